"""vLLM's allowed_token_ids: only the listed tokens may be chosen, at every step, greedy included.
Checked when SamplingParams are built and against the vocabulary with the request; applied by the
leader before the logit bias and penalties (workers/penalties.py); greedy generation with it equal to
transformers' greedy generation restricted to the same ids, in the static engine and the serving
loop; with structured output, the tokens both allow. Over HTTP: tests/test_openai_server.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardlib.request_checks import check_request
from shardlib.sampling_params import SamplingParams
from shardlib.structured_output import StructuredOutput
from tests.serving_driver import collect, request, run_loops, stop
from tests.test_engine import PROMPTS, fresh_model, hf_model
from tests.test_penalties import generated_in_both_engines
from tests.test_replicas import model_and_expected  # noqa: F401 - fixture
from tests.test_structured_output import EOS, fresh_loop, run, wide_model  # noqa: F401 - wide_model: a fixture
from workers.penalties import penalized
from workers.serving.loop import ServingConfig, ServingLoop

NEW = 12
ALLOWED = (3, 17, 40, 61, 99, 120)


# ---- SamplingParams ------------------------------------------------------------------------------
def test_allowed_token_ids_are_kept_sorted_and_merged_and_ask_for_the_logits_to_change():
    params = SamplingParams(allowed_token_ids=[40, 3, np.int64(17), 3, torch.tensor(40)])
    assert params.allowed_token_ids == (3, 17, 40)  # duplicates merged (vLLM takes them), plain ints
    assert hash(params) == hash(SamplingParams(allowed_token_ids=(17, 40, 3)))
    assert params.adjusts_logits(10**6) and params.is_greedy
    assert SamplingParams().allowed_token_ids is None and not SamplingParams().adjusts_logits(0)


@pytest.mark.parametrize("ids, words", [
    ([], "allowed_token_ids=[] must be a non-empty list of token ids: an empty one leaves no token"),
    (set(), "allowed_token_ids=[] must be a non-empty list"),
    ([4, -1], "allowed_token_ids holds [-1], which are not token ids; they must be integers >= 0"),
    ([4, 2.0], "allowed_token_ids holds [2.0], which are not token ids"),
    ([True, 5], "allowed_token_ids holds [True], which are not token ids"),
    (["7"], "allowed_token_ids holds ['7'], which are not token ids"),
    ("7", "allowed_token_ids='7' must be a non-empty list of token ids (or None for every token)"),
    (7, "allowed_token_ids=7 must be a non-empty list of token ids"),
    ({7: 1.0}, "allowed_token_ids={7: 1.0} must be a non-empty list of token ids"),
], ids=["empty", "empty-set", "negative", "float", "bool", "str-id", "str", "int", "mapping"])
def test_bad_allowed_token_ids_are_refused_naming_the_value(ids, words):
    with pytest.raises(ValueError) as caught:
        SamplingParams(allowed_token_ids=ids)
    assert words in str(caught.value)


def test_ids_outside_the_vocabulary_are_refused_with_the_request():
    check_request([[1], [2]], [SamplingParams(), SamplingParams(allowed_token_ids=[0, 127])], 4, vocab_size=128)
    with pytest.raises(ValueError, match=r"^allowed_token_ids names token ids \[128, 500\] outside the vocabulary "
                                         r"\[0, 128\); were they taken from another model's tokenizer\?"):
        check_request([[1]], [SamplingParams(allowed_token_ids=[500, 128, 3])], 4, vocab_size=128)


# ---- the leader's logits ------------------------------------------------------------------------
def test_only_the_allowed_tokens_stay_with_their_bias_and_penalties_and_other_rows_untouched():
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(0)) * 4
    before = logits.clone()
    params = [SamplingParams(allowed_token_ids=[2, 5, 9, 30]),
              SamplingParams(),  # in the same batch: left exactly as it was
              # the bias of an allowed token is added, a forbidden one's cannot lift it back; min_tokens
              # holds the allowed stop token 9 back
              SamplingParams(allowed_token_ids=[2, 5, 9, 30], logit_bias={5: 3.0, 7: 100.0}, min_tokens=2),
              SamplingParams(allowed_token_ids=[1, 4], repetition_penalty=2.0)]
    prompts, outputs, stops = [[1], [1], [1], [4, 4]], [[], [], [], [1]], [(9,), (9,), (9,), ()]
    got = penalized(logits, params, prompts, outputs, stops)
    assert torch.equal(logits, before)  # the caller's logits (log-probabilities come from them) untouched
    assert torch.equal(got[1], logits[1])

    def finite(row: int) -> list[int]:
        return torch.nonzero(got[row].isfinite()).flatten().tolist()

    assert finite(0) == [2, 5, 9, 30] and torch.equal(got[0, [2, 5, 9, 30]], logits[0, [2, 5, 9, 30]])
    assert (got[0][got[0].isinf()] == float("-inf")).all()
    assert finite(2) == [2, 5, 30]  # 9: a stop token held back; 7: biased by 100 yet not allowed
    assert got[2, 5] == logits[2, 5] + 3.0 and got[2, 2] == logits[2, 2] and got[2, 30] == logits[2, 30]
    for token in (1, 4):  # both seen: penalised as without the restriction
        x = float(logits[3, token])
        assert float(got[3, token]) == pytest.approx(x / 2 if x > 0 else x * 2)
    assert finite(3) == [1, 4]
    # past min_tokens the stop token is allowed again
    assert 9 in torch.nonzero(penalized(logits, params, prompts, [[], [], [8, 8], [1]], stops)[2].isfinite())


def test_a_row_whose_allowed_tokens_are_all_held_back_is_refused_by_name():
    params = [SamplingParams(allowed_token_ids=[9], min_tokens=3)]
    with pytest.raises(ValueError, match=r"no token is left to choose: allowed_token_ids \[9\] are all stop tokens, "
                                         r"which min_tokens \(3\) holds back for 2 more tokens"):
        penalized(torch.zeros(1, 16), params, [[1]], [[4]], [(9, 2)])
    assert penalized(torch.zeros(1, 16), params, [[1]], [[4, 4, 4]], [(9, 2)])[0, 9] == 0  # past min_tokens


def test_a_rows_mask_is_made_once_not_every_step():
    params = [SamplingParams(allowed_token_ids=[3, 11, 12, 13, 29])]
    penalized(torch.zeros(1, 32), params, [[1]], [[]])
    entry = params[0].allowed_token_ids.mask_entry
    mask = entry.forbidden
    for step in range(1, 5):
        penalized(torch.zeros(1, 32), params, [[1]], [[3] * step])
        assert params[0].allowed_token_ids.mask_entry is entry and entry.forbidden is mask


class CountedId(int):
    """A token id that counts the times Python hashes it or compares it for equality: a set of them
    shows how much of the set a step's mask look-up walks."""

    uses = 0

    def __hash__(self) -> int:
        CountedId.uses += 1
        return int.__hash__(self)

    def __eq__(self, other) -> bool:
        CountedId.uses += 1
        return int.__eq__(self, other)


def counted(params: SamplingParams) -> SamplingParams:
    """params with their allowed ids made CountedIds, in the container SamplingParams made
    (SamplingParams itself turns ids into plain ints: set here as its __post_init__ sets fields)."""
    ids = params.allowed_token_ids
    object.__setattr__(params, "allowed_token_ids", type(ids)(CountedId(t) for t in ids))
    return params


def test_a_step_walks_none_of_the_allowed_ids_after_a_requests_first():
    """Python hashes a plain tuple anew at every use: finding a row's mask by its set hashed all of
    the set at every step (0.64 ms a row for 262144 ids), and a request sending the set another sent
    compared the two as well. Now a set is hashed once, a request's later steps go straight to its
    mask, and an equal set is compared once, at its request's first step; no_token_left does not
    walk a set larger than the stop tokens held back."""
    ids = range(0, 20000, 2)
    first = counted(SamplingParams(allowed_token_ids=ids, min_tokens=50))  # stop token 2 held back
    same = counted(SamplingParams(allowed_token_ids=ids))  # another request, the same set
    logits = torch.zeros(1, 20000)
    penalized(logits, [first], [[1]], [[]], [(2,)])  # its first step makes the mask
    CountedId.uses = 0
    for step in range(1, 5):
        penalized(logits, [first], [[1]], [[3] * step], [(2,)])
    assert CountedId.uses == 0
    penalized(logits, [same], [[1]], [[]])
    assert CountedId.uses <= len(ids)  # the two sets compared once (no hash: it was computed with the set)
    assert same.allowed_token_ids.mask_entry is first.allowed_token_ids.mask_entry  # one mask for both
    CountedId.uses = 0
    for step in range(1, 5):
        penalized(torch.zeros(2, 20000), [same, first], [[1], [1]], [[3] * step] * 2, [(), (2,)])
    assert CountedId.uses == 0


def test_the_masks_are_the_allowed_ids_exactly_for_sets_small_and_large():
    vocab = 50000
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    sets = [[7], list(range(0, vocab, 3)), list(range(vocab))]
    got = penalized(logits, [SamplingParams(allowed_token_ids=ids) for ids in sets], [[1]] * 3, [[]] * 3)
    for row, ids in enumerate(sets):
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[ids] = True
        assert torch.equal(got[row], torch.where(allowed, logits[row], float("-inf")))


def test_ids_past_the_logits_width_are_refused_at_every_step_and_cache_nothing():
    from workers.penalties import _masks

    params = [SamplingParams(allowed_token_ids=[3, 20, 40])]
    before = len(_masks)
    for step in range(2):  # not remembered: refused again, as the first time
        with pytest.raises(ValueError, match=r"^allowed_token_ids names token ids \[20, 40\] outside the logits' 16 "
                                             r"columns; send ids of this model's tokenizer$"):
            penalized(torch.zeros(1, 16), params, [[1]], [[4] * step])
    assert len(_masks) == before and params[0].allowed_token_ids.mask_entry is None


def test_the_least_recently_used_set_leaves_the_cache_and_lets_go_of_its_mask():
    from workers.penalties import ALLOWED_MASKS_KEPT, _masks

    vocab = 24  # a width no other test uses: these sets' masks are this test's own
    sets = [[SamplingParams(allowed_token_ids=[t, t + 1])] for t in range(ALLOWED_MASKS_KEPT + 1)]
    for params in sets[:-1]:
        penalized(torch.zeros(1, vocab), params, [[1]], [[]])
    penalized(torch.zeros(1, vocab), sets[0], [[1]], [[5]])  # used again: the most recent now
    penalized(torch.zeros(1, vocab), sets[-1], [[1]], [[]])  # one too many: sets[1]'s mask leaves
    assert len(_masks) == ALLOWED_MASKS_KEPT
    gone = sets[1][0].allowed_token_ids.mask_entry
    assert gone.key is None and gone.forbidden is None  # neither its mask nor its ids kept past the cache
    assert sets[0][0].allowed_token_ids.mask_entry.forbidden is not None
    again = penalized(torch.zeros(1, vocab), sets[1], [[1]], [[5]])  # made again, the same mask
    assert torch.nonzero(again[0].isfinite()).flatten().tolist() == [1, 2]
    assert len(_masks) == ALLOWED_MASKS_KEPT and sets[2][0].allowed_token_ids.mask_entry.key is None


def test_allowed_ids_pickle_as_plain_ids_and_hash_as_a_tuple():
    """SamplingParams go from the driver to rank 0 pickled: the leader's entry (a mask) stays behind."""
    import pickle

    params = SamplingParams(allowed_token_ids=[9, 2, 5])
    penalized(torch.zeros(1, 16), [params], [[1]], [[]])
    assert params.allowed_token_ids.mask_entry is not None
    sent = pickle.dumps(params)
    assert b"torch" not in sent and b"_MaskEntry" not in sent
    got = pickle.loads(sent)
    assert got == params and hash(got) == hash(params) and got.allowed_token_ids.mask_entry is None
    assert hash(got.allowed_token_ids) == hash((2, 5, 9)) and got.allowed_token_ids == (2, 5, 9)
    assert repr(got.allowed_token_ids) == "(2, 5, 9)"


# ---- generation ----------------------------------------------------------------------------------
def transformers_allowed_greedy(prompt: list[int], allowed: tuple[int, ...] | None) -> list[int]:
    """transformers' greedy tokens, restricted to `allowed` by its own prefix_allowed_tokens_fn."""
    ids = torch.tensor([prompt])
    restrict = None if allowed is None else (lambda batch_id, sent: list(allowed))
    with torch.inference_mode():
        out = hf_model().generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                                  eos_token_id=None, pad_token_id=0, prefix_allowed_tokens_fn=restrict)
    return out[0, len(prompt):].tolist()


def test_greedy_with_allowed_token_ids_equals_transformers_in_both_engines():
    params = SamplingParams(allowed_token_ids=ALLOWED)
    want = [transformers_allowed_greedy(p, ALLOWED) for p in PROMPTS]
    plain = [transformers_allowed_greedy(p, None) for p in PROMPTS]
    assert all(set(w) <= set(ALLOWED) for w in want)
    assert not any(set(p) <= set(ALLOWED) for p in plain)  # the restriction changes what this model generates
    static, served, companion = generated_in_both_engines(params)
    assert static == want and served == want
    assert companion == plain[0]  # a companion without the option is not restricted


def test_a_stop_token_left_out_cannot_end_the_request_and_an_allowed_one_still_does():
    """As in vLLM: allowed ids that exclude the stop tokens (EOS included) run to max tokens."""
    prompt = PROMPTS[0]
    restricted = transformers_allowed_greedy(prompt, ALLOWED)
    ending = restricted[1]  # allowed, and what greedy picks second
    outside = next(t for t in range(200) if t not in ALLOWED)
    loop = ServingLoop(fresh_model(), ServingConfig(2, 4, 64))
    threads = run_loops([loop])
    params = SamplingParams(allowed_token_ids=ALLOWED)
    loop.submit([request("runs", prompt, NEW, sampling=params, stop_token_ids=(outside,)),
                 request("ends", prompt, NEW, sampling=params, stop_token_ids=(ending,))])
    got = collect(loop, {"runs", "ends"})
    stop([loop], threads)
    assert got.finish["runs"] == "length" and got.tokens["runs"] == restricted
    assert got.finish["ends"] == "stop" and got.tokens["ends"] == restricted[:2]


def test_with_structured_output_only_tokens_both_allow_and_none_fails_that_request_alone(wide_model,
                                                                                          smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = tok.encode("Answer:")
    spec = StructuredOutput(choice=["yes", "no", "maybe so"])
    no = tuple(tok.encode("no"))
    assert tok.decode(list(no)) == "no"
    requests = [request("no", prompt, 20, sampling=SamplingParams(structured_output=spec, allowed_token_ids=no),
                        stop_token_ids=(EOS,)),
                request("none", prompt, 20, sampling=SamplingParams(structured_output=spec,
                                                                     allowed_token_ids=tok.encode(" x")),
                        stop_token_ids=(EOS,)),
                request("plain", prompt, 3)]
    out = run(fresh_loop(wide_model, tok), requests)
    assert out.finish == {"no": "stop", "none": "error", "plain": "length"}
    assert tok.decode(out.tokens["no"]) == "no" and len(out.tokens["plain"]) == 3
    [error] = [e.error for e in out.events if e.request_id == "none"]
    assert "no token is left that continues the structured output" in error and "allowed_token_ids" in error


def test_allowed_ids_that_are_all_held_back_stop_tokens_are_refused_before_submitting(model_and_expected,
                                                                                         in_process_cluster):
    """min_tokens holds stop tokens back: allowed ids that are all stop tokens leave nothing to choose.
    The leader failed such a request in its first step, and a static batch as a whole, after its
    prefill (review of 939b9e2): the driver refuses it first, on every path, naming the field."""
    from launcher.api import Launcher
    from shardlib.sampling_params import check_allowed_beyond_stops
    from tests.test_replicas import EAGER, PROMPTS as REPLICA_PROMPTS

    held = SamplingParams(allowed_token_ids=[7, 9], min_tokens=2)
    check_allowed_beyond_stops([held], (7,))  # 9 is left to choose
    check_allowed_beyond_stops([SamplingParams(allowed_token_ids=[7], min_tokens=0)], (7,))  # nothing held back
    words = r"allowed_token_ids \[7, 9\] are all stop tokens \(EOS included\), which min_tokens \(2\) holds back"
    with pytest.raises(ValueError, match=words):
        check_allowed_beyond_stops([SamplingParams(), held], (7, 9))
    model_dir, _ = model_and_expected
    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, **EAGER) as llm:
        both = [SamplingParams(), held]
        for batching in ("static", "continuous"):
            with pytest.raises(ValueError, match=words):
                llm.generate(REPLICA_PROMPTS[:2], both, max_new_tokens=4, stop_token_ids=[7, 9], batching=batching)
        with pytest.raises(ValueError, match=words):
            llm.stream(REPLICA_PROMPTS[0], held, max_new_tokens=4, stop_token_ids=[7, 9])
        assert llm.load() == {"running": 0, "waiting": 0}
        assert len(llm.generate(REPLICA_PROMPTS[:2], both, max_new_tokens=4, stop_token_ids=[7])) == 2


def test_a_row_with_fewer_allowed_tokens_than_its_top_k_keeps_the_batch_off_the_full_sort():
    """Its k-th value is -inf, which every column past its allowed ones equals: that was a tie at its
    cut, and the whole vocabulary was sorted for every row of the step (review of 939b9e2: 2.1 ms to
    67 ms for 16 rows). -inf is never drawn, so it ties nothing; a real tie still widens the cut."""
    from workers.sampling import _sorted

    logits = torch.randn(4, 1000)
    logits[1, 3:] = float("-inf")  # three tokens allowed, top_k 50
    values, ids = _sorted(logits, torch.tensor([[50], [50], [20], [50]]))
    assert values.shape[-1] == 50
    assert torch.equal(ids[1, :3], logits[1, :3].argsort(descending=True))
    tied = logits.clone()
    tied[0, :60] = 5.0  # 60 equal best values: row 0's 50th ties ten more
    assert _sorted(tied, torch.tensor([[50], [50], [20], [50]]))[0].shape[-1] == 60


def test_a_plain_tuple_of_allowed_ids_still_finds_its_mask():
    """SamplingParams keeps allowed ids as AllowedIds; a caller that hands penalties a plain tuple (a
    params object built around __post_init__) gets the same mask, not an AttributeError."""
    from workers.penalties import _forbidden

    plain = _forbidden((1, 3), 6, torch.device("cpu"))
    assert plain.tolist() == [True, False, True, False, True, True]
