"""Renders ``docs/fields.md``: each endpoint's field table (``endpoints/*/fields.py``: the
tiers the server acts on) joined with its prose (``docs/fields/*.yaml``: what Candor does,
what vLLM and SGLang do, the tests that show it) and the request limits
(``RequestLimits``), so the page cannot drift from what the server does.

``docs/fields/page.yaml`` holds the page's head and tail and names its sections in order;
a section file names the endpoints whose tiers are its columns and holds one entry per row
(found by its ``fields``, or by its ``key`` where the code derives them; an entry with only
a ``label`` is a behaviour no field names). A row without prose, or prose without a row,
is an error naming it. ``python -m api_frontend.fields_doc`` rewrites the page;
``tests/unit/api_frontend/test_fields_doc.py`` fails when the checked-in page differs
from ``render()``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import msgspec
import yaml

from api_frontend.endpoints.registry import ENDPOINTS
from api_frontend.field_policy import TIER_MEANINGS, UNKNOWN, FieldTable, Foreign, Row
from cluster.topology import RequestLimits

DOCS = Path(__file__).resolve().parent.parent / "docs"
PATH = DOCS / "fields.md"
DATA = DOCS / "fields"
COMMAND = "python -m api_frontend.fields_doc"


class DocDrift(ValueError):
    """The prose and the code's rows do not match one to one."""


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DATA / f"{name}.yaml").read_text(encoding="utf-8"))


def tables() -> dict[str, FieldTable]:
    """Every endpoint's field table, by its name (the column it is in the page)."""
    return {ep.fields.name: ep.fields for ep in ENDPOINTS}


def _key(row: Row) -> str:
    return row.key or ", ".join(row.fields)


def _entry_key(entry: dict[str, Any]) -> str | None:
    if "key" in entry:
        return entry["key"]
    return ", ".join(entry["fields"]) if "fields" in entry else None


def _code(value: object) -> str:
    return f"`{msgspec.json.encode(value).decode()}`"


def _foreign(spec: Foreign) -> str:
    what = spec.tier
    if spec.harmless:
        what += f" (ignored and reported when {' or '.join(map(_code, spec.harmless))})"
    return f"| `{spec.field}` | {what} | {spec.reason} |"


def _joined(name: str, section: dict[str, Any],
            columns: list[FieldTable]) -> list[tuple[dict[str, Any], list[Row | None]]]:
    """Each prose entry with the row it documents in each column (None: not a field
    there); every row of every column is documented exactly once."""
    by_key = [{_key(row): row for row in table.rows} for table in columns]
    out, seen = [], set()
    for entry in section["rows"]:
        key = _entry_key(entry)
        if key is None:  # a behaviour, no fields: no tier anywhere
            out.append((entry, [None] * len(columns)))
            continue
        if key in seen:
            raise DocDrift(f"docs/fields/{name}.yaml documents {key!r} twice")
        seen.add(key)
        rows = [table.get(key) for table in by_key]
        if not any(rows):
            raise DocDrift(f"docs/fields/{name}.yaml documents {key!r}, which no table of "
                           f"{[t.name for t in columns]} has")
        out.append((entry, rows))
    for table, keys in zip(columns, by_key):
        missing = [k for k in keys if k not in seen]
        if missing:
            raise DocDrift(f"{table.name}: rows {missing} have no prose in "
                           f"docs/fields/{name}.yaml")
    return out


def _label(entry: dict[str, Any], rows: list[Row | None]) -> str:
    if "label" in entry:
        return entry["label"]
    fields = next(row for row in rows if row is not None).fields
    return ", ".join(f"`{f}`" for f in fields)


def _table(name: str, section: dict[str, Any], all_tables: dict[str, FieldTable]) -> list[str]:
    columns = [all_tables[c] for c in section["columns"]]
    compare = section["compare"]
    tier_heads = [t.name for t in columns] if len(columns) > 1 else ["tier"]
    heads = ["field", *tier_heads, "Candor", *compare, "test"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for entry, rows in _joined(name, section, columns):
        cells = [_label(entry, rows), *(row.tier if row else "—" for row in rows),
                 entry["candor"], *(entry.get(c.lower(), "—") for c in compare),
                 entry.get("tests", "")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _foreign_table(section: dict[str, Any], all_tables: dict[str, FieldTable]) -> list[str]:
    spec = section["foreign"]
    owns = [all_tables[c].own_foreign for c in section["columns"]]
    if any(own != owns[0] for own in owns):
        raise DocDrift(f"the columns {section['columns']} name different foreign fields")
    return [spec["caption"], f"| field | {spec['header']} | why |", "|---|---|---|",
            *map(_foreign, owns[0]), ""]


def route_fields() -> list[dict[str, Any]]:
    """The body fields of the management routes (LoRA adapters), as documented."""
    return _load("lora_routes")["route_fields"]


def _route_table(section: dict[str, Any]) -> list[str]:
    lines = ["| route | field | Candor | vLLM | test |", "|---|---|---|---|---|"]
    for f in section["route_fields"]:
        lines.append(f"| `{f['route']}` | `{f['field']}` | {f['candor']} | "
                     f"{f.get('vllm', 'same')} | {f.get('tests', '')} |")
    return lines


def _fill(text: str, values: dict[str, str]) -> str:
    """``{tiers}``, ``{limits}``, ``{unknown}`` filled in; other braces (``{id}``) kept."""
    for name, value in values.items():
        text = text.replace("{" + name + "}", value)
    return text


def render() -> str:
    """The whole text of ``docs/fields.md``."""
    page = _load("page")
    values = {
        "tiers": ", ".join(f"**{t}** ({meaning})" for t, meaning in TIER_MEANINGS.items()),
        "limits": ", ".join(f"`{name}` {value}" for name, value in
                            msgspec.structs.asdict(RequestLimits()).items()),
        "unknown": f"`{UNKNOWN}`",
    }
    all_tables = tables()
    shown = set()
    lines = [f"# {page['title']}", "",
             f"<!-- Generated from the field tables (api_frontend/endpoints/*/fields.py, "
             f"api_frontend/generation_fields.py) and their prose (docs/fields/*.yaml) "
             f"by `{COMMAND}`; edit those, not this file. -->", "",
             _fill(page["intro"], values)]
    for name in page["sections"]:
        section = _load(name)
        lines.append(_fill(section["intro"], values))
        if "rows" in section:
            lines += [*_table(name, section, all_tables), ""]
            shown.update(section["columns"])
        if "foreign" in section:
            lines += _foreign_table(section, all_tables)
        if "route_fields" in section:
            lines += [*_route_table(section), ""]
    undocumented = sorted(set(all_tables) - shown)
    if undocumented:
        raise DocDrift(f"endpoints {undocumented} have no section in docs/fields/page.yaml")
    lines.append(_fill(page["outro"], values))
    return "\n".join(lines)


def main() -> None:
    PATH.write_text(render())
    print(f"wrote {PATH}", file=sys.stderr)


if __name__ == "__main__":
    main()
