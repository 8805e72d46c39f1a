"""Whether a tokenizer has the chat template /v1/chat/completions renders messages with.

`tokenizer.chat_template` is None without one, but not only then: templates named only in
additional_chat_templates/ load as a dict without a default, and apply_chat_template refuses every
conversation. The server says at start that chat cannot work, and refuses chat requests as a 400
naming /v1/completions, in both cases.
"""

from __future__ import annotations


def has_default_chat_template(tokenizer) -> bool:
    """True when apply_chat_template can render a conversation with no template named."""
    if getattr(tokenizer, "chat_template", None) is None:
        return False
    try:
        tokenizer.get_chat_template()
    except ValueError:  # a dict of named templates, none of them "default"
        return False
    return True
