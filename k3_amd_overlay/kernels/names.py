"""The overlay's GPU kernels by the names profilers show for them (each Triton function's name),
for the kernel census. Imports nothing: the census reads traces without triton."""

QK_CACHE_KERNEL = "qk_cache_kernel"
ABSORB_QK_CACHE_KERNEL = "absorb_qk_cache_kernel"
RMSNORM_PAIR_KERNEL = "rmsnorm_pair_kernel"
