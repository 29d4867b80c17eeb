"""The apply pipeline shared by the OSC controller and ``node-agent apply``.

decode (caller) → what is applied now (``base``: the last applied OSC overlaid with any
unfinished journal) → plan (pure) → persist the change set with its base and target → execute,
each item with its own outcome → remove orphans → persist last-applied.

The invariant: from any state the agent can be in (applied OSC, a journal half done, failed
units, a crash, a newer Secret), the next successful apply converges the host to the latest OSC,
restarting each affected unit once, and one failing item neither blocks nor re-disrupts the
others. Anything the agent created that no OSC wants any more is removed (upstream leaks those
when an OSC never succeeds).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import NoReturn

from node_agent.apply.executor import ApplyReport, Executor
from node_agent.apply.restart_guard import RestartGuard
from node_agent.base.digest import sha256_hex
from node_agent.base.errors import ApplyError, HostError, NodeAgentError, SystemdCallError
from node_agent.base.layout import drop_in_path, unit_path
from node_agent.base.log import get_logger
from node_agent.containerd.images import ImageStore
from node_agent.host.documents import ApplyRecord, ItemFailure, Pending
from node_agent.host.fs import HostFS
from node_agent.host.state import (
    UNIT_DIR,
    UNIT_FILE_MODE,
    StateStore,
    claims_for,
    not_written,
    remove_created,
    write_claims,
)
from node_agent.osc import steps
from node_agent.osc.applied import Applied, AppliedUnit, Owed, adopt
from node_agent.osc.decode import parse_osc
from node_agent.osc.memo import Last
from node_agent.osc.merge import osc_units
from node_agent.osc.models import OperatingSystemConfig
from node_agent.osc.plan import ChangeSet, UnitCommand, is_template, plan
from node_agent.osc.settle import settle
from node_agent.systemd import JobResult, SystemdSeam

log = get_logger("node-agent.apply")


@dataclass(frozen=True)
class Planned:
    """One plan of an OSC against what is applied now: what the rollout's admission judges and
    what the apply then runs, so an admitted apply never plans a second time."""

    pending_id: str | None  # the unfinished journal it was planned over (None: none)
    base: Applied  # what is applied now, item by item (adoptions included)
    desired: OperatingSystemConfig  # the OSC with what the agent derives from it
    target: Applied  # what it aims at
    change_set: ChangeSet
    #: derived files that could not be made (path -> why): each one failed item of the apply
    not_derived: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    checksum: str
    change_set: ChangeSet
    report: ApplyReport
    resumed: bool = False
    orphans_removed: list[str] = field(default_factory=list)

    @property
    def restarts_agent(self) -> bool:
        return self.report.agent_restart_due


def wanted_paths(applied: Applied) -> frozenset[str]:
    """Every host path an ``Applied`` has: files, unit files, drop-ins. Kept for the last one
    asked about: an apply's orphan sweep asks about its target, and the next apply's plan
    about the same object, its base."""
    return _WANTED.get(applied, _wanted_paths)


def _wanted_paths(applied: Applied) -> frozenset[str]:
    paths = set(applied.files)
    for unit in applied.units.values():
        if unit.content is not None:
            paths.add(unit_path(unit.name))
        paths |= {drop_in_path(unit.name, name) for name in unit.drop_ins}
    return frozenset(paths)


_WANTED: Last[Applied, frozenset[str]] = Last()


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
        expand: Callable[[OperatingSystemConfig], OperatingSystemConfig] | None = None,
        prepare: Callable[[OperatingSystemConfig], None] | None = None,
        images: ImageStore | None = None,
        held_back: Callable[[], Mapping[str, str]] | None = None,
        not_derived: Callable[[], Mapping[str, str]] | None = None,
        keep_previous: Iterable[str] = (),
        guard: RestartGuard | None = None,
    ) -> None:
        """``keep_previous``: host paths (the agent's own binary) whose old content is kept as
        ``<path>.previous`` when an OSC replaces it, for a rollback by hand.

        ``expand`` adds the items the agent derives from an OSC (e.g. containerd's
        configuration from ``criConfig``) as files and units, so they are planned, journaled,
        repaired and removed like the OSC's own."""
        self.expand = expand or (lambda osc: osc)
        self.prepare = prepare  # e.g. directories the derived items need; before execution
        #: derived items the last expansion held back (name -> why), e.g. a registry mirror whose
        #: readiness probe failed; the OSC controller checks again sooner while there are any
        self.held_back = held_back or dict
        #: derived files the last expansion could not make (path -> why), e.g. a config.toml
        #: that is not TOML: each is kept as it is on the host and reported as a failed item
        self.not_derived = not_derived or dict
        self.fs = fs
        self.state = state
        self.systemd = systemd
        self.host_name = host_name
        self.agent_unit = agent_unit
        self._parsed: tuple[str, OperatingSystemConfig] | None = None  # last applied, parsed
        self.executor = Executor(
            fs,
            systemd,
            state,
            job_timeout=job_timeout,
            on_command=on_command,
            images=images,
            keep_previous=keep_previous,
            guard=guard,
        )

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

    async def plan(self, osc: OperatingSystemConfig, resolved: Mapping[str, bytes]) -> Planned:
        """What applying ``osc`` now would do (changes nothing, not even the inventory)."""
        pending = await self.state.pending_async()
        base = await asyncio.to_thread(self.base, pending)
        desired = await asyncio.to_thread(self.expand, osc)
        not_derived = dict(self.not_derived())
        # A derived file that could not be made is neither written nor deleted: the plan sees
        # it on neither side, and the target keeps what was applied for it.
        wanted = Applied.of_osc(desired, self.host_name, resolved, required=True)
        target = _keep(wanted, base, not_derived)
        owned = (await self.state.inventory_async()).entries
        base = with_leftover_drop_ins(base, target, {p for p, e in owned.items() if e.created})
        running = await self._running(base, target)
        base = await asyncio.to_thread(self._adopt, base, target, running)
        change_set = await asyncio.to_thread(
            plan,
            _set_aside(base, not_derived),
            desired,
            self.host_name,
            resolved,
            agent_unit=self.agent_unit,
            target=wanted,
        )
        pending_id = pending.id if pending else None
        return Planned(pending_id, base, desired, target, change_set, not_derived)

    def last_applied(self) -> Applied:
        """The items of the last complete apply, as recorded then (derived items included), or
        derived from its OSC when an older agent applied it; empty when nothing was applied."""
        last = self.state.load_last_applied()
        if last is not None and last.applied is not None:
            return last.applied
        previous, previous_resolved, _ = self.previous()
        return Applied.of_osc(previous, self.host_name, previous_resolved)

    def applied_checksum(self) -> str:
        """sha256 of the last applied osc.yaml ('' if none); from memory once known."""
        return self.state.applied_checksum()

    async def apply(
        self,
        raw: bytes,
        osc: OperatingSystemConfig,
        checksum: str,
        resolved: Mapping[str, bytes],
        planned: Planned | None = None,
    ) -> Outcome:
        """Bring the host to ``osc``. Every item gets its own outcome: when some fail, the rest
        is applied, the journal keeps what is left, and ApplyError (with the report) is raised;
        the next call for the same OSC runs only what failed or is pending, and a newer OSC is
        planned from what is really applied. ``planned``: this OSC's plan made just before (by
        :meth:`plan`, for the rollout's admission); used when it was made over the same journal."""
        started = time.monotonic()
        pending = await self.state.pending_async()
        resumed = pending is not None and pending.osc_checksum == checksum
        if pending is not None and resumed:
            desired = await asyncio.to_thread(self.expand, osc)
            not_derived = dict(self.not_derived())
            stale = self._derived_since(pending, desired, resolved, not_derived)
            if stale:
                # A derived file (config.toml) that could not be made when this journal began
                # can be made now, or came out differently: resuming would finish the journal
                # without it and report the OSC applied. Plan again over the journal instead.
                log.info("re-planning the same OSC: derived files changed", paths=stale)
                resumed = False
            else:
                log.info(
                    "continuing an unfinished apply of the same OSC",
                    checksum=checksum,
                    remaining=len(pending.remaining()),
                    failed_before=sorted(pending.failed),
                )
                if self.prepare is not None:  # a crash may have come before it ran
                    await asyncio.to_thread(self.prepare, desired)
        if not resumed:
            if planned is None or planned.pending_id != (pending.id if pending else None):
                planned = await self.plan(osc, resolved)
            if pending is not None:  # writes of the unfinished journal seen on disk are ours
                await asyncio.to_thread(self.claim_observed, pending)
            not_derived = dict(planned.not_derived)
            try:
                await asyncio.to_thread(self.preflight, planned.change_set)
            except HostError as exc:
                await self._record(checksum, started, error=str(exc))
                raise
            pending = await self.state.begin_async(
                planned.change_set, checksum, base=planned.base, target=planned.target
            )
            if self.prepare is not None:
                await asyncio.to_thread(self.prepare, planned.desired)
        assert pending is not None  # resumed, or begun just above
        report = await self.executor.execute(pending)
        for path, why in not_derived.items():
            report.failures[steps.file_step(path)] = ItemFailure(kind="file", item=path, error=why)
        if not report.complete:
            await self._unfinished(checksum, started, report)
        applied = pending.target
        if applied is None:  # a journal from an older agent
            applied = Applied.of_osc(self.expand(osc), self.host_name, resolved, required=True)
        return await self._complete(
            raw, osc, applied, checksum, resolved, pending.change_set, report, started, resumed
        )

    def _derived_since(
        self,
        pending: Pending,
        desired: OperatingSystemConfig,
        resolved: Mapping[str, bytes],
        not_derived: Mapping[str, str],
    ) -> list[str]:
        """Files the OSC brings now (derivable this time) whose content the journal's target
        does not have: the journal was planned for another derivation of the same OSC."""
        if pending.target is None:  # a journal from an older agent: no target to compare
            return []
        now = Applied.of_osc(desired, self.host_name, resolved, required=True)
        stale = []
        for path, item in now.files.items():
            if path in not_derived or item.sha256 is None:
                continue
            then = pending.target.files.get(path)
            if then is None or (then.sha256 is not None and then.sha256 != item.sha256):
                stale.append(path)
        return sorted(stale)

    def claim_observed(self, pending: Pending) -> None:
        """Claim in the inventory the writes of an unfinished journal found on disk (a crash
        kept them from being marked), before a newer change set is begun over it."""
        observed = self._observed(pending)
        if observed:
            writes = write_claims(pending.change_set)
            self.state.record_written(writes[s] for s in observed if s in writes)

    def base(self, pending: Pending | None) -> Applied:
        """What is applied now, item by item: the last applied OSC, overlaid with whatever an
        unfinished journal already did (its marks, and writes or deletions seen on disk that a
        crash kept from being marked; :meth:`claim_observed` claims those writes)."""
        last = self.last_applied()
        if pending is None:
            return last
        cs = pending.change_set
        done = set(pending.done) | self._observed(pending)
        if pending.target is None:  # a journal from an older agent: commands owed, conservatively
            owed = {
                c.unit: Owed(action=c.action, reasons=c.reasons)
                for c in cs.unit_commands
                if steps.cmd_step(c.unit) not in done and not c.removed
            }
            return last.model_copy(update={"owed": owed})
        return settle(pending.base or last, pending.target, cs, done)

    def _adopt(self, base: Applied, target: Applied, running: set[str]) -> Applied:
        """Adopt items new to ``base`` that are already on disk exactly as ``target`` wants,
        and units without content among ``running`` (active now) that have nothing to change."""
        matching = {
            path
            for path, f in target.files.items()
            if path not in base.files
            and f.sha256 is not None
            and self.fs.stat_matches(path, sha256=f.sha256, mode=f.mode)
        }
        for unit in target.units.values():
            have = base.units.get(unit.name)
            for name, content in unit.drop_ins.items():
                if have is not None and name in have.drop_ins:
                    continue
                path = drop_in_path(unit.name, name)
                digest = sha256_hex(content.encode())
                if self.fs.stat_matches(path, sha256=digest, mode=UNIT_FILE_MODE):
                    matching.add(path)
        if not matching and not running:
            return base
        return adopt(base, target, matching, UNIT_DIR, running)

    async def _running(self, base: Applied, target: Applied) -> set[str]:
        """Which of the target's units that could be adopted (new, without content, asking for
        nothing) systemd runs now, enabled: only those are adopted. One the agent itself stopped
        earlier, or that never ran, is started like any new unit."""
        names = [
            u.name
            for u in target.units.values()
            if u.name not in base.units
            and not is_template(u.name)  # systemd refuses to look one up by that name
            and u.content is None
            and u.enable is None
            and u.command is None
        ]
        if not names or self.systemd is None:
            return set()
        states = await self.systemd.unit_states(names)
        return {
            n
            for n, st in states.items()
            if st.active_state == "active" and st.unit_file_state in ("enabled", "static")
        }

    def _observed(self, pending: Pending) -> set[str]:
        """Not-yet-marked write and delete steps whose result is already on disk."""
        cs = pending.change_set
        todo = set(pending.remaining())
        found = {
            step
            for step, claim in write_claims(cs).items()
            if step in todo
            and claim.sha256 is not None  # a file from an image: its bytes are not known yet
            and self.fs.stat_matches(claim.path, sha256=claim.sha256, mode=claim.mode)
        }
        deletes = {steps.delete_file_step(f.path): f.path for f in cs.files_to_delete}
        deletes |= {steps.delete_unit_step(u.name): unit_path(u.name) for u in cs.units_to_delete}
        deletes |= {
            steps.delete_dropin_step(d.unit, d.name): drop_in_path(d.unit, d.name)
            for d in cs.dropins_to_delete
        }
        found |= {s for s, path in deletes.items() if s in todo and not self.fs.exists(path)}
        return found

    async def _unfinished(self, checksum: str, started: float, report: ApplyReport) -> NoReturn:
        """Record a partial apply (the journal stays for the retry) and raise ApplyError."""
        if report.agent_restart_due:
            # The caller restarts the agent now; record it first so a retry does not repeat it.
            pending = await self.state.pending_async()
            if pending is not None:
                agent = [s for s in pending.remaining() if self._is_agent_step(pending, s)]
                await self.state.mark_done_async(*agent)
        report.duration = time.monotonic() - started
        failed = report.failed_items()
        message = f"{failed} item(s) not applied, the rest is: {report.describe_failures()}"
        await self._record(checksum, started, report=report, error=message)
        raise ApplyError(message, report=report)

    @staticmethod
    def _is_agent_step(pending: Pending, step: str) -> bool:
        return any(
            c.is_agent and steps.cmd_step(c.unit) == step for c in pending.change_set.unit_commands
        )

    def drifted(self, full: ChangeSet) -> tuple[set[str], set[str]]:
        """Host paths that no longer match what the OSC says: (bytes differ or missing, only the
        mode differs)."""
        wanted = {c.path: (c.sha256, c.mode) for c in claims_for(full) if c.sha256 is not None}
        entries = self.state.inventory().entries
        for f in full.files_to_write:
            # A file from an image: its bytes are known from when it was written (the claim).
            entry = entries.get(f.path)
            if f.image_ref is not None and entry is not None and entry.sha256 is not None:
                wanted[f.path] = (entry.sha256, f.mode)
        content: set[str] = set()
        mode_only: set[str] = set()
        for path, (digest, mode) in wanted.items():
            if self.fs.stat_matches(path, sha256=digest, mode=mode):
                continue
            if self.fs.stat_matches(path, sha256=digest):
                mode_only.add(path)
            elif path in self.executor.keep_previous:
                # The agent's own binary, replaced by hand (a rollback to ``.previous``): only
                # an OSC that changes it again replaces it, never a drift repair.
                log.warning("own binary differs from the OSC's; left as it is", path=path)
            else:
                content.add(path)
        return content, mode_only

    async def repair_drift(
        self, osc: OperatingSystemConfig, resolved: Mapping[str, bytes] | None
    ) -> Outcome | None:
        """Re-check the disk against the applied OSC (upstream trusts the checksum forever):
        rewrite what drifted and restart exactly the units that depend on it."""
        last = await self.state.load_last_applied_async()
        if last is None or await self.state.pending_async() is not None:
            return None
        refs = resolved if resolved is not None else (last.resolved or {})
        osc = await asyncio.to_thread(self.expand, osc)
        try:
            full = await asyncio.to_thread(
                plan, None, osc, self.host_name, refs, agent_unit=self.agent_unit
            )
        except NodeAgentError as exc:  # e.g. secretRef contents unknown: cannot compare
            log.info("drift check skipped", reason=str(exc))
            return None
        content, mode_only = await asyncio.to_thread(self.drifted, full)
        if not content and not mode_only:
            return None
        repair = drift_change_set(full, content, mode_only, osc)
        log.warning(
            "host drifted from the applied OSC; repairing",
            paths=sorted(content),
            modes=sorted(mode_only),
        )
        started = time.monotonic()
        await asyncio.to_thread(self.preflight, repair)
        applied = Applied.of_osc(osc, self.host_name, refs)
        pending = await self.state.begin_async(repair, last.checksum, base=applied, target=applied)
        report = await self.executor.execute(pending)
        if not report.complete:
            await self._unfinished(last.checksum, started, report)
        await self.state.finish_async()
        report.duration = time.monotonic() - started
        await self._record(last.checksum, started, report=report)
        return Outcome(last.checksum, repair, report)

    def preflight(self, cs: ChangeSet) -> None:
        """Refuse the whole change set before any write if one of its paths cannot be written
        safely on this host: a parent symlink planted under /etc, a directory, device node,
        FIFO or socket where a file goes, a file where a directory is needed. Nothing is then
        half-applied, and the error names the path."""
        writes = [f.path for f in cs.files_to_write]
        writes += [unit_path(u.name) for u in cs.units_to_write]
        writes += [drop_in_path(d.unit, d.name) for d in cs.dropins_to_write]
        deletes = [f.path for f in cs.files_to_delete]
        deletes += [drop_in_path(d.unit, d.name) for d in cs.dropins_to_delete]
        for path in writes:
            self.fs.check_target(path)
        for path in deletes:
            self.fs.resolve(path)

    async def _complete(
        self,
        raw: bytes,
        osc: OperatingSystemConfig,
        target: Applied,
        checksum: str,
        resolved: Mapping[str, bytes],
        change_set: ChangeSet,
        report: ApplyReport,
        started: float,
        resumed: bool,
    ) -> Outcome:
        orphans = await self.remove_orphans(target)
        await self.state.save_last_applied_async(raw, resolved, applied=target)
        self._parsed = (checksum, osc)
        await self.state.finish_async()
        report.duration = time.monotonic() - started
        await self._record(checksum, started, report=report)
        return Outcome(checksum, change_set, report, resumed=resumed, orphans_removed=orphans)

    async def remove_orphans(self, applied: Applied) -> list[str]:
        """Delete what the agent created and no OSC wants any more (stop/disable units first).

        Only what it can show it wrote: never in its own directory nor its program or unit, nor
        what ``bootstrap`` wrote (``OwnedEntry.by``: the kubelet data volume's mount unit, which
        no OSC names; ``reset`` takes it back), and only a regular file still holding the bytes
        recorded when it was written (claims of a progress file were vetted when read). What
        fails that is kept, said in the log, and forgotten; what could not be removed is kept
        for a later apply."""
        wanted = wanted_paths(applied)
        own_unit = unit_path(self.agent_unit)  # never swept: reset's to remove
        entries = (await self.state.inventory_async()).entries
        owned = {
            p: e
            for p, e in entries.items()
            if e.created and e.by == "osc" and p not in wanted and p != own_unit
        }
        if not owned:
            return []
        keep = {
            *self.executor.keep_previous,
            *(f"{p}.previous" for p in self.executor.keep_previous),
        }
        forget: dict[str, str] = {}  # path -> why it is not provably the agent's
        unit_files = {
            p: e
            for p, e in owned.items()
            if p.startswith(UNIT_DIR + "/") and "/" not in p.removeprefix(UNIT_DIR + "/")
        }
        for path, entry in unit_files.items():  # a unit that is not the agent's is not stopped
            try:
                why = await asyncio.to_thread(not_written, self.fs, path, entry, keep)
            except HostError:
                continue  # its removal below says why
            if why is not None:
                forget[path] = why
        units = [p.removeprefix(UNIT_DIR + "/") for p in unit_files if p not in forget]
        # A template (foo@.service) gets no job: systemd refuses one for a name without instance.
        units = [u for u in units if not is_template(u)]
        stuck: set[str] = set()
        if units and self.systemd is not None:
            results = await self.systemd.run_jobs([(u, "stop") for u in units], job_timeout=30.0)
            stuck = {u for u, r in results.items() if not r.ok}
            for unit in units:
                try:
                    await self.systemd.disable([unit])
                except SystemdCallError as exc:
                    log.info("leftover unit not disabled", unit=unit, error=str(exc))
        removed = []
        for path in sorted(owned):
            if path in forget:
                continue
            if path.removeprefix(UNIT_DIR + "/") in stuck:
                continue  # a leftover unit that would not stop keeps its file until a later apply
            try:
                removal = await asyncio.to_thread(remove_created, self.fs, path, owned[path], keep)
                if "/" in path.removeprefix(UNIT_DIR + "/") and path.startswith(UNIT_DIR + "/"):
                    await asyncio.to_thread(self.fs.remove_dir_if_empty, path.rsplit("/", 1)[0])
            except HostError as exc:
                log.warning(
                    "leftover not removed; kept for a later apply", path=path, error=str(exc)
                )
                continue
            if removal.kept is not None:
                forget[path] = removal.kept
            else:
                removed.append(path)
        for path, why in sorted(forget.items()):
            log.warning("leftover kept: not provably the agent's; forgotten", path=path, reason=why)
        if removed or forget:
            await self.state.release_async([*removed, *forget])
        if removed:
            if self.systemd is not None and any(p.startswith(UNIT_DIR + "/") for p in removed):
                await self.systemd.daemon_reload()
            log.info("removed leftovers no OSC wants", paths=removed)
        return removed

    async def _record(
        self, checksum: str, started: float, *, report: object = None, error: str | None = None
    ) -> None:
        rep = report if isinstance(report, ApplyReport) else None
        duration = time.monotonic() - started
        finished = datetime.now(UTC)
        stopped = [
            u for u, r in (rep.results.items() if rep else ()) if r.action == "stop" and r.ok
        ]
        try:
            await self.state.save_status_async(
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
                    failures=rep.failure_list() if rep else (),
                )
            )
        except (NodeAgentError, ValueError) as exc:  # status is informational only
            log.warning("apply status not saved", error=str(exc))


#: What a leftover drop-in's content is taken to be: nothing an OSC can hold, so the plan always
#: rewrites (or deletes) it and restarts its unit.
LEFTOVER_CONTENT = "\x00unknown: written by an apply whose journal was lost"


def with_leftover_drop_ins(base: Applied, target: Applied, owned: set[str]) -> Applied:
    """``base`` with the drop-ins the agent wrote (its inventory says so) that ``base`` does
    not know: an apply interrupted after writing one, whose journal was then lost. Unknown to
    the plan, such a drop-in would only be swept as a leftover after its unit was restarted
    with it still in force; known, the plan deletes (or rewrites) it and restarts the unit.
    A unit whose own file is such a leftover, and that ``target`` does not have, is left to the
    leftover sweep (it stops the unit)."""
    known = wanted_paths(base)
    found: dict[str, dict[str, str]] = {}
    prefix = UNIT_DIR + "/"
    for path in owned - known:
        rest = path.removeprefix(prefix)
        if not path.startswith(prefix) or rest.count("/") != 1:
            continue
        directory, name = rest.split("/")
        unit = directory.removesuffix(".d")
        if unit == directory or not unit:
            continue
        if unit_path(unit) in owned - known and unit not in target.units:
            continue
        found.setdefault(unit, {})[name] = LEFTOVER_CONTENT
    if not found:
        return base
    units = dict(base.units)
    for unit, drop_ins in found.items():
        have = units.get(unit) or AppliedUnit(name=unit)
        units[unit] = have.model_copy(update={"drop_ins": {**drop_ins, **have.drop_ins}})
    return base.model_copy(update={"units": units})


def _set_aside(applied: Applied, paths: Mapping[str, str]) -> Applied:
    """``applied`` without the files at ``paths`` (derived files that could not be made)."""
    if not paths or not paths.keys() & applied.files.keys():
        return applied
    files = {p: f for p, f in applied.files.items() if p not in paths}
    return applied.model_copy(update={"files": files})


def _keep(target: Applied, base: Applied, paths: Mapping[str, str]) -> Applied:
    """``target`` with the applied state of ``paths`` taken over from ``base`` (as they are)."""
    kept = {p: base.files[p] for p in paths if p in base.files}
    if not kept:
        return target
    return target.model_copy(update={"files": {**target.files, **kept}})


def drift_change_set(
    full: ChangeSet, drifted: set[str], mode_only: set[str], osc: OperatingSystemConfig
) -> ChangeSet:
    """The part of a from-scratch plan that rewrites ``drifted`` paths and the commands of the
    units that use them (their unit file, a drop-in or one of their ``filePaths``); paths whose
    bytes still match and only the mode drifted are rewritten without restarting anything."""
    rewrite = drifted | mode_only
    files = tuple(f for f in full.files_to_write if f.path in rewrite)
    units = tuple(u for u in full.units_to_write if unit_path(u.name) in rewrite)
    dropins = tuple(d for d in full.dropins_to_write if drop_in_path(d.unit, d.name) in rewrite)
    touched = {u.name for u in units if unit_path(u.name) in drifted}
    touched |= {d.unit for d in dropins if drop_in_path(d.unit, d.name) in drifted}
    changed_files = {f.path for f in files if f.path in drifted}
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
