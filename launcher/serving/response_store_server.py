"""Where a server's kept responses (launcher/serving/responses/store.py) live, and how its route
reaches them: both ways give the route the same coroutines (put, generating, history, get,
input_items, delete) and the same two calls that do not wait (begin_soon, abandon_soon: a stream's
first event does not wait for the store, and a stream cut off, its task cancelled, cannot await).

One Serve replica keeps them in its own process (LocalResponses): nothing to share, and no process
more on the host (on a host whose cores the ranks use, an idle Serve replica's background work comes
out of the forward, README: Limits). Several replicas share one store, its own small Serve deployment
in the same application (ResponseStoreServer, reached through its handle: SharedResponses), since
the next turn of a conversation may reach any replica; it is deleted with the application. A call
to it that gets no answer within STORE_WAIT_S raises StoreUnavailable (Serve's router would wait
for a dead store replica's replacement, holding every /v1/responses request meanwhile). A
put that gets no answer may still land later, keeping a response whose answer said store: false: the
response is forgotten meanwhile, as far as the store answers (store.py: forget; a put that lands
after it keeps nothing); so is one whose request was cancelled while its put was awaited (the client
left before its answer). begin_soon and abandon_soon reach it in the background (held tasks), so
they may land after a later call: the store ignores a begin that comes after the response's put,
abandon or delete (store.py: tombstones).
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from launcher.serving.responses.store import ResponseStore


STORE_WAIT_S = 10.0
"""How long a replica waits for the shared store's answer to one call."""

STORE_LOG = logging.getLogger("ray.serve")
"""The replica's log (the route's own), where a call nobody waits for says it failed."""


class StoreUnavailable(RuntimeError):
    """The shared store did not answer (its replica gone, or failing): what was asked is unknown."""


class LocalResponses:
    """The store in this process."""

    def __init__(self, capacity: int) -> None:
        self.store = ResponseStore(capacity)

    def begin_soon(self, response: dict, input_items: list, previous_id: str | None, life_s: float) -> None:
        """Done at once here (a local store does not wait)."""
        self.store.begin(response, input_items, previous_id, life_s)

    def abandon_soon(self, response_id: str) -> None:
        self.store.abandon(response_id)

    async def begin(self, response: dict, input_items: list, previous_id: str | None, life_s: float) -> None:
        """The shared store's (SharedResponses.begin_soon calls it)."""
        self.store.begin(response, input_items, previous_id, life_s)

    async def put(self, response: dict, input_items: list, previous_id: str | None) -> bool:
        return self.store.put(response, input_items, previous_id)

    async def abandon(self, response_id: str) -> None:
        """The shared store's (SharedResponses.abandon_soon calls it)."""
        self.store.abandon(response_id)

    async def generating(self, response_id: str) -> bool:
        return self.store.generating(response_id)

    async def forget(self, response_id: str) -> None:
        self.store.forget(response_id)

    async def history(self, response_id: str):
        return self.store.history(response_id)

    async def get(self, response_id: str):
        return self.store.get(response_id)

    async def input_items(self, response_id: str):
        return self.store.input_items(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)


class SharedResponses:
    """The application's store deployment, through its handle (one round trip per call)."""

    def __init__(self, handle) -> None:
        self.handle = handle
        self._sending: set[asyncio.Task] = set()
        """The calls made in the background (begin, abandon, forget) under way (held: a task only
        weakly referenced by the loop may be collected before it runs)."""

    def begin_soon(self, response: dict, input_items: list, previous_id: str | None, life_s: float) -> None:
        """Sent in the background: the stream's first event goes out meanwhile; until it lands, the
        response reads back as not kept."""
        self._in_background(f"response {response['id']} cannot be read back while it streams",
                            "begin", response, input_items, previous_id, life_s)

    def abandon_soon(self, response_id: str) -> None:
        """Sent in the background: called where the stream ends, possibly with its task cancelled."""
        self._in_background(f"response {response_id} failed or was cut off and may read back as in progress "
                            f"until its record's life ends", "abandon", response_id)

    async def put(self, response: dict, input_items: list, previous_id: str | None) -> bool:
        """The store's put; where it fails, or its caller is cancelled while it waits (the client left:
        it never gets the answer), the response forgotten in the background (store.py: forget; not
        awaited: the answer goes out meanwhile, and a cancelled task cannot await), so that a put
        that lands late keeps nothing the answer did not say."""
        try:
            return await self._call("put", response, input_items, previous_id)
        except (StoreUnavailable, asyncio.CancelledError):
            self._in_background(None, "forget", response["id"])
            raise

    async def generating(self, response_id: str) -> bool:
        return await self._call("generating", response_id)

    async def history(self, response_id: str):
        return await self._call("history", response_id)

    async def get(self, response_id: str):
        return await self._call("get", response_id)

    async def input_items(self, response_id: str):
        return await self._call("input_items", response_id)

    async def delete(self, response_id: str) -> bool:
        return await self._call("delete", response_id)

    def _in_background(self, failing: str | None, method: str, *args) -> None:
        """_call, not awaited (a task held in _sending); where it fails, `failing` says in the replica's
        log what that costs (None: nothing worth saying)."""
        sending = asyncio.ensure_future(self._quietly(failing, method, *args))
        self._sending.add(sending)
        sending.add_done_callback(self._sending.discard)

    async def _quietly(self, failing: str | None, method: str, *args) -> None:
        try:
            await self._call(method, *args)
        except StoreUnavailable as err:  # nobody waits for it: the log says so
            if failing is not None:
                STORE_LOG.warning("corelaunch serve: %s: %s", failing, err)

    async def _call(self, method: str, *args):
        try:
            return await asyncio.wait_for(getattr(self.handle, method).remote(*args), STORE_WAIT_S)
        except asyncio.TimeoutError:
            raise StoreUnavailable(f"the response store did not answer within {STORE_WAIT_S:g} s") from None
        except Exception as err:  # noqa: BLE001 - Serve's and Ray's errors alike: the store failed this call
            raise StoreUnavailable(f"the response store failed: {type(err).__name__}: {err}") from err


def refuse_several_stores(facts) -> None:
    """ValueError where Serve runs the store deployment with more than one replica (a config file's
    deployments: entry for it): each would keep its own responses, and a conversation's next turn
    could miss its earlier ones. facts: serve_deployment.DeploymentFacts, or None (unknown)."""
    if facts is not None and facts.most_replicas > 1:
        raise ValueError(f"ResponseStoreServer runs {facts.most_replicas} replicas (its deployments: entry), and "
                         f"each would keep responses of its own; leave its num_replicas at 1 (and no autoscaling)")


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1, max_ongoing_requests=1000)
class ResponseStoreServer(LocalResponses):
    """The store shared by an application's replicas: one replica (two would be two stores: refused),
    taking no CPU of the ranks' share; each call is a few dictionary operations on its event loop, so
    many may be in flight at once (Serve's default of 5 would queue the replicas' calls in its router)."""

    def __init__(self, capacity: int) -> None:
        from launcher.serving.serve_deployment import this_replicas_facts

        refuse_several_stores(this_replicas_facts())
        super().__init__(capacity)
