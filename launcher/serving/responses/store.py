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
progress and input_items lists its input, DELETE forgets it, and continuing it can be refused as
still being generated (`generating`) rather than as unknown. `put` or `abandon` (it failed, or the
client left) ends the record. A record lives `life_s` at most (begin's: the request's own timeout
and a margin): past that it is of a replica that died mid-stream, and reads as unknown. At most
`capacity` are in flight; past that the oldest record goes (that response is kept when it
finishes).

An id deleted, forgotten or abandoned is remembered (a tombstone: the last TOMBSTONES of them,
whatever the capacity) so that a put or begin that lands after it keeps nothing: a shared store's
calls may arrive late and out of order (a begin after its put, or after its abandon, is ignored).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

MAX_CAPACITY = 1_000_000
"""The most responses a store may be asked to keep (a bound on the option, not a memory budget)."""
TOMBSTONES = 10_000
"""How many ids deleted, forgotten or abandoned are remembered, so that their late put or begin keeps
nothing (ids are random: an id, a few dozen bytes, is never reused)."""


@dataclass(frozen=True)
class StoredResponse:
    response: dict
    """The Response object as it was answered (whole, or the stream's final one): its output items
    are the second half of its turn."""
    inputs: tuple
    """The first half: the request's input items."""
    previous_id: str | None
    """The response it continued (its request's previous_response_id), or None."""


@dataclass(frozen=True)
class _InFlight:
    """A response being generated, as it was when it started (status in_progress, no output)."""

    started: StoredResponse
    ends: float
    """The store's clock past which it is taken for gone (its replica died mid-stream)."""


class ResponseStore:
    def __init__(self, capacity: int, clock=time.monotonic) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"a response store's capacity ({capacity!r}) must be an integer from 1 to {MAX_CAPACITY}")
        self.capacity, self._clock = capacity, clock
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        """Least recently used first."""
        self._in_flight: OrderedDict[str, _InFlight] = OrderedDict()
        """Responses begun and not yet put, abandoned or deleted, the oldest first."""
        self._gone: OrderedDict[str, None] = OrderedDict()
        """Tombstones: ids deleted, forgotten or abandoned, the oldest first (TOMBSTONES at most)."""

    def __len__(self) -> int:
        return len(self._kept)

    def begin(self, response: dict, input_items: list, previous_id: str | None, life_s: float) -> None:
        """`response` (its id is response["id"], its status in_progress) is being generated, for at
        most life_s more seconds. Ignored where it is kept or gone already (a begin that came late)."""
        response_id = response["id"]
        if response_id in self._kept or response_id in self._gone:
            return
        started = StoredResponse(response, tuple(input_items), previous_id)
        self._in_flight[response_id] = _InFlight(started, self._clock() + life_s)
        self._in_flight.move_to_end(response_id)
        while len(self._in_flight) > self.capacity:
            self._in_flight.popitem(last=False)

    def abandon(self, response_id: str) -> None:
        """It will not be put (it failed, or the client left): its in-flight record goes, and a begin
        that comes later is ignored."""
        self._in_flight.pop(response_id, None)
        self._bury(response_id)

    def generating(self, response_id: str) -> bool:
        """Whether it was begun and is not yet put, abandoned, deleted or past its life."""
        return self._live(response_id) is not None

    def _live(self, response_id: str) -> _InFlight | None:
        in_flight = self._in_flight.get(response_id)
        if in_flight is not None and self._clock() > in_flight.ends:
            del self._in_flight[response_id]  # its put may still come (a slow reader): not buried
            return None
        return in_flight

    def _bury(self, response_id: str) -> None:
        self._gone[response_id] = None
        self._gone.move_to_end(response_id)
        while len(self._gone) > TOMBSTONES:
            self._gone.popitem(last=False)

    def put(self, response: dict, input_items: list, previous_id: str | None) -> bool:
        """Keep `response` (its id is response["id"]), answered to `input_items` after previous_id;
        False (nothing kept) where it was deleted, forgotten or abandoned meanwhile."""
        response_id = response["id"]
        self._in_flight.pop(response_id, None)
        if response_id in self._gone:
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
        in_flight = self._live(response_id)
        return None if in_flight is None else in_flight.started

    def delete(self, response_id: str) -> bool:
        """Forget it; False when it was neither kept nor in flight. A later turn that continued it can
        no longer be continued (its history names this one as missing); one in flight is not kept
        when it finishes."""
        found = self._live(response_id) is not None
        self._in_flight.pop(response_id, None)
        found = self._kept.pop(response_id, None) is not None or found
        if found:
            self._bury(response_id)
        return found

    def forget(self, response_id: str) -> None:
        """Delete it, and keep nothing its put (or begin) brings later: the replica's call to put it got
        no answer in time (its answer said store: false), and may still land (response_store_server.py)."""
        self._in_flight.pop(response_id, None)
        self._kept.pop(response_id, None)
        self._bury(response_id)
