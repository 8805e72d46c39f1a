"""A backend that exists only in the tests: one module, registered by a test with one entry
(FAKE_ENTRY) and nothing else edited, is enough for the CLI, the planner, the Ray bundles and a
rank to take it. It is the cpu backend under another name, with a constructor option."""

from __future__ import annotations

from workers.backends import BackendEntry
from workers.backends.cpu import CpuBackend


class FakeBackend(CpuBackend):
    name = "fake"

    def __init__(self, lnc: int = 1) -> None:
        self.lnc = lnc


def planner_target(request):
    return request.instance or "cpu"


def found() -> bool:
    return True


FAKE_ENTRY = BackendEntry(
    name="fake", implementation="tests.fake_backend:FakeBackend", planner_target="tests.fake_backend:planner_target",
    description="the cpu backend under another name", detect="tests.fake_backend:found",
    found_when="the tests register it", ray_resource="fake_accelerator", constructor_options=("lnc",))
