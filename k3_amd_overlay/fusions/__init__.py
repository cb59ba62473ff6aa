"""The fusions: each module holds one fusion's predicate (a pure function of state the layer
already holds), its per-layer plan and the fused code path. Nothing here imports vLLM at module
import; the vLLM-specific binding lives in targets/."""
