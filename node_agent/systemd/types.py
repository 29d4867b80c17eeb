"""Plain values the systemd seam hands out: unit states, job results, unit-file changes.

Kept free of pystemd and of the worker protocol so other layers (and their fakes) can build
them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

JobAction = Literal["start", "stop", "restart"]
JOB_ACTIONS: tuple[JobAction, ...] = ("start", "stop", "restart")

#: ``done``, ``canceled``, ``timeout``, ``failed``, ``dependency``, ``skipped`` come from systemd's
#: JobRemoved signal (``timeout`` also when we stopped waiting: then ``finished`` is False);
#: ``error`` means systemd refused to queue the job (e.g. the unit does not exist).
JobResultName = str
OK_RESULTS = frozenset({"done", "skipped"})


@dataclass(frozen=True, slots=True)
class JobResult:
    """Outcome of one start/stop/restart job."""

    unit: str
    action: JobAction
    result: JobResultName
    #: False when the job was still running at the deadline (it keeps running in systemd).
    finished: bool = True
    #: D-Bus path of the job, None when systemd refused to queue it.
    job: str | None = None
    #: Human-readable detail for anything but success, e.g. the unit's state after a failure.
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.result in OK_RESULTS

    @property
    def still_starting(self) -> bool:
        """A start or restart whose job was still running at the deadline: the unit is on
        its way up (a oneshot doing long work, a slow service), not failed."""
        return self.result == "timeout" and not self.finished and self.action != "stop"

    def describe(self) -> str:
        text = f"{self.action} {self.unit}: {self.result}"
        return f"{text} ({self.message})" if self.message else text


@dataclass(frozen=True, slots=True)
class UnitFileChange:
    """One symlink systemd created or removed while enabling or disabling unit files."""

    kind: str  # "symlink" or "unlink"
    path: str
    source: str


def _from_usec(usec: int | None) -> datetime | None:
    if not usec:
        return None
    return datetime.fromtimestamp(usec / 1_000_000, tz=UTC)


@dataclass(frozen=True, slots=True)
class UnitState:
    """What systemd says about one unit right now."""

    name: str
    #: The unit's own name (differs from ``name`` when ``name`` is an alias).
    id: str
    load_state: str
    active_state: str
    sub_state: str
    unit_file_state: str
    #: Hex of the 128-bit invocation id; "" when the unit never ran. A restart changes it.
    invocation_id: str
    fragment_path: str
    drop_in_paths: tuple[str, ...]
    #: Realtime microseconds of the last active-state change (0: never).
    state_change_timestamp: int = 0
    #: The following are None for units that are not (loaded) services.
    n_restarts: int | None = None
    main_pid: int | None = None
    exec_main_start_timestamp: int | None = None
    result: str | None = None
    #: The service's ``Type`` (``simple``, ``oneshot``, ...); "" for anything but a loaded service.
    service_type: str = ""
    #: Units that start this one (its timers, paths, sockets): systemd's ``TriggeredBy``.
    triggered_by: tuple[str, ...] = ()

    @property
    def exists(self) -> bool:
        return self.load_state not in ("not-found", "")

    @property
    def state_change(self) -> datetime | None:
        return _from_usec(self.state_change_timestamp)

    @property
    def exec_main_start(self) -> datetime | None:
        return _from_usec(self.exec_main_start_timestamp)
