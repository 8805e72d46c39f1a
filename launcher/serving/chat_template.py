"""The chat template /v1/chat/completions renders messages with: the server's own (vLLM's
--chat-template, read once where the settings are made) or the tokenizer's, and whether there is one.

`tokenizer.chat_template` is None without one, but not only then: templates named only in
additional_chat_templates/ load as a dict without a default, and apply_chat_template refuses every
conversation. The server says at start that chat cannot work, and refuses chat requests as a 400
naming /v1/completions, in both cases.
"""

from __future__ import annotations

from contextlib import contextmanager

JINJA_CHARACTERS = "{}\n"
"""A chat_template value that names no readable file and holds one of these is the template text
itself; without any it is a path (vLLM's rule: renderers/chat_utils.py, _load_chat_template)."""

TAKES = "a template file, or the template text itself (text holding {, } or a newline)"
"""What a chat_template value may be, for its refusals."""


def has_default_chat_template(tokenizer) -> bool:
    """True when apply_chat_template can render a conversation with no template named."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    try:
        tokenizer.get_chat_template()
    except ValueError:  # a dict of named templates, none of them "default"
        return False
    return True


def use_chat_template(tokenizer, template: str | None):
    """The tokenizer, rendering chats with the server's template (ServerSettings.chat_template) in
    place of its own (its named ones too) where one is given; None leaves the tokenizer's. Set before
    anything reads tokenizer.chat_template, so that everything that renders or inspects it (the chat
    route, /v1/responses, /tokenize's chat form, the start's "has no chat template") takes that one.
    Its control tokens are pinned first (pin_control_tokens), so that no template narrows them."""
    pin_control_tokens(tokenizer, template)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def pin_control_tokens(tokenizer, template: str | None = None) -> None:
    """Fix the tokens sanitize_control_tokens encodes as text inside messages, where the tokenizer
    names none itself (tokenizer.chat_control_tokens): the added tokens that its own template(s) or
    `template` (the server's) write, besides its special tokens, which are always in. Without this,
    transformers takes the added tokens written by the template being rendered, so a server's or a
    request's template that never writes a non-special `<tool_call>` let a message's "<tool_call>"
    through as that token. With one template of its own and no server template the set is the one
    transformers took before; with named templates it is all of theirs."""
    find = getattr(tokenizer, "_get_control_tokens", None)  # transformers 5.20 and later, as sanitizing
    if find is None or getattr(tokenizer, "chat_control_tokens", None) is not None:
        return
    own = getattr(tokenizer, "chat_template", None)
    templates = list(own.values()) if isinstance(own, dict) else [own]
    control = set()
    for text in [*templates, template]:
        if isinstance(text, str) and jinja_problem(text) is None:  # one that does not compile renders nothing
            control.update(find(text))
    tokenizer.chat_control_tokens = sorted(control)


@contextmanager
def control_tokens_for(tokenizer, template: str | None):
    """While a request's own template (`template`) renders: the pinned control tokens
    (pin_control_tokens) and the added tokens that template writes, which are its control tokens as
    transformers takes them; the request's template widens the set, never narrows it. None (the
    server's template) or a transformers without sanitizing: the set as it is. Used under the
    replica's encoding lock: the tokenizer is changed while it renders."""
    find = getattr(tokenizer, "_get_control_tokens", None)
    pinned = getattr(tokenizer, "chat_control_tokens", None)
    if template is None or find is None or pinned is None:
        yield
        return
    tokenizer.chat_control_tokens = None  # transformers' own rule, for this template alone
    try:
        tokenizer.chat_control_tokens = sorted(set(pinned) | set(find(template)))
        yield
    finally:
        tokenizer.chat_control_tokens = pinned


PROBE = [{"role": "user", "content": "hi"}]
"""The chat a server's template is tried on at start (chat_template_warning)."""


def chat_template_problem(tokenizer) -> str | None:
    """Why the tokenizer's template raises on a one-message chat (PROBE, with a generation prompt),
    or None: said at start as a warning, not a refusal, since some templates refuse on purpose (a
    chat without a system message, say). Renders text only (milliseconds)."""
    try:
        tokenizer.apply_chat_template(PROBE, tokenize=False, add_generation_prompt=True)
    except Exception as err:  # noqa: BLE001 - whatever the template raises is what a client would see
        return f"{type(err).__name__}: {err}"
    return None


def chat_template_warning(tokenizer, value: str, name: str = "--chat-template") -> str | None:
    """The start's warning where the server's template (`value`, as given to `name`) raises on a
    one-message chat, or None."""
    problem = chat_template_problem(tokenizer)
    if problem is None:
        return None
    shown = value if len(value) <= 200 else value[:197] + "..."  # a path whole, template text clipped
    return (f"warning: {name} ({shown!r}) raised on the one-message chat {PROBE!r} with a generation prompt "
            f"({problem}): chats it raises on are refused (400); check the template, unless it refuses such "
            f"a chat on purpose")


def read_chat_template(value, name: str = "chat_template") -> str:
    """The template text a chat_template argument gives (vLLM's --chat-template): the UTF-8 file it
    names, or the value itself where it names no readable file and holds {, } or a newline. Read
    where the settings are made, so a replica on another node gets the text, not a path. ValueError
    naming `name` (the flag or argument), the value or file, and the fix: no text, a path-like value
    that is no readable file, an empty template, one that does not compile as transformers
    compiles chat templates (the Jinja error's line), or template text (not a file) that never uses
    `messages`: a mistyped path holding braces is no template. A file is taken whatever it renders,
    as vLLM takes it: naming an existing file leaves no doubt that it is the template meant."""
    if not isinstance(value, str):
        raise ValueError(f"{name} ({value!r}) must be {TAKES}")
    text, source = _template_text(value, name)
    if not text.strip():  # every chat would render to an empty prompt
        raise ValueError(f"{name} ({source}) is an empty template; give {TAKES}")
    problem = jinja_problem(text)
    if problem is not None:
        raise ValueError(f"{name} ({source}) does not compile as a Jinja chat template: {problem}")
    if text is value and "messages" not in _template_variables(text):  # text given, not a file's
        # a mistyped path holding braces (templates/chat-{v2}.jinja) would render one string for every chat
        raise ValueError(f"{name} ({source}) names no file and, read as template text, never uses messages, so "
                         f"every chat would render the same; give an existing file, or template text that "
                         f"renders messages")
    return text


def _template_text(value: str, name: str) -> tuple[str, str]:
    """(the template text, how refusals name where it came from)."""
    try:
        # utf-8-sig: a byte order mark some editors write would otherwise reach every prompt as text
        with open(value, encoding="utf-8-sig") as file:
            return file.read(), f"file {value}"
    except UnicodeDecodeError as err:
        raise ValueError(f"{name} (file {value}) is no UTF-8 text ({err.reason} at byte {err.start}); save the "
                         f"template as UTF-8") from None
    except (OSError, ValueError) as err:  # ValueError: a NUL, which no path holds
        if not any(character in value for character in JINJA_CHARACTERS):
            why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise ValueError(f"{name} ({value!r}) is no readable file ({why}); give {TAKES}") from None
    shown = value if len(value) <= 60 else value[:57] + "..."
    return value, f"the template text {shown!r}"


def jinja_problem(text: str) -> str | None:
    """Why transformers' own compiling of chat templates (its sandboxed Jinja environment, with its
    extensions) refuses `text`, with the line (a syntax error) or its nesting, or None when it
    compiles. Jinja compiles a template to Python: more than 20 nested loops, or about 100 nested
    blocks, are past what Python compiles (a SyntaxError), and a few thousand past what Jinja's parser
    recurses through (a RecursionError)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as err:  # no SyntaxError: its line is the template's
        return f"line {err.lineno}: {err.message}"
    except (RecursionError, SyntaxError) as err:
        why = err.msg if isinstance(err, SyntaxError) else "past Python's recursion limit"
        return (f"it nests too deeply to compile ({why}); flatten its blocks "
                f"(fewer {{% if %}} or {{% for %}} inside one another)")
    return None


def _template_variables(text: str) -> frozenset[str]:
    """The variables a template that compiles reads from its context (messages, tools, ...)."""
    from transformers.utils.chat_template_utils import _get_template_variables

    return _get_template_variables(text)
