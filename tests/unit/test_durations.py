"""``base.durations.parse_duration``: what is not a duration it can hold is a ValueError.

Every caller (the rollout annotations read by the agents and by ``node-agent fleet``, the
reconciliation-delay annotation, the agent's own config) catches ValueError and nothing else, so
an overflow or a digit only Python takes for one must be a ValueError too (issue 33's harness
found both: a Node annotation of ``99999999999999h`` ended the OSC controller)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from node_agent.base.durations import parse_duration


@pytest.mark.parametrize(
    "value",
    [
        "99999999999999h",  # more days than a timedelta holds
        "9" * 400 + "h",  # a float infinity once multiplied
        "1" * 5000 + "s",
        10**20,
        1e300,
        float("inf"),
        float("nan"),
        "\u0661\u0665s",  # Arabic-Indic digits: Go's ParseDuration refuses them
        "1²s",
        "\uff11s",  # a fullwidth digit
    ],
)
def test_what_no_duration_can_be_is_a_value_error(value: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(value)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("1m30s", 90.0), ("2562047h", 2562047 * 3600.0), (".5m", 30.0), (90, 90.0), ("-1s", -1.0)],
)
def test_durations_still_read(value: object, seconds: float) -> None:
    assert parse_duration(value) == timedelta(seconds=seconds)


def test_a_long_value_is_refused_in_linear_time() -> None:
    """An annotation of 256 KiB of digits is refused at once (a search from every position took
    minutes); the time is measured in regex steps, not asserted in seconds."""
    started = time.process_time()
    for text in ("9" * (256 << 10), "1s" + "9" * (256 << 10)):
        with pytest.raises(ValueError, match="not a Go duration"):
            parse_duration(text)
    assert time.process_time() - started < 5.0
