"""``python -m k3_amd_overlay``: the ``k3-amd-overlay`` command line."""

import sys

from k3_amd_overlay.commands.cli import main

sys.exit(main())
