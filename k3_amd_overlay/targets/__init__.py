"""Everything that touches vLLM lives here; fusions/ decides over plain values, ops/ and kernels/
compute without vLLM.

Where each thing is:
    shapes.py        the vLLM shapes the overlay recognises (0.27-0.29 plain wrapper, 0.30-0.31 K3
                     norm wrapper, 0.32-0.33 K3 decode wrapper): anchors, what vLLM fuses itself, the
                     patches (PatchSpecs) each installs; docs/patches.md is the register of them all
    sources.py       static probes of vLLM's source on disk (ast), before any model import
    defects.py       known defects of vLLM's own K3 code, recognised by source
    vllm_env.py      what the running vLLM process says (fp8 dtype, config in context, AITER switch,
                     backend head padding, KV-connector hooks, attention context): its only imports
                     of vLLM at run time
    installer.py     reads a freshly built K3 layer into the predicate inputs (fusions/), decides,
                     attaches the sites; every shape comes through ``install_sites``
    norm.py          the qkv_norm site: ``QkvNormSite.normalize``, the one site acting on qkv_norm
    decode.py        the decode site: ``DecodeSite``, the one site acting on qk_cache and
                     absorb_qk_cache (the fused decode step: one launch, then vLLM's MQA and V-up)
    k3_wrapper.py    wrapt wrappers on the K3 wrapper class (0.30+): ``__init__``, ``_normalize_q_kv``,
                     ``_fused_qk_prep_supported``, ``_fused_decode``; the text model's layer report
    plain_wrapper.py the K3-only wrapper subclass bound in ``amd/linear.py`` (0.27-0.29; stock mode too)
    attend_hook.py   the per-instance MLAAttention class swap that carries the decode site (0.27-0.31;
                     every release in stock mode, for the census's decode range)
    class_swap.py    the per-instance class swap both hooks use: a K3-only subclass made once per class
    norm_hook.py     the per-instance RMSNorm class swap that opens the census's qkv_norm range where
                     vLLM's shared forward calls the two norms itself (0.27-0.29; stock mode too)
"""
