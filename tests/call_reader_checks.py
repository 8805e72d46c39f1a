"""What the tests of the tool_choice "auto" readers (hermes, llama3_json, mistral, pythonic,
qwen3_coder) share: a whole text's answer checked against its table row, a text that is all content,
a text streamed in given pieces, random cut points, and the check that the stream says what the whole answer says."""

from __future__ import annotations

import json
import random
import re


def default_id(call_id: str) -> bool:
    """vLLM's default tool call id (tool_calls.new_call_id)."""
    return re.fullmatch(r"chatcmpl-tool-[0-9a-f]{16}", call_id) is not None


def named(calls: list[dict]) -> list[tuple[str, str]]:
    return [(call["function"]["name"], call["function"]["arguments"]) for call in calls]


def assert_read_whole_as(reader_class, read_whole, text: str, content, calls: list, id_ok=default_id) -> dict:
    """The module's read_whole and the reader's whole answer give `content` and `calls`, each call
    with its id (made once: the ids stay), finished by "tool_calls" when there are calls (a cut text
    keeps "length"). Returns the reader's message."""
    assert read_whole(text).content == content and read_whole(text).calls == calls
    reader = reader_class()
    reader.push(text, True)
    message = reader.message()
    assert message["content"] == content
    assert named(message.get("tool_calls", [])) == calls and ("tool_calls" in message) == bool(calls)
    for call in message.get("tool_calls", []):
        assert call["type"] == "function" and id_ok(call["id"])
    assert reader.message() == message  # made once: the ids stay
    assert reader.finish_reason("stop") == ("tool_calls" if calls else "stop")
    assert reader.finish_reason("length") == "length"  # a cut text says so, calls or not
    return message


def assert_all_content(reader_class, read_whole, text: str, content: str | None = None) -> None:
    """A text without a readable call is all content (`content`: the text itself unless given),
    whole reading and reader alike."""
    content = text if content is None else content
    assert read_whole(text).content == content and read_whole(text).calls == []
    reader = reader_class()
    reader.push(text, True)
    assert reader.message() == {"role": "assistant", "content": content} and reader.finish_reason("stop") == "stop"


def reassembled(entries: list[dict]) -> list[dict]:
    """The calls streamed entries make, in index order: a call's first entry carries its index, id,
    type and name (and the arguments so far), the later ones only its index and more arguments,
    which are appended (each entry's form checked)."""
    calls: dict[int, dict] = {}
    for entry in entries:
        if entry["index"] not in calls:
            assert set(entry) == {"index", "id", "type", "function"} and entry["type"] == "function", entry
            assert set(entry["function"]) == {"name", "arguments"}, entry
            calls[entry["index"]] = {**entry, "function": dict(entry["function"])}
        else:
            assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}, entry
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    return [calls[index] for index in sorted(calls)]


def same_json(streamed_arguments: str, whole_arguments: str) -> bool:
    """The streamed arguments (the text as written) hold the JSON value the whole answer's (as
    json.dumps writes it) do; arguments that are no JSON (a format that takes any text) are the
    same text."""
    try:
        whole_value = json.loads(whole_arguments)
    except ValueError:
        return streamed_arguments == whole_arguments
    return json.dumps(json.loads(streamed_arguments)) == json.dumps(whole_value)


def streamed_with_deltas(reader, text: str, cuts: list[int]) -> tuple[str, list[dict], str, list[dict]]:
    """The text streamed through `reader` in pieces cut at `cuts`: its content, its calls (reassembled
    from the entries), its finish reason and every delta."""
    deltas, edges = [], [0, *cuts, len(text)]
    for i, (start, end) in enumerate(zip(edges, edges[1:])):
        deltas.append(reader.delta(text[start:end], i == len(edges) - 2))
    content = "".join(delta.get("content", "") for delta in deltas)
    calls = reassembled([call for delta in deltas for call in delta.get("tool_calls", [])])
    assert [call["function"] for call in reader.calls()] == [call["function"] for call in calls]
    return content, calls, reader.finish_reason("stop"), deltas


def streamed(reader_class, text: str, cuts: list[int], parallel: bool = True) -> tuple[str, list[dict], str]:
    """The text streamed in pieces cut at `cuts`: its content, its calls and its finish reason."""
    return streamed_with_deltas(reader_class(parallel), text, cuts)[:3]


def random_cuts(rng: random.Random, text: str, most: int = 12) -> list[int]:
    return sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, most)))) if len(text) > 1 else []


def assert_streamed_as_whole(reader_class, text: str, cuts: list[int], id_ok=lambda call_id: call_id.startswith(
        "chatcmpl-tool-")) -> None:
    """Content, calls (in order, indexed 0..n-1: names, and arguments holding the same JSON) and
    finish reason of the stream are the whole answer's."""
    whole = reader_class()
    whole.push(text, True)
    expected = whole.message()
    content, calls, finish = streamed(reader_class, text, cuts)
    assert content == (expected["content"] or ""), (text, cuts)
    assert [call["index"] for call in calls] == list(range(len(calls)))
    whole_calls = expected.get("tool_calls", [])
    assert [call["function"]["name"] for call in calls] == [call["function"]["name"] for call in whole_calls]
    assert all(same_json(call["function"]["arguments"], whole_call["function"]["arguments"])
               for call, whole_call in zip(calls, whole_calls)), (text, cuts)
    assert all(id_ok(call["id"]) for call in calls)  # (reassembled checked each type)
    assert finish == whole.finish_reason("stop"), (text, cuts)


def answered_with_parser(model_dir, parser: str, body: dict, refused_without: bool = False):
    """Over a real in-process Launcher, a chat `body` answered by a server reading "auto" calls with
    `parser`: (the ProtocolError a server without the option gives it, when refused_without, else
    None; the whole answer; the stream's chunks)."""
    import asyncio

    import pytest

    from launcher.api import Launcher
    from launcher.serving.openai_protocol import ProtocolError
    from tests.test_skip_special_tokens import answered, replica_over
    from tests.test_tokenize_routes import post

    route = "/v1/chat/completions"
    with Launcher(model=model_dir, tp=1, max_num_seqs=4, progress=False, compile=False) as llm:
        server = replica_over(llm)

        async def answers():
            refused = None
            if refused_without:
                server.tool_call_parser = None  # as a server started without the option
                with pytest.raises(ProtocolError) as refusal:
                    await server.chat_completions(post(route, body))
                refused = refusal.value
            server.tool_call_parser = parser  # as OpenAIServer's constructor sets it from the settings
            return refused, await answered(server, route, body), await answered(server, route, {**body, "stream": True})

        return asyncio.run(answers())


def assert_forced_calls_end_to_end(model_dir, parser: str, reader_class, text: str,
                                   expected: list[tuple[str, str]]) -> None:
    """Over a real in-process Launcher: the model's text forced (a structured_outputs regex) to
    `text`, on a server reading "auto" calls with `parser`: for each of n=2 choices no content and
    the `expected` calls, finished by "tool_calls", whole and streamed alike."""
    from launcher.serving.openai_protocol import ChatCompletionRequest, parse_request
    from tests.test_tool_calls import BASE, TOOLS, streamed_calls

    body = {**BASE, "tools": TOOLS, "tool_choice": "auto"}
    assert isinstance(parse_request(ChatCompletionRequest, body, parser).tool_call_reader(), reader_class)
    body = {**body, "structured_outputs": {"regex": re.escape(text)}, "max_tokens": 80, "temperature": 1.0,
            "seed": 3, "n": 2}
    _, whole, stream = answered_with_parser(model_dir, parser, body)

    assert len(whole["choices"]) == 2
    for choice in whole["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        calls = choice["message"]["tool_calls"]
        assert all(call["type"] == "function" and call["id"].startswith("chatcmpl-tool-") for call in calls)
        assert named(calls) == expected
    calls, finishes, contents = streamed_calls(stream, 2)
    assert finishes == ["tool_calls", "tool_calls"] and contents == ["", ""]
    for choice_calls, choice in zip(calls, whole["choices"]):  # the arguments as written: the same JSON
        whole_calls = choice["message"]["tool_calls"]
        assert [call["function"]["name"] for call in choice_calls] == [call["function"]["name"] for call in whole_calls]
        assert all(same_json(call["function"]["arguments"], whole_call["function"]["arguments"])
                   for call, whole_call in zip(choice_calls, whole_calls))
