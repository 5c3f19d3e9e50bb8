"""The configuration edge: ``%APP_SETTING%`` references and every read of the environment.

This module is the only place dbtrigger reads the process environment
(:func:`environment`, :func:`variable`; ``tests/test_settings_edge.py`` fails
on a read anywhere else): library objects take plain values in their
constructors, a value written as ``%NAME%`` is looked up here so configuration
can be shared with ``local.settings.json`` and App Settings without code
changes, and the CLI reads its ``DBTRIGGER_*`` variables through here.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Generic, TypeVar

from dbtrigger.errors import ConfigurationError, MissingSettingError

#: The one documented form: the whole value is ``%NAME%``. Only that is a
#: reference; a ``%`` anywhere else is the value's own (a percent-encoded
#: password ``p%C3%A4ss`` in a URL must not be read as the setting ``C3``).
_REFERENCE = re.compile(r"%([A-Za-z_][A-Za-z0-9_:.-]*)%")

T = TypeVar("T")


def environment(environ: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """The process environment, or ``environ`` when a caller (a test) passes its own."""
    return os.environ if environ is None else environ


def variable(name: str) -> str | None:
    """The environment variable ``name`` (the CLI's ``DBTRIGGER_STORE`` and the like), or None."""
    return os.environ.get(name)


def setting_name(value: str | None) -> str | None:
    """The app setting ``value`` refers to when it is a whole ``%NAME%``, else None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise ConfigurationError(
            f"expected text (a value or a %SETTING% reference), got {type(value).__name__}"
        )
    match = _REFERENCE.fullmatch(value)
    return match.group(1) if match else None


def references_setting(value: str | None) -> bool:
    """True when ``value`` is a ``%SETTING%`` reference (resolved from the environment)."""
    return setting_name(value) is not None


class Deferred(Generic[T]):
    """A value built from app settings at its first use, not when it is configured.

    A Function App builds its sources and stores when the host imports
    ``function_app.py`` to index the functions. If one missing app setting
    raised there, the import would fail and *every* function of the app would
    disappear. Objects that read app settings therefore hold a ``Deferred``:
    :meth:`get` builds the value on the first call that needs it; until the
    build succeeds, every call raises again (a
    :class:`~dbtrigger.errors.ConfigurationError` naming the setting), so only
    the functions that use it fail, each invocation, and they recover as soon
    as the setting exists. Nothing is cached until a build succeeds.

    ``what`` says in words where the value comes from (``app setting
    'AzureWebJobsStorage'``), for descriptions made before it is resolved;
    it must hold no secret.
    """

    def __init__(self, build: Callable[[], T], what: str) -> None:
        self._build = build
        self.what = what
        self._value: T | None = None
        self._built = False
        self._lock = threading.Lock()

    @property
    def ready(self) -> bool:
        """Whether the value has been built (describing it then needs no guess)."""
        return self._built

    def get(self) -> T:
        """The value, built now if it was not yet (raises what building raises)."""
        if self._built:
            return self._value  # type: ignore[return-value]  # set with _built
        with self._lock:
            if not self._built:
                self._value = self._build()
                self._built = True
            return self._value


def peek(value: T | Deferred[T]) -> T | None:
    """``value`` itself, or what a :class:`Deferred` holds once built (None before)."""
    if isinstance(value, Deferred):
        return value.get() if value.ready else None
    return value


def resolve(value: T | Deferred[T]) -> T:
    """``value`` itself, or a :class:`Deferred`'s value (built now if need be)."""
    return value.get() if isinstance(value, Deferred) else value


def resolve_setting(value: str, environ: Mapping[str, str] | None = None) -> str:
    """The app setting's value when ``value`` is a whole ``%NAME%``, else ``value``.

    Exactly one lookup: the setting's value is used as it is, even if it looks
    like a reference itself, and nothing inside a longer value is replaced
    (``postgresql://app:p%C3%A4ss@db/shop`` is a URL, not a use of ``C3``).
    Callers resolve a value once and pass the result on; resolving a result
    again finds nothing to replace unless it is itself a whole ``%NAME%``.

    Raises:
        MissingSettingError: naming the missing setting (never its value).
    """
    name = setting_name(value)
    if name is None:
        return value
    env = environment(environ)
    if name not in env:
        raise MissingSettingError(
            f"app setting {name!r} is referenced but not set: set the environment variable "
            f"{name} (in Azure, an application setting of the Function App; locally, in the "
            "Values of local.settings.json, which func start and the dbtrigger CLI read)"
        )
    return env[name]


class DeferredSettingError(ConfigurationError):
    """An option given as a ``%SETTING%`` is missing or not a number.

    Raised when the option is used, not when the function is decorated: the
    Function App still indexes, and only the function that needs the setting
    fails, each invocation, until the setting is right.
    """


def setting_number(value: object, option: str, kind: type[int] | type[float]) -> int | float:
    """A numeric decorator option: a number, or the number in the app setting a
    ``%SETTING%`` string references (``batch_size="%QUEUE_BATCH%"``, as the Azure
    SQL trigger reads ``Sql_Trigger_MaxBatchSize``).

    Raises:
        DeferredSettingError: the referenced setting is missing or not a number.
        ConfigurationError: ``value`` itself is not a number of ``kind`` (a bool,
            NaN, a fraction for a whole number, a string that is neither).
    """
    what = "a whole number" if kind is int else "a number"
    text: str | None = None
    if isinstance(value, str):
        if references_setting(value):
            try:
                text = resolve_setting(value).strip()
            except MissingSettingError as exc:
                raise DeferredSettingError(f"{option}: {exc}") from None
        number = _parse_number(text if text is not None else value.strip(), kind)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = value
    else:
        number = None
    if number is not None and kind is int and float(number).is_integer():
        return int(number)
    if number is not None and kind is float and math.isfinite(number):
        return float(number)
    if text is not None:
        raise DeferredSettingError(f"{option}={value!r} is {text!r}, not {what}")
    raise ConfigurationError(
        f"{option} must be {what} or a '%SETTING%' reference to one, got {value!r}"
    )


def _parse_number(text: str, kind: type[int] | type[float]) -> int | float | None:
    try:
        return int(text) if kind is int else float(text)
    except ValueError:
        return None


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
    env = os.environ if environ is None else environ  # written to: MutableMapping
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
