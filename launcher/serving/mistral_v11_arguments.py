"""V11Arguments: a Mistral v11 call's arguments streamed as they come; the mistral reader
(launcher/serving/mistral_calls.py) drives one per streamed v11 call."""

from __future__ import annotations

from launcher.serving.call_json import JsonValueEnd, decode_at

LITERALS = ("true", "false", "null")
"""The words that are a whole JSON value (NaN and the infinities, which Python's decoder takes, are no
call's JSON here: launcher/serving/call_json.py; arguments starting with one are text)."""
_SURE_NUMBER_STATES = frozenset(("sign", "zero", "int", "frac", "exp"))
"""A number's states in which every character so far belongs to it (in "dot", "e" and "e_sign" the
last one or two may not: `1.x` is the number 1 to json's decoder, the text after it dropped)."""


def number_step(state: str, char: str) -> str | None:
    """A JSON number's state after one more character, as json's pattern
    `-?(?:0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?` reads it from "start"; None where the
    character does not continue the number (it has ended before it)."""
    digit = "0" <= char <= "9"
    if state in ("start", "sign") and digit:
        return "zero" if char == "0" else "int"
    if state == "start" and char == "-":
        return "sign"
    if state == "int" and digit:
        return "int"
    if state in ("dot", "frac") and digit:
        return "frac"
    if state in ("zero", "int") and char == ".":
        return "dot"
    if state in ("zero", "int", "frac") and char in "eE":
        return "e"
    if state == "e" and char in "+-":
        return "e_sign"
    if state in ("e", "e_sign", "exp") and digit:
        return "exp"
    return None


class V11Arguments:
    """A v11 call's arguments streamed as they come (the text after `[ARGS]`, up to the next marker):
    feed() returns the text now sure to be part of the arguments the whole reading takes
    (v11_arguments: the first JSON value of the stripped text, or all that text when it starts with
    none), end() the rest once the next marker or the end of the text has come. Sure means: not
    whitespace that may turn out to end the text (it is stripped), and not a `.`, `e`, `e-` after a
    number that the next character may leave out of it."""

    def __init__(self) -> None:
        self.stage = "lead"
        """"lead": only whitespace so far; "value": in a JSON object, array or string; "number",
        "word": in a number or one of LITERALS; "text": the arguments are all the text up to the next
        marker (it starts with no JSON value, or one that is not JSON after all); "done": the value
        has ended, and the rest of the text is dropped."""
        self._blank: list[str] = []
        """"value", "text": whitespace held after the last sure character."""
        self._value: list[str] = []
        """"value": its text so far, decoded where it closes; "number": its sure text so far."""
        self._value_end = JsonValueEnd()
        self._number_state = "start"
        self._pending = ""
        """"number": its characters after the sure ones."""
        self._word = ""
        """"word": the letters so far (a proper start of one of LITERALS)."""

    def feed(self, text: str) -> str:
        out, at = [], 0
        while at < len(text) and self.stage != "done":
            if self.stage == "lead":
                at = self._past_whitespace(text, at)
            elif self.stage == "value":
                at = self._in_value(text, at, out)
            elif self.stage == "number":
                at = self._in_number(text, at, out)
            elif self.stage == "word":
                at = self._in_word(text, at, out)
            else:
                out.append(self._sure(text[at:]))
                at = len(text)
        return "".join(out)

    def end(self) -> str:
        """The arguments' last piece: "{}" when there were none, what a number left unsure if it
        turns out to be no JSON (`1` followed by 5000 more digits and a `.`), else ""."""
        if self.stage == "lead":
            return "{}"
        out: list[str] = []
        if self.stage == "number":
            self._number_ended(out)
        self.stage = "done"
        return "".join(out)

    def _past_whitespace(self, text: str, at: int) -> int:
        """Skip whitespace (the whole reading strips it); the first other character picks the stage."""
        while at < len(text) and text[at].isspace():
            at += 1
        if at < len(text):
            char = text[at]
            if char in '{["':
                self.stage = "value"
            elif char == "-" or "0" <= char <= "9":
                self.stage = "number"
            elif any(literal.startswith(char) for literal in LITERALS):
                self.stage = "word"
            else:
                self.stage = "text"
        return at

    def _sure(self, text: str) -> str:
        """The text up to its last non-whitespace character, after the whitespace held before it; a
        whitespace tail is held (it is no argument if the text ends there)."""
        stripped = text.rstrip()
        if not stripped:
            self._blank.append(text)
            return ""
        out = "".join(self._blank) + stripped
        self._blank = [text[len(stripped):]] if len(stripped) < len(text) else []
        return out

    def _in_value(self, text: str, at: int, out: list[str]) -> int:
        """A JSON object, array or string: sent as written up to where it closes; there, a value that
        is JSON ends the arguments, and one that is not makes them all the text up to the marker."""
        closed = self._value_end.feed(text, at)
        end = len(text) if closed is None else closed
        self._value.append(text[at:end])
        out.append(self._sure(text[at:end]))
        if closed is not None:
            self.stage = "text" if decode_at("".join(self._value)) is None else "done"
            self._value = []
        return end

    def _in_number(self, text: str, at: int, out: list[str]) -> int:
        """A number's characters: the sure ones go out, a possible `.`, `e`, `e-` waits for the next
        character. Where the number ends, it ends the arguments, unless it is no call's JSON (an
        integer past Python's digit limit, a number beyond a double's range, a lone `-`: call_json's
        decode_at): then the arguments are all the text."""
        start = sure_to = at
        while at < len(text):
            state = number_step(self._number_state, text[at])
            if state is None:
                break
            self._number_state, at = state, at + 1
            if state in _SURE_NUMBER_STATES:
                sure_to = at
        if sure_to > start:  # what was pending before this piece is sure now
            sure = self._pending + text[start:sure_to]
            self._value.append(sure)
            out.append(sure)
            self._pending = text[sure_to:at]
        else:
            self._pending += text[start:at]
        if at < len(text) and self.stage == "number":
            self._number_ended(out)
        return at

    def _number_ended(self, out: list[str]) -> None:
        if decode_at("".join(self._value)) is None:
            self.stage = "text"
            out.append(self._pending)  # not whitespace: part of the stripped text, whatever follows
        else:
            self.stage = "done"
        self._value, self._pending = [], ""

    def _in_word(self, text: str, at: int, out: list[str]) -> int:
        """One of LITERALS being written: each letter goes out (the word's, or the text's if it turns
        out to be none); the whole word ends the arguments."""
        start = at
        while at < len(text):
            word = self._word + text[at]
            if not any(literal.startswith(word) for literal in LITERALS):
                self.stage = "text"
                break
            self._word, at = word, at + 1
            if word in LITERALS:
                self.stage = "done"
                break
        out.append(text[start:at])
        return at
