"""BinlogSource without column names in the log: which statements stop a reader, and which not.

A table map's values are named from ``information_schema`` (``binlog_row_metadata``
not FULL), read at some moment. The names are right when no statement changed the
table's column list between the table map's place in the log and that reading;
otherwise they are not knowable, and delivery stops before those changes
(:mod:`dbtrigger.cdc.binlog_lookahead`). The first look-ahead stopped at *any*
``ALTER TABLE`` of the table anywhere up to the log's end: an index added, a
comment, a table option, or a statement written after the names were read, each
stopped a healthy table's delivery (an outage) though nothing was misnamed. And a
reader that met a table's first map written after an ``ALTER`` that followed its
start named it by the catalog read at its start (``b``'s values as ``a``'s).
"""

from __future__ import annotations

import pytest

from dbtrigger import PollTrigger, RowChange
from dbtrigger.cdc import BinlogSource, binlog_ddl, binlog_setup
from dbtrigger.cdc import binlog_lookahead as lookahead
from tests import test_cdc_binlog_table_gone as gone
from tests.cdc_servers import BinlogDatabase

pytestmark = [pytest.mark.binlog, pytest.mark.timeout(120)]


@pytest.fixture
def catalog_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # The private server logs names (FULL); the source is made to read the catalog's.
    monkeypatch.setattr(binlog_setup.ServerFacts, "names_from_log", property(lambda _: False))


def behind(db: BinlogDatabase, *statements: str) -> tuple[list[RowChange], BinlogSource]:
    """A worker stopped before ``statements`` ran and started again after them; what it
    delivered in a bounded drain (it raises if delivery stops)."""
    db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b INT)")
    db.execute("CREATE TABLE t2 (id INT PRIMARY KEY, a INT, b INT)")
    db.execute("CREATE TABLE `t-x` (id INT PRIMARY KEY, a INT, b INT)")
    first, store, name, got = gone.watching(db, ["t"])
    first.source.close()
    db.execute("INSERT INTO t VALUES (1, 10, 20)")
    for statement in statements:
        db.execute(statement)
    db.execute("INSERT INTO t (id, a) VALUES (2, 11)")
    trigger = gone.poller(db, ["t"], store, name)
    trigger.drain(got.extend)
    assert isinstance(trigger.source, BinlogSource)
    return got, trigger.source


@pytest.mark.usefixtures("catalog_names")
@pytest.mark.parametrize(
    "statements",
    [
        ["ALTER TABLE t2 DROP COLUMN b, ADD COLUMN c INT"],  # another table
        ["ALTER TABLE `t-x` DROP COLUMN b, ADD COLUMN c INT"],  # one whose name starts as t's
        ["ALTER TABLE t ADD INDEX ia (a)"],
        ["ALTER TABLE t ADD INDEX ia (a)", "ALTER TABLE t ADD UNIQUE KEY ub (b), DROP INDEX ia"],
        ["ALTER TABLE t COMMENT = 'orders, per customer'"],
        ["ALTER TABLE t ENGINE = InnoDB, ALGORITHM = COPY"],
        ["ALTER TABLE t AUTO_INCREMENT = 100 ROW_FORMAT = DYNAMIC"],
        ["ALTER TABLE t ALTER COLUMN b SET DEFAULT 7"],
        ["ALTER TABLE t FORCE"],
    ],
)
def test_a_statement_that_leaves_the_column_list_as_it_was_does_not_stop(
    binlog_db: BinlogDatabase, statements: list[str]
) -> None:
    got, source = behind(binlog_db, *statements)
    after = [dict(e.after or {}) for e in got]
    assert after[0] == {"id": 1, "a": 10, "b": 20}
    assert (after[1]["id"], after[1]["a"]) == (2, 11)
    source.close()


@pytest.mark.usefixtures("catalog_names")
@pytest.mark.parametrize(
    ("statement", "shown"),
    [
        # (those whose names follow from the statement read on: test_cdc_binlog_replay.py)
        ("ALTER TABLE t DROP COLUMN b, ADD COLUMN c INT", "DROP COLUMN b"),
        ("ALTER TABLE t MODIFY b INT FIRST", "MODIFY b INT FIRST"),
        ("ALTER TABLE t ADD INDEX ib (b), MODIFY a INT AFTER b", "MODIFY a INT AFTER b"),
    ],
)
def test_a_statement_that_changes_the_column_list_stops_before_the_changes_it_would_misname(
    binlog_db: BinlogDatabase, statement: str, shown: str
) -> None:
    with pytest.raises(Exception, match="was changed by a statement") as stop:
        behind(binlog_db, statement)
    assert shown in str(stop.value)


@pytest.mark.usefixtures("catalog_names")
def test_a_statement_after_the_names_were_read_does_not_stop_the_changes_named_before_it(
    binlog_db: BinlogDatabase,
) -> None:
    # The worker read t's columns when it started; the two transactions of its backlog
    # have two table map ids (FLUSH TABLES), and it reads them in two reads. The ALTER
    # runs between the reads: both ids were written, and named, before it.
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b INT)")
    first, store, name, got = gone.watching(binlog_db, ["t"])
    first.source.close()
    binlog_db.execute("INSERT INTO t VALUES (1, 10, 20)")
    binlog_db.execute("FLUSH TABLES")
    binlog_db.execute("INSERT INTO t VALUES (2, 11, 21)")
    source = BinlogSource(binlog_db.url, ["t"], snapshot="never", read_ahead=1)
    trigger = PollTrigger(name=name, source=source, checkpoint_store=store, batch_size=1)
    trigger.tick(got.extend)
    assert [dict(e.after or {}) for e in got] == [{"id": 1, "a": 10, "b": 20}]
    binlog_db.execute("ALTER TABLE t DROP COLUMN b, ADD COLUMN c INT")
    binlog_db.execute("INSERT INTO t VALUES (3, 12, 32)")
    for _ in range(6):  # a bound: one change a read (a read may end at a statement)
        trigger.tick(got.extend)
    assert [dict(e.after or {}) for e in got] == [
        {"id": 1, "a": 10, "b": 20},
        {"id": 2, "a": 11, "b": 21},  # was a stop: the ALTER counted, though after the names
        {"id": 3, "a": 12, "c": 32},
    ]
    source.close()


@pytest.mark.usefixtures("catalog_names")
def test_a_table_first_met_after_an_alter_that_followed_the_start_is_named_as_it_is_now(
    binlog_db: BinlogDatabase,
) -> None:
    binlog_db.execute("CREATE TABLE t (id INT PRIMARY KEY, a INT, b INT)")
    trigger, _store, _name, got = gone.watching(binlog_db, ["t"])  # read the columns: a, b
    binlog_db.execute("ALTER TABLE t DROP COLUMN a, ADD COLUMN c INT")
    binlog_db.execute("INSERT INTO t VALUES (1, 20, 30)")
    trigger.drain(got.extend)
    assert [dict(e.after or {}) for e in got] == [{"id": 1, "b": 20, "c": 30}]  # was a: 20, b: 30
    trigger.source.close()


@pytest.mark.parametrize(
    ("text", "changes"),
    [
        ("ALTER TABLE t ADD INDEX (a)", False),
        ("alter online table `db`.`t` add index (a)", False),
        ("ALTER TABLE t ADD CONSTRAINT c1 CHECK (a > 0), DROP CONSTRAINT c0", False),
        ("ALTER TABLE t ADD FOREIGN KEY (a) REFERENCES p (id) ON DELETE CASCADE", False),
        ("ALTER TABLE t DROP PRIMARY KEY, ADD PRIMARY KEY (id, a)", True),  # the key: events'
        ("ALTER TABLE t ADD CONSTRAINT PRIMARY KEY (id)", True),
        ("ALTER TABLE t RENAME INDEX ia TO ib, ALTER INDEX ib IGNORED", False),
        ("ALTER TABLE t COMMENT 'a, b', DEFAULT CHARSET = utf8mb4", False),
        ("ALTER TABLE t ENGINE=InnoDB ROW_FORMAT=COMPRESSED KEY_BLOCK_SIZE=8", False),
        ("ALTER TABLE t ALTER b DROP DEFAULT, LOCK = NONE", False),
        # may change b's type, which decides how its values are read (not in the statement)
        ("ALTER TABLE t MODIFY COLUMN b BIGINT COMMENT 'after all'", True),
        ("ALTER TABLE t CHANGE `b` b VARCHAR(10) DEFAULT 'first'", True),
        ("ALTER TABLE t COMMENT '#1', DROP COLUMN b", True),  # not a comment: a literal
        ("ALTER TABLE t COMMENT '-- x' /* , DROP COLUMN b */", False),
        ("ALTER TABLE t ADD INDEX (a) /*!50100 , DROP COLUMN b */", True),  # run by the server
        ('ALTER TABLE t COMMENT "x\\", DROP COLUMN b, y"', False),
        ("ALTER TABLE `db` . `t` DROP COLUMN b", True),
        ("ALTER TABLE other.t DROP COLUMN b", False),
        ("ALTER TABLE t ADD PARTITION (PARTITION p2 VALUES LESS THAN (30))", False),
        ("ALTER TABLE t ENABLE KEYS", False),
        ("ALTER TABLE t", False),
        ("ALTER TABLE t ADD COLUMN c INT", True),
        ("ALTER TABLE t ADD c INT", True),
        ("ALTER TABLE t ADD (c INT, d INT)", True),
        ("ALTER TABLE t DROP b", True),
        ("ALTER TABLE t DROP COLUMN IF EXISTS b", True),
        ("ALTER TABLE t CHANGE b c INT", True),
        ("ALTER TABLE t MODIFY b INT AFTER id", True),
        ("ALTER TABLE t MODIFY b INT FIRST", True),
        ("ALTER TABLE t RENAME COLUMN b TO c", True),
        ("ALTER TABLE t CONVERT TO CHARACTER SET utf8mb4", True),
        ("ALTER TABLE t ADD INDEX (a), DROP COLUMN b", True),
        ("ALTER TABLE t SOMETHING NEW", True),  # not known: counted
        ("ALTER TABLE t RENAME TO t_old", True),
        ("ALTER TABLE t2 DROP COLUMN b", False),
        ("ALTER TABLE `t-x` DROP COLUMN b", False),
        ("ALTER TABLE `t` DROP COLUMN b", True),
    ],
)
def test_which_alter_statements_change_the_column_list(text: str, changes: bool) -> None:
    assert binlog_ddl.redefines(text, "db", "db.t") is changes


# --- the decision and the log it reads, without a server ------------------------------------


def mark(pos: int, index: int = 1) -> lookahead.Mark:
    return lookahead.Mark(index, pos, f"binlog.{index:06d}")


class FakeLog:
    """A log of statements at offsets; records each stretch read (``Statements``' reader)."""

    def __init__(self, statements: dict[int, str]) -> None:
        self.statements = statements
        self.reads: list[tuple[int, int]] = []

    def read(self, a: lookahead.Mark, b: lookahead.Mark) -> tuple[list[lookahead.Statement], int]:
        self.reads.append((a.pos, b.pos))
        found = [
            lookahead.Statement(mark(pos), text, "db")
            for pos, text in sorted(self.statements.items())
            if a.pos <= pos < b.pos
        ]
        return found, b.pos - a.pos


def test_each_stretch_of_the_log_is_read_once_however_many_table_maps_ask() -> None:
    log = FakeLog({500: "ALTER TABLE t DROP COLUMN b, ADD COLUMN c INT"})
    statements = lookahead.Statements(log.read)
    assert statements.first("db.t", mark(100), mark(400)) is None
    assert statements.first("db.t", mark(200), mark(400)) is None  # inside: not read again
    found = statements.first("db.t", mark(300), mark(900))  # only 400..900 is read
    assert found is not None
    assert found.at.pos == 500
    assert statements.first("db.t", mark(900), mark(50)) is not None  # either way round: 50..100
    assert statements.first("db.t2", mark(50), mark(900)) is None  # another table
    assert log.reads == [(100, 400), (400, 900), (50, 100)]
    assert statements.bytes_read == 850


def reading(names: tuple[str, ...], end: int) -> lookahead.Reading:
    return lookahead.Reading(names, dict.fromkeys(names, "int"), mark(end), ("id",))


DROP_B = "ALTER TABLE t DROP COLUMN b, ADD COLUMN c INT"
CHANGE_C = "ALTER TABLE t CHANGE c d INT"
INDEX = "ALTER TABLE t ADD INDEX (b)"
OTHER = "ALTER TABLE t2 DROP COLUMN b, ADD COLUMN c INT"


@pytest.mark.parametrize(
    ("statements", "start", "now", "at", "named", "stops_at"),
    [
        # the ALTER after the start's reading: a table map before it is named by that
        ({500: DROP_B}, ("ab", 300), ("ac", 900), 200, "ab", None),
        # a table map between the start and the ALTER, met after it ran: the start's too
        ({500: DROP_B}, ("ab", 300), ("ac", 900), 400, "ab", None),
        # a table map after the ALTER: the catalog read again, named as it is now
        ({500: DROP_B}, ("ab", 300), ("ac", 900), 600, "ac", None),
        # before the ALTER, and started after it (a reader behind): not knowable, stop
        ({500: DROP_B}, ("ac", 800), ("ac", 900), 200, "ac", 500),
        # between two ALTERs, readings before the first and after the second: stop
        ({300: DROP_B, 600: CHANGE_C}, ("ab", 100), ("ad", 900), 400, "ad", 600),
        # an index of the table, a column of another: nothing between, read on
        ({500: INDEX, 510: OTHER}, ("ab", 800), ("ab", 900), 200, "ab", None),
    ],
)
def test_the_reading_a_table_map_is_named_by(
    statements: dict[int, str],
    start: tuple[str, int],
    now: tuple[str, int],
    at: int,
    named: str,
    stops_at: int | None,
) -> None:
    ahead = lookahead.Lookahead(
        lookahead.Statements(FakeLog(statements).read), lambda table: reading(tuple(now[0]), now[1])
    )
    ahead.readings["db.t"] = [reading(tuple(start[0]), start[1])]
    got = ahead.reading(7, "db.t", ("binlog.000001", at))
    assert got is not None
    assert "".join(got.names) == named
    later = ahead.later(7)
    assert (None if later is None else later.pos) == stops_at


def test_a_stretch_the_server_no_longer_has_counts_as_a_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # binlog.000002 purged while the reader was behind: its statements are not known.
    monkeypatch.setattr(lookahead, "binary_logs", lambda conn: [("binlog.000003", 900)])
    statements = lookahead.Statements(
        lambda a, b: lookahead.read_statements(None, ["db.t"], a, b)  # type: ignore[arg-type]
    )
    found = statements.first("db.t", mark(500, 2), mark(50, 3))
    assert found is not None
    assert found.at == mark(500, 2)
    assert "binlog.000002, no longer on the server" in found.text
