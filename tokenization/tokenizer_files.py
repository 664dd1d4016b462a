"""Load a Hugging Face checkpoint's tokenizer and chat template(s) without transformers.

The worker must tokenize exactly like ``AutoTokenizer.from_pretrained(dir)`` (transformers 5.x, ``TokenizersBackend``)
while importing only ``tokenizers`` and ``jinja2``. What transformers does on top of ``tokenizer.json``, mirrored here:

* ``add_bos_token``/``add_eos_token`` in ``tokenizer_config.json`` are ignored when ``tokenizer.json`` exists: the
  post-processor stored in ``tokenizer.json`` alone decides what ``add_special_tokens=True`` adds;
* the ``added_tokens_decoder`` of the config and the named special tokens are (re-)added to the backend, so a token
  declared only in the config still exists (with the config's flags);
* padding/truncation stored in ``tokenizer.json`` are switched off (plain ``tok(text)`` never pads or truncates);
* ``special_tokens_map`` = bos/eos/unk/sep/pad/cls/mask plus model-specific ``*_token`` entries; it is what HF passes
  into the chat template;
* chat templates: ``chat_template.jinja`` (+ ``additional_chat_templates/*.jinja``) take priority over
  ``tokenizer_config.json``'s ``chat_template`` (a string or a list of named templates); ``chat_template.json``
  (the processor format, which AutoTokenizer itself does not read) is the last fallback.

Not mirrored: model-specific tokenizer classes that transformers rebuilds from vocab/merges instead of using
``tokenizer.json`` as is, the Mistral regex patch, slow (sentencepiece/tiktoken-only) checkpoints.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from tokenization.chat_template import ChatTemplate, ChatTemplateError

__all__ = ["CheckpointTokenizer", "NAMED_SPECIAL_TOKENS"]

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    """A special-token entry is a string or a serialized AddedToken dict; return its text."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(value: Any, *, default_special: bool) -> AddedToken | None:
    content = _token_content(value)
    if content is None:
        return None
    if isinstance(value, Mapping):
        flags = {k: bool(value[k]) for k in _ADDED_TOKEN_FLAGS if k in value}
        flags.setdefault("special", default_special)
        return AddedToken(content, **flags)
    return AddedToken(content, special=default_special)


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


class CheckpointTokenizer:
    """The tokenizer, special tokens, stop ids and chat templates of one checkpoint directory.

    ``now`` is the clock given to every chat template (``strftime_now``), injectable for tests.
    """

    def __init__(self, directory: str | Path, *, now: Callable[[], datetime] = datetime.now) -> None:
        self.directory = Path(directory)
        self._now = now
        tokenizer_json = self.directory / "tokenizer.json"
        if not tokenizer_json.is_file():
            raise FileNotFoundError(f"{tokenizer_json} not found (only fast tokenizers are supported)")
        config = _read_json(self.directory / "tokenizer_config.json")
        if "added_tokens_decoder" not in config:  # legacy checkpoints keep special tokens in special_tokens_map.json
            config = {**config, **_read_json(self.directory / "special_tokens_map.json")}

        self.backend = Tokenizer.from_file(str(tokenizer_json))
        self.backend.no_padding()
        self.backend.no_truncation()
        self.backend.encode_special_tokens = bool(config.get("split_special_tokens", False))
        self._clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and (
            self.backend.model.__class__.__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        )

        named, extra = self._special_tokens(config)
        self._register_added_tokens(config, named, extra)
        self.special_tokens_map: dict[str, str] = {name: tok.content for name, tok in named.items()}
        specials = list(dict.fromkeys([t.content for t in named.values()] + [t.content for t in extra]))
        self.all_special_ids: list[int] = [i for i in map(self._token_id, specials) if i is not None]
        self.eos_token_ids: list[int] = self._eos_token_ids()
        self._chat_templates: dict[str, ChatTemplate] = self._load_chat_templates(config)

    # --- loading -------------------------------------------------------------------------------------------------

    @staticmethod
    def _special_tokens(config: Mapping[str, Any]) -> tuple[dict[str, AddedToken], list[AddedToken]]:
        """Named special tokens (standard ones first, then model-specific ``*_token`` keys) and extra ones."""
        named: dict[str, AddedToken] = {}
        for key in NAMED_SPECIAL_TOKENS:
            token = _added_token(config.get(key), default_special=True)
            if token is not None:
                named[key] = token
        # transformers registers serialized-AddedToken entries before plain-string ones; keep its order.
        custom = [k for k in config if k.endswith("_token") and k not in NAMED_SPECIAL_TOKENS]
        for key in sorted(custom, key=lambda k: isinstance(config[k], str)):
            token = _added_token(config[key], default_special=True)
            if token is not None:
                named[key] = token
        extra_cfg = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        extra: list[AddedToken] = []
        if isinstance(extra_cfg, Mapping):  # a dict of extra *named* tokens
            for key, value in extra_cfg.items():
                token = _added_token(value, default_special=True)
                if token is not None:
                    named[key] = token
        elif isinstance(extra_cfg, list):
            extra = [t for t in (_added_token(v, default_special=True) for v in extra_cfg) if t is not None]
        return named, extra

    def _register_added_tokens(self, config: Mapping[str, Any], named: dict[str, AddedToken],
                               extra: list[AddedToken]) -> None:
        """Re-add the config's added tokens, then any special token the backend does not know yet (as HF does)."""
        declared = config.get("added_tokens_decoder") or {}
        by_content: dict[str, AddedToken] = {}
        to_add: list[AddedToken] = []
        for _, value in sorted(declared.items(), key=lambda kv: int(kv[0])):
            token = _added_token(value, default_special=False)
            if token is not None:
                to_add.append(token)
                by_content[token.content] = token
        # A named token that is also an added token is that AddedToken (with its flags), forced special.
        for key, token in list(named.items()):
            known = by_content.get(token.content)
            named[key] = known if known is not None else token
        existing = {t.content for t in self.backend.get_added_tokens_decoder().values()} | set(by_content)
        for token in [*named.values(), *extra]:
            if token.content not in existing:
                to_add.append(token)
                existing.add(token.content)
        named_contents = {t.content for t in named.values()}
        for token in to_add:
            if token.content in named_contents and not token.special:
                token.special = True
        if to_add:
            self.backend.add_tokens(to_add)

    def _eos_token_ids(self) -> list[int]:
        """Stop ids: generation_config.json's eos (config.json's when absent) plus the tokenizer's eos token."""
        gen = _read_json(self.directory / "generation_config.json")
        if "eos_token_id" in gen:
            ids = _ids(gen["eos_token_id"])
        else:
            model_cfg = _read_json(self.directory / "config.json")
            ids = _ids(model_cfg.get("eos_token_id")) or _ids((model_cfg.get("text_config") or {}).get("eos_token_id"))
        eos = self.special_tokens_map.get("eos_token")
        eos_id = self._token_id(eos) if eos is not None else None
        if eos_id is not None:
            ids.append(eos_id)
        return list(dict.fromkeys(ids))

    def _load_chat_templates(self, config: Mapping[str, Any]) -> dict[str, ChatTemplate]:
        def make(source: str, origin: str) -> ChatTemplate:
            return ChatTemplate(source, origin=origin, now=self._now)

        templates: dict[str, ChatTemplate] = {}
        default_file = self.directory / "chat_template.jinja"
        if default_file.is_file():
            templates["default"] = make(default_file.read_text(encoding="utf-8"), "checkpoint:chat_template.jinja")
        extra_dir = self.directory / "additional_chat_templates"
        if extra_dir.is_dir():
            for path in sorted(extra_dir.glob("*.jinja")):
                templates[path.stem] = make(path.read_text(encoding="utf-8"),
                                            f"checkpoint:additional_chat_templates/{path.name}")
        if templates:
            return templates
        configured = config.get("chat_template")
        if isinstance(configured, str):
            return {"default": make(configured, "checkpoint:tokenizer_config.json")}
        if isinstance(configured, list):
            return {
                entry["name"]: make(entry["template"], f"checkpoint:tokenizer_config.json[{entry['name']}]")
                for entry in configured
                if isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
            }
        legacy = _read_json(self.directory / "chat_template.json").get("chat_template")
        if isinstance(legacy, str):
            return {"default": make(legacy, "checkpoint:chat_template.json")}
        return {}

    # --- tokenization --------------------------------------------------------------------------------------------

    def _token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids including added tokens (``len(AutoTokenizer)``), not the model's embedding rows."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies tokenizer.json's post-processor (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return self._clean_up_tokenization(text) if self._clean_up_spaces else text

    @staticmethod
    def _clean_up_tokenization(text: str) -> str:
        """transformers' legacy WordPiece-era space clean-up, used only when the config asks for it."""
        for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                              (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
            text = text.replace(before, after)
        return text

    # --- chat ----------------------------------------------------------------------------------------------------

    def chat_template(self, tools_present: bool) -> ChatTemplate | None:
        """The template HF would pick: ``tool_use`` when tools are passed and it exists, else ``default``.

        ``None`` when the checkpoint has no template; ``ChatTemplateError`` when it has several but no default.
        """
        templates = self._chat_templates
        if not templates:
            return None
        if tools_present and "tool_use" in templates:
            return templates["tool_use"]
        if "default" in templates:
            return templates["default"]
        raise ChatTemplateError(f"checkpoint has chat templates {sorted(templates)} but none named 'default'")

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        /,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        chat_template: ChatTemplate | None = None,
        **kwargs: Any,
    ) -> tuple[str, ChatTemplate]:
        """Render a conversation with ``chat_template`` (an override) or the checkpoint's template.

        Tokenize the result with ``encode(text, add_special_tokens=False)``: the template already writes BOS.
        """
        template = chat_template if chat_template is not None else self.chat_template(tools is not None)
        if template is None:
            raise ChatTemplateError("this model has no chat template; pass one with --chat-template or in the request")
        text = template.render(
            messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens_map, continue_final_message=continue_final_message, **kwargs,
        )
        return text, template
