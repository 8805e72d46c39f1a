"""A Serve replica started by `serve run`/`serve deploy` tells its launch refusals in the builder's
argument names (launcher/serving/builder_terms.py); one `corelaunch serve` started keeps its flags.
A review by hand deployed `cpus_per_rank: 3` and `backend: cuda` configs: the refusals said "Lower
--cpus-per-rank" and "pass --ray-address and --device-memory-gib", options a config does not have
(and ray_address one the builder refuses)."""

from __future__ import annotations

import pytest

from launcher.serving.builder_terms import in_builder_terms, refusals_in_builder_terms
from launcher.serving.server_settings import settings_from_args
from workers.backends.planner_targets import NO_GPU


def test_flags_become_the_builder_arguments_that_set_them():
    assert in_builder_terms("Lower --cpus-per-rank (at most 2), or raise --placement-timeout") == (
        "Lower cpus_per_rank (at most 2), or raise placement_timeout_s")
    assert in_builder_terms("graphs need buckets (--no-compile runs eager); see --granularity and --tp") == (
        "graphs need buckets (compile: false runs eager); see compile_granularity and tp")
    # a longer option is not read as its prefix, a path or word with dashes is left alone
    assert in_builder_terms("--presharded-cache or --presharded DIR; /tmp/--tp-x and my--model") == (
        "presharded_cache or presharded_dir DIR; /tmp/--tp-x and my--model")
    told = in_builder_terms(NO_GPU)
    assert "--" not in told and "device_memory_gib" in told and "backend cuda:" in told
    assert "RAY_ADDRESS where `serve run`/`serve deploy` runs" in told and "builder takes no ray_address" in told


def test_a_refusal_keeps_its_type_and_an_error_of_other_arguments_is_left_as_it_is():
    with pytest.raises(FileNotFoundError, match=r"^model path /x does not exist; pass model$"):
        with refusals_in_builder_terms():
            raise FileNotFoundError("model path /x does not exist; pass --model")
    with pytest.raises(OSError) as raised:
        with refusals_in_builder_terms():
            raise OSError(2, "--tp")  # not a one-message error: untouched
    assert raised.value.args == (2, "--tp")


def test_settings_say_which_terms_their_replicas_speak():
    assert settings_from_args({}).from_command_line is False  # serve run / serve deploy: the builder's
    assert settings_from_args({}, {"api_key": "--api-key"}).from_command_line is True  # corelaunch serve


def test_a_field_named_beside_its_option_is_named_once():
    assert in_builder_terms("or pad Q heads with zero heads (pad_q_heads, --pad-q-heads)") == (
        "or pad Q heads with zero heads (pad_q_heads)")


def test_a_replica_refuses_the_layout_in_builder_terms_before_its_launcher_exists(tmp_path, monkeypatch):
    """A check by hand: the replica's CPU-share plan runs before the Launcher, and its refusals (a
    TP degree the heads do not divide, `backend: cuda` with no GPU) kept the flags under serve run."""
    from launcher.errors import PlanRejected
    from launcher.serving import openai_app, port_rebind, request_heads
    from tests.model_factory import save_random_model

    for module, name in ((port_rebind, "allow_port_rebinding"), (request_heads, "bound_request_heads"),
                         (openai_app, "install_key_check")):
        monkeypatch.setattr(module, name, lambda *args: None)  # process-wide hooks a replica installs
    model = save_random_model(tmp_path / "m", num_heads=4, num_kv_heads=2)
    ours = next(c for c in openai_app.OpenAIServer.func_or_class.__mro__[1:] if c.__module__ == openai_app.__name__)
    for settings, said in ((settings_from_args({"model": str(model), "tp": 3, "compile": False}), "(pad_q_heads)"),
                           (settings_from_args({"model": str(model), "tp": 3, "compile": False},
                                               {"api_key": "--api-key"}), "(pad_q_heads, --pad-q-heads)")):
        with pytest.raises(PlanRejected, match="is not divisible by tp_degree") as refused:
            ours.__init__(object.__new__(ours), settings)
        assert str(refused.value).endswith(said)
