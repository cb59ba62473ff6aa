"""The overlay's own Triton kernels (ROCm and CUDA), imported only when a Triton provider runs.
Each kernel module imports triton; ``names`` (the kernels' names for the census) imports nothing."""
