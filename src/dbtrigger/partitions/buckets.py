"""A fixed space of virtual buckets, and the same bucket computed in Python and in SQL.

Every row belongs to one of :data:`BUCKETS` buckets by a hash of its primary
key; a partition is a contiguous range of buckets. The space never changes, so
changing the number of partitions splits or merges ranges and never moves a
row from one bucket to another (``hash % N`` with a changing N would move
almost every key, and a row could be skipped by the partition it left and not
yet reached by the one it joined).

The hash is the first byte of the MD5 of the key's text: the key columns'
values as text joined with ``|`` (an integer as its decimal digits, a UUID in
its canonical lower-case form, a string as itself, UTF-8). Every database here
computes that in SQL, so a partition's fetch filters by bucket on the server;
the poller recomputes it in Python for each fetched row and refuses to go on if
the two ever disagree (see :func:`check_rows`).

A PostgreSQL ``char(n)`` value reaches Python padded with spaces to n, while
its text in SQL drops them (padding is not part of a ``char(n)`` value there):
for those columns the check hashes the value without its trailing spaces.

Key types: integers, decimals (in plain digits), strings and UUIDs. Other
types (timestamps, floats, binary) render as text differently per database,
driver and session, so a fetched row with such a key is refused.
"""

from __future__ import annotations

import decimal
import hashlib
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import sqlalchemy as sa

from dbtrigger.errors import ConfigurationError
from dbtrigger.names import quoted_name, validate_sql_identifier

#: The number of virtual buckets. Fixed forever: changing it rehashes every key.
BUCKETS = 256

#: Name of the optional stored bucket column (``partition_ddl``).
BUCKET_COLUMN = "dbt_bucket"

#: SQLite has no MD5: the poller registers this function on its connections.
SQLITE_FUNCTION = "dbt_bucket"


def key_text(values: Sequence[Any]) -> str:
    """The text the bucket hash is taken of.

    A decimal is written in plain digits (``0.0000001``, as PostgreSQL and
    MariaDB write a ``NUMERIC``/``DECIMAL``; ``str()`` would say ``1E-7``).

    Raises:
        ConfigurationError: a key value of a type that is not an integer,
            decimal, string or UUID.
    """
    parts = []
    for value in values:
        if isinstance(value, decimal.Decimal) and value.is_finite():
            parts.append(format(value, "f"))
            continue
        if isinstance(value, bool) or not isinstance(value, (int, str, uuid.UUID)):
            raise ConfigurationError(
                f"partitioning needs integer, decimal, text or UUID key columns; got a "
                f"{type(value).__name__} key value {value!r}, whose text differs between "
                "databases, drivers and session settings (a bucket computed in SQL and in "
                "Python could disagree, and a row be delivered by no partition). Poll this "
                "table with one PollTrigger (max_concurrency= handles keys side by side), "
                "or partition by an integer, text or UUID key"
            )
        parts.append(str(value))
    return "|".join(parts)


def bucket_of_text(text: str) -> int:
    return hashlib.md5(text.encode("utf-8"), usedforsecurity=False).digest()[0]


def bucket_of(values: Sequence[Any]) -> int:
    """The bucket of a key given as its column values in ``pk_columns`` order."""
    return bucket_of_text(key_text(values))


def sql_bucket(
    dialect: str,
    pk_columns: Sequence[str],
    quote: Callable[[str], str],
    *,
    encoding: str | None = None,
    zerofill: Collection[str] = (),
) -> str:
    """A SQL expression for the bucket of each row (an integer 0..255).

    ``encoding`` is a PostgreSQL database's ``server_encoding``: ``md5(text)``
    hashes the text's bytes in it, so a database that is not UTF8 hashes the
    key's UTF-8 form instead (``convert_to``, which is not immutable: the stored
    ``dbt_bucket`` column cannot use it, see :func:`partition_ddl`).
    ``zerofill`` names MariaDB/MySQL ``ZEROFILL`` integer columns, whose text is
    padded with zeros (42 as '000042') while the driver returns the number: their
    bucket is taken of ``c + 0``, the number's own digits.
    Identifiers are validated and quoted; the expression contains no values.
    """
    for name in pk_columns:
        validate_sql_identifier(name, "pk column")
    cols = [quote(c) for c in pk_columns]
    if dialect == "postgresql":
        text = " || '|' || ".join(f"{c}::text" for c in cols)
        if not is_utf8(encoding):
            text = f"convert_to({text}, 'UTF8')"
        return f"get_byte(decode(md5({text}), 'hex'), 0)"
    if dialect in ("mysql", "mariadb"):
        padded = {quote(c) for c in zerofill}
        text = (
            "CONCAT_WS('|', "
            + ", ".join(f"CAST({c}{' + 0' if c in padded else ''} AS CHAR)" for c in cols)
            + ")"
        )
        return f"CAST(CONV(LEFT(MD5(CONVERT({text} USING utf8mb4)), 2), 16, 10) AS UNSIGNED)"
    if dialect == "sqlite":
        text = " || '|' || ".join(f"CAST({c} AS TEXT)" for c in cols)
        return f"{SQLITE_FUNCTION}({text})"
    raise ConfigurationError(
        f"partitioning supports PostgreSQL, MariaDB/MySQL and SQLite, not {dialect!r}"
    )


def is_utf8(encoding: str | None) -> bool:
    """A PostgreSQL ``server_encoding`` whose text bytes are UTF-8 (None: not known)."""
    return encoding is None or encoding.upper().replace("-", "") in ("UTF8", "UNICODE")


def server_encoding(engine: sa.Engine) -> str | None:
    """A PostgreSQL database's ``server_encoding``, read once per engine (None elsewhere)."""
    if engine.dialect.name != "postgresql":
        return None
    if "_dbt_server_encoding" not in engine.__dict__:
        with engine.connect() as conn:
            value = conn.exec_driver_sql("SHOW server_encoding").scalar()
        engine.__dict__["_dbt_server_encoding"] = str(value) if value is not None else None
    encoding: str | None = engine.__dict__["_dbt_server_encoding"]
    return encoding


def zerofill_columns(
    dialect: str, columns: Mapping[str, Any], pk_columns: Sequence[str]
) -> frozenset[str]:
    """The MariaDB/MySQL key columns declared ``ZEROFILL`` (``columns``: name ->
    a column or reflected column dict with its SQLAlchemy type)."""
    if dialect not in ("mysql", "mariadb"):
        return frozenset()

    def type_of(column: Any) -> Any:
        return column.get("type") if isinstance(column, Mapping) else getattr(column, "type", None)

    return frozenset(
        name
        for name in pk_columns
        if name in columns and getattr(type_of(columns[name]), "zerofill", False)
    )


def sqlite_bucket(text: str | None) -> int | None:
    """The SQLite function behind :func:`sql_bucket` (registered per connection)."""
    return None if text is None else bucket_of_text(text)


def partition_ddl(
    dialect: str,
    table: str,
    pk_columns: Sequence[str],
    cursor_column: str,
    quote: Callable[[str], str],
    *,
    schema: str | None = None,
    zerofill: Collection[str] = (),
) -> list[str]:
    """DDL for a stored, indexed bucket column, so a partition's fetch stays O(batch).

    Without it each partition's fetch still reads only its own rows, but the
    database evaluates the hash for the rows it passes on the ``(cursor, pk)``
    index; with it the index ``(dbt_bucket, cursor, pk)`` goes straight to the
    partition's range. The poller uses the column when it exists.
    """
    validate_sql_identifier(table, "table")
    validate_sql_identifier(cursor_column, "cursor_column")
    if schema:
        validate_sql_identifier(schema, "schema")
    target = quoted_name(quote, table, schema)
    expr = sql_bucket(dialect, pk_columns, quote, zerofill=zerofill)
    index = quote(f"ix_{table}_{BUCKET_COLUMN}"[:63])
    # A key that is its own cursor (an AUTO_INCREMENT id) is listed once: MariaDB
    # refuses a column named twice in an index.
    ordered = dict.fromkeys([cursor_column, *pk_columns])
    columns = ", ".join([BUCKET_COLUMN, *(quote(c) for c in ordered)])
    if dialect == "postgresql":
        # Always md5 of the text in the database's encoding (immutable, as a generated
        # column needs): on a database that is not UTF8 the caller says so (cmd_ddl).
        expr = sql_bucket(dialect, pk_columns, quote, encoding="UTF8")
        return [
            f"ALTER TABLE {target} ADD COLUMN IF NOT EXISTS {BUCKET_COLUMN} smallint "
            f"GENERATED ALWAYS AS ({expr}) STORED",
            f"CREATE INDEX IF NOT EXISTS {index} ON {target} ({columns})",
        ]
    if dialect in ("mysql", "mariadb"):
        return [
            f"ALTER TABLE {target} ADD COLUMN {BUCKET_COLUMN} SMALLINT UNSIGNED AS ({expr}) STORED",
            f"CREATE INDEX {index} ON {target} ({columns})",
        ]
    raise ConfigurationError(
        "a stored bucket column needs PostgreSQL or MariaDB/MySQL (SQLite computes the bucket "
        "with a function registered on the poller's connections and cannot store it portably)"
    )


def padded_columns(
    dialect: str, columns: Mapping[str, Any], pk_columns: Sequence[str]
) -> frozenset[str]:
    """The key columns whose values Python gets padded but SQL hashes unpadded.

    PostgreSQL's ``char(n)``: ``c::text`` (the bucket's input, also in the stored
    ``dbt_bucket``) drops the trailing spaces the driver returns. MariaDB/MySQL
    return ``CHAR`` values unpadded already, and SQLite does not pad at all.
    """
    if dialect != "postgresql":
        return frozenset()
    return frozenset(
        name
        for name in pk_columns
        if name in columns and isinstance(getattr(columns[name], "type", None), sa.CHAR)
    )


def check_rows(
    rows: Sequence[Mapping[str, Any]],
    pk_columns: Sequence[str],
    lo: int,
    hi: int,
    where: str,
    *,
    padded: Collection[str] = (),
) -> None:
    """Refuse rows whose bucket, recomputed here, is outside ``[lo, hi)``.

    The database and Python disagreeing on a bucket would mean a row belongs
    to no partition (never delivered) or to two; that is a configuration the
    poller must not run with. ``padded`` names the columns whose trailing
    spaces are not part of the value (:func:`padded_columns`).
    """
    for row in rows:
        values = [row[c] for c in pk_columns]
        if any(v is None for v in values):
            continue  # a NULL key: refused by to_events, as the plain poller refuses it
        if padded:
            values = [
                v.rstrip(" ") if c in padded and isinstance(v, str) else v
                for c, v in zip(pk_columns, values, strict=True)
            ]
        bucket = bucket_of(values)
        if not lo <= bucket < hi:
            raise ConfigurationError(
                f"{where}: the database put key {dict(zip(pk_columns, values, strict=True))!r} "
                f"in buckets [{lo}, {hi}) but its bucket is {bucket}: the key's text differs "
                "between the database and Python (collation or type); partitioning cannot be "
                "used with this key"
            )
