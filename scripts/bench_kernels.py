#!/usr/bin/env python3
"""Thin caller of `k3-amd-overlay bench` (k3_amd_overlay/commands/bench/kernels.py), kept for scripts/gpu_check.sh."""

import sys

from k3_amd_overlay.commands.bench.kernels import main

sys.exit(main())
