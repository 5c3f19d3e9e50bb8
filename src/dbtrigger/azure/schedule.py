"""The timer schedule of a Functions app, checked against the lease it must fit.

A tick may run until the timer fires again, and a lease shorter than the
timer's interval lets a batch that fits the interval outlive its lease (then
another instance takes over and the batch is delivered twice: window W4). To
say so when the module is imported, the interval is computed here from the
schedule, in either form the Functions host accepts: six-field NCRONTAB
(``{second} {minute} {hour} {day} {month} {day-of-week}``) or an
``hh:mm:ss`` TimeSpan. Pure functions of text; no clock is read.
"""

from __future__ import annotations

import datetime as dt
import logging
import re
import warnings
from collections.abc import Iterator, Mapping

from dbtrigger.errors import ConfigurationError, MissingSettingError
from dbtrigger.settings import resolve_setting

log = logging.getLogger("dbtrigger.azure")


class LeaseScheduleWarning(UserWarning):
    """``lease_ttl_seconds`` is shorter than the timer interval (runtime contract, section 7)."""


#: Full English names, in order: the host's NCrontab takes any leading part of one,
#: in any case ("Mon", "Monday", "thurs"), the first name it begins wins.
_MONTH_NAMES = {
    m: i + 1
    for i, m in enumerate(
        [
            "january",
            "february",
            "march",
            "april",
            "may",
            "june",
            "july",
            "august",
            "september",
            "october",
            "november",
            "december",
        ]
    )
}
_DAY_NAMES = {
    d: i
    for i, d in enumerate(
        ["sunday", "monday", "tuesday", "wednesday", "thursday", "friday", "saturday"]
    )
}
#: (name, lowest, highest, names) of the six NCRONTAB fields. Day-of-week takes 7
#: for Sunday too, but ``*`` and ``n/step`` end at Saturday (6), as the host's do.
_FIELDS: tuple[tuple[str, int, int, Mapping[str, int]], ...] = (
    ("second", 0, 59, {}),
    ("minute", 0, 59, {}),
    ("hour", 0, 23, {}),
    ("day", 1, 31, {}),
    ("month", 1, 12, _MONTH_NAMES),
    ("day-of-week", 0, 7, _DAY_NAMES),
)
_OPEN_END = {"day-of-week": 6}
#: ``hh:mm:ss``, ``d.hh:mm:ss`` and ``d:hh:mm:ss`` (seconds may carry a fraction),
#: and ``dd:hh:mm`` (three numbers, the first 24 or more), as .NET's TimeSpan
#: parses them for the host. ASCII digits only, as NCRONTAB's.
_TIMESPAN = re.compile(r"^(?:(\d+)[.:])?(\d+):(\d{2}):(\d{2})(?:\.(\d{1,7}))?$", re.ASCII)
#: Firings enumerated to find the shortest gap; plenty for any real schedule.
_SAMPLE_FIRINGS = 500
_SAMPLE_YEARS = 5


def _field_values(text: str, name: str, lo: int, hi: int, names: Mapping[str, int]) -> set[int]:
    def number(token: str) -> int:
        key = token.strip().lower()
        if names and key.isascii() and key.isalpha():
            for full, value in names.items():
                if full.startswith(key):
                    return value
        if not (key.isascii() and key.isdigit()):
            what = "a number or the start of an English name" if names else "a number"
            raise ConfigurationError(f"schedule {name} field: {token!r} is not {what}")
        return int(key)

    values: set[int] = set()
    for part in text.split(","):
        body, slash, step_text = part.partition("/")
        step = number(step_text) if slash else 1
        if step < 1:
            raise ConfigurationError(f"schedule {name} field: step must be >= 1 in {part!r}")
        open_end = _OPEN_END.get(name, hi)
        if body in ("*", "?"):
            start, end = lo, open_end
        elif "-" in body:
            first, _, last = body.partition("-")
            start, end = number(first), number(last)
        else:
            start = number(body)
            end = open_end if slash else start
        if not lo <= start <= end <= hi:
            raise ConfigurationError(
                f"schedule {name} field: {part!r} is outside {lo}-{hi} or reversed"
            )
        values.update(range(start, end + 1, step))
    return values


def _firings(fields: list[set[int]], start: dt.datetime) -> Iterator[dt.datetime]:
    seconds, minutes, hours, days, months, weekdays = (sorted(f) for f in fields)
    dow = {d % 7 for d in weekdays}  # 7 is Sunday too
    day = start
    end = start.replace(year=start.year + _SAMPLE_YEARS)
    while day < end:
        # NCRONTAB requires day-of-month AND day-of-week to match.
        if day.month in months and day.day in days and (day.weekday() + 1) % 7 in dow:
            for h in hours:
                for m in minutes:
                    for s in seconds:
                        yield day.replace(hour=h, minute=m, second=s)
        day += dt.timedelta(days=1)


#: The most days each month has (February 29 in a leap year).
_MONTH_DAYS = (31, 29, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
_MONTH_TITLES = [name[:3].title() for name in _MONTH_NAMES]


def _check_some_date(schedule: str, days: set[int], months: set[int]) -> None:
    """Refuse a day and month that never meet (``0 0 0 31 2 *``): the timer would
    never fire, and nothing else would ever say so.

    Every date that exists falls on each day of the week in some year, so the
    day-of-week field cannot make a schedule impossible by itself.
    """
    if any(day <= _MONTH_DAYS[month - 1] for month in months for day in days):
        return
    shown_days = " or ".join(str(d) for d in sorted(days))
    shown_months = ", ".join(_MONTH_TITLES[m - 1] for m in sorted(months))
    have = "has" if len(months) == 1 else "have"
    raise ConfigurationError(
        f"schedule {schedule!r} never fires: {shown_months} {have} no day {shown_days}; "
        "fix its day or month field ({second} {minute} {hour} {day} {month} {day-of-week})"
    )


def schedule_interval(schedule: str) -> dt.timedelta | None:
    """The shortest time between two firings of a Functions timer schedule.

    Accepts the six-field NCRONTAB form (``{second} {minute} {hour} {day}
    {month} {day-of-week}``, with ``*``, ranges, lists, steps and English month
    and day names) and the ``hh:mm:ss`` TimeSpan form. Returns None when the
    schedule fires fewer than twice in five years (``0 0 0 29 2 Mon``).

    Raises:
        ConfigurationError: the schedule is not in either form, or it can never
            fire (a day its months do not have: ``0 0 0 31 2 *``).
    """
    text = schedule.strip()
    span = _TIMESPAN.match(text)
    if span:
        days, hours, minutes, seconds = (int(g) if g else 0 for g in span.groups()[:4])
        fraction = float(f"0.{span.group(5)}") if span.group(5) else 0.0
        if span.group(1) is None and hours >= 24 and not span.group(5):
            # The host reads "24:00:00" as 24 days: dd:hh:mm when the first number is >= 24.
            days, hours, minutes, seconds = hours, minutes, seconds, 0
        if hours > 23 or minutes > 59 or seconds > 59:
            raise ConfigurationError(
                f"schedule {schedule!r}: a TimeSpan's hours must be 0-23 and its minutes and "
                "seconds 0-59 (hh:mm:ss, d.hh:mm:ss, or dd:hh:mm with dd >= 24)"
            )
        interval = dt.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds + fraction)
        if interval <= dt.timedelta(0):
            raise ConfigurationError(f"schedule {schedule!r}: a TimeSpan must be positive")
        return interval
    parts = text.split()
    if len(parts) != len(_FIELDS):
        raise ConfigurationError(
            f"schedule {schedule!r} is not a six-field NCRONTAB expression "
            "('{second} {minute} {hour} {day} {month} {day-of-week}') or an hh:mm:ss TimeSpan"
        )
    fields = [
        _field_values(part, name, lo, hi, names)
        for part, (name, lo, hi, names) in zip(parts, _FIELDS, strict=True)
    ]
    _check_some_date(schedule, fields[3], fields[4])
    shortest: dt.timedelta | None = None
    previous: dt.datetime | None = None
    start = dt.datetime(2024, 1, 1)  # naive on purpose: calendar arithmetic, no real instant
    for count, firing in enumerate(_firings(fields, start)):
        if previous is not None:
            gap = firing - previous
            shortest = gap if shortest is None else min(shortest, gap)
        previous = firing
        if count >= _SAMPLE_FIRINGS:
            break
    return shortest


def lease_schedule_conflict(lease_ttl_seconds: float, schedule: str) -> str | None:
    """Why ``lease_ttl_seconds`` does not suit ``schedule``, or None when it does.

    A tick may run until the timer fires again, and every commit renews the
    lease for another TTL. A TTL shorter than the interval means a batch that
    fits comfortably in the tick's time slot can still outlive its lease; then
    another instance takes over and the batch is delivered twice (window W4).
    A timer faster than the TTL is harmless: overlapping firings find the lease
    taken and return after one read.
    """
    interval = schedule_interval(schedule)
    if interval is None or lease_ttl_seconds >= interval.total_seconds():
        return None
    return (
        f"lease_ttl_seconds={lease_ttl_seconds:g} is shorter than the timer interval "
        f"({interval.total_seconds():g} s) of schedule {schedule!r}: a batch that fits the "
        "interval can outlive its lease and be delivered twice by another instance; set "
        f"lease_ttl_seconds >= {interval.total_seconds():g} (and above the slowest batch)"
    )


def check_schedule(lease_ttl_seconds: float | None, schedule: str | None) -> None:
    """Refuse a schedule that is malformed or never fires; warn when the lease is
    shorter than its interval (not checked when the TTL is not known yet, None)."""
    if schedule is None:
        return
    try:
        resolved = resolve_setting(schedule)
    except MissingSettingError:
        # The host resolves %SETTING% schedules too and reports a missing one itself.
        log.debug("schedule %s is not resolvable here; not checked against the lease", schedule)
        return
    if lease_ttl_seconds is None:
        schedule_interval(resolved)
        return
    problem = lease_schedule_conflict(lease_ttl_seconds, resolved)
    if problem:
        # stacklevel: warn -> check_schedule -> decorator -> the user's module
        warnings.warn(problem, LeaseScheduleWarning, stacklevel=3)


__all__ = ["LeaseScheduleWarning", "check_schedule", "lease_schedule_conflict", "schedule_interval"]
