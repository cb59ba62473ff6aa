"""Every overlay kernel's Triton cache key is worked out in one order before a process's first launch
(kernels/cache_keys.py): on a GPU, keys otherwise depended on what the process had launched before, and
``tune``'s compile workers and the tuning process missed each other's compiles
(tests/test_gpu_tune_compile.py, which failed on an H100 before and passes with it). Here: every
module with a Triton function is settled, each such function is, and a launch settles first."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from k3_amd_overlay.kernels import cache_keys, launch

KERNELS = Path(launch.__file__).parent


def _jit_functions(path: Path) -> list[str]:
    """The functions of ``path`` decorated ``@triton.jit`` (with or without arguments)."""
    found = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef):
            for decorator in node.decorator_list:
                target = decorator.func if isinstance(decorator, ast.Call) else decorator
                if ast.unparse(target) == "triton.jit":
                    found.append(node.name)
    return found


def test_every_module_with_a_triton_function_is_settled():
    modules = {p.stem for p in KERNELS.glob("*.py") if _jit_functions(p)}
    assert modules == set(cache_keys.KERNEL_MODULES)


def test_settling_works_out_every_triton_functions_key_compiled_not_interpreted():
    """Outside Triton's interpreter (whose functions have no key) every function of those modules is
    settled; no GPU is needed to work a key out."""
    expected = sum(len(_jit_functions(KERNELS / f"{m}.py")) for m in cache_keys.KERNEL_MODULES)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = "from k3_amd_overlay.kernels import cache_keys; print(cache_keys.settle())"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) == expected > 20


def test_a_launch_settles_the_keys_before_it_runs(monkeypatch):
    order = []
    monkeypatch.setattr(cache_keys, "settle", lambda: order.append("settle"))

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **options: order.append("launch")

    launch.launch(Kernel(), (1,))
    assert order == ["settle", "launch"]


def test_the_keys_are_worked_out_once_a_process():
    """A launch of every layer's eager decode calls ``settle``: after the first, it does nothing."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    probe = ("import importlib\n"
             "from k3_amd_overlay.kernels import cache_keys\n"
             "cache_keys.settle()\n"
             "calls = []\n"
             "importlib.import_module = lambda name: calls.append(name)\n"
             "cache_keys.settle()\n"
             "print(len(calls))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "0", proc.stderr[-2000:]

