"""``PollTrigger(partitions=N)``, deprecated: the member such a trigger delegates to.

Partitioned pollers have their own constructor,
:class:`dbtrigger.partitions.PartitionedPoller`, and the partitions wing
stands on the runtime. The old spelling still works: it warns and builds
that member through :data:`partitioned_member`, a factory the package root
(``dbtrigger/__init__.py``, which stands above both wings) installs, so the
runtime never imports the partitions wing. Gone with the spelling.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

#: Builds the ``PartitionedPoller`` a deprecated ``PollTrigger(partitions=N)``
#: delegates every tick to (its keyword arguments); installed by the package root.
partitioned_member: Callable[..., Any] | None = None


def delegate_partitions(options: dict[str, Any], *, partitions: int, owner_id: str) -> Any:
    """Warn, then build the member ``PollTrigger(partitions=N, **options)`` stands for.

    ``options`` are the trigger's keyword arguments (``name``, ``source``,
    ``checkpoint_store`` and every other option, which the member takes alike);
    ``owner_id`` becomes the member's ``member_id``.
    """
    warnings.warn(
        "PollTrigger(partitions=N) is deprecated: build the member with "
        "dbtrigger.partitions.PartitionedPoller(name=..., source=..., "
        "checkpoint_store=..., partitions=N, ...), which takes the same options",
        DeprecationWarning,
        stacklevel=3,
    )
    if partitioned_member is None:  # pragma: no cover - the root installs it on import
        raise RuntimeError("dbtrigger's package root did not install the partitioned member")
    return partitioned_member(
        **{k: v for k, v in options.items() if k not in ("partitions", "owner_id")},
        partitions=partitions,
        member_id=owner_id,
    )


__all__ = ["delegate_partitions", "partitioned_member"]
