"""A streamed response that is kept (`--responses-store N`) while it is still being generated: its
id is the client's from response.created on, so GET reads it back in progress and lists its input,
DELETE forgets it (its end keeps nothing), and continuing it is refused as still being generated;
one that fails or whose client leaves leaves no record behind, even while its put is awaited. The
store's own rules for responses in flight (launcher/serving/responses/store.py): a deleted,
forgotten or abandoned id stays so however many streams begin after it (a stream deleted early,
however many ids are buried before its end), a begin landing late is ignored (after the response
was kept and pushed out too), a record past its life (its replica died mid-stream) reads as
unknown; a shared store's put that gets no answer in time, or whose client leaves while it is
awaited, forgotten meanwhile, so that one landing late keeps nothing the answer did not say; a
shared store's begin and abandon sent without waiting (the first event does not wait for a slow
store; a stream whose task is cancelled, as Starlette cancels it when the client leaves, still
abandons its record). The routes run in-process over SmolLM2's tokenizer and the scripted engine
(tests/test_tokenize_routes.py)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from launcher.serving.openai_protocol import ProtocolError
from launcher.serving.response_store_server import LocalResponses, SharedResponses, StoreUnavailable
from launcher.serving.responses.store import TOMBSTONES, ResponseStore
from tests.manual_clock import ManualClock
from tests.test_kept_responses import keeping, request_to
from tests.test_responses_route import asked, check_with_the_clients_types, first_then, tokenizer
from tests.test_tokenize_routes import post

__all__ = ["tokenizer"]  # the module-scoped fixture, taken from the route's tests



async def read_into(response, seen: list) -> None:
    """Read a streamed response's chunks into `seen`, as a client does (in a task a scope may cancel)."""
    async for chunk in response.body_iterator:
        seen.append(chunk)

def events_of(chunks: list) -> list[dict]:
    text = "".join(chunk if isinstance(chunk, str) else chunk.decode() for chunk in chunks)
    return [json.loads(block.split("\n")[1][len("data: "):]) for block in text.split("\n\n")[:-1]]


async def answered_or_refused(call):
    try:
        return await call
    except ProtocolError as err:
        return err


async def mid_stream(server, body: dict, while_streaming):
    """The stream's first event (response.created), what while_streaming(server, its id) gives while
    the rest is still to come, then the stream's other events."""
    response = await server.responses(post("/v1/responses", {**body, "stream": True}))
    chunks = response.body_iterator
    first = events_of([await chunks.__anext__()])
    asked_meanwhile = await while_streaming(server, first[0]["response"]["id"])
    rest = [chunk async for chunk in chunks]
    return first, asked_meanwhile, events_of(rest)


async def get(server, response_id: str):
    return await answered_or_refused(server.retrieve_response(response_id,
                                                              request_to("GET", f"/v1/responses/{response_id}")))


async def delete(server, response_id: str):
    return await answered_or_refused(server.delete_response(response_id,
                                                            request_to("DELETE", f"/v1/responses/{response_id}")))


async def items(server, response_id: str):
    path = f"/v1/responses/{response_id}/input_items"
    return await answered_or_refused(server.response_input_items(response_id, request_to("GET", path)))


async def continued(server, response_id: str):
    return await answered_or_refused(server.responses(post("/v1/responses", asked(
        input="And then?", previous_response_id=response_id))))


def test_a_streamed_response_reads_back_in_progress_until_it_is_kept(tokenizer):
    server = keeping(tokenizer, ["The sky is blue today.", "Yes."])

    async def meanwhile(server, response_id):
        return await get(server, response_id), await items(server, response_id), await continued(server, response_id)

    async def run():
        first, (read, listed, refused), rest = await mid_stream(server, asked(input="Sky?"), meanwhile)
        created = first[0]["response"]
        assert read == created and read["status"] == "in_progress" and read["store"] is True
        check_with_the_clients_types(read)
        assert [item["content"][0]["text"] for item in listed["data"]] == ["Sky?"]
        assert isinstance(refused, ProtocolError) and refused.status == 400
        assert refused.param == "previous_response_id" and refused.code == "previous_response_in_progress"
        assert "still being generated" in refused.message and "response.completed" in refused.message
        final = rest[-1]["response"]
        assert rest[-1]["type"] == "response.completed" and await get(server, created["id"]) == final
        answer = await continued(server, created["id"])  # once kept, it continues
        assert json.loads(answer.body)["previous_response_id"] == created["id"]

    asyncio.run(run())


def test_a_response_deleted_while_it_streams_is_not_kept_at_its_end(tokenizer):
    server = keeping(tokenizer, "The sky is blue today.")

    async def run():
        first, gone, rest = await mid_stream(server, asked(), delete)
        response_id = first[0]["response"]["id"]
        assert gone == {"id": response_id, "object": "response", "deleted": True}
        assert rest[-1]["type"] == "response.completed"  # the answer still goes out whole
        assert first[0]["response"]["store"] is True and rest[-1]["response"]["store"] is False  # as it ends: not kept
        for call in (get, delete):
            missing = await call(server, response_id)
            assert isinstance(missing, ProtocolError) and missing.status == 404 and "was deleted" in missing.message
        lost = await continued(server, response_id)
        assert lost.code == "previous_response_not_found"

    asyncio.run(run())


def test_a_stream_that_fails_or_is_left_leaves_no_record_in_flight(tokenizer):
    from launcher.errors import RequestTimeout

    server = keeping(tokenizer, "The sky is blue today.")
    scripted = server.launcher.astream

    async def times_out():
        raise RequestTimeout("request r did not finish within 4 s")

    async def left(server, body):  # the client reads response.created, then goes
        response = await server.responses(post("/v1/responses", {**body, "stream": True}))
        response_id = events_of([await response.body_iterator.__anext__()])[0]["response"]["id"]
        assert (await get(server, response_id))["status"] == "in_progress"
        await response.body_iterator.aclose()  # as the route's response does when the client leaves
        return response_id

    async def failed(server, body):
        response = await server.responses(post("/v1/responses", {**body, "stream": True}))
        events = events_of([chunk async for chunk in response.body_iterator])
        assert events[-1]["type"] == "response.failed"
        return events[0]["response"]["id"]

    async def run():
        gone = [await left(server, asked())]
        server.launcher.astream = first_then(scripted, times_out)
        gone.append(await failed(server, asked()))
        for response_id in gone:
            missing = await get(server, response_id)
            assert isinstance(missing, ProtocolError) and missing.status == 404
            assert not await server.responses_kept.generating(response_id)
            assert (await continued(server, response_id)).code == "previous_response_not_found"

    asyncio.run(run())


def said(text: str) -> dict:
    return {"type": "message", "role": "user", "content": text}


def started(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "status": "in_progress", "output": []}


def finished(response_id: str) -> dict:
    return {"id": response_id, "object": "response", "status": "completed",
            "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "x"}]}]}


LIFE_S = 600.0


def test_the_store_keeps_responses_in_flight_apart_and_bounded():
    store = ResponseStore(2)
    store.begin(started("r1"), [said("Hi")], None, LIFE_S)
    assert store.generating("r1") and store.get("r1") == started("r1") and store.input_items("r1") == [said("Hi")]
    assert store.history("r1") == (None, "r1") and len(store) == 0  # not a turn to continue yet
    assert store.put(finished("r1"), [said("Hi")], None) and store.get("r1") == finished("r1")
    assert not store.generating("r1") and store.history("r1")[1] is None
    store.begin(started("r2"), [said("Hi")], "r1", LIFE_S)
    assert store.delete("r2") and not store.generating("r2") and store.get("r2") is None
    assert not store.delete("r2")  # deleted once
    assert not store.put(finished("r2"), [said("Hi")], "r1") and store.get("r2") is None  # its end keeps nothing
    store.begin(started("r3"), [said("Hi")], None, LIFE_S)
    store.abandon("r3")
    assert store.get("r3") is None and not store.generating("r3")
    for response_id in ("a", "b", "c"):  # past the capacity the oldest record goes
        store.begin(started(response_id), [], None, LIFE_S)
    assert [store.generating(response_id) for response_id in ("a", "b", "c")] == [False, True, True]


class HeldPut:
    """A shared store's handle whose put is held until `through` is set, as `mode` says: "cancelled"
    with its caller; or, where the caller is cancelled or gives up waiting, landing in the store after
    it (a call already sent may still land: "lands late") or having landed before, only its answer
    held ("answered late"). Its other calls are answered at once; every call's method is recorded in
    `calls`."""

    def __init__(self, mode: str) -> None:
        self.store, self.mode = LocalResponses(4), mode
        self.through, self.arrived = asyncio.Event(), asyncio.Event()
        self.calls: list[str] = []
        self.sent: list[asyncio.Task] = []

    def __getattr__(self, method):
        async def put(*args):
            self.arrived.set()
            if self.mode == "answered late":
                kept = await self.store.put(*args)
                await self.through.wait()
                return kept
            await self.through.wait()
            return await self.store.put(*args)

        async def call(*args):
            self.calls.append(method)
            if method != "put":
                return await getattr(self.store, method)(*args)
            if self.mode == "cancelled":
                return await put(*args)
            self.sent.append(asyncio.ensure_future(put(*args)))
            return await asyncio.shield(self.sent[-1])
        return SimpleNamespace(remote=call)


@pytest.mark.parametrize("begun", [False, True])
def test_a_put_that_gets_no_answer_in_time_keeps_nothing(monkeypatch, begun):
    from launcher.serving import response_store_server

    monkeypatch.setattr(response_store_server, "STORE_WAIT_S", 0.05)
    late = HeldPut("lands late")
    shared = SharedResponses(late)

    async def run():
        if begun:
            shared.begin_soon(started("r1"), [said("Hi")], None, LIFE_S)
        with pytest.raises(StoreUnavailable, match="did not answer within 0.05 s"):
            await shared.put(finished("r1"), [said("Hi")], None)
        late.through.set()
        await asyncio.gather(*late.sent)  # the put has landed, after the replica gave up on it
        return await late.store.get("r1")

    assert asyncio.run(run()) is None


def test_a_server_that_restarted_is_among_the_reasons_a_response_is_not_kept(tokenizer):
    server = keeping(tokenizer, "Hello.")
    missing = asyncio.run(get(server, "resp_1"))
    assert missing.status == 404 and "or the server (or its response store) restarted since" in missing.message


def test_a_deleted_or_forgotten_response_stays_unkept_however_many_begin_after_it():
    store = ResponseStore(2)
    store.begin(started("deleted"), [said("Hi")], None, LIFE_S)
    assert store.delete("deleted")
    store.forget("forgotten")  # a put that got no answer in time
    for response_id in ("b", "c", "d"):  # more than the capacity begin after them
        store.begin(started(response_id), [], None, LIFE_S)
    assert not store.put(finished("deleted"), [said("Hi")], None) and store.get("deleted") is None
    assert not store.put(finished("forgotten"), [said("Hi")], None) and store.get("forgotten") is None
    # tombstones take no room of the responses in flight
    live = ResponseStore(2)
    live.begin(started("live"), [said("Hi")], None, LIFE_S)
    for response_id in ("t1", "t2", "t3"):
        live.forget(response_id)
    assert live.get("live") == started("live") and live.generating("live")


def test_a_begin_that_lands_after_its_put_abandon_or_delete_is_ignored():
    store = ResponseStore(4)
    store.put(finished("kept"), [said("Hi")], None)
    store.begin(started("kept"), [said("Hi")], None, LIFE_S)  # a shared store's begin, come late
    assert store.get("kept") == finished("kept") and not store.generating("kept")
    assert store.delete("kept") and store.get("kept") is None and not store.delete("kept")
    store.begin(started("kept"), [said("Hi")], None, LIFE_S)  # later still: after the delete
    assert store.get("kept") is None
    store.abandon("left")
    store.begin(started("left"), [said("Hi")], None, LIFE_S)
    assert not store.generating("left") and store.get("left") is None


def test_a_record_in_flight_past_its_life_reads_as_unknown():
    clock = ManualClock()
    store = ResponseStore(4, clock=clock)
    store.begin(started("r1"), [said("Hi")], None, 30.0)
    clock.now = 30.0
    assert store.generating("r1") and store.get("r1") == started("r1")
    clock.now = 30.5  # its replica died mid-stream: no put, no abandon
    assert not store.generating("r1") and store.get("r1") is None and store.input_items("r1") is None
    assert not store.delete("r1")
    assert store.put(finished("r1"), [said("Hi")], None) and store.get("r1") == finished("r1")  # a slow end


def test_a_deleted_streaming_response_is_not_kept_though_more_streams_begin_meanwhile(tokenizer):
    server = keeping(tokenizer, ["The sky is blue today.", "Yes it is."], capacity=1)

    async def run():
        first = await server.responses(post("/v1/responses", {**asked(input="Sky?"), "stream": True}))
        first_id = events_of([await first.body_iterator.__anext__()])[0]["response"]["id"]
        assert (await delete(server, first_id))["deleted"] is True
        second = await server.responses(post("/v1/responses", {**asked(input="Sea?"), "stream": True}))
        await second.body_iterator.__anext__()  # begun: the only room in flight is its
        last = events_of([chunk async for chunk in first.body_iterator])[-1]
        assert last["type"] == "response.completed" and last["response"]["store"] is False
        gone = await get(server, first_id)
        assert isinstance(gone, ProtocolError) and gone.status == 404
        [chunk async for chunk in second.body_iterator]

    asyncio.run(run())


def test_a_streaming_response_past_its_life_reads_as_unknown(tokenizer, monkeypatch):
    from launcher.serving import openai_app

    server = keeping(tokenizer, ["The sky is blue today.", "Yes."])
    server.launcher.config.request_timeout_s = 0.0
    monkeypatch.setattr(openai_app, "IN_FLIGHT_MARGIN_S", 0.05)

    async def meanwhile(server, response_id):
        await asyncio.sleep(0.1)  # past the record's life: as where its replica died mid-stream
        return await get(server, response_id), await continued(server, response_id)

    async def run():
        first, (read, refused), rest = await mid_stream(server, asked(input="Sky?"), meanwhile)
        assert isinstance(read, ProtocolError) and read.status == 404
        assert isinstance(refused, ProtocolError) and refused.code == "previous_response_not_found"
        assert await get(server, first[0]["response"]["id"]) == rest[-1]["response"]  # its end still keeps it

    asyncio.run(run())


class StandIn:
    """A shared store's handle over a store in this process: `held` methods wait for their event
    first (each call's fate recorded in `fates`: "landed" or "cancelled"), the others answer at once."""

    def __init__(self, held: dict[str, asyncio.Event]) -> None:
        self.store, self.held = LocalResponses(4), held
        self.fates: dict[str, list[str]] = {method: [] for method in held}
        self.settled = asyncio.Event()

    def __getattr__(self, method):
        async def call(*args):
            if method in self.held:
                try:
                    await self.held[method].wait()
                except asyncio.CancelledError:
                    self.fates[method].append("cancelled")
                    self.settled.set()
                    raise
                answer = await getattr(self.store, method)(*args)
                self.fates[method].append("landed")
                self.settled.set()
                return answer
            return await getattr(self.store, method)(*args)
        return SimpleNamespace(remote=call)


def test_a_stream_cut_off_by_its_cancelled_task_still_abandons_its_record(tokenizer):
    import anyio

    server = keeping(tokenizer, "The sky is blue today.")
    scripted = server.launcher.astream

    server.launcher.astream = first_then(scripted, lambda: asyncio.Event().wait())  # the next token never comes

    async def run():
        stand_in = StandIn({"abandon": asyncio.Event()})  # it answers once the client has gone
        server.responses_kept = SharedResponses(stand_in)
        response = await server.responses(post("/v1/responses", {**asked(), "stream": True}))
        seen = []
        async with anyio.create_task_group() as group:  # as Starlette's response runs the stream
            group.start_soon(read_into, response, seen)
            while not seen:
                await asyncio.sleep(0)
            await asyncio.sleep(0.01)  # the stream waits for the engine
            group.cancel_scope.cancel()  # the client disconnected
        response_id = events_of(seen[:1])[0]["response"]["id"]
        stand_in.held["abandon"].set()
        await asyncio.wait_for(stand_in.settled.wait(), 5)
        assert stand_in.fates["abandon"] == ["landed"]
        assert not await stand_in.store.generating(response_id)

    asyncio.run(run())


def test_the_first_event_does_not_wait_for_a_slow_shared_begin(tokenizer, monkeypatch):
    from launcher.serving import response_store_server

    monkeypatch.setattr(response_store_server, "STORE_WAIT_S", 1.0)
    server = keeping(tokenizer, "The sky is blue today.")

    async def run():
        stand_in = StandIn({"begin": asyncio.Event()})
        server.responses_kept = SharedResponses(stand_in)
        response = await server.responses(post("/v1/responses", {**asked(), "stream": True}))
        first = events_of([await response.body_iterator.__anext__()])
        assert stand_in.fates["begin"] == []  # still on its way, neither waited for nor given up
        rest = events_of([chunk async for chunk in response.body_iterator])
        stand_in.held["begin"].set()  # the begin lands after the put
        await asyncio.wait_for(stand_in.settled.wait(), 5)
        response_id = first[0]["response"]["id"]
        assert stand_in.fates["begin"] == ["landed"] and not await stand_in.store.generating(response_id)
        assert await get(server, response_id) == rest[-1]["response"]
        assert (await delete(server, response_id))["deleted"] is True
        gone = await get(server, response_id)
        assert isinstance(gone, ProtocolError) and gone.status == 404

    asyncio.run(run())


def test_a_deleted_streams_mark_outlasts_any_number_of_ids_buried_before_its_end():
    store = ResponseStore(100)
    store.begin(started("long"), [said("Hi")], None, LIFE_S)
    assert store.delete("long")
    for i in range(TOMBSTONES + 1):  # more streams cut off meanwhile than tombstones are remembered
        store.begin(started(f"cut{i}"), [], None, LIFE_S)
        store.abandon(f"cut{i}")
    assert store.get("long") is None and not store.generating("long") and not store.delete("long")
    assert not store.put(finished("long"), [said("Hi")], None) and store.get("long") is None
    # past its life, the mark is a tombstone: its put, come late, still keeps nothing
    clock = ManualClock()
    timed = ResponseStore(4, clock=clock)
    timed.begin(started("r1"), [said("Hi")], None, 30.0)
    assert timed.delete("r1")
    clock.now = 31.0
    assert not timed.generating("r1") and not timed.put(finished("r1"), [said("Hi")], None)
    assert timed.get("r1") is None


def test_a_begin_that_lands_after_its_response_was_kept_and_pushed_out_is_ignored():
    store = ResponseStore(1)
    store.put(finished("a"), [said("Hi")], None)
    store.put(finished("b"), [said("Hi")], None)  # a was kept, then pushed out
    store.begin(started("a"), [said("Hi")], None, LIFE_S)  # a shared store's begin, come late
    assert store.get("a") is None and not store.generating("a") and store.history("a") == (None, "a")
    assert store.get("b") == finished("b")


@pytest.mark.parametrize("mode", ["cancelled", "lands late", "answered late"])
def test_a_client_that_leaves_while_its_put_is_awaited_leaves_no_response(tokenizer, mode):
    import anyio

    server = keeping(tokenizer, "The sky is blue today.")

    async def run():
        handle = HeldPut(mode)
        shared = server.responses_kept = SharedResponses(handle)
        response = await server.responses(post("/v1/responses", {**asked(), "stream": True}))
        seen = []
        async with anyio.create_task_group() as group:  # as Starlette's response runs the stream
            group.start_soon(read_into, response, seen)
            await asyncio.wait_for(handle.arrived.wait(), 5)  # the final put is under way
            group.cancel_scope.cancel()  # the client disconnected
        events = events_of(seen)
        response_id = events[0]["response"]["id"]
        assert all(event["type"] != "response.completed" for event in events)  # it never got the answer
        await asyncio.gather(*shared._sending)  # the calls sent in the background have landed
        handle.through.set()
        await asyncio.gather(*handle.sent)  # and then the put, or its answer
        assert "forget" in handle.calls
        assert not await handle.store.generating(response_id) and await handle.store.get(response_id) is None

    asyncio.run(run())
