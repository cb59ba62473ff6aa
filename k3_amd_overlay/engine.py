"""Patch records on wrapt: verify a target, apply, revert. Idempotent (a target patched already
is never wrapped twice), atomic (a failure part-way reverts what this call applied) and
revertible (revert puts back the identical original objects, except under a wrapper someone else
put on top since, which keeps the overlay's: the caller makes it inert)."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import wrapt

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


class AnchorError(RuntimeError):
    """A patch target is missing or has changed shape in this vLLM."""


@dataclass(frozen=True)
class PatchSpec:
    """One patch: ``module:attribute`` and either a wrapt wrapper or a replacement factory.

    ``key`` names its entry in docs/patches.md; ``params`` are the parameter names (after self)
    the target must start with, checked before anything is applied."""

    key: str
    module: str
    attribute: str
    fusions: tuple[str, ...]
    wrapper: Wrapper | None = None
    replace: Callable[[Any], Any] | None = None
    params: tuple[str, ...] | None = None
    guard: Callable[[Any], str | None] | None = None  # a live condition: an error message, or None
    # The instance attribute holding the per-layer site this wrapper routes by: once the patch is
    # reverted, a layer that holds one keeps the route (the wrapper bound on the instance).
    kept_by: str | None = None
    # For the log only: where its target fails the check, it is left out (PatchEngine.left_out) and
    # the module's other patches apply; no fusion waits on it.
    optional: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}:{self.attribute}"


@dataclass
class Applied:
    """One patch in place: its spec, where it went, and what it replaced."""

    spec: PatchSpec
    parent: Any
    name: str
    original: Any
    had_own: bool  # the attribute lived in parent's own __dict__ (else inherited or a module global)
    installed: Any


def _resolve(module: Any, attribute: str) -> tuple[Any, str, Any]:
    parent = module
    *path, name = attribute.split(".")
    for part in path:
        parent = getattr(parent, part)
    if inspect.isclass(parent):
        for klass in inspect.getmro(parent):
            if name in vars(klass):
                return parent, name, vars(klass)[name]
        raise AttributeError(name)
    return parent, name, getattr(parent, name)


def verify(spec: PatchSpec, module: Any) -> None:
    """Raise AnchorError unless the target exists and takes the parameters the patch expects."""
    try:
        _, _, original = _resolve(module, spec.attribute)
    except AttributeError:
        raise AnchorError(f"{spec.target} does not exist") from None
    if spec.guard is not None:
        try:
            problem = spec.guard(module)
        except Exception as exc:  # a check that cannot tell: the target is not what the patch knows
            raise AnchorError(f"{spec.target}: its check raised {type(exc).__name__}: {exc}") from exc
        if problem:
            raise AnchorError(f"{spec.target}: {problem}")
    if spec.params is None:
        return
    if isinstance(original, (classmethod, staticmethod)):  # as stored in the class: inspect its function
        original = original.__func__
    try:
        names = [p for p in inspect.signature(original).parameters if p not in ("self", "cls")]
    except (TypeError, ValueError):
        raise AnchorError(f"{spec.target} has no inspectable signature") from None
    if tuple(names[: len(spec.params)]) != spec.params:
        raise AnchorError(f"{spec.target} takes {tuple(names)}, the overlay expects {spec.params}")


@dataclass
class PatchEngine:
    """The patches this process has in place, in the order applied."""

    applied: list[Applied] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)  # optional patches whose target failed: key -> why

    def is_applied(self, spec: PatchSpec) -> bool:
        return any(a.spec.key == spec.key for a in self.applied)

    def apply(self, specs: Sequence[PatchSpec], module: Any) -> list[str]:
        """Verify every spec, then apply those not applied yet; all or nothing, but for an optional
        spec whose target fails the check, left out (``left_out``). Returns keys applied."""
        pending = [s for s in specs if not self.is_applied(s) and s.key not in self.left_out]
        for spec in pending:
            try:
                verify(spec, module)
            except AnchorError as exc:
                if not spec.optional:
                    raise
                self.left_out[spec.key] = str(exc)
        pending = [s for s in pending if s.key not in self.left_out]
        done: list[Applied] = []
        try:
            for spec in pending:
                done.append(self._apply_one(spec, module))
        except BaseException:
            for record in reversed(done):
                self._revert_one(record)
            raise
        self.applied.extend(done)
        return [r.spec.key for r in done]

    def _apply_one(self, spec: PatchSpec, module: Any) -> Applied:
        parent, name, original = _resolve(module, spec.attribute)
        had_own = name in vars(parent) if inspect.isclass(parent) else True
        if spec.wrapper is not None:
            wrapt.wrap_function_wrapper(parent, name, spec.wrapper)
        else:
            assert spec.replace is not None
            setattr(parent, name, spec.replace(original))
        return Applied(spec, parent, name, original, had_own, vars(parent)[name])

    @staticmethod
    def _revert_one(record: Applied) -> None:
        if vars(record.parent).get(record.name) is not record.installed:
            raise AnchorError(
                f"{record.spec.target} was changed by someone else after the overlay patched it; "
                "not reverting over it"
            )
        if record.had_own:
            setattr(record.parent, record.name, record.original)
        else:
            delattr(record.parent, record.name)

    def revert_all(self) -> list[str]:
        """Every patch off its target, newest first, each tried: one that something else has wrapped
        since (reverting it would drop that wrapper too) stays in ``applied``. The keys reverted."""
        keys, kept = [], []
        for record in reversed(self.applied):
            try:
                self._revert_one(record)
            except AnchorError:
                kept.append(record)
                continue
            keys.append(record.spec.key)
        self.applied = kept[::-1]
        return keys
