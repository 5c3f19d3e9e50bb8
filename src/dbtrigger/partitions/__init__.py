"""Partitioned polling: one table split over many members by a hash of its key.

See ``docs/scale-out.md``. :class:`PartitionedPoller` is the member that runs
in every worker; :mod:`~dbtrigger.partitions.layout` the pure layout and
balancing rules; :mod:`~dbtrigger.partitions.buckets` the bucket hash in
Python and SQL.
"""

from __future__ import annotations

from dbtrigger.partitions.buckets import BUCKETS, bucket_of, partition_ddl
from dbtrigger.partitions.inspect import PartitionState
from dbtrigger.partitions.layout import Partition, even_ranges
from dbtrigger.partitions.member import PartitionedPoller
from dbtrigger.partitions.source import PartitionSource

__all__ = [
    "BUCKETS",
    "Partition",
    "PartitionSource",
    "PartitionState",
    "PartitionedPoller",
    "bucket_of",
    "even_ranges",
    "partition_ddl",
]
