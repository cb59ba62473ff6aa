"""The overlay's GPU kernels by the names profilers show for them (each Triton function's name),
for the kernel census. Imports nothing: the census reads traces without triton."""

QK_CACHE_KERNEL = "qk_cache_kernel"
ABSORB_QK_CACHE_KERNEL = "absorb_qk_cache_kernel"
ABSORB_FP8_QK_CACHE_KERNEL = "absorb_fp8_qk_cache_kernel"
ABSORB_MXFP4_QK_CACHE_KERNEL = "absorb_mxfp4_qk_cache_kernel"
STATIC_QUANT_KERNEL = "query_fp8_quant_kernel"  # the aiter absorb providers' second launch
RMSNORM_PAIR_KERNEL = "rmsnorm_pair_kernel"
