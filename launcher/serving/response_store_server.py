"""Where a server's kept responses (launcher/serving/responses/store.py) live, and how its route
reaches them: both ways give the route the same four coroutines (put, history, get, delete).

One Serve replica keeps them in its own process (LocalResponses): nothing to share, and no process
more on the host (on a host whose cores the ranks use, an idle Serve replica's background work comes
out of the forward, README: Limits). Several replicas share one store, its own small Serve deployment
in the same application (ResponseStoreServer, reached through its handle: SharedResponses), since
the next turn of a conversation may reach any replica; it is deleted with the application.
"""

from __future__ import annotations

from ray import serve

from launcher.serving.responses.store import ResponseStore


class LocalResponses:
    """The store in this process."""

    def __init__(self, capacity: int) -> None:
        self.store = ResponseStore(capacity)

    async def put(self, response: dict, input_items: list, previous_id: str | None) -> None:
        self.store.put(response, input_items, previous_id)

    async def history(self, response_id: str):
        return self.store.history(response_id)

    async def get(self, response_id: str):
        return self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return self.store.delete(response_id)


class SharedResponses:
    """The application's store deployment, through its handle (one round trip per call)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    async def put(self, response: dict, input_items: list, previous_id: str | None) -> None:
        await self.handle.put.remote(response, input_items, previous_id)

    async def history(self, response_id: str):
        return await self.handle.history.remote(response_id)

    async def get(self, response_id: str):
        return await self.handle.get.remote(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self.handle.delete.remote(response_id)


@serve.deployment(ray_actor_options={"num_cpus": 0}, num_replicas=1, max_ongoing_requests=1000)
class ResponseStoreServer(LocalResponses):
    """The store shared by an application's replicas: one replica (two would be two stores), taking no
    CPU of the ranks' share; each call is a few dictionary operations on its event loop, so many may
    be in flight at once (Serve's default of 5 would queue the replicas' calls in its router)."""
