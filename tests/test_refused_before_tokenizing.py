"""A request of more sequences (prompts x n) than the server runs at once (--max-num-seqs) is refused
as soon as its body is parsed, before any prompt is tokenized or any chat template rendered: the
refusal came only where the choices start, after 200,000 one-character prompts (1 MB) had been
tokenized for 117 s, 1.5 million token-id prompts had held the event loop for 11 s, and 30,000
messages had been rendered for seconds. Counted once, as every refusal is. In-process over SmolLM2's
tokenizer and a scripted engine (tests/test_tokenize_routes.py: scripted_server, max_num_seqs 4)."""

from __future__ import annotations

import pytest

from tests.test_tokenize_routes import MODEL, answer, refusal_of, scripted_server


class CountingTokenizer:
    """The tokenizer, its text tokenizing and chat rendering counted (everything else passed through)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer, self.calls = tokenizer, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.calls += 1
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def counted_server(tokenizer):
    server = scripted_server(tokenizer, "Paris")
    server.tokenizer = CountingTokenizer(tokenizer)
    return server


def rejections(server) -> float:
    line = 'corelaunch_requests_total{finish_reason="rejected",status="400"} '
    return float(next(row for row in server.metrics.render().decode().splitlines()
                      if row.startswith(line)).split()[-1])


@pytest.mark.parametrize("prompts, n", [(["a"] * 5, 1), (["a", "b"], 3)], ids=["five-prompts", "two-prompts-of-3"])
def test_too_many_text_prompts_are_refused_before_any_is_tokenized(smollm2_tokenizer, prompts, n):
    server = counted_server(smollm2_tokenizer)
    err = refusal_of(server, "/v1/completions", {"model": MODEL, "prompt": prompts, "n": n, "max_tokens": 1})
    assert (err.status, err.param) == (400, "prompt")
    assert err.message.startswith(f"{len(prompts)} prompts of n ({n}) choices each are {len(prompts) * n} sequences, "
                                  f"more than this server runs at once (max_num_seqs 4)")
    assert server.tokenizer.calls == 0 and rejections(server) == 1
    answer(server, "/v1/completions", {"model": MODEL, "prompt": prompts[:2], "n": 2, "max_tokens": 1})
    assert server.tokenizer.calls >= 2  # four sequences fit: each prompt tokenized (the count sees them)


def test_too_many_token_id_prompts_are_refused_before_any_is_checked(smollm2_tokenizer):
    server = counted_server(smollm2_tokenizer)
    checked = []
    known_ids = server._known_ids
    server._known_ids = lambda prompt: checked.append(prompt) or known_ids(prompt)  # each id prompt's check, seen
    err = refusal_of(server, "/v1/completions", {"model": MODEL, "prompt": [[1, 2]] * 5, "max_tokens": 1})
    assert (err.status, err.param, checked, rejections(server)) == (400, "prompt", [], 1)
    answer(server, "/v1/completions", {"model": MODEL, "prompt": [[1, 2]] * 4, "max_tokens": 1})
    assert len(checked) == 4


def test_a_chat_of_more_choices_than_rows_is_refused_before_its_template_renders(smollm2_tokenizer):
    server = counted_server(smollm2_tokenizer)
    chat = [{"role": "user", "content": "a"}] * 3
    err = refusal_of(server, "/v1/chat/completions", {"model": MODEL, "messages": chat, "n": 5, "max_tokens": 1})
    assert (err.status, err.param) == (400, "n") and "n (5) is more than this server runs at once" in err.message
    assert server.tokenizer.calls == 0 and rejections(server) == 1
    answer(server, "/v1/chat/completions", {"model": MODEL, "messages": chat, "n": 4, "max_tokens": 1})
    assert server.tokenizer.calls > 0  # four choices fit: the template rendered (the count sees it)
