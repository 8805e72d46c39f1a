"""The ids a prompt's closed thinking is looked for within (the reasoning parser's: the last turn's
end, openai_protocol._thinking_closed) are every end-of-sequence id the Launcher stops at:
generation_config.json's too, where a chat model often names its end of turn alone (Llama 3
Instruct's <|eot_id|>). Read from config.json and the tokenizer only, an earlier turn's `</think>`
closed the new answer's thinking, and the model's new thinking went to the content."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

from launcher.serving.openai_app import _turn_ends
from launcher.serving.openai_protocol import _thinking_closed

THINK_START, THINK_END = 100, 101  # stand-ins for a reasoning model's <think> and </think>


def test_an_end_of_turn_named_only_in_generation_config_ends_the_turn(tmp_path, smollm2_tokenizer):
    # as Llama 3 Instruct's files: config.json and the tokenizer end the text (<|endoftext|> here),
    # generation_config.json adds the end of a turn (<|im_end|> here)
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.eos_token = "<|endoftext|>"
    end_of_text, end_of_turn = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [end_of_text, end_of_turn]}))
    model_config = SimpleNamespace(eos_token_id=(end_of_text,))
    turn_ends = _turn_ends(tokenizer, model_config, tmp_path)
    assert turn_ends == {end_of_text, end_of_turn}
    # an earlier assistant turn closed its thinking; the new answer's opens after the turn's end
    prompt = [THINK_START, 5, THINK_END, 6, end_of_turn, 7, 8]
    assert not _thinking_closed(prompt, THINK_START, THINK_END, turn_ends)
    assert _turn_ends(tokenizer, model_config, tmp_path / "no-such-dir") == {end_of_text}
