"""The chat-template sandbox sizes every value a template builds before building it
(tokenizer_worker/template_sandbox.py): one expression can no longer allocate without bound,
which neither the render timer (it cannot interrupt C) nor the output cap (it sees text only
once it exists) could stop. Rendering real templates is unchanged (test_chat_templates.py)."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from tokenization.chat_template import ChatTemplate, ChatTemplateError
from tokenization.template_sandbox import DEFAULT_LIMIT

MESSAGES = [{"role": "user", "content": "hi"}]
BIG = 200_000_000  # the 'a' * 200000000

ATTACKS = [
    "{% set x = 'a' * 200000000 %}{{ x | length }}",
    "{% set x = 200000000 * 'a' %}",
    "{% set x = [0] * 200000000 %}",
    "{% set x = 'ab' * 6000000 %}{% set y = x + x %}{% set z = y + y %}",
    "{% set x = 'ab' * 6000000 %}{% set y = x ~ x ~ x %}",
    "{% set ns = namespace(s='a' * 1000000) %}{% for i in range(100) %}"
    "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ ['a' * 1000000] * 1000 }}",
    "{% set x = ['a' * 1000000] * 1000 %}{{ x | join(',') }}",
    "{% set x = ['a' * 1000000] * 1000 %}{{ ','.join(x) }}",
    "{% set x = ['a' * 1000000] * 1000 %}{{ x | tojson }}",
    "{% set x = ['a' * 1000000] * 1000 %}{{ x | string }}",
    "{{ 10 ** 100000000 }}",
    "{% set x = 2 ** 60000 %}{{ x * x * x }}",
    "{{ (2 ** 60000) ** 3 }}",
    "{{ '%300000000d' % 1 }}",
    "{{ '%*d' % (300000000, 1) }}",
    "{{ '{:>300000000}'.format(1) }}",
    "{{ '{:>{w}}'.format(1, w=300000000) }}",
    "{{ '{x:>300000000}'.format_map({'x': 1}) }}",
    "{{ 'x'.ljust(300000000) }}",
    "{{ 'x'.center(300000000) }}",
    "{{ 'x'.zfill(300000000) }}",
    "{{ ('\t' * 1000).expandtabs(1000000) }}",
    "{{ ('a' * 1000).replace('a', 'b' * 1000000) }}",
    "{{ ('a' * 10000).replace('', 'b' * 100000) }}",
    "{{ ('a b ' * 4000000).split() | length }}",
    "{{ 'x' | center(300000000) }}",
    "{{ ('x\n' * 100000) | indent(100000) }}",
    "{{ ('a' * 1000000) | wordwrap(1, wrapstring='b' * 1000) }}",
    "{{ ('a' * 10000) | replace('a', 'b' * 100000) }}",
    "{{ '%300000000d' | format(1) }}",
    "{{ [1] | batch(300000000, 0) | list }}",
    "{{ [1] | slice(300000000) | list }}",
    "{{ ('a' * 10000000) | list | length }}",
    "{{ lipsum(10000000) }}",
    "{{ (['a' * 1000000] * 10) | tojson(indent=100000000) }}",
]


@pytest.mark.parametrize("source", ATTACKS)
def test_one_expression_cannot_allocate_past_the_limit(source):
    template = ChatTemplate(source, origin="request")
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ChatTemplateError) as err:
            template.render(MESSAGES, special_tokens={}, max_output_bytes=4096)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert err.value.limit == "value", err.value
    assert "bytes" in str(err.value) or "bits" in str(err.value)
    assert time.monotonic() - started < 2
    assert peak < 3 * DEFAULT_LIMIT, peak


def test_values_up_to_the_limit_are_built_and_the_limit_follows_the_context():
    """16 MiB, or the render's output cap when that is larger: a value that may end up in
    the prompt is never refused."""
    template = ChatTemplate("{{ ('a' * n) | length }}", origin="t")
    under = DEFAULT_LIMIT - 1
    assert template.render(MESSAGES, special_tokens={}, n=under) == str(under)
    with pytest.raises(ChatTemplateError):
        template.render(MESSAGES, special_tokens={}, n=DEFAULT_LIMIT + 1)
    assert template.render(MESSAGES, special_tokens={}, n=DEFAULT_LIMIT + 1,
                           max_output_bytes=2 * DEFAULT_LIMIT) == str(DEFAULT_LIMIT + 1)


@pytest.mark.parametrize("source,expected", [
    ("{{ 'ab' * 3 }}|{{ [1, 2] * 2 }}|{{ 'a' + 'b' }}|{{ 'a' ~ 1 ~ none }}|{{ 2 ** 10 }}",
     "ababab|[1, 2, 1, 2]|ab|a1None|1024"),
    ("{{ '%05d|%s' % (42, 'x') }}|{{ '{:>4}'.format(7) }}|{{ 'x'.center(5) }}|",
     "00042|x|   7|  x  |"),
    ("{{ ['a', 'b'] | join(', ') }}|{{ 'a\nb' | indent(2, true) }}|{{ {'k': [1]} | tojson }}",
     "a, b|  a\n  b|{\"k\": [1]}"),
    ("{{ range(3) | batch(2, 0) | list }}|{{ 'ab' | list }}|{{ 'a b'.split() }}",
     "[[0, 1], [2, 0]]|['a', 'b']|['a', 'b']"),
])
def test_ordinary_expressions_render_as_jinja_does(source, expected):
    assert ChatTemplate(source, origin="t").render(MESSAGES, special_tokens={}) == expected
