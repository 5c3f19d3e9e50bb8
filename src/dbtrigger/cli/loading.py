"""Import what ``MODULE:ATTRIBUTE`` names on the command line.

Every command that takes a trigger, a source or a handler by name resolves it
here, so the import rules (the current directory is importable, errors say
which part is missing) are the same everywhere and no command module needs to
import another.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dbtrigger.errors import ConfigurationError, DbTriggerError
from dbtrigger.runtime.kernel import Handler
from dbtrigger.runtime.poller import PollTrigger
from dbtrigger.runtime.trigger import Trigger

if TYPE_CHECKING:
    from dbtrigger.partitions.member import PartitionedPoller


def load_object(spec: str) -> Any:
    """Import ``package.module:attribute``."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"expected MODULE:ATTRIBUTE, got {spec!r}")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, ".")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigurationError(f"cannot import {module_name!r}: {exc}") from exc
    except DbTriggerError:
        raise
    except Exception as exc:
        raise ConfigurationError(
            f"importing {module_name!r} failed: {type(exc).__name__}: {exc} "
            "(an app setting it reads may be missing: run inside the Functions project, "
            "or pass --settings local.settings.json)"
        ) from exc
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigurationError(f"{module_name!r} has no attribute {attr!r}") from None
    return target


@dataclass(frozen=True)
class LoadedTrigger:
    """A poller named on the command line, with the handler that goes with it.

    ``handler`` is the trigger's ``@handler``, or for an Azure Functions
    function (``function_app:orders_poll``) the function itself with its
    output bindings; None when neither exists.
    """

    spec: str
    trigger: Trigger
    handler: Handler | None
    function: bool = False


def as_trigger(target: Any, spec: str) -> LoadedTrigger | None:
    """``target`` as a poller: a PollTrigger, or a ``@db.trigger`` Functions function."""
    if isinstance(target, PollTrigger):
        target.cli_source = spec  # log lines then print commands with this --source
        return LoadedTrigger(spec, target, target.default_handler)
    if isinstance(target, Trigger):  # a QueueTrigger, a PartitionedPoller
        return LoadedTrigger(spec, target, target.default_handler)
    from dbtrigger.queue.sidecar import SidecarFeeder  # noqa: PLC0415 - SQLAlchemy on use

    if isinstance(target, SidecarFeeder):  # a keyset poller whose handler feeds the claims
        target.poll.cli_source = spec
        return LoadedTrigger(spec, target.poll, target.handle)
    from dbtrigger.azure import function_handler, function_trigger  # noqa: PLC0415 - optional

    poll = function_trigger(target)
    if poll is None:
        return None
    if isinstance(poll, PollTrigger):
        poll.cli_source = spec
    return LoadedTrigger(spec, poll, function_handler(target), function=True)


def partitioned_of(trigger: Any) -> PartitionedPoller | None:
    """The PartitionedPoller ``trigger`` is (or a deprecated ``PollTrigger(partitions=N)``
    delegates to), or None: a command then acts on its partitions' pollers."""
    from dbtrigger.partitions.member import PartitionedPoller  # noqa: PLC0415 - SQLAlchemy

    if isinstance(trigger, PartitionedPoller):
        return trigger
    delegate = getattr(trigger, "partitioned", None) if isinstance(trigger, PollTrigger) else None
    return delegate if isinstance(delegate, PartitionedPoller) else None


def as_partition(loaded: LoadedTrigger, poller: str, command: str) -> LoadedTrigger:
    """``loaded`` as the one partition ``poller`` of the partitioned poller it names
    (``orders.p000-064``): that partition's own trigger (its name, bucket range, state
    document and history) with the group's handler; ``loaded`` itself otherwise.

    A fan-out group's handler is the subscribers' marker, not a handler: it is
    dropped, so the command picks a subscriber as it does for a fan-out poller.

    Raises:
        ConfigurationError: ``poller`` is not one of the group's partitions
            (``command`` is how the message shows the command to run on one).
    """
    group = partitioned_of(loaded.trigger)
    if group is None:
        return loaded
    from dbtrigger.partitions.balancing import partition_of  # noqa: PLC0415 - SQLAlchemy
    from dbtrigger.runtime.subscriber_options import SubscriberCall  # noqa: PLC0415

    partition = partition_of(group.name, poller)
    if partition is None:
        raise ConfigurationError(
            f"{loaded.spec} is the partitioned poller {group.name!r}: each partition keeps its "
            f"own state and history under its own name; name one, e.g. `dbtrigger {command} "
            f"{group.name}.p000-064 ...` (`dbtrigger partitions show --trigger {loaded.spec}` "
            "lists them)"
        )
    handler = None if isinstance(loaded.handler, SubscriberCall) else loaded.handler
    return LoadedTrigger(loaded.spec, group.partition_trigger(partition), handler, loaded.function)


def _triggers_hint(module_name: str) -> str:
    """``; name one of its triggers instead: m:orders, m:refunds``, or nothing.

    A new user names the Function App (``function_app:app``) or its
    ``DbBindings`` where a function is wanted: the app is not one poller, and
    the worker runs each function it is given by name. Looked up without
    building anything (a trigger whose app settings are missing is listed too).
    """
    from dbtrigger.azure.introspect import function_record  # noqa: PLC0415 - error path

    def is_trigger(value: object) -> bool:
        try:
            return isinstance(value, Trigger) or function_record(value).is_trigger
        except Exception:  # noqa: BLE001 - an odd module attribute is simply not listed
            return False

    module = sys.modules.get(module_name)
    found = [
        f"{module_name}:{attr}"
        for attr, value in list(vars(module).items() if module else [])
        if not attr.startswith("_") and is_trigger(value)
    ]
    if not found:
        return ""
    several = " (`dbtrigger run` takes several: one worker runs them all)" if len(found) > 1 else ""
    return f"; name one of its triggers instead: {', '.join(found)}{several}"


def load_trigger(spec: str, handler_spec: str | None = None) -> LoadedTrigger:
    """``MODULE:ATTR`` naming a PollTrigger or a Functions function, and its handler.

    Raises:
        ConfigurationError: the name is not a poller, or it has no handler and
            ``handler_spec`` gives none.
    """
    target = load_object(spec)
    loaded = as_trigger(target, spec)
    if loaded is None:
        raise ConfigurationError(
            f"{spec} is a {type(target).__name__}, not a PollTrigger, a QueueTrigger or a "
            f"@db.trigger function{_triggers_hint(spec.partition(':')[0])}"
        )
    if handler_spec:
        loaded = LoadedTrigger(spec, loaded.trigger, load_object(handler_spec), loaded.function)
    fan_out = isinstance(loaded.trigger, PollTrigger) and loaded.trigger.subscribers
    if loaded.handler is None and not fan_out:
        raise ConfigurationError(
            f"{spec} has no handler: decorate one with @{spec.split(':')[1]}.handler "
            "or pass --handler MODULE:FUNCTION"
        )
    return loaded
