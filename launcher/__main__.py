"""`python -m launcher` runs the corelaunch CLI."""

from launcher.cli import run

run()
