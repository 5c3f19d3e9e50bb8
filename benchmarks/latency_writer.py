"""The writer of ``benchmarks.latency``: a process of its own (no GIL shared with the worker).

Run as ``python -m benchmarks.latency_writer JSON`` by :func:`benchmarks.latency.measure`,
once per measured configuration. It imports only the standard library and the
database driver: importing ``benchmarks.latency`` (SQLAlchemy, dbtrigger) for it
cost about a second of CPU per run, more than the writing.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


def writer_main(
    url: str,
    table: str,
    rate: float,
    seconds: float,
    out: str,
    connections: int = 1,
    start_at: float = 0.0,
) -> None:
    """Insert one row per transaction at ``rate``/s; write each commit's wall clock to ``out``.

    Row ``i`` carries ``payload = str(i)`` and is due at ``i / rate`` seconds;
    ``connections`` sessions take turns (row ``i`` on session ``i %
    connections``), each committing its rows on schedule. ``out`` gets a JSON
    list whose item ``i`` is ``time.time()`` right after row ``i``'s commit
    returned. Several sessions: MariaDB syncs its redo log at every commit
    (``innodb_flush_log_at_trx_commit=1``), so one session keeps only a few
    hundred commits a second on a shared disk, while concurrent ones share a
    group commit. ``start_at``: the wall clock of the first commit, if later
    than the sessions are ready (the phase, free of the process's start-up).
    """
    parsed = urlsplit(url)
    total = int(rate * seconds)
    committed = [0.0] * total
    sql = f"INSERT INTO {table} (payload) VALUES (%s)"

    def connect() -> Any:
        if parsed.scheme.split("+")[0] == "postgresql":
            import psycopg  # noqa: PLC0415

            conn: Any = psycopg.connect(
                host=parsed.hostname,
                port=parsed.port,
                user=unquote(parsed.username) if parsed.username else None,
                password=unquote(parsed.password) if parsed.password else None,
                dbname=parsed.path.lstrip("/"),
                autocommit=True,
            )
            # Commits that do not wait for the WAL flush: the writer can keep 2,000/s on a
            # shared disk; what a reader sees, and when, is the same.
            conn.execute("SET synchronous_commit = off")
            return conn
        import pymysql  # noqa: PLC0415

        return pymysql.connect(
            host=parsed.hostname,
            port=parsed.port or 3306,
            user=unquote(parsed.username) if parsed.username else None,
            password=unquote(parsed.password or ""),
            database=parsed.path.lstrip("/"),
            autocommit=True,
        )

    sessions = [connect() for _ in range(connections)]
    errors: list[BaseException] = []

    def write(k: int, start: float) -> None:
        conn = sessions[k]
        cursor = conn.cursor()
        try:
            for i in range(k, total, connections):
                due = start + i / rate
                now = time.monotonic()
                if due > now:
                    time.sleep(due - now)
                cursor.execute(sql, (str(i),))
                committed[i] = time.time()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    try:
        time.sleep(max(0.0, start_at - time.time()))
        start = time.monotonic()
        wall_start = time.time()
        threads = [
            threading.Thread(target=write, args=(k, start), daemon=True) for k in range(connections)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - start
    finally:
        for conn in sessions:
            conn.close()
    if errors:
        raise errors[0]
    # How late each commit was against its schedule (a writer starved of CPU commits
    # in a burst afterwards).
    late = [at - (wall_start + i / rate) for i, at in enumerate(committed)]
    Path(out).write_text(json.dumps({"commits": committed, "seconds": elapsed, "late": late}))


def main(argv: list[str]) -> int:
    url, table, rate, seconds, out, connections, start_at = json.loads(argv[0])
    writer_main(url, table, float(rate), float(seconds), out, int(connections), float(start_at))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
