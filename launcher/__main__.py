"""`python -m launcher` runs the corelaunch CLI."""

import sys

from launcher.cli import main

sys.exit(main())
