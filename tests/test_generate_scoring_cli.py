"""`corelaunch generate --prompt-logprobs` and `--logit-bias`, the TP group in-process: the prompt's
scores equal transformers' log-softmax, and a bias of 100 forces its token."""

from __future__ import annotations

import re

import pytest

from launcher.api import Launcher


def test_generate_scores_prompts_and_takes_a_logit_bias(in_process_cluster, capsys, monkeypatch):
    """--prompt-logprobs puts each prompt's scores in --json's outputs (and their sum on stderr);
    --logit-bias 100 on a token makes greedy generation choose it."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from launcher.cli import main
    from shardlib.demo_model import ensure_demo_model

    model_dir = str(ensure_demo_model())
    common = ["generate", "--model", model_dir, "--tp", "1", "--no-compile", "--max-new-tokens", "2",
              "--prompt", "The capital of France is"]
    assert main([*common, "--json", "--quiet", "--prompt-logprobs", "1", "--logit-bias", "28=100"]) == 0
    [output] = json.loads(capsys.readouterr().out)["outputs"]
    assert output["token_ids"] == [28, 28]  # forced
    ids = AutoTokenizer.from_pretrained(model_dir)("The capital of France is")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        table = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    scored = output["prompt_logprobs"]
    assert [e["token_id"] for e in scored] == ids[1:] and all(len(e["top"]) == 1 for e in scored)
    for j, entry in enumerate(scored):
        assert entry["logprob"] == pytest.approx(float(table[j, ids[j + 1]]), abs=2e-3)
    assert main([*common, "--prompt-logprobs", "0"]) == 0
    shown = re.search(r"prompt log-probability (-?[0-9.]+) over ([0-9]+) tokens", capsys.readouterr().err)
    assert shown and float(shown[1]) == pytest.approx(sum(e["logprob"] for e in scored), abs=1e-3)
    assert int(shown[2]) == len(ids) - 1
    assert main([*common, "--quiet", "--prompt-logprobs", "0"]) == 0  # the score asked for, under --quiet too
    quiet = capsys.readouterr().err
    assert re.fullmatch(r"  \[prompt log-probability -?[0-9.]+ over [0-9]+ tokens\]\n", quiet), quiet
    assert main([*common, "--prompt-logprobs", "21"]) == 2
    assert "--prompt-logprobs (21) must be an integer from 0 to 20" in capsys.readouterr().err
    assert main([*common, "--logit-bias", "999999=1"]) == 2  # checked against the vocabulary before Ray
    assert "--logit-bias names token ids [999999] outside the vocabulary" in capsys.readouterr().err


def test_quiet_hides_the_figures_but_not_the_prompt_score_asked_for(capsys):
    """--prompt-logprobs N --quiet without --json scored every prompt and printed no score: the sum
    was only on the figures line, which --quiet hides."""
    from launcher.cli.generate_command import print_report

    scored = [{"token_id": 5, "logprob": -1.25, "rank": 1, "top": []}, {"token_id": 6, "logprob": -0.5, "rank": 2,
                                                                       "top": []}]
    output = {"prompt": "Hi", "text": " there", "token_ids": [7, 8], "finish_reason": "length",
              "time_to_first_token_s": 0.25, "decode_tokens_per_s": 30.0, "prompt_logprobs": scored}
    print_report({"outputs": [output]}, as_json=False, quiet=True)
    assert capsys.readouterr() == ("Hi there\n", "  [prompt log-probability -1.7500 over 2 tokens]\n")
    print_report({"outputs": [output]}, as_json=False, quiet=False)
    assert capsys.readouterr().err == ("  [length, 2 tokens, first token 250 ms, 30.0 tokens/s, prompt log-probability "
                                       "-1.7500 over 2 tokens]\n")
    unscored = {key: value for key, value in output.items() if key != "prompt_logprobs"}
    print_report({"outputs": [unscored]}, as_json=False, quiet=True)
    assert capsys.readouterr() == ("Hi there\n", "")  # nothing asked for, nothing on stderr
