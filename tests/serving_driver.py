"""Drives a ServingLoop in-process: a thread per rank, requests submitted at chosen moments, every
event collected (the fast lane's stand-in for the Ray actors around the same loop)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from workers.serving.loop import ServingLoop
from workers.serving.requests import StreamRequest, TokenEvent


@dataclass
class Collected:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    finish: dict[str, str] = field(default_factory=dict)
    events: list[TokenEvent] = field(default_factory=list)


def run_loops(loops: list[ServingLoop]) -> list[threading.Thread]:
    errors: list[BaseException] = []

    def main(loop: ServingLoop) -> None:
        try:
            loop.run()
        except BaseException as err:  # noqa: BLE001 - surfaced by the test through loop.error
            loop.error = err
            errors.append(err)

    threads = [threading.Thread(target=main, args=(loop,), daemon=True) for loop in loops]
    for t in threads:
        t.start()
    return threads


def collect(leader: ServingLoop, expected: set[str], timeout_s: float = 60.0,
            on_event=None) -> Collected:
    """Poll the leader until every expected request has finished; on_event(event) after each."""
    out = Collected()
    deadline = time.monotonic() + timeout_s
    while not expected <= set(out.finish):  # requests outside `expected` (cancelled ones) may finish too
        if time.monotonic() > deadline:
            raise TimeoutError(f"requests {sorted(expected - set(out.finish))} did not finish in {timeout_s} s")
        failed = getattr(leader, "error", None)  # set by run_loops: its loop has ended, nothing more comes
        if failed is not None:
            raise RuntimeError(f"the leader's loop failed with requests {sorted(expected - set(out.finish))} "
                               f"unfinished: {failed!r}") from failed
        events, _ = leader.poll(0.2)
        for event in events:
            out.events.append(event)
            out.tokens.setdefault(event.request_id, []).extend(event.token_ids)
            if event.finish_reason is not None:
                assert event.request_id not in out.finish, f"{event.request_id} finished twice"
                out.finish[event.request_id] = event.finish_reason
            if on_event is not None:
                on_event(event)
    return out


def stop(loops: list[ServingLoop], threads: list[threading.Thread]) -> None:
    loops[0].stop()
    for t in threads:
        t.join(30)
        assert not t.is_alive(), "a serving loop did not stop"
    for loop in loops:
        assert getattr(loop, "error", None) is None, f"rank {loop.collectives.rank} failed: {loop.error!r}"


def request(rid: str, prompt, max_tokens: int, **kw) -> StreamRequest:
    from workers.sampling import SamplingParams

    kw.setdefault("sampling", SamplingParams())
    return StreamRequest(rid, tuple(prompt), max_tokens=max_tokens, **kw)


def count_prefill_calls(model) -> dict[str, int]:
    """Counts, from now on, a CompiledCausalLM's eager steps ("eager") and its prefill calls through
    a graph ("graph"); the dict returned is updated in place."""
    calls = {"eager": 0, "graph": 0}
    eager, graph = model.eager_serve_step, model.serve_step

    def counted_eager(*args):
        calls["eager"] += 1
        return eager(*args)

    def counted_graph(input_ids, *args):
        calls["graph"] += input_ids.shape[1] > 1  # prefill calls through a graph
        return graph(input_ids, *args)
    model.eager_serve_step, model.serve_step = counted_eager, counted_graph
    return calls
