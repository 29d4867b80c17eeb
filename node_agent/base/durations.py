"""Go durations (``1m30s``, ``10m``, ``250ms``) as Gardener's config and annotations spell them.

Read and written in many places (the component config, the reconciliation-delay annotation, the
rollout annotations, messages), so they live in the base and depend on nothing."""

from __future__ import annotations

import re
from datetime import timedelta

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}


def parse_duration(value: object) -> timedelta:
    """Parse a Go duration (``1m30s``, ``10m``, ``1h``, ``250ms``) or a number of seconds."""
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return timedelta(seconds=float(value))
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"not a duration: {value!r}")
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("+-")
    if text == "0":
        return timedelta(0)
    pos, seconds = 0, 0.0
    for match in _DURATION_PART.finditer(text):
        if match.start() != pos:
            break
        seconds += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(text) or pos == 0:
        raise ValueError(f"not a Go duration: {value!r} (examples: 30s, 1m30s, 10m, 1h)")
    return timedelta(seconds=sign * seconds)


def format_duration(value: timedelta) -> str:
    """The shortest Go-style spelling of a duration, e.g. ``1m30s``."""
    total = value.total_seconds()
    if total == 0:
        return "0s"
    sign = "-" if total < 0 else ""
    total = abs(total)
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    out = ""
    if hours:
        out += f"{int(hours)}h"
    if minutes:
        out += f"{int(minutes)}m"
    if seconds or not out:
        out += f"{seconds:g}s"
    return sign + out
