"""The chaos run: processes, the killer, the state monitor, and the accounting.

``run_chaos`` sets up the PostgreSQL tables, starts one writer and N workers
(``tests/chaos/writer.py``, ``tests/chaos/worker.py``), and while the writer
runs it keeps SIGKILLing a random worker (restarting it at once) or freezing
one with SIGSTOP for longer than the lease TTL plus grace (so another worker
takes its lease while it still believes it holds it) and then thawing it.
Meanwhile a monitor thread reads the state document every tenth of a
second. When the writer is done the workers drain the backlog, are
stopped, and :func:`analyse` turns the tables and the monitor's observations
into a :class:`ChaosReport`.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from dbtrigger.state import document as docmod
from dbtrigger.state.document import StateDocument
from dbtrigger.state.stores.base import CheckpointStore
from tests.chaos.forked import ForkedProcess, Forker

ROOT = Path(__file__).resolve().parent.parent.parent
POLLER = "chaos"
#: Created in the work directory once the writer is done.
DRAINING = "draining"

SCHEMA_SQL = """
CREATE SEQUENCE {s}.items_version_seq;
CREATE TABLE {s}.items (id bigint PRIMARY KEY, version bigint NOT NULL, payload text NOT NULL);
CREATE INDEX ix_items_version_id ON {s}.items (version, id);
CREATE TABLE {s}.seen (
    n bigserial PRIMARY KEY, item_id bigint NOT NULL, version bigint NOT NULL,
    worker text NOT NULL, incarnation int NOT NULL, batch_id text NOT NULL,
    token bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(),
    subscriber text NOT NULL DEFAULT '', retried boolean NOT NULL DEFAULT false);
CREATE TABLE {s}.sink (
    item_id bigint NOT NULL, version bigint NOT NULL, token bigint NOT NULL,
    PRIMARY KEY (item_id, version));
CREATE TABLE {s}.fence (id int PRIMARY KEY, token bigint NOT NULL);
INSERT INTO {s}.fence VALUES (1, 0);
CREATE TABLE {s}.fence_rejections (
    n bigserial PRIMARY KEY, worker text NOT NULL, incarnation int NOT NULL,
    batch_id text NOT NULL, token bigint NOT NULL, fence bigint NOT NULL);
CREATE TABLE {s}.outcomes (
    n bigserial PRIMARY KEY, worker text NOT NULL, incarnation int NOT NULL,
    batch_id text, token bigint, outcome text NOT NULL, error text NOT NULL);
CREATE TABLE {s}.timeouts (
    n bigserial PRIMARY KEY, batch_id text NOT NULL, subscriber text NOT NULL);
"""


def create_tables(engine: sa.Engine, schema: str) -> None:
    with engine.begin() as conn:
        for statement in SCHEMA_SQL.format(s=f'"{schema}"').split(";"):
            if statement.strip():
                conn.execute(sa.text(statement))


def position_key(raw: dict[str, Any] | None) -> tuple[int, int]:
    """A checkpoint position (state-document JSON) as ``(version, id)``."""
    if raw is None:
        return (-1, -1)
    position = docmod.position_from_json(raw)
    if position.is_beginning:
        return (-1, -1)
    return (int(position.cursor), int(position.pk["id"]))


class Monitor(threading.Thread):
    """Reads the state document in a loop and keeps what it saw."""

    #: 0.1 s (0.03 until the suite outgrew its budget: a Blob read each time). Nothing
    #: is missed by reading less often: the workers keep 100 journal entries
    #: (tests/chaos/worker.py --journal-limit), far more than commit in 0.1 s, and the
    #: commit chain rebuilt from them shows any stale commit whenever it landed.
    def __init__(self, store: CheckpointStore, interval: float = 0.1) -> None:
        super().__init__(name="chaos-monitor", daemon=True)
        self.store = store
        self.interval = interval
        self.positions: list[tuple[int, int]] = []
        self.tokens: list[int] = []
        self.commits: dict[str, dict[str, Any]] = {}
        self.order: list[str] = []
        self.reads = 0
        self.read_errors = 0
        self.latest: StateDocument | None = None
        self._halt = threading.Event()
        self._lock = threading.Lock()

    def observe(self) -> None:
        try:
            stored = self.store.read(POLLER)
        except Exception:
            self.read_errors += 1
            return
        self.reads += 1
        if stored is None:
            return
        doc = docmod.loads(stored.data)
        with self._lock:
            self.latest = doc
            if doc.checkpoint is not None:
                self.positions.append(position_key(docmod.position_to_json(doc.position)))
            if doc.lease is not None:
                self.tokens.append(doc.lease.fencing_token)
            for entry in doc.journal:
                if entry.get("type") != "commit":
                    continue
                batch_id = str(entry["batch_id"])
                if batch_id not in self.commits:
                    self.commits[batch_id] = dict(entry)
                    self.order.append(batch_id)

    def run(self) -> None:
        while not self._halt.wait(self.interval):
            self.observe()

    def stop(self) -> None:
        self._halt.set()
        self.join()
        self.observe()


@dataclasses.dataclass
class ChaosReport:
    seconds: float
    workers: int
    rows_inserted: int
    row_updates: int
    final_rows: int
    kills: int
    pauses: int
    restarts: int
    deliveries: int
    row_states_seen: int
    superseded_unseen_w7: int
    duplicates: int
    duplicate_windows: dict[str, int]
    unexplained_duplicates: int
    unexplained_cases: list[str]
    lost: int
    #: For each row state some subscriber was never handed (up to 20): what that
    #: subscriber was handed of the row, and what was dead-lettered of it.
    lost_cases: list[str]
    ack_timeouts: int
    dead_letters: int
    unearned_dead_letters: int
    unearned_cases: list[str]
    checkpoint_regressions: int
    commits: int
    chain_breaks: int
    stale_commits_accepted: int
    max_fencing_token: int
    lost_lease_outcomes: int
    commit_failed_outcomes: int
    other_error_outcomes: int
    fence_rejections: int
    monitor_reads: int
    drain_seconds: float

    def table(self) -> str:
        rows = [(k, v) for k, v in dataclasses.asdict(self).items()]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


class Chaos:
    """Owns the processes of one run."""

    def __init__(
        self,
        *,
        db_url: str,
        schema: str,
        workdir: Path,
        worker_args: list[str],
        env: dict[str, str],
        workers: int,
        seed: int,
        forker: Forker,
    ) -> None:
        self.forker = forker
        self.extra_env = env
        self.db_url = db_url
        self.schema = schema
        self.workdir = workdir
        self.worker_args = worker_args
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        self.names = [f"w{i + 1}" for i in range(workers)]
        self.rng = random.Random(seed)
        self.procs: dict[str, ForkedProcess] = {}
        self.incarnation: dict[str, int] = collections.Counter()
        self.killed: set[tuple[str, int]] = set()
        self.paused: set[tuple[str, int]] = set()
        self.restarts = 0

    def start(self, name: str) -> None:
        """``python -m tests.chaos.worker``, forked from the run's fork server
        (tests/chaos/forked.py): a restart after a kill costs no new interpreter."""
        self.incarnation[name] += 1
        cmd = [
            "--db-url",
            self.db_url,
            "--schema",
            self.schema,
            "--worker",
            name,
            "--incarnation",
            str(self.incarnation[name]),
            *self.worker_args,
        ]
        self.procs[name] = self.forker.start(
            cmd, self.workdir / f"{name}.log", {"PYTHONPATH": str(ROOT), **self.extra_env}
        )

    def start_all(self) -> None:
        for name in self.names:
            self.start(name)

    def kill_one(self) -> None:
        name = self.rng.choice(self.names)
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.killed.add((name, self.incarnation[name]))
        self.restarts += 1
        self.start(name)

    def pause_one(self, seconds: float) -> None:
        name = self.rng.choice(self.names)
        proc = self.procs[name]
        proc.send_signal(signal.SIGSTOP)
        self.paused.add((name, self.incarnation[name]))
        time.sleep(seconds)
        proc.send_signal(signal.SIGCONT)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.workdir.glob("*.log"))
        )


def wait_until(predicate: Callable[[], bool], timeout: float, step: float = 0.2) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def run_chaos(
    *,
    engine: sa.Engine,
    db_url: str,
    schema: str,
    store: CheckpointStore,
    state_args: list[str],
    env: dict[str, str],
    workdir: Path,
    seconds: float = 30,
    workers: int = 3,
    ttl: float = 1.5,
    seed: int = 4,
    subscribers: int = 0,
    max_concurrency: int = 1,
    min_chaos: int = 0,
    min_rows: int = 0,
    hang: Hang | None = None,
    retries: Retries | None = None,
) -> tuple[ChaosReport, str]:
    """Run the whole scenario; returns the report and the workers' log tails.

    ``min_chaos``: kills and freezes go on after the writer stopped (while the
    workers drain) until there were at least that many (bounded), so a loaded
    machine, whose steps take longer, still gets the chaos the test asserts;
    likewise the writer goes on until it inserted more than ``min_rows``.

    ``subscribers``: fan-out workers (``PollTrigger(subscribers=...)``) with
    that many subscribers, each of which must see every row state.
    ``max_concurrency`` > 1 runs every worker's batches as parallel lanes.
    ``hang``: fan-out calls outlive a short ack timeout, one subscriber now and
    then hangs past it (deaf to ``ctx.cancelled``) while the writer runs, and
    dead-lettered events go to a table: none may be dead-lettered for a
    subscriber that was not handed it ``max_attempts`` times.
    ``retries``: the handler asks to retry some events (``ctx.retry``), which
    pins the checkpoint while later events flow, in a small window, and the
    writer updates recent rows - often ones the window settled above a pinned
    retry (issue #20 item 1: such rows stalled the poller for good).
    """
    create_tables(engine, schema)
    grace = min(ttl / 2, 5.0)
    forker = Forker("tests.chaos.worker")
    chaos = Chaos(
        forker=forker,
        db_url=db_url,
        schema=schema,
        workdir=workdir,
        worker_args=[
            *state_args,
            "--ttl",
            str(ttl),
            "--slow-seconds",
            str(ttl * 1.7),
            "--slow-probability",
            "0.1",
            "--batch-size",
            "50",
            "--subscribers",
            str(subscribers),
            "--max-concurrency",
            str(max_concurrency),
            *(hang.worker_args(workdir) if hang is not None else []),
            *(retries.worker_args() if retries is not None else []),
        ],
        env=env,
        workers=workers,
        seed=seed,
    )
    monitor = Monitor(store)
    monitor.start()
    writer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.chaos.writer",
            "--db-url",
            db_url,
            "--schema",
            schema,
            "--seconds",
            str(seconds),
            "--seed",
            str(seed),
            "--pause",
            "0.03",
            "--min-rows",
            str(min_rows),
            *(retries.writer_args() if retries is not None else []),
        ],
        cwd=ROOT,
        env=chaos.env,
        stdout=subprocess.PIPE,
    )
    kills = pauses = 0
    chaos.start_all()
    cap = time.monotonic() + seconds + 120

    def more() -> bool:
        return writer.poll() is None or (kills + pauses < min_chaos and time.monotonic() < cap)

    try:
        while more():
            time.sleep(chaos.rng.uniform(1.0, 3.0))
            if not more():
                break
            if chaos.rng.random() < 0.7:
                chaos.kill_one()
                kills += 1
            else:
                chaos.pause_one(ttl + grace + 1.0)
                pauses += 1
        out, _ = writer.communicate(timeout=60)
        written = json.loads(out.decode().strip().splitlines()[-1])
        (workdir / DRAINING).touch()  # no more hangs (tests/chaos/worker.py --hang-until)

        with engine.connect() as conn:
            final_rows = int(
                conn.execute(sa.text(f'SELECT count(*) FROM "{schema}".items')).scalar_one()
            )
            target = conn.execute(
                sa.text(
                    f'SELECT version, id FROM "{schema}".items '
                    "ORDER BY version DESC, id DESC LIMIT 1"
                )
            ).one()
        goal = (int(target.version), int(target.id))
        drain_started = time.monotonic()
        drained = wait_until(
            lambda: bool(monitor.positions) and monitor.positions[-1] == goal, timeout=90
        )
        drain_seconds = time.monotonic() - drain_started
    finally:
        chaos.stop_all()
        forker.close()
        monitor.stop()
    if not drained:
        raise AssertionError(
            f"the workers did not drain to {goal} (last {monitor.positions[-1:]})\n{chaos.logs()}"
        )
    report = analyse(
        engine,
        schema,
        monitor,
        chaos,
        seconds=seconds,
        written=written,
        final_rows=final_rows,
        kills=kills,
        pauses=pauses,
        drain_seconds=drain_seconds,
        subscribers=[f"s{i + 1}" for i in range(subscribers)] or [""],
        max_attempts=hang.max_attempts if hang is not None else None,
    )
    return report, chaos.logs()


@dataclasses.dataclass(frozen=True)
class Hang:
    """Fan-out timeouts and a subscriber that hangs past them (see run_chaos)."""

    ack_timeout: float = 0.5
    subscriber: str = "s2"
    probability: float = 0.2
    seconds: float = 1.5
    max_attempts: int = 3
    retry_delay: float = 0.1
    #: Small batches: many ticks while a subscriber is busy.
    batch_size: int = 10

    def worker_args(self, workdir: Path) -> list[str]:
        return [
            "--batch-size",
            str(self.batch_size),
            "--hang-until",
            str(workdir / DRAINING),
            "--ack-timeout",
            str(self.ack_timeout),
            "--hang-subscriber",
            self.subscriber,
            "--hang-probability",
            str(self.probability),
            "--hang-seconds",
            str(self.seconds),
            "--dead-letter",
            "--max-attempts",
            str(self.max_attempts),
            "--retry-delay",
            str(self.retry_delay),
        ]


@dataclasses.dataclass(frozen=True)
class Retries:
    """Per-event retries in a small window, and updates of recent rows (see run_chaos)."""

    #: One row state in this many is retried on its first delivery.
    every: int = 25
    retry_delay: float = 0.5
    #: Small enough to reach its 75% mark while a retry pins the checkpoint
    #: (and above a batch, so no single batch overflows it).
    window_max_events: int = 40
    batch_size: int = 10
    #: The writer updates rows among the last this many ids.
    recent: int = 150

    def writer_args(self) -> list[str]:
        return ["--recent", str(self.recent)]

    def worker_args(self) -> list[str]:
        return [
            "--batch-size",
            str(self.batch_size),
            "--retry-every",
            str(self.every),
            "--retry-delay",
            str(self.retry_delay),
            "--window-max-events",
            str(self.window_max_events),
        ]


def analyse(
    engine: sa.Engine,
    schema: str,
    monitor: Monitor,
    chaos: Chaos,
    *,
    seconds: float,
    written: dict[str, int],
    final_rows: int,
    kills: int,
    pauses: int,
    drain_seconds: float,
    subscribers: list[str] | None = None,
    max_attempts: int | None = None,
) -> ChaosReport:
    q = f'"{schema}"'
    with engine.connect() as conn:
        timed_out = {
            (str(r.batch_id), str(r.subscriber))
            for r in conn.execute(sa.text(f"SELECT batch_id, subscriber FROM {q}.timeouts"))
        }
        dead = (
            conn.execute(sa.text(f"SELECT pk_json, cursor_json, error FROM {q}.dead_letters")).all()
            if sa.inspect(conn).has_table("dead_letters", schema=schema)
            else []
        )
        final = {
            (int(r.id), int(r.version))
            for r in conn.execute(sa.text(f"SELECT id, version FROM {q}.items"))
        }
        seen_rows = conn.execute(
            sa.text(
                "SELECT item_id, version, worker, incarnation, batch_id, token, subscriber, "
                f"retried FROM {q}.seen ORDER BY n"
            )
        ).all()
        outcome_rows = conn.execute(sa.text(f"SELECT batch_id, outcome FROM {q}.outcomes")).all()
        fence_rejections = int(
            conn.execute(sa.text(f"SELECT count(*) FROM {q}.fence_rejections")).scalar_one()
        )

    seen_states = {(int(r.item_id), int(r.version)) for r in seen_rows}
    # Every subscriber (fan-out) must have been handed every final row state
    # itself, in a delivery it did not ask to retry.
    lost = sum(
        len(
            final
            - {
                (int(r.item_id), int(r.version))
                for r in seen_rows
                if r.subscriber == sub and not r.retried
            }
        )
        for sub in subscribers or [""]
    )

    lost_cases: list[str] = []
    if lost:
        dead_versions: dict[int, list[str]] = collections.defaultdict(list)
        for row in dead:
            item = int(json.loads(row.pk_json)["id"])
            dead_versions[item].append(f"v{json.loads(row.cursor_json)}: {row.error}")
        for sub in subscribers or [""]:
            mine = [r for r in seen_rows if r.subscriber == sub]
            got = {(int(r.item_id), int(r.version)) for r in mine if not r.retried}
            for item, version in sorted(final - got)[: 20 - len(lost_cases)]:
                handed_versions = sorted(
                    (int(r.version), bool(r.retried), str(r.batch_id))
                    for r in mine
                    if int(r.item_id) == item
                )
                lost_cases.append(
                    f"{sub or 'handler'} never handed ({item}, {version}); handed "
                    f"{handed_versions}; dead-lettered {dead_versions.get(item, [])}"
                )

    regressions = sum(
        1 for a, b in zip(monitor.positions, monitor.positions[1:], strict=False) if b < a
    )

    # The commit history, reconstructed from the journal: a stale commit would
    # either carry a token lower than an earlier commit's, or not start where
    # the previous commit ended.
    commits = [monitor.commits[b] for b in monitor.order]
    stale_accepted = chain_breaks = 0
    max_token = 0
    previous_to: tuple[int, int] = (-1, -1)
    for entry in commits:
        token = int(entry["fencing_token"])
        if token < max_token:
            stale_accepted += 1
        max_token = max(max_token, token)
        if position_key(entry["from"]) != previous_to:
            chain_breaks += 1
        previous_to = position_key(entry["to"])
    committed = set(monitor.order)
    outcome_of: dict[str, str] = {}
    for row in outcome_rows:
        if row.batch_id:
            outcome_of[str(row.batch_id)] = str(row.outcome)
    stale_accepted += sum(1 for b, o in outcome_of.items() if o == "lost" and b in committed)

    batch_owner = {str(r.batch_id): (str(r.worker), int(r.incarnation)) for r in seen_rows}
    by_state: dict[tuple[str, int, int], list[str]] = collections.defaultdict(list)
    asked: collections.Counter[tuple[str, int, int]] = collections.Counter()
    for r in seen_rows:
        state_of = (str(r.subscriber), int(r.item_id), int(r.version))
        if r.retried:  # the handler asked for it again: that delivery does not count
            asked[state_of] += 1
            continue
        by_state[state_of].append(str(r.batch_id))
    duplicates_asked = sum(asked.values())
    windows: collections.Counter[str] = collections.Counter()
    duplicates = duplicates_asked
    if duplicates_asked:
        windows["R the handler asked to retry it (ctx.retry)"] = duplicates_asked
    cases: list[str] = []
    for state, delivered in by_state.items():
        # A delivery to a subscriber whose call outlived its ack timeout does
        # not count for it (its batch still commits the others' outcomes): the
        # event comes to it again (or, after max_attempts, is dead-lettered).
        late = [b for b in delivered if (b, state[0]) in timed_out]
        batches = [b for b in delivered if (b, state[0]) not in timed_out]
        if not batches:
            batches, late = late[-1:], late[:-1]
        if late:
            duplicates += len(late)
            windows["W8 subscriber outlived its ack timeout"] += len(late)
        # One delivery is the one that counts: the committed one (or, for a
        # state still in flight at the end, the last). Every other delivery is
        # a duplicate, explained by what happened to *its own* batch - which
        # may come after the committed one (a frozen owner resuming, W4).
        kept = next((b for b in batches if b in committed), batches[-1])
        extras = list(batches)
        extras.remove(kept)
        for extra in extras:
            duplicates += 1
            window = classify(extra, committed, outcome_of, batch_owner, chaos)
            windows[window] += 1
            if window.startswith("unexplained") and len(cases) < 20:
                cases.append(
                    f"item {state}: kept {kept} by {batch_owner.get(kept)}, also {extra} by "
                    f"{batch_owner.get(extra)} ({outcome_of.get(extra)})"
                )
    unexplained = sum(n for w, n in windows.items() if w.startswith("unexplained"))

    # Attempts count deliveries to that subscriber only: a row state is
    # dead-lettered as exhausted only once some subscriber it names was
    # handed it max_attempts times (issue #20 item 4).
    handed = collections.Counter(
        (str(r.subscriber), int(r.item_id), int(r.version)) for r in seen_rows
    )
    unearned: list[str] = []
    for row in dead:
        item = int(json.loads(row.pk_json)["id"])  # bigint keys and cursors: plain JSON
        version = int(json.loads(row.cursor_json))
        names = [part.split(": ", 1)[0] for part in str(row.error).split(": ", 1)[-1].split("; ")]
        counts = {n: handed[(n, item, version)] for n in names}
        if max_attempts is not None and max(counts.values(), default=0) < max_attempts:
            unearned.append(f"item ({item}, {version}): {row.error} after deliveries {counts}")

    counts = collections.Counter(outcome_of.values())
    return ChaosReport(
        seconds=seconds,
        workers=len(chaos.names),
        rows_inserted=written["inserted"],
        row_updates=written["updated"],
        final_rows=final_rows,
        kills=kills,
        pauses=pauses,
        restarts=chaos.restarts,
        deliveries=len(seen_rows),
        row_states_seen=len(seen_states),
        superseded_unseen_w7=written["inserted"] + written["updated"] - len(seen_states),
        duplicates=duplicates,
        duplicate_windows=dict(sorted(windows.items())),
        unexplained_duplicates=unexplained,
        unexplained_cases=cases,
        lost=lost,
        lost_cases=lost_cases,
        ack_timeouts=len(timed_out),
        dead_letters=len(dead),
        unearned_dead_letters=len(unearned),
        unearned_cases=unearned[:10],
        checkpoint_regressions=regressions,
        commits=len(commits),
        chain_breaks=chain_breaks,
        stale_commits_accepted=stale_accepted,
        max_fencing_token=max(monitor.tokens, default=0),
        lost_lease_outcomes=counts["lost"],
        commit_failed_outcomes=counts["commit_failed"],
        other_error_outcomes=counts["error"],
        fence_rejections=fence_rejections,
        monitor_reads=monitor.reads,
        drain_seconds=round(drain_seconds, 1),
    )


def classify(
    batch_id: str,
    committed: set[str],
    outcome_of: dict[str, str],
    batch_owner: dict[str, tuple[str, int]],
    chaos: Chaos,
) -> str:
    """Which duplicate window explains that ``batch_id`` was delivered again."""
    if batch_id in committed:
        return "unexplained: one row state in two committed batches"
    outcome = outcome_of.get(batch_id)
    owner = batch_owner.get(batch_id)
    if outcome == "lost":
        return "W4 lease lost (heartbeat/commit rejected)"
    if outcome == "commit_failed":
        return "W1/W5 commit failed or ambiguous"
    if owner in chaos.killed:
        return "W2/W3/W6 worker killed mid-batch"
    if owner in chaos.paused:
        return "W4 worker frozen past its lease"
    if outcome is not None:
        return f"W1 tick failed ({outcome})"
    return "unexplained: no failure recorded"
