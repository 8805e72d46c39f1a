"""The server's own chat template (vLLM's --chat-template; builder argument chat_template): a file, or
the template text itself where the value names no file and holds {, } or a newline, read and
compiled where the settings are made (a `serve deploy` replica gets the text, not a path), refused
there naming the flag, the value and what is taken. A replica renders every chat with it in place of
its tokenizer's, so a model whose tokenizer has none serves chat: checked through the routes
in-process, through `corelaunch serve`'s start-up checks, and (slow) on a real server
(tests/test_flagged_server.py). A request's own chat_template field is taken only by a server
started with --trust-request-chat-template, and compiled off the event loop. Neither template narrows the control tokens that message text cannot
write (the model's template's are pinned first); a template's refusal names whose it is; template
text that never uses messages (a mistyped path with braces) and one nested too deeply to compile are
refused; a server's template that raises on a one-message chat is a warning at start."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from tests.test_tokenize_routes import answer, refusal_of, scripted_server
from workers.net import free_port

MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Name a colour."}]
TEMPLATE = ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant] {% endif %}")
"""A template no model ships: a prompt rendered with it is told apart from SmolLM2's at a glance."""
OWN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
"""A request's own template (chat_template): the messages' text alone."""


def trusting_server(tokenizer, template: str | None = None):
    """A scripted server over `tokenizer` as its constructor sets one up under
    --trust-request-chat-template, and --chat-template `template` where given."""
    from launcher.serving.chat_template import use_chat_template

    server = scripted_server(tokenizer if template is None else use_chat_template(tokenizer, template), "Blue.")
    server.server_template, server.trust_request_chat_template = template is not None, True
    return server


def flags() -> dict:
    """`corelaunch serve`'s names for the server's arguments (max_replicas -> --max-replicas)."""
    from launcher.serving.server_settings import SERVER_ARGS

    return {k: "--" + k.replace("_", "-") for k in SERVER_ARGS}


def serve_settings(*argv: str):
    """The settings `corelaunch serve ARGV` makes (its options parsed, then checked as run() checks them)."""
    from launcher.cli import build_parser
    from launcher.cli.serve_command import server_args
    from launcher.serving.server_settings import settings_from_args

    return settings_from_args(server_args(build_parser().parse_args(["serve", *argv])), flags())


@pytest.fixture
def template_file(tmp_path) -> Path:
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return path


def test_the_template_is_a_files_text_or_the_text_given(template_file, monkeypatch):
    from launcher.serving.server_settings import settings_from_args

    assert settings_from_args({"chat_template": str(template_file)}).chat_template == TEMPLATE
    assert serve_settings("--chat-template", str(template_file)).chat_template == TEMPLATE
    monkeypatch.chdir(template_file.parent)  # a relative path is read where the settings are made
    assert serve_settings("--chat-template", template_file.name).chat_template == TEMPLATE
    # no such file, and Jinja's characters: the text itself, on the command line and in a config's args
    assert serve_settings("--chat-template", TEMPLATE).chat_template == TEMPLATE
    assert settings_from_args({"chat_template": "{{ messages[0].content }}"}).chat_template == \
        "{{ messages[0].content }}"
    # a newline is enough to be read as text (refused for never using messages, not as no readable file)
    with pytest.raises(ValueError, match=r"^chat_template \(the template text 'hi\\nthere'\) names no file"):
        settings_from_args({"chat_template": "hi\nthere"})
    # left out, or `serve run chat_template=null`: the tokenizer's own
    assert serve_settings().chat_template is None
    assert settings_from_args({"chat_template": "null"}).chat_template is None
    assert settings_from_args({}).chat_template is None


def test_a_template_file_saved_with_a_byte_order_mark_is_read_without_it(tmp_path, smollm2_tokenizer):
    """Some editors save UTF-8 with a BOM: read as text, it was the first thing of every prompt."""
    from launcher.serving.chat_template import use_chat_template
    from launcher.serving.server_settings import settings_from_args

    marked = tmp_path / "bom.jinja"
    marked.write_text(TEMPLATE, encoding="utf-8-sig")
    template = settings_from_args({"chat_template": str(marked)}).chat_template
    assert template == TEMPLATE
    server = scripted_server(use_chat_template(copy.deepcopy(smollm2_tokenizer), template), "Blue.")
    tokens = answer(server, "/tokenize", {"model": MODEL, "messages": CHAT})["tokens"]
    assert smollm2_tokenizer.decode(tokens) == "[user] Name a colour.\n[assistant] "


def _bad_templates(tmp_path: Path) -> list[tuple[object, str]]:
    """(value, words its refusal holds after the name and value) for every kind of bad value."""
    empty, spaces, broken, latin = (tmp_path / name for name in ("empty.jinja", "spaces.jinja", "broken.jinja",
                                                                 "latin.jinja"))
    empty.write_text("")
    spaces.write_text("  \n\t\n")
    broken.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")  # line 2 closes with one brace
    latin.write_bytes("{{ 'caf\u00e9' }}".encode("latin-1"))
    missing = tmp_path / "templates" / "chat.jinja"

    def file(path: Path) -> str:  # how a refusal names a file
        return rf"\(file {re.escape(str(path))}\)"

    return [
        (str(missing), rf"\('{re.escape(str(missing))}'\) is no readable file \(No such file or directory\); "
                       r"give a template file, or the template text itself \(text holding \{, \} or a newline\)"),
        ("chatml", r"\('chatml'\) is no readable file \(No such file or directory\); give a template file"),
        (str(tmp_path), rf"\('{re.escape(str(tmp_path))}'\) is no readable file \(Is a directory\)"),
        (str(empty), file(empty) + r" is an empty template; give a template file"),
        (str(spaces), file(spaces) + r" is an empty template"),
        ("\n \n", r"\(the template text '\\n \\n'\) is an empty template"),
        (str(broken), file(broken) + r" does not compile as a Jinja chat template: line 2: unexpected '}'"),
        ("{% if add_generation_prompt %}[assistant]",
         r"\(the template text '\{% if .*'\) does not compile as a Jinja chat template: line 1: Unexpected end "
         r"of template"),
        (str(latin), file(latin) + r" is no UTF-8 text \(invalid continuation byte at byte 7\); save the template "
                                   r"as UTF-8"),
        (["{{ x }}"], r"\(\['\{\{ x \}\}'\]\) must be a template file, or the template text itself"),
    ]


def test_a_bad_template_is_refused_naming_the_flag_the_value_and_what_is_taken(tmp_path):
    from launcher.serving.server_settings import settings_from_args

    for value, words in _bad_templates(tmp_path):
        with pytest.raises(ValueError, match=rf"^chat_template {words}"):
            settings_from_args({"chat_template": value})
        if isinstance(value, str):
            with pytest.raises(ValueError, match=rf"^--chat-template {words}"):
                serve_settings("--chat-template", value)


def test_serve_refuses_a_bad_template_before_anything_starts(tmp_path, monkeypatch, capsys):
    from launcher.cli import main, serve_command

    monkeypatch.setattr(serve_command, "_serve", lambda *args: pytest.fail("the server was started"))
    monkeypatch.setattr(serve_command, "_plan", lambda *args: pytest.fail("the launch was planned"))
    missing = tmp_path / "chat.jinja"
    assert main(["serve", "--chat-template", str(missing), "--port", str(free_port())]) == 2
    assert f"corelaunch serve: --chat-template ('{missing}') is no readable file" in capsys.readouterr().err


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory) -> Path:
    """A small random Llama with SmolLM2's tokenizer and vocabulary, its chat template removed."""
    from tests.model_factory import random_model_with_smollm2_tokenizer

    model_dir = Path(random_model_with_smollm2_tokenizer(tmp_path_factory.mktemp("bare")))
    (model_dir / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return model_dir


def test_serve_with_a_template_serves_chat_for_a_model_without_one(bare_model, template_file, monkeypatch, capsys):
    """The start-up check counts the flag's template (no "has no chat template" line, --quiet or
    not), and the settings handed to Serve carry the template's text."""
    from launcher.cli import main, serve_command

    assert not serve_command.has_chat_template(bare_model)
    assert serve_command.has_chat_template(bare_model, TEMPLATE)
    started = []
    monkeypatch.setattr(serve_command, "_serve", lambda args, settings, mode: started.append(settings) or 0)
    base = ["serve", "--model", str(bare_model), "--quiet"]
    assert main([*base, "--port", str(free_port())]) == 0
    err = capsys.readouterr().err
    assert "has no chat template: /v1/chat/completions refuses every request" in err and "--chat-template" in err
    assert main([*base, "--port", str(free_port()), "--chat-template", str(template_file)]) == 0
    assert "no chat template" not in capsys.readouterr().err
    assert [s.chat_template for s in started] == [None, TEMPLATE]


def test_a_replica_renders_chat_with_the_settings_template(bare_model, template_file, in_process_cluster,
                                                          monkeypatch, capsys):
    """The replica's constructor (over an in-process Launcher) puts the settings' template on its own
    tokenizer before anything reads it: no "has no chat template" line, and the chat route's prompt is
    the template's. The Launcher's copy of the tokenizer is another object, left as its files made it."""
    from launcher.serving import openai_app, port_rebind
    from launcher.serving.openai_app import OpenAIServer, builder_settings

    monkeypatch.setattr(port_rebind, "allow_port_rebinding", lambda: True)  # Serve's sockets: not this test's
    monkeypatch.setattr(openai_app, "_key_check", openai_app._key_check)  # the constructor installs its own
    ours = next(c for c in OpenAIServer.func_or_class.__mro__[1:] if c.__module__ == "launcher.serving.openai_app")
    server = object.__new__(ours)
    ours.__init__(server, builder_settings({"model": str(bare_model), "tp": 1, "backend": "cpu", "compile": False,
                                            "cpus_per_rank": 1, "max_num_seqs": 2, "served_model_name": MODEL,
                                            "chat_template": str(template_file), "trust_request_chat_template": True}))
    try:
        assert "no chat template" not in capsys.readouterr().err
        assert server.tokenizer.chat_template == TEMPLATE and server.launcher.tokenizer.chat_template is None
        expected = server.launcher.tokenizer.apply_chat_template(CHAT, chat_template=TEMPLATE,
                                                                 add_generation_prompt=True, return_dict=False)
        chat = answer(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                       "temperature": 0})
        assert chat["usage"]["prompt_tokens"] == len(expected)
        # trusted by the settings: a request's own template renders that request
        own = answer(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                      "chat_template": OWN_TEMPLATE})
        assert own["usage"]["prompt_tokens"] == len(server.tokenizer("Name a colour.")["input_ids"])
    finally:
        server.launcher.shutdown()


@pytest.fixture
def no_template_tokenizer(smollm2_tokenizer):
    bare = copy.deepcopy(smollm2_tokenizer)
    bare.chat_template = None
    return bare


def test_a_server_with_a_template_renders_every_chat_with_it(no_template_tokenizer, smollm2_tokenizer,
                                                             template_file):
    """A tokenizer with no template: chat is refused without the server's, and with it /v1/chat/completions,
    /v1/responses and /tokenize's chat form all render the messages with it; a tokenizer's own
    template gives way to it too."""
    from launcher.serving.chat_template import use_chat_template
    from launcher.serving.server_settings import settings_from_args

    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
    without = scripted_server(no_template_tokenizer, "Blue.")
    refused = refusal_of(without, "/v1/chat/completions", body)
    assert refused.status == 400 and f"model {MODEL!r} has no chat template" in refused.message
    assert "has no chat template" in refusal_of(without, "/tokenize", {"model": MODEL, "messages": CHAT}).message

    template = settings_from_args({"chat_template": str(template_file)}).chat_template
    rendered = "[user] Name a colour.\n[assistant] "
    expected = no_template_tokenizer.apply_chat_template(CHAT, chat_template=TEMPLATE, add_generation_prompt=True,
                                                         return_dict=False)
    for tokenizer in (no_template_tokenizer, copy.deepcopy(smollm2_tokenizer)):
        server = scripted_server(use_chat_template(tokenizer, template), "Blue.")
        chat = answer(server, "/v1/chat/completions", body)
        assert chat["choices"][0]["message"]["content"] == "Blue."
        assert server.prompts == [rendered] and chat["usage"]["prompt_tokens"] == len(expected)
        tokenized = answer(server, "/tokenize", {"model": MODEL, "messages": CHAT})
        assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)
        responded = answer(server, "/v1/responses", {"model": MODEL, "input": "Name a colour.",
                                                     "max_output_tokens": 4})
        assert responded["status"] == "completed" and server.prompts[-1] == rendered
    assert smollm2_tokenizer.chat_template != TEMPLATE  # the shared fixture's own is untouched


def test_a_requests_own_template_is_taken_only_where_the_server_trusts_it(smollm2_tokenizer, no_template_tokenizer):
    """vLLM's chat_template field: refused (400, naming it and the flag) by default, on the chat route
    and /tokenize's chat form; with --trust-request-chat-template it renders that request in place of
    the server's template, or where the tokenizer has none; an empty one, or one that does not
    compile (its Jinja error's line named), is refused."""
    from launcher.serving.chat_template import use_chat_template

    tokenize = {"model": MODEL, "messages": CHAT, "chat_template": OWN_TEMPLATE}
    plain = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
    body = {**tokenize, "max_tokens": 4}
    untrusted = scripted_server(copy.deepcopy(smollm2_tokenizer), "Blue.")
    for route, asked in (("/v1/chat/completions", body), ("/tokenize", tokenize)):
        refused = refusal_of(untrusted, route, asked)
        assert refused.param == "chat_template" and "takes no chat template from a request" in refused.message
        assert "--trust-request-chat-template" in refused.message
    assert untrusted.prompts == []
    nested = refusal_of(untrusted, "/v1/chat/completions", {**plain, "chat_template_kwargs": {"chat_template": "x"}})
    assert nested.param == "chat_template_kwargs.chat_template" and "request's own chat_template" in nested.message
    own_ids = smollm2_tokenizer("Name a colour.", add_special_tokens=False)["input_ids"]
    for tokenizer in (use_chat_template(copy.deepcopy(smollm2_tokenizer), TEMPLATE), no_template_tokenizer):
        trusted = trusting_server(tokenizer)
        assert answer(trusted, "/v1/chat/completions", body)["usage"]["prompt_tokens"] == len(own_ids)
        assert trusted.prompts == ["Name a colour."]
        assert answer(trusted, "/tokenize", tokenize)["tokens"] == own_ids
        # without the field: the server's template, or (no template at all) the refusal
        if tokenizer.chat_template is not None:
            answer(trusted, "/v1/chat/completions", plain)
            assert trusted.prompts[-1] == "[user] Name a colour.\n[assistant] "
        else:
            assert "has no chat template" in refusal_of(trusted, "/v1/chat/completions", plain).message
        for bad, words in (("{% if x %}", "does not compile as a Jinja chat template: line 1: Unexpected end"),
                           (" \n", "chat_template is an empty template")):
            refused = refusal_of(trusted, "/v1/chat/completions", {**body, "chat_template": bad})
            assert refused.param == "chat_template" and words in refused.message, refused.message


DEEP_WORDS = "it nests too deeply to compile"


@pytest.mark.parametrize("deep", [
    "{% if x %}" * 3000 + "{{ messages }}" + "{% endif %}" * 3000,  # past Jinja's parser's recursion
    "".join(f"{{% for x{i} in messages %}}" for i in range(21)) + "{{ messages }}" + "{% endfor %}" * 21,
], ids=["past-the-recursion-limit", "past-what-python-compiles"])
def test_a_template_nested_too_deeply_is_refused_not_a_traceback(smollm2_tokenizer, monkeypatch, capsys, deep):
    """As the flag's value (exit 2, no traceback) and as a trusted request's own (a 400, not a 500):
    Jinja compiles to Python, which refuses 21 nested loops, and its parser recurses per block."""
    from launcher.cli import main, serve_command
    from launcher.serving.server_settings import settings_from_args

    with pytest.raises(ValueError, match=rf"^chat_template \(the template text .*\) does not compile as a Jinja "
                                         rf"chat template: {re.escape(DEEP_WORDS)}"):
        settings_from_args({"chat_template": deep})
    monkeypatch.setattr(serve_command, "_serve", lambda *args: pytest.fail("the server was started"))
    monkeypatch.setattr(serve_command, "_plan", lambda *args: pytest.fail("the launch was planned"))
    assert main(["serve", "--chat-template", deep, "--port", str(free_port())]) == 2
    assert DEEP_WORDS in capsys.readouterr().err
    trusted = trusting_server(copy.deepcopy(smollm2_tokenizer))
    refused = refusal_of(trusted, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 4,
                                                           "chat_template": deep})
    assert refused.status == 400 and refused.param == "chat_template" and DEEP_WORDS in refused.message


TOOL_CALL = "<tool_call>"
"""A non-special added token that the model's template writes and the server's does not."""


@pytest.fixture
def tool_call_tokenizer(smollm2_tokenizer):
    """SmolLM2's tokenizer with a non-special added <tool_call> that its own template writes (as
    Qwen's does), and no chat_control_tokens of its own."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_tokens([TOOL_CALL])
    tokenizer.chat_template = OWN_TEMPLATE + "{% if tools %}" + TOOL_CALL + "{% endif %}"
    assert tokenizer.chat_control_tokens is None and TOOL_CALL not in TEMPLATE + OWN_TEMPLATE
    return tokenizer


def test_a_replaced_template_does_not_narrow_the_control_tokens(tool_call_tokenizer):
    """A message's "<tool_call>" stays text under the server's template and under a request's own,
    neither of which writes it: the control tokens are the model's template's, pinned before the
    server's replaces it. A server without a template keeps the set it had (its template's)."""
    from launcher.serving.chat_template import use_chat_template

    token = tool_call_tokenizer.convert_tokens_to_ids(TOOL_CALL)
    said = [{"role": "user", "content": f"{TOOL_CALL}hi"}]
    body = {"model": MODEL, "messages": said}
    before = set(tool_call_tokenizer._get_control_tokens(tool_call_tokenizer.chat_template))  # transformers' own
    assert TOOL_CALL in before
    plain = scripted_server(use_chat_template(copy.deepcopy(tool_call_tokenizer), None), "Blue.")
    assert token not in answer(plain, "/tokenize", body)["tokens"]
    server = trusting_server(tool_call_tokenizer, TEMPLATE)
    for asked in (body, {**body, "chat_template": OWN_TEMPLATE}):
        ids = answer(server, "/tokenize", asked)["tokens"]
        assert token not in ids and TOOL_CALL in tool_call_tokenizer.decode(ids), asked
    answer(server, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert server.prompts[-1] == f"[user] {TOOL_CALL}hi\n[assistant] "
    # a request's own template that writes a token makes it a control token for that request
    writing = "{% for m in messages %}{{ m.content }}{% endfor %}<tool_call>"
    ids = answer(server, "/tokenize", {**body, "chat_template": writing})["tokens"]
    assert ids.count(token) == 1 and ids[-1] == token
    assert set(server.tokenizer.chat_control_tokens) == before  # as pinned, after the request
    assert set(plain.tokenizer.chat_control_tokens) == before  # without a server template: the set it had


RAISING = "{% if messages[0].role == 'user' %}{{ raise_exception('a system message must come first') }}{% endif %}"
"""A template that refuses a chat starting with the user (as some refuse chats on purpose)."""


def test_a_template_refusal_names_whose_template_refused(smollm2_tokenizer):
    """The model's, the server's (--chat-template), or the request's own (param chat_template)."""
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 4}
    model_raising = copy.deepcopy(smollm2_tokenizer)
    model_raising.chat_template = RAISING
    refused = refusal_of(scripted_server(model_raising, "Blue."), "/v1/chat/completions", body)
    assert refused.param == "messages" and refused.message.startswith(
        "messages: the model's chat template refused them: a system message must come first"), refused.message
    server = trusting_server(copy.deepcopy(smollm2_tokenizer), RAISING)
    for route, asked in (("/v1/chat/completions", body), ("/tokenize", {"model": MODEL, "messages": CHAT})):
        refused = refusal_of(server, route, asked)
        assert refused.param == "messages" and refused.message.startswith(
            "messages: the server's chat template refused them: a system message"), refused.message
    server = trusting_server(copy.deepcopy(smollm2_tokenizer), TEMPLATE)
    refused = refusal_of(server, "/v1/chat/completions", {**body, "chat_template": RAISING})
    assert refused.param == "chat_template" and refused.message.startswith(
        "chat_template: the request's own chat template refused its messages: a system message"), refused.message


def test_serve_warns_at_start_where_its_template_raises_on_a_chat(bare_model, tmp_path, monkeypatch, capsys):
    """One user message rendered at start: a warning naming the value and the error; the server starts."""
    from launcher.cli import main, serve_command

    raising = tmp_path / "raising.jinja"
    raising.write_text(RAISING, encoding="utf-8")
    started = []
    monkeypatch.setattr(serve_command, "_serve", lambda args, settings, mode: started.append(settings) or 0)
    base = ["serve", "--model", str(bare_model), "--quiet"]
    assert main([*base, "--port", str(free_port()), "--chat-template", str(raising)]) == 0
    err = capsys.readouterr().err
    assert (f"corelaunch serve: warning: --chat-template ({str(raising)!r}) raised on the one-message chat "
            f"[{{'role': 'user', 'content': 'hi'}}] with a generation prompt (TemplateError: a system message must "
            f"come first)") in err, err
    assert main([*base, "--port", str(free_port()), "--chat-template", TEMPLATE]) == 0
    assert "warning" not in capsys.readouterr().err
    assert [s.chat_template for s in started] == [RAISING, TEMPLATE]


def test_template_text_that_never_uses_messages_is_refused_as_a_mistyped_path(tmp_path):
    """`--chat-template 'templates/chat-{v2}.jinja'` (no such file) would render one string for every
    chat; a file is taken whatever it renders, as vLLM takes it."""
    from launcher.serving.server_settings import settings_from_args

    mistyped = "templates/chat-{v2}.jinja"
    words = (rf"\(the template text '{re.escape(mistyped)}'\) names no file and, read as template text, never "
             rf"uses messages, so every chat would render the same; give an existing file, or template text that "
             rf"renders messages")
    with pytest.raises(ValueError, match=rf"^--chat-template {words}"):
        serve_settings("--chat-template", mistyped)
    with pytest.raises(ValueError, match=rf"^chat_template {words}"):
        settings_from_args({"chat_template": mistyped})
    fixed = tmp_path / "fixed.jinja"
    fixed.write_text("{{ bos_token }}Say hello.", encoding="utf-8")
    assert settings_from_args({"chat_template": str(fixed)}).chat_template == "{{ bos_token }}Say hello."


def test_a_requests_own_template_is_compiled_off_the_event_loop(smollm2_tokenizer, monkeypatch):
    """Compiling a trusted request's template took 0.65 s for 62 KB: on a thread, even for a small
    body, so no stream or /health waits on it; an untrusted one is refused as before."""
    import threading

    from launcher.serving import chat_template

    compiled_on = []
    compile_it = chat_template.jinja_problem
    monkeypatch.setattr(chat_template, "jinja_problem",
                        lambda text: compiled_on.append(threading.current_thread()) or compile_it(text))
    server = trusting_server(copy.deepcopy(smollm2_tokenizer))
    body = {"model": MODEL, "messages": CHAT, "chat_template": OWN_TEMPLATE}
    assert answer(server, "/tokenize", body)["count"] > 0
    answer(server, "/v1/chat/completions", {**body, "max_tokens": 2})
    assert len(compiled_on) == 2 and threading.main_thread() not in compiled_on
    refused = refusal_of(server, "/v1/chat/completions", {**body, "chat_template": "{% if x %}"})
    assert refused.param == "chat_template" and "line 1: Unexpected end" in refused.message


def test_trusting_request_templates_is_a_flag_and_a_builder_argument():
    from launcher.serving.server_settings import settings_from_args

    assert serve_settings("--trust-request-chat-template").trust_request_chat_template is True
    assert serve_settings().trust_request_chat_template is False
    assert settings_from_args({"trust_request_chat_template": "true"}).trust_request_chat_template is True
    assert settings_from_args({}).trust_request_chat_template is False
    with pytest.raises(ValueError, match=r"^trust_request_chat_template \('maybe'\) must be true or false"):
        settings_from_args({"trust_request_chat_template": "maybe"})
