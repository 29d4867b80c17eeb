"""Carry out a persisted ChangeSet on the host, step by step, each step journaled when done.

The caller persists the change set first (``StateStore.begin``); the executor then runs the
journal's remaining steps in their fixed order (``host.steps``) and records each one, so a crash
at any point resumes with exactly the steps still to do. Steps are idempotent: a file whose bytes
and mode already match is not rewritten, and a unit restarted twice is harmless.

Consecutive steps of one kind are batched: all enables in one call, all disables in one call, and
all unit commands as one parallel batch of systemd jobs. Deletions touch only what the agent
created (the inventory). The agent's own restart is never run here: the caller persists
everything first and restarts the agent last.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from node_agent.errors import ApplyError
from node_agent.host.fs import HostFS
from node_agent.host.state import UNIT_FILE_MODE, Pending, StateStore, dropin_path, unit_path
from node_agent.osc.plan import ChangeSet, UnitCommand
from node_agent.systemd import JobResult, SystemdSeam

CRASH_HOOK_ENV = "NODE_AGENT_TEST_CRASH_AFTER"


@dataclass
class ApplyReport:
    """What one apply did, for the status command, Events and metrics."""

    files_written: list[str] = field(default_factory=list)
    files_deleted: list[str] = field(default_factory=list)
    units_written: list[str] = field(default_factory=list)
    units_deleted: list[str] = field(default_factory=list)
    results: dict[str, JobResult] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    duration: float = 0.0

    @property
    def failed(self) -> list[JobResult]:
        return [r for r in self.results.values() if not r.ok]

    @property
    def restarted(self) -> list[str]:
        return sorted(u for u, r in self.results.items() if r.action == "restart" and r.ok)


def _crash_hook(step: str) -> None:
    """Fault injection for the crash-consistency tests: die like ``kill -9`` after a step.

    ``NODE_AGENT_TEST_CRASH_AFTER`` names a step id (``reload``) or a step kind (``file``).
    """
    target = os.environ.get(CRASH_HOOK_ENV)
    if target and (step == target or step.split(":", 1)[0] == target):
        os.kill(os.getpid(), signal.SIGKILL)


class Executor:
    def __init__(
        self,
        fs: HostFS,
        systemd: SystemdSeam | None,
        state: StateStore,
        *,
        job_timeout: float = 60.0,
        on_command: Callable[[UnitCommand, JobResult], None] | None = None,
    ) -> None:
        """``systemd=None`` is offline mode (image build): files and units only, no jobs."""
        self.fs = fs
        self.systemd = systemd
        self.state = state
        self.job_timeout = job_timeout
        self.on_command = on_command

    async def execute(self, pending: Pending) -> ApplyReport:
        """Run the remaining steps of ``pending``; ApplyError if a unit job failed."""
        started = time.monotonic()
        report = ApplyReport()
        cs = pending.change_set
        remaining = list(pending.remaining())
        i = 0
        while i < len(remaining):
            kind = remaining[i].split(":", 1)[0]
            j = i
            while j < len(remaining) and remaining[j].split(":", 1)[0] == kind:
                j += 1
            batch = remaining[i:j]
            if kind == "cmd":
                batch = [s for s in batch if not self._is_agent(cs, s)]
                j = i + len(batch) if batch else j
                if not batch:  # the agent's own restart: left to the caller
                    break
            await self._run(kind, batch, cs, report)
            self.state.mark_done(*batch)
            for step in batch:
                _crash_hook(step)
            i = j
        report.duration = time.monotonic() - started
        if report.failed:
            raise ApplyError(
                "units did not reach their desired state: "
                + "; ".join(r.describe() for r in report.failed),
                report=report,
            )
        return report

    @staticmethod
    def _is_agent(cs: ChangeSet, step: str) -> bool:
        return any(c.is_agent and f"cmd:{c.unit}" == step for c in cs.unit_commands)

    async def _run(self, kind: str, steps: Sequence[str], cs: ChangeSet, rep: ApplyReport) -> None:
        args = [s.split(":", 1)[1] for s in steps if ":" in s]
        if kind == "file":
            writes = {f.path: f for f in cs.files_to_write}
            for path in args:
                fw = writes[path]
                if fw.content is None:
                    rep.skipped.append(f"{path}: imageRef content is not supported by this agent")
                    continue
                await self.fs.write_atomic_async(path, fw.content, fw.mode)
                rep.files_written.append(path)
        elif kind == "unit":
            units = {u.name: u for u in cs.units_to_write}
            for name in args:
                await self.fs.write_atomic_async(
                    unit_path(name), units[name].content.encode(), UNIT_FILE_MODE
                )
                rep.units_written.append(name)
        elif kind == "dropin":
            dropins = {f"{d.unit}/{d.name}": d for d in cs.dropins_to_write}
            for key in args:
                d = dropins[key]
                await self.fs.write_atomic_async(
                    dropin_path(d.unit, d.name), d.content.encode(), UNIT_FILE_MODE
                )
        elif kind == "delete-dropin":
            for key in args:
                unit, name = key.split("/", 1)
                self._delete(dropin_path(unit, name), rep)
                self.fs.remove_dir_if_empty(f"{unit_path(unit)}.d")
        elif kind in ("enable", "disable"):
            if self.systemd is not None:
                call = self.systemd.enable if kind == "enable" else self.systemd.disable
                await call(args)
        elif kind in ("reload", "reload-after-delete"):
            if self.systemd is not None:
                await self.systemd.daemon_reload()
        elif kind == "cmd":
            await self._commands([c for c in cs.unit_commands if c.unit in args], rep)
        elif kind == "delete-unit":
            for name in args:
                if self._delete(unit_path(name), rep):
                    rep.units_deleted.append(name)
                self.fs.remove_dir_if_empty(f"{unit_path(name)}.d")
        elif kind == "delete-file":
            for path in args:
                if self._delete(path, rep):
                    rep.files_deleted.append(path)
        else:  # pragma: no cover - step_ids() and this dispatcher change together
            raise AssertionError(f"unknown step kind {kind!r}")

    def _delete(self, path: str, rep: ApplyReport) -> bool:
        """Delete ``path`` if the agent created it; leave anything else in place."""
        if not self.state.owns(path):
            if self.fs.exists(path):
                rep.skipped.append(f"{path}: not created by node-agent, left in place")
            return False
        self.fs.remove(path)
        self.state.release([path])
        return True

    async def _commands(self, commands: list[UnitCommand], rep: ApplyReport) -> None:
        if self.systemd is None or not commands:
            return
        results = await self.systemd.run_jobs(
            [(c.unit, c.action) for c in commands], job_timeout=self.job_timeout
        )
        for command in commands:
            result = results[command.unit]
            rep.results[command.unit] = result
            if self.on_command is not None:
                self.on_command(command, result)
