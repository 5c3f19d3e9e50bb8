"""What dbtrigger attached to a decorated function: one record, one attribute.

The decorators stack (``@db.output`` under ``@db.trigger`` under
``@app.schedule``), and whoever comes later needs what an earlier one set up:
the trigger resolves the output's settings before it fetches; ``@db.output``
refuses to sit above a trigger; the CLI finds a function's poller and handler
to run it outside the host. All of it is one :class:`FunctionBinding`, kept
under one attribute (:data:`ATTRIBUTE`) and read with :func:`binding_of`.

``functools.wraps`` copies a wrapped function's attributes onto its wrapper,
so a wrapper finds the record of what it wraps; each decorator then attaches
an extended *copy* (:func:`attach`), never changing the record of the
function below it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dbtrigger.azure.deferred import Lazy
    from dbtrigger.output import OutputTarget
    from dbtrigger.partitions.member import PartitionedPoller
    from dbtrigger.queue.trigger import QueueTrigger
    from dbtrigger.runtime.poller import PollTrigger

#: The one attribute dbtrigger sets on a function it decorates.
ATTRIBUTE = "dbtrigger_binding"

#: Given the host's arguments of one invocation, the ``(events, context)`` handler.
HandlerFactory = Callable[[dict[str, Any]], Callable[[Any, Any], Any]]


@dataclass(frozen=True)
class FunctionBinding:
    """The bindings of one decorated function (each None when not applied)."""

    #: ``@db.output``: where the rows given to ``out.set`` are written.
    output: OutputTarget | None = None
    #: ``@db.trigger``: its poller, built at decoration or at the first invocation.
    poller: Lazy[PollTrigger] | None = None
    #: ``@db.queue_trigger``: its queue, built likewise.
    queue: Lazy[QueueTrigger] | None = None
    #: ``db.partitioned_trigger``: the partitioned poller the function handles.
    partitioned: PartitionedPoller | None = None
    #: ``@db.trigger``: the function as a batch handler, for one invocation's host arguments.
    make_handler: HandlerFactory | None = None

    @property
    def is_trigger(self) -> bool:
        """Whether a trigger (of any kind) drives this function."""
        return self.poller is not None or self.queue is not None or self.partitioned is not None

    @property
    def poll_trigger(self) -> PollTrigger | None:
        """The poller, when it is built (its app settings were there)."""
        return self.poller.built if self.poller is not None else None

    @property
    def queue_trigger(self) -> QueueTrigger | None:
        """The queue, when it is built."""
        return self.queue.built if self.queue is not None else None


def binding_of(fn: Any) -> FunctionBinding:
    """The record of ``fn`` (an empty one for a function dbtrigger did not decorate)."""
    found = getattr(fn, ATTRIBUTE, None)
    return found if isinstance(found, FunctionBinding) else FunctionBinding()


def attach(wrapper: Any, fn: Any, **changes: Any) -> FunctionBinding:
    """Set on ``wrapper`` the record of ``fn`` with ``changes``; return it."""
    record = dataclasses.replace(binding_of(fn), **changes)
    setattr(wrapper, ATTRIBUTE, record)
    return record


__all__ = ["ATTRIBUTE", "FunctionBinding", "HandlerFactory", "attach", "binding_of"]
