"""The operator's commands (``k3-amd-overlay ...``) and their helpers: one module per command
(cli.py dispatches; check's judging is verdict.py). Nothing that runs inside a vLLM process imports
this package (tests/test_package.py checks it)."""
