"""The CPU backend behind an import that takes 5 s (as torch's can on a busy host): a rank that
imports it from the backend registry spends those seconds in the import (tests/fault_actors.py)."""

import time

time.sleep(5.0)

from workers.backends.cpu import CpuBackend  # noqa: E402,F401 - re-exported after the slow import
