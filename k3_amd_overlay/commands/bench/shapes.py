"""The shapes the kernel benchmarks measure, which ``tune`` also tunes and compares at: tokens of
qkv_norm (every batch, prefill included), per-rank query heads (K3's 96 at TP 32, 16, 8, 6) and
decode batches."""

NORM_TOKENS = [1, 8, 64, 512, 4096, 16384]
HEADS = [3, 6, 12, 16]
QK_CACHE_BATCHES = [1, 8, 32, 128, 256, 1024]
ABSORB_BATCHES = [1, 8, 32, 64, 128, 256]
