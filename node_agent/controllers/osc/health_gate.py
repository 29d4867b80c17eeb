"""The health gate of an update: watch the units it restarted, and roll back one that broke them.

No peer protects a node from the most common bad day: a config update that breaks kubelet on every
node it reaches. Here, before an update (not the first apply) the gate notes which of the applied
OSC's units are running; after the apply it watches the ones the apply started or restarted for a
settle window (``nodeAgent.healthGate.settleWindow``, 30 s). When one of them breaks (rules in
``node_agent.controllers.osc.breakage``), the OSC controller applies the last-known-good OSC again,
which restores that unit's files, unit file and drop-ins and restarts it once, puts the Node
annotation back to the old checksum and quarantines the new checksum until the Secret changes.
By default the update's checksum was reported before the window, as upstream reports it (the
window runs beside the reconcile loop); with the operator's ``reportAfterSettle`` strictness it is
reported only after the window.

The gate's record is persisted before the apply (``health-gate.json``, 0600: it holds the
previous OSC and its resolved secretRef contents), so a kill -9 at any point resumes: during
the apply or the window, the restarted agent watches again; during the rollback, it goes on
rolling back; a quarantine outlives restarts.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict

from node_agent.apply.executor import ApplyReport
from node_agent.base.layout import HEALTH_GATE, HEALTH_GATE_PREVIOUS
from node_agent.base.log import get_logger
from node_agent.config import HealthGateConfig
from node_agent.controllers.osc.breakage import Evidence, first_evidence, ran_before, watched_units
from node_agent.host.documents import Document, LastApplied
from node_agent.host.state import StateStore
from node_agent.osc.plan import Base64Bytes, is_template
from node_agent.systemd import JobResult, SystemdSeam
from node_agent.systemd.types import UnitState

log = get_logger("node-agent.gate")

Phase = Literal["watching", "rolling-back", "quarantined"]


class UnitMark(BaseModel):
    """What the gate remembers of a unit that ran before the apply."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    invocation_id: str = ""
    n_restarts: int | None = None

    def state(self, name: str) -> UnitState:
        return UnitState(
            name=name,
            id=name,
            load_state="loaded",
            active_state="active",
            sub_state="running",
            unit_file_state="",
            invocation_id=self.invocation_id,
            fragment_path="",
            drop_in_paths=(),
            n_restarts=self.n_restarts,
        )


class GateRecord(Document):
    """The gate of one update: watching it, rolling it back, or its quarantine."""

    phase: Phase
    checksum: str  # the update's OSC
    previous_checksum: str  # the last-known-good OSC
    #: its osc.yaml; None: kept as state file HEALTH_GATE_PREVIOUS, a hard link to the last
    #: applied one as the update began (writing up to a MiB before every update would cost in
    #: proportion to the OSC on the way to the restart)
    previous_raw: Base64Bytes | None = None
    previous_resolved: dict[str, Base64Bytes] | None = None
    before: dict[str, UnitMark]  # units running before the apply
    watched: tuple[str, ...] | None = None  # None: the apply has not finished yet
    started_at: AwareDatetime
    unit: str | None = None
    evidence: str | None = None
    decided_at: AwareDatetime | None = None

    def before_states(self) -> dict[str, UnitState]:
        return {name: mark.state(name) for name, mark in self.before.items()}


@dataclass(frozen=True)
class Rollback:
    """The last rollback, for status, metrics and the history."""

    checksum: str
    to_checksum: str
    unit: str
    evidence: str
    at: datetime


@dataclass(frozen=True)
class GateView:
    enabled: bool
    settle_window_seconds: float
    #: the update under watch and the units watched (empty when idle)
    watching: str | None
    watched_units: tuple[str, ...]
    quarantined: str | None
    last_rollback: Rollback | None
    rollbacks: int
    #: the stricter behaviours the operator's ``node-agent-strict.yaml`` turns on (none:
    #: upstream's contract in what Gardener reads)
    strict: tuple[str, ...] = ()


class HealthGate:
    def __init__(
        self,
        systemd: SystemdSeam,
        state: StateStore,
        config: HealthGateConfig,
        *,
        agent_unit: str,
        poll: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        strict: Callable[[], tuple[str, ...]] = tuple,
    ) -> None:
        self.systemd = systemd
        self.strict = strict
        self.state = state
        self.config = config
        self.agent_unit = agent_unit
        self.poll = poll
        self.clock = clock
        self.sleep = sleep
        self._record: GateRecord | None = None
        self._loaded = False
        self.rollbacks = 0
        self.last_rollback: Rollback | None = None

    @property
    def enabled(self) -> bool:
        return self.config.enabled and self.config.settle_window.total_seconds() > 0

    @property
    def window(self) -> float:
        return self.config.settle_window.total_seconds()

    async def record(self) -> GateRecord | None:
        """The persisted record (read once, then kept in memory)."""
        if not self._loaded:
            self._record = await self.state.load_doc_async(HEALTH_GATE, GateRecord)
            self._loaded = True
        return self._record

    async def _save(self, record: GateRecord) -> GateRecord:
        await self.state.save_doc_async(HEALTH_GATE, record)
        self._record, self._loaded = record, True
        return record

    async def clear(self) -> None:
        if await self.record() is not None:
            await self.state.remove_doc_async(HEALTH_GATE)
            await self.state.remove_doc_async(HEALTH_GATE_PREVIOUS)
        self._record, self._loaded = None, True

    async def previous_raw(self, record: GateRecord) -> bytes | None:
        """The last-known-good osc.yaml of ``record``; None when the copy kept of it is gone
        or is not what it was (its checksum differs)."""
        if record.previous_raw is not None:
            return record.previous_raw
        return await self.state.load_kept_async(HEALTH_GATE_PREVIOUS, record.previous_checksum)

    # -- one update ----------------------------------------------------------------------------
    async def begin(
        self, checksum: str, previous: LastApplied, units: Iterable[str]
    ) -> GateRecord | None:
        """Before an update: note which of ``units`` run now. None (no gate) when none does.
        A template (``foo@.service``) never runs by that name and systemd refuses to look it
        up (the whole batch with it), so it is not asked about."""
        names = sorted({u for u in units if u != self.agent_unit and not is_template(u)})
        states = await self.systemd.unit_states(names) if names else {}
        before = {
            name: UnitMark(invocation_id=st.invocation_id, n_restarts=st.n_restarts)
            for name, st in states.items()
            if ran_before(st)
        }
        if not before:
            await self.clear()
            return None
        kept = await self.state.keep_last_applied_async(HEALTH_GATE_PREVIOUS)
        return await self._save(
            GateRecord(
                phase="watching",
                checksum=checksum,
                previous_checksum=previous.checksum,
                previous_raw=None if kept else previous.raw,
                previous_resolved=previous.resolved,
                before=before,
                started_at=datetime.now(UTC),
            )
        )

    async def watch(
        self, record: GateRecord, report: ApplyReport | None, *, window: float | None = None
    ) -> Evidence | None:
        """After the apply: watch the units it (re)started that ran before, for the settle
        window; the first broken one ends the watch. ``report`` None: the apply's outcome was
        lost to a crash, so the units systemd shows restarted since ``record`` are watched."""
        before = record.before_states()
        if report is not None:
            jobs: dict[str, JobResult | None] = dict(
                watched_units(before, report.results, agent_unit=self.agent_unit)
            )
        else:
            now = await self.systemd.unit_states(sorted(before))
            jobs = {u: None for u, st in now.items() if _touched(before[u], st)}
        if not jobs:
            return None
        if record.watched != tuple(jobs):
            record = await self._save(record.model_copy(update={"watched": tuple(jobs)}))
        deadline = self.clock() + (self.window if window is None else window)
        log.info("watching units after the apply", units=sorted(jobs), seconds=self.window)
        found = first_evidence(before, jobs, {})  # a failed job is evidence at once
        while found is None:
            states = await self.systemd.unit_states(sorted(jobs))
            found = first_evidence(before, jobs, states)
            left = deadline - self.clock()
            if found is not None or left <= 0:
                break
            await self.sleep(min(self.poll, left))
        return found

    def remaining(self, record: GateRecord) -> float:
        """What is left of the settle window of ``record`` (at least a few seconds, so a
        resumed watch sees the units at all)."""
        elapsed = (datetime.now(UTC) - record.started_at).total_seconds()
        return max(self.window - elapsed, min(self.window, 5.0))

    async def rolling_back(self, record: GateRecord, evidence: Evidence) -> GateRecord:
        log.error(
            "update broke a unit that ran before it; rolling back",
            checksum=record.checksum,
            to=record.previous_checksum,
            unit=evidence.unit,
            evidence=evidence.what,
        )
        return await self._save(
            record.model_copy(
                update={
                    "phase": "rolling-back",
                    "unit": evidence.unit,
                    "evidence": evidence.what,
                    "decided_at": datetime.now(UTC),
                }
            )
        )

    async def quarantine(self, record: GateRecord) -> Rollback:
        """The rollback is done: keep the bad checksum out until the Secret changes."""
        record = await self._save(
            record.model_copy(update={"phase": "quarantined", "previous_resolved": None})
        )
        self.rollbacks += 1
        self.last_rollback = Rollback(
            checksum=record.checksum,
            to_checksum=record.previous_checksum,
            unit=record.unit or "",
            evidence=record.evidence or "",
            at=record.decided_at or datetime.now(UTC),
        )
        return self.last_rollback

    def view(self) -> GateView:
        record = self._record
        watching = record is not None and record.phase == "watching"
        return GateView(
            enabled=self.enabled,
            settle_window_seconds=self.window,
            watching=record.checksum if record is not None and watching else None,
            watched_units=tuple(record.watched or ()) if record is not None and watching else (),
            quarantined=(
                record.checksum if record is not None and record.phase == "quarantined" else None
            ),
            last_rollback=self.last_rollback,
            rollbacks=self.rollbacks,
            strict=self.strict(),
        )


def _touched(before: UnitState, now: UnitState) -> bool:
    """Restarted (another invocation) or no longer running since ``before``."""
    return now.invocation_id != before.invocation_id or now.active_state != "active"
