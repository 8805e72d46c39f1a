"""The server's default template variables (--default-chat-template-kwargs; the app's
default_chat_template_kwargs argument) holding a control token in a key, or inside a list or object,
would have every chat request refused with a 400 naming chat_template_kwargs, a field its clients
never sent. The settings' check knows no tokenizer, so the replica's constructor checks them against
its own and refuses to start, naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

FLAG = "--default-chat-template-kwargs"


@pytest.mark.parametrize("defaults, path", [
    ({"examples": ["<|im_start|>user"]}, f"{FLAG}.examples.0"),
    ({"shots": {"q": {"text": "a<|im_end|>"}}}, f"{FLAG}.shots.q.text"),
    ({"shots": {"<|im_start|>": "x"}}, f"{FLAG}.shots"),
], ids=["in-a-list", "in-an-object", "a-key"])
def test_defaults_a_template_could_write_as_control_tokens_are_a_problem_naming_the_flag(smollm2_tokenizer,
                                                                                        defaults, path):
    from launcher.serving.openai_app import _template_defaults_problem

    problem = _template_defaults_problem(smollm2_tokenizer, defaults, FLAG)
    assert problem is not None and problem.startswith(path) and "every chat request would be refused" in problem
    assert "chat_template_kwargs." not in problem.replace(FLAG, "")  # no field a client sends


def test_defaults_without_control_tokens_or_with_one_in_a_plain_string_are_taken(smollm2_tokenizer):
    """A top-level string stays marked (encoded as text): taken, as in a request's chat_template_kwargs."""
    from launcher.serving.openai_app import _template_defaults_problem

    for defaults in (None, {}, {"enable_thinking": False, "examples": ["hi", {"q": "a"}]},
                     {"note": "<|im_start|> is text here"}):
        assert _template_defaults_problem(smollm2_tokenizer, defaults, FLAG) is None


def test_a_replica_with_such_defaults_refuses_to_start_and_stops_its_launcher(tmp_path_factory, in_process_cluster,
                                                                              monkeypatch):
    from launcher.serving import openai_app, port_rebind
    from launcher.serving.openai_app import OpenAIServer, builder_settings
    from tests.model_factory import random_model_with_smollm2_tokenizer

    model_dir = Path(random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("defaults")))
    monkeypatch.setattr(port_rebind, "allow_port_rebinding", lambda: True)  # Serve's sockets: not this test's
    monkeypatch.setattr(openai_app, "_key_check", openai_app._key_check)  # the constructor installs its own
    ours = next(c for c in OpenAIServer.func_or_class.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    server = object.__new__(ours)
    settings = builder_settings({"model": str(model_dir), "tp": 1, "backend": "cpu", "compile": False,
                                 "cpus_per_rank": 1, "max_num_seqs": 2,
                                 "default_chat_template_kwargs": {"examples": ["<|im_start|>user"]}})
    with pytest.raises(ValueError) as refused:
        ours.__init__(server, settings)
    assert str(refused.value).startswith("default_chat_template_kwargs.examples.0 holds '<|im_start|>'")
    assert in_process_cluster.groups and all(not group.actors for group in in_process_cluster.groups)


def test_corelaunch_serve_refuses_such_defaults_before_ray_starts(tmp_path_factory, monkeypatch, capsys):
    """The command loads the tokenizer before Ray starts (as each replica will): such defaults are
    refused there, exit 2, not in every replica's failed start after Ray and Serve started."""
    import json

    from launcher.cli import main, serve_command
    from tests.model_factory import random_model_with_smollm2_tokenizer
    from workers.net import free_port

    model_dir = random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("defaults"))
    monkeypatch.setattr(serve_command, "_serve", lambda *args: pytest.fail("the server was started"))
    asked = json.dumps({"examples": ["<|im_start|>user"]})
    assert main(["serve", "--model", str(model_dir), FLAG, asked, "--port", str(free_port())]) == 2
    assert f"corelaunch serve: {FLAG}.examples.0 holds '<|im_start|>'" in capsys.readouterr().err
