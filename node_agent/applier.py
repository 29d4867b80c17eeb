"""The apply pipeline shared by the OSC controller and ``node-agent apply``.

decode (caller) → plan against the last applied OSC (pure) → persist the change set → execute
→ remove orphans → persist last-applied. Anything left by a crash is finished first, and
anything the agent created that no OSC wants any more is removed (upstream leaks those when an
OSC never succeeds).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from node_agent.errors import ApplyError, NodeAgentError
from node_agent.executor import ApplyReport, Executor
from node_agent.host.fs import HostFS
from node_agent.host.state import (
    UNIT_DIR,
    UNIT_FILE_MODE,
    ApplyRecord,
    StateStore,
    dropin_path,
    unit_path,
)
from node_agent.log import get_logger
from node_agent.osc.decode import parse_osc, sha256_hex
from node_agent.osc.merge import osc_files, osc_units
from node_agent.osc.models import OperatingSystemConfig
from node_agent.osc.plan import ChangeSet, UnitCommand, plan
from node_agent.systemd import JobResult, SystemdSeam

log = get_logger("node-agent.apply")


@dataclass
class Outcome:
    checksum: str
    change_set: ChangeSet
    report: ApplyReport
    resumed: bool = False
    orphans_removed: list[str] = field(default_factory=list)

    @property
    def restarts_agent(self) -> bool:
        return self.change_set.restarts_agent


def desired_paths(osc: OperatingSystemConfig, host_name: str) -> set[str]:
    """Every host path the OSC wants to exist: files, unit files, drop-ins."""
    paths = {f.path for f in osc_files(osc, host_name)}
    for unit in osc_units(osc):
        if unit.content is not None:
            paths.add(unit_path(unit.name))
        paths |= {dropin_path(unit.name, d.name) for d in unit.drop_ins}
    return paths


class Applier:
    def __init__(
        self,
        fs: HostFS,
        state: StateStore,
        systemd: SystemdSeam | None,
        *,
        host_name: str,
        agent_unit: str,
        job_timeout: float = 60.0,
        on_command: Callable[[UnitCommand, JobResult], None] | None = None,
    ) -> None:
        self.fs = fs
        self.state = state
        self.systemd = systemd
        self.host_name = host_name
        self.agent_unit = agent_unit
        self._parsed: tuple[str, OperatingSystemConfig] | None = None  # last applied, parsed
        self.executor = Executor(fs, systemd, state, job_timeout=job_timeout, on_command=on_command)

    def previous(self) -> tuple[OperatingSystemConfig | None, Mapping[str, bytes] | None, str]:
        last = self.state.load_last_applied()
        if last is None:
            return None, None, ""
        cached = self._parsed
        if cached is not None and cached[0] == last.checksum:
            return cached[1], last.resolved, last.checksum
        try:
            osc = parse_osc(last.raw)
        except NodeAgentError as exc:
            log.warning("last applied OSC unreadable; planning from scratch", error=str(exc))
            return None, None, ""
        self._parsed = (last.checksum, osc)
        return osc, last.resolved, last.checksum

    def plan(self, osc: OperatingSystemConfig, resolved: Mapping[str, bytes]) -> ChangeSet:
        previous, previous_resolved, _ = self.previous()
        return plan(
            previous,
            osc,
            self.host_name,
            resolved,
            previous_resolved=previous_resolved,
            agent_unit=self.agent_unit,
        )

    def applied_checksum(self) -> str:
        """sha256 of the last applied osc.yaml ('' if none); cheap: no parsing."""
        last = self.state.load_last_applied()
        return last.checksum if last is not None else ""

    async def apply(
        self, raw: bytes, osc: OperatingSystemConfig, checksum: str, resolved: Mapping[str, bytes]
    ) -> Outcome:
        """Bring the host to ``osc``; raises ApplyError (state kept for a retry) on failure."""
        started = time.monotonic()
        pending = self.state.pending()
        if pending is not None:
            log.info(
                "resuming an interrupted apply",
                checksum=pending.osc_checksum,
                remaining=len(pending.remaining()),
            )
            try:
                resumed = await self.executor.execute(pending)
            except NodeAgentError as exc:
                # Re-planning from the last applied OSC yields these steps again (steps are
                # idempotent), so dropping the journal loses nothing and cannot loop forever.
                log.warning("resuming failed; planning afresh", error=str(exc))
                self.state.finish()
            else:
                if pending.osc_checksum == checksum:
                    return await self._complete(
                        raw,
                        osc,
                        checksum,
                        resolved,
                        pending.change_set,
                        resumed,
                        started,
                        resumed=True,
                    )
                self.state.finish()  # a newer OSC arrived; the old one's orphans go below

        change_set = await asyncio.to_thread(self.plan, osc, resolved)
        self.preflight(change_set)
        pending = self.state.begin(change_set, checksum)
        try:
            report = await self.executor.execute(pending)
        except ApplyError as exc:
            self.state.finish()
            self._record(checksum, started, error=str(exc), report=exc.report)
            raise
        return await self._complete(raw, osc, checksum, resolved, change_set, report, started)

    def drifted(self, full: ChangeSet) -> set[str]:
        """Host paths whose bytes or mode no longer match what the OSC says (edited, deleted)."""
        wanted: dict[str, tuple[str | None, int]] = {
            f.path: (f.sha256, f.mode) for f in full.files_to_write if f.content is not None
        }
        for u in full.units_to_write:
            wanted[unit_path(u.name)] = (sha256_hex(u.content.encode()), UNIT_FILE_MODE)
        for d in full.dropins_to_write:
            wanted[dropin_path(d.unit, d.name)] = (sha256_hex(d.content.encode()), UNIT_FILE_MODE)
        return {
            path
            for path, (digest, mode) in wanted.items()
            if not self.fs.stat_matches(path, sha256=digest, mode=mode)
        }

    async def repair_drift(
        self, osc: OperatingSystemConfig, resolved: Mapping[str, bytes] | None
    ) -> Outcome | None:
        """Re-check the disk against the applied OSC (upstream trusts the checksum forever):
        rewrite what drifted and restart exactly the units that depend on it."""
        last = self.state.load_last_applied()
        if last is None or self.state.pending() is not None:
            return None
        refs = resolved if resolved is not None else (last.resolved or {})
        try:
            full = await asyncio.to_thread(
                plan, None, osc, self.host_name, refs, agent_unit=self.agent_unit
            )
        except NodeAgentError as exc:  # e.g. secretRef contents unknown: cannot compare
            log.info("drift check skipped", reason=str(exc))
            return None
        drifted = await asyncio.to_thread(self.drifted, full)
        if not drifted:
            return None
        repair = drift_change_set(full, drifted, osc)
        log.warning("host drifted from the applied OSC; repairing", paths=sorted(drifted))
        started = time.monotonic()
        self.preflight(repair)
        pending = self.state.begin(repair, last.checksum)
        try:
            report = await self.executor.execute(pending)
        finally:
            self.state.finish()
        report.duration = time.monotonic() - started
        self._record(last.checksum, started, report=report)
        return Outcome(last.checksum, repair, report)

    def preflight(self, cs: ChangeSet) -> None:
        """Refuse the whole change set before any write if one of its paths is unsafe on this
        host (e.g. a parent symlink planted under /etc): nothing is then half-applied."""
        paths = [f.path for f in cs.files_to_write] + [f.path for f in cs.files_to_delete]
        paths += [unit_path(u.name) for u in cs.units_to_write]
        paths += [dropin_path(d.unit, d.name) for d in cs.dropins_to_write]
        paths += [dropin_path(d.unit, d.name) for d in cs.dropins_to_delete]
        for path in paths:
            self.fs.resolve(path)

    async def _complete(
        self,
        raw: bytes,
        osc: OperatingSystemConfig,
        checksum: str,
        resolved: Mapping[str, bytes],
        change_set: ChangeSet,
        report: ApplyReport,
        started: float,
        *,
        resumed: bool = False,
    ) -> Outcome:
        orphans = await self.remove_orphans(osc)
        self.state.save_last_applied(raw, resolved)
        self._parsed = (checksum, osc)
        self.state.finish()
        report.duration = time.monotonic() - started
        self._record(checksum, started, report=report)
        return Outcome(checksum, change_set, report, resumed=resumed, orphans_removed=orphans)

    async def remove_orphans(self, osc: OperatingSystemConfig) -> list[str]:
        """Delete what the agent created and no OSC wants any more (stop/disable units first)."""
        wanted = desired_paths(osc, self.host_name)
        owned = [
            p
            for p, entry in self.state.inventory().entries.items()
            if entry.created and p not in wanted
        ]
        units = [
            p.removeprefix(UNIT_DIR + "/")
            for p in owned
            if p.startswith(UNIT_DIR + "/") and "/" not in p.removeprefix(UNIT_DIR + "/")
        ]
        units = [u for u in units if u != self.agent_unit]
        if units and self.systemd is not None:
            await self.systemd.run_jobs([(u, "stop") for u in units], job_timeout=30.0)
            await self.systemd.disable(units)
        removed = []
        for path in sorted(owned):
            if path == unit_path(self.agent_unit):
                continue
            self.fs.remove(path)
            if "/" in path.removeprefix(UNIT_DIR + "/") and path.startswith(UNIT_DIR + "/"):
                self.fs.remove_dir_if_empty(path.rsplit("/", 1)[0])
            removed.append(path)
        if removed:
            self.state.release(removed)
            if self.systemd is not None and any(p.startswith(UNIT_DIR + "/") for p in removed):
                await self.systemd.daemon_reload()
            log.info("removed leftovers no OSC wants", paths=removed)
        return removed

    def _record(
        self, checksum: str, started: float, *, report: object = None, error: str | None = None
    ) -> None:
        rep = report if isinstance(report, ApplyReport) else None
        duration = time.monotonic() - started
        finished = datetime.now(UTC)
        stopped = [
            u for u, r in (rep.results.items() if rep else ()) if r.action == "stop" and r.ok
        ]
        try:
            self.state.save_status(
                ApplyRecord(
                    osc_checksum=checksum,
                    started_at=finished - timedelta(seconds=duration),
                    finished_at=finished,
                    duration_seconds=duration,
                    result="failed" if error else "succeeded",
                    steps=len(rep.results) + len(rep.files_written) + len(rep.units_written)
                    if rep
                    else 0,
                    restarted_units=tuple(rep.restarted if rep else ()),
                    stopped_units=tuple(sorted(stopped)),
                    error=error,
                )
            )
        except (NodeAgentError, ValueError) as exc:  # status is informational only
            log.warning("apply status not saved", error=str(exc))


def drift_change_set(full: ChangeSet, drifted: set[str], osc: OperatingSystemConfig) -> ChangeSet:
    """The part of a from-scratch plan that rewrites ``drifted`` paths, and the commands of the
    units that use them (their unit file, a drop-in or one of their ``filePaths``)."""
    files = tuple(f for f in full.files_to_write if f.path in drifted)
    units = tuple(u for u in full.units_to_write if unit_path(u.name) in drifted)
    dropins = tuple(d for d in full.dropins_to_write if dropin_path(d.unit, d.name) in drifted)
    touched = {u.name for u in units} | {d.unit for d in dropins}
    changed_files = {f.path for f in files}
    touched |= {u.name for u in osc_units(osc) if changed_files & set(u.file_paths)}
    commands = tuple(
        cmd.model_copy(update={"reasons": ("its files drifted on the host",)})
        for cmd in full.unit_commands
        if cmd.unit in touched
    )
    return ChangeSet(
        files_to_write=files,
        units_to_write=units,
        dropins_to_write=dropins,
        unit_commands=commands,
        agent_unit=full.agent_unit,
    )
