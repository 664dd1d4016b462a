"""The chat-template sandbox, with a bound on the size of every value a template builds.

A template (a request's, where the deployment allows them) is untrusted code. The render
timer interrupts Python bytecode and the output cap counts text once it exists, but neither
can stop one allocation inside C: ``{% set x = 'a' * 200000000 %}`` takes ~780 MB at once.
So every operation whose result can be much larger than its operands is sized *before* it
runs, and refused past the render's limit (``value_limit``): the operators ``*``, ``+``,
``**``, ``%`` and ``~``, the ``str`` methods that pad, repeat, join, split or format, the
filters that do the same (``center``, ``indent``, ``wordwrap``, ``join``, ``replace``,
``format``, ``tojson``, ``batch``, ``slice``, ``list``, ``string``, ``pprint``), ``lipsum``,
and every ``{{ ... }}`` (a list holding one big string many times prints as all of them).
Sizes are estimates in bytes (UTF-8 for text, a pointer per list item), within a small
factor of what Python allocates. Loops that keep many values alive stay bounded by time.
Everything else behaves exactly as in jinja2's ``ImmutableSandboxedEnvironment``, which
transformers renders with, so rendered prompts stay byte-identical.
"""

from __future__ import annotations

import contextlib
import functools
import re
import string
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import jinja2.nodes
import jinja2.utils
from jinja2.compiler import CodeGenerator, Frame
from jinja2.runtime import Context
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["TemplateSandbox", "ValueTooLarge", "value_limit"]

DEFAULT_LIMIT = 16 << 20  # bytes; a render sets its own (at least this)
INT_BITS = 1 << 16  # larger integers take C time the timer cannot interrupt
_ITEM = 8  # bytes per list item (a pointer)
_PIECE = 56  # bytes per string a split creates (object header + a short text)

_LIMIT: ContextVar[int] = ContextVar("template_value_limit", default=DEFAULT_LIMIT)


class ValueTooLarge(Exception):
    """A template operation would build a value past the render's limit."""


@contextlib.contextmanager
def value_limit(limit: int) -> Iterator[None]:
    """Bound every value a template builds while rendering in this block."""
    token = _LIMIT.set(limit)
    try:
        yield
    finally:
        _LIMIT.reset(token)


def _check(size: int, what: str) -> None:
    limit = _LIMIT.get()
    if size > limit:
        raise ValueTooLarge(f"{what} would build a value of about {size} bytes, more than the "
                            f"{limit} one template value may hold")


def _text(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8", "surrogatepass"))


def _sized(value: Any) -> int:
    """Bytes of a string or of a sequence's item pointers (what ``*`` and ``+`` copy)."""
    return _text(value) if isinstance(value, str) else _ITEM * len(value)


def text_size(value: Any, indent: int = 0) -> int:
    """About how many bytes ``str(value)`` (or its JSON, with ``indent``) takes; counting
    stops once past the limit. A value held several times counts each time, as it prints."""
    stop = _LIMIT.get()
    total = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack and total <= stop:
        item, depth = stack.pop()
        total += indent * depth
        if isinstance(item, str):
            total += _text(item) + 2
        elif isinstance(item, bool) or item is None or isinstance(item, float):
            total += 8
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, jinja2.utils.Namespace):
            stack.append((item._Namespace__attrs, depth))  # noqa: SLF001 - what its repr prints
        elif isinstance(item, Mapping):
            total += 4 * len(item) + 2
            stack.extend((x, depth + 1) for pair in item.items() for x in pair)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 * len(item) + 2
            stack.extend((x, depth + 1) for x in item)
        else:
            total += 64
    return total


_PRINTF = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_SPEC = re.compile(r"(\d+)?[,_]?(?:\.(\d+))?[a-zA-Z%]?$")


def _widest(values: Any) -> int:
    """The largest int among ``values`` (a ``*`` or nested width may be any of them)."""
    items = values.values() if isinstance(values, Mapping) else values
    return max((v for v in items if isinstance(v, int)), default=0)


def _printf_size(fmt: str, args: Any) -> int:
    """``fmt % args``: the format, every width and precision, and the arguments' text."""
    size = _text(fmt) + text_size(args)
    for width, precision in _PRINTF.findall(fmt):
        for n in (width, precision):
            size += _widest(args if isinstance(args, (tuple, Mapping)) else (args,)) \
                if n == "*" else int(n or 0)
    return size


def _format_size(fmt: str, args: tuple, kwargs: Mapping) -> int:
    """``fmt.format(*args, **kwargs)``: as ``_printf_size``, for format specs."""
    size = _text(fmt) + text_size(args) + text_size(dict(kwargs))
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return size  # Python refuses it anyway
    for _, field, spec, _ in fields:
        if field is None or not spec:
            continue
        if "{" in spec:  # a width taken from the arguments
            size += max(_widest(args), _widest(kwargs))
            continue
        m = _SPEC.search(spec)
        size += int(m.group(1) or 0) + int(m.group(2) or 0) if m else 0
    return size


def _binop_size(op: str, left: Any, right: Any) -> tuple[int, str] | None:
    """(bytes or bits, unit) of ``left op right`` where it can be far larger than both."""
    if op == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                return _sized(seq) * max(n, 0), "bytes"
        if isinstance(left, int) and isinstance(right, int):
            return left.bit_length() + right.bit_length(), "bits"
    elif op == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, type(left)):
            return _sized(left) + _sized(right), "bytes"
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            return left.bit_length() * right, "bits"
    elif op == "%" and isinstance(left, str):
        return _printf_size(left, right), "bytes"
    return None


def _check_binop(op: str, left: Any, right: Any) -> None:
    got = _binop_size(op, left, right)
    if got is None:
        return
    size, unit = got
    if unit == "bits":
        if size > INT_BITS:
            raise ValueTooLarge(f"`{op}` would build an integer of about {size} bits, more "
                                f"than the {INT_BITS} a template may use")
        return
    _check(size, f"`{op}`")


def _split_size(s: str, sep: Any) -> int:
    pieces = (s.count(sep) if isinstance(sep, str) and sep else len(s) // 2) + 1
    return _text(s) + _PIECE * pieces


def _join_size(sep: str, items: list) -> int:
    return sum(text_size(x) for x in items) + _text(sep) * max(len(items) - 1, 0)


def _replace_size(s: str, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return _text(s)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return _text(s) + hits * max(_text(new) - _text(old), 0)


def _width(args: tuple, kwargs: Mapping, at: int, name: str, default: int = 0) -> int:
    value = args[at] if len(args) > at else kwargs.get(name, default)
    return value if isinstance(value, int) else 0


# str methods that can build far more than the string: bytes before they run
_STR_METHODS: dict[str, Callable[[str, tuple, Mapping], int]] = {
    "center": lambda s, a, k: max(_text(s), 4 * _width(a, k, 0, "width")),
    "ljust": lambda s, a, k: max(_text(s), 4 * _width(a, k, 0, "width")),
    "rjust": lambda s, a, k: max(_text(s), 4 * _width(a, k, 0, "width")),
    "zfill": lambda s, a, k: max(_text(s), _width(a, k, 0, "width")),
    "expandtabs": lambda s, a, k: _text(s) + s.count("\t") * _width(a, k, 0, "tabsize", 8),
    "replace": lambda s, a, k: _replace_size(s, a[0] if a else None, a[1] if len(a) > 1 else None,
                                             a[2] if len(a) > 2 else k.get("count", -1)),
    "split": lambda s, a, k: _split_size(s, a[0] if a else k.get("sep")),
    "rsplit": lambda s, a, k: _split_size(s, a[0] if a else k.get("sep")),
    "splitlines": lambda s, a, k: _split_size(s, "\n"),
    "translate": lambda s, a, k: _text(s) * max(
        [len(v) for v in (a[0].values() if a and isinstance(a[0], Mapping) else ())
         if isinstance(v, str)] + [1]),
}


def _guard_filter(env: TemplateSandbox, name: str,
                  size: Callable[[Any, tuple, Mapping], int]) -> None:
    """Size the filter's result from its input and arguments before it runs (the
    environment / eval-context argument some filters take first is passed through)."""
    inner = env.filters[name]
    skip = 1 if getattr(inner, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(inner)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        args = list(args)
        if len(args) > skip and name in ("join", "batch", "slice") and not isinstance(
                args[skip], (list, tuple, str)):
            args[skip] = list(args[skip])  # sized once, then handed on
        if len(args) > skip:
            _check(size(args[skip], tuple(args[skip + 1:]), kwargs), f"the `{name}` filter")
        return inner(*args, **kwargs)

    env.filters[name] = guarded


def _length(value: Any) -> int:
    return len(value) if hasattr(value, "__len__") else 0


def _lines(value: Any) -> int:
    return value.count("\n") + 1 if isinstance(value, str) else 1


def _indent_width(args: tuple, kwargs: Mapping) -> int:
    width = args[0] if args else kwargs.get("width", 4)
    if isinstance(width, str):
        return _text(width)
    return width if isinstance(width, int) else 0


def _filter_join_size(value: Any, args: tuple, kwargs: Mapping) -> int:
    sep = args[0] if args else kwargs.get("d", "")
    sep = sep if isinstance(sep, str) else str(sep)
    if isinstance(value, str):  # joins its characters
        return _text(value) + _text(sep) * max(len(value) - 1, 0)
    return _join_size(sep, list(value))


def _filter_replace_size(value: Any, args: tuple, kwargs: Mapping) -> int:
    old = args[0] if args else kwargs.get("old")
    new = args[1] if len(args) > 1 else kwargs.get("new")
    count = args[2] if len(args) > 2 else kwargs.get("count")
    if isinstance(value, str):
        return _replace_size(value, old, new, count)
    size = text_size(value)  # replaces in its text: at most every character, once each
    return size + size * max(_text(str(new)) - 1, 0) if size <= _LIMIT.get() else size


def _wordwrap_size(value: Any, args: tuple, kwargs: Mapping) -> int:
    wrap = (args[2] if len(args) > 2 else kwargs.get("wrapstring")) or "\n"
    size = text_size(value)
    width = max(_width(args, kwargs, 0, "width", 79), 1)
    return size + _text(str(wrap)) * (size // width + _lines(value))


# The filters that can build far more than their input: bytes before they run (a value
# that is no string is sized as its text first: the filter converts it).
_FILTERS: dict[str, Callable[[Any, tuple, Mapping], int]] = {
    "center": lambda v, a, k: max(text_size(v), _width(a, k, 0, "width", 80)),
    "indent": lambda v, a, k: text_size(v) + _lines(v) * _indent_width(a, k),
    "wordwrap": _wordwrap_size,
    "join": _filter_join_size,
    "replace": _filter_replace_size,
    "format": lambda v, a, k: (_printf_size(v, dict(k) if k else a) if isinstance(v, str)
                               else text_size(v)),
    "tojson": lambda v, a, k: (6 if (a[0] if a else k.get("ensure_ascii")) else 2) * text_size(
        v, _json_indent(a[1] if len(a) > 1 else k.get("indent"))),
    "batch": lambda v, a, k: _ITEM * (_length(v) + _width(a, k, 0, "linecount")),
    "slice": lambda v, a, k: _ITEM * _length(v) + 64 * _width(a, k, 0, "slices"),
    "list": lambda v, a, k: (_PIECE if isinstance(v, str) else _ITEM) * _length(v),
    "string": lambda v, a, k: text_size(v),
    "pprint": lambda v, a, k: 2 * text_size(v),
}


def _json_indent(indent: Any) -> int:
    if isinstance(indent, str):
        return _text(indent) + 1
    return indent + 1 if isinstance(indent, int) and indent > 0 else 1


class _BoundedCodeGenerator(CodeGenerator):
    """``a ~ b`` goes through the environment, which sizes it first (jinja compiles it to
    a plain join otherwise)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class TemplateSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, with every size-amplifying operation checked first.
    ``filters``: the caller's own (HF's ``tojson``), guarded like jinja's."""

    intercepted_binops = frozenset({"*", "+", "**", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, filters: Mapping[str, Callable] = {}, **options: Any) -> None:  # noqa: B006
        super().__init__(finalize=self._finalize, **options)
        self.filters.update(filters)
        for name, size in _FILTERS.items():
            if name in self.filters:
                _guard_filter(self, name, size)
        lipsum = self.globals["lipsum"]

        def bounded_lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:
            _check(12 * n * max if isinstance(n, int) and isinstance(max, int) else 0,
                   "`lipsum`")
            return lipsum(n, html, min, max)

        self.globals["lipsum"] = bounded_lipsum

    @staticmethod
    def _finalize(value: Any) -> Any:
        if not isinstance(value, str):
            _check(text_size(value), "`{{ ... }}`")
        return value

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        _check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def bounded_join(self, values: tuple) -> str:
        _check(sum(text_size(v) if not isinstance(v, str) else _text(v) for v in values),
               "`~`")
        return "".join(map(str, values))

    def call(__self, __context: Context, __obj: Any, *args: Any,  # noqa: N805 - jinja's trick
             **kwargs: Any) -> Any:
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name == "join" and args and not isinstance(args[0], (list, tuple, str)):
                args = (list(args[0]), *args[1:])
            if name == "join" and args:
                _check(_join_size(owner, list(args[0])), "`str.join`")
            elif name in _STR_METHODS:
                _check(_STR_METHODS[name](owner, args, kwargs), f"`str.{name}`")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        inner = super().wrap_str_format(value)
        if inner is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        def checked(*args: Any, **kwargs: Any) -> str:
            mapping = args[0] if is_map and args and isinstance(args[0], Mapping) else {}
            _check(_format_size(fmt, () if is_map else args, mapping or kwargs),
                   f"`str.{value.__name__}`")
            return inner(*args, **kwargs)

        return checked
