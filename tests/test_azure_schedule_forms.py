"""Timer schedules written the ways the Functions host's NCRONTAB parser accepts them.

``schedule=`` on ``@db.trigger`` (required on ``partitioned_trigger``) is checked
when the module is imported, so a form the host accepts but this check refuses
stops the whole Function App from indexing, and a form read differently gives
the lease check a wrong interval.
"""

from __future__ import annotations

import pytest

from dbtrigger.azure import schedule_interval
from dbtrigger.errors import ConfigurationError

DAY = 86400


@pytest.mark.parametrize(
    ("schedule", "seconds"),
    [
        # NCrontab takes any leading part of an English name, in any case.
        ("0 0 9 * * Monday", 7 * DAY),
        ("0 0 9 * * thurs", 7 * DAY),
        ("0 0 9 * * Monday-Friday", DAY),
        ("0 0 0 1 September *", 365 * DAY),
        ("0 0 0 1 January,July *", 181 * DAY),
        # A start with a step runs to the field's end: Saturday (6) for day-of-week.
        ("0 0 0 * * Mon/2", 2 * DAY),
        ("0 0 0 * * 1/2", 2 * DAY),
        ("0 0 0 * * 2/5", 7 * DAY),
    ],
)
def test_name_and_step_forms_the_host_accepts(schedule: str, seconds: int) -> None:
    interval = schedule_interval(schedule)
    assert interval is not None
    assert interval.total_seconds() == seconds


@pytest.mark.parametrize(
    ("schedule", "field"),
    [
        ("0 */ * * * *", "minute"),  # a step with no number: the host refuses it
        ("0 0 0 * * Mondays", "day-of-week"),  # not a leading part of a name
        ("0 0 0 * Jan- *", "month"),
    ],
)
def test_forms_the_host_refuses_are_refused_naming_the_field(schedule: str, field: str) -> None:
    with pytest.raises(ConfigurationError, match=f"schedule {field} field"):
        schedule_interval(schedule)
