"""allowed_token_ids together with bad_words and min_tokens: ids that each of them removes in part
leave nothing to choose together. Each check looked at one of them alone, so such a row reached the
token choice with every logit -inf, which blamed the checkpoint ("the forward overflowed or the
weights are broken"); the leader now names the fields, and the driver refuses what it can see
before submitting (bad words of one token, stop tokens held back from the first step): a 400 over
HTTP naming allowed_token_ids. Also: an n-choice seeded request's choices share its checked params
(a copy per choice re-sorted 262144 allowed ids on the event loop)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from launcher.serving.openai_protocol import CompletionRequest, ProtocolError, parse_request
from shardlib.sampling_params import check_allowed_beyond_stops
from workers.penalties import penalized
from workers.sampling import SamplingParams, sample

EOS = 9


def greedy(allowed, bad=(), min_tokens=0) -> SamplingParams:
    """Greedy params with bad words' token sequences as the driver fills them."""
    return SamplingParams(temperature=0.0, allowed_token_ids=allowed, min_tokens=min_tokens,
                          bad_words=("w",) if bad else (), bad_words_token_ids=bad)


def chosen(params: SamplingParams, generated: list[int]) -> int:
    """The greedy token of one row of flat logits (token 4 best) with EOS as its stop token."""
    logits = torch.arange(10, dtype=torch.float32)[None].flip(-1)  # 0 best ... 9 worst
    logits[0, 4] = 100.0
    [token] = sample(penalized(logits, [params], [[1, 2]], [generated], [(EOS,)]), [params], [None]).tolist()
    return token


# ---- the leader -------------------------------------------------------------------------------------
def test_allowed_ids_emptied_by_bad_words_and_held_stops_together_are_refused_by_name():
    """Allowed 3 and EOS: the bad word bans 3, min_tokens holds EOS back. It reached sample() with no
    finite logit, whose error blamed the model's weights."""
    both = greedy([3, EOS], bad=[(3,)], min_tokens=5)
    with pytest.raises(ValueError, match=r"^no token is left to choose: allowed_token_ids \[3, 9\] are each banned "
                                         r"here by bad_words \(token ids \[3\]\) or a stop token, which min_tokens "
                                         r"\(5\) holds back for 5 more tokens; allow other tokens too, ban fewer "
                                         r"words, or lower min_tokens"):
        chosen(both, [])
    assert chosen(both, [3] * 5) == EOS  # past min_tokens EOS is allowed again: the only token left
    assert chosen(greedy([3, 4, EOS], bad=[(3,)], min_tokens=5), []) == 4  # one token left is enough


def test_a_longer_bad_word_empties_the_row_only_at_the_step_it_is_due():
    """(3, 3) bans 3 right after a 3: the first step may choose 3, the second has nothing left."""
    params = greedy([3, EOS], bad=[(3, 3)], min_tokens=5)
    assert chosen(params, []) == 3
    with pytest.raises(ValueError, match=r"^no token is left to choose: allowed_token_ids \[3, 9\] are each banned "
                                         r"here by bad_words"):
        chosen(params, [3])


def test_each_field_alone_keeps_its_own_words():
    with pytest.raises(ValueError, match=r"^no token is left to choose: allowed_token_ids \[9\] are all stop tokens, "
                                         r"which min_tokens \(2\) holds back for 1 more tokens"):
        chosen(greedy([EOS], min_tokens=2), [5])
    with pytest.raises(ValueError, match=r"^no token is left to choose: bad_words ban every one of allowed_token_ids "
                                         r"\[3\] here"):
        chosen(greedy([3], bad=[(3,)]), [])


def test_a_broken_rows_nan_is_still_reported_as_the_forwards():
    """The check reads the ids, not the logits: a NaN row with allowed ids left is sample()'s to report."""
    params = greedy([3, 4], bad=[(3,)], min_tokens=5)
    logits = torch.full((1, 10), float("nan"))
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        sample(penalized(logits, [params], [[1]], [[]], [(EOS,)]), [params], [None])


# ---- the driver, before submitting ------------------------------------------------------------------
def test_allowed_ids_that_one_token_bad_words_ban_are_refused_before_submitting():
    """A one-token bad word is banned at every step: allowed ids that such words (and stop tokens
    min_tokens holds back) cover leave no first token."""
    with pytest.raises(ValueError, match=r"^allowed_token_ids \[3\] are all banned by bad_words \(whose words of one "
                                         r"token ban token ids \[3\] at every step\): no token could be chosen; allow "
                                         r"other tokens too, or remove those bad words"):
        check_allowed_beyond_stops([greedy([5, 6]), greedy([3], bad=[(3,), (7, 3)])], (EOS,))
    with pytest.raises(ValueError, match=r"^allowed_token_ids \[3, 9\] are each banned by bad_words \(whose words of "
                                         r"one token ban token ids \[3\] at every step\) or a stop token \(EOS "
                                         r"included\), which min_tokens \(1\) holds back: no token could be chosen; "
                                         r"allow other tokens too, remove those bad words, or lower min_tokens"):
        check_allowed_beyond_stops([greedy([3, EOS], bad=[(3,)], min_tokens=1)], (EOS,))
    check_allowed_beyond_stops([greedy([3, EOS], bad=[(3,)])], (EOS,))  # EOS may end it at once
    check_allowed_beyond_stops([greedy([3, 4], bad=[(3,)], min_tokens=1)], (EOS,))  # 4 is left
    check_allowed_beyond_stops([greedy([3], bad=[(7, 3)])], (EOS,))  # 3 may come first


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.model_factory import random_model_with_smollm2_tokenizer

    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("allowed_and_bad_words"))


def one_token_word(llm) -> tuple[str, int]:
    """A word the driver tokenizes into one token on its own: (the word, that token)."""
    for word in ("the", "Hello", "cat", "a"):
        for sequence in llm._bad_word_sequences((word,)):
            if len(sequence) == 1:
                return word, sequence[0]
    raise AssertionError("no one-token word among the candidates")


def test_the_driver_and_the_completions_route_refuse_allowed_ids_a_bad_word_bans(model_dir, in_process_cluster):
    """Through the driver API on each path and as a 400 naming allowed_token_ids over HTTP: the
    request failed in the leader's first step (a 500 whose message blamed the weights, with
    min_tokens)."""
    from launcher.api import Launcher
    from tests.test_skip_special_tokens import replica_over
    from tests.test_tokenize_routes import post

    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        word, token = one_token_word(llm)
        eos = llm._ending_ids((), False)[0]
        alone = SamplingParams(temperature=0.0, allowed_token_ids=[token], bad_words=[word])
        held = SamplingParams(temperature=0.0, allowed_token_ids=[token, eos], bad_words=[word], min_tokens=1)
        for params in (alone, held):
            for batching in ("static", "continuous"):
                with pytest.raises(ValueError, match=r"^allowed_token_ids .* banned by bad_words"):
                    llm.generate(["Hi"], params, max_new_tokens=4, batching=batching)
            with pytest.raises(ValueError, match=r"^allowed_token_ids .* banned by bad_words"):
                llm.stream("Hi", params, max_new_tokens=4)
        server = replica_over(llm)
        body = {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 4, "temperature": 0,
                "allowed_token_ids": [token, eos], "bad_words": [word], "min_tokens": 1}
        with pytest.raises(ProtocolError) as caught:  # the server's handler answers it as OpenAI's error object
            asyncio.run(server.completions(post("/v1/completions", body)))
        assert llm.load() == {"running": 0, "waiting": 0}
    err = caught.value
    assert err.status == 400 and err.param == "allowed_token_ids", (err.status, err.param, err.message)
    assert "bad_words" in err.message and "min_tokens" in err.message, err.message


# ---- n choices ----------------------------------------------------------------------------------------
def test_seeded_choices_share_the_requests_checked_params_and_move_the_seed_on():
    """dataclasses.replace checked every field again per choice: 262144 allowed ids re-sorted on the
    event loop (n=8: about 560 ms), and a set (and the leader's mask of it) per choice."""
    body = {"model": "m", "prompt": "hi", "n": 3, "seed": 2**63 - 2, "temperature": 1.0,
            "allowed_token_ids": [5, 3, 9], "bad_words": ["w"]}
    req = parse_request(CompletionRequest, body)
    first = req.sampling()
    choices = [req.choice_sampling(i) for i in range(3)]
    assert [c.seed for c in choices] == [2**63 - 2, 2**63 - 1, -2**63]  # seed + i, wrapping
    assert choices[0] is first and first.seed == 2**63 - 2  # the request's own params keep their seed
    for choice in choices[1:]:
        assert choice.allowed_token_ids is first.allowed_token_ids
        assert choice.bad_words is first.bad_words and choice.temperature == first.temperature
    unseeded = parse_request(CompletionRequest, {**body, "seed": None})
    assert unseeded.choice_sampling(2) is unseeded.sampling()


def test_the_driver_tokenizes_the_choices_bad_words_once_and_checks_nothing_again(model_dir, in_process_cluster,
                                                                                    monkeypatch):
    """A request's seeded choices are copies of one checked params: the driver filled each one's
    bad-word ids with dataclasses.replace (every field checked again, 262144 allowed ids sorted per
    choice on the event loop) and tokenized the words per choice."""
    from launcher.api import Launcher

    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        word, token = one_token_word(llm)
        base = SamplingParams(temperature=1.0, seed=5, allowed_token_ids=list(range(1000)), bad_words=[word])
        choices = [base, base.with_derived(seed=6), base.with_derived(seed=7)]
        tokenized = []
        real = llm._bad_word_sequences
        monkeypatch.setattr(llm, "_bad_word_sequences", lambda words: tokenized.append(words) or real(words))
        filled = llm._with_bad_word_ids(choices)
    assert tokenized == [(word,)]
    assert [p.seed for p in filled] == [5, 6, 7]
    assert all(p.allowed_token_ids is base.allowed_token_ids for p in filled)
    assert all((token,) in p.bad_words_token_ids for p in filled)
    assert base.bad_words_token_ids == ()  # the caller's params are not changed


def test_streams_with_the_same_bad_words_tokenize_them_once(model_dir, in_process_cluster, monkeypatch):
    """The OpenAI routes open one astream per choice, each filling its own params: a request of n
    choices tokenized its bad words n times on the event loop (128 long words: about 0.1 s each),
    and a client sending the same list again tokenized it again. The Launcher remembers them."""
    import launcher.api
    from launcher.api import Launcher

    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        word, token = one_token_word(llm)
        words = [word, "purple elephant"]
        tokenized = []
        real = llm._bad_word_sequences
        monkeypatch.setattr(llm, "_bad_word_sequences", lambda ws: tokenized.append(ws) or real(ws))
        base = SamplingParams(temperature=1.0, seed=3, bad_words=words)

        async def choices(params):  # as the completions route streams a request's choices
            streams = [llm.astream("Hi", p, max_new_tokens=6, ignore_eos=True) for p in params]
            return [[t for delta in [d async for d in s] for t in delta.token_ids] for s in streams]

        first = asyncio.run(choices([base, base.with_derived(seed=4), base.with_derived(seed=5)]))
        again = asyncio.run(choices([SamplingParams(temperature=1.0, seed=6, bad_words=list(words))]))
        assert tokenized == [tuple(words)]  # one tokenization for four streams of two requests
        assert all(token not in generated for generated in first + again), (token, first, again)

        # bounded: past BAD_WORD_LISTS_REMEMBERED lists, or BAD_WORD_IDS_REMEMBERED ids, all are
        # forgotten, and each list is tokenized right again
        lists = [(word,), ("purple",), ("elephant",), ("purple elephant", "blue whale")]
        for bound, most in (("BAD_WORD_LISTS_REMEMBERED", 2), ("BAD_WORD_IDS_REMEMBERED", 4)):
            with monkeypatch.context() as bounded:
                bounded.setattr(launcher.api, bound, most)
                for bad in lists:
                    [filled] = llm._with_bad_word_ids([SamplingParams(bad_words=bad)])
                    assert filled.bad_words_token_ids == real(bad)
                    remembered = llm._bad_words_tokenized.values()
                    assert len(remembered) <= 2 if bound == "BAD_WORD_LISTS_REMEMBERED" else (
                        len(remembered) == 1 or sum(len(s) for ids in remembered for s in ids) <= most)


def test_the_server_tokenizes_a_new_bad_words_list_off_its_event_loop(model_dir, in_process_cluster, monkeypatch):
    """A new list's tokenizing (128 long words: about 0.1 s) ran on the event loop, which a client
    sending another list each time made every stream and request of the replica wait for: it runs
    on a worker thread before the choices start, and they find it remembered."""
    import threading

    from launcher.api import Launcher
    from tests.test_skip_special_tokens import answered, replica_over

    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        word, _ = one_token_word(llm)
        server = replica_over(llm)
        threads, real = [], llm._bad_word_sequences
        monkeypatch.setattr(llm, "_bad_word_sequences", lambda ws: threads.append(threading.get_ident()) or real(ws))
        asked = {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 4, "n": 2, "bad_words": [word]}

        async def answer_on_the_loop():
            return await answered(server, "/v1/completions", asked), threading.get_ident()

        answer, loop_thread = asyncio.run(answer_on_the_loop())
    assert len(answer["choices"]) == 2
    assert len(threads) == 1 and threads[0] != loop_thread


def test_seeded_choices_each_equal_their_own_request_over_the_completions_route(model_dir, in_process_cluster):
    """Choice i of a seeded request samples what one request seeded with choice_seed(seed, i) does."""
    from launcher.api import Launcher
    from launcher.serving.openai_protocol import choice_seed
    from tests.test_skip_special_tokens import answered, choice_texts, replica_over

    asked = {"model": "smollm2-135m-instruct", "prompt": "Hi", "max_tokens": 6, "temperature": 1.0, "seed": 11,
             "n": 3, "ignore_eos": True, "allowed_token_ids": list(range(0, 49152, 3))}
    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        server = replica_over(llm)

        async def every():
            together = await answered(server, "/v1/completions", asked)
            alone = [await answered(server, "/v1/completions", {**asked, "n": 1, "seed": choice_seed(11, i)})
                     for i in range(3)]
            return together, alone

        together, alone = asyncio.run(every())
    texts = choice_texts("/v1/completions", together, 3)
    assert texts == [choice_texts("/v1/completions", one, 1)[0] for one in alone]
    assert len(set(texts)) > 1  # the seeds differ: so do the choices (a random model at temperature 1)
