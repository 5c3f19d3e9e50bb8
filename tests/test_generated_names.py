"""Generated identifiers past the database's limit: a stable start-and-hash, one rule everywhere."""

from __future__ import annotations

from sqlalchemy.dialects import mysql, postgresql

from dbtrigger.cdc.binlog_setup import default_reader_name
from dbtrigger.changelog import log_table_name
from dbtrigger.names import quoted_name, shortened
from dbtrigger.wakeup.ddl import default_channel

LONG_TABLE = "orders_" + "x" * 60


def test_names_that_fit_are_kept() -> None:
    assert shortened("a" * 63) == "a" * 63
    assert shortened("a" * 64, 64) == "a" * 64
    assert log_table_name("orders") == "dbt_changelog_orders"
    assert default_channel("orders", "public") == "dbt_wake_public_orders"


def test_long_names_keep_the_names_they_always_had() -> None:
    # The values the change log, the wake-up trigger and the binlog reader have
    # generated since they were written: installed objects are found by them.
    assert log_table_name(LONG_TABLE) == (
        "dbt_changelog_orders_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx_f9c1455d"
    )
    assert default_channel(LONG_TABLE, "public") == (
        "dbt_wake_public_orders_xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx_aa702a1f"
    )
    assert default_reader_name("poller_" + "y" * 70) == (
        "poller_yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy_2ec13db1"
    )


def test_shortened_names_fit_exactly_and_differ() -> None:
    a, b = shortened("t" * 80 + "a"), shortened("t" * 80 + "b")
    assert len(a) == len(b) == 63
    assert a != b
    assert len(shortened("t" * 80, 64)) == 64


def test_a_qualified_name_quotes_each_part_with_the_dialects_rule() -> None:
    pg = postgresql.dialect().identifier_preparer.quote
    my = mysql.dialect().identifier_preparer.quote
    assert quoted_name(pg, "orders", None) == "orders"
    assert quoted_name(pg, "orders", "") == "orders"
    assert quoted_name(pg, "Orders", "Shop") == '"Shop"."Orders"'
    assert quoted_name(my, "order", "shop") == "shop.`order`"  # a reserved word
