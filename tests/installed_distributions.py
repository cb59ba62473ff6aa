"""``importlib.metadata`` as a machine with only some distributions installed sees it: tests put it
in place of a module's ``metadata`` to say which versions are installed."""

from __future__ import annotations

from importlib import metadata


class InstalledOnly:
    """``importlib.metadata`` with only the distributions in ``installed`` (name: version)."""

    PackageNotFoundError = metadata.PackageNotFoundError

    def __init__(self, installed: dict[str, str]) -> None:
        self.installed = installed

    def version(self, dist: str) -> str:
        if dist not in self.installed:
            raise self.PackageNotFoundError(dist)
        return self.installed[dist]
