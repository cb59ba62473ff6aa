"""The fusions' decisions, pure functions of state the layer already holds: each fusion's
predicate and per-layer plan (``qkv_norm``; ``qk_cache`` for both decode fusions), and the states a
decision takes (``states``). Nothing here imports torch or vLLM; the sites that act on a decision
live in targets/, the fused code paths in ops/ and kernels/."""
