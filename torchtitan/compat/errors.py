"""The error every compat function raises where an internal of torch or torchft is not where it was."""

from __future__ import annotations

import importlib.metadata


class CompatError(RuntimeError):
    """An internal of torch or torchft that the project relies on is not where it was."""


def missing(internal: str, package: str = "torch") -> CompatError:
    """The error naming ``internal`` and the installed version of ``package``."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "not installed"
    return CompatError(
        f"{package} {version} has no {internal}, which torchtitan relies on; torchtitan/compat/ needs a branch "
        f"for this version (tested versions: docs/versions.md)")
