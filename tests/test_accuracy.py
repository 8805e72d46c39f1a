"""shardlib.evaluation.accuracy on synthetic tensors: token matching, top-k groups, divergences, teacher forcing."""

from __future__ import annotations

import math

import pytest
import torch

from shardlib.evaluation.accuracy import (DEFAULT_TOL_MAP, check_position, logit_matching, parse_tol_map,
                               token_matching)

PROMPT = [3, 1, 4, 1, 5]
VOCAB = 64


def peaked_logits(num_tokens: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """(num_tokens, vocab) float32 logits of LLM-like size (max about 20) with a clear argmax per
    row (gap >= 5 to the runner-up)."""
    g = torch.Generator().manual_seed(seed)
    logits = 5 * torch.randn(num_tokens, vocab, generator=g)
    top = torch.randint(vocab, (num_tokens,), generator=g)
    logits[torch.arange(num_tokens), top] = logits.max(dim=1).values + 5.0
    return logits


class FakeCorelaunch:
    """Plays corelaunch for logit_matching: `actual` (n, vocab) holds the logits corelaunch produces on
    the expected path. After its own greedy token leaves that path, the rest of a run is noise (as a
    real model would then be answering another prefix), so those rows must never be compared."""

    def __init__(self, expected_tokens: list[int], actual: torch.Tensor):
        self.expected, self.actual, self.calls = expected_tokens, actual, []

    def __call__(self, ids: list[int], count: int):
        assert ids[:len(PROMPT)] == PROMPT
        start = len(ids) - len(PROMPT)
        assert ids[len(PROMPT):] == self.expected[:start], "teacher forcing must feed the expected prefix"
        self.calls.append((start, count))
        rows = self.actual[start:start + count].clone()
        tokens = rows.argmax(dim=1).tolist()
        for i, tok in enumerate(tokens):
            if tok != self.expected[start + i]:  # left the expected path: the rest is noise
                rows[i + 1:] = torch.randn(count - i - 1, rows.shape[1]) * 50
                tokens[i + 1:] = rows[i + 1:].argmax(dim=1).tolist()
                break
        return tokens, rows


def make_tie(logits: torch.Tensor, position: int, margin: float) -> tuple[torch.Tensor, int]:
    """Put the runner-up of `position` 1e-4 below its top in the expected logits, and return actual
    logits where that runner-up beats the expected token by `margin` (a divergence of that size)."""
    expected = logits.clone()
    top = int(expected[position].argmax())
    runner_up = int(expected[position].topk(2).indices[1])
    expected[position, runner_up] = expected[position, top] - 1e-4
    actual = expected.clone()
    actual[position, runner_up] = actual[position, top] + margin
    return expected, actual, runner_up


def test_identical_logits_pass_with_zero_error_in_one_run():
    expected = peaked_logits(6)
    tokens = expected.argmax(dim=1).tolist()
    fake = FakeCorelaunch(tokens, expected.clone())
    result = logit_matching(PROMPT, expected, fake)
    assert result.passed and result.runs == 1 and fake.calls == [(0, 6)]
    assert result.divergences == [] and result.first_failure is None
    assert result.first_pass_tokens == tokens == result.expected_tokens
    assert [g.max_abs_error for g in result.groups] == [0.0] * len(DEFAULT_TOL_MAP)
    report = result.to_dict()
    assert report["passed"] and set(report["top_k"]) == {"top5", "top50", "top1000", "all"}


def test_tie_within_tolerance_at_a_divergence_passes_and_teacher_forcing_continues():
    expected, actual, runner_up = make_tie(peaked_logits(6), position=2, margin=0.0005)
    tokens = expected.argmax(dim=1).tolist()
    fake = FakeCorelaunch(tokens, actual)
    result = logit_matching(PROMPT, expected, fake)
    assert result.passed, result.to_dict()["first_failure"]
    # one run from the prompt, then one from the prompt + expected tokens 0..2
    assert fake.calls == [(0, 6), (3, 3)] and result.runs == 2
    [div] = result.divergences
    assert (div.position, div.expected_token, div.actual_token) == (2, tokens[2], runner_up)
    assert div.divergence_difference == pytest.approx(0.0005, abs=2e-6)
    assert result.first_pass_tokens[:2] == tokens[:2] and result.first_pass_tokens[2] == runner_up
    assert [p.position for p in result.positions] == list(range(6))  # every position checked once


def test_real_divergence_fails_at_its_position_with_its_magnitude_and_checking_goes_on():
    expected, actual, runner_up = make_tie(peaked_logits(8, seed=1), position=4, margin=0.05)
    tokens = expected.argmax(dim=1).tolist()
    fake = FakeCorelaunch(tokens, actual)
    result = logit_matching(PROMPT, expected, fake)
    assert not result.passed
    failure = result.first_failure
    assert failure.position == 4 and not failure.divergence_passed
    assert failure.divergence_difference == pytest.approx(0.05, abs=1e-5)
    assert all(g.passed for g in failure.groups)  # only the divergence fails, not the logits' closeness
    assert "position 4" in failure.failures()[0] and "divergence_difference_tol" in failure.failures()[0]
    assert fake.calls == [(0, 8), (5, 3)]
    assert [p.passed for p in result.positions] == [True] * 4 + [False] + [True] * 3
    report = result.to_dict()
    assert report["divergences"] == [{"position": 4, "expected_token": tokens[4], "actual_token": runner_up,
                                      "divergence_difference": failure.divergence_difference,
                                      "actual_token_gap": 0.0, "passed": False}]  # its own greedy token
    assert report["first_failure"]["position"] == 4


def test_divergence_tolerance_is_settable():
    expected, actual, _ = make_tie(peaked_logits(5, seed=2), position=1, margin=0.05)
    tokens = expected.argmax(dim=1).tolist()
    strict = logit_matching(PROMPT, expected, FakeCorelaunch(tokens, actual))
    loose = logit_matching(PROMPT, expected, FakeCorelaunch(tokens, actual), divergence_difference_tol=0.1)
    assert not strict.passed and loose.passed


def test_divergence_at_the_last_position_needs_no_rerun():
    expected, actual, _ = make_tie(peaked_logits(4, seed=3), position=3, margin=0.0002)
    fake = FakeCorelaunch(expected.argmax(dim=1).tolist(), actual)
    result = logit_matching(PROMPT, expected, fake)
    assert result.passed and fake.calls == [(0, 4)] and len(result.divergences) == 1


def ranked_logits(vocab: int = 2000, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct logits from 10 down to 0 (so every group's max |expected| is 10) in a shuffled
    vocabulary; returns (logits, vocabulary index of each rank)."""
    g = torch.Generator().manual_seed(seed)
    by_rank = torch.linspace(10, 0, vocab, dtype=torch.float64)
    order = torch.randperm(vocab, generator=g)  # order[r] = vocabulary index of rank r
    logits = torch.empty(vocab, dtype=torch.float64)
    logits[order] = by_rank
    return logits.float(), order


@pytest.mark.parametrize("rank, rel, failing", [
    (0, 0.015, {5}),        # a top-5 logit off by 1.5% of the max: only top 5 (rtol 0.01) fails
    (20, 0.025, {50}),      # rank 20, 2.5%: outside the top 5; top 50 (0.02) fails, top 1000 (0.03) holds
    (500, 0.035, {1000}),   # rank 500, 3.5%: only top 1000 (0.03) fails; all (0.05) holds
    (1500, 0.06, {None}),   # rank 1500, 6%: only the whole vocabulary (0.05) fails
    (30, 0.015, set()),     # 1.5% at rank 30: within top 50's 2%
])
def test_each_top_k_group_has_its_own_tolerance(rank, rel, failing):
    expected, order = ranked_logits()
    actual = expected.clone()
    token = int(order[rank])
    sign = 1.0 if rank == 0 else -1.0  # raise the top logit, lower others: the argmax never changes
    actual[token] += sign * rel * 10
    check = check_position(expected, actual, position=7)
    assert check.divergence_difference is None
    assert {g.top_k for g in check.groups if not g.passed} == failing
    for g in check.groups:
        if g.top_k is None or rank < g.top_k:  # the group holds the perturbed logit
            assert g.token_id == token
            assert g.max_abs_error == pytest.approx(rel * 10, rel=1e-4)
            assert g.max_rel_error == pytest.approx((rel * 10 - 1e-5) / 10, rel=1e-4)
    assert len(check.failures()) == len(failing)
    for line in check.failures():
        assert f"token {token}" in line and "position 7" in line


def test_atol_absorbs_small_errors_and_is_settable():
    expected, order = ranked_logits()
    actual = expected.clone()
    actual[int(order[1])] -= 0.15  # 1.5% of the max in the top 5
    assert not check_position(expected, actual).passed
    tol = parse_tol_map("5:0.01,all:0.05", atol=0.2)
    check = check_position(expected, actual, tol_map=tol)
    assert check.passed and [g.max_rel_error for g in check.groups] == [0.0, 0.0]


def test_groups_larger_than_the_vocabulary_cover_it_and_minus_inf_is_ignored():
    expected = peaked_logits(1, vocab=40)[0]
    actual = expected.clone()
    expected[7] = actual[7] = -math.inf  # a token both sides forbid is left out
    actual[3] = expected[3] + 0.001
    check = check_position(expected, actual)
    assert check.passed
    groups = {g.top_k: g for g in check.groups}
    assert groups[1000].max_abs_error == groups[None].max_abs_error == pytest.approx(0.001, rel=1e-3)
    assert groups[1000].token_id == 3 and math.isfinite(groups[None].max_rel_error)


@pytest.mark.parametrize("where, value", [("actual", math.nan), ("expected", math.nan), ("actual", math.inf),
                                          ("actual", -math.inf), ("expected", -math.inf)])
def test_a_logit_nan_or_infinite_on_one_side_fails_its_position(where, value):
    """Such entries were left out of every group: NaN logits everywhere but the chosen token passed,
    as did a token one side forbade (-inf) while the other ranked it second."""
    expected = peaked_logits(1, vocab=40)[0]
    actual = expected.clone()
    second = int(expected.topk(2).indices[1])
    (actual if where == "actual" else expected)[second] = value
    check = check_position(expected, actual, position=2)
    assert not check.passed and check.non_finite_tokens == [second] and check.non_finite_count == 1
    assert f"position 2: 1 logit(s) NaN or infinite on one side (at tokens [{second}])" in check.failures()[0]
    clean = peaked_logits(1, vocab=40)[0]
    everywhere = torch.full_like(clean, math.nan)
    everywhere[int(clean.argmax())] = clean.max()
    assert check_position(clean, everywhere).non_finite_count == 39  # and no crash with one entry left
    assert not check_position(clean, torch.full_like(clean, math.nan)).passed  # nothing left to compare


def test_mismatched_vocabularies_and_short_runs_are_refused():
    expected = peaked_logits(3)
    with pytest.raises(ValueError, match="same vocabulary"):
        check_position(expected[0], expected[0, :-1])
    with pytest.raises(ValueError, match="exactly 3"):
        logit_matching(PROMPT, expected, lambda ids, n: ([1], expected[:1]))
    with pytest.raises(ValueError, match="one token per row"):
        logit_matching(PROMPT, expected, lambda ids, n: ([], expected), expected_tokens=[1, 2])


def test_token_matching_reports_the_first_divergence_and_its_size():
    assert token_matching([1, 2, 3], [1, 2, 3]).passed
    logits = peaked_logits(4)
    actual = logits.argmax(dim=1).tolist()
    expected = list(actual)
    expected[2] = (actual[2] + 1) % VOCAB
    result = token_matching(expected, actual, logits)
    assert not result.passed
    d = result.first_divergence
    assert (d.position, d.expected_token, d.actual_token) == (2, expected[2], actual[2])
    assert d.divergence_difference == pytest.approx(float(logits[2].max() - logits[2, expected[2]]))
    assert d.divergence_difference > 0
    short = token_matching([1, 2, 3], [1, 2])
    assert short.first_divergence.to_dict() == {"position": 2, "expected_token": 3, "actual_token": None,
                                                "divergence_difference": None}


def test_parse_tol_map():
    assert parse_tol_map("5:0.01,50:0.02,1000:0.03,all:0.05") == DEFAULT_TOL_MAP
    assert parse_tol_map("10:0.1", atol=0.5) == {10: (0.5, 0.1)}
    # each names the entry and what it must be (a bare raises let any message pass)
    for bad, words in (("", "tolerance map '' has no entries; e.g. 5:0.01"),
                       ("5", "entry '5' is not K:RTOL (K a positive integer or 'all')"),
                       ("five:0.1", "entry 'five:0.1' is not K:RTOL"),
                       ("0:0.1", "entry '0:0.1': top-k (0) must be at least 1"),
                       ("5:-1", "entry '5:-1': rtol (-1.0) must be a finite number >= 0"),
                       ("5:0.1,5:0.2", "names group top5 twice"),
                       ("all:nan", "entry 'all:nan': rtol (nan) must be a finite number >= 0")):
        with pytest.raises(ValueError) as refused:
            parse_tol_map(bad)
        assert words in str(refused.value), (bad, refused.value)
    with pytest.raises(ValueError, match="atol"):
        parse_tol_map("5:0.1", atol=-1)


def test_the_json_report_names_non_finite_positions_and_stays_strict_json():
    """A position failing only for a non-finite logit appeared only as a first failure, and a divergence
    at a token corelaunch gave -inf was written as Infinity, which strict JSON readers refuse."""
    import json

    expected = peaked_logits(3, vocab=40)
    tokens = [int(t) for t in expected.argmax(dim=-1)]

    def generate(ids, m):
        actual = expected[len(ids) - 2:][:m].clone()
        actual[:, 5] = math.nan  # every position
        if len(ids) == 2:
            actual[0, tokens[0]] = -math.inf  # a divergence at position 0, at the expected token
        return [int(t) for t in torch.nan_to_num(actual, nan=-1e9).argmax(dim=-1)], actual

    report = logit_matching([1, 2], expected, generate).to_dict()
    assert report["non_finite_positions"] == [0, 1, 2]
    assert report["divergences"][0]["divergence_difference"] is None and report["max_divergence_difference"] is None
    json.dumps(report, allow_nan=False)


def test_a_divergence_at_a_token_that_is_not_corelaunchs_own_greedy_choice_fails():
    """The divergence rule looked only at max(actual) - actual[expected]: corelaunch emitting any token
    (one outside the vocabulary too) beside logits equal to the reference's passed."""
    expected = peaked_logits(3, vocab=40)
    tokens = [int(t) for t in expected.argmax(dim=-1)]
    for emitted in (7 if tokens[0] != 7 else 8, 40):  # a wrong token, then one past the vocabulary

        def generate(ids, m, emitted=emitted):
            return [emitted] * m, expected[len(ids) - 2:][:m].clone()

        result = logit_matching([1, 2], expected, generate)
        assert not result.passed
        failure = result.first_failure
        assert failure.position == 0 and failure.divergence_difference == 0.0 and not failure.divergence_passed
        assert "which is not its own greedy choice" in failure.failures()[0]
        report = result.to_dict()
        assert report["divergences"][0]["actual_token_gap"] == (None if emitted == 40 else pytest.approx(
            float(expected[0].max() - expected[0, emitted])))


def test_a_group_of_zero_expected_logits_past_atol_stays_strict_json_and_shows_in_the_text():
    """A review: every expected logit of a group 0 makes the group's relative error inf past atol,
    and the JSON report printed `Infinity`, which no strict parser takes."""
    import json

    from launcher.cli.check_command import _error_cell
    from shardlib.evaluation.accuracy import group_name

    expected = torch.zeros(2, 40)

    def generate(ids, m):
        actual = torch.zeros(m, 40)
        actual[:, 3] = 0.5  # past atol everywhere; every expected logit 0
        return [0] * m, actual

    result = logit_matching([1, 2], expected, generate)
    report = result.to_dict()
    infinite = [group_name(g.top_k) for g in result.groups if g.max_rel_error == math.inf]
    assert not result.passed and "all" in infinite
    assert all(report["top_k"][name]["max_rel_error"] is None for name in infinite)
    json.dumps(report, allow_nan=False)
    assert _error_cell(None).strip() == "not finite" and _error_cell(0.5).strip() == "0.5"  # the text report's cell


def test_token_matching_json_stays_strict_at_a_minus_inf_logit():
    import json

    logits = peaked_logits(3, vocab=40)
    actual = logits.argmax(dim=1).tolist()
    expected = list(actual)
    expected[1] = (actual[1] + 1) % 40
    logits[1, expected[1]] = -math.inf
    report = token_matching(expected, actual, logits).to_dict()
    assert report["first_divergence"]["divergence_difference"] is None
    json.dumps(report, allow_nan=False)
