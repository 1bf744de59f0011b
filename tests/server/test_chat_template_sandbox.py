"""Chat templates run in jinja2's immutable sandbox: a hostile template (as a model repository
could ship) cannot reach Python internals, mutate the request, or exhaust memory, and what a
client writes in its messages is data, never template code."""

from __future__ import annotations

import httpx
import jinja2.exceptions
import pytest

from atom_runtime.text.tokenizer import Tokenizer

MESSAGES = [{"role": "user", "content": "Hi"}]

HOSTILE = {
    "class walk to subclasses": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals of a builtin to os": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "mutate the messages": "{% set _ = messages.append({'role': 'system'}) %}{{ messages }}",
    "huge range": "{% for i in range(10 ** 9) %}x{% endfor %}",
}


@pytest.fixture(scope="module")
def tokenizer(tiny_models) -> Tokenizer:
    return Tokenizer.from_path(tiny_models["llama"])


@pytest.mark.parametrize("template", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_templates_are_stopped(tokenizer, template):
    tokenizer.chat_template, tokenizer._template = template, None
    messages = [dict(m) for m in MESSAGES]
    with pytest.raises((jinja2.exceptions.SecurityError, OverflowError)):
        tokenizer.apply_chat_template(messages)
    assert messages == MESSAGES  # nothing was changed


def test_message_content_is_data_not_template_code(server):
    content = "{{ 7 * 7 }}{% if true %}yes{% endif %}"
    messages = [{"role": "user", "content": content}]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=300)
    assert ids.status_code == 200, ids.text
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": ids.json()["tokens"]})
    assert content in text.json()["prompt"]
    assert "49" not in text.json()["prompt"]
