"""vLLM general-plugin entry point (group ``vllm.general_plugins``, name ``k3_amd_overlay``).

vLLM calls ``register`` in every process (API server, engine core, workers) before the model is
imported. With the switch off it installs nothing and leaves only a small "off" record
(``off_record.py``), the positive evidence ``check --expect off`` needs. A bad switch value, or a
requested fusion this vLLM cannot take in strict mode, raises here so vLLM startup stops: vLLM
only logs plugins that fail to *import*, so the failure must come from this function.

A ``vllm`` CLI client (``vllm bench serve``, ``vllm --version``, ``vllm collect-env``, ...) and vLLM's
model-inspection child (the registry reading a model class's facts) build no model: they are left
alone (nothing patched) and leave no evidence, not even an off record."""

from __future__ import annotations

import logging

from k3_amd_overlay.settings import load_settings

logger = logging.getLogger("vllm.k3_amd_overlay")


def register() -> None:
    from k3_amd_overlay.process_identity import is_cli_client, is_model_inspection

    if is_cli_client() or is_model_inspection():
        return
    settings = load_settings()
    if not settings.enabled:
        if settings.unknown_variables:
            logger.warning("k3-amd-overlay is off; ignoring unknown variables %s",
                           ", ".join(settings.unknown_variables))
        from k3_amd_overlay import off_record

        off_record.leave(settings)
        return
    for words in settings.ineffective_providers():
        logger.warning("k3-amd-overlay: %s", words)
    from k3_amd_overlay.activation import activate

    activate(settings)
