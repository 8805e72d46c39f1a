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
finishes). A record deleted stays, marked deleted (it reads as unknown), until its put comes (which
then keeps nothing) or its life ends: however many other ids are buried meanwhile, a long stream
deleted early is not kept at its end.

An id deleted, forgotten, abandoned or pushed out of the kept ones is remembered (a tombstone: the
last TOMBSTONES of them, whatever the capacity) so that a put or begin that lands after it keeps
nothing: a shared store's calls may arrive late and out of order (a begin after its put, or after
its abandon, is ignored; so is one after the response was kept and pushed out again).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, replace

MAX_CAPACITY = 1_000_000
"""The most responses a store may be asked to keep (a bound on the option, not a memory budget)."""
TOMBSTONES = 10_000
"""How many ids deleted, forgotten, abandoned or pushed out are remembered, so that their late put or
begin keeps nothing (ids are random: an id, a few dozen bytes, is never reused)."""


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
    deleted: bool = False
    """DELETE found it: it reads as unknown, and its put keeps nothing. Marked on the record rather
    than by a tombstone, which many other ids buried during one long stream could push out."""


class ResponseStore:
    def __init__(self, capacity: int, clock=time.monotonic) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or not 1 <= capacity <= MAX_CAPACITY:
            raise ValueError(f"a response store's capacity ({capacity!r}) must be an integer from 1 to {MAX_CAPACITY}")
        self.capacity, self._clock = capacity, clock
        self._kept: OrderedDict[str, StoredResponse] = OrderedDict()
        """Least recently used first."""
        self._in_flight: OrderedDict[str, _InFlight] = OrderedDict()
        """Responses begun and not yet put or abandoned (those deleted marked so), the oldest first."""
        self._gone: OrderedDict[str, None] = OrderedDict()
        """Tombstones: ids deleted, forgotten, abandoned or pushed out, the oldest first (TOMBSTONES at
        most)."""

    def __len__(self) -> int:
        return len(self._kept)

    def begin(self, response: dict, input_items: list, previous_id: str | None, life_s: float) -> None:
        """`response` (its id is response["id"], its status in_progress) is being generated, for at
        most life_s more seconds. Ignored where it is begun, kept or gone already (a begin that came late)."""
        response_id = response["id"]
        if response_id in self._kept or response_id in self._gone or response_id in self._in_flight:
            return
        started = StoredResponse(response, tuple(input_items), previous_id)
        self._in_flight[response_id] = _InFlight(started, self._clock() + life_s)
        while len(self._in_flight) > self.capacity:
            self._drop_in_flight(next(iter(self._in_flight)))

    def abandon(self, response_id: str) -> None:
        """It will not be put (it failed, or the client left): its in-flight record goes, and a begin
        that comes later is ignored."""
        self._in_flight.pop(response_id, None)
        self._bury(response_id)

    def generating(self, response_id: str) -> bool:
        """Whether it was begun and is not yet put, abandoned, deleted or past its life."""
        return self._live(response_id) is not None

    def _live(self, response_id: str) -> _InFlight | None:
        """Its record in flight, unless deleted or past its life (a record past its life goes)."""
        in_flight = self._in_flight.get(response_id)
        if in_flight is not None and self._clock() > in_flight.ends:
            self._drop_in_flight(response_id)
            return None
        return None if in_flight is None or in_flight.deleted else in_flight

    def _drop_in_flight(self, response_id: str) -> None:
        """Its record goes without its put (past its life, or pushed out): a deleted one's mark becomes
        a tombstone; another's put may still come (a slow reader) and keeps it."""
        if self._in_flight.pop(response_id).deleted:
            self._bury(response_id)

    def _bury(self, response_id: str) -> None:
        self._gone[response_id] = None
        self._gone.move_to_end(response_id)
        while len(self._gone) > TOMBSTONES:
            self._gone.popitem(last=False)

    def put(self, response: dict, input_items: list, previous_id: str | None) -> bool:
        """Keep `response` (its id is response["id"]), answered to `input_items` after previous_id;
        False (nothing kept) where it was deleted, forgotten or abandoned meanwhile."""
        response_id = response["id"]
        in_flight = self._in_flight.pop(response_id, None)
        if in_flight is not None and in_flight.deleted:
            self._bury(response_id)
            return False
        if response_id in self._gone:
            return False
        self._kept[response_id] = StoredResponse(response, tuple(input_items), previous_id)
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.capacity:
            self._bury(self._kept.popitem(last=False)[0])  # a begin landing later does not bring it back
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
        in_flight = self._live(response_id)
        if in_flight is not None:  # marked, not buried: the mark lasts until its put or its life's end
            self._in_flight[response_id] = replace(in_flight, deleted=True)
            return True
        if self._kept.pop(response_id, None) is None:
            return False
        self._bury(response_id)
        return True

    def forget(self, response_id: str) -> None:
        """Delete it, and keep nothing its put (or begin) brings later: the replica's call to put it got
        no answer in time (its answer said store: false), and may still land (response_store_server.py)."""
        self._in_flight.pop(response_id, None)
        self._kept.pop(response_id, None)
        self._bury(response_id)
