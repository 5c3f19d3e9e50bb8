"""PostgreSQL logical decoding, read: messages in, whole transactions out, changes on demand.

:class:`Decoder` assembles the ``pgoutput`` messages of one read into
:class:`~dbtrigger.cdc.buffer.Transaction` objects, keeping for each change
only its raw message and the relation it was written under: a change becomes
a :class:`~dbtrigger.cdc.changes.Change` (dicts of converted values) only when
:func:`materialise` is asked for it, as a batch is handed out.

Two kinds of logical message are ours: heartbeats (non-transactional, ignored
here: they only give the slot somewhere to advance to) and snapshot chunks
(transactional: the rows of one chunk of a table's snapshot, written into the
log by :mod:`dbtrigger.cdc.pg_snapshot` so that they arrive in commit order
with everything else). Messages of other prefixes are not ours and skipped.

A column type that changes under a watched table (a Relation message that
disagrees with the accepted columns,
:class:`~dbtrigger.cdc.assembly.SchemaGuard`) ends the read just before the
transaction that first uses it: what came before is delivered, and
the reader reports the change (:attr:`Decoder.schema_break`) instead of
handing out rows of a shape the consumers did not agree to.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbtrigger.cdc import pgoutput as po
from dbtrigger.cdc.assembly import Assembly, SchemaBreak, SchemaGuard, keyless
from dbtrigger.cdc.buffer import Transaction
from dbtrigger.cdc.changes import UNCHANGED, Change, truncate_change
from dbtrigger.cdc.pg_setup import TableInfo
from dbtrigger.cdc.position import LogPosition
from dbtrigger.errors import SerializationError

log = logging.getLogger("dbtrigger.cdc")

HEARTBEAT_PREFIX = "dbtrigger.heartbeat"
SNAPSHOT_PREFIX = "dbtrigger.snapshot:"


@dataclass(frozen=True)
class RelationInfo:
    """A watched table as one Relation message (or snapshot chunk) described it."""

    oid: int
    table: str
    names: tuple[str, ...]
    type_oids: tuple[int, ...]
    is_key: tuple[bool, ...]
    key_index: tuple[tuple[str, int], ...]
    converters: tuple[Callable[[str], Any] | None, ...] = field(repr=False, compare=False)

    @classmethod
    def build(
        cls,
        oid: int,
        table: str,
        columns: Sequence[tuple[str, int, bool]],
        key_columns: Sequence[str],
        domains: Mapping[int, int] | None = None,
    ) -> RelationInfo:
        """``domains`` maps a domain's type OID to its base type's: a domain column is
        converted as its base type (a query gives its base type's value)."""
        names = tuple(c[0] for c in columns)
        where = {name: i for i, name in enumerate(names)}
        return cls(
            oid,
            table,
            names,
            tuple(c[1] for c in columns),
            tuple(c[2] for c in columns),
            tuple((k, where[k]) for k in key_columns if k in where),
            tuple(po.converter((domains or {}).get(c[1], c[1])) for c in columns),
        )

    def image(self, values: Sequence[po.Value], *, key_only: bool = False) -> dict[str, Any]:
        """Column name -> Python value; a key-only image keeps only the identity columns.

        Runs for every column of every change: text columns are decoded and
        kept, others converted; a value a conversion cannot read stays text.
        """
        out: dict[str, Any] = {}
        for name, value, convert, key in zip(
            self.names, values, self.converters, self.is_key, strict=False
        ):
            if key_only and not key:
                continue
            if value is None or value is UNCHANGED:
                out[name] = value
                continue
            text = value.decode()  # type: ignore[union-attr]
            if convert is None:
                out[name] = text
                continue
            try:
                out[name] = convert(text)
            except (ValueError, ArithmeticError):
                out[name] = text
        return out

    def pk(self, image: Mapping[str, Any]) -> dict[str, Any]:
        return {name: image[name] for name, _ in self.key_index if name in image}


def relation_keys(message: po.Relation, known: Sequence[str]) -> tuple[str, ...]:
    """The key columns of the changes a Relation message describes.

    Under ``REPLICA IDENTITY DEFAULT`` (the primary key) or ``USING INDEX`` the message
    flags the identity's columns as the table was when those changes were written, so
    a key changed under a running reader (``DROP CONSTRAINT t_pkey, ADD PRIMARY KEY (a,
    id)``, a key column renamed) keys them anew; ``known`` (the catalog's, read at the
    start) gives the order when it has the same columns. Under ``FULL`` every column is
    flagged, and ``known`` is kept; so it is when none is flagged (a change written
    while the table had no primary key: a key chosen now would hold back no better).
    """
    if message.replica_identity not in ("d", "i"):
        return tuple(known)
    flagged = [c.name for c in message.columns if c.is_key]
    if not flagged or sorted(flagged) == sorted(known):
        return tuple(known)  # none: written while the table had no key (the start's, as before)
    return tuple(flagged)


class Decoder(Assembly[TableInfo, int]):
    """Turns the messages of one read into committed transactions of watched changes."""

    def __init__(
        self,
        watched: Mapping[str, TableInfo],
        guard: SchemaGuard[int],
        *,
        slot: str,
    ) -> None:
        super().__init__(watched, guard)
        self.snapshot_prefix = SNAPSHOT_PREFIX + slot
        self.relations: dict[int, RelationInfo] = {}
        self.last_end: int | None = None

    def start(self, room: int) -> None:
        """A new read (a new decoding session: Relation messages come again) that
        may keep ``room`` changes."""
        self.restart(room)
        self.relations.clear()
        self._problems.clear()
        self.last_end = None

    def feed(self, data: bytes, after: LogPosition | None) -> Transaction[Any] | None:
        """Take one message; a transaction when this one committed it."""
        kind = data[:1]
        if kind in (b"I", b"U", b"D"):
            current = self.delivering
            if current is not None:
                oid = int.from_bytes(data[1:5], "big")
                relation = self.relations.get(oid)
                if relation is not None and self.schema_break is None:
                    if self.delivered_already():  # under whatever shape it had
                        return None
                    problem = self._problems.get(oid)
                    if problem is not None:  # this change and all after it wait
                        self.schema_break = SchemaBreak(current.commit, problem)
                        return None
                    self.keep((relation, data))
            return None
        message = po.decode(data)
        if isinstance(message, po.Begin):
            commit = po.lsn_token(message.final_lsn)
            self.open(commit, message.final_lsn, message.commit_time, message.xid, after)
        elif isinstance(message, po.Commit):
            txn = self.close()
            self.last_end = message.end_lsn
            if txn is not None:
                txn.end = message.end_lsn
            return txn
        elif isinstance(message, po.Relation):
            self._relation(message)
        elif isinstance(message, po.Message):
            self._message(message)
        elif isinstance(message, po.Truncate):
            self._truncate(message)
        return None

    def _relation(self, message: po.Relation) -> None:
        table = f"{message.namespace}.{message.name}"
        info = self.watched.get(table)
        if info is None:
            # A change made before the table was renamed (ALTER TABLE ... RENAME) carries
            # the name it had then; the OID stays. Matched by name only, the changes a
            # source re-pointed at the new name still had to read were skipped silently.
            table, info = next(
                ((t, i) for t, i in self.watched.items() if i.oid == message.oid),
                (table, None),
            )
        if info is None:
            self.relations.pop(message.oid, None)  # a table we do not watch (shared publication)
            return
        keys = relation_keys(message, info.key_columns)
        relation = RelationInfo.build(
            message.oid,
            table,
            [(c.name, c.type_oid, c.is_key) for c in message.columns],
            keys,
            info.domains,
        )
        self.relations[message.oid] = relation
        columns = zip(relation.names, relation.type_oids, strict=True)
        problem = self.guard.check(table, columns)
        gone = [k for k in keys if k not in relation.names]
        if gone:  # renamed or dropped: its changes would come without their key
            problem = "; ".join(p for p in (problem, keyless(table, gone)) if p)
        self.note_problem(message.oid, problem)

    def _message(self, message: po.Message) -> None:
        if message.prefix != self.snapshot_prefix or not message.transactional:
            return  # heartbeats and other tools' messages
        if self.delivering is None:
            return
        chunk = json.loads(message.content)
        table = chunk["table"]
        info = self.watched.get(table)
        if info is None:
            return
        relation = RelationInfo.build(
            info.oid,
            table,
            [
                (n, t, n in info.key_columns)
                for n, t in zip(chunk["columns"], chunk["types"], strict=True)
            ],
            info.key_columns,
            info.domains,
        )
        for row in chunk["rows"]:
            self.keep((relation, tuple(None if v is None else v.encode() for v in row)))

    def _truncate(self, message: po.Truncate) -> None:
        """One ``truncate`` change per watched table it empties, in its place in the
        transaction (``TRUNCATE a, b`` is one message; each table gets its own)."""
        if self.delivering is None or self.schema_break is not None:
            return
        for oid in message.relation_oids:
            relation = self.relations.get(oid)
            if relation is not None:
                self.keep((relation, TRUNCATED))


#: The raw payload of a kept ``TRUNCATE`` (beside its relation): compared by identity.
TRUNCATED = object()


def materialise(txn: Transaction[Any], ordinal: int, raw: tuple[RelationInfo, Any]) -> Change:
    """The change at ``ordinal`` of ``txn`` (raw: its relation and message or snapshot row).

    Reads the row-change messages (``I``, ``U``, ``D``) directly, the hot path
    of every delivered change; :func:`~dbtrigger.cdc.pgoutput.decode` is the
    reference decoder they agree with (tested on the same bytes).
    """
    relation, payload = raw
    position = LogPosition(txn.commit, ordinal)
    common: dict[str, Any] = {
        "position": position,
        "table": relation.table,
        "commit_time": txn.commit_time,
        "transaction_id": txn.transaction_id,
        "last_in_transaction": txn.whole and ordinal == txn.last_ordinal,
    }
    if payload is TRUNCATED:
        return truncate_change(
            position,
            relation.table,
            [name for name, _ in relation.key_index],
            commit_time=txn.commit_time,
            transaction_id=txn.transaction_id,
            last_in_transaction=common["last_in_transaction"],
        )
    if isinstance(payload, tuple):  # a snapshot row
        after = relation.image(payload)
        return Change(
            op="upsert", pk=relation.pk(after), before=None, after=after, snapshot=True, **common
        )
    before: dict[str, Any] | None = None
    after_image: dict[str, Any] | None = None
    image_kind: str | None = None
    try:
        kind = payload[0]
        tag = payload[5]
        if kind == 0x49 and tag == 0x4E:  # 'I' ... 'N'
            op = "insert"
            after_image = relation.image(po.read_tuple(payload, 6)[0])
        elif kind == 0x55:  # 'U'
            op = "update"
            pos = 6
            if tag in (0x4B, 0x4F):  # 'K', 'O'
                old, pos = po.read_tuple(payload, 6)
                key_only = tag == 0x4B
                before = relation.image(old, key_only=key_only)
                image_kind = "key" if key_only else "full"
                if payload[pos] != 0x4E:
                    raise po.DecodeError("update: expected new tuple 'N'")
                pos += 1
            elif tag != 0x4E:
                raise po.DecodeError("update: expected new tuple 'N'")
            after_image = relation.image(po.read_tuple(payload, pos)[0])
            if image_kind == "full" and before is not None:
                _fill_unchanged(after_image, before)
        elif kind == 0x44 and tag in (0x4B, 0x4F):  # 'D', 'K'/'O'
            op = "delete"
            key_only = tag == 0x4B
            before = relation.image(po.read_tuple(payload, 6)[0], key_only=key_only)
            image_kind = "key" if key_only else "full"
        else:
            raise po.DecodeError(f"not a row change ({payload[:1]!r})")
    except (po.DecodeError, IndexError) as exc:
        raise SerializationError(f"change of {relation.table} at {position}: {exc}") from None
    keyed = after_image if after_image is not None else before or {}
    unchanged = (
        tuple(k for k, v in after_image.items() if v is UNCHANGED)
        if after_image is not None and UNCHANGED in after_image.values()
        else ()
    )
    return Change(
        op=op,
        pk=relation.pk(keyed),
        before=before,
        after=after_image,
        before_image=image_kind,
        unchanged=unchanged,
        **common,
    )


def _fill_unchanged(after: dict[str, Any], before: Mapping[str, Any]) -> None:
    """Under ``REPLICA IDENTITY FULL``, an unchanged TOASTed value from the old row.

    The new row carries such a value as "unchanged", but the old row (written
    whole, its TOASTed values read out) has it, and the update left it as it
    was: ``after`` then holds the real value, never the marker.
    """
    for name, value in after.items():
        if value is UNCHANGED and name in before and before[name] is not UNCHANGED:
            after[name] = before[name]


__all__ = [
    "HEARTBEAT_PREFIX",
    "SNAPSHOT_PREFIX",
    "Decoder",
    "RelationInfo",
    "materialise",
]
