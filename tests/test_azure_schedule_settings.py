"""A timer schedule given as a ``%SETTING%`` that is missing or malformed, and
``WEBSITE_TIME_ZONE``, in a real ``func.FunctionApp`` module.

A malformed schedule setting made ``function_app.py`` fail to import (the
ConfigurationError came out of ``@db.trigger`` / ``partitioned_trigger``): the
host then indexes no function of the app, not only the one that reads the
setting. The app now imports; only the invocations of that function fail,
naming the setting and what to set, until it is fixed.
"""

from __future__ import annotations

import datetime as dt
import logging
import textwrap
import uuid
import warnings
import zoneinfo
from pathlib import Path

import pytest
from azure.functions.timer import TimerRequest

from dbtrigger.azure import schedule_interval
from dbtrigger.azure.schedule import LeaseScheduleWarning, check_schedule
from dbtrigger.errors import ConfigurationError
from dbtrigger.settings import DeferredSettingError
from tests.databases import TestDatabase
from tests.test_azure_malformed_settings import load
from tests.test_source_sqlalchemy import insert, naive, orders_table

APP = """
import azure.functions as func
from dbtrigger import DbBindings, InMemoryCheckpointStore, SqlAlchemySource

app = func.FunctionApp()
db = DbBindings()
SEEN = []
OTHER = []

@app.schedule(schedule="0 0 * * * *", arg_name="timer")
def other(timer: func.TimerRequest) -> None:
    OTHER.append(1)

@app.schedule(schedule="%ORDERS_SCHEDULE_{tag}%", arg_name="timer")
@db.trigger(arg_name="events", checkpoint_store=InMemoryCheckpointStore(),
            schedule="%ORDERS_SCHEDULE_{tag}%", lease_ttl_seconds=600,
            source=SqlAlchemySource(url="{url}", table="orders",
                                    cursor_column="updated_at", pk_columns=["id"]))
def orders(timer: func.TimerRequest, events) -> None:
    SEEN.extend(e.pk["id"] for e in events)

@db.partitioned_trigger(app, checkpoint_store=InMemoryCheckpointStore(), partitions=2,
                        schedule="%ORDERS_SCHEDULE_{tag}%",
                        source=SqlAlchemySource(url="{url}", table="orders",
                                                cursor_column="updated_at",
                                                pk_columns=["id"]))
def spread(events) -> None:
    pass
"""


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (None, "which is not set"),
        ("every five minutes", "not a six-field NCRONTAB expression"),
        ("0 0 0 31 2 *", "never fires"),
        ("0 0 25 * * *", "hour field"),
    ],
)
def test_a_bad_schedule_setting_fails_only_the_functions_that_read_it(
    value: str | None,
    words: str,
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": i, "updated_at": naive(i)} for i in range(3)])
    tag = uuid.uuid4().hex[:8]
    setting = f"ORDERS_SCHEDULE_{tag}"
    if value is not None:
        monkeypatch.setenv(setting, value)
    path = tmp_path / f"function_app_{tag}.py"
    path.write_text(textwrap.dedent(APP.format(tag=tag, url=sqlite_db.url)))
    caplog.set_level(logging.WARNING, logger="dbtrigger")

    module = load(path, f"function_app_{tag}")  # the import does not fail
    functions = {f.get_function_name(): f.get_user_function() for f in module.app.get_functions()}
    assert sorted(functions) == ["orders", "other", "spread", "spread_coordinator"]
    warned = [r for r in caplog.records if r.__dict__.get("event") == "schedule_setting_unusable"]
    assert warned
    assert all(setting in r.getMessage() for r in warned)

    functions["other"](timer=TimerRequest(past_due=False))  # the rest of the app runs
    assert module.OTHER == [1]
    for name in ("orders", "spread_coordinator"):
        for _ in range(2):  # every invocation, not only the first
            with pytest.raises(DeferredSettingError) as info:
                functions[name](timer=TimerRequest(past_due=False))
            assert info.value.fields["setting"] == setting
            assert f"app setting {setting!r}" in str(info.value)
            assert words in str(info.value)
            assert "0 */5 * * * *" in str(info.value)  # what to set
    assert module.SEEN == []

    monkeypatch.setenv(setting, "0 */5 * * * *")  # fixed: the next invocation runs
    functions["orders"](timer=TimerRequest(past_due=False))
    assert module.SEEN == [0, 1, 2]


def test_a_malformed_literal_schedule_is_still_refused_at_import() -> None:
    """A schedule written in code is code: a mistake in it fails where it is written."""
    with pytest.raises(ConfigurationError, match="never fires"):
        check_schedule(600, "0 0 0 31 2 *")


@pytest.fixture
def forget_zones() -> None:
    """Each test sees its own WEBSITE_TIME_ZONE warnings (the zone is looked up once)."""
    from dbtrigger.azure import schedule  # noqa: PLC0415

    schedule._zone.cache_clear()


HOUR = 3600


@pytest.mark.parametrize(
    ("schedule", "zone", "hours"),
    [
        # Daily at 02:30 on Berlin's wall clock: 23 hours apart when summer time starts.
        ("0 30 2 * * *", "Europe/Berlin", 23),
        ("0 30 2 * * *", None, 24),
        # 01:00 and 03:00 New York time: one hour apart the day 02:00 is skipped.
        ("0 0 1,3 * * *", "America/New_York", 1),
        ("0 0 1,3 * * *", None, 2),
        # Every five minutes stays five minutes; a TimeSpan ignores the zone.
        ("0 */5 * * * *", "Europe/Berlin", 5 / 60),
        ("02:00:00", "America/New_York", 2),
        ("0 0 9 * * *", "UTC", 24),
    ],
)
def test_the_interval_follows_the_zones_wall_clock(
    schedule: str, zone: str | None, hours: float
) -> None:
    tz = zoneinfo.ZoneInfo(zone) if zone else None
    interval = schedule_interval(schedule, tz)
    assert interval == dt.timedelta(hours=hours)


def test_website_time_zone_is_read_for_the_lease_check(
    monkeypatch: pytest.MonkeyPatch, forget_zones: None
) -> None:
    """01:00 and 03:00 New York time: a lease of 1.5 hours is shorter than the two
    hours in UTC, not than the one hour the host's firings are apart the day
    summer time starts; the check measures in the zone the host fires in."""
    monkeypatch.setenv("WEBSITE_TIME_ZONE", "America/New_York")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeaseScheduleWarning)
        check_schedule(1.5 * HOUR, "0 0 1,3 * * *")
    with pytest.warns(LeaseScheduleWarning, match="3600 s"):
        check_schedule(0.5 * HOUR, "0 0 1,3 * * *")


@pytest.mark.parametrize("name", ["W. Europe Standard Time", "Europe/Nowhere", "../etc"])
def test_a_time_zone_this_machine_does_not_know_is_named_and_read_as_utc(
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    forget_zones: None,
) -> None:
    monkeypatch.setenv("WEBSITE_TIME_ZONE", name)
    caplog.set_level(logging.WARNING, logger="dbtrigger")
    with pytest.warns(LeaseScheduleWarning, match="7200 s"):  # two hours: UTC
        check_schedule(1.5 * HOUR, "0 0 1,3 * * *")
    (record,) = [r for r in caplog.records if r.__dict__.get("event") == "time_zone_unknown"]
    assert "WEBSITE_TIME_ZONE" in record.getMessage()
    assert repr(name) in record.getMessage()
    assert "IANA" in record.getMessage()


@pytest.mark.parametrize("sku", ["Dynamic", "FlexConsumption"])
def test_a_plan_that_ignores_website_time_zone_is_named_and_read_as_utc(
    sku: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    forget_zones: None,
) -> None:
    """Linux Consumption and Flex Consumption hosts do not read WEBSITE_TIME_ZONE and
    fire in UTC: the interval is the UTC one, and a warning says the setting does
    nothing there."""
    monkeypatch.setenv("WEBSITE_TIME_ZONE", "America/New_York")
    monkeypatch.setenv("WEBSITE_SKU", sku)
    caplog.set_level(logging.WARNING, logger="dbtrigger")
    with pytest.warns(LeaseScheduleWarning, match="7200 s"):
        check_schedule(1.5 * HOUR, "0 0 1,3 * * *")
    (record,) = [r for r in caplog.records if r.__dict__.get("event") == "time_zone_ignored"]
    assert "WEBSITE_TIME_ZONE" in record.getMessage()
    assert f"WEBSITE_SKU={sku}" in record.getMessage()

    monkeypatch.setenv("WEBSITE_SKU", "ElasticPremium")  # Premium reads it
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeaseScheduleWarning)
        check_schedule(1.5 * HOUR, "0 0 1,3 * * *")


@pytest.mark.parametrize("late", ["ttl", "schedule"])
def test_a_lease_too_short_for_the_schedule_is_named_at_the_first_invocation(
    late: str,
    sqlite_db: TestDatabase,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A TTL given as a %SETTING% is not known at import, and a schedule setting set
    only after it: the lease was then never checked against the schedule (a 60 s
    lease under a 5 minute timer passed without a word). It is checked at the first
    invocation that has both, and logged once."""
    table = orders_table(sqlite_db)
    insert(sqlite_db, table, [{"id": 1, "updated_at": naive(1)}])
    tag = uuid.uuid4().hex[:8]
    app = APP.replace("lease_ttl_seconds=600", f'lease_ttl_seconds="%TTL_{tag}%"')
    # One of the two settings is set only after the import.
    monkeypatch.setenv(
        f"ORDERS_SCHEDULE_{tag}" if late == "ttl" else f"TTL_{tag}",
        ("0 */5 * * * *" if late == "ttl" else "60"),
    )
    path = tmp_path / f"function_app_{tag}.py"
    path.write_text(textwrap.dedent(app.format(tag=tag, url=sqlite_db.url)))
    caplog.set_level(logging.WARNING, logger="dbtrigger")
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeaseScheduleWarning)  # nothing to say at import
        module = load(path, f"function_app_{tag}")
    orders = {f.get_function_name(): f for f in module.app.get_functions()}["orders"]
    monkeypatch.setenv(f"ORDERS_SCHEDULE_{tag}", "0 */5 * * * *")
    monkeypatch.setenv(f"TTL_{tag}", "60")

    for _ in range(2):
        orders.get_user_function()(timer=TimerRequest(past_due=False))
    assert module.SEEN == [1]
    named = [r for r in caplog.records if r.__dict__.get("event") == "lease_schedule_conflict"]
    assert len(named) == 1, [r.getMessage() for r in named]
    assert "lease_ttl_seconds=60" in named[0].getMessage()
    assert "300 s" in named[0].getMessage()
    assert named[0].__dict__["poller"] == "orders"
