"""Deprecated attribute spellings: an old name that warns and reads the new one.

``worker_id = DeprecatedAlias[str]("owner_id", "X.worker_id is deprecated: ...")``
in a class body behaves like a read-only property returning ``self.owner_id``
that first issues a :class:`DeprecationWarning` pointing at the caller's line.
"""

from __future__ import annotations

import warnings
from typing import Any, Generic, TypeVar, cast, overload

T = TypeVar("T")


class DeprecatedAlias(Generic[T]):
    """A read-only attribute: warns ``message``, then returns the attribute ``new``."""

    def __init__(self, new: str, message: str) -> None:
        self.new = new
        self.message = message
        self.name = new
        self.__doc__ = f"Deprecated spelling of :attr:`{new}`."

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> DeprecatedAlias[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object | None, owner: type | None = None) -> Any:
        if obj is None:
            return self
        warnings.warn(self.message, DeprecationWarning, stacklevel=2)
        return cast("T", getattr(obj, self.new))

    def __set__(self, obj: object, value: object) -> None:
        raise AttributeError(f"{self.name} is read-only (a deprecated spelling of {self.new})")


__all__ = ["DeprecatedAlias"]
