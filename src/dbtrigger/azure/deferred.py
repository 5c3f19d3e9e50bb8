"""A trigger that app settings configure: built at decoration, or at its first invocation.

A Function App builds its triggers when the host imports ``function_app.py``
to index the functions. A numeric option may be a ``%SETTING%`` reference
(``batch_size="%QUEUE_BATCH%"``, as the Azure SQL trigger reads
``Sql_Trigger_MaxBatchSize``); if that setting is missing, raising at import
would make *every* function of the app disappear. So a decorator keeps its
trigger :class:`Lazy`: a number written in the code is checked at once (a
mistake in code fails the import, where it is seen), a setting is read when
the trigger is first needed, and until the build succeeds each invocation of
that one function fails with a :class:`~dbtrigger.settings.DeferredSettingError`
naming the option and the setting.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

from dbtrigger.errors import ConfigurationError
from dbtrigger.settings import DeferredSettingError, setting_number

T = TypeVar("T")

#: An option's value (a number or a ``%SETTING%``), its type, and its least value (or None).
NumberSpec = tuple[object, type[int] | type[float], int | None]


class Lazy(Generic[T]):
    """``build(numbers)`` once its numeric options can be read (see the module docstring).

    ``numbers`` maps each option to :data:`NumberSpec`; ``build`` receives them
    read (an ``int`` or a ``float`` each).
    """

    def __init__(
        self, build: Callable[[dict[str, int | float]], T], numbers: Mapping[str, NumberSpec]
    ) -> None:
        self._build = build
        self._numbers = dict(numbers)
        self._lock = threading.Lock()
        self.built: T | None = None
        check_written(self._numbers)

    def get(self) -> T:
        """The trigger, built now if it was not yet (raises what building raises)."""
        if self.built is None:
            with self._lock:
                if self.built is None:
                    self.built = self._build(_read_all(self._numbers))
        return self.built

    def prepared(self) -> T | None:
        """The trigger if it can be built now; None while an app setting is missing."""
        try:
            return self.get()
        except DeferredSettingError:
            return None


def check_written(numbers: Mapping[str, NumberSpec]) -> None:
    """Check the numbers written in the code now (a ConfigurationError names the
    option); ``%SETTING%`` references are read later, by :meth:`Lazy.get`."""
    for option, spec in numbers.items():
        with contextlib.suppress(DeferredSettingError):
            _read(option, spec)


def _read_all(numbers: Mapping[str, NumberSpec]) -> dict[str, int | float]:
    """Every option read; every setting missing or malformed named in one error.

    In Azure each change to the app settings restarts the app: naming only the
    first would cost a person a restart and a timer firing per setting.
    """
    read: dict[str, int | float] = {}
    problems: list[str] = []
    for option, spec in numbers.items():
        try:
            read[option] = _read(option, spec)
        except DeferredSettingError as exc:
            problems.append(str(exc))
    if len(problems) == 1:
        raise DeferredSettingError(problems[0])
    if problems:
        raise DeferredSettingError(
            f"{len(problems)} app settings need fixing: " + "; ".join(problems)
        )
    return read


def _read(option: str, spec: NumberSpec) -> int | float:
    value, kind, minimum = spec
    number = setting_number(value, option, kind)
    if minimum is not None and number < minimum:
        raise ConfigurationError(f"{option} must be >= {minimum}, got {number}")
    return number


__all__ = ["Lazy", "NumberSpec", "check_written"]
