"""A poller's history as entities of the Table Storage state table.

Entities sit in the state store's own table, in a partition of their own per
poller (``{app}.history.{poller}``; the state entities are in partition
``{app}``, which is all ``list_keys`` reads). RowKey is ``10**12 - seq``,
zero-padded, so the service's ascending order is newest first and the tail is
the first page of a query. The record's JSON is split over string properties
``rec_0``... as the state store splits documents. An append is one entity
transaction of create operations after reading the newest number: a second
writer of the same number gets ``EntityAlreadyExists`` and stores nothing.
"""

from __future__ import annotations

import datetime as dt
import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from azure.data.tables import TableClient

from dbtrigger import _azure_errors as azure_errors
from dbtrigger.history.store import (
    DEFAULT_RETENTION,
    Retention,
    decoded_row,
    expect_end,
    row_texts,
)
from dbtrigger.names import validate_name
from dbtrigger.state.document import format_time
from dbtrigger.state.stores.table import split_text

_TOP = 10**12
#: Operations one entity transaction may carry.
_BATCH = 100


def row_key(seq: int) -> str:
    return f"{_TOP - seq:012d}"


class TableHistory:
    """History entities beside the state entities of one table.

    ``credential`` gives a refusal's words for the credential (the state
    store's: the app setting it was read from, its SAS's expiry); by default
    they are read from the client.
    """

    def __init__(
        self,
        client: TableClient | Callable[[], TableClient],
        *,
        app: str,
        retention: Retention = DEFAULT_RETENTION,
        credential: Callable[[], str] | None = None,
    ) -> None:
        #: How long the runtime keeps records here (it prunes after its appends).
        self.retention = retention
        self._client = client
        self.app = validate_name(app, "app name")
        self._credential = credential or (lambda: azure_errors.credential_words(self.client, None))

    @property
    def client(self) -> TableClient:
        value = self._client
        return value if isinstance(value, TableClient) else value()

    def describe(self) -> str:
        try:
            url = str(self.client.url).split("?", 1)[0]
        except Exception:  # noqa: BLE001 - describe never raises
            url = "(unresolved)"
        return f"table:{url.rstrip('/')} partition={self.app}.history.*"

    def _partition(self, poller: str) -> str:
        return f"{self.app}.history.{validate_name(poller, 'poller name')}"

    def _mapped(self, op: str, poller: str, *, write: bool = False) -> Any:
        return azure_errors.mapped(
            azure_errors.TABLE,
            f"{op} of the history of {poller!r} in {self.describe()}",
            write=write,
            credential=self._credential,
        )

    def _record(self, entity: Mapping[str, Any]) -> dict[str, Any]:
        parts = int(entity.get("rec_parts") or 0)
        text = "".join(str(entity.get(f"rec_{i}") or "") for i in range(parts))
        return decoded_row(text, int(entity.get("seq") or 0), self.describe)

    def _query(
        self, poller: str, *, below_key: str | None = None, top: int | None = None
    ) -> Iterator[Mapping[str, Any]]:
        filter_text = "PartitionKey eq @pk"
        params: dict[str, Any] = {"pk": self._partition(poller)}
        if below_key is not None:
            filter_text += " and RowKey lt @rk"
            params["rk"] = below_key
        with self._mapped("read", poller):
            pages = self.client.query_entities(
                filter_text, parameters=params, results_per_page=top or 1000
            )
            yield from (itertools.islice(pages, top) if top else pages)

    # --- the port -----------------------------------------------------------------------

    def tail(self, poller: str, count: int) -> list[dict[str, Any]]:
        if count <= 0:
            return []
        newest = [self._record(e) for e in self._query(poller, top=count)]
        return list(reversed(newest))

    def read(self, poller: str, *, since_seq: int = 0) -> Iterator[dict[str, Any]]:
        below = row_key(since_seq) if since_seq > 0 else None
        newest_first = [self._record(e) for e in self._query(poller, below_key=below)]
        yield from reversed(newest_first)

    def append(self, poller: str, records: Sequence[Mapping[str, Any]], *, after_seq: int) -> None:
        if not records:
            return
        last = self.tail(poller, 1)
        last_seq = int(last[0].get("seq") or 0) if last else 0
        expect_end(poller, last_seq, after_seq)
        operations = []
        for record, text in row_texts(records, after_seq):
            parts = split_text(text)
            entity: dict[str, Any] = {
                "PartitionKey": self._partition(poller),
                "RowKey": row_key(int(record["seq"])),
                "seq": int(record["seq"]),
                "at": str(record.get("at") or ""),
                "type": str(record.get("type") or ""),
                "size": len(text),
                "rec_parts": len(parts),
            }
            entity.update({f"rec_{i}": part for i, part in enumerate(parts)})
            operations.append(("create", entity))
        with self._mapped("append", poller, write=True):
            for start in range(0, len(operations), _BATCH):
                self.client.submit_transaction(operations[start : start + _BATCH])

    def prune(self, poller: str, retention: Retention, now: dt.datetime) -> int:
        cutoff = retention.cutoff(now)
        cut = format_time(cutoff) if cutoff is not None else None
        total = 0
        doomed: list[dict[str, Any]] = []
        with self._mapped("read", poller):
            entities = self.client.query_entities(
                "PartitionKey eq @pk",
                parameters={"pk": self._partition(poller)},
                select=["PartitionKey", "RowKey", "at", "size"],
            )
            for index, entity in enumerate(entities):  # newest first
                total += int(entity.get("size") or 0)
                if index == 0:
                    continue  # the last record always stays
                old = cut is not None and str(entity.get("at") or "") <= cut
                big = retention.max_bytes is not None and total > retention.max_bytes
                if doomed or old or big:
                    # From the newest record that may go, every older one goes too:
                    # the history loses its oldest records, never one in the middle
                    # (a record written under a clock behind the others' is not kept
                    # while older ones go around it).
                    doomed.append(
                        {"PartitionKey": entity["PartitionKey"], "RowKey": entity["RowKey"]}
                    )
        # Oldest first: a prune that stops half way (a failed transaction, a process
        # killed) has then removed the oldest records only, never a stretch in the
        # middle that readers would read across.
        doomed.reverse()
        with self._mapped("prune", poller, write=True):
            for start in range(0, len(doomed), _BATCH):
                self.client.submit_transaction(
                    [("delete", e) for e in doomed[start : start + _BATCH]]
                )
        return len(doomed)


__all__ = ["TableHistory", "row_key"]
