"""vLLM's bad_words: words never generated. SamplingParams keeps the words (checked when built) and
their token sequences, which the driver fills with vLLM's rule (each word alone and after a space,
without special tokens); the leader bans a sequence's last token right after the generated tokens
(never the prompt's) end with the rest of it (workers/penalties.py). Checked on penalized() itself,
on SamplingParams and the request checks, through the driver API and on /v1/completions over a real
in-process Launcher (a small random model with SmolLM2's vocabulary and tokenizer)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from launcher.serving.openai_protocol import CompletionRequest, ProtocolError, parse_request
from shardlib.request_checks import check_request
from shardlib.sampling_params import MAX_BAD_WORD_CHARS, MAX_BAD_WORDS, SamplingParams
from tests.model_factory import random_model_with_smollm2_tokenizer
from workers.penalties import penalized

VOCAB = 8
NEW = 8


def banned(params: SamplingParams, outputs: list[int], prompt: list[int] = (1,)) -> list[int]:
    """The tokens penalized() sets to -inf for one row of flat logits."""
    out = penalized(torch.zeros(1, VOCAB), [params], [list(prompt)], [outputs])
    return [t for t in range(VOCAB) if out[0, t] == float("-inf")]


def with_ids(*sequences) -> SamplingParams:
    """Greedy params with bad words' token sequences as the driver fills them."""
    return SamplingParams(temperature=0.0, bad_words=("w",), bad_words_token_ids=sequences)


# ---- penalized() -----------------------------------------------------------------------------------
def test_a_one_token_word_is_banned_from_the_first_step_on():
    params = with_ids((5,))
    assert params.adjusts_logits(0) and params.adjusts_logits(10**6)
    assert banned(params, []) == [5]
    assert banned(params, [2, 3]) == [5]


def test_a_two_token_words_last_token_is_banned_only_right_after_its_first():
    params = with_ids((3, 6))
    assert banned(params, []) == []
    assert banned(params, [3]) == [6]
    assert banned(params, [2, 3]) == [6]
    assert banned(params, [3, 2]) == []  # not right after
    assert banned(params, [6]) == []


def test_the_prompt_does_not_count_as_the_words_start():
    params = with_ids((3, 6))
    assert banned(params, [], prompt=[1, 3]) == []
    assert banned(params, [3], prompt=[1, 3]) == [6]


def test_bad_words_come_after_allowed_token_ids_and_a_row_left_with_none_fails():
    both = SamplingParams(temperature=0.0, allowed_token_ids=[4, 5], bad_words=("w",), bad_words_token_ids=((5,),))
    assert banned(both, []) == [0, 1, 2, 3, 5, 6, 7]
    only = SamplingParams(temperature=0.0, allowed_token_ids=[5], bad_words=("w",), bad_words_token_ids=((5,),))
    with pytest.raises(ValueError, match=r"^no token is left to choose: bad_words ban every one of allowed_token_ids"):
        banned(only, [])


def test_rows_without_bad_words_are_untouched_and_greedy_picks_the_next_best():
    logits = torch.tensor([[0.0, 0, 0, 0, 0, 9, 5, 0], [0.0, 0, 0, 0, 0, 9, 5, 0]])
    out = penalized(logits, [with_ids((5,)), SamplingParams(temperature=0.0)], [[1], [1]], [[], []])
    assert out[0].argmax() == 6 and out[1].argmax() == 5


# ---- SamplingParams and the request checks -----------------------------------------------------------
def test_bad_words_are_kept_as_a_tuple_and_hashable():
    params = SamplingParams(bad_words=["hello", " world"])
    assert params.bad_words == ("hello", " world") and hash(params)
    assert SamplingParams().bad_words == () and not SamplingParams().adjusts_logits(0)
    assert with_ids([3, 6], [5]).bad_words_token_ids == ((3, 6), (5,))


@pytest.mark.parametrize("words, message", [
    ("hello", "bad_words='hello' must be a list of strings"),
    (7, "bad_words=7 must be a list of strings"),
    ({"a": 1}, "bad_words={'a': 1} must be a list of strings"),
    (["ok", 3], "bad_words[1]=3 must be a string"),
    (["ok", ""], "bad_words[1]='' must be a non-empty word"),
    (["  "], "bad_words[0]='  ' must be a non-empty word"),
    (["x" * (MAX_BAD_WORD_CHARS + 1)], f"must be at most {MAX_BAD_WORD_CHARS} characters"),
    (["w"] * (MAX_BAD_WORDS + 1), f"bad_words holds {MAX_BAD_WORDS + 1} words; at most {MAX_BAD_WORDS}"),
], ids=["str", "int", "mapping", "not-str", "empty", "spaces", "too-long", "too-many"])
def test_bad_words_are_refused_naming_the_value(words, message):
    with pytest.raises(ValueError) as caught:
        SamplingParams(bad_words=words)
    assert message in str(caught.value)


@pytest.mark.parametrize("sequences", [[[]], [[-1]], [["a"]], "ab"], ids=["empty", "negative", "str-id", "str"])
def test_bad_token_sequences_are_refused(sequences):
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words=("w",), bad_words_token_ids=sequences)


def test_the_request_checks_refuse_untokenized_words_and_ids_outside_the_vocabulary():
    check_request([[1]], [with_ids((3, 127))], 4, vocab_size=128)
    with pytest.raises(ValueError, match=r"^bad_words \['w'\] have no token ids"):
        check_request([[1]], [SamplingParams(bad_words=["w"])], 4, vocab_size=128)
    with pytest.raises(ValueError, match=r"^bad_words_token_ids names token ids \[128\] outside the vocabulary"):
        check_request([[1]], [with_ids((3, 128))], 4, vocab_size=128)


# ---- the request body --------------------------------------------------------------------------------
BASE = {"model": "m", "prompt": "hi"}


def test_the_body_takes_bad_words_into_the_sampling_params():
    assert parse_request(CompletionRequest, {**BASE, "bad_words": ["a", "b c"]}).sampling().bad_words == ("a", "b c")
    assert parse_request(CompletionRequest, {**BASE, "bad_words": None}).sampling().bad_words == ()


@pytest.mark.parametrize("value, words", [
    ("hello", "bad_words ('hello') must be a list of at most"),
    ([1], "bad_words (1) must be a list of at most"),
    ([""], "bad_words[0] ('') must be a non-empty word"),
    (["x" * (MAX_BAD_WORD_CHARS + 1)], f"of at most {MAX_BAD_WORD_CHARS} characters"),
    (["w"] * (MAX_BAD_WORDS + 1), f"bad_words has {MAX_BAD_WORDS + 1} words; at most {MAX_BAD_WORDS}"),
], ids=["str", "int-word", "empty", "too-long", "too-many"])
def test_a_bad_body_value_is_a_400_naming_bad_words(value, words):
    with pytest.raises(ProtocolError) as caught:
        parse_request(CompletionRequest, {**BASE, "bad_words": value})
    err = caught.value
    assert err.status == 400 and err.param == "bad_words" and words in err.message, err.message


# ---- the driver API and /v1/completions, over a real in-process Launcher -----------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("bad_words"))


def a_generated_word(tokenizer, token_ids: list[int]) -> tuple[str, int]:
    """A word the output holds as one token of its own: (the word, that token)."""
    for token in token_ids:
        word = tokenizer.decode([token]).strip()
        if word.isalpha() and token in (tokenizer.encode(word, add_special_tokens=False)
                                        + tokenizer.encode(" " + word, add_special_tokens=False)):
            return word, token
    raise AssertionError(f"no one-token word in {tokenizer.decode(token_ids)!r}")


def test_the_driver_api_never_generates_a_bad_word_on_any_path(model_dir, in_process_cluster):
    from launcher.api import Launcher

    greedy = SamplingParams(temperature=0.0)
    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        tok = llm.tokenizer
        [free] = llm.generate(["Hi"], greedy, max_new_tokens=NEW, ignore_eos=True)
        word, token = a_generated_word(tok, free.token_ids)
        assert (token,) in llm._bad_word_sequences((word,))  # the word alone or after a space
        ban = SamplingParams(temperature=0.0, bad_words=[word])
        [kept] = llm.generate(["Hi"], ban, max_new_tokens=NEW, ignore_eos=True)
        [static] = llm.generate(["Hi"], ban, max_new_tokens=NEW, ignore_eos=True, batching="static")
        streamed = list(llm.stream("Hi", ban, max_new_tokens=NEW, ignore_eos=True))

        async def read():
            [together] = await llm.agenerate(["Hi"], ban, max_new_tokens=NEW, ignore_eos=True)
            return together, [d async for d in llm.astream("Hi", ban, max_new_tokens=NEW, ignore_eos=True)]

        together, astreamed = asyncio.run(read())
        llm.check_prompts(["Hi"], ban, max_new_tokens=NEW)  # tokenized there too: no "no token ids" refusal
        with pytest.raises(ValueError, match=r"^bad_words\[0\]='' must be a non-empty word"):
            llm.generate(["Hi"], SamplingParams(bad_words=[""]), max_new_tokens=NEW)
    assert token in free.token_ids and token not in kept.token_ids and kept.text != free.text
    for other in (static.token_ids, together.token_ids, [t for d in streamed for t in d.token_ids],
                  [t for d in astreamed for t in d.token_ids]):
        assert other == kept.token_ids  # every path bans the same tokens


def test_the_completions_route_never_generates_a_bad_word(model_dir, in_process_cluster):
    from launcher.api import Launcher
    from tests.test_skip_special_tokens import answered, choice_texts, replica_over

    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        server = replica_over(llm)
        [free] = llm.generate(["Hi"], SamplingParams(temperature=0.0), max_new_tokens=NEW, ignore_eos=True)
        word, _ = a_generated_word(llm.tokenizer, free.token_ids)
        [kept] = llm.generate(["Hi"], SamplingParams(temperature=0.0, bad_words=[word]), max_new_tokens=NEW,
                              ignore_eos=True)
        asked = {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": NEW, "temperature": 0, "ignore_eos": True}

        async def both():
            return (await answered(server, "/v1/completions", asked),
                    await answered(server, "/v1/completions", {**asked, "bad_words": [word]}))

        unbanned, banned_answer = asyncio.run(both())
    assert choice_texts("/v1/completions", unbanned, 1) == [free.text]
    assert choice_texts("/v1/completions", banned_answer, 1) == [kept.text] != [free.text]
