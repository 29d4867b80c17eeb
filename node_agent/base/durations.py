"""Go durations (``1m30s``, ``10m``, ``250ms``) as Gardener's config and annotations spell them.

Read and written in many places (the component config, the reconciliation-delay annotation, the
rollout annotations, messages), so they live in the base and depend on nothing."""

from __future__ import annotations

import math
import re
from datetime import timedelta

#: ASCII digits only, as Go reads them (``\d`` alone takes any Unicode digit)
_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)", re.ASCII)
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
    """Parse a Go duration (``1m30s``, ``10m``, ``1h``, ``250ms``) or a number of seconds.

    Anything else, a duration too long for a ``timedelta`` (about 2.7 million years) or one
    that is not finite included, is a ValueError: every caller catches that, and nothing else.
    """
    if isinstance(value, timedelta):
        return value
    if isinstance(value, int | float) and not isinstance(value, bool):
        return _seconds(float(value), value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"not a duration: {value!r}")
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    text = text.lstrip("+-")
    if text == "0":
        return timedelta(0)
    pos, seconds = 0, 0.0
    # each part matched where the last ended: a search from every position would be quadratic
    while match := _DURATION_PART.match(text, pos):
        seconds += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
        pos = match.end()
    if pos != len(text) or pos == 0:
        raise ValueError(f"not a Go duration: {value!r} (examples: 30s, 1m30s, 10m, 1h)")
    return _seconds(sign * seconds, value)


def _seconds(seconds: float, value: object) -> timedelta:
    try:
        return timedelta(seconds=seconds)
    except (OverflowError, ValueError) as exc:  # infinite, NaN, or beyond timedelta.max
        raise ValueError(f"not a duration this agent can hold: {value!r}"[:200]) from exc


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
        out += f"{seconds:.9g}s"
    return sign + out


#: nanoseconds per unit, as Go's time.ParseDuration knows them (both micro signs)
_GO_UNITS_NS = {
    "ns": 1,
    "us": 1_000,
    "\u00b5s": 1_000,
    "\u03bcs": 1_000,
    "ms": 1_000_000,
    "s": 1_000_000_000,
    "m": 60_000_000_000,
    "h": 3_600_000_000_000,
}
_GO_UNIT = re.compile(r"[^0-9.]+")
_INT64_LIMIT = 1 << 63


def _leading_digits(text: str) -> int:
    return len(text) - len(text.lstrip("0123456789"))


def parse_go_duration_ns(text: str) -> int:
    """A duration exactly as Go's ``time.ParseDuration`` reads it, in nanoseconds.

    Stricter than :func:`parse_duration`: no spaces, one optional sign, a unit on every number,
    the int64 range, Go's rounding of fractions. The component config is decoded this way so
    that the agent accepts what upstream accepts and refuses what it refuses."""
    bad = ValueError(f"not a Go duration: {text!r} (examples: 30s, 1m30s, 10m, 1h)")
    rest = text
    negative = False
    if rest[:1] in ("-", "+"):
        negative = rest[0] == "-"
        rest = rest[1:]
    if rest == "0":
        return 0
    if not rest:
        raise bad
    total = 0
    while rest:
        n = _leading_digits(rest)
        whole, rest = rest[:n], rest[n:]
        value = 0
        for digit in whole:  # Go stops at 2**63 (the magnitude of the smallest int64)
            value = value * 10 + int(digit)
            if value > _INT64_LIMIT:
                raise bad
        fraction, scale = 0, 1.0
        has_fraction = False
        if rest[:1] == ".":
            n = _leading_digits(rest[1:])
            digits, rest = rest[1 : 1 + n], rest[1 + n :]
            has_fraction = n > 0
            for digit in digits:  # digits beyond int64 precision are dropped, as Go does
                if fraction > (_INT64_LIMIT - 1) // 10 or fraction * 10 + int(digit) > _INT64_LIMIT:
                    break
                fraction = fraction * 10 + int(digit)
                scale *= 10
        if not whole and not has_fraction:
            raise bad
        unit = _GO_UNIT.match(rest)
        per_unit = _GO_UNITS_NS.get(unit.group()) if unit else None
        if unit is None or per_unit is None:
            raise bad
        rest = rest[unit.end() :]
        if value > _INT64_LIMIT // per_unit:
            raise bad
        value *= per_unit
        if fraction > 0:
            value += int(float(fraction) * (float(per_unit) / scale))
            if value > _INT64_LIMIT:
                raise bad
        total += value
        if total > _INT64_LIMIT:
            raise bad
    if not negative and total > _INT64_LIMIT - 1:
        raise bad
    return -total if negative else total


def human_duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h03m``, ``4d02h``: short, for people."""
    if not math.isfinite(seconds):  # read from a state file: not always a number of seconds
        return "unknown"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"
