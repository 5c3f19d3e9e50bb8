"""Resolution of ``%APP_SETTING%`` references, the Azure Functions convention.

This module and the CLI are the only places dbtrigger reads the environment:
library objects take plain values in their constructors, and a value written as
``%NAME%`` is looked up here so configuration can be shared with
``local.settings.json`` and App Settings without code changes.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from dbtrigger.errors import ConfigurationError, MissingSettingError

_REFERENCE = re.compile(r"%([A-Za-z_][A-Za-z0-9_:.-]*)%")


def resolve_setting(value: str, environ: Mapping[str, str] | None = None) -> str:
    """Replace each ``%NAME%`` in ``value`` with that environment variable.

    Raises:
        MissingSettingError: naming the missing setting (never its value).
    """
    env = os.environ if environ is None else environ

    def lookup(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise MissingSettingError(f"app setting {name!r} is referenced but not set")
        return env[name]

    return _REFERENCE.sub(lookup, value)


#: The settings file of an Azure Functions project (``func start`` reads it).
LOCAL_SETTINGS = "local.settings.json"


def load_local_settings(
    path: str | os.PathLike[str], environ: MutableMapping[str, str] | None = None
) -> list[str]:
    """Put the ``Values`` of a ``local.settings.json`` into the environment.

    This is what the Functions host does when it starts locally, so a
    ``%SETTING%`` reference resolves the same way under the CLI. Variables
    already set win (as real App Settings would), so an operator can override
    one value for a single command. Returns the names that were set.

    Raises:
        ConfigurationError: the file is unreadable, not JSON, or its
            ``Values`` is not an object of strings.
    """
    env = os.environ if environ is None else environ
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8-sig"))
    except OSError as exc:
        raise ConfigurationError(f"cannot read {file}: {exc.strerror}") from None
    except ValueError as exc:
        raise ConfigurationError(f"{file} is not valid JSON: {exc}") from None
    values = data.get("Values") if isinstance(data, dict) else None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ConfigurationError(f"{file}: 'Values' must be an object of app settings")
    loaded: list[str] = []
    for name, value in values.items():
        if name in env:
            continue
        if not isinstance(value, (str, int, float, bool)):
            raise ConfigurationError(f"{file}: app setting {name!r} must be a string")
        env[name] = str(value).lower() if isinstance(value, bool) else str(value)
        loaded.append(name)
    return loaded


def find_local_settings(start: str | os.PathLike[str] = ".") -> Path | None:
    """``local.settings.json`` of the Functions project in ``start``, if it is one.

    A directory is a Functions project when it holds ``host.json``; the
    settings file next to it is then what ``func start`` would read.
    """
    here = Path(start)
    candidate = here / LOCAL_SETTINGS
    if (here / "host.json").is_file() and candidate.is_file():
        return candidate
    return None
