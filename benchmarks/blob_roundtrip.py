"""Round-trip time of BlobCheckpointStore reads and conditional writes on Azurite.

Run from the repository root::

    python -m benchmarks.blob_roundtrip            # starts a private Azurite
    python -m benchmarks.blob_roundtrip --iterations 500

Each operation is timed next to the same request made with the bare
azure-storage-blob SDK in the same run, so the adapter's own overhead (error
translation, path validation, one extra dict) shows as a ratio rather than as
an absolute figure that depends on the machine. The document is a realistic
state document (checkpoint, lease, a 20-entry journal: about 2.5 KB).

Set ``DBTRIGGER_BENCH_STORAGE`` to a connection string to measure a real
storage account instead of Azurite.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import os
import statistics
import time
import uuid
from collections.abc import Callable, Iterator

from azure.core import MatchConditions
from azure.storage.blob import BlobServiceClient

from dbtrigger.cursor import Position
from dbtrigger.state import document as docmod
from dbtrigger.state import lease as leasemod
from dbtrigger.state.stores.blob import BlobCheckpointStore


def state_document() -> bytes:
    now = dt.datetime(2026, 4, 7, 1, 0, tzinfo=dt.timezone.utc)
    acquired = leasemod.decide_acquire(
        None,
        poller="orders",
        fingerprint="sha256:" + "0" * 64,
        owner="host/1/abc",
        now=now,
        ttl=dt.timedelta(seconds=120),
    )
    assert isinstance(acquired, leasemod.Acquired)
    doc = acquired.document
    for i in range(20):
        doc = leasemod.decide_commit(
            doc,
            owner="host/1/abc",
            token=acquired.fencing_token,
            position=Position(cursor=now + dt.timedelta(seconds=i), pk={"id": i * 100}),
            batch_id=f"batch_{i}",
            row_count=100,
            now=now + dt.timedelta(seconds=i),
            ttl=dt.timedelta(seconds=120),
            release=False,
            journal_entry={"type": "commit", "batch_id": f"batch_{i}", "rows": 100},
            journal_limit=20,
        )
    return docmod.dumps(doc)


@contextlib.contextmanager
def storage() -> Iterator[str]:
    configured = os.environ.get("DBTRIGGER_BENCH_STORAGE")
    if configured:
        yield configured
        return
    from tests.azurite import start_azurite  # noqa: PLC0415 - reuse the test suite's launcher

    with contextlib.contextmanager(start_azurite)() as running:
        yield running.connection_string


def timings(fn: Callable[[], object], iterations: int) -> list[float]:
    for _ in range(5):  # warm the connection pool
        fn()
    out = []
    for _ in range(iterations):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1000)
    return out


def summary(values: list[float]) -> str:
    ordered = sorted(values)
    p90 = ordered[int(0.9 * (len(ordered) - 1))]
    p99 = ordered[int(0.99 * (len(ordered) - 1))]
    return f"median {statistics.median(values):6.2f} ms   p90 {p90:6.2f} ms   p99 {p99:6.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200)
    args = parser.parse_args()
    data = state_document()
    with storage() as conn:
        container = f"bench{uuid.uuid4().hex[:16]}"
        service = BlobServiceClient.from_connection_string(conn)
        service.create_container(container)
        try:
            store = BlobCheckpointStore.from_connection_string(
                conn, app_name="bench", container=container
            )
            raw = service.get_blob_client(container, "raw/orders.json")
            etag = store.write("orders", data, if_match=None)
            raw_etag = raw.upload_blob(data, overwrite=True)["etag"]

            def store_write() -> None:
                nonlocal etag
                etag = store.write("orders", data, if_match=etag)

            def raw_write() -> None:
                nonlocal raw_etag
                raw_etag = raw.upload_blob(
                    data,
                    overwrite=True,
                    etag=raw_etag,
                    match_condition=MatchConditions.IfNotModified,
                )["etag"]

            rows = [
                (
                    "read",
                    timings(lambda: store.read("orders"), args.iterations),
                    timings(lambda: raw.download_blob().readall(), args.iterations),
                ),
                (
                    "conditional write",
                    timings(store_write, args.iterations),
                    timings(raw_write, args.iterations),
                ),
            ]
            print(f"state document: {len(data)} bytes, {args.iterations} iterations each")
            for name, ours, bare in rows:
                ratio = statistics.median(ours) / statistics.median(bare)
                print(f"{name:18} store: {summary(ours)}")
                print(f"{'':18} bare SDK: {summary(bare)}   store/bare {ratio:.2f}x")
            store.close()
        finally:
            service.delete_container(container)


if __name__ == "__main__":
    main()
