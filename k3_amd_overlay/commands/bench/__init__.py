"""The kernel benchmarks' parts (GPU only, imported by scripts/bench_kernels.py and
scripts/make_gpu_trace.py): ``timing`` (CUDA-graph replay and eager medians, the bandwidth and
launch floors) and ``baselines`` (the unfused launches each fusion replaces); ``kernels`` is the
``k3-amd-overlay bench`` command, ``plot`` its ``bench plot``. Never imported by the overlay itself;
this package's own import needs nothing beyond the standard library."""

AITER_TREE = "K3OVL_AITER_TRITON"  # where --peers aiter finds AITER's Triton kernels off ROCm
