"""Accuracy checks against a reference model: token matching and logit matching (NxD Inference's rules).

Pure comparison logic on tensors; no Ray, no model. `corelaunch check` feeds it the reference's
(Hugging Face transformers, float32, CPU) greedy tokens and logits and a function that runs corelaunch.

Positions are 0-based indices into the generated tokens (position 0 is the first new token).

Token matching: the greedy tokens must be exactly equal.

Logit matching, at every generated position, with expected logits e and actual logits a (vocab,):
- top-k groups: for each (k, atol, rtol) of the tolerance map, take the indices of e's k largest
  logits (k=None: the whole vocabulary) and compute, over those indices,
      rel_error = (|a - e| - atol) / max|e over the group|      (clamped at 0)
  The group passes when rel_error <= rtol at every index. Defaults (NxD Inference): atol 1e-5 and
  rtol 0.01 (top 5), 0.02 (top 50), 0.03 (top 1000), 0.05 (all).
- divergence: where the greedy tokens differ, the position passes when
      max(a) - a[expected token] < divergence_difference_tol      (default 0.001)
  i.e. the expected token was a near-tie in corelaunch's own logits, and when the token corelaunch
  emitted is its own greedy choice too (max(a) - a[actual token] below the same tolerance; a token
  outside the vocabulary fails): otherwise any token would pass beside near-tied logits. Either way the actual run has
  left the expected path, so it is re-run from the prompt plus the expected tokens up to and
  including this position (teacher forcing) and checking continues from the next position.

Unlike NxD Inference, no constant shift is fitted and removed from the actual logits before the
comparison, and errors are not rounded to the tolerance's decimals: the errors reported are raw.
Entries that are -inf in both tensors (forbidden tokens) are left out of the groups. An entry that
is NaN or +inf in either, or -inf in one only, fails its position: a token one side forbids or an
overflow is a difference no tolerance measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

TolMap = dict  # top_k (int, or None for the whole vocabulary) -> (atol, rtol)

DEFAULT_ATOL = 1e-5
DEFAULT_TOL_MAP: TolMap = {5: (1e-5, 0.01), 50: (1e-5, 0.02), 1000: (1e-5, 0.03), None: (1e-5, 0.05)}
DEFAULT_DIVERGENCE_DIFFERENCE_TOL = 0.001

GenerateFn = Callable[[list, int], tuple]
"""generate_fn(input_ids, num_tokens) -> (token ids, list of num_tokens; logits, (num_tokens, vocab))."""


def group_name(top_k: int | None) -> str:
    return "all" if top_k is None else f"top{top_k}"


def parse_tol_map(spec: str, atol: float = DEFAULT_ATOL) -> TolMap:
    """"5:0.01,50:0.02,all:0.05" -> {5: (atol, 0.01), 50: (atol, 0.02), None: (atol, 0.05)}.

    Each entry is K:RTOL with K a positive integer or "all"; every group uses `atol`.
    """
    if not math.isfinite(atol) or atol < 0:
        raise ValueError(f"atol ({atol}) must be a finite number >= 0")
    tol_map: TolMap = {}
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        k_text, sep, rtol_text = entry.partition(":")
        try:
            if not sep:
                raise ValueError
            k = None if k_text.strip().lower() == "all" else int(k_text)
            rtol = float(rtol_text)
        except ValueError:
            raise ValueError(f"tolerance map entry {entry!r} is not K:RTOL (K a positive integer or 'all'), "
                             f"e.g. --tol-map 5:0.01,50:0.02,1000:0.03,all:0.05") from None
        if k is not None and k < 1:
            raise ValueError(f"tolerance map entry {entry!r}: top-k ({k}) must be at least 1")
        if not math.isfinite(rtol) or rtol < 0:
            raise ValueError(f"tolerance map entry {entry!r}: rtol ({rtol}) must be a finite number >= 0")
        if k in tol_map:
            raise ValueError(f"tolerance map names group {group_name(k)} twice in {spec!r}")
        tol_map[k] = (atol, rtol)
    if not tol_map:
        raise ValueError(f"tolerance map {spec!r} has no entries; e.g. 5:0.01,50:0.02,1000:0.03,all:0.05")
    return tol_map


def _sorted_groups(tol_map: TolMap) -> list:
    return sorted(tol_map, key=lambda k: math.inf if k is None else k)


# ---- one position -------------------------------------------------------------------------------
@dataclass
class GroupCheck:
    """One top-k group at one position."""

    top_k: int | None
    atol: float
    rtol: float
    max_abs_error: float
    """max |actual - expected| over the group."""
    max_rel_error: float
    """max (|actual - expected| - atol) / max|expected over the group|, clamped at 0; compared to rtol."""
    token_id: int
    """Vocabulary index where rel error is largest."""
    expected_logit: float
    actual_logit: float

    @property
    def passed(self) -> bool:
        return self.max_rel_error <= self.rtol


@dataclass
class PositionCheck:
    position: int
    expected_token: int
    actual_token: int
    divergence_difference: float | None
    """max(actual) - actual[expected token] where the tokens differ; None where they agree."""
    divergence_difference_tol: float
    groups: list[GroupCheck]
    non_finite_tokens: list[int] = field(default_factory=list)
    """Vocabulary indices where either side is NaN or +inf, or one side only is -inf (the first 8)."""
    non_finite_count: int = 0
    actual_token_gap: float | None = None
    """max(actual) - actual[actual token] where the tokens differ (inf for a token outside the
    vocabulary): how far the emitted token is from corelaunch's own greedy choice."""

    @property
    def diverged(self) -> bool:
        return self.expected_token != self.actual_token

    @property
    def divergence_passed(self) -> bool:
        return ((self.divergence_difference is None or self.divergence_difference < self.divergence_difference_tol)
                and (self.actual_token_gap is None or self.actual_token_gap < self.divergence_difference_tol))

    @property
    def passed(self) -> bool:
        return self.divergence_passed and not self.non_finite_count and all(g.passed for g in self.groups)

    def failures(self) -> list[str]:
        out = []
        if self.non_finite_count:
            out.append(f"position {self.position}: {self.non_finite_count} logit(s) NaN or infinite on one side "
                       f"(at tokens {self.non_finite_tokens}{' ...' if self.non_finite_count > 8 else ''})")
        if self.actual_token_gap is not None and not self.actual_token_gap < self.divergence_difference_tol:
            out.append(f"position {self.position}: corelaunch emitted token {self.actual_token}, which is not "
                       f"its own greedy choice: max(actual) - actual[emitted] = {shown_difference(self.actual_token_gap)} >= "
                       f"divergence_difference_tol {self.divergence_difference_tol:g}")
        if self.divergence_difference is not None and not self.divergence_difference < self.divergence_difference_tol:
            out.append(f"position {self.position}: greedy token {self.actual_token} instead of expected "
                       f"{self.expected_token}; max(actual) - actual[expected] = "
                       f"{shown_difference(self.divergence_difference)} >= divergence_difference_tol "
                       f"{self.divergence_difference_tol:g}")
        for g in self.groups:
            if not g.passed:
                rel = shown_difference(g.max_rel_error)  # inf where the group's expected logits are all 0
                out.append(f"position {self.position}: {group_name(g.top_k)} rel error {rel} > "
                           f"rtol {g.rtol:g} (max abs error {g.max_abs_error:.6g}; at token {g.token_id}: "
                           f"expected {g.expected_logit:.6g}, actual {g.actual_logit:.6g})")
        return out


def check_position(expected_logits: torch.Tensor, actual_logits: torch.Tensor, *, position: int = 0,
                   expected_token: int | None = None, actual_token: int | None = None,
                   tol_map: TolMap | None = None,
                   divergence_difference_tol: float = DEFAULT_DIVERGENCE_DIFFERENCE_TOL) -> PositionCheck:
    """Compare one position's logits, both (vocab,). Tokens default to each tensor's argmax."""
    tol_map = DEFAULT_TOL_MAP if tol_map is None else tol_map
    if expected_logits.shape != actual_logits.shape or expected_logits.dim() != 1:
        raise ValueError(f"position {position}: expected logits {tuple(expected_logits.shape)} and actual logits "
                         f"{tuple(actual_logits.shape)} must both be (vocab,) with the same vocabulary; is the "
                         f"reference the same model?")
    e = expected_logits.detach().to(torch.float64)
    a = actual_logits.detach().to(torch.float64)
    expected_token = int(e.argmax()) if expected_token is None else int(expected_token)
    actual_token = int(a.argmax()) if actual_token is None else int(actual_token)

    finite = torch.isfinite(e) & torch.isfinite(a)
    forbidden = (e == -math.inf) & (a == -math.inf)  # a token both sides forbid
    bad = torch.nonzero(~finite & ~forbidden).flatten()
    kept = torch.nonzero(finite).flatten()  # vocabulary indices compared
    e_kept, a_kept = e[kept], a[kept]
    groups = []
    for k in _sorted_groups(tol_map) if len(kept) else ():
        atol, rtol = tol_map[k]
        if k is None or k >= len(kept):
            idx = torch.arange(len(kept))
        else:
            idx = torch.topk(e_kept, k).indices
        eg, ag = e_kept[idx], a_kept[idx]
        abs_err = (ag - eg).abs()
        scale = eg.abs().max()
        rel = ((abs_err - atol) / scale).clamp(min=0) if scale > 0 else torch.where(
            abs_err > atol, torch.tensor(math.inf, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
        worst = int(rel.argmax()) if float(rel.max()) > 0 else int(abs_err.argmax())
        groups.append(GroupCheck(top_k=k, atol=atol, rtol=rtol, max_abs_error=float(abs_err.max()),
                                 max_rel_error=float(rel.max()), token_id=int(kept[idx[worst]]),
                                 expected_logit=float(eg[worst]), actual_logit=float(ag[worst])))
    difference = gap = None
    if actual_token != expected_token:
        difference = float(a.max() - a[expected_token])
        gap = float(a.max() - a[actual_token]) if 0 <= actual_token < len(a) else math.inf
    return PositionCheck(position=position, expected_token=expected_token, actual_token=actual_token,
                         divergence_difference=difference, divergence_difference_tol=divergence_difference_tol,
                         groups=groups, non_finite_tokens=bad[:8].tolist(), non_finite_count=len(bad),
                         actual_token_gap=gap)


# ---- token matching ----------------------------------------------------------------------------
@dataclass
class Divergence:
    position: int
    expected_token: int | None
    actual_token: int | None
    """None when that side produced no token at this position."""
    divergence_difference: float | None = None
    """max(actual) - actual[expected token], when corelaunch's logits are known."""

    def to_dict(self) -> dict:
        return {"position": self.position, "expected_token": self.expected_token,
                "actual_token": self.actual_token, "divergence_difference": _json_number(self.divergence_difference)}


@dataclass
class TokenMatchResult:
    expected_tokens: list[int]
    actual_tokens: list[int]
    first_divergence: Divergence | None

    @property
    def passed(self) -> bool:
        return self.first_divergence is None

    def to_dict(self) -> dict:
        return {"passed": self.passed, "num_tokens": len(self.expected_tokens),
                "expected_tokens": self.expected_tokens, "actual_tokens": self.actual_tokens,
                "first_divergence": None if self.first_divergence is None else self.first_divergence.to_dict()}


def token_matching(expected_tokens: Sequence[int], actual_tokens: Sequence[int],
                   actual_logits: torch.Tensor | None = None) -> TokenMatchResult:
    """Exact equality of greedy tokens. With corelaunch's logits ((n, vocab)), the first divergence
    also says by how much corelaunch preferred its own token: max(actual) - actual[expected]."""
    expected, actual = [int(t) for t in expected_tokens], [int(t) for t in actual_tokens]
    first = None
    for i in range(max(len(expected), len(actual))):
        e = expected[i] if i < len(expected) else None
        a = actual[i] if i < len(actual) else None
        if e != a:
            diff = None
            if actual_logits is not None and e is not None and i < len(actual_logits):
                row = actual_logits[i].to(torch.float64)
                diff = float(row.max() - row[e])
            first = Divergence(i, e, a, diff)
            break
    return TokenMatchResult(expected, actual, first)


# ---- logit matching ----------------------------------------------------------------------------
@dataclass
class GroupSummary:
    """The worst error of one top-k group over every checked position."""

    top_k: int | None
    atol: float
    rtol: float
    max_abs_error: float = 0.0
    max_rel_error: float = 0.0
    position: int | None = None
    """Position of the largest rel error (of the largest abs error while every rel error is 0)."""
    token_id: int | None = None
    failed_positions: list[int] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failed_positions

    def add(self, check: GroupCheck, position: int) -> None:
        worse = (check.max_rel_error > self.max_rel_error
                 or (self.max_rel_error == 0 and check.max_rel_error == 0
                     and check.max_abs_error > self.max_abs_error)
                 or self.position is None)
        self.max_abs_error = max(self.max_abs_error, check.max_abs_error)
        if worse:
            self.max_rel_error, self.position, self.token_id = check.max_rel_error, position, check.token_id
        if not check.passed:
            self.failed_positions.append(position)

    def to_dict(self) -> dict:
        return {"top_k": self.top_k, "atol": self.atol, "rtol": self.rtol, "passed": self.passed,
                # inf where every expected logit of the group is 0 (no scale) and an error passed atol
                "max_abs_error": _json_number(self.max_abs_error), "max_rel_error": _json_number(self.max_rel_error),
                "position": self.position, "token_id": self.token_id, "failed_positions": self.failed_positions}


@dataclass
class LogitMatchResult:
    expected_tokens: list[int]
    first_pass_tokens: list[int]
    """corelaunch's greedy tokens from the prompt alone, before any teacher forcing."""
    positions: list[PositionCheck]
    groups: list[GroupSummary]
    runs: int
    """corelaunch generate calls: 1 plus one per divergence that was not at the last position."""
    divergence_difference_tol: float

    @property
    def passed(self) -> bool:
        return all(p.passed for p in self.positions)

    @property
    def divergences(self) -> list[PositionCheck]:
        return [p for p in self.positions if p.diverged]

    @property
    def first_failure(self) -> PositionCheck | None:
        return next((p for p in self.positions if not p.passed), None)

    def to_dict(self) -> dict:
        first = self.first_failure
        return {
            "passed": self.passed,
            "num_tokens": len(self.positions),
            "expected_tokens": self.expected_tokens,
            "first_pass_tokens": self.first_pass_tokens,
            "runs": self.runs,
            "divergence_difference_tol": self.divergence_difference_tol,
            "divergences": [{"position": p.position, "expected_token": p.expected_token,
                             "actual_token": p.actual_token,
                             "divergence_difference": _json_number(p.divergence_difference),
                             "actual_token_gap": _json_number(p.actual_token_gap),
                             "passed": p.divergence_passed} for p in self.divergences],
            "max_divergence_difference": _json_number(max((p.divergence_difference for p in self.divergences),
                                                          default=None)),
            "non_finite_positions": [p.position for p in self.positions if p.non_finite_count],
            "top_k": {group_name(g.top_k): g.to_dict() for g in self.groups},
            "first_failure": None if first is None else {"position": first.position, "failures": first.failures()},
        }


def shown_difference(value: float | None) -> str:
    """A divergence difference or relative error as the failure lines and the text report print it:
    None (how the JSON report carries a value it cannot: inf, NaN) and non-finite values as "not finite"."""
    return f"{value:.6g}" if value is not None and math.isfinite(value) else "not finite"


def _json_number(value: float | None) -> float | None:
    """None for a value JSON cannot carry (a divergence at a token corelaunch gave -inf: inf)."""
    return value if value is None or math.isfinite(value) else None


def logit_matching(input_ids: Sequence[int], expected_logits: torch.Tensor, generate_fn: GenerateFn, *,
                   expected_tokens: Sequence[int] | None = None, tol_map: TolMap | None = None,
                   divergence_difference_tol: float = DEFAULT_DIVERGENCE_DIFFERENCE_TOL) -> LogitMatchResult:
    """Check corelaunch's logits for one prompt against expected logits (n, vocab), with teacher forcing.

    generate_fn(ids, m) must run greedy generation of exactly m tokens from `ids` (EOS ignored) and
    return (tokens, logits (m, vocab)). It is called once from the prompt and once more after each
    divergence, from the prompt plus the expected tokens up to and including the divergent position.
    expected_tokens defaults to the argmax of each row of expected_logits.
    """
    tol_map = DEFAULT_TOL_MAP if tol_map is None else tol_map
    if expected_logits.dim() != 2 or expected_logits.shape[0] < 1:
        raise ValueError(f"expected logits must be (num_tokens, vocab) with num_tokens >= 1; got "
                         f"{tuple(expected_logits.shape)}")
    n = expected_logits.shape[0]
    if expected_tokens is None:
        expected = [int(t) for t in expected_logits.argmax(dim=-1)]
    else:
        expected = [int(t) for t in expected_tokens]
        if len(expected) != n:
            raise ValueError(f"{len(expected)} expected tokens but {n} rows of expected logits; give one "
                             f"token per row")
    prompt = [int(t) for t in input_ids]
    summaries = [GroupSummary(k, *tol_map[k]) for k in _sorted_groups(tol_map)]
    positions: list[PositionCheck] = []
    first_pass: list[int] = []
    start, runs = 0, 0
    while start < n:
        want = n - start
        tokens, logits = generate_fn(prompt + expected[:start], want)
        runs += 1
        tokens = [int(t) for t in tokens]
        if len(tokens) != want or tuple(logits.shape[:1]) != (want,):
            raise ValueError(f"generate_fn returned {len(tokens)} tokens and logits {tuple(logits.shape)} "
                             f"for {want} requested tokens; it must ignore EOS and return exactly {want}")
        if runs == 1:
            first_pass = tokens
        for offset in range(want):
            pos = start + offset
            check = check_position(expected_logits[pos], logits[offset], position=pos,
                                   expected_token=expected[pos], actual_token=tokens[offset],
                                   tol_map=tol_map, divergence_difference_tol=divergence_difference_tol)
            positions.append(check)
            for summary, group in zip(summaries, check.groups):
                summary.add(group, pos)
            if check.diverged:
                break
        start = positions[-1].position + 1
    return LogitMatchResult(expected_tokens=expected, first_pass_tokens=first_pass, positions=positions,
                            groups=summaries, runs=runs, divergence_difference_tol=divergence_difference_tol)
