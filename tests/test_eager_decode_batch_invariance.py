"""A float32 request's logits do not depend on what else its batch holds, eager as compiled, on the
cpu backend: eager decode steps take the decode attention kernel too.

torch's CPU attention, which eager decode steps used, splits a lone row's work over threads unlike
a batch's: the same request's decode logits decoded alone and beside others differed by 4e-06 here
(4e-05 in SmolLM2-135M's), so a seeded draw at a near-tie could turn on its neighbours.
"""

from __future__ import annotations

import pytest
import torch

from shardlib.sampling_params import SamplingParams
from tests.model_factory import random_model_with_smollm2_tokenizer

PROMPTS = [list(range(100 + 10 * i, 110 + 10 * i)) for i in range(4)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("model"))


def test_a_request_decoded_alone_and_beside_others_gives_the_same_logits_eager(model_dir, in_process_cluster):
    from launcher.api import Launcher
    from workers.kernels import decode_attention

    if not decode_attention.available():
        pytest.skip(f"no decode attention kernel on this host: {decode_attention.unavailable_reason}")
    greedy = SamplingParams(temperature=0.0)
    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False, prefix_caching=False,
                  dtype="float32", cpus_per_rank=2) as llm:
        logits = {n: llm.generate(PROMPTS[:n], greedy, max_new_tokens=5, ignore_eos=True,
                                  return_logits=True)[0].logits for n in (1, 2, 4)}
    assert logits[1].shape[0] == 5
    for n in (2, 4):
        assert torch.equal(logits[n], logits[1]), (n, (logits[n] - logits[1]).abs().max().item())
