"""Every numeric option of every public constructor: a wrong type or a meaningless value
is a ConfigurationError naming the option, at construction.

Before, ``batch_size="100"`` raised a bare ``TypeError`` at the first comparison
(for a Function App: at import, so no function was indexed), ``batch_size=True``
was taken for 1, ``lease_ttl_seconds=nan`` passed every check (``nan <= 0`` is
False) and ``inf`` meant forever. One helper (``dbtrigger.options``) checks
them all; this table lists every public constructor and numeric option.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import azure.functions as func
import pytest

from dbtrigger import (
    BlobCheckpointStore,
    ClaimSource,
    DbBindings,
    FileCheckpointStore,
    InMemoryCheckpointStore,
    PollTrigger,
    QueueTrigger,
    RetryPolicy,
    SqlAlchemySource,
    TableCheckpointStore,
)
from dbtrigger.cdc import BinlogSource, PgLogicalSource
from dbtrigger.changelog import ChangeLogSource
from dbtrigger.errors import ConfigurationError
from dbtrigger.options import number, seconds, whole
from dbtrigger.partitions import PartitionedPoller
from dbtrigger.queue import Backoff
from dbtrigger.sources.visibility import (
    MariaDbHorizon,
    SafetyWindow,
    SnapshotHorizon,
    TransactionHorizon,
)
from dbtrigger.testing import MemorySource

SQLITE = "sqlite:///unused.db"  # never connected: construction only
STORAGE = "UseDevelopmentStorage=true"


def memory() -> MemorySource:
    return MemorySource(cursor_column="n", pk_columns=["id"])


def poll(**kw: Any) -> Any:
    return PollTrigger(name="p", source=memory(), checkpoint_store=InMemoryCheckpointStore(), **kw)


def fan_out(**kw: Any) -> Any:
    return poll(subscribers={"a": lambda events: None}, **kw)


def queue(**kw: Any) -> Any:
    return QueueTrigger(
        name="q", source=ClaimSource(url=SQLITE, table="jobs", pk_columns=["id"]), **kw
    )


def partitioned(**kw: Any) -> Any:
    source = SqlAlchemySource(url=SQLITE, table="t", cursor_column="n", pk_columns=["id"])
    return PartitionedPoller(
        name="p",
        source=source,
        checkpoint_store=InMemoryCheckpointStore(),
        background=False,
        **kw,
    )


def decorated(**kw: Any) -> Any:
    """``@db.trigger`` in a real FunctionApp (the numbers are read at decoration)."""
    app = func.FunctionApp()
    db = DbBindings()

    @app.schedule(schedule="0 */5 * * * *", arg_name="timer", run_on_startup=False)
    @db.trigger(
        arg_name="events", source=memory(), checkpoint_store=InMemoryCheckpointStore(), **kw
    )
    def handle(timer: func.TimerRequest, events: list[Any]) -> None:
        del timer, events

    return handle


def tmp_file_store(tmp: Path, **kw: Any) -> Any:
    return FileCheckpointStore(tmp / "state", **kw)


#: Bad values for a count (>= 1 unless noted) and for a duration (> 0 unless noted).
WHOLE_BAD = ["100", True, 2.0, math.nan, -1, 0, None]
SECONDS_BAD = ["100", True, math.nan, math.inf, -math.inf, -1, 0]
#: For options that take 0 (a count of zero, a delay of zero, "0 disables"):
WHOLE0_BAD = ["100", True, 2.0, -1]
SECONDS0_BAD = ["100", True, math.nan, math.inf, -1]

Case = tuple[str, Callable[..., Any], str, list[Any]]

CASES: list[Case] = [
    ("PollTrigger", poll, "batch_size", WHOLE_BAD),
    ("PollTrigger", poll, "max_batches_per_tick", WHOLE_BAD),
    ("PollTrigger", poll, "lease_ttl_seconds", SECONDS_BAD),
    ("PollTrigger", poll, "journal_limit", WHOLE0_BAD),
    ("PollTrigger", poll, "null_check_interval_seconds", SECONDS0_BAD),
    ("PollTrigger", poll, "heartbeat_interval_seconds", SECONDS0_BAD),
    ("PollTrigger", poll, "max_attempts", WHOLE_BAD),
    ("PollTrigger", poll, "quarantine_limit", WHOLE_BAD),
    ("PollTrigger", poll, "partitions", [v for v in WHOLE_BAD if v is not None]),
    ("PollTrigger", poll, "balance_interval_seconds", SECONDS_BAD),
    ("PollTrigger", poll, "member_ttl_seconds", SECONDS_BAD),
    ("PollTrigger", poll, "retry_delay_seconds", SECONDS0_BAD),
    ("PollTrigger", poll, "retry_delay_max_seconds", SECONDS0_BAD),
    ("PollTrigger", poll, "window_max_events", WHOLE_BAD),
    ("PollTrigger", poll, "window_max_bytes", [*WHOLE_BAD, 1023]),
    ("PollTrigger", poll, "max_concurrency", WHOLE_BAD),
    ("PollTrigger(subscribers=)", fan_out, "ack_timeout_seconds", SECONDS_BAD),
    ("QueueTrigger", queue, "batch_size", WHOLE_BAD),
    ("QueueTrigger", queue, "max_concurrency", WHOLE_BAD),
    ("QueueTrigger", queue, "visibility_timeout_seconds", SECONDS_BAD),
    ("QueueTrigger", queue, "heartbeat_interval_seconds", SECONDS_BAD),
    ("QueueTrigger", queue, "max_attempts", WHOLE_BAD),
    ("QueueTrigger", queue, "retry_delay_seconds", SECONDS0_BAD),
    ("QueueTrigger", queue, "retry_delay_max_seconds", SECONDS0_BAD),
    ("QueueTrigger", queue, "max_batches_per_tick", WHOLE_BAD),
    ("QueueTrigger", queue, "seed", ["1", True, 1.5]),
    ("Backoff", Backoff, "base_seconds", SECONDS0_BAD),
    ("Backoff", Backoff, "cap_seconds", SECONDS0_BAD),
    ("RetryPolicy", RetryPolicy, "attempts", WHOLE_BAD),
    ("RetryPolicy", RetryPolicy, "initial_backoff_seconds", SECONDS0_BAD),
    ("RetryPolicy", RetryPolicy, "max_backoff_seconds", SECONDS0_BAD),
    ("RetryPolicy", RetryPolicy, "multiplier", [*SECONDS0_BAD, 0.5]),
    ("RetryPolicy", RetryPolicy, "max_elapsed_seconds", SECONDS_BAD),
    ("SafetyWindow", SafetyWindow, "seconds", SECONDS_BAD),
    ("TransactionHorizon", TransactionHorizon, "warn_after_seconds", SECONDS0_BAD),
    ("TransactionHorizon", TransactionHorizon, "settle_seconds", SECONDS0_BAD),
    ("SnapshotHorizon", SnapshotHorizon, "warn_after_seconds", SECONDS0_BAD),
    ("MariaDbHorizon", MariaDbHorizon, "warn_after_seconds", SECONDS0_BAD),
    ("MariaDbHorizon", MariaDbHorizon, "settle_seconds", SECONDS0_BAD),
    ("MariaDbHorizon", MariaDbHorizon, "precision", [*WHOLE0_BAD, 7]),
    (
        "BlobCheckpointStore",
        lambda **kw: BlobCheckpointStore.from_connection_string(
            STORAGE, app_name="a", container="db-state", **kw
        ),
        "read_timeout",
        SECONDS_BAD,
    ),
    (
        "TableCheckpointStore",
        lambda **kw: TableCheckpointStore(connection_string=STORAGE, app_name="a", **kw),
        "timeout_seconds",
        SECONDS_BAD,
    ),
    (
        "TableCheckpointStore",
        lambda **kw: TableCheckpointStore(connection_string=STORAGE, app_name="a", **kw),
        "retries",
        WHOLE0_BAD,
    ),
    ("FileCheckpointStore", tmp_file_store, "lock_timeout", SECONDS_BAD),
    ("PartitionedPoller", partitioned, "partitions", WHOLE_BAD),
    ("PartitionedPoller", partitioned, "balance_interval_seconds", SECONDS_BAD),
    ("PartitionedPoller", partitioned, "member_ttl_seconds", SECONDS_BAD),
    ("PartitionedPoller", partitioned, "min_hold_cycles", WHOLE0_BAD),
    (
        "ChangeLogSource",
        lambda **kw: ChangeLogSource(url=SQLITE, table="t", **kw),
        "prune_every_seconds",
        SECONDS_BAD,
    ),
    (
        "ChangeLogSource",
        lambda **kw: ChangeLogSource(url=SQLITE, table="t", **kw),
        "drift_check_seconds",
        SECONDS_BAD,
    ),
    (
        "ChangeLogSource",
        lambda **kw: ChangeLogSource(url=SQLITE, table="t", **kw),
        "prune_keep_seconds",
        SECONDS0_BAD,
    ),
    *(
        (
            "PgLogicalSource",
            lambda **kw: PgLogicalSource("postgresql://u@h/db", ["orders"], **kw),
            option,
            bad,
        )
        for option, bad in [
            ("read_timeout_seconds", SECONDS_BAD),
            ("read_ahead", WHOLE_BAD),
            ("backlog_step_mb", WHOLE_BAD),
            ("heartbeat_interval_seconds", SECONDS0_BAD),
            ("snapshot_chunk_size", WHOLE_BAD),
            ("snapshot_lock_timeout_seconds", SECONDS_BAD),
            ("stream_wait_seconds", SECONDS0_BAD),
        ]
    ),
    # (The decorator also takes numbers written as text or 2.0, as app settings give them.)
    *(
        (
            "BinlogSource",
            lambda **kw: BinlogSource("mysql+pymysql://u@h/db", ["orders"], **kw),
            option,
            bad,
        )
        for option, bad in [
            ("server_id", ["1", True, 1.5, 0, -1, 2**32]),
            ("read_timeout_seconds", SECONDS_BAD),
            ("read_ahead", WHOLE_BAD),
            ("heartbeat_interval_seconds", SECONDS0_BAD),
            ("snapshot_chunk_size", WHOLE_BAD),
            ("snapshot_lock_timeout_seconds", SECONDS_BAD),
        ]
    ),
    ("@db.trigger", decorated, "batch_size", [v for v in WHOLE_BAD if v not in ("100", 2.0)]),
    (
        "@db.trigger",
        decorated,
        "max_batches_per_tick",
        [v for v in WHOLE_BAD if v not in ("100", 2.0)],
    ),
    ("@db.trigger", decorated, "lease_ttl_seconds", [v for v in SECONDS_BAD if v != "100"]),
    ("@db.trigger", decorated, "max_concurrency", WHOLE_BAD),
]


def _params() -> list[Any]:
    out = []
    for label, build, option, values in CASES:
        for value in values:
            out.append(pytest.param(build, option, value, id=f"{label}-{option}={value!r}"))
    return out


@pytest.mark.parametrize(("build", "option", "value"), _params())
def test_a_bad_numeric_option_is_a_configuration_error_naming_it(
    build: Callable[..., Any], option: str, value: Any, tmp_path: Path
) -> None:
    kwargs = {option: value}
    with pytest.raises(ConfigurationError) as caught:
        build(tmp_path, **kwargs) if build is tmp_file_store else build(**kwargs)
    assert option in str(caught.value)


@pytest.mark.parametrize(("label", "build"), sorted({(c[0], c[1]) for c in CASES}, key=str))
def test_every_constructor_in_the_table_accepts_its_defaults(
    label: str, build: Callable[..., Any], tmp_path: Path
) -> None:
    del label
    assert (build(tmp_path) if build is tmp_file_store else build()) is not None


def test_the_helpers_normalise_and_name_the_option() -> None:
    assert whole("n", 3) == 3
    assert isinstance(seconds("s", 5), float)
    assert number("m", 1, minimum=1, inclusive=True) == 1.0
    with pytest.raises(
        ConfigurationError, match=r"^batch_size must be a whole number >= 1, got '100' \(str\)$"
    ):
        whole("batch_size", "100")
    with pytest.raises(
        ConfigurationError,
        match=r"lease_ttl_seconds must be a finite number of seconds > 0, got nan",
    ):
        seconds("lease_ttl_seconds", math.nan)


def test_the_worker_says_which_option_is_wrong(tmp_path: Path) -> None:
    """Through the installed console script: one error line naming the option."""
    (tmp_path / "typo_app.py").write_text(
        "from dbtrigger import InMemoryCheckpointStore, PollTrigger\n"
        "from dbtrigger.testing import MemorySource\n"
        "orders = PollTrigger(name='orders', checkpoint_store=InMemoryCheckpointStore(),\n"
        "    source=MemorySource(cursor_column='n', pk_columns=['id']), batch_size='100')\n"
    )
    done = subprocess.run(
        [str(Path(sys.executable).with_name("dbtrigger")), "run", "typo_app:orders"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert "batch_size must be a whole number >= 1, got '100' (str)" in done.stderr
    assert "Traceback" not in done.stderr
