"""The overlay's own Triton kernels (ROCm and CUDA). Imported only when a Triton provider runs:
importing this package pulls in triton, never vLLM or AITER."""
