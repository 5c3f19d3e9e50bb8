"""The comparison package, azure-functions-db (the runtime contract's origin): its
version, an in-memory state store following its blob store's algorithm, a drain
through its ``PollTrigger``, and its own blob store on Azurite. Kept apart from
:mod:`benchmarks.common` so that the scripts which do not compare with it never
touch it (it is optional: ``afdb_version()`` is None without it).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.common import Dataset, noop_handler


def afdb_version() -> str | None:
    """The installed azure-functions-db version, or None when it is not installed."""
    try:
        import azure_functions_db  # noqa: PLC0415 - optional comparison package
    except ImportError:
        return None
    return str(azure_functions_db.__version__)


class AfdbMemoryStateStore:
    """azure-functions-db's ``StateStore`` protocol kept in memory.

    The package ships only a blob-backed store; this one follows the same
    algorithm (a JSON document per poller, read-modify-write on every lease and
    checkpoint call, owner and fencing-token checks) without the network, so the
    in-memory comparison is like for like with ``InMemoryCheckpointStore``.
    """

    def __init__(self) -> None:
        self._docs: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self.reads = 0
        self.writes = 0

    def _read(self, poller: str) -> dict[str, Any] | None:
        self.reads += 1
        raw = self._docs.get(poller)
        return None if raw is None else dict(json.loads(raw))

    def _write(self, poller: str, state: dict[str, Any]) -> None:
        self.writes += 1
        self._docs[poller] = json.dumps(state, indent=2).encode()

    @staticmethod
    def _lease_id(lease_id: str) -> tuple[str, int]:
        owner, token = lease_id.rsplit(":", 1)
        return owner, int(token)

    def _verify(self, state: dict[str, Any] | None, lease_id: str) -> dict[str, Any]:
        from azure_functions_db import LostLeaseError  # noqa: PLC0415

        owner, token = self._lease_id(lease_id)
        lease = (state or {}).get("lease") or {}
        if state is None or lease.get("owner_id") != owner or lease.get("fencing_token") != token:
            raise LostLeaseError("lease is not ours")
        return state

    def acquire_lease(self, poller_name: str, ttl_seconds: int) -> str:
        from azure_functions_db.state.errors import LeaseConflictError  # noqa: PLC0415

        with self._lock:
            now = time.time()
            state = self._read(poller_name) or {"checkpoint": {}, "lease": {}}
            lease = state.get("lease") or {}
            # Like its blob store: a lease is free only after expiry plus a grace
            # period, min(ttl / 2, 5 s), and a release only moves expiry to now.
            grace = min(ttl_seconds * 0.5, 5.0)
            if lease and now <= lease.get("expires_at", 0) + grace:
                raise LeaseConflictError("lease held")
            token = int(lease.get("fencing_token", 0)) + 1
            owner = uuid.uuid4().hex
            state["lease"] = {
                "owner_id": owner,
                "fencing_token": token,
                "expires_at": now + ttl_seconds,
            }
            self._write(poller_name, state)
            return f"{owner}:{token}"

    def renew_lease(self, poller_name: str, lease_id: str, ttl_seconds: int) -> None:
        with self._lock:
            state = self._verify(self._read(poller_name), lease_id)
            state["lease"]["expires_at"] = time.time() + ttl_seconds
            self._write(poller_name, state)

    def release_lease(self, poller_name: str, lease_id: str) -> None:
        with self._lock:
            state = self._verify(self._read(poller_name), lease_id)
            state["lease"]["expires_at"] = time.time()
            self._write(poller_name, state)

    def load_checkpoint(self, poller_name: str) -> dict[str, object]:
        with self._lock:
            state = self._read(poller_name)
            return dict((state or {}).get("checkpoint") or {})

    def commit_checkpoint(
        self, poller_name: str, checkpoint: dict[str, object], lease_id: str
    ) -> None:
        with self._lock:
            state = self._verify(self._read(poller_name), lease_id)
            state["checkpoint"] = dict(checkpoint)
            self._write(poller_name, state)


def afdb_drain(
    ds: Dataset,
    batch: int,
    store: Any,
    *,
    poller: str = "bench",
    handler: Callable[[Sequence[Any]], None] = noop_handler,
) -> int:
    """Drain the table through azure-functions-db's public ``PollTrigger``; returns rows.

    One tick drains the whole table (``max_batches_per_tick`` is unbounded and
    the lease is renewed before every batch); the loop ends at the first tick
    that delivers nothing, which for this package includes "lease released less
    than the grace period ago".
    """
    import azure_functions_db as afdb  # noqa: PLC0415 - optional comparison package

    source = afdb.SqlAlchemySource(
        url=ds.url,
        table=ds.table,
        schema=ds.schema,
        cursor_column="updated_at",
        pk_columns=["id"],
    )
    try:
        trigger = afdb.PollTrigger(
            name=poller,
            source=source,
            checkpoint_store=store,
            batch_size=batch,
            max_batches_per_tick=1_000_000,
        )
        total = 0
        while True:
            got = trigger.run(timer=None, handler=handler)
            total += got
            if got == 0:
                return total
    finally:
        source.dispose()


def afdb_blob_store(az: Any, ds: Dataset, container: str) -> Any:
    """azure-functions-db's own ``BlobCheckpointStore`` on Azurite (fresh container)."""
    import azure_functions_db as afdb  # noqa: PLC0415
    from azure.storage.blob import ContainerClient  # noqa: PLC0415

    client = ContainerClient.from_connection_string(az.connection_string, container)
    client.create_container()
    fingerprint = afdb.SqlAlchemySource(
        url=ds.url, table=ds.table, schema=ds.schema, cursor_column="updated_at", pk_columns=["id"]
    ).source_descriptor.fingerprint
    return afdb.BlobCheckpointStore(container_client=client, source_fingerprint=fingerprint)
