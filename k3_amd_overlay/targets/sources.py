"""Static probes of the installed vLLM's source, read from disk without importing it: the
plugin decides which vLLM shape it faces (and fails loudly) before any model code is imported.
Probes parse the code (ast), so a comment or a docstring can never satisfy an anchor."""

from __future__ import annotations

import ast
import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

LINEAR = "models/kimi_k3/amd/linear.py"
K3_MLA = "models/kimi_k3/amd/mla.py"
K3_WRAPPER = "KimiK3MultiHeadLatentAttentionWrapper"  # the K3-only MLA wrapper class in K3_MLA (0.30+)
SHARED_MLA = "model_executor/layers/mla.py"
MLA_ATTENTION = "model_executor/layers/attention/mla_attention.py"
ATTENTION = "model_executor/layers/attention/attention.py"


def vllm_root() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@dataclass
class VllmSources:
    """Parsed vLLM files, by path relative to the vllm package; None for a file that is absent."""

    root: Path | None
    _trees: dict[str, ast.Module | None] = field(default_factory=dict)

    def text(self, rel: str) -> str | None:
        if self.root is None:
            return None
        path = self.root / rel
        return path.read_text() if path.is_file() else None

    def tree(self, rel: str) -> ast.Module | None:
        if rel not in self._trees:
            text = self.text(rel)
            self._trees[rel] = ast.parse(text) if text is not None else None
        return self._trees[rel]


def find_class(tree: ast.Module | None, name: str) -> ast.ClassDef | None:
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    return None


def find_function(tree: ast.Module | None, name: str) -> ast.FunctionDef | None:
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def find_method(cls: ast.ClassDef | None, name: str) -> ast.FunctionDef | None:
    if cls is None:
        return None
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    return None


def params(fn: ast.FunctionDef | None) -> tuple[str, ...]:
    if fn is None:
        return ()
    names = [a.arg for a in (*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs)]
    return tuple(n for n in names if n != "self")


def calls(node: ast.AST | None, dotted: str) -> bool:
    """Whether ``node`` contains a call of ``dotted`` (e.g. ``self._normalize_q_kv``)."""
    if node is None:
        return False
    return any(isinstance(n, ast.Call) and ast.unparse(n.func) == dotted for n in ast.walk(node))


def compares_equal(node: ast.AST | None, left: str, right: str) -> bool:
    """Whether ``node`` holds a comparison ``X.left == Y.right`` (attribute names, either way round)."""
    if node is None:
        return False
    return any(isinstance(n, ast.Compare) and len(n.ops) == 1 and isinstance(n.ops[0], ast.Eq)
               and {getattr(n.left, "attr", None), getattr(n.comparators[0], "attr", None)} == {left, right}
               for n in ast.walk(node))


def mentions(node: ast.AST | None, name: str) -> bool:
    """Whether any identifier or attribute in ``node`` is ``name`` (code only, not comments)."""
    if node is None:
        return False
    for n in ast.walk(node):
        if (isinstance(n, ast.Name) and n.id == name) or (isinstance(n, ast.Attribute) and n.attr == name):
            return True
        if isinstance(n, ast.alias) and name in (n.name.rsplit(".", 1)[-1], n.asname):
            return True
    return False


def imports_name(tree: ast.Module | None, module: str, name: str) -> bool:
    if tree is None:
        return False
    return any(
        isinstance(n, ast.ImportFrom) and n.module == module and any(a.name == name for a in n.names)
        for n in ast.walk(tree)
    )


def assigns_self_attr(fn: ast.FunctionDef | None, attr: str) -> bool:
    if fn is None:
        return False
    return any(
        isinstance(n, (ast.Assign, ast.AnnAssign))
        and any(ast.unparse(t) == f"self.{attr}" for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
        for n in ast.walk(fn)
    )
