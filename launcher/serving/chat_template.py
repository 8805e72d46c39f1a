"""The chat template /v1/chat/completions renders messages with: the server's own (vLLM's
--chat-template, read once where the settings are made) or the tokenizer's, and whether there is one.

`tokenizer.chat_template` is None without one, but not only then: templates named only in
additional_chat_templates/ load as a dict without a default, and apply_chat_template refuses every
conversation. The server says at start that chat cannot work, and refuses chat requests as a 400
naming /v1/completions, in both cases.
"""

from __future__ import annotations

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
    route, /v1/responses, /tokenize's chat form, the start's "has no chat template") takes that one."""
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def read_chat_template(value, name: str = "chat_template") -> str:
    """The template text a chat_template argument gives (vLLM's --chat-template): the UTF-8 file it
    names, or the value itself where it names no readable file and holds {, } or a newline. Read
    where the settings are made, so a replica on another node gets the text, not a path. ValueError
    naming `name` (the flag or argument), the value or file, and the fix: no text, a path-like value
    that is no readable file, an empty template, or one that does not compile as transformers
    compiles chat templates (the Jinja error's line)."""
    if not isinstance(value, str):
        raise ValueError(f"{name} ({value!r}) must be {TAKES}")
    text, source = _template_text(value, name)
    if not text.strip():  # every chat would render to an empty prompt
        raise ValueError(f"{name} ({source}) is an empty template; give {TAKES}")
    problem = jinja_problem(text)
    if problem is not None:
        raise ValueError(f"{name} ({source}) does not compile as a Jinja chat template: {problem}")
    return text


def _template_text(value: str, name: str) -> tuple[str, str]:
    """(the template text, how refusals name where it came from)."""
    try:
        with open(value, encoding="utf-8") as file:
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
    extensions) refuses `text`, with the line (a syntax error), or None when it compiles."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as err:
        return f"line {err.lineno}: {err.message}"
    return None
