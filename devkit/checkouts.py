"""Where the trainer tests find the trainers: a source checkout an environment variable names, or
the release installed."""

from __future__ import annotations

import importlib.metadata
import os
from typing import Optional


def named_checkout(variable: str, marker: str) -> Optional[str]:
    """The directory the environment variable ``variable`` names, or ``None`` when it is unset or
    empty; ``ValueError`` if the directory holds no ``marker`` (a file path relative to it), so that
    a wrong path fails the tests instead of skipping them."""
    source = os.environ.get(variable, "").strip()
    if not source:
        return None
    if not os.path.isfile(os.path.join(source, marker)):
        raise ValueError(f"{variable}={source} holds no {marker}")
    return source


def installed_version(distribution: str) -> str:
    """The installed release of ``distribution``, or ``"none"``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"
