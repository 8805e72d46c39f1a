"""Every Serve replica's metrics on every replica's GET /metrics.

Each Serve replica keeps its own registry (metrics.py), and with several replicas Serve sends each
scrape to one of them: a scrape showed that replica's counters alone, the next another's, which
Prometheus read as counter resets. So where a deployment may run more than one replica, each one
posts its exposition text to one small named Ray actor every PUSH_PERIOD_S (and when scraped), and
GET /metrics answers with every live replica's series, each labelled `replica` with Serve's id for
it. Counters and histograms of a replica that is gone drop out (a new replica is a new series, as
Prometheus expects); another replica's gauges may be up to PUSH_PERIOD_S old.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

PUSH_PERIOD_S = 2.0
STALE_AFTER_S = 3 * PUSH_PERIOD_S
"""A replica that has posted nothing for this long is taken for gone (stopped, or killed)."""
GATHER_TIMEOUT_S = 5.0


class MetricsBoard:
    """The latest exposition text of each replica (a Ray actor, one per application)."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[float, int, bytes]] = {}  # replica: (arrived, its render's number, text)
        self._dropped: set[str] = set()
        """Replicas that stopped (drop): a periodic post rendered before the stop but arriving after its
        drop showed a cleanly stopped replica again for up to STALE_AFTER_S. Serve never reuses an id."""

    def put(self, replica: str, text: bytes, rendered: int) -> None:
        """Keep `text` unless the replica's board already holds a later render of its (`rendered`
        counts its renders): a periodic post rendered before a scrape's but arriving after it
        replaced the newer text, and the next scrape showed a counter going back, a reset to
        Prometheus."""
        if replica in self._dropped:
            return
        held = self._texts.get(replica)
        now = time.monotonic()
        if held is not None and held[1] > rendered:
            self._texts[replica] = (now, held[1], held[2])  # still alive, its newer text kept
        else:
            self._texts[replica] = (now, rendered, text)

    def gather(self, replica: str, text: bytes, rendered: int) -> dict[str, bytes]:
        """Post `replica`'s text and return every live replica's."""
        self.put(replica, text, rendered)
        now = time.monotonic()
        self._texts = {r: held for r, held in self._texts.items() if now - held[0] < STALE_AFTER_S}
        return {r: held[2] for r, held in self._texts.items()}

    def drop(self, replica: str) -> None:
        self._texts.pop(replica, None)
        self._dropped.add(replica)


def board_for(app_name: str):
    """The application's board, started by the first replica that asks. Detached: it outlives the
    replica that started it (Serve replaces replicas); one `corelaunch serve` stops with its Ray."""
    import ray

    actor = ray.remote(num_cpus=0, max_restarts=-1)(MetricsBoard)
    return actor.options(name=f"corelaunch-metrics-{app_name}", namespace="corelaunch", lifetime="detached",
                         get_if_exists=True).remote()


def merged_exposition(texts: dict[str, bytes]) -> bytes:
    """One exposition of every replica's series, each sample labelled replica=<id>."""
    registry = CollectorRegistry()
    registry.register(_Merged(texts))
    return generate_latest(registry)


class _Merged:
    def __init__(self, texts: dict[str, bytes]) -> None:
        self.texts = texts

    def collect(self):
        families: dict[str, Metric] = {}
        for replica, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text.decode()):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type)
                merged.samples.extend(Sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp,
                                             s.exemplar) for s in family.samples)
        return list(families.values())


class BoardPoster:
    """A replica's side: posts its own text every PUSH_PERIOD_S on a daemon thread, and on a scrape
    posts it and reads every replica's. A board that cannot be reached leaves the scrape with this
    replica's own series (labelled, so they never mix with the others')."""

    def __init__(self, board, replica: str, render) -> None:
        self.board, self.replica, self._render = board, replica, render
        self._renders = itertools.count()
        self._render_lock = threading.Lock()  # a render's number orders its values: taken together
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._post_periodically, name="corelaunch-metrics-board", daemon=True)
        self._thread.start()

    def _post_periodically(self) -> None:
        import ray

        while not self._stop.wait(PUSH_PERIOD_S):
            try:
                ray.get(self.board.put.remote(self.replica, *self.render()), timeout=GATHER_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the next period tries again; a scrape falls back to its own
                pass

    def exposition(self) -> bytes:
        import ray

        own, rendered = self.render()
        try:
            # Submitted in an empty context, so the call is no child of the scrape's request: the
            # route runs on a thread carrying a copy of the request's context (Ray's current task
            # among it), and Serve's proxy cancels a disconnected client's request with its children.
            # Scrapes cut short that way had their gathers cancelled, and (seen through Serve) from
            # then on every call of this replica's to the board went unanswered: each scrape waited
            # GATHER_TIMEOUT_S and showed this replica alone, and its periodic posts stopped, so the
            # others showed it no more.
            gather = contextvars.Context().run(self.board.gather.remote, self.replica, own, rendered)
            texts = ray.get(gather, timeout=GATHER_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - see the class docstring
            texts = {self.replica: own}
        return merged_exposition(texts)

    def render(self) -> tuple[bytes, int]:
        """This replica's exposition text and the number of its render (later renders, higher)."""
        with self._render_lock:
            return self._render(), next(self._renders)

    def close(self) -> None:
        self._stop.set()
        try:
            self.board.drop.remote(self.replica)
        except Exception:  # noqa: BLE001 - Ray may be shutting down
            pass
