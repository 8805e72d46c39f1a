"""shardlib.demo_model off the happy path of the first run: a cache on a full disk (safetensors'
own write error is no OSError, and was a traceback) and a conversion whose stderr is a log file
(transformers' progress bars wrote carriage-return redraws into it)."""

from __future__ import annotations

import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest

from shardlib import demo_model
from shardlib.demo_model import DEMO_MODEL_NAME, ensure_demo_model


def _only_the_lock_left(cache: Path) -> bool:
    return [p.name for p in cache.iterdir()] == [f"{DEMO_MODEL_NAME}.lock"]


def test_safetensors_failing_on_a_full_disk_is_the_one_line_cache_error(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    def disk_full(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(demo_model, "_convert", disk_full)
    with pytest.raises(ValueError, match="No space left on device") as caught:
        ensure_demo_model(tmp_path)
    message = str(caught.value)
    assert f"cache directory {tmp_path} (" in message and "CORELAUNCH_CACHE" in message
    assert "545 MB" in message and "\n" not in message
    assert _only_the_lock_left(tmp_path)  # the half-written folder removed


def test_a_cache_without_room_is_refused_before_converting(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 200_000_000, 200_000_000))
    monkeypatch.setattr(demo_model, "_convert", lambda *a: pytest.fail("converted onto a full disk"))
    with pytest.raises(ValueError) as caught:
        ensure_demo_model(tmp_path)
    message = str(caught.value)
    assert f"cache directory {tmp_path}:" in message and "CORELAUNCH_CACHE" in message
    assert "takes 545 MB and only 200 MB are free" in message and "\n" not in message
    assert _only_the_lock_left(tmp_path)


def _converter_drawing_bars(gguf_path, out_dir):
    """Draws the bars the real conversion draws, through the names transformers looks up when it
    converts: gguf's module's tqdm (tqdm's own) and transformers' logging tqdm."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...", mininterval=0):
        pass
    for _ in hf_logging.tqdm(range(3), desc="Loading weights", mininterval=0):
        pass
    from safetensors.numpy import save_file
    import numpy as np

    (out_dir / "config.json").write_text("{}")
    save_file({"w": np.zeros(4, dtype=np.float32)}, str(out_dir / "model.safetensors"))


def test_conversion_into_a_log_draws_no_progress_bars_and_puts_them_back(tmp_path, monkeypatch, capfd):
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    assert not sys.stderr.isatty()  # pytest's capture: as in a log file
    gguf_tqdm, enabled = gguf_utils.tqdm, hf_logging.is_progress_bar_enabled()
    monkeypatch.setattr(demo_model, "_convert", _converter_drawing_bars)
    ensure_demo_model(tmp_path)
    err = capfd.readouterr().err
    assert "\r" not in err and "Loading weights" not in err and "GGUF tensors" not in err
    assert gguf_utils.tqdm is gguf_tqdm and hf_logging.is_progress_bar_enabled() == enabled


def test_conversion_on_a_terminal_keeps_its_progress_bars(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(demo_model, "stderr_is_a_terminal", lambda: True)
    monkeypatch.setattr(demo_model, "_convert", _converter_drawing_bars)
    ensure_demo_model(tmp_path)
    assert "GGUF tensors" in capfd.readouterr().err
