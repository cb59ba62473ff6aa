"""Test scaffolding shipped with the package (tests and ``k3-amd-overlay doctor`` use it): a
stand-in for AITER's fused decode op that checks every argument against AITER's contract, and a
harness that builds and runs a real vLLM Kimi-K3 MLA layer on CPU."""
