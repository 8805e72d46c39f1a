"""A static batch's finished rows keep flowing through the (fixed-shape) batch: their later logits,
which can overflow (float16), must not reach the token choice, whose check refuses a batch with any
row's logits NaN, and so failed the rows still running."""

from __future__ import annotations

from tests.test_engine import NEW, PROMPTS, fresh_model
from workers.engine import generate
from workers.sampling import SamplingParams

GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=1.5, top_k=50, seed=7, repetition_penalty=1.3)
"""A sampled row with a penalty: its draws and penalties must be those it gets alone."""


def _alone(prompt: list[int], params: SamplingParams) -> list[int]:
    [out] = generate(fresh_model(), [prompt], [params], NEW, [])
    return out.token_ids


class NaNAfterFinish:
    """Makes row 0's logits NaN from the forward call `first` on (0: the prefill), as a finished row
    whose decoding overflowed."""

    def __init__(self, model, first: int) -> None:
        self.model, self.first, self.calls = model, first, 0
        self.original = model.forward

    def __enter__(self):
        def forward(*args, **kwargs):
            logits = self.original(*args, **kwargs)
            if self.calls >= self.first:
                logits = logits.clone()
                logits[0] = float("nan")
            self.calls += 1
            return logits

        self.model.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        del self.model.forward  # back to the class's method


def test_a_finished_row_whose_logits_turn_nan_leaves_the_others_as_alone():
    params = [GREEDY, SEEDED, GREEDY]
    first, second, third = (_alone(p, q) for p, q in zip(PROMPTS, params))
    stop_token = next(t for t in first[1:] if t not in second and t not in third)  # ends row 0 early only
    finished_after = first.index(stop_token) + 1  # row 0's tokens: the prefill's and as many decode steps
    assert finished_after < NEW - 1  # row 0 has decode steps after its stop, where its logits turn NaN
    model = fresh_model()
    with NaNAfterFinish(model, finished_after) as spy:
        outs = generate(model, PROMPTS, params, NEW, [stop_token])
    assert spy.calls > finished_after  # the NaN rows did flow through the batch
    assert outs[0].token_ids == first[:finished_after] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == second and outs[1].finish_reason == "length"
    assert outs[2].token_ids == third and outs[2].finish_reason == "length"

