"""What this package is and what it supports: its version, the vLLM range it declares, and the
names of the fusions it knows. Data only, imported by everything else, importing nothing."""

# Each release bumps it; between releases it carries a .devN suffix above the last release, so a
# newer wheel always installs over an older one (pip treats an equal version as already installed).
__version__ = "0.3.0.dev1"

DISTRIBUTION = "k3-amd-overlay"
PLUGIN_NAME = "k3_amd_overlay"

# The vLLM releases this overlay recognises, as OpenTelemetry instrumentations declare theirs.
# Inside the range the vLLM shape is still recognised by probing (targets/), never by version.
SUPPORTED_VLLM = "vllm >= 0.29, < 0.34"

QKV_NORM = "qkv_norm"
QK_CACHE = "qk_cache"
ABSORB_QK_CACHE = "absorb_qk_cache"
FUSIONS: tuple[str, ...] = (QKV_NORM, QK_CACHE, ABSORB_QK_CACHE)

REFERENCE = "reference"  # the plain-torch provider each fused op is checked against
AUTO = "auto"  # a provider setting: the first fused provider that can run here
# Each fusion's fused providers, in ``auto``'s order of preference.
FUSED_PROVIDERS: dict[str, tuple[str, ...]] = {
    QKV_NORM: ("aiter", "triton", "vllm"),
    QK_CACHE: ("aiter", "triton"),
    ABSORB_QK_CACHE: ("triton", "aiter"),  # aiter: vLLM's fp8 and MXFP4 W_K absorptions only
}
PROVIDERS: dict[str, tuple[str, ...]] = {f: (*fused, REFERENCE) for f, fused in FUSED_PROVIDERS.items()}
# Decode batches up to this many tokens take the absorbed path (W_UK folded into the fused launch)
# when absorb_qk_cache is on, larger ones the qk_cache path. On an H200 (docs/benchmarks.md) the
# absorbed launch beat the W_UK GEMM + qk_cache at every batch measured up to 256 tokens: bf16 W_UK
# 1.2-1.3x at 128-256 tokens once its KV programs took 16 rows each (2026-12-03), fp8 W_K 1.4-1.6x,
# MXFP4 1.1-1.4x; beyond 256 it is unmeasured for fp8 and MXFP4. Where a self-measurement exists
# (``k3-amd-overlay measure``), a bucket it measured slower runs stock whatever this limit says.
ABSORB_MAX_TOKENS = 256
