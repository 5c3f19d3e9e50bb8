"""The timer schedule of a Functions app, checked against the lease it must fit.

A tick may run until the timer fires again, and a lease shorter than the
timer's interval lets a batch that fits the interval outlive its lease (then
another instance takes over and the batch is delivered twice: window W4). To
say so when the module is imported, the interval is computed here from the
schedule, in either form the Functions host accepts: six-field NCRONTAB
(``{second} {minute} {hour} {day} {month} {day-of-week}``) or an
``hh:mm:ss`` TimeSpan. Pure functions of text; no clock is read.

A schedule given as a ``%SETTING%`` is the app's configuration, not code: a
setting that is missing or malformed must not fail the import of
``function_app.py`` (the host would then index no function of the app at
all). It is reported when the module is imported (a warning naming the
setting) and fails each invocation of the function that uses it, as a
:class:`~dbtrigger.settings.DeferredSettingError` naming the setting and what
to set, until it is fixed (:func:`checked_schedule`). A literal schedule in
code that is malformed is refused at import, as any other mistake in code.

``WEBSITE_TIME_ZONE`` makes the host fire NCRONTAB schedules on that zone's
wall clock (TimeSpans are not affected). Across a daylight-saving change a
daily ``0 30 2 * * *`` is then 23 hours from one firing to the next, so the
interval is measured in that zone, between the instants the local firings
are. As the host's ``CronSchedule`` does, a local time the change skips is
read with the offset before it (02:30 the night clocks go from 02:00 to 03:00
is 03:30), and a repeated one as its first occurrence; the host also fires an
interval schedule (``*``, ``/`` or ``-`` in its time fields) in the repeated
hour, at the same spacing, which makes no gap shorter. A zone this machine
does not know (a Windows name such as ``W. Europe Standard Time``, which only
Windows plans read, or a typo) is reported with a warning naming the setting,
and the interval is measured in UTC, as a Linux host runs the timer then. So
is the setting on a Consumption or Flex Consumption plan (``WEBSITE_SKU``
``Dynamic`` or ``FlexConsumption``), whose Linux hosts do not read it.
"""

from __future__ import annotations

import bisect
import datetime as dt
import functools
import logging
import re
import warnings
import zoneinfo
from collections.abc import Iterator, Mapping

from dbtrigger.errors import ConfigurationError, MissingSettingError
from dbtrigger.settings import DeferredSettingError, environment, resolve_setting, setting_name

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
#: Firings looked at around each change of a zone's offset (WEBSITE_TIME_ZONE): the
#: wall-clock times it skips or repeats (an hour, mostly), one a second at most.
_ZONE_CHANGE_FIRINGS = 3 * 3600
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


def _firings(
    fields: list[set[int]], start: dt.datetime, end: dt.datetime | None = None
) -> Iterator[dt.datetime]:
    """The firings (naive, local) from ``start`` (a day: from its midnight; a moment:
    from it on) to ``end`` (default: the sampled years)."""
    seconds, minutes, hours = (sorted(f) for f in fields[:3])
    days, months, weekdays = fields[3:]
    dow = {d % 7 for d in weekdays}  # 7 is Sunday too
    day = start.replace(hour=0, minute=0, second=0, microsecond=0)
    end = end or day.replace(year=day.year + _SAMPLE_YEARS)
    after: tuple[int, int, int] | None = (start.hour, start.minute, start.second)
    while day < end:
        # NCRONTAB requires day-of-month AND day-of-week to match.
        if day.month in months and day.day in days and (day.weekday() + 1) % 7 in dow:
            for h, m, s in _times_from(hours, minutes, seconds, after or (0, 0, 0)):
                yield day.replace(hour=h, minute=m, second=s)
        day += dt.timedelta(days=1)
        after = None


def _times_from(
    hours: list[int], minutes: list[int], seconds: list[int], after: tuple[int, int, int]
) -> Iterator[tuple[int, int, int]]:
    """The times of day of the fields, in order, from ``after`` (h, m, s) on."""
    for h in hours[bisect.bisect_left(hours, after[0]) :]:
        m_from = after[1] if h == after[0] else 0
        for m in minutes[bisect.bisect_left(minutes, m_from) :]:
            s_from = after[2] if (h, m) == after[:2] else 0
            for s in seconds[bisect.bisect_left(seconds, s_from) :]:
                yield h, m, s


def _last_before(fields: list[set[int]], moment: dt.datetime) -> dt.datetime | None:
    """The last firing (naive, local) before ``moment``, within the sampled years."""
    seconds, minutes, hours = (sorted(f) for f in fields[:3])
    days, months, weekdays = fields[3:]
    dow = {d % 7 for d in weekdays}
    day = moment.replace(hour=0, minute=0, second=0, microsecond=0)
    cut = (moment.hour, moment.minute, moment.second)
    for _ in range(366 * _SAMPLE_YEARS):
        if day.month in months and day.day in days and (day.weekday() + 1) % 7 in dow:
            found = [(h, m, s) for h in hours for m in minutes for s in (seconds[0], seconds[-1])]
            earlier = [t for t in found if t < cut]
            if earlier:  # the last one before the cut: its second is the last below it
                h, m, _s = max(earlier)
                below = [s for s in seconds if (h, m, s) < cut]
                return day.replace(hour=h, minute=m, second=below[-1])
        day -= dt.timedelta(days=1)
        cut = (24, 0, 0)
    return None


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


def _shortest_gap(
    firings: Iterator[dt.datetime], zone: dt.tzinfo | None, limit: int
) -> dt.timedelta | None:
    """The shortest time between the first ``limit`` of ``firings`` (local wall-clock
    times), measured between the instants they are in ``zone`` (None: as given).
    Two local times that are one instant (a skipped hour) are one firing."""
    shortest: dt.timedelta | None = None
    previous: dt.datetime | None = None
    for count, firing in enumerate(firings):
        instant = firing.replace(tzinfo=zone).astimezone(dt.timezone.utc) if zone else firing
        if previous is not None and instant > previous:
            gap = instant - previous
            shortest = gap if shortest is None else min(shortest, gap)
        previous = instant if previous is None else max(previous, instant)
        if count >= limit:
            break
    return shortest


def _zone_changes(zone: dt.tzinfo, start: dt.datetime) -> list[tuple[dt.datetime, dt.datetime]]:
    """Each change of ``zone``'s offset in the sampled years, as the wall-clock times
    (naive) it goes from and to: (02:00, 03:00) when clocks go forward an hour,
    (03:00, 02:00) when they go back."""
    changes = []
    day = start
    end = start.replace(year=start.year + _SAMPLE_YEARS)
    offset = day.replace(tzinfo=zone).utcoffset()
    while day < end:
        following = day + dt.timedelta(days=1)
        next_offset = following.replace(tzinfo=zone).utcoffset()
        if next_offset != offset:
            changes.append(_change_on(zone, day, following))
        day, offset = following, next_offset
    return changes


def _change_on(
    zone: dt.tzinfo, day: dt.datetime, following: dt.datetime
) -> tuple[dt.datetime, dt.datetime]:
    low = day.replace(tzinfo=zone).astimezone(dt.timezone.utc)
    high = following.replace(tzinfo=zone).astimezone(dt.timezone.utc)
    before = low.astimezone(zone).utcoffset()
    while high - low > dt.timedelta(seconds=1):  # the instant of the change, to the second
        middle = low + (high - low) / 2
        if middle.astimezone(zone).utcoffset() == before:
            low = middle
        else:
            high = middle
    old = (high + (before or dt.timedelta(0))).replace(tzinfo=None, microsecond=0)
    new = high.astimezone(zone).replace(tzinfo=None, microsecond=0)
    return old, new


def _gap_across_change(
    fields: list[set[int]], zone: dt.tzinfo, old: dt.datetime, new: dt.datetime
) -> dt.timedelta | None:
    """The shortest time between two firings around a change of ``zone``'s offset from
    wall-clock time ``old`` to ``new``: from the last firing before the wall-clock
    times the change skips or repeats to the first after them. Every other pair of
    firings is as far apart as on the wall clock."""
    first, last = min(old, new), max(old, new)
    start = _last_before(fields, first) or first

    def near() -> Iterator[dt.datetime]:
        for firing in _firings(fields, start, last + dt.timedelta(days=366)):
            yield firing
            if firing > last:
                return

    return _shortest_gap(near(), zone, _ZONE_CHANGE_FIRINGS)


def schedule_interval(schedule: str, zone: dt.tzinfo | None = None) -> dt.timedelta | None:
    """The shortest time between two firings of a Functions timer schedule.

    Accepts the six-field NCRONTAB form (``{second} {minute} {hour} {day}
    {month} {day-of-week}``, with ``*``, ranges, lists, steps and English month
    and day names) and the ``hh:mm:ss`` TimeSpan form. Returns None when the
    schedule fires fewer than twice in five years (``0 0 0 29 2 Mon``).
    ``zone``: the zone whose wall clock an NCRONTAB schedule follows
    (``WEBSITE_TIME_ZONE``); the gaps are measured between real instants, so
    across a daylight-saving change a daily schedule is 23 hours apart.

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
    start = dt.datetime(2024, 1, 1)  # naive on purpose: calendar arithmetic, no real instant
    shortest = _shortest_gap(_firings(fields, start), zone, _SAMPLE_FIRINGS)
    if zone is None or (shortest is not None and shortest <= dt.timedelta(seconds=1)):
        return shortest  # a second apart: no change of offset makes it shorter
    # The sample may end long before the first change of the zone's offset: look at
    # the firings around each change too (the day before it to the day after).
    for old, new in _zone_changes(zone, start):
        gap = _gap_across_change(fields, zone, old, new)
        if gap is not None and (shortest is None or gap < shortest):
            shortest = gap
    return shortest


def lease_schedule_conflict(
    lease_ttl_seconds: float, schedule: str, zone: dt.tzinfo | None = None
) -> str | None:
    """Why ``lease_ttl_seconds`` does not suit ``schedule``, or None when it does.

    A tick may run until the timer fires again, and every commit renews the
    lease for another TTL. A TTL shorter than the interval means a batch that
    fits comfortably in the tick's time slot can still outlive its lease; then
    another instance takes over and the batch is delivered twice (window W4).
    A timer faster than the TTL is harmless: overlapping firings find the lease
    taken and return after one read.
    """
    interval = schedule_interval(schedule, zone)
    if interval is None or lease_ttl_seconds >= interval.total_seconds():
        return None
    return (
        f"lease_ttl_seconds={lease_ttl_seconds:g} is shorter than the timer interval "
        f"({interval.total_seconds():g} s) of schedule {schedule!r}: a batch that fits the "
        "interval can outlive its lease and be delivered twice by another instance; set "
        f"lease_ttl_seconds >= {interval.total_seconds():g} (and above the slowest batch)"
    )


#: The app setting that makes the host fire NCRONTAB schedules on a zone's wall clock.
TIME_ZONE_SETTING = "WEBSITE_TIME_ZONE"


#: The plans (``WEBSITE_SKU``, set by the platform) whose Linux hosts ignore
#: ``WEBSITE_TIME_ZONE``: Consumption and Flex Consumption fire schedules in UTC.
_UTC_ONLY_SKUS = frozenset({"dynamic", "flexconsumption"})


def host_time_zone(environ: Mapping[str, str] | None = None) -> dt.tzinfo | None:
    """The zone of ``WEBSITE_TIME_ZONE`` (None: not set, or UTC). A name this machine
    does not know, or a plan that ignores the setting, is logged as a warning, once,
    and read as UTC, as the host then fires the schedule."""
    env = environment(environ)
    name = env.get(TIME_ZONE_SETTING, "").strip()
    if not name:
        return None
    return _zone(name, env.get("WEBSITE_SKU", "").strip())


@functools.lru_cache(maxsize=8)
def _zone(name: str, sku: str) -> dt.tzinfo | None:
    if sku.lower() in _UTC_ONLY_SKUS:
        log.warning(
            "app setting %s is %r, but this plan (WEBSITE_SKU=%s: Consumption or Flex "
            "Consumption on Linux) does not read it: the host fires timer schedules in "
            "UTC, and their intervals are measured in UTC. Write the schedule in UTC, or "
            "move to a Premium or Dedicated plan to use a time zone",
            TIME_ZONE_SETTING,
            name,
            sku,
            extra={"event": "time_zone_ignored", "setting": TIME_ZONE_SETTING},
        )
        return None
    try:
        return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError, OSError):
        log.warning(
            "app setting %s is %r, which is not a time zone this machine knows: the timer "
            "schedule's interval is measured in UTC. A Linux Function App needs an IANA "
            "name such as Europe/Berlin (Windows names like 'W. Europe Standard Time' are "
            "read on Windows plans only)",
            TIME_ZONE_SETTING,
            name,
            extra={"event": "time_zone_unknown", "setting": TIME_ZONE_SETTING},
        )
        return None


@functools.lru_cache(maxsize=64)
def _interval(schedule: str, zone: dt.tzinfo | None) -> dt.timedelta | None:
    return schedule_interval(schedule, zone)


def checked_schedule(schedule: str, environ: Mapping[str, str] | None = None) -> str:
    """``schedule``, its ``%SETTING%`` resolved and checked (malformed, never fires).

    Raises:
        DeferredSettingError: ``schedule`` is a ``%SETTING%`` that is missing or
            holds no schedule the host accepts; names the setting and what to set.
        ConfigurationError: a literal ``schedule`` is malformed or never fires.
    """
    name = setting_name(schedule)
    forms = (
        "a six-field NCRONTAB expression ('{second} {minute} {hour} {day} {month} "
        "{day-of-week}', e.g. '0 */5 * * * *') or an hh:mm:ss TimeSpan"
    )
    try:
        resolved = resolve_setting(schedule, environ)
    except MissingSettingError as exc:
        raise DeferredSettingError(
            f"the timer schedule {schedule} reads app setting {name!r}, which is not set: "
            f"set {name} to {forms}",
            setting=name,
        ) from exc
    try:
        _interval(resolved, host_time_zone(environ))
    except ConfigurationError as exc:
        if name is None:
            raise
        raise DeferredSettingError(
            f"the timer schedule {schedule}: app setting {name!r} holds no schedule the "
            f"Functions host runs: {exc}. Fix {name} (e.g. '0 */5 * * * *' for every "
            "five minutes)",
            setting=name,
        ) from exc
    return resolved


class ScheduleCheck:
    """What each invocation of a function checks of its ``schedule=``: a ``%SETTING%``
    resolved again (the invocation fails until it is right, :func:`checked_schedule`),
    and, once, the lease against the interval when the import could not (the TTL a
    ``%SETTING%`` of its own, or the schedule's setting not usable yet): a conflict
    is then a warning in the log (``lease_schedule_conflict``), naming the poller."""

    def __init__(self, schedule: str, *, lease_checked: bool) -> None:
        self.schedule = schedule
        self.setting = setting_name(schedule) is not None
        self.lease_checked = lease_checked

    def resolved(self) -> str:
        """The schedule, its setting read again.

        Raises:
            DeferredSettingError: the schedule's setting is missing or malformed.
        """
        return checked_schedule(self.schedule) if self.setting else self.schedule

    def check_lease(self, poller: str, lease_ttl_seconds: float, resolved: str) -> None:
        """Log a lease shorter than the interval of ``resolved``, once, when the import
        could not tell."""
        if self.lease_checked:
            return
        self.lease_checked = True
        problem = lease_schedule_conflict(lease_ttl_seconds, resolved, host_time_zone())
        if problem:
            log.warning(
                "poller %s: %s",
                poller,
                problem,
                extra={"event": "lease_schedule_conflict", "poller": poller},
            )


def check_schedule(lease_ttl_seconds: float | None, schedule: str | None) -> ScheduleCheck | None:
    """Refuse a literal schedule that is malformed or never fires; warn when the lease
    is shorter than its interval (checked at the first invocation instead when the TTL
    is not known yet, None).

    A ``%SETTING%`` schedule that is missing or malformed is only logged here (a
    warning naming the setting): the app still imports and indexes every other
    function. Returns what the function's invocations check (:class:`ScheduleCheck`),
    None without a schedule.
    """
    if schedule is None:
        return None
    try:
        resolved = checked_schedule(schedule)
    except DeferredSettingError as exc:
        log.warning(
            "%s; this function fails each invocation until it is fixed",
            exc,
            extra={"event": "schedule_setting_unusable", "setting": setting_name(schedule)},
        )
        return ScheduleCheck(schedule, lease_checked=False)
    if lease_ttl_seconds is None:
        return ScheduleCheck(schedule, lease_checked=False)
    problem = lease_schedule_conflict(lease_ttl_seconds, resolved, host_time_zone())
    if problem:
        # stacklevel: warn -> check_schedule -> decorator -> the user's module
        warnings.warn(problem, LeaseScheduleWarning, stacklevel=3)
    return ScheduleCheck(schedule, lease_checked=True)


__all__ = [
    "TIME_ZONE_SETTING",
    "LeaseScheduleWarning",
    "ScheduleCheck",
    "check_schedule",
    "checked_schedule",
    "host_time_zone",
    "lease_schedule_conflict",
    "schedule_interval",
]
