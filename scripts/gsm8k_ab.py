#!/usr/bin/env python3
"""Thin caller of `k3-amd-overlay gsm8k-ab` (k3_amd_overlay/commands/gsm8k_ab.py), kept for the repository's users."""

import sys

from k3_amd_overlay.commands.gsm8k_ab import main

sys.exit(main())
