"""Did an apply break a unit that ran before it? The evidence rules of the health gate (pure).

After an update restarted units, the health gate watches each restarted unit that was running
before the apply. A unit counts as broken by the apply when, within the settle window:

- the start or restart job the apply ran for it did not succeed (``failed``, ``timeout``,
  ``dependency``, ...), or
- systemd reports it ``failed``, or
- it restarted itself ``RESTART_LOOP`` times or more (``Restart=`` brought it back each time it
  crashed: a restart loop that never shows as ``failed``).

A unit that was not running before (new, stopped, failed already) never triggers a rollback:
the apply did not take anything from it. Units the OSC asks to stop are not watched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from node_agent.systemd.types import JobResult, UnitState

#: Automatic restarts (systemd's ``NRestarts``) since the apply that count as a restart loop.
RESTART_LOOP = 2
WATCHED_ACTIONS = ("start", "restart")


@dataclass(frozen=True)
class Evidence:
    """Why the health gate rolled an OSC back: the unit and what was seen, in one line."""

    unit: str
    what: str

    def describe(self) -> str:
        return f"{self.unit}: {self.what}"


def ran_before(state: UnitState | None) -> bool:
    """Running when the apply began: loaded and active (or reloading)."""
    return state is not None and state.exists and state.active_state in ("active", "reloading")


def restarts_since(before: int | None, now: int | None) -> int:
    """Automatic restarts between two readings of ``NRestarts`` (systemd resets the counter
    when a job starts the unit, so a smaller value counts from zero)."""
    then, current = before or 0, now or 0
    return current - then if current >= then else current


def watched_units(
    before: Mapping[str, UnitState],
    jobs: Mapping[str, JobResult],
    *,
    agent_unit: str,
) -> dict[str, JobResult]:
    """The units the gate watches: those the apply started or restarted that ran before it.
    The agent's own unit is never watched (it restarts last, after the gate)."""
    return {
        unit: job
        for unit, job in sorted(jobs.items())
        if job.action in WATCHED_ACTIONS and unit != agent_unit and ran_before(before.get(unit))
    }


def unit_evidence(
    unit: str, before: UnitState, job: JobResult | None, now: UnitState | None
) -> Evidence | None:
    """What shows ``unit`` broken since the apply, or None while it looks healthy."""
    if job is not None and not job.ok:
        detail = f" ({job.message})" if job.message else ""
        return Evidence(unit, f"its {job.action} job after the apply ended {job.result}{detail}")
    if now is None or not now.exists:
        return None  # gone from systemd: the OSC removed it, nothing to judge
    if now.active_state == "failed":
        result = f" (result {now.result})" if now.result else ""
        return Evidence(unit, f"failed after the apply{result}")
    loops = restarts_since(before.n_restarts, now.n_restarts)
    if loops >= RESTART_LOOP:
        return Evidence(unit, f"restart loop: restarted itself {loops} times since the apply")
    return None


def first_evidence(
    before: Mapping[str, UnitState],
    jobs: Mapping[str, JobResult | None],
    now: Mapping[str, UnitState],
) -> Evidence | None:
    """The first broken unit (by name) among the watched ``jobs``, or None."""
    for unit in sorted(jobs):
        then = before.get(unit)
        if then is None:
            continue
        found = unit_evidence(unit, then, jobs[unit], now.get(unit))
        if found is not None:
            return found
    return None
