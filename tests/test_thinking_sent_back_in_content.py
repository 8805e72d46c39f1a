"""An assistant's earlier answer sent back with its thinking inside its content
(`<think>...</think>answer`, no reasoning field), to a model whose tokenizer has those tags and whose
template splits the content at them (Qwen3's): sanitizing marks the tags as text, and the template's
own split of the marked content left the marks' newlines in the prompt. The server splits the
thinking off first, as the template would, so the prompt is token for token transformers' unsanitized
render; other models' messages reach their templates unchanged."""

from __future__ import annotations

import copy

import pytest

from tests.test_tokenize_routes import answer, scripted_server

MODEL = "smollm2-135m-instruct"
QWEN3_STYLE = """{%- for message in messages %}
{%- if message.role == "user" %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}
{%- set content = message.content %}{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}{%- set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\\n') %}
{%- endif %}
{%- if loop.last and reasoning_content %}{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}{{- '<|im_end|>\\n' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
"""Qwen3's handling of an assistant's thinking, cut down: earlier turns' thinking dropped, the last's kept."""
THOUGHT = "<think>\nadd them\n</think>\n\nIt is 4."


def with_think_tags(smollm2_tokenizer, template: str | None):
    """A copy of SmolLM2's tokenizer with <think> and </think> as added tokens (as Qwen3 has them) and
    `template` as its own, saved and loaded back as a model's files are."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens(["<think>", "</think>"])
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def served_and_expected(tokenizer, reference, messages: list[dict], **options) -> tuple[list[int], list[int]]:
    """The server's /tokenize ids for `messages` and transformers' own unsanitized render of them."""
    from launcher.serving.chat_template import use_chat_template

    server = scripted_server(use_chat_template(tokenizer, None), "ok")
    if not server._chat_options:
        pytest.skip("this transformers does not sanitize chat messages")
    got = answer(server, "/tokenize", {"model": MODEL, "messages": messages, **options})["tokens"]
    expected = reference.apply_chat_template(messages, tokenize=True, return_dict=False,
                                             add_generation_prompt=options.get("add_generation_prompt", True))
    return got, expected


@pytest.mark.parametrize("answer_text", [THOUGHT, "</think>It is 4.", "<think>a</think>\n\nb</think>\n\nIt is 4."],
                         ids=["tagged", "no-opening-tag", "two-closing-tags"])
def test_thinking_inside_an_earlier_answer_renders_as_transformers_renders_it(smollm2_tokenizer, answer_text):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": answer_text},
                {"role": "user", "content": "and 3+3?"}]
    got, expected = served_and_expected(with_think_tags(smollm2_tokenizer, QWEN3_STYLE),
                                        with_think_tags(smollm2_tokenizer, QWEN3_STYLE), messages)
    assert got == expected, (smollm2_tokenizer.decode(got), smollm2_tokenizer.decode(expected))


def test_the_last_answers_thinking_is_kept_as_the_template_keeps_it(smollm2_tokenizer):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": THOUGHT}]
    reference = with_think_tags(smollm2_tokenizer, QWEN3_STYLE)
    got, expected = served_and_expected(with_think_tags(smollm2_tokenizer, QWEN3_STYLE), reference, messages,
                                        add_generation_prompt=False)
    assert got == expected
    assert reference.decode(got).endswith("<|im_start|>assistant\n<think>\nadd them\n</think>\n\nIt is 4."
                                                  "<|im_end|>\n")


def test_models_without_the_tags_or_a_template_that_splits_at_them_get_the_content_whole(smollm2_tokenizer):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": THOUGHT},
                {"role": "user", "content": "and 3+3?"}]
    plain = copy.deepcopy(smollm2_tokenizer)  # no think tags: SmolLM2's own template, the tags plain text
    got, expected = served_and_expected(plain, copy.deepcopy(smollm2_tokenizer), messages)
    assert got == expected and "add them" in smollm2_tokenizer.decode(got)
    tagged = with_think_tags(smollm2_tokenizer, None)  # the tags, but a template that never splits at them
    got, expected = served_and_expected(tagged, with_think_tags(smollm2_tokenizer, None), messages)
    assert got == expected and "add them" in smollm2_tokenizer.decode(got)


R1_STYLE = """{%- for message in messages %}
{%- if message.role == "user" %}{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == "assistant" %}{%- set content = message.content %}
{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}{%- endif %}
{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
"""DeepSeek-R1's handling, cut down: the split at `</think>` without lstrip, no reasoning_content read."""
WHOLE_CONTENT_STYLE = """{%- for message in messages %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- if message.role == "system" %}{{- '<think>\\n\\n</think>\\n' }}{%- endif %}
{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""
"""A template that writes `</think>` as text of its own (SmolLM3's empty thinking) and prints content whole."""


def test_a_template_that_splits_without_reading_reasoning_content_gets_the_content_whole(smollm2_tokenizer):
    """DeepSeek-R1's template keeps the newlines its split leaves: split off first, they were lost. (The
    text is transformers'; its tokens may differ where a sanitizing mark stood between newlines.)"""
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": THOUGHT},
                {"role": "user", "content": "and 3+3?"}]
    got, expected = served_and_expected(with_think_tags(smollm2_tokenizer, R1_STYLE),
                                        with_think_tags(smollm2_tokenizer, R1_STYLE), messages)
    assert smollm2_tokenizer.decode(got) == smollm2_tokenizer.decode(expected)
    assert "<|im_start|>assistant\n\n\nIt is 4.<|im_end|>" in smollm2_tokenizer.decode(got)


def test_a_template_that_prints_content_whole_keeps_the_thinking_in_it(smollm2_tokenizer):
    """Split off into reasoning fields such a template never reads, the earlier thinking was lost."""
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": THOUGHT},
                {"role": "user", "content": "and 3+3?"}]
    got, _ = served_and_expected(with_think_tags(smollm2_tokenizer, WHOLE_CONTENT_STYLE),
                                 with_think_tags(smollm2_tokenizer, WHOLE_CONTENT_STYLE), messages)
    assert "add them" in smollm2_tokenizer.decode(got)
