"""Carry out a persisted ChangeSet on the host, step by step, each item with its own outcome.

The caller persists the change set first (``StateStore.begin``); the executor then runs the
journal's remaining steps in their fixed order (``host.steps``) and records each one, so a crash
at any point resumes with exactly the steps still to do. Steps are idempotent: a file whose bytes
and mode already match is not rewritten, deleting something already gone is success, and a unit
command that succeeded for this change set is never run again for it.

One failing item never stops the others: a file that cannot be written (read-only mount, full
disk), a file whose image cannot be pulled or lacks the file, a unit systemd does not know or
that is masked, a unit that fails to start — each is
recorded as an ``ItemFailure`` and the rest goes on. Only a unit command whose own inputs failed
(its unit file, a drop-in, its enablement, a file in its ``filePaths``, the daemon-reload) is held
back ("blocked"): restarting it would run the old definition and spend the restart. A retry runs
only what failed or is still pending. systemd being unreachable as a whole is not an item
failure: it raises, with every finished step already recorded.

Consecutive steps of one kind are batched: all enables in one call (one by one only after a
failure, to find the culprit), and all unit commands as one parallel batch of systemd jobs.
Deletions touch only what the agent created (the inventory), and only while it holds the bytes
the agent wrote (``state.remove_created``). The agent's own restart is never run here: the
caller persists everything first and restarts the agent last.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from node_agent.apply.restart_guard import HeldUnit, RestartGuard
from node_agent.base.digest import sha256_hex
from node_agent.base.errors import HostError, ImageError, SystemdCallError
from node_agent.base.layout import CONTAINERD_CERTS_DIR, drop_in_path, unit_path
from node_agent.base.log import get_logger
from node_agent.containerd.images import ImagePull, ImageStore
from node_agent.host.documents import Claim, ItemFailure, Pending
from node_agent.host.fs import HostFS
from node_agent.host.state import UNIT_FILE_MODE, StateStore, remove_created
from node_agent.osc import steps as S
from node_agent.osc.models import ImageRefContent
from node_agent.osc.plan import ChangeSet, DropInWrite, FileWrite, UnitCommand, UnitWrite
from node_agent.systemd import JobResult, SystemdSeam

CRASH_HOOK_ENV = "NODE_AGENT_TEST_CRASH_AFTER"
NO_IMAGE_STORE = "imageRef content is not supported by this agent"
#: containerd's own command: image files are pulled through it
CONTAINERD_COMMAND = S.cmd_step("containerd.service")

log = get_logger("node-agent.executor")

_KIND_OF_STEP = {
    "file": "file",
    "unit": "unit",
    "dropin": "dropin",
    "delete-dropin": "delete",
    "enable": "enable",
    "disable": "disable",
    "reload": "reload",
    "reload-after-delete": "reload",
    "cmd": "command",
    "delete-unit": "delete",
    "delete-file": "delete",
}


@dataclass
class ApplyReport:
    """What one apply attempt did, for the status command, Events and metrics."""

    files_written: list[str] = field(default_factory=list)
    files_deleted: list[str] = field(default_factory=list)
    units_written: list[str] = field(default_factory=list)
    units_deleted: list[str] = field(default_factory=list)
    results: dict[str, JobResult] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    #: imageRef files written in this attempt: image, digest, bytes
    pulls: list[ImagePull] = field(default_factory=list)
    #: step id -> what went wrong, for every step that failed or was blocked in this attempt
    failures: dict[str, ItemFailure] = field(default_factory=dict)
    #: the agent's own restart is due (its inputs are in place), for the caller to do last
    agent_restart_due: bool = False
    #: units the restart-storm guard began to hold in this attempt (for one Event each)
    held: list[HeldUnit] = field(default_factory=list)
    duration: float = 0.0

    @property
    def failed(self) -> list[JobResult]:
        return [r for r in self.results.values() if not r.ok and not r.still_starting]

    @property
    def complete(self) -> bool:
        return not self.failures

    @property
    def restarted(self) -> list[str]:
        return sorted(u for u, r in self.results.items() if r.action == "restart" and r.ok)

    def failure_list(self) -> tuple[ItemFailure, ...]:
        return tuple(self.failures[k] for k in sorted(self.failures))

    def failed_items(self) -> int:
        """How many distinct items (paths, units) failed or were held back."""
        return len({f.item for f in self.failures.values()})

    def describe_failures(self, limit: int = 5) -> str:
        items = self.failure_list()
        text = "; ".join(f"{f.item}: {f.error}" for f in items[:limit])
        return text + (f"; and {len(items) - limit} more" if len(items) > limit else "")


def _crash_hook(step: str) -> None:
    """Fault injection for the crash-consistency tests: die like ``kill -9`` after a step.

    ``NODE_AGENT_TEST_CRASH_AFTER`` names a step id (``reload``) or a step kind (``file``).
    """
    target = os.environ.get(CRASH_HOOK_ENV)
    if target and (step == target or step.split(":", 1)[0] == target):
        os.kill(os.getpid(), signal.SIGKILL)


#: the same hook for the steps around an apply (e.g. ``in-place:detected``)
crash_hook = _crash_hook


class Executor:
    def __init__(
        self,
        fs: HostFS,
        systemd: SystemdSeam | None,
        state: StateStore,
        *,
        job_timeout: float = 60.0,
        on_command: Callable[[UnitCommand, JobResult], None] | None = None,
        images: ImageStore | None = None,
        keep_previous: Iterable[str] = (),
        guard: RestartGuard | None = None,
    ) -> None:
        """``systemd=None`` is offline mode (image build): files and units only, no jobs.
        ``images`` pulls the imageRef files; without it they are skipped (reported).
        ``keep_previous``: files whose replaced content is kept as ``<path>.previous``."""
        self.fs = fs
        self.keep_previous = frozenset(keep_previous)
        self.images = images
        self._digests: dict[str, str] = {}  # image -> digest, pulled once per attempt
        #: enable/disable steps run in this attempt that changed no symlink (see ``_needless``)
        self._quiet: set[str] = set()
        self.systemd = systemd
        self.state = state
        self.job_timeout = job_timeout
        self.on_command = on_command
        #: the restart-storm guard: counts failed starts/restarts, holds units that keep failing
        self.guard = guard

    async def execute(self, pending: Pending) -> ApplyReport:
        """Run the remaining steps of ``pending``; every item gets its own outcome in the
        report. Raises only when systemd as a whole is unreachable (steps done so far are
        recorded)."""
        started = time.monotonic()
        report = ApplyReport()
        self._digests = {}
        self._quiet = set()
        if self.guard is not None:
            self.guard.osc(pending.osc_checksum)
        cs = pending.change_set
        agent_steps = {S.cmd_step(c.unit) for c in cs.unit_commands if c.is_agent}
        remaining = [s for s in pending.remaining() if s not in agent_steps]
        steps = pending.steps
        # A retry that still writes or deletes unit files or drop-ins, or changes enablement,
        # reloads again before its commands; one that still deletes a removed unit's file
        # reloads again after it: systemd runs what it loaded, not what is on disk.
        for reload, needs in (
            (S.RELOAD, lambda s: not s.startswith("file:")),
            (S.RELOAD_AFTER_ENABLE, lambda s: s.startswith("enable:")),
            (S.RELOAD_AFTER_DELETE, lambda s: s.startswith("delete-unit:")),
        ):
            if reload in pending.done:
                before = set(steps[: steps.index(reload)])
                if any(s in before and needs(s) for s in remaining):
                    at = next(
                        (i for i, s in enumerate(remaining) if s not in before), len(remaining)
                    )
                    remaining.insert(at, reload)
        failed: dict[str, str] = {}

        async def record(ok: list[str], errors: dict[str, str]) -> None:
            nonlocal pending
            failed.update(errors)
            for step, why in errors.items():
                report.failures[step] = _failure(step, why)
            pending = await self.state.mark_done_async(*ok, failed=failed)
            for step in ok:
                _crash_hook(step)

        # Files from images are fetched beside everything else, one task per image: a slow or
        # hanging registry holds only the commands of units whose filePaths name such a file.
        by_image = self._image_steps(cs, remaining)
        in_flight = {s for group in by_image.values() for s in group}
        remaining = [s for s in remaining if s not in in_flight]
        fetches = [
            asyncio.create_task(self._run("file", group, pending, report))
            for group in by_image.values()
        ]

        async def join() -> None:
            for ok, errors in await asyncio.gather(*fetches):
                await record(ok, errors)
            fetches.clear()

        try:
            for kind, batch in _batches(remaining):
                if kind == "cmd" and fetches:
                    # A unit waits for the pulls of its files; containerd waits for every pull
                    # in flight (they go through it: a restart would cut them off).
                    waiting = [
                        s
                        for s in batch
                        if in_flight & set(self._blockers(s, pending)) or s == CONTAINERD_COMMAND
                    ]
                    now = [s for s in batch if s not in waiting]
                    if now:
                        await record(*await self._run(kind, now, pending, report))
                    await join()
                    batch = waiting
                    if not batch:
                        continue
                await record(*await self._run(kind, batch, pending, report))
            await join()
        finally:
            for task in fetches:  # only when the apply itself ends early (cancelled, a crash)
                task.cancel()
            if fetches:
                await asyncio.wait(fetches)
        due = [s for s in agent_steps if s not in pending.done]
        report.agent_restart_due = bool(due) and not self._blockers(due[0], pending)
        report.duration = time.monotonic() - started
        return report

    def _image_steps(self, cs: ChangeSet, remaining: Sequence[str]) -> dict[str, list[str]]:
        """The remaining file steps whose bytes come from an image, grouped by image (each
        image is pulled once, its files read one after the other)."""
        if self.images is None:
            return {}
        todo = set(remaining)
        groups: dict[str, list[str]] = {}
        for f in cs.files_to_write:
            step = S.file_step(f.path)
            if f.content is None and f.image_ref is not None and step in todo:
                groups.setdefault(f.image_ref.image, []).append(step)
        return groups

    def _blockers(self, cmd: str, pending: Pending) -> list[str]:
        """The steps a unit command depends on that are not done: its unit file, drop-ins,
        enablement, the files in its ``filePaths``, and the reload that makes them count."""
        unit = cmd.split(":", 1)[1]
        deps = {S.unit_step(unit), S.enable_step(unit), S.disable_step(unit), S.RELOAD}
        cs = pending.change_set
        if not any(c.unit == unit and c.removed for c in cs.unit_commands):
            deps.add(S.delete_unit_step(unit))  # our unit file goes before it restarts
        deps |= {S.dropin_step(d.unit, d.name) for d in cs.dropins_to_write if d.unit == unit}
        deps |= {
            S.delete_dropin_step(d.unit, d.name) for d in cs.dropins_to_delete if d.unit == unit
        }
        for applied in (pending.target, pending.base):
            if applied is not None and unit in applied.units:
                deps |= {S.file_step(p) for p in applied.units[unit].file_paths}
        order = {step: i for i, step in enumerate(pending.steps)}
        at = order.get(cmd, len(order))  # a late enable comes after the command: not a blocker
        return sorted(d for d in deps if order.get(d, at) < at and d not in pending.done)

    async def _run(
        self, kind: str, steps: Sequence[str], pending: Pending, rep: ApplyReport
    ) -> tuple[list[str], dict[str, str]]:
        """Run one batch; returns the steps that succeeded and why each other one failed."""
        cs = pending.change_set
        args = {s: s.split(":", 1)[1] if ":" in s else "" for s in steps}
        ok: list[str] = []
        errors: dict[str, str] = {}
        if kind in ("file", "unit", "dropin"):
            items = _writes(cs)
            claims: list[Claim] = []
            for step in steps:
                try:
                    claim = await self._write(items[step], rep)
                except (HostError, ImageError) as exc:
                    errors[step] = str(exc)
                    continue
                if claim is not None:
                    claims.append(claim)
                ok.append(step)
            if claims:
                await self.state.record_written_async(claims)  # before the steps are marked done
        elif kind in ("delete-dropin", "delete-unit", "delete-file"):
            for step in steps:
                if kind == "delete-unit" and self._stop_failed(args[step], pending):
                    errors[step] = "not deleted: stopping the unit failed"
                    continue
                try:  # the deletion and the inventory update, off the loop
                    await asyncio.to_thread(self._remove, kind, args[step], rep)
                except HostError as exc:
                    errors[step] = str(exc)
                    continue
                ok.append(step)
        elif kind in ("enable", "disable"):
            names = {args[s]: s for s in steps}
            good, bad, changed = await self._unit_files(kind, list(names))
            ok += [names[n] for n in good]
            errors |= {names[n]: why for n, why in bad.items()}
            if not changed and not bad:
                self._quiet |= set(steps)
        elif kind in ("reload", "reload-after-enable", "reload-after-delete"):
            if self.systemd is not None and not self._needless(kind, pending):
                await self.systemd.daemon_reload()
            ok += steps
        elif kind == "cmd":
            runnable: list[str] = []
            for step in steps:
                blockers = self._blockers(step, pending)
                if blockers:
                    unit = args[step]
                    errors[step] = "not attempted: " + ", ".join(
                        _describe_step(b, pending, unit) for b in blockers
                    )
                else:
                    runnable.append(step)
            good, bad = await self._commands([args[s] for s in runnable], cs, rep)
            ok += [S.cmd_step(u) for u in good]
            errors |= {S.cmd_step(u): why for u, why in bad.items()}
        else:  # pragma: no cover - step_ids() and this dispatcher change together
            raise AssertionError(f"unknown step kind {kind!r}")
        return ok, errors

    async def _write(
        self, item: FileWrite | UnitWrite | DropInWrite, rep: ApplyReport
    ) -> Claim | None:
        if isinstance(item, FileWrite):
            if item.content is None:
                if item.image_ref is None or self.images is None:
                    rep.skipped.append(f"{item.path}: {NO_IMAGE_STORE}")
                    return None
                return await self._write_from_image(item, item.image_ref, self.images, rep)
            await self._replace(item.path, item.content, item.mode)
            rep.files_written.append(item.path)
            return Claim("file", item.path, item.sha256, item.mode)
        data = item.content.encode()
        if isinstance(item, UnitWrite):
            path = unit_path(item.name)
            await self.fs.write_atomic_async(path, data, UNIT_FILE_MODE)
            rep.units_written.append(item.name)
            return Claim("unit", path, sha256_hex(data), UNIT_FILE_MODE)
        path = drop_in_path(item.unit, item.name)
        await self.fs.write_atomic_async(path, data, UNIT_FILE_MODE)
        return Claim("dropin", path, sha256_hex(data), UNIT_FILE_MODE)

    async def _replace(self, path: str, data: bytes, mode: int) -> None:
        """Write a file atomically; the agent's own binary keeps its previous content beside
        it (only when the content really changes, so a retried write never loses it)."""
        if path in self.keep_previous:
            current = await self.fs.read_async(path)
            if current is not None and current != data:
                kept = await asyncio.to_thread(self.fs.keep_previous, path)
                if kept:
                    log.info("previous agent binary kept", path=path, previous=f"{path}.previous")
        await self.fs.write_atomic_async(path, data, mode)

    async def _write_from_image(
        self, fw: FileWrite, ref: ImageRefContent, images: ImageStore, rep: ApplyReport
    ) -> Claim:
        """Pull the image (once per attempt), read the file, write it atomically: a running
        binary is replaced, never overwritten in place. Claimed by the bytes written."""
        started = time.monotonic()
        digest = self._digests.get(ref.image)
        if digest is None:
            digest = self._digests[ref.image] = await images.pull(ref.image)
        data = await images.read_file(ref.image, ref.file_path_in_image)
        await self._replace(fw.path, data, fw.mode)
        pull = ImagePull(
            image=ref.image,
            digest=digest,
            path_in_image=ref.file_path_in_image,
            target=fw.path,
            size=len(data),
            seconds=round(time.monotonic() - started, 3),
        )
        rep.files_written.append(fw.path)
        rep.pulls.append(pull)
        log.info(
            "file written from image",
            path=fw.path,
            image=ref.image,
            digest=digest,
            file_path_in_image=ref.file_path_in_image,
            bytes=len(data),
            seconds=pull.seconds,
        )
        return Claim("file", fw.path, sha256_hex(data), fw.mode)

    def _remove(self, kind: str, arg: str, rep: ApplyReport) -> None:
        if kind == "delete-dropin":
            unit, name = arg.split("/", 1)
            self._delete(drop_in_path(unit, name), rep)
            self.fs.remove_dir_if_empty(f"{unit_path(unit)}.d")
        elif kind == "delete-unit":
            if self._delete(unit_path(arg), rep):
                rep.units_deleted.append(arg)
            self.fs.remove_dir_if_empty(f"{unit_path(arg)}.d")
        elif self._delete(arg, rep):
            rep.files_deleted.append(arg)
            parent = arg.rsplit("/", 1)[0]
            if parent.startswith(
                CONTAINERD_CERTS_DIR + "/"
            ):  # a registry that left: its directory too
                self.fs.remove_dir_if_empty(parent)

    @staticmethod
    def _stop_failed(unit: str, pending: Pending) -> bool:
        step = S.cmd_step(unit)
        removed = any(c.unit == unit and c.removed for c in pending.change_set.unit_commands)
        return removed and step in pending.steps and step not in pending.done

    def _delete(self, path: str, rep: ApplyReport) -> bool:
        """Delete ``path`` if the agent created it and it is still a regular file holding the
        bytes the agent wrote (``remove_created``; the digest is read only here, from the file
        about to go). Anything else stays, is said in ``skipped`` (a Warning naming the path)
        and is no longer the agent's. Already gone is success."""
        entry = self.state.inventory().entries.get(path)
        if entry is None or not entry.created:
            if self.fs.exists(path):
                rep.skipped.append(f"{path}: not created by node-agent, left in place")
            return False
        removal = remove_created(self.fs, path, entry, by_osc=True)
        self.state.release([path])
        if removal.kept is not None:
            rep.skipped.append(f"{path}: kept, {removal.kept}; no longer node-agent's")
            log.warning(
                "removed item kept: not what the agent wrote", path=path, reason=removal.kept
            )
            return False
        return True

    def _needless(self, reload: str, pending: Pending) -> bool:
        """Whether the reload would change nothing systemd has loaded. Before the commands: no
        unit file or drop-in is written or deleted before it, no command is carried over from
        an unfinished apply, and every enable/disable before it ran in this attempt without
        changing a symlink. After the late enables (``ChangeSet.late_enables``): each of them ran
        in this attempt without changing a symlink. systemd re-reads every unit file on a
        reload, so on a node with many units it is the costliest step of a one-file change."""
        if reload == S.RELOAD_AFTER_ENABLE:
            late = pending.change_set.late_enables()
            return all(S.enable_step(u) in self._quiet for u in late)
        if reload != S.RELOAD:
            return False
        cs = pending.change_set
        if cs.reload:
            return False
        steps = pending.steps
        before = steps[: steps.index(S.RELOAD)] if S.RELOAD in steps else steps
        for step in before:
            kind = step.split(":", 1)[0]
            if kind == "file":
                continue
            if kind in ("enable", "disable") and step in self._quiet:
                continue
            return False
        return True

    async def _unit_files(
        self, kind: str, units: list[str]
    ) -> tuple[list[str], dict[str, str], bool]:
        """Enable or disable ``units``: one call, or one per unit after a failure so that one
        unknown or masked unit does not hold back the others. Disabling a unit whose file is
        already gone is success. The last value: whether any symlink changed (or may have)."""
        if self.systemd is None or not units:
            return units, {}, True
        call = self.systemd.enable if kind == "enable" else self.systemd.disable
        try:
            changes = await call(units)
            return units, {}, bool(changes)
        except SystemdCallError:
            pass
        ok: list[str] = []
        bad: dict[str, str] = {}
        for unit in units:
            try:
                await call([unit])
                ok.append(unit)
            except SystemdCallError as exc:
                if kind == "disable" and _unit_file_missing(exc):
                    ok.append(unit)
                else:
                    bad[unit] = f"{kind} {unit}: {exc}"
        return ok, bad, True

    async def _commands(
        self, units: list[str], cs: ChangeSet, rep: ApplyReport
    ) -> tuple[list[str], dict[str, str]]:
        commands = [c for c in cs.unit_commands if c.unit in set(units)]
        if self.systemd is None or not commands:
            return [c.unit for c in commands], {}
        ok: list[str] = []
        bad: dict[str, str] = {}
        guard = self.guard
        if guard is not None:
            # A unit whose restarts by the agent keep failing is not restarted again.
            for command in commands:
                held = guard.held(command.unit) if _starts(command) else None
                if held is not None and not guard.allows(command.unit):
                    bad[command.unit] = f"not restarted: {held.describe()}"
            commands = [c for c in commands if c.unit not in bad]
            if not commands:
                return ok, bad
        results = await self.systemd.run_jobs(
            [(c.unit, c.action) for c in commands], job_timeout=self.job_timeout
        )
        for command in commands:
            result = results[command.unit]
            if command.removed and command.action == "restart" and _unit_gone(result):
                # It left the OSC and systemd no longer knows it: what can still be running is
                # a leftover of a unit file deleted earlier, so stopping it is what is left.
                stop = await self.systemd.run_jobs(
                    [(command.unit, "stop")], job_timeout=self.job_timeout
                )
                result = stop[command.unit]
            rep.results[command.unit] = result
            # Upstream's contract: a job still running at the deadline does not fail the OSC
            # (upstream goes on after 10 s); the unit is left to finish, not started again
            # by a retry, and the unit check judges it from then on.
            passed = result.ok or result.still_starting
            if guard is not None and _starts(command):
                held = guard.record(command.unit, ok=passed, error=result.describe())
                if held is not None:
                    rep.held.append(held)
            if self.on_command is not None:
                self.on_command(command, result)
            if passed:
                ok.append(command.unit)
                if not result.ok:
                    log.warning(
                        "unit still starting, going on", unit=command.unit, detail=result.describe()
                    )
            else:
                bad[command.unit] = result.describe()
        return ok, bad


def _starts(command: UnitCommand) -> bool:
    """A command that (re)starts a unit: what the restart-storm guard counts."""
    return command.action in ("start", "restart") and not command.removed


def _writes(cs: ChangeSet) -> dict[str, FileWrite | UnitWrite | DropInWrite]:
    """Every write of ``cs`` by its step id (one lookup per step, not a scan)."""
    items: dict[str, FileWrite | UnitWrite | DropInWrite] = {
        S.file_step(f.path): f for f in cs.files_to_write
    }
    items |= {S.unit_step(u.name): u for u in cs.units_to_write}
    items |= {S.dropin_step(d.unit, d.name): d for d in cs.dropins_to_write}
    return items


def _batches(steps: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Consecutive steps of one kind, in order."""
    out: list[tuple[str, list[str]]] = []
    for step in steps:
        kind = step.split(":", 1)[0]
        if out and out[-1][0] == kind:
            out[-1][1].append(step)
        else:
            out.append((kind, [step]))
    return out


def _unit_file_missing(exc: SystemdCallError) -> bool:
    return (
        exc.errno == errno.ENOENT
        or exc.name.endswith("NoSuchUnit")
        or "does not exist" in str(exc)
        or "not found" in str(exc)
    )


def _unit_gone(result: JobResult) -> bool:
    return result.result == "error" and (
        "NoSuchUnit" in result.message or "not found" in result.message
    )


def _describe_step(step: str, pending: Pending, unit: str) -> str:
    """Why a command of ``unit`` was held back by ``step``; the cause is repeated only when it
    is another item's (the unit's own failure is reported on its own line)."""
    kind, _, arg = step.partition(":")
    why = pending.failed.get(step)
    own = arg == unit or arg.startswith(f"{unit}/")
    what = {
        "file": f"{arg} was not written",
        "unit": "its unit file was not written" if own else f"unit file {arg} was not written",
        "dropin": f"drop-in {arg} was not written",
        "delete-dropin": f"drop-in {arg} was not deleted",
        "enable": "enabling it failed" if own else f"enabling {arg} failed",
        "disable": "disabling it failed" if own else f"disabling {arg} failed",
        "reload": "daemon-reload failed",
    }.get(kind, step)
    if own or not why or why.startswith("not attempted"):
        return what
    return f"{what} ({why})"


def _failure(step: str, why: str) -> ItemFailure:
    kind, _, arg = step.partition(":")
    if why.startswith("not attempted:"):
        return ItemFailure(kind="blocked", item=arg or kind, error=why)
    return ItemFailure(kind=_KIND_OF_STEP.get(kind, kind), item=arg or kind, error=why)
