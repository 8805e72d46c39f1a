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

A streamed response's id is the client's from its first event (response.created), long before its
final one: it is recorded as in flight when it starts (`begin`), so that GET reads it back in
progress and input_items lists its input, DELETE forgets it (its final `put` then keeps nothing),
and continuing it can be refused as still being generated (`generating`) rather than as unknown.
`put` or `abandon` (it failed, or the client left) ends the record. At most `capacity` are in
flight; past that the oldest record goes (a replica that died mid-stream never ends its records),
and that response is kept when it finishes, unless deleted meanwhile.
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


@dataclass
class _InFlight:
    """A response being generated, as it was when it started (status in_progress, no output); or
    one deleted or forgotten before its put came, whose put keeps nothing."""

    started: StoredResponse | None
    """None for one never begun here, only forgotten (`forget`)."""
    deleted: bool = False
    """DELETE named it meanwhile (or `forget`): read back as not kept, and its put keeps nothing."""


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"a response store's capacity ({capacity!r}) must be an integer from 1 to {MAX_CAPACITY}")
        self.capacity = capacity
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        """Least recently used first."""
        self._in_flight: OrderedDict[str, _InFlight] = OrderedDict()
        """Responses begun and not yet put or abandoned, the oldest first."""

    def __len__(self) -> int:
        return len(self._kept)

    def begin(self, response: dict, input_items: list, previous_id: str | None) -> None:
        """`response` (its id is response["id"], its status in_progress) is being generated."""
        self._record(response["id"], _InFlight(StoredResponse(response, tuple(input_items), previous_id)))

    def _record(self, response_id: str, in_flight: _InFlight) -> None:
        self._in_flight[response_id] = in_flight
        self._in_flight.move_to_end(response_id)
        while len(self._in_flight) > self.capacity:
            self._in_flight.popitem(last=False)

    def abandon(self, response_id: str) -> None:
        """It will not be put (it failed, or the client left): its in-flight record goes."""
        self._in_flight.pop(response_id, None)

    def generating(self, response_id: str) -> bool:
        """Whether it was begun and is not yet put, abandoned or deleted."""
        started = self._in_flight.get(response_id)
        return started is not None and not started.deleted

    def put(self, response: dict, input_items: list, previous_id: str | None) -> bool:
        """Keep `response` (its id is response["id"]), answered to `input_items` after previous_id;
        False (nothing kept) where it was deleted while in flight."""
        response_id = response["id"]
        started = self._in_flight.pop(response_id, None)
        if started is not None and started.deleted:
            return False
        self._kept[response_id] = StoredResponse(response, tuple(input_items), previous_id)
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)
        return True

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
        """The kept response, or one in flight as it started (status in_progress); None for neither."""
        kept = self._used(response_id)
        return None if kept is None else kept.response

    def input_items(self, response_id: str) -> list | None:
        """The items its request sent as input (its own turn's; earlier turns' are their responses'),
        or None when it is neither kept nor in flight."""
        kept = self._used(response_id)
        return None if kept is None else list(kept.inputs)

    def _used(self, response_id: str) -> StoredResponse | None:
        kept = self._kept.get(response_id)
        if kept is not None:
            self._kept.move_to_end(response_id)
            return kept
        return self._in_flight[response_id].started if self.generating(response_id) else None

    def delete(self, response_id: str) -> bool:
        """Forget it; False when it was neither kept nor in flight. A later turn that continued it can
        no longer be continued (its history names this one as missing); one in flight is not kept
        when it finishes."""
        if self.generating(response_id):
            self._in_flight[response_id].deleted = True
            return True
        return self._kept.pop(response_id, None) is not None

    def forget(self, response_id: str) -> None:
        """Delete it, and keep nothing its put brings later: the replica's call to put it got no answer
        in time (its answer said store: false), and may still land (response_store_server.py)."""
        if not self.delete(response_id) or response_id not in self._in_flight:
            self._record(response_id, _InFlight(None, deleted=True))
