"""Claim-source harnesses: a queue table in columns mode and in sidecar mode.

Both queue rows ``(id integer primary key, payload)``; ``put`` commits before
it returns, so the rows are claimable at once (a sidecar harness also runs
the feeder that copies them into the claims table).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from dbtrigger import ClaimSource, InMemoryCheckpointStore
from dbtrigger.queue import SidecarFeeder, ddl
from dbtrigger.queue.sidecar_table import install_claims_table
from tests.databases import TestDatabase

CLAIMS = "dbtrigger_claims"


class ColumnsHarness:
    """The claim columns on the queue table itself (``mode="columns"``)."""

    def __init__(self, db: TestDatabase) -> None:
        self.db = db
        db.execute(
            f"CREATE TABLE {db.qualified('jobs')} (id integer PRIMARY KEY, payload varchar(40))"
        )
        with db.engine.begin() as conn:
            table = sa.Table("jobs", sa.MetaData(), schema=db.schema, autoload_with=conn)
            ddl.apply(conn, ddl.install_columns(conn, table))

    def put(self, ids: Sequence[int]) -> None:
        if ids:
            self.db.execute(
                f"INSERT INTO {self.db.qualified('jobs')} (id, payload) VALUES (:i, :p)",
                [{"i": i, "p": f"job {i}"} for i in ids],
            )

    def open(self) -> ClaimSource:
        return ClaimSource(url=self.db.url, table="jobs", schema=self.db.schema, pk_columns=["id"])


class SidecarHarness:
    """The user table untouched, a claims table filled by a feeder (``mode="sidecar"``)."""

    def __init__(self, db: TestDatabase) -> None:
        self.db = db
        db.execute(
            f"CREATE TABLE {db.qualified('items')} "
            "(id integer PRIMARY KEY, version bigint NOT NULL, payload varchar(40))"
        )
        with db.engine.begin() as conn:
            ddl.apply(conn, install_claims_table(conn, CLAIMS, db.schema))
        self._feeder_source = self.open()
        self.feeder = SidecarFeeder(
            name="contract-feeder",
            source=self._feeder_source,
            checkpoint_store=InMemoryCheckpointStore(),
        )

    def put(self, ids: Sequence[int]) -> None:
        if not ids:
            return
        self.db.execute(
            f"INSERT INTO {self.db.qualified('items')} (id, version, payload) VALUES (:i, :i, :p)",
            [{"i": i, "p": f"item {i}"} for i in ids],
        )
        self.feeder.drain()

    def open(self) -> ClaimSource:
        return ClaimSource(
            url=self.db.url,
            table="items",
            schema=self.db.schema,
            pk_columns=["id"],
            mode="sidecar",
            cursor_column="version",
        )

    def close(self) -> None:
        self.feeder.close()
        self._feeder_source.close()
