"""The responses a server keeps (`--responses-store N`), so that a request can continue one by its
previous_response_id and a client can read one back (GET /v1/responses/{id}, and its input items)
or delete it. Pure: no Ray, no server (the route: launcher/serving/openai_app.py; where the store
lives when several Serve replicas share it: launcher/serving/response_store_server.py).

Each response keeps its own turn only: the items its request sent as input (in the listed shape:
responses/listed_items.py) and the items it answered (instructions are never kept: OpenAI's rule is
that they do not carry over to the next response), plus the id of the response it continued. A
conversation's history is read by walking that chain back to its first response, so a conversation
of n turns keeps n turns, not n whole histories.

At most `capacity` responses are kept, each turn one of them; past that the least recently used one
goes (continuing a conversation uses every response of its chain, so an idle conversation goes
before one in use; storing or reading back a response uses that one). A chain whose earlier
response is gone (a conversation of more turns than the capacity loses its first) can no longer be
continued: `history` names the missing one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

MAX_CAPACITY = 1_000_000
"""The most responses a store may be asked to keep (a bound on the option, not a memory budget)."""


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    """The Response object as it was answered (whole, or the stream's final one): its output items
    are the second half of its turn."""
    inputs: tuple
    """The first half: the request's input items."""
    previous_id: str | None
    """The response it continued (its request's previous_response_id), or None."""


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"a response store's capacity ({capacity!r}) must be an integer from 1 to {MAX_CAPACITY}")
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        """Least recently used first."""

    def __len__(self) -> int:
        return len(self._kept)

    def put(self, response: dict, input_items: list, previous_id: str | None) -> None:
        """Keep `response` (its id is response["id"]), answered to `input_items` after previous_id."""
        response_id = response["id"]
        self._kept[response_id] = StoredResponse(response, tuple(input_items), previous_id)
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def history(self, response_id: str) -> tuple[list | None, str | None]:
        """(every item of the conversation up to and including `response_id`, first turn first; None)
        or, when the chain cannot be read whole, (None, the id of the response that is not kept)."""
        chain, at = [], response_id
        while at is not None:
            kept = self._kept.get(at)
            if kept is None:
                return None, at
            chain.append((at, kept))
            at = kept.previous_id
            if len(chain) > len(self._kept):  # ids are never reused, so no chain loops; bounded anyway
                return None, at
        chain.reverse()  # first turn first
        for each, _ in chain:  # the latest turn most recently used: evicted last
            self._kept.move_to_end(each)
        return [item for _, kept in chain for item in (*kept.inputs, *kept.response["output"])], None

    def get(self, response_id: str) -> dict | None:
        kept = self._used(response_id)
        return None if kept is None else kept.response

    def input_items(self, response_id: str) -> list | None:
        """The items its request sent as input (its own turn's; earlier turns' are their responses'),
        or None when it is not kept."""
        kept = self._used(response_id)
        return None if kept is None else list(kept.inputs)

    def _used(self, response_id: str) -> StoredResponse | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
        return kept

    def delete(self, response_id: str) -> bool:
        """Forget it; False when it was not kept. A later turn that continued it can no longer be
        continued (its history names this one as missing)."""
        return self._kept.pop(response_id, None) is not None
