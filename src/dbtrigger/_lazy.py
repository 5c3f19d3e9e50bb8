"""Names a package hands on, imported the first time one is used.

``import dbtrigger`` must stay cheap (a Functions worker's cold start, tools
that only want the error classes): everything that pulls in SQLAlchemy, a
driver or an Azure SDK is imported when one of its names is first looked up.
A package writes down which of its names come from which module, and gets its
module ``__getattr__`` and ``__dir__`` from :func:`exports`. ``moved`` names
are still found at an older address, with a :class:`DeprecationWarning` naming
the new one.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

#: The extra (pyproject.toml) that installs each optional top-level module.
EXTRAS = {
    "azure": "azure",
    "psycopg": "postgres",
    "pymysql": "mysql",
    "opentelemetry": "otel",
    "prometheus_client": "prometheus",
    "rich": "progress",
    "cloudevents": "cloudevents",
}


def _without_extra(
    name: str, exc: ModuleNotFoundError, extras: Mapping[str, str] = EXTRAS
) -> ModuleNotFoundError:
    """``from dbtrigger import BlobCheckpointStore`` on a core install said only
    "No module named 'azure'": the error names the extra that brings it.
    ``extras`` maps a missing top-level module to that extra (a package whose
    names need an extra of their own, as log capture does, passes its own)."""
    missing = exc.name or ""
    extra = extras.get(missing.partition(".")[0])
    if extra is None:
        return exc
    return ModuleNotFoundError(
        f'{name} needs {missing}, which is not installed: pip install "dbtrigger[{extra}]"',
        name=missing,
    )


def import_name(name: str, home: str, extras: Mapping[str, str] = EXTRAS) -> Any:
    """``name`` from module ``home``; a missing optional module is said as the
    extra to install (see :func:`_without_extra`)."""
    try:
        module = importlib.import_module(home)
    except ModuleNotFoundError as exc:
        raise _without_extra(name, exc, extras) from exc
    return getattr(module, name)


def exports(
    package: str,
    names: Mapping[str, str],
    *,
    moved: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``.

    ``names`` maps each name to the module that defines it; ``moved`` maps a
    name no longer offered here to the public module it is now imported from.
    A name found in ``names`` is cached in the package's namespace, so later
    lookups are plain attribute reads.
    """
    moved = dict(moved or {})

    def __getattr__(name: str) -> Any:
        home = names.get(name)
        if home is not None:
            value = import_name(name, home)
            vars(importlib.import_module(package))[name] = value
            return value
        new = moved.get(name)
        if new is not None:
            warnings.warn(
                f"'from {package} import {name}' is deprecated: import it from {new}",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(importlib.import_module(new), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(vars(importlib.import_module(package))) | set(names))

    return __getattr__, __dir__


def installed_version(distribution: str) -> str:
    """The installed version of ``distribution`` (``0+unknown`` for a tree never installed)."""
    from importlib import metadata  # noqa: PLC0415 - a tenth of the package's import time

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "0+unknown"


__all__ = ["EXTRAS", "exports", "import_name", "installed_version"]
