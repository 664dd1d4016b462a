"""No import cycle anywhere in the project, and no import runs back up the floors.

A cycle makes the import order matter (a module half-initialised when its partner reads
it) and hides which of two modules owns what; the flashinfer backend importing back from
the attention module that selected it was one. Every ``import`` counts, those inside
functions too: a lazy import postpones the cycle, it does not remove it.

The floors, bottom up: ``protocol`` (the wire contract) imports nothing of ours;
``cluster`` (what every role reads) only ``protocol``; ``tokenization`` (tokenizer files
and templates, read alike by several roles) those two; a role (a process: frontend,
tokenizer worker, scheduler, worker, detokenizer, KV store) those three and never another
role, which it reaches only through messages; ``launcher`` and ``launch_cluster`` anything
shipped but ``bench``. ``bench`` and ``tests`` stand outside the floors.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.server import REPO

ROLES = ("api_frontend", "tokenizer_worker", "scheduler", "gpu_worker", "detokenizer", "kv_store")
SHIPPED = ("protocol", "cluster", "tokenization", *ROLES, "launcher", "launch_cluster")
# what each package may import besides itself
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "cluster": {"protocol"},
    "tokenization": {"protocol", "cluster"},
    **{role: {"protocol", "cluster", "tokenization"} for role in ROLES},
    "launcher": set(SHIPPED),
    "launch_cluster": set(SHIPPED),
}

def _modules() -> dict[str, Path]:
    out = {"launch_cluster": REPO / "launch_cluster.py"}
    for top in sorted(p.parent.name for p in REPO.glob("*/__init__.py")):
        for path in (REPO / top).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports: ``import a.b`` -> a.b; ``from a import b`` ->
    a.b where that is a module, else a (the name is read from a's ``__init__``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    out.add(target)
                elif base in modules:
                    out.add(base)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 200  # the parser found the project's imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import from a package to one its floor does not allow, as 'a.b -> c.d'."""
    bad = []
    for name, targets in sorted(graph.items()):
        top = name.split(".")[0]
        if top not in ALLOWED:
            continue  # bench, tests
        for target in sorted(targets):
            other = target.split(".")[0]
            if other != top and other not in ALLOWED[top]:
                bad.append(f"{name} -> {target}")
    return bad


def test_imports_run_down_the_floors():
    modules = _modules()
    assert {name.split(".")[0] for name in modules} >= set(SHIPPED) | {"bench", "tests"}
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    # the floors are really crossed downwards (the check reads real edges)
    tops = {(n.split(".")[0], t.split(".")[0]) for n, ts in graph.items() for t in ts}
    assert {("cluster", "protocol"), ("scheduler", "cluster"), ("launcher", "gpu_worker"),
            ("launch_cluster", "launcher")} <= tops
    assert _upward(graph) == []


def test_the_floor_check_names_an_upward_import():
    graph = {"protocol.transport": {"cluster.topology"}, "cluster.topology": {"protocol.ipc"},
             "scheduler.loop": {"gpu_worker.sampler", "cluster.metrics"},
             "gpu_worker.runner": {"launcher.supervisor"}, "bench.x": {"tests.y"}}
    assert _upward(graph) == ["gpu_worker.runner -> launcher.supervisor",
                              "protocol.transport -> cluster.topology",
                              "scheduler.loop -> gpu_worker.sampler"]
