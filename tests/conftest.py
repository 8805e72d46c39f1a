"""Shared fixtures: one local Ray instance for the whole test session (ray.init costs ~2 s)."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with this machine's CPU count, shared by every test that needs Ray."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
    yield ray
    ray.shutdown()
