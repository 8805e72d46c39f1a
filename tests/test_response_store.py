"""The kept responses (launcher/serving/responses/store.py): a conversation read back first turn
first, each response keeping its own turn; the least recently used response going first, where
continuing a conversation uses its whole chain; a missing link named; deleting; bad capacities."""

from __future__ import annotations

import pytest

from launcher.serving.responses.store import MAX_CAPACITY, ResponseStore


def said(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def answered(response_id: str, text: str) -> dict:
    return {"id": response_id, "object": "response",
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}]}


def texts(items: list) -> list[str]:
    return [item["content"] if isinstance(item["content"], str) else item["content"][0]["text"] for item in items]


def test_a_conversation_is_read_back_first_turn_first():
    store = ResponseStore(8)
    store.put(answered("r1", "Hello."), [said("Hi")], None)
    store.put(answered("r2", "Paris."), [said("Capital of France?")], "r1")
    store.put(answered("r3", "Rome."), [said("And Italy?"), said("One word.")], "r2")
    assert texts(store.history("r3")[0]) == ["Hi", "Hello.", "Capital of France?", "Paris.", "And Italy?",
                                             "One word.", "Rome."]
    assert store.history("r1") == ([said("Hi"), answered("r1", "Hello.")["output"][0]], None)
    assert len(store) == 3  # each keeps its own turn: three turns, not three whole histories
    assert store.get("r2") == answered("r2", "Paris.")


def test_the_least_recently_used_goes_first_and_a_conversation_in_use_keeps_its_turns():
    store = ResponseStore(3)
    store.put(answered("a1", "x"), [said("a")], None)
    store.put(answered("b1", "y"), [said("b")], None)
    store.put(answered("a2", "z"), [said("a again")], "a1")
    assert store.history("a2")[1] is None  # continuing a2 uses a1 too
    store.put(answered("c1", "w"), [said("c")], None)  # full: b1, the least recently used, goes
    assert store.get("b1") is None and len(store) == 3
    store.get("a1")  # reading one back uses it: a2 is now the least recently used
    store.put(answered("d1", "v"), [said("d")], None)
    assert store.get("a2") is None
    assert store.get("a1") is not None and store.get("c1") is not None and store.get("d1") is not None


def test_a_missing_or_deleted_response_is_named():
    store = ResponseStore(4)
    assert store.history("resp_x") == (None, "resp_x") and store.get("resp_x") is None
    store.put(answered("r1", "Hello."), [said("Hi")], None)
    store.put(answered("r2", "Paris."), [said("Capital?")], "r1")
    assert store.delete("r1") and not store.delete("r1")
    assert store.history("r2") == (None, "r1")
    assert store.get("r2") is not None  # still there to read back, no longer to continue


@pytest.mark.parametrize("capacity", [0, -1, True, 2.0, "8", MAX_CAPACITY + 1])
def test_a_capacity_that_is_no_count_is_refused(capacity):
    with pytest.raises(ValueError, match=f"capacity \\({capacity!r}\\) must be an integer from 1 to {MAX_CAPACITY}"):
        ResponseStore(capacity)
