"""Chaos writer: inserts and updates ``items`` rows for a while, in cursor order.

One connection, one transaction per change, and the cursor (``version``) is
taken from a sequence inside that transaction: commit order equals cursor
order, so every row the pollers could ever miss would be the lease/checkpoint
protocol's fault, not a late-committing writer's (that is a separate problem,
handled by visibility guards).

Prints one JSON line with what it did when the time is up.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import sqlalchemy as sa


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--schema", required=True)
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--pause", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--min-rows",
        type=int,
        default=0,
        help="go on past --seconds until more rows than this were inserted (bounded)",
    )
    parser.add_argument(
        "--recent", type=int, default=0, help="update only rows among the last N ids (0: any)"
    )
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    engine = sa.create_engine(args.db_url, pool_size=1, max_overflow=0)
    items = sa.Table("items", sa.MetaData(), schema=args.schema, autoload_with=engine)
    seq = sa.Sequence("items_version_seq", schema=args.schema)
    next_id = 1
    inserted = updated = transactions = 0
    deadline = time.monotonic() + args.seconds
    cap = deadline + 120
    with engine.connect() as conn:
        while time.monotonic() < deadline or (inserted <= args.min_rows and time.monotonic() < cap):
            with conn.begin():
                if next_id == 1 or rng.random() < 0.6:
                    for _ in range(rng.randint(1, 6)):
                        conn.execute(
                            items.insert().values(
                                id=next_id, version=seq.next_value(), payload=f"v0-{next_id}"
                            )
                        )
                        next_id += 1
                        inserted += 1
                else:
                    low = max(1, next_id - args.recent) if args.recent else 1
                    for target in rng.sample(range(low, next_id), k=min(3, next_id - low)):
                        conn.execute(
                            items.update()
                            .where(items.c.id == target)
                            .values(version=seq.next_value(), payload=f"update-{updated}")
                        )
                        updated += 1
            transactions += 1
            time.sleep(args.pause * rng.random() * 2)
    engine.dispose()
    print(json.dumps({"inserted": inserted, "updated": updated, "transactions": transactions}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
