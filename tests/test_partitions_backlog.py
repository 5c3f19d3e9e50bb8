"""The scale signal: backlog per partition and poller, ``partitions backlog``, the HTTP
endpoint KEDA's ``metrics-api`` scaler reads, and the documented KEDA manifests."""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dbtrigger import FileCheckpointStore, SqlAlchemySource
from dbtrigger.cli import main
from dbtrigger.cli.main import build_parser
from dbtrigger.errors import ConfigurationError, FetchError
from dbtrigger.metrics import InMemoryMetrics
from dbtrigger.partitions import PartitionedPoller, bucket_of
from dbtrigger.partitions.backlog import Backlog, PartitionBacklog, measure_backlog
from dbtrigger.partitions.endpoint import BacklogCache, BacklogServer, parse_address
from tests.databases import TestDatabase

ROOT = Path(__file__).resolve().parent.parent
NOW = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.timezone.utc)


def backlog(*rows: int | None) -> Backlog:
    return Backlog(
        "orders",
        NOW,
        2,
        tuple(PartitionBacklog(f"p{i}", r, None, None) for i, r in enumerate(rows)),
    )


@pytest.mark.parametrize(
    ("rows", "target", "desired"),
    [
        ((0, 0, 0, 0), 1000, 0),
        ((1, 0, 0, 0), 1000, 1),
        ((1000, 0, 0, 0), 1000, 1),
        ((1000, 1, 0, 0), 1000, 2),
        ((3000, 3000, 3000, 0), 1000, 4),  # never more replicas than partitions
        ((9000,) * 12, 100, 12),
        ((None, 0, 0, 0), 1000, 1),  # a partition that could not be counted is not "idle"
        ((500, 500, 500, 500), 250, 4),
    ],
)
def test_desired_replicas_is_min_partitions_ceil_backlog_over_target(
    rows: tuple[int | None, ...], target: int, desired: int
) -> None:
    assert backlog(*rows).desired_replicas(target) == desired


def test_a_target_below_one_row_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="at least 1 row"):
        backlog(1).desired_replicas(0)


# --- a real backlog ----------------------------------------------------------------


@pytest.fixture
def orders(pg: TestDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A PostgreSQL table with a timestamp cursor, 4 partitions, one partition
    drained by a member; importable as ``<module>:orders``."""
    table = pg.qualified("orders")
    pg.execute(f"CREATE TABLE {table} (id INTEGER PRIMARY KEY, updated_at TIMESTAMPTZ NOT NULL)")
    pg.execute(
        f"INSERT INTO {table} SELECT g, now() - (1000 - g) * interval '1 second' "
        "FROM generate_series(1, 800) g"
    )
    poller = PartitionedPoller(
        name="orders",
        source=SqlAlchemySource(
            url=pg.url,
            table="orders",
            schema=pg.schema,
            cursor_column="updated_at",
            pk_columns=["id"],
            visibility="none",
        ),
        checkpoint_store=FileCheckpointStore(tmp_path / "state"),
        partitions=4,
        join_window_seconds=0,
        background=False,
        batch_size=50,
        max_batches_per_tick=100,
    )
    poller.balance()
    drained = poller.owned[0]
    seen: list[int] = []
    poller.trigger(drained).drain(lambda events: seen.extend(e.pk["id"] for e in events))
    module = f"backlog_app_{uuid.uuid4().hex[:8]}"
    mod = type(sys)(module)
    mod.orders = poller  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module, mod)
    monkeypatch.chdir(tmp_path)
    yield module, poller, drained, set(seen)
    poller.source.close()


def truth(poller: PartitionedPoller, delivered: set[int]) -> dict[str, int]:
    """Rows behind per partition, computed in Python from the bucket hash."""
    doc = poller.membership
    assert doc is not None
    out = {}
    for p in doc.partitions:
        out[p.id] = sum(
            1 for key in range(1, 801) if p.lo <= bucket_of([key]) < p.hi and key not in delivered
        )
    return out


def test_backlog_counts_each_partition_and_ages_the_oldest(orders: Any) -> None:
    _, poller, drained, delivered = orders
    measured = measure_backlog(poller)
    expected = truth(poller, delivered)
    assert {p.id: p.rows for p in measured.partitions} == expected
    assert expected[drained] == 0
    assert measured.rows == 800 - len(delivered)
    # The oldest undelivered row is about 1000 s old (timestamps count up to now - 200 s).
    assert measured.oldest_seconds is not None
    assert 900 < measured.oldest_seconds < 1200
    metrics = InMemoryMetrics()
    measured.report(metrics, target_rows=100)
    assert metrics.gauge("backlog_rows", poller="orders") == measured.rows
    assert metrics.gauge("backlog_desired_replicas", poller="orders") == 4
    assert metrics.gauge("partition_backlog_rows", poller="orders", partition=drained) == 0


def test_partitions_backlog_json_matches_the_table(
    orders: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    module, poller, _, delivered = orders
    assert main(["partitions", "backlog", "--trigger", f"{module}:orders", "--target", "200"]) == 0
    text = capsys.readouterr().out
    argv = ["partitions", "backlog", "--trigger", f"{module}:orders", "--json", "--target", "200"]
    assert main(argv) == 0
    shown = json.loads(capsys.readouterr().out)
    table = {
        line.split()[0]: int(line.split()[1])
        for line in text.splitlines()
        if re.match(r"\s+p\d{3}-\d{3}\s", line)
    }
    assert table == {p["id"]: p["rows"] for p in shown["partitions"]} == truth(poller, delivered)
    assert f"{shown['backlog_rows']:,} rows behind" in text
    # About 1000 s: said as "16m 40s", not "1000.3s".
    assert re.search(r", the oldest 1[5-9]m( \d+s)? old;", text), text
    rows = shown["backlog_rows"]
    assert shown["desired_replicas"] == min(4, math.ceil(rows / 200))
    assert f"desired replicas {shown['desired_replicas']}" in text


def get(url: str) -> tuple[int, str, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:  # noqa: S310 - our server
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read()


def documented_json() -> dict[str, Any]:
    text = (ROOT / "docs" / "scale-out.md").read_text()
    block = re.search(r"```json\n(\{\n  \"poller\".*?)\n```", text, re.S)
    assert block is not None, "docs/scale-out.md shows the endpoint's JSON"
    documented: dict[str, Any] = json.loads(block[1])
    return documented


def test_the_endpoint_returns_the_documented_json_for_a_real_backlog(orders: Any) -> None:
    _, poller, _, delivered = orders
    measured: list[int] = []

    def measure() -> Backlog:
        measured.append(1)
        return measure_backlog(poller)

    server = BacklogServer(
        ("127.0.0.1", 0), BacklogCache(measure, min_interval=60), target_rows=100
    )
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        status, kind, body = get(f"{server.url}/backlog")
        assert (status, kind) == (200, "application/json")
        got = json.loads(body)
        documented = documented_json()
        assert set(got) == set(documented)
        assert set(got["partitions"][0]) == set(documented["partitions"][0])
        for key, value in documented.items():
            if value is not None:
                assert isinstance(got[key], type(value)), key
        assert got["backlog_rows"] == sum(truth(poller, delivered).values())
        assert got["desired_replicas"] == min(4, math.ceil(got["backlog_rows"] / 100))
        assert got["partition_count"] == 4
        status, _, body = get(f"{server.url}/backlog?target=100000")
        assert json.loads(body)["desired_replicas"] == 1
        assert len(measured) == 1  # the second request was served from the cache
        status, kind, body = get(f"{server.url}/metrics")
        assert status == 200
        assert kind.startswith("text/plain")
        assert f'dbtrigger_backlog_rows{{poller="orders"}} {got["backlog_rows"]}' in body.decode()
        assert get(f"{server.url}/healthz")[:1] == (200,)
        assert get(f"{server.url}/backlog?target=0")[0] == 400
        assert get(f"{server.url}/nope")[0] == 404
    finally:
        server.shutdown()
        thread.join()
        server.server_close()


def test_a_failing_measurement_answers_503_without_the_password() -> None:
    def measure() -> Backlog:
        raise FetchError("could not connect to postgresql://app:s3cret@db:5432/shop")

    server = BacklogServer(("127.0.0.1", 0), BacklogCache(measure), target_rows=100)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        status, _, body = get(f"{server.url}/backlog")
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
    assert status == 503
    assert "FetchError" in json.loads(body)["error"]
    assert b"s3cret" not in body


def test_partitions_backlog_serve_answers_a_real_http_client(orders: Any, tmp_path: Path) -> None:
    """The CLI's server in its own process, as the documented Deployment runs it."""
    module, poller, _, delivered = orders
    (tmp_path / f"{module}.py").write_text(
        "from dbtrigger import FileCheckpointStore, SqlAlchemySource\n"
        "from dbtrigger.partitions import PartitionedPoller\n"
        "orders = PartitionedPoller(\n"
        f"    name='orders', partitions=4,\n"
        f"    source=SqlAlchemySource(url={poller.source._db_url.spec!r}, table='orders',\n"
        f"        schema={poller.source.describe().get('schema')!r},\n"
        "        cursor_column='updated_at', pk_columns=['id'], visibility='none'),\n"
        f"    checkpoint_store=FileCheckpointStore({str(tmp_path / 'state')!r}),\n"
        ")\n"
    )
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dbtrigger.cli",
            "partitions",
            "backlog",
            "--trigger",
            f"{module}:orders",
            "--serve",
            "127.0.0.1:0",
        ],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        assert found is not None, line + (proc.stderr.read() if proc.stderr else "")
        status, _, body = get(f"{found[1]}/backlog")
        assert status == 200
        got = json.loads(body)
        assert got["backlog_rows"] == sum(truth(poller, delivered).values())
        assert got["desired_replicas"] == 1  # the default target: 1,000 rows per replica
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


# --- the documented KEDA manifests -----------------------------------------------------


def manifests() -> list[dict[str, Any]]:
    text = (ROOT / "docs" / "scale-out.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    docs = [d for block in blocks for d in yaml.safe_load_all(block) if d]
    assert docs, "docs/scale-out.md has the Kubernetes manifests"
    return docs


def test_the_documented_keda_scaled_object_is_valid_and_wired_to_the_endpoint() -> None:
    docs = manifests()
    kinds = Counter(d["kind"] for d in docs)
    assert kinds == {"Deployment": 2, "Service": 1, "ScaledObject": 1}
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for d in docs:
        assert isinstance(d["metadata"]["name"], str)
        by_kind.setdefault(d["kind"], []).append(d)
    (scaled,) = by_kind["ScaledObject"]
    (service,) = by_kind["Service"]
    deployments = {d["metadata"]["name"]: d for d in by_kind["Deployment"]}
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert set(spec) <= {
        "scaleTargetRef",
        "minReplicaCount",
        "maxReplicaCount",
        "pollingInterval",
        "cooldownPeriod",
        "triggers",
        "fallback",
        "advanced",
    }
    worker = deployments[spec["scaleTargetRef"]["name"]]
    assert worker["apiVersion"] == "apps/v1"
    (container,) = worker["spec"]["template"]["spec"]["containers"]
    assert container["command"][:2] == ["dbtrigger", "run"]
    parser = build_parser()
    assert parser.parse_args(container["command"][1:]).func.__name__ == "cmd_run"
    assert (
        worker["spec"]["selector"]["matchLabels"].items()
        <= worker["spec"]["template"]["metadata"]["labels"].items()
    )
    assert isinstance(spec["minReplicaCount"], int)
    assert spec["maxReplicaCount"] >= 1
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "metrics-api"
    assert trigger["metricType"] == "AverageValue"
    meta = trigger["metadata"]
    assert all(isinstance(v, str) for v in meta.values()), "KEDA metadata values are strings"
    assert meta["format"] == "json"
    assert meta["targetValue"] == "1"
    assert meta["valueLocation"] in documented_json()
    url = urllib.parse.urlsplit(meta["url"])
    assert url.path == "/backlog"
    assert url.hostname is not None
    assert url.hostname.split(".")[0] == service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert url.port == port["port"]
    served = [
        d
        for d in deployments.values()
        if service["spec"]["selector"].items()
        <= d["spec"]["template"]["metadata"]["labels"].items()
    ]
    (backlog_deployment,) = served
    (server,) = backlog_deployment["spec"]["template"]["spec"]["containers"]
    args = parser.parse_args(server["command"][1:])
    assert args.func.__name__ == "cmd_backlog"
    assert args.serve.rsplit(":", 1)[1] == str(port["targetPort"])
    assert args.trigger == parser.parse_args(container["command"][1:]).trigger[0]
    assert backlog_deployment["spec"]["replicas"] == 1
    assert spec["maxReplicaCount"] == 12  # the app's partitions: more would idle


def test_a_serve_address_that_cannot_be_bound_is_a_configuration_error() -> None:
    """A port over 65535 raised OverflowError, an address of another host or a port
    in use OSError, each as a traceback out of ``partitions backlog --serve``."""
    cache = BacklogCache(lambda: pytest.fail("measured"))  # type: ignore[arg-type,return-value]
    with pytest.raises(ConfigurationError, match="HOST:PORT"):
        parse_address("127.0.0.1:99999")
    with pytest.raises(ConfigurationError, match="cannot serve"):
        BacklogServer(("127.0.0.1", 99999), cache)
    with pytest.raises(ConfigurationError, match="cannot serve"):
        BacklogServer(("192.0.2.1", 0), cache)  # TEST-NET-1: not an address of this host
    taken = BacklogServer(("127.0.0.1", 0), cache)
    try:
        with pytest.raises(ConfigurationError, match="cannot serve"):
            BacklogServer(("127.0.0.1", taken.server_address[1]), cache)
    finally:
        taken.server_close()
