"""The kernel benchmarks' parts (GPU only, imported by scripts/bench_kernels.py and
scripts/make_gpu_trace.py): ``timing`` (CUDA-graph replay and eager medians, the bandwidth and
launch floors) and ``baselines`` (the unfused launches each fusion replaces). Never imported by
the overlay itself."""
