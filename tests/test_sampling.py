"""Token selection: greedy, temperature, top-k, top-p, seeds, and parameter validation."""

from __future__ import annotations

import math

import pytest
import torch

from workers.sampling import SamplingParams, filtered_probs, make_generator, sample, sampling_table


def draw(logits: torch.Tensor, n: int, **params) -> list[int]:
    """n independent draws from one row of logits (vocab,), one seeded request per draw."""
    rows = [SamplingParams(seed=i, **params) for i in range(n)]
    return sample(logits.expand(n, -1), rows, [make_generator(p) for p in rows]).tolist()


def test_temperature_zero_is_argmax():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams()] * 6
    assert torch.equal(sample(logits, params, [None] * 6), logits.argmax(dim=-1))


def test_greedy_takes_the_first_of_equal_maxima_like_argmax():
    # Greedy reads max()'s indices (faster than argmax on CPU): ties must still pick as argmax.
    logits = torch.zeros(3, 49152)
    logits[0, [900, 5]] = 1.0  # a tie: the lower index
    logits[1, [49151, 100]] = 2.0
    logits[2, 7] = -float("inf")  # -inf beside finite values is a token masked off
    tokens = sample(logits, [SamplingParams()] * 3, [None] * 3)
    assert tokens.tolist() == [5, 100, 0]
    assert torch.equal(tokens, logits.argmax(dim=-1))


@pytest.mark.parametrize("greedy", [True, False])
def test_logits_with_nan_or_nothing_finite_are_refused_greedy_or_not(greedy):
    """A broken forward: greedy took token 0 (or the NaN's column) silently while a sampled row
    raised multinomial's error; both now name the rows."""
    logits = torch.zeros(4, 300)
    logits[1, [40, 3]] = float("nan")
    logits[3] = float("-inf")
    params = [SamplingParams() if greedy else SamplingParams(temperature=0.8, seed=1)] * 4
    with pytest.raises(ValueError, match=r"logits in row\(s\) \[1, 3\] hold NaN or \+inf, or no finite value"):
        sample(logits, params, [make_generator(p) for p in params])


def test_greedy_and_sampled_rows_mix_in_one_batch():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    tokens = sample(logits, params, [make_generator(p) for p in params])
    assert tokens[1] == logits[1].argmax()
    # the sampled row draws what its seed draws alone: the greedy row beside it takes nothing from it
    alone = sample(logits[:1], params[:1], [make_generator(params[0])])
    assert tokens[0] == alone[0]


def test_same_seed_same_tokens_different_seeds_differ():
    flat = torch.zeros(1000)  # every token equally likely
    params = SamplingParams(temperature=1.0, seed=7)

    def run(p: SamplingParams) -> list[int]:
        gen = make_generator(p)
        return [sample(flat[None], [p], [gen]).item() for _ in range(20)]

    assert run(params) == run(params)
    assert run(params) != run(SamplingParams(temperature=1.0, seed=8))
    # a negative seed (OpenAI's API takes any signed 64-bit one) is a seed of its own
    negative = SamplingParams(temperature=1.0, seed=-7)
    assert run(negative) == run(negative) and run(negative) != run(params)
    # torch's CPU generator reads only a seed's low 32 bits: these drew the same tokens before
    for a, b in ((-2**63, 0), (1, 2**32 + 1), (2**63 - 1, 2**32 - 1)):
        assert run(SamplingParams(temperature=1.0, seed=a)) != run(SamplingParams(temperature=1.0, seed=b))


def test_top_k_never_draws_outside_the_top_k():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(2))
    top5 = set(logits.topk(5).indices.tolist())
    drawn = draw(logits, 2000, temperature=2.0, top_k=5)
    assert set(drawn) <= top5
    assert len(set(drawn)) >= 4  # it samples, it does not just take the argmax


def test_top_k_one_is_greedy():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3))
    assert set(draw(logits, 50, temperature=5.0, top_k=1)) == {logits.argmax().item()}


def test_top_p_drops_the_tail():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    drawn = draw(probs.log(), 2000, temperature=1.0, top_p=0.7)
    # 0.5 before token 1 is below 0.7, so it stays; 0.8 before token 2 is not.
    assert set(drawn) == {0, 1}
    assert 0.55 < drawn.count(0) / len(drawn) < 0.70  # renormalised: 0.5 / 0.8 = 0.625


def test_top_p_drops_a_token_whose_mass_before_it_equals_top_p():
    """The cut at the exact boundary, as transformers' (a token stays while the mass before it is
    below top_p): powers of two make the float32 sums exact, so `<=` here would keep token 1."""
    probs = torch.tensor([0.5, 0.25, 0.25])
    assert set(draw(probs.log(), 300, temperature=1.0, top_p=0.5)) == {0}
    assert set(draw(probs.log(), 300, temperature=1.0, top_p=0.5001)) == {0, 1}  # past it: the next one too


def test_top_p_keeps_the_most_likely_token_at_least():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(4))
    assert set(draw(logits, 50, temperature=1.0, top_p=1e-6)) == {logits.argmax().item()}


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    cold = draw(logits, 1000, temperature=0.1)
    hot = draw(logits, 1000, temperature=10.0)
    assert cold.count(0) > 990
    assert min(hot.count(t) for t in range(4)) > 150


def test_sampling_table_rows():
    table = sampling_table([SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.25), SamplingParams()])
    assert table.shape == (2, 4)
    assert table.tolist() == [[40.0, pytest.approx(0.9), pytest.approx(0.7), 0.25], [0.0, 1.0, 0.0, 0.0]]


def test_row_count_mismatch_is_refused():
    with pytest.raises(ValueError, match="2 rows but 1 SamplingParams and 1 generators"):
        sample(torch.zeros(2, 10), [SamplingParams()], [None])


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.5), r"temperature=-0\.5 must be a finite number >= 0"),
    (dict(temperature=math.nan), r"temperature=nan must be a finite number"),
    # float32 infinity on the ranks: top-k and top-p kept tokens by id, not by likelihood
    (dict(temperature=1e39), r"temperature=1e\+39 must be at most 3\.402823e\+38 \(float32's largest value"),
    (dict(top_k=-2), r"top_k=-2 must be an integer >= 0"),
    (dict(top_k=-1.0), r"top_k=-1\.0 must be an integer"),  # vLLM's -1 is an integer, as every top_k here
    (dict(top_k=2.5), r"top_k=2\.5 must be an integer"),
    (dict(top_p=0.0), r"top_p=0\.0 must be a number in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p=1\.5 must be a number in \(0, 1\]"),
    (dict(seed=-2**63 - 1), r"seed=-9223372036854775809 must be None or an integer in \[-2\*\*63, 2\*\*63 - 1\]"),
    (dict(seed=2**63), r"seed=9223372036854775808 must be None or an integer in \[-2\*\*63, 2\*\*63 - 1\]"),
    (dict(seed="42"), r"seed='42' must be None or an integer"),
])
def test_invalid_params_name_the_value_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_top_k_of_minus_one_is_vllms_every_token():
    """vLLM's SamplingParams writes "no limit" as top_k=-1 (long its default); code ported from its
    LLM.generate was refused here, though the HTTP server already read -1 as no limit."""
    params = SamplingParams(temperature=1.0, top_k=-1, seed=3)
    assert params.top_k == 0
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    drawn = [sample(logits, [params] * 4, [torch.Generator().manual_seed(3) for _ in range(4)]) for params in
             (params, SamplingParams(temperature=1.0, top_k=0, seed=3))]
    assert torch.equal(drawn[0], drawn[1])


def test_the_largest_temperature_taken_still_keeps_the_most_likely_tokens():
    from shardlib.sampling_params import MAX_TEMPERATURE

    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0)) * 3
    probs, ids = filtered_probs(logits, sampling_table([SamplingParams(temperature=MAX_TEMPERATURE, top_k=5)]))
    assert set(ids[0][probs[0] > 0].tolist()) == set(logits[0].topk(5).indices.tolist())


def test_temperature_zero_ignores_top_k_and_top_p():
    logits = torch.randn(4, 60, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.3, seed=1)] * 4
    assert torch.equal(sample(logits, params, [make_generator(p) for p in params]), logits.argmax(dim=-1))


def test_top_k_then_top_p_together():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top-k 3 renormalises to (0.44, 0.33, 0.22); mass before token 2 is 0.78 >= 0.6, so it goes.
    drawn = draw(probs.log(), 1000, temperature=1.0, top_k=3, top_p=0.6)
    assert set(drawn) == {0, 1}


def test_top_k_fast_path_keeps_the_same_distribution_as_the_full_sort():
    from workers.sampling import filtered_probs

    logits = torch.randn(2, 500, generator=torch.Generator().manual_seed(6))
    row = [SamplingParams(temperature=0.7, top_k=7, top_p=0.9)]
    fast_probs, fast_ids = filtered_probs(logits[:1], sampling_table(row))  # every row has top_k: topk path
    mixed = row + [SamplingParams(temperature=1.0)]  # a row without top_k forces the full sort
    full_probs, full_ids = filtered_probs(logits, sampling_table(mixed))
    assert fast_probs.shape == (1, 7) and full_probs.shape == (2, 500)
    assert torch.equal(fast_ids[0], full_ids[0, :7])
    torch.testing.assert_close(fast_probs[0], full_probs[0, :7], rtol=0, atol=1e-7)
    assert full_probs[0, 7:].sum() == 0


def test_a_top_k_past_float32_range_keeps_every_token():
    """top_k 10**39 is infinite in float32: the table caps it, and the row samples as with top-k off
    (before, int(inf) raised in the leader's step and brought its group down)."""
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(8))
    for k in (10**39, 2**24 + 1, 300):
        huge = [SamplingParams(temperature=0.9, top_k=k, seed=4)]
        plain = [SamplingParams(temperature=0.9, seed=4)]
        assert sampling_table(huge)[0, 0].item() == min(k, 2**24)
        assert torch.equal(sample(logits, huge, [make_generator(huge[0])]),
                           sample(logits, plain, [make_generator(plain[0])]))


@pytest.mark.parametrize("temperature", [1e-50, 1e-40, 1e-8, 9.9e-6])
def test_a_temperature_below_the_greedy_threshold_is_greedy(temperature):
    """1e-40 is a float32 denormal that divided the logits into infinities (NaN probabilities:
    multinomial raised), and 1e-50 rounds to 0 (it sampled at temperature 1): both are the argmax
    now, as is anything below 1e-5."""
    logits = torch.randn(3, 400, generator=torch.Generator().manual_seed(9)) * 30
    params = [SamplingParams(temperature=temperature, top_k=0, seed=s) for s in range(3)]
    assert all(p.is_greedy for p in params)
    assert torch.equal(sample(logits, params, [make_generator(p) for p in params]), logits.argmax(dim=-1))
    assert not SamplingParams(temperature=1e-5).is_greedy


def _reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers (temperature, top-k, top-p, min-p, in its generate() order) on one row: (vocab,)."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)

    scores = TemperatureLogitsWarper(params.temperature)(None, logits[None].float())
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p > 0:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    return scores.softmax(dim=-1)[0]


def _by_token(probs: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.zeros(vocab).scatter(0, ids, probs)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=2),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.95),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, min_p=0.05),
    SamplingParams(temperature=0.6, min_p=0.3),
    SamplingParams(temperature=1.3, top_k=40, top_p=0.8, min_p=0.1),
    SamplingParams(temperature=1.0, min_p=1.0),  # the most likely token and its equals only
])
def test_kept_tokens_and_their_probabilities_are_transformers(params):
    """Ties at the top-k cut all stay (kept were the first k columns: 4 tokens tied at the 2nd logit
    left 1 drawable, and the top token's probability went from 0.40 to 0.72); bfloat16-valued logits
    tie often."""
    from workers.sampling import filtered_probs

    ties = torch.full((1000,), -4.0)
    ties[3], ties[[10, 200, 500, 900]] = 5.0, 4.0
    bf16 = (torch.randn(49152, generator=torch.Generator().manual_seed(11)) * 3).bfloat16().float()
    for row in (ties, bf16):
        probs, ids = filtered_probs(row[None], sampling_table([params]))
        ours, reference = _by_token(probs[0], ids[0], row.numel()), _reference_probs(row, params)
        assert torch.equal(ours > 0, reference > 0)
        torch.testing.assert_close(ours, reference, rtol=0, atol=1e-6)


def test_min_p_alone_draws_only_the_tokens_it_keeps():
    """A request with min_p and no top-k or top-p must not take the unfiltered path that rows keeping
    every token take: its draws stay among the tokens at least min_p times as likely as the best."""
    probs = torch.tensor([0.5, 0.3, 0.12, 0.08])
    assert set(draw(probs.log(), 400, temperature=1.0, min_p=0.5)) == {0, 1}
    assert set(draw(probs.log(), 400, temperature=1.0, min_p=0.2)) == {0, 1, 2}
    assert set(draw(probs.log(), 400, min_p=0.9)) == {0}  # min_p alone samples at temperature 1
    assert SamplingParams(min_p=0.1).temperature == 1.0 and SamplingParams(min_p=0.0).is_greedy
    for bad in (-0.1, 1.5, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match=r"^min_p=.* must be a number in \[0, 1\]"):
            SamplingParams(min_p=bad)


def test_top_p_one_keeps_the_whole_tail():
    """float32 cumulative sums of a 128k vocabulary reach 1.0 early: the tail's mass before reads
    1.0, which is not below top_p 1.0, and 73772 tokens could never be drawn."""
    from workers.sampling import filtered_probs

    logits = torch.randn(1, 128256, generator=torch.Generator().manual_seed(12)) * 3
    probs, _ = filtered_probs(logits, sampling_table([SamplingParams(temperature=0.7)]))
    assert int((probs > 0).sum()) == int((logits / 0.7).softmax(-1).gt(0).sum())


@pytest.mark.parametrize("neighbour", [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_k=100),
                                       SamplingParams()])
def test_a_seeded_rows_tokens_do_not_depend_on_its_neighbours(neighbour):
    """The columns' width (topk of the largest top_k, or the full sort) came from the other rows, and
    with it the order of tied logits and the token a drawn column names: beside a top_k 0 request a
    seeded top_k 50 request drew other tokens in 91 of 300 draws. Both draw-seeded (the serving
    engine) and one generator through the draws (the static engine)."""
    from workers.serving.token_choice import draw_seed

    own = SamplingParams(temperature=1.0, top_k=50, seed=7)
    logits = (torch.randn(60, 2, 49152, generator=torch.Generator().manual_seed(13)) * 3).bfloat16().float()

    def draws(with_neighbour: bool, reseed: bool) -> list[int]:
        generator = make_generator(own)
        out = []
        for step, rows in enumerate(logits):
            if reseed:
                generator.manual_seed(draw_seed(7, step))
            if with_neighbour:
                out.append(sample(rows, [own, neighbour], [generator, make_generator(neighbour)])[0].item())
            else:
                out.append(sample(rows[:1], [own], [generator])[0].item())
        return out

    for reseed in (True, False):
        assert draws(True, reseed) == draws(False, reseed)


def test_top_logprobs_list_equal_logits_by_id_with_the_greedy_token_first():
    """topk orders equal values as it likes: a greedy token (the lowest id among equal maxima) was
    often listed after its equals, and ties at the cut kept any of them."""
    from tests.serving_driver import request
    from workers.serving.scheduler import Sequence
    from workers.serving.token_choice import choose

    logits = torch.full((1, 64), -5.0)
    logits[0, [40, 31, 9, 60, 12]] = 2.0  # five equal maxima
    logits[0, 3] = 1.0
    seq = Sequence(request("r", [1, 2], 4, logprobs=3))
    [token], [entry] = choose(logits, [seq])
    assert token == 9 and [t for t, _ in entry.top] == [9, 12, 31]  # the cut falls inside the tie
    seq = Sequence(request("r", [1, 2], 4, logprobs=6))
    [token], [entry] = choose(logits, [seq])
    assert [t for t, _ in entry.top] == [9, 12, 31, 40, 60, 3]


def test_numpy_and_torch_scalars_are_taken_as_plain_numbers():
    """SamplingParams(top_k=np.int64(50)) was refused "must be an integer >= 0", a rule the value
    met, while prompts took numpy's integers; they are now read as Python's, bools still refused."""
    import numpy as np

    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(50), top_p=np.float64(0.9),
                            seed=torch.tensor(7))
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (0.5, 50, 0.9, 7)
    assert [type(v) for v in (params.temperature, params.top_k, params.top_p, params.seed)] == [float, int, float, int]
    for bad, words in ((dict(top_k=np.True_), "top_k"), (dict(top_k=torch.tensor(True)), "top_k"),
                       (dict(temperature="0.7"), "temperature"), (dict(top_k=np.float64(3.0)), "top_k"),
                       (dict(top_p=np.float32("nan")), "top_p")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**bad)


def test_zero_dim_float_tensors_are_taken_as_plain_numbers():
    """SamplingParams(temperature=torch.tensor(0.5)) was refused "must be a finite number >= 0", a
    rule the value met, while LaunchConfig took the same tensor; 0-d float tensors are read as float,
    tensors of other shapes and bool tensors still refused."""
    params = SamplingParams(temperature=torch.tensor(0.5), top_p=torch.tensor(0.9, dtype=torch.float64),
                            top_k=torch.tensor(3))
    assert (params.temperature, params.top_k, params.top_p) == (0.5, 3, 0.9)
    assert [type(v) for v in (params.temperature, params.top_k, params.top_p)] == [float, int, float]
    for bad, words in ((dict(temperature=torch.tensor([0.5])), "temperature"),
                       (dict(temperature=torch.tensor(True)), "temperature"),
                       (dict(top_k=torch.tensor(2.0)), "top_k")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(**bad)


def test_a_device_without_torch_generators_draws_on_the_host():
    """Neuron's eager path keeps its model on an XLA device, which has no torch.Generator: every
    seeded request (and every sampled one, served) failed making its generator. Such a device's
    tokens are drawn on the host; CPU and CUDA keep drawing where their logits are."""
    from tests.serving_driver import request
    from workers.sampling import sampling_device
    from workers.serving.scheduler import Sequence
    from workers.serving.token_choice import request_generator

    xla = torch.device("xla", 0)  # a device torch names without torch_xla loaded
    assert make_generator(SamplingParams(seed=1, temperature=1.0), xla).device == torch.device("cpu")
    sampled = Sequence(request("r", [1, 2], 4, sampling=SamplingParams(temperature=1.0)))
    assert request_generator(sampled, xla).device == torch.device("cpu")
    assert sampling_device("cpu") == torch.device("cpu") and sampling_device("cuda:1") == torch.device("cuda", 1)
    logits = torch.randn(3, 50)  # and the tokens come back on the logits' own device
    rows = [SamplingParams(seed=i, temperature=1.0) for i in range(3)]
    assert sample(logits, rows, [make_generator(p) for p in rows]).device == logits.device


def test_top_k_or_top_p_without_a_temperature_samples_and_a_lone_seed_is_refused():
    """SamplingParams(top_k=50, top_p=0.9) was greedy (the temperature defaulted to 0) and
    SamplingParams(seed=7) was taken and dropped, both without a word, where `corelaunch generate
    --top-k 50` samples at temperature 1 and a lone --seed is refused."""
    from shardlib.sampling_params import SamplingParams as Params

    assert Params().temperature == 0.0 and Params().is_greedy
    assert Params(top_k=50).temperature == 1.0 and Params(top_p=0.9, seed=3).temperature == 1.0
    assert Params(top_k=50, temperature=0.0).is_greedy  # an explicit 0 stays greedy, as OpenAI's API takes it
    assert Params(temperature=0.0, seed=1).seed == 1
    with pytest.raises(ValueError, match=r"^seed=7 seeds sampling, and nothing asks for sampling .* give a "
                                         r"temperature, or top_k / top_p / min_p \(which sample at temperature 1\)$"):
        Params(seed=7)
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))[0]
    assert len(set(draw(logits, 200, top_k=10))) > 1  # draw() seeds each request: it samples now


def test_inverse_cdf_draws_in_proportion_and_never_a_column_of_probability_zero():
    from workers.sampling import inverse_cdf

    p = torch.tensor([0.5, 0.0, 0.25, 0.0, 0.125, 0.125] + [0.0] * 300)  # 306 columns: not whole blocks
    u = torch.rand(40000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    columns = inverse_cdf(p[None].expand(40000, -1).contiguous(), u)
    share = torch.bincount(columns, minlength=306).double() / 40000
    assert torch.allclose(share[:6], p[:6].double(), atol=0.01) and share[6:].sum() == 0 and share[1] == share[3] == 0


def test_inverse_cdf_at_the_ends_of_u_gives_the_first_and_last_columns_that_can_be_drawn():
    from workers.sampling import INVERSE_CDF_BLOCK, inverse_cdf

    p = torch.zeros(3 * INVERSE_CDF_BLOCK + 7)
    p[INVERSE_CDF_BLOCK + 3], p[2 * INVERSE_CDF_BLOCK + 9] = 0.75, 0.25  # in the second and third blocks
    rows = p[None].expand(4, -1).contiguous()
    u = torch.tensor([0.0, 0.74999, 1 - 2**-53, 1.0], dtype=torch.float64)  # 1.0: rounding's worst case
    assert inverse_cdf(rows, u).tolist() == [INVERSE_CDF_BLOCK + 3, INVERSE_CDF_BLOCK + 3] + [2 * INVERSE_CDF_BLOCK + 9] * 2


def test_inverse_cdf_reaches_a_long_tail_of_tiny_probabilities():
    """float32 running totals over the vocabulary step in units of their last place (6e-8 near 1):
    a tail of 1e-9 tokens after a likely one is drawn 40 tokens off the exact place with them. The
    two-level float64 totals land within a few."""
    from workers.sampling import inverse_cdf

    vocab, tiny = 49152, 1e-9
    p = torch.full((1, vocab), tiny)
    p[0, 0] = 1 - tiny * (vocab - 1)
    column = int(inverse_cdf(p, torch.tensor([1 - 1e-5], dtype=torch.float64))[0])
    expected = round((tiny * (vocab - 1) - 1e-5) / tiny)  # that far into the tail
    assert abs(column - expected) <= 8, (column, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top_p_over_the_most_likely_columns_keeps_what_the_full_sort_keeps(dtype):
    """Rows with top-p and no top-k are filtered over their 256 (then 2048) most likely columns when
    their kept tokens all lie there (temperatures up to 1): the same tokens, in the same order, with the same
    probabilities as over the sorted vocabulary; the others (a flat row, a tie across the cut)
    fall back to it. bfloat16-valued logits tie often."""
    from workers.sampling import TOP_P_WIDTHS, _sorted_probs, _scaled

    g = torch.Generator().manual_seed(11)
    vocab = 5000
    sharp = (torch.randn(6, vocab, generator=g) * 6).to(dtype).float()  # a few dozen tokens hold 0.9
    flat = (torch.randn(2, vocab, generator=g) * 0.5).to(dtype).float()  # thousands do: the full sort
    tied = torch.full((1, vocab), -20.0)
    tied[0, :300] = 5.0  # 300 equal tokens across column 256: not certain there, certain among 2048
    logits = torch.cat([sharp, flat, tied])
    params = [SamplingParams(temperature=t, top_p=p, min_p=m) for t, p, m in
              [(1.0, 0.9, 0.0), (0.7, 0.95, 0.0), (1.3, 0.5, 0.0), (1.0, 0.9, 0.05), (0.0, 0.8, 0.0), (2.0, 0.99, 0.0),
               (1.0, 0.9, 0.0), (1.0, 0.95, 0.0), (1.0, 0.501, 0.0)]]
    table = sampling_table(params)
    probs, ids = filtered_probs(logits, table)
    full_probs, full_ids = _sorted_probs(_scaled(logits, table[:, 2:3]), table)
    for row in range(len(params)):
        kept = int((probs[row] > 0).sum())
        assert kept == int((full_probs[row] > 0).sum()) and kept > 0
        assert torch.equal(ids[row, :kept], full_ids[row, :kept])
        torch.testing.assert_close(probs[row, :kept], full_probs[row, :kept], rtol=1e-5, atol=1e-7)
    assert ids[-1, :151].tolist() == list(range(151)) and TOP_P_WIDTHS[0] < 300  # the tie's first 151, by id
    assert filtered_probs(logits[:2], table[:2])[0].shape == (2, TOP_P_WIDTHS[0])  # both fit 256 columns
    cool = [0, 1, 3, 4]  # temperatures of at most 1
    assert filtered_probs(logits[cool], table[cool])[0].shape[-1] < vocab  # no row needed the full sort
    assert filtered_probs(logits[2:3], table[2:3])[0].shape[-1] == vocab  # temperature 1.3: the full sort


@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}, {"top_k": 3}, {"min_p": 0.1}],
                         ids=["whole", "top-p", "top-k", "min-p"])
def test_logits_at_float32s_edge_under_a_temperature_below_1_are_drawn_from(extra):
    """Finite logits at float32's edge (a repetition penalty near its smallest makes them) divided by
    a temperature below 1 were infinite, their softmax NaN: the request was refused mid-generation
    (before that, column 0 was drawn silently), though the distribution is well defined: token 2,
    the largest by 1e37, all but certainly. Scaled less the row's largest, nothing overflows."""
    logits = torch.tensor([[1.0, 2.9e38, 3.0e38, 0.0]])
    for seed in range(5):
        params = [SamplingParams(temperature=0.5, seed=seed, **extra)]
        assert sample(logits, params, [make_generator(params[0])]).tolist() == [2]


def test_a_repetition_penalty_near_its_smallest_samples_below_temperature_1():
    """The reviewer's case: the prompt token 0's logit 3 divided by 1.2e-38 is held near float32's
    largest; at temperature 0.5 sample raised "cannot be sampled", at 0 and 1 it chose token 0."""
    from workers.penalties import penalized

    logits = torch.tensor([[3.0, 1.0, 0.5, -1.0]])
    for temperature in (0.0, 1.0, 0.5, 0.01):
        params = [SamplingParams(temperature=temperature, repetition_penalty=1.2e-38, seed=1)]
        scores = penalized(logits, params, [[0]], [[]])
        assert scores[0, 0] > 1e38  # at float32's edge, finite
        assert sample(scores, params, [make_generator(params[0])]).tolist() == [0]


def test_a_row_with_few_finite_logits_keeps_to_the_top_p_fast_path():
    """Structured output's masks leave a few tokens finite: with the (width + 1)-th logit -inf the
    cut is certain among the first width columns (it went on to the 2048 topk and the full sort)."""
    from workers.sampling import TOP_P_WIDTHS

    logits = torch.full((3, 5000), float("-inf"))
    logits[0, 7], logits[1, [3, 40, 4999]], logits[2, :300] = 1.0, torch.tensor([2.0, 1.0, 0.5]), 0.0
    table = sampling_table([SamplingParams(temperature=0.7, top_p=0.9)] * 2)
    probs, ids = filtered_probs(logits[:2], table)
    assert probs.shape == (2, TOP_P_WIDTHS[0])
    assert ids[0, 0] == 7 and probs[0, 0] == 1 and probs[0, 1:].sum() == 0
    assert ids[1, :3].tolist() == [3, 40, 4999] and torch.isclose(probs[1].sum(), torch.tensor(1.0))
    wide, _ = filtered_probs(logits[2:], table[:1])  # 300 finite ties across column 256: not certain there
    assert wide.shape[-1] == TOP_P_WIDTHS[1]
