"""shardlib.model_path_hints: a missing local path is not taken for a Hugging Face Hub id.
`corelaunch plan --model ./checkpoints/my-llama` (a folder not there) was told to `hf download
checkpoints/my-llama`: the `./` was gone before the hint was worded."""

from __future__ import annotations

import pytest

from shardlib.model_path_hints import missing_model_hint


@pytest.mark.parametrize("typed", ["./checkpoints/my-llama", "../checkpoints/my-llama", "/checkpoints/my-llama"])
def test_a_path_written_as_one_gets_no_hub_hint(typed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert missing_model_hint(typed) == ""


def test_a_missing_model_in_a_local_folder_gets_no_hub_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    assert missing_model_hint("checkpoints/my-llama") == ""


def test_plan_of_a_missing_model_in_a_local_folder_names_no_download(tmp_path, monkeypatch):
    from shardlib.model_config import load_model_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError) as missing:
        load_model_config("./checkpoints/my-llama")
    assert "hf download" not in str(missing.value) and "Hub id" not in str(missing.value)


def test_plan_of_a_missing_model_written_from_here_names_no_download(tmp_path, monkeypatch):
    """No `checkpoints` folder: only the `./` as typed says it is no Hub id (load_model_config made
    it a Path, which drops the `./`, before the hint read it)."""
    from shardlib.model_config import load_model_config

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as missing:
        load_model_config("./checkpoints/my-llama")
    assert "hf download" not in str(missing.value) and "Hub id" not in str(missing.value)


def test_what_reads_as_a_hub_id_still_gets_the_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    hint = missing_model_hint("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert "`hf download HuggingFaceTB/SmolLM2-135M-Instruct --local-dir DIR`" in hint
