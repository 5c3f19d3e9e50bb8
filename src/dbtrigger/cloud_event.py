"""A change as a CloudEvent (``event.to_cloudevent()``), for handlers that forward events.

A handler that hands changes on to Event Grid, Event Hubs, Service Bus or
anything else that speaks CloudEvents builds the same envelope every time;
:meth:`RowChange.to_cloudevent <dbtrigger.events.RowChange.to_cloudevent>`
builds it with the ``cloudevents`` SDK (``pip install "dbtrigger[cloudevents]"``):

* ``id`` is the event's ``event_id``: equal on every redelivery of the same
  row state, so a consumer that deduplicates on ``source`` + ``id`` (as the
  CloudEvents spec says consumers may) drops at-least-once duplicates;
* ``source`` is ``/dbtrigger/<poller>`` (the ids are unique per poller), or
  what the caller passes;
* ``type`` is ``dbtrigger.row.<op>`` (``upsert``, ``insert``, ``update``,
  ``delete``, and a change log's ``truncate``), or what the caller passes;
* ``subject`` is the row's key, ``id=5`` (``region=eu/id=5`` for several
  columns); a ``truncate`` concerns every row and has none;
* ``time`` is the cursor when it is an aware timestamp (when the row
  changed), else the time the envelope was made;
* ``data`` (``application/json``) is ``{"op", "source", "pk", "cursor",
  "before", "after"}`` with values as plain JSON: timestamps and dates as ISO
  8601 text, decimals and UUIDs as text (no precision lost), bytes as base64.

Nothing here runs unless a handler calls it, and the SDK is imported then.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import importlib
import math
import uuid
from collections.abc import Mapping
from typing import Any

from dbtrigger.errors import ConfigurationError


def plain_json(value: Any) -> Any:
    """``value`` as plain JSON a consumer in any language reads without dbtrigger."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, Mapping):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain_json(v) for v in value]
    return str(value)


def _subject(pk: Mapping[str, Any]) -> str:
    return "/".join(f"{name}={plain_json(value)}" for name, value in pk.items())


def to_cloudevent(
    event: Any,
    *,
    source: str | None = None,
    type: str | None = None,
    extensions: Mapping[str, Any] | None = None,
) -> Any:
    """``event`` (a :class:`~dbtrigger.events.RowChange`, whose ``to_cloudevent``
    calls this: the type is not named here, so this module needs nothing of
    ``dbtrigger.events``) as a ``cloudevents.core.v1.event.CloudEvent`` (see the
    module doc).

    Raises:
        ConfigurationError: the ``cloudevents`` package is not installed, or an
            attribute is not valid CloudEvents (the SDK's reason is chained).
    """
    try:
        module = importlib.import_module("cloudevents.core.v1.event")
        invalid = importlib.import_module("cloudevents.core.exceptions").BaseCloudEventException
    except ImportError as exc:
        raise ConfigurationError(
            'event.to_cloudevent() needs the CloudEvents SDK: pip install "dbtrigger[cloudevents]"'
        ) from exc
    poller = event.metadata.get("poller")
    attributes: dict[str, Any] = {
        "id": event.event_id,
        "source": source or (f"/dbtrigger/{poller}" if poller else f"/dbtrigger/{event.source}"),
        "type": type or f"dbtrigger.row.{event.op}",
        "datacontenttype": "application/json",
    }
    if event.op != "truncate":  # its key values are None: no row is its subject
        attributes["subject"] = _subject(event.pk)
    cursor = event.cursor
    if isinstance(cursor, dt.datetime) and cursor.tzinfo is not None:
        attributes["time"] = cursor
    attributes.update(extensions or {})
    data = {
        "op": event.op,
        "source": event.source,
        "pk": plain_json(event.pk),
        "cursor": plain_json(cursor),
        "before": plain_json(event.before),
        "after": plain_json(event.after),
    }
    try:
        return module.CloudEvent(attributes, data)
    except invalid as exc:
        raise ConfigurationError(f"not a valid CloudEvent: {exc}") from exc


__all__ = ["plain_json", "to_cloudevent"]
