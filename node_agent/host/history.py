"""The apply history: the last 50 applies, kept in the state directory for ``node-agent status
--history``.

Why: ``status.json`` holds the last apply only; after a rollback, a drift repair or a restart
loop an operator needs to see what happened before it, in order, without a log shipper. Each
entry says when an apply ran, what triggered it, the OSC checksum it went from and to, what it
changed and restarted, what failed item by item, whether it was rolled back, and how long it took.

The file ``apply-history.json`` (mode 0600: a rollback's evidence quotes a unit's journal) is
one JSON document, the entries oldest first; ``StateStore.append_history_async`` rewrites it
atomically (temp file, fsync, rename, directory fsync), so a kill at any point leaves the old or
the new file, never a mix. A file that is not a history document at all is set aside like any
other unreadable state file and the history starts empty; a single entry this agent cannot read
(written by a newer agent, with a trigger it does not know) is left out, the others are kept.
Unknown fields are ignored, so an older agent reads a newer agent's entries and the reverse.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import (
    AwareDatetime,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from node_agent.base import layout
from node_agent.host.documents import ItemFailure

#: The history's file name in the state directory (defined with the other state files).
HISTORY = layout.HISTORY
#: Entries kept; appending drops the oldest beyond this.
HISTORY_LIMIT = 50
#: Names of changed items kept per entry (``items_changed_count`` keeps the full number), so a
#: first apply of a large OSC does not make every later history write large.
ITEMS_LIMIT = 100

Trigger = Literal["secret", "drift", "resume", "annotation", "rollback", "health", "in-place"]
Result = Literal["succeeded", "failed", "rolled-back", "quarantined"]


class HistoryRollback(BaseModel):
    """Why an apply was rolled back, and from which OSC to which."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    unit: str | None = None  # the unit whose failure caused it (None: not a unit's failure)
    evidence: str = ""  # one or a few lines: systemd's result, the journal lines that showed it
    from_checksum: str | None = None  # the bad OSC
    to_checksum: str | None = None  # the OSC restored


class HistoryEntry(BaseModel):
    """One apply (or the restarts requested through the Node's annotation), as it ended.

    ``trigger``: ``secret`` (a new or changed OSC Secret), ``drift`` (the host differed from the
    applied OSC), ``resume`` (a change set interrupted by a crash or restart, finished),
    ``annotation`` (the Node's restart-systemd-services annotation), ``rollback`` (the automatic
    rollback of a bad OSC), ``health`` (a restart by the kubelet/containerd health check),
    ``in-place`` (the outcome of an in-place update: its parts in ``items_changed``, a failure's
    reason in ``error``). ``duration_seconds`` is computed from the two times when not given;
    ``items_changed_count`` is the number of changed items, of which at most ``ITEMS_LIMIT``
    are named."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    started_at: AwareDatetime
    finished_at: AwareDatetime
    duration_seconds: float = Field(ge=0)
    trigger: Trigger
    checksum_from: str | None = None
    checksum_to: str | None = None
    result: Result
    items_changed: tuple[str, ...] = ()  # host paths and unit names
    items_changed_count: int = Field(default=0, ge=0)
    restarted_units: tuple[str, ...] = ()
    failures: tuple[ItemFailure, ...] = ()
    rollback: HistoryRollback | None = None
    error: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _derived(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("duration_seconds") is None:
            started, finished = _moment(data.get("started_at")), _moment(data.get("finished_at"))
            if started is not None and finished is not None:
                data["duration_seconds"] = max(0.0, (finished - started).total_seconds())
        items = data.get("items_changed")
        if items is not None and not isinstance(items, str):
            items = tuple(items)
            data["items_changed"] = items[:ITEMS_LIMIT]
            if data.get("items_changed_count") is None:
                data["items_changed_count"] = len(items)
        return data

    @property
    def items_not_named(self) -> int:
        """Changed items counted but not named (beyond ``ITEMS_LIMIT``)."""
        return max(0, self.items_changed_count - len(self.items_changed))


def _moment(value: Any) -> datetime | None:
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value
    return None


def _readable_entries(value: Any) -> Any:
    """Keep the entries this agent can read; a newer agent's unknown kind of entry is left out
    rather than losing the whole history."""
    if not isinstance(value, list | tuple):
        return value  # not a list: the document is invalid and is set aside
    kept: list[HistoryEntry] = []
    for item in value:
        try:
            kept.append(HistoryEntry.model_validate(item))
        except ValidationError:
            continue
    return kept


class HistoryLog(BaseModel):
    """The persisted document: the last ``HISTORY_LIMIT`` entries, oldest first."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: int = 1
    entries: Annotated[tuple[HistoryEntry, ...], BeforeValidator(_readable_entries)] = ()

    def appended(self, entry: HistoryEntry, limit: int = HISTORY_LIMIT) -> HistoryLog:
        """This log with ``entry`` added last and the oldest dropped beyond ``limit``."""
        entries = (*self.entries, entry)
        return HistoryLog(entries=entries[-limit:] if limit > 0 else ())

    def newest_first(self) -> tuple[HistoryEntry, ...]:
        return tuple(reversed(self.entries))

    def to_json(self) -> bytes:
        return self.model_dump_json(indent=1).encode() + b"\n"


def history_entry(
    *,
    trigger: Trigger,
    result: Result,
    started_at: datetime,
    finished_at: datetime | None = None,
    checksum_from: str | None = None,
    checksum_to: str | None = None,
    items_changed: Sequence[str] = (),
    restarted_units: Sequence[str] = (),
    failures: Sequence[ItemFailure] = (),
    rollback: HistoryRollback | None = None,
    error: str | None = None,
) -> HistoryEntry:
    """A ``HistoryEntry`` ending now (or at ``finished_at``), its duration computed."""
    return HistoryEntry.model_validate(
        {
            "started_at": started_at,
            "finished_at": finished_at or datetime.now(UTC),
            "trigger": trigger,
            "result": result,
            "checksum_from": checksum_from or None,
            "checksum_to": checksum_to or None,
            "items_changed": tuple(items_changed),
            "restarted_units": tuple(restarted_units),
            "failures": tuple(failures),
            "rollback": rollback,
            "error": error,
        }
    )
