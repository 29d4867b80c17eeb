"""``node-agent status --history``: the last applies, newest first, for people or as JSON.

The history file is read directly from the state directory under ``--root``, so the command
works the same whether the agent runs or not, and it writes nothing: an unreadable file is
reported, not set aside (the agent does that when it next reads it). The JSON output is
``{"history": [...]}`` with the entries as they are stored, newest first.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from node_agent.base.durations import human_duration
from node_agent.base.errors import HostIOError, UnsafePathError
from node_agent.base.text import escape_controls
from node_agent.host.history import HISTORY, HISTORY_LIMIT, HistoryEntry, HistoryLog
from node_agent.host.state import STATE_DIR, read_state_file

EXIT_UNREADABLE = 1
NAMES_SHOWN = 8  # changed items named per entry, the rest counted
LIST_SHOWN = 20  # failures (one per line) and restarted units shown per entry
EVIDENCE_LINES = 5
LINE_WIDTH = 300  # characters of one error or evidence line


def history_path(root: Path) -> Path:
    return root / STATE_DIR.lstrip("/") / HISTORY


class HistoryUnreadable(Exception):
    """The history file exists but cannot be read or is not a history document."""


def read_history(root: Path) -> tuple[HistoryLog, int]:
    """The history under ``root`` (empty if there is none yet) and how many stored entries
    this agent could not read (written by a newer agent). Raises ``HistoryUnreadable``."""
    path = history_path(root)
    try:  # never through a symlink, never blocking on a FIFO, never unbounded
        raw = read_state_file(root, HISTORY)
    except UnsafePathError as exc:
        raise HistoryUnreadable(str(exc)) from exc
    except HostIOError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise HistoryUnreadable(f"{path}: {why}") from exc
    if raw is None:
        return HistoryLog(), 0
    try:
        log = HistoryLog.model_validate_json(raw)
    except ValidationError as exc:
        first = str(exc).splitlines()[0]
        raise HistoryUnreadable(f"{path}: not an apply history ({first})") from exc
    stored = json.loads(raw).get("entries")
    skipped = len(stored) - len(log.entries) if isinstance(stored, list) else 0
    return log, max(0, skipped)


def history_document(log: HistoryLog) -> dict[str, Any]:
    """``{"history": [...]}``: the entries as stored, newest first."""
    return {"history": [e.model_dump(mode="json") for e in log.newest_first()]}


def _short(checksum: str | None) -> str:
    return checksum[:12] if checksum else "none"


def _checksums(before: str | None, after: str | None) -> str:
    if before is not None and before == after:
        return f"{_short(after)} (same OSC)"
    return f"{_short(before)} -> {_short(after)}"


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= LINE_WIDTH else line[: LINE_WIDTH - 3] + "..."


def _names(names: Sequence[str], total: int, shown: int) -> str:
    listed = ", ".join(names[:shown])
    rest = total - min(len(names), shown)
    if not listed:
        return "(not named)"
    return f"{listed}, ... and {rest} more" if rest > 0 else listed


def _when(entry: HistoryEntry, now: datetime) -> str:
    local = entry.started_at.astimezone().isoformat(timespec="seconds")
    ago = human_duration((now - entry.started_at).total_seconds())
    return f"{local} ({ago} ago)"


def render_entry(entry: HistoryEntry, now: datetime) -> list[str]:
    """One entry: a headline, then one indented line per fact that is there."""
    head = (
        f"{_when(entry, now)}  {entry.trigger:<10} "
        f"{_checksums(entry.checksum_from, entry.checksum_to)}  "
        f"{entry.result} in {human_duration(entry.duration_seconds)}"
    )
    lines = [head]
    if entry.items_changed_count:
        names = _names(entry.items_changed, entry.items_changed_count, NAMES_SHOWN)
        lines.append(f"  changed ({entry.items_changed_count}): {names}")
    if entry.restarted_units:
        units = entry.restarted_units
        lines.append(f"  restarted ({len(units)}): {_names(units, len(units), LIST_SHOWN)}")
    for failure in entry.failures[:LIST_SHOWN]:
        lines.append(f"  failed {failure.kind} {failure.item}: {_one_line(failure.error)}")
    if len(entry.failures) > LIST_SHOWN:
        lines.append(f"  ... and {len(entry.failures) - LIST_SHOWN} more failures")
    if entry.rollback is not None:
        rb = entry.rollback
        what = rb.unit or "rollback"
        lines.append(
            f"  rolled back because of {what}: "
            f"{_short(rb.from_checksum)} -> {_short(rb.to_checksum)}"
        )
        evidence = [line for line in rb.evidence.splitlines() if line.strip()]
        for line in evidence[:EVIDENCE_LINES]:
            lines.append(f"    {_one_line(line)}")
        if len(evidence) > EVIDENCE_LINES:
            lines.append(f"    ... {len(evidence) - EVIDENCE_LINES} more lines")
    if entry.error:
        lines.append(f"  error: {_one_line(entry.error)}")
    return [escape_controls(line) for line in lines]


def render_history(log: HistoryLog, *, now: datetime | None = None, skipped: int = 0) -> str:
    """The history for people: newest first, one short block per entry."""
    now = now or datetime.now(UTC)
    if not log.entries:
        text = "No applies recorded yet.\n"
    else:
        count = len(log.entries)
        lines = [f"Apply history ({count} of the last {HISTORY_LIMIT}, newest first):"]
        for entry in log.newest_first():
            lines.extend(render_entry(entry, now))
        text = "\n".join(lines) + "\n"
    if skipped:
        text += f"({skipped} entries written by another agent version not shown)\n"
    return text


def run_history(root: Path, *, as_json: bool) -> int:
    """The ``status --history`` command: 0, or 1 if the history file cannot be read."""
    try:
        log, skipped = read_history(root)
    except HistoryUnreadable as exc:
        print(f"apply history unreadable: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if as_json:
        print(json.dumps(history_document(log), indent=2))
    else:
        print(render_history(log, skipped=skipped), end="")
    return 0
