"""Shared pieces of the benchmark scripts: data sets, baselines, stores, timing, tables.

Every script prints its measurement next to a baseline measured *in the same
run* (a raw driver loop, the azure-functions-db package, a target), because on
a shared 2-core machine an absolute rows/s figure from one run says little; the
ratio between two things measured back to back says a lot more.

Data sets are built once and reused across runs (they are keyed by row count
and a layout version), so re-running a benchmark does not pay for the load:

* PostgreSQL: schema ``dbtrigger_bench`` (``DBTRIGGER_BENCH_SCHEMA``), table
  ``events_<n>``, loaded with one ``INSERT ... SELECT generate_series``.
  ``DBTRIGGER_BENCH_PG_URL`` overrides the server (default: the test server on
  127.0.0.1:5432).
* SQLite: ``$TMPDIR/dbtrigger-bench/events_<n>_<layout>.sqlite``
  (``DBTRIGGER_BENCH_DIR`` replaces ``$TMPDIR``), loaded with ``executemany``
  in chunks.

Two layouts: ``wide`` (``events_<n>``: a key, a ``timestamptz`` cursor and
three more columns, text, numeric and text) and ``narrow`` (``narrow_<n>``:
``id bigint`` key, ``updated_at bigint`` cursor and a ``payload`` text: the
smallest useful row, where the driver's own work per row is least and what
dbtrigger adds shows most). In both the cursor column ``updated_at`` is a
permutation of the key order, three rows share each cursor value (ties that
straddle batch boundaries), and the table has the composite index
``(updated_at, id)`` the keyset fetch needs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import math
import os
import sqlite3
import statistics
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from dbtrigger import PollTrigger, SqlAlchemySource
from dbtrigger.state.stores.base import CheckpointStore, StoredDocument

ROOT = Path(__file__).resolve().parent.parent
PG_URL = os.environ.get(
    "DBTRIGGER_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)
SCHEMA = os.environ.get("DBTRIGGER_BENCH_SCHEMA", "dbtrigger_bench")
DATA_DIR = Path(os.environ.get("DBTRIGGER_BENCH_DIR", tempfile.gettempdir())) / "dbtrigger-bench"
#: Bump when the table layout or contents change, so stale data sets are rebuilt.
LAYOUT = "v1"
BASE_TIME = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
COLUMNS = ("id", "updated_at", "customer", "amount", "status")


def noop_handler(events: Sequence[Any]) -> None:
    """A handler that does nothing: the cost measured is dbtrigger's own."""
    del events


def reading_handler(events: Sequence[Any]) -> None:
    """A handler that reads each event's key and one column, a fair stand-in for
    real work (the raw loop reads the same two fields from its tuples): an event
    that defers building its ``pk`` or ``after`` pays for it here."""
    for event in events:
        event.pk["id"]  # the read is the point
        event.after["status"]


def narrow_reading_handler(events: Sequence[Any]) -> None:
    """:func:`reading_handler` for the narrow layout: the key and ``payload``."""
    for event in events:
        event.pk["id"]  # the read is the point
        event.after["payload"]


#: ``--handler`` choices of the catch-up benchmarks.
HANDLERS: dict[str, Callable[[Sequence[Any]], None]] = {
    "noop": noop_handler,
    "read": reading_handler,
}


# --- data sets -----------------------------------------------------------------------


def _stride(n: int) -> int:
    """A multiplier coprime with ``n``: ``i * stride % n`` permutes ``0..n-1``."""
    for candidate in (7919, 7907, 7901, 104729):
        if math.gcd(candidate, n) == 1:
            return candidate
    return 1


@dataclass(frozen=True)
class Layout:
    """The columns of one data-set layout and the one column a reading handler reads."""

    name: str
    prefix: str  # table name prefix
    columns: tuple[str, ...]
    read_column: str
    reader: Callable[[Sequence[Any]], None]

    @property
    def read_index(self) -> int:
        return self.columns.index(self.read_column)


WIDE = Layout("wide", "events", COLUMNS, "status", reading_handler)
NARROW = Layout(
    "narrow", "narrow", ("id", "updated_at", "payload"), "payload", narrow_reading_handler
)
LAYOUTS = {layout.name: layout for layout in (WIDE, NARROW)}


def table_name(n: int, layout: Layout = WIDE) -> str:
    return f"{layout.prefix}_{n}"


def pg_engine() -> sa.Engine:
    return sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")


def pg_conninfo() -> str:
    """The benchmark server as a libpq connection string (for the raw psycopg loop)."""
    url = sa.make_url(PG_URL)
    parts = {
        "host": url.host or "127.0.0.1",
        "port": url.port or 5432,
        "user": url.username or "postgres",
        "dbname": url.database or "postgres",
    }
    if url.password:
        parts["password"] = url.password
    return " ".join(f"{k}={v}" for k, v in parts.items())


_PG_DDL = {
    "wide": (
        " id bigint PRIMARY KEY,"
        " updated_at timestamptz NOT NULL,"
        " customer text NOT NULL,"
        " amount numeric(12, 2) NOT NULL,"
        " status text NOT NULL"
    ),
    "narrow": " id bigint PRIMARY KEY, updated_at bigint NOT NULL, payload text NOT NULL",
}
_PG_FILL = {
    "wide": (
        "SELECT g,"
        " CAST(:base AS timestamptz)"
        "   + ((g * CAST(:stride AS bigint)) % :n / 3) * interval '1 millisecond',"
        " 'customer-' || (g % 997),"
        " (g % 100000) / 100.0,"
        " CASE WHEN g % 5 = 0 THEN 'shipped' ELSE 'new' END"
    ),
    "narrow": (
        "SELECT g,"
        " (g * CAST(:stride AS bigint)) % :n / 3,"
        " CASE WHEN g % 5 = 0 THEN 'shipped' ELSE 'new' END"
    ),
}


def ensure_pg_table(n: int, *, rebuild: bool = False, layout: Layout = WIDE) -> tuple[str, str]:
    """Create (or reuse) the ``n``-row PostgreSQL table; returns ``(schema, table)``."""
    name = table_name(n, layout)
    tag = "" if layout is WIDE else f" {layout.name}"
    marker = f"dbtrigger-bench {LAYOUT}{tag} rows={n}"
    engine = pg_engine()
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
            comment = conn.execute(
                sa.text("SELECT obj_description(to_regclass(:t), 'pg_class')"),
                {"t": f"{SCHEMA}.{name}"},
            ).scalar()
            if comment == marker and not rebuild:
                return SCHEMA, name
            started = time.perf_counter()
            conn.execute(sa.text(f"DROP TABLE IF EXISTS {SCHEMA}.{name}"))
            conn.execute(sa.text(f"CREATE TABLE {SCHEMA}.{name} ({_PG_DDL[layout.name]})"))
            fill = _PG_FILL[layout.name]
            params: dict[str, Any] = {"stride": _stride(n), "n": n}
            if ":base" in fill:
                params["base"] = BASE_TIME
            conn.execute(
                sa.text(f"INSERT INTO {SCHEMA}.{name} {fill} FROM generate_series(0, :n - 1) AS g"),
                params,
            )
            conn.execute(sa.text(f"CREATE INDEX ON {SCHEMA}.{name} (updated_at, id)"))
            conn.execute(sa.text(f"VACUUM ANALYZE {SCHEMA}.{name}"))
            conn.execute(sa.text(f"COMMENT ON TABLE {SCHEMA}.{name} IS '{marker}'"))
            print(f"# built PostgreSQL {SCHEMA}.{name} in {time.perf_counter() - started:.1f} s")
            return SCHEMA, name
    finally:
        engine.dispose()


def _sqlite_rows(n: int, start: int, stop: int, layout: Layout = WIDE) -> Iterator[tuple[Any, ...]]:
    stride = _stride(n)
    if layout is NARROW:
        for g in range(start, stop):
            yield (g, (g * stride) % n // 3, "shipped" if g % 5 == 0 else "new")
        return
    for g in range(start, stop):
        ts = BASE_TIME + dt.timedelta(milliseconds=(g * stride) % n // 3)
        yield (
            g,
            # SQLAlchemy's own text format for DATETIME on SQLite.
            ts.replace(tzinfo=None).strftime("%Y-%m-%d %H:%M:%S.%f"),
            f"customer-{g % 997}",
            (g % 100000) / 100.0,
            "shipped" if g % 5 == 0 else "new",
        )


_LITE_DDL = {
    "wide": (
        "CREATE TABLE events (id INTEGER PRIMARY KEY, updated_at DATETIME NOT NULL,"
        " customer TEXT NOT NULL, amount REAL NOT NULL, status TEXT NOT NULL)"
    ),
    "narrow": (
        "CREATE TABLE events (id INTEGER PRIMARY KEY, updated_at INTEGER NOT NULL,"
        " payload TEXT NOT NULL)"
    ),
}


def ensure_sqlite_file(n: int, *, rebuild: bool = False, layout: Layout = WIDE) -> Path:
    """Create (or reuse) the ``n``-row SQLite file; returns its path."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    path = DATA_DIR / f"{layout.prefix}_{n}_{LAYOUT}.sqlite"
    if path.exists() and not rebuild:
        return path
    started = time.perf_counter()
    tmp = path.with_suffix(".building")
    tmp.unlink(missing_ok=True)
    conn = sqlite3.connect(tmp)
    try:
        conn.execute(_LITE_DDL[layout.name])
        marks = ", ".join("?" for _ in layout.columns)
        chunk = 50_000
        for start in range(0, n, chunk):
            conn.executemany(
                f"INSERT INTO events VALUES ({marks})",
                _sqlite_rows(n, start, min(n, start + chunk), layout),
            )
        conn.execute("CREATE INDEX events_cursor ON events (updated_at, id)")
        conn.commit()
        conn.execute("ANALYZE")
    finally:
        conn.close()
    tmp.replace(path)
    print(f"# built SQLite {path.name} in {time.perf_counter() - started:.1f} s")
    return path


@dataclass(frozen=True)
class Dataset:
    """One table to drain: where it is, and how to build a source for it."""

    kind: str  # "postgresql" or "sqlite"
    rows: int
    url: str
    schema: str | None
    table: str
    layout: Layout = WIDE

    def source(self, visibility: str = "none") -> SqlAlchemySource:
        """A source over the table. ``visibility="none"`` by default: the table
        is static, and the raw loop it is compared with has no guard either; the
        guard's own cost is measured separately (``visibility="auto"``)."""
        return SqlAlchemySource(
            url=self.url,
            table=self.table,
            schema=self.schema,
            cursor_column="updated_at",
            pk_columns=["id"],
            visibility=visibility,
        )


def dataset(kind: str, n: int, *, rebuild: bool = False, layout: Layout = WIDE) -> Dataset:
    if kind == "postgresql":
        schema, name = ensure_pg_table(n, rebuild=rebuild, layout=layout)
        return Dataset(kind, n, PG_URL, schema, name, layout)
    if kind == "sqlite":
        path = ensure_sqlite_file(n, rebuild=rebuild, layout=layout)
        return Dataset(kind, n, f"sqlite:///{path}", None, "events", layout)
    raise SystemExit(f"unknown database kind {kind!r} (postgresql, sqlite)")


# --- baselines: the raw driver keyset loop ------------------------------------------------

_FIRST = "SELECT {c} FROM {t} ORDER BY updated_at, id LIMIT {m}"
_NEXT = "SELECT {c} FROM {t} WHERE (updated_at, id) > ({m}, {m}) ORDER BY updated_at, id LIMIT {m}"


def raw_keyset_drain(ds: Dataset, batch: int, *, read: bool = False) -> int:
    """The floor: the same keyset read with the bare driver, rows as tuples, nothing else.

    One connection, autocommit, the last row's ``(updated_at, id)`` bound into
    the next query. With ``read`` it reads each tuple's key and ``status``, the
    fields :func:`reading_handler` reads from each event. Returns the rows read.
    """
    columns = ", ".join(ds.layout.columns)
    read_at = ds.layout.read_index if read else -1
    if ds.kind == "postgresql":
        import psycopg  # noqa: PLC0415 - only the PostgreSQL baseline needs it

        where = f"{ds.schema}.{ds.table}"
        first = _FIRST.format(c=columns, t=where, m="%s")
        nxt = _NEXT.format(c=columns, t=where, m="%s")
        with psycopg.connect(pg_conninfo(), autocommit=True) as pconn, pconn.cursor() as cur:
            return _keyset_loop(
                lambda q, p: cur.execute(q, p).fetchall(), first, nxt, batch, read_at=read_at
            )
    path = sa.make_url(ds.url).database or ""
    lconn = sqlite3.connect(path)
    first = _FIRST.format(c=columns, t="events", m="?")
    nxt = _NEXT.format(c=columns, t="events", m="?")
    try:
        return _keyset_loop(
            lambda q, p: lconn.execute(q, p).fetchall(), first, nxt, batch, read_at=read_at
        )
    finally:
        lconn.close()


def _keyset_loop(
    run: Callable[[str, tuple[Any, ...]], list[Any]],
    first: str,
    nxt: str,
    batch: int,
    *,
    read_at: int = -1,
) -> int:
    total = 0
    rows = run(first, (batch,))
    while rows:
        total += len(rows)
        if read_at >= 0:
            for row in rows:
                row[0]  # the key, as the reading handler reads it
                row[read_at]  # the column it reads
        if len(rows) < batch:
            break
        last = rows[-1]
        rows = run(nxt, (last[1], last[0], batch))
    return total


# --- dbtrigger -------------------------------------------------------------------------------


def dbtrigger_drain(
    ds: Dataset,
    batch: int,
    store: CheckpointStore,
    *,
    poller: str = "bench",
    visibility: str = "none",
    idle_limit_seconds: float = 30.0,
    handler: Callable[[Sequence[Any]], None] = noop_handler,
) -> int:
    """Drain the table through ``PollTrigger`` (no-op handler unless one is given);
    returns the rows delivered.

    Ticks until every row was delivered. A tick that delivers nothing while rows
    remain is a visibility guard holding rows back until transactions that were
    open at its probe have ended (other sessions on a shared server); the loop
    waits for that, but gives up after ``idle_limit_seconds`` without progress.
    """
    source = ds.source(visibility)
    try:
        trigger = PollTrigger(
            name=poller,
            source=source,
            checkpoint_store=store,
            batch_size=batch,
            max_batches_per_tick=1_000_000,
        )
        total = 0
        stalled_since: float | None = None
        while total < ds.rows:
            got = trigger.tick(handler)
            total += got
            if got:
                stalled_since = None
                continue
            now = time.monotonic()
            stalled_since = stalled_since or now
            if now - stalled_since > idle_limit_seconds:
                break
            time.sleep(0.005)
        return total
    finally:
        source.close()


# --- Azurite and the blob stores --------------------------------------------------------------


@contextlib.contextmanager
def azurite() -> Iterator[Any]:
    """A private Azurite on free ports, started the way the test suite starts it.

    ``DBTRIGGER_BENCH_AZURITE`` (a connection string): that running Azurite instead
    (the smoke tests pass theirs; starting one costs about 3 s of CPU). Scripts keep
    their state there under fresh names (app names, containers): no run reads another's.
    """
    if os.environ.get("DBTRIGGER_BENCH_AZURITE"):
        yield types.SimpleNamespace(connection_string=os.environ["DBTRIGGER_BENCH_AZURITE"])
        return
    import sys  # noqa: PLC0415

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.azurite import start_azurite  # noqa: PLC0415 - reuse the test fixture's launcher

    with contextlib.contextmanager(start_azurite)() as running:
        yield running


def blob_store_class() -> Any:
    """dbtrigger's ``BlobCheckpointStore``, or None when this checkout has none yet."""
    try:
        from dbtrigger.state.stores.blob import BlobCheckpointStore  # noqa: PLC0415
    except ImportError:
        return None
    return BlobCheckpointStore


def dbtrigger_blob_store(az: Any, app_name: str) -> CheckpointStore:
    cls = blob_store_class()
    if cls is None:
        raise RuntimeError("dbtrigger.state.stores.blob is not available in this checkout")
    store: CheckpointStore = cls.from_connection_string(
        az.connection_string, app_name=app_name, container="bench-state", create_container=True
    )
    return store


# --- timing storage operations ----------------------------------------------------------------


@dataclass
class OpTimes:
    """Durations (seconds) of the store calls made through a :class:`TimingStore`."""

    reads: list[float] = field(default_factory=list)
    writes: list[float] = field(default_factory=list)

    def reset(self) -> None:
        self.reads.clear()
        self.writes.clear()


class TimingStore:
    """A ``CheckpointStore`` that forwards to another and times each read and write.

    Counting is :class:`dbtrigger.testing.CountingStore`'s job; this one measures
    round trips, failed calls included.
    """

    def __init__(self, inner: CheckpointStore) -> None:
        self.inner = inner
        self.times = OpTimes()

    def read(self, key: str) -> StoredDocument | None:
        started = time.perf_counter()
        try:
            return self.inner.read(key)
        finally:
            self.times.reads.append(time.perf_counter() - started)

    def write(self, key: str, data: bytes, *, if_match: str | None) -> str:
        started = time.perf_counter()
        try:
            return self.inner.write(key, data, if_match=if_match)
        finally:
            self.times.writes.append(time.perf_counter() - started)

    def delete(self, key: str, *, if_match: str | None = None) -> None:
        self.inner.delete(key, if_match=if_match)

    def list_keys(self) -> list[str]:
        return self.inner.list_keys()

    def describe(self) -> str:
        return self.inner.describe()


# --- timing and output ---------------------------------------------------------------------------


def timed(fn: Callable[[], int]) -> tuple[int, float]:
    """Run ``fn`` (which returns a row count); return ``(rows, seconds)``."""
    started = time.perf_counter()
    rows = fn()
    return rows, time.perf_counter() - started


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def fmt_rate(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:,.0f}"


def fmt_ratio(num: float | None, den: float | None) -> str:
    if num is None or den is None or den == 0 or math.isnan(num) or math.isnan(den):
        return "-"
    return f"{num / den:.2f}"


def print_table(
    title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], *, left: int = 1
) -> None:
    """A plain-text table: the first ``left`` columns left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    print()
    print(title)
    for index, row in enumerate(cells):
        line = [
            c.ljust(w) if column < left or index == 0 else c.rjust(w)
            for column, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(line).rstrip())
        if index == 0:
            print("  ".join("-" * w for w in widths))
    print(flush=True)


def int_list(text: str) -> list[int]:
    """``"100,1000,5k,1m"`` -> ``[100, 1000, 5000, 1000000]``."""
    values = []
    for raw in text.split(","):
        part = raw.strip().lower()
        if not part:
            continue
        scale = {"k": 1000, "m": 1_000_000}.get(part[-1], 1)
        number = part[:-1] if scale > 1 else part
        values.append(int(float(number) * scale))
    return values


def str_list(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def rss_mb() -> tuple[float, float]:
    """``(VmRSS, VmHWM)`` of this process in MiB, from ``/proc/self/status``."""
    values = {"VmRSS": float("nan"), "VmHWM": float("nan")}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0]) / 1024
    return values["VmRSS"], values["VmHWM"]


__all__ = [
    "COLUMNS",
    "HANDLERS",
    "LAYOUTS",
    "NARROW",
    "PG_URL",
    "ROOT",
    "WIDE",
    "Dataset",
    "Layout",
    "OpTimes",
    "PollTrigger",
    "TimingStore",
    "azurite",
    "blob_store_class",
    "dataset",
    "dbtrigger_blob_store",
    "dbtrigger_drain",
    "fmt_rate",
    "fmt_ratio",
    "int_list",
    "median",
    "narrow_reading_handler",
    "noop_handler",
    "percentile",
    "print_table",
    "raw_keyset_drain",
    "reading_handler",
    "rss_mb",
    "str_list",
    "timed",
]
