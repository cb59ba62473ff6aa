"""Kimi-K3 MLA shapes: the one home for the model's dimensions used by kernels, tests,
benchmarks and the doctor."""

NUM_HEADS = 96
KV_LORA_RANK = 512
QK_ROPE_HEAD_DIM = 64
QK_NOPE_HEAD_DIM = 128
V_HEAD_DIM = 128
Q_LORA_RANK = 1536
MLA_LAYERS = 24
NUM_HIDDEN_LAYERS = 93
MAX_POSITION_EMBEDDINGS = 1_048_576
RMS_NORM_EPS = 1e-5
LATENT_ROW = KV_LORA_RANK + QK_ROPE_HEAD_DIM  # 576: one KV-cache row, one decode query head

# Heads per rank at the tensor-parallel sizes K3 is served with.
HEADS_PER_RANK = {tp: NUM_HEADS // tp for tp in (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 96)}
