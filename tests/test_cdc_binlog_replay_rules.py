"""What an ``ALTER TABLE`` tells of the columns before (or after) it, from its text alone.

The rules :mod:`dbtrigger.cdc.binlog_replay` follows to name a table map written
before a statement by the catalog read after it, and the statements whose effect
is not known for certain (which stop a reader instead). The reader on a server:
tests/test_cdc_binlog_replay.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dbtrigger.cdc import binlog_replay as replay
from dbtrigger.cdc.binlog_alter import column_ops


def cols(*names: str, keys: tuple[str, ...] = ("id",)) -> replay.Columns:
    return replay.Columns(names, dict.fromkeys(names, "int"), keys)


@pytest.mark.parametrize(
    ("texts", "now", "before"),
    [
        (["ALTER TABLE t ADD c INT"], ("id", "a", "c"), ("id", "a")),
        (["ALTER TABLE t ADD COLUMN `c` INT FIRST"], ("c", "id", "a"), ("id", "a")),
        (["ALTER TABLE t ADD c INT DEFAULT 'after a' AFTER id"], ("id", "c", "a"), ("id", "a")),
        (["ALTER TABLE t ADD (c INT, d INT)"], ("id", "a", "c", "d"), ("id", "a")),
        (["ALTER TABLE t RENAME COLUMN a TO B"], ("id", "B"), ("id", "a")),
        (["ALTER TABLE t ADD c INT", "ALTER TABLE t RENAME COLUMN c TO d"], ("id", "d"), ("id",)),
        (["ALTER TABLE t ADD INDEX (a), COMMENT 'x, DROP a'"], ("id", "a"), ("id", "a")),
        (["ALTER TABLE t DROP COLUMN a"], ("id",), None),
        (["ALTER TABLE t CHANGE a b INT AFTER id"], ("id", "b"), None),
        (["ALTER TABLE t ADD c INT AFTER a, ADD d INT AFTER c"], ("id", "a", "c", "d"), None),
        (["ALTER TABLE t ADD c INT, RENAME TO u"], ("id", "a", "c"), None),
        (["ALTER TABLE t ADD c INT PRIMARY KEY"], ("id", "a", "c"), None),
        (["ALTER TABLE t ADD c INT"], ("id", "a"), None),  # c is not there: not this table
        (["ALTER TABLE t CONVERT TO CHARACTER SET utf8mb4"], ("id", "a"), None),
    ],
)
def test_columns_before_statements_follow_from_their_text_or_are_not_known(
    texts: list[str], now: tuple[str, ...], before: tuple[str, ...] | None
) -> None:
    found = replay.across(texts, cols(*now), backward=True)
    assert (None if found is None else found.names) == before
    if found is not None and before is not None:  # and forward again, the same
        again = replay.across(
            texts, replay.Columns(found.names, found.types, found.keys), backward=False
        )
        assert again is not None
        assert [n.lower() for n in again.names] == [n.lower() for n in now]


def test_the_key_before_an_added_primary_key_is_none_and_before_a_dropped_one_not_known() -> None:
    added = replay.across(
        ["ALTER TABLE t ADD PRIMARY KEY (a, id)"], cols("id", "a", keys=("a", "id")), backward=True
    )
    assert added is not None
    assert added.keys == ()
    swapped = "ALTER TABLE t DROP PRIMARY KEY, ADD PRIMARY KEY (a, id)"
    assert replay.across([swapped], cols("id", "a", keys=("a", "id")), backward=True) is None
    forward = replay.across([swapped], cols("id", "a"), backward=False)
    assert forward is not None
    assert forward.keys == ("a", "id")


def column(code: int) -> SimpleNamespace:
    return SimpleNamespace(type=code)


def test_replayed_columns_must_fit_the_table_map() -> None:
    changed = replay.across(["ALTER TABLE t MODIFY a BIGINT"], cols("id", "a"), backward=True)
    assert changed is not None
    assert changed.types["a"] is None  # its type then is not in the statement
    assert replay.fitted(changed, [column(3), column(3)]) == {"id": "int", "a": ""}
    assert replay.fitted(changed, [column(3), column(15)]) is None  # a string: how it reads?
    assert replay.fitted(changed, [column(3)]) is None  # another count
    assert replay.fitted(cols("id", "a"), [column(3), column(12)]) is None  # a DATETIME, not INT


def test_clauses_read() -> None:
    assert column_ops("ALTER TABLE t ADD COLUMN IF NOT EXISTS c INT") is None
    assert column_ops("ALTER TABLE t DROP COLUMN IF EXISTS c") is None
    assert column_ops("ALTER TABLE t SOMETHING NEW") is None
    assert column_ops("ALTER TABLE t ADD INDEX (a), ALGORITHM = INSTANT") == []
    [op] = column_ops("ALTER TABLE t ADD CONSTRAINT pk PRIMARY KEY (`a`(10) DESC, id)") or [None]
    assert op is not None
    assert op.keys == ("a", "id")
