#!/usr/bin/env python3
"""Thin caller of `k3-amd-overlay ab-serve` (k3_amd_overlay/commands/ab_serve.py), kept for the repository's users."""

import sys

from k3_amd_overlay.commands.ab_serve import main

sys.exit(main())
