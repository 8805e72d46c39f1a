"""One `corelaunch serve` with the flags that change how chat is read and answered, started once for
the cases that need them (each server start costs tens of seconds of the suite): --chat-template
with --trust-request-chat-template (the server's own template, and a request's), and
--reasoning-parser deepseek_r1 with --quiet. The flags act on different parts of an answer (the
prompt a chat renders to; where the generated text goes), so each case checks its own alone."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from tests.test_chat_template_flag import CHAT, OWN_TEMPLATE, TEMPLATE
from tests.test_openai_server import MODEL, hf, running_server  # noqa: F401 - hf: the module's fixture

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def flagged(tmp_path_factory):
    """The server. Its stop sends SIGTERM to the command's whole process group and checks it exits 0
    in well under Serve's 30 s shutdown wait (running_server's stop_group)."""
    root = tmp_path_factory.mktemp("flagged")
    (root / "chat.jinja").write_text(TEMPLATE, encoding="utf-8")
    log = root / "serve.log"
    with running_server(log, "--max-num-seqs", "2", "--chat-template", str(root / "chat.jinja"),
                        "--trust-request-chat-template", "--reasoning-parser", "deepseek_r1", "--quiet",
                        stop_group=True) as running:
        yield SimpleNamespace(url=running.url, log=log)


def test_corelaunch_serve_renders_chat_with_the_flags_template(flagged, smollm2_tokenizer):
    """/tokenize's chat form and a chat answer's prompt_tokens are the --chat-template file's prompt,
    not SmolLM2's own; a request's own chat_template renders that request."""
    import requests

    ours = smollm2_tokenizer.apply_chat_template(CHAT, chat_template=TEMPLATE, add_generation_prompt=True,
                                                 return_dict=False)
    own = smollm2_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert len(ours) != len(own)
    asked = {"model": MODEL, "messages": CHAT, "max_tokens": 2, "temperature": 0}
    tokenized = requests.post(f"{flagged.url}/tokenize", json={"model": MODEL, "messages": CHAT}, timeout=60)
    chat = requests.post(f"{flagged.url}/v1/chat/completions", json=asked, timeout=300)
    own = requests.post(f"{flagged.url}/v1/chat/completions", json={**asked, "chat_template": OWN_TEMPLATE},
                        timeout=300)
    assert tokenized.status_code == 200 and tokenized.json()["tokens"] == ours, tokenized.text
    assert chat.status_code == 200 and chat.json()["usage"]["prompt_tokens"] == len(ours), chat.text
    assert own.status_code == 200 and own.json()["usage"]["prompt_tokens"] == len(
        smollm2_tokenizer("Name a colour.", add_special_tokens=False)["input_ids"]), own.text


def test_a_thinking_servers_reasoning_reaches_the_official_client(flagged, hf):  # noqa: F811
    """SmolLM2 writes no </think>: its greedy answer (transformers' text, from the prompt the server's
    template renders) is all reasoning, content null, whole and streamed (delta `reasoning`) through
    the openai client, and left out with include_reasoning false; the usage counts every generated
    token as reasoning, whole, streamed and hidden alike. --quiet kept Serve's INFO lines out of the
    command's output."""
    import openai

    asked = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    client = openai.OpenAI(base_url=f"{flagged.url}/v1", api_key="unused", timeout=300, max_retries=0)
    whole = client.chat.completions.create(**asked)
    streamed = list(client.chat.completions.create(**asked, stream=True, stream_options={"include_usage": True}))
    hidden = client.chat.completions.create(**asked, extra_body={"include_reasoning": False})
    expected = hf.greedy(hf.tok.apply_chat_template(CHAT, chat_template=TEMPLATE, add_generation_prompt=True,
                                                    return_dict=False), 12)
    assert expected and "</think>" not in expected
    message = whole.choices[0].message
    assert message.content is None and getattr(message, "reasoning", None) == expected
    assert "".join(getattr(c.choices[0].delta, "reasoning", None) or "" for c in streamed if c.choices) == expected
    assert not any(c.choices[0].delta.content for c in streamed if c.choices)
    assert hidden.choices[0].message.content is None and getattr(hidden.choices[0].message, "reasoning", None) is None
    # no tag written (SmolLM2 has no tag tokens: the count reads the text): every token is the thinking's
    assert "<think>" not in expected and whole.usage.completion_tokens > 0
    for usage in (whole.usage, streamed[-1].usage, hidden.usage):
        assert usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens, usage
    # --quiet: no progress, Serve's own INFO lines included ("Started Serve", "Application ... is ready")
    log = flagged.log.read_text()
    assert not re.search(r"^INFO ", log, re.MULTILINE) and "Started Serve" not in log, log[-3000:]
