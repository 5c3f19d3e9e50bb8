"""Validation of names that end up in SQL, storage paths or blob names.

Configuration is trusted to be *meant*, not to be *safe*: a poller name becomes
a file name and a blob path, a table name becomes SQL. Anything outside a
conservative alphabet is refused up front with an error naming the value.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from collections.abc import Callable

from dbtrigger.errors import DbTriggerError, UnsafeIdentifierError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_SQL_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_$]{0,127}$")


def validate_name(value: str, what: str) -> str:
    """A poller/app/container-path segment: letters, digits, ``_ . -``; no ``..``."""
    if not isinstance(value, str) or not _NAME.match(value) or ".." in value:
        raise UnsafeIdentifierError(
            f"{what} {value!r} is not a safe name: use 1-128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit",
            name=what,
        )
    return value


def validate_sql_identifier(value: str, what: str) -> str:
    """A table/column/schema name: a plain SQL identifier, quoted by SQLAlchemy later."""
    if not isinstance(value, str) or not _SQL_IDENTIFIER.match(value):
        raise UnsafeIdentifierError(
            f"{what} {value!r} is not a safe SQL identifier: use letters, digits, '_' or '$', "
            f"starting with a letter or '_'{_identifier_hint(value)}",
            name=what,
        )
    return value


def _identifier_hint(value: object) -> str:
    """What the person probably meant, for the names people write most often."""
    if not isinstance(value, str):
        return ""
    bare = value.strip('"`[]')
    if bare != value and _SQL_IDENTIFIER.match(bare):
        return f" (give it without quotes, {bare!r}: names are quoted for you, capitals kept)"
    parts = value.split(".")
    if len(parts) == 2 and all(_SQL_IDENTIFIER.match(p.strip('"`')) for p in parts):
        schema, name = (p.strip('"`') for p in parts)
        return f" (a name in a schema is given in two parts: schema={schema!r} and {name!r})"
    return (
        "; a name that needs other characters (spaces, quotes, '-') cannot be used as it "
        "is: give the table a view with a plain name, or its column an alias (AS) in query="
    )


def shortened(name: str, limit: int = 63) -> str:
    """``name`` if it fits ``limit`` characters, else its start and a short hash of it all.

    Generated identifiers (log tables, triggers, channels, reader names) must
    fit the database's limit (PostgreSQL 63 bytes, MariaDB/MySQL 64 characters)
    and two long names with a common start must not end up equal: the result is
    stable for a name, exactly ``limit`` long when shortened.
    """
    if len(name) <= limit:
        return name
    return name[: limit - 9] + "_" + hashlib.sha256(name.encode()).hexdigest()[:8]


def quoted_name(quote: Callable[[str], str], name: str, schema: str | None) -> str:
    """``name`` in ``schema`` (the connection's default schema without one), each part
    quoted with ``quote`` (a dialect's ``identifier_preparer.quote``), for DDL and
    catalogue queries that SQLAlchemy constructs cannot spell."""
    return f"{quote(schema)}.{quote(name)}" if schema else quote(name)


def import_path_of(obj: object) -> str | None:
    """``module:attribute`` under which ``obj`` can be imported again, or None.

    What an operator pastes into a ``dbtrigger`` command to name a poller the
    program built itself (``trigger.tick()`` from a script or a service). Only
    a module-level global of an importable module counts: ``__main__`` (a
    script run as ``python app.py``) is not importable under that name, so it
    gives None and the caller prints a fill-in instead of a command that fails.
    """
    import sys  # noqa: PLC0415 - only needed here

    for module_name, module in list(sys.modules.items()):
        if module is None or module_name == "__main__" or module_name.startswith("dbtrigger"):
            continue
        try:
            names = vars(module)
        except Exception:  # noqa: BLE001, S112 - lazy proxies in sys.modules may raise anything
            continue
        for attr, value in list(names.items()):
            if value is obj and not attr.startswith("_"):
                return f"{module_name}:{attr}"
    return None


#: What a source's error names its trigger by in a command (``dbtrigger cdc snapshot
#: MODULE:TRIGGER ...``): a source does not know where its trigger is defined.
TRIGGER_PLACEHOLDER = "MODULE:TRIGGER"


def trigger_named(text: str, spec: str | None) -> str:
    """``text`` with its commands naming the trigger by ``spec`` (its ``module:attribute``,
    when known) instead of :data:`TRIGGER_PLACEHOLDER`, so that they can be pasted."""
    return text.replace(TRIGGER_PLACEHOLDER, shlex.quote(spec)) if spec else text


def name_trigger(exc: DbTriggerError, spec: str | None) -> DbTriggerError:
    """``exc`` with its message's commands naming the trigger (:func:`trigger_named`)."""
    if spec and TRIGGER_PLACEHOLDER in exc.message:
        exc.message = trigger_named(exc.message, spec)
        exc.args = (exc.message, *exc.args[1:])
    return exc


def command_target(name: str, spec: str | None, store: str) -> str:
    """``NAME --source MODULE:ATTR`` for a pasteable command, or ``NAME --store
    STORE`` when the trigger cannot be named by an import path."""
    where = f"--source {shlex.quote(spec)}" if spec else f"--store {shlex.quote(store)}"
    return f"{name} {where}"
