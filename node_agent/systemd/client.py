"""The asyncio side of the systemd seam: ``Systemd`` talks to a worker process over pipes.

Why: pystemd holds the GIL for every D-Bus round trip, so calling it on (or beside) the event
loop stalls the whole agent, Lease heartbeat included. ``node_agent.systemd.worker`` owns the bus
instead; here every call is a JSON line with a request id and a deadline. Several tasks may call
concurrently (replies are matched by id). If a call misses its deadline the worker is presumed
hung: it is killed, every call in flight fails with a typed error, and the next call spawns a
fresh worker. The worker dies with the agent (stdin EOF, and PR_SET_PDEATHSIG as a backstop).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from node_agent.base.errors import (
    SystemdCallError,
    SystemdError,
    SystemdTimeout,
    SystemdUnavailable,
    SystemdWorkerDied,
)
from node_agent.base.loop import cancel_and_wait
from node_agent.systemd.types import (
    JOB_ACTIONS,
    JobAction,
    JobResult,
    UnitFileChange,
    UnitState,
)

log = structlog.get_logger("node_agent.systemd")

WORKER_MODULE = "node_agent.systemd.worker"
#: Replies can be large (unit states with many drop-ins); asyncio's default line limit is 64 KiB.
LINE_LIMIT = 16 << 20
STDERR_TAIL = 20
#: A worker still starting after ``start_timeout`` gets this many times as long in all.
SLOW_START_PATIENCE = 4
#: Extra time a job batch gets beyond its job timeout for queuing the jobs and replying.
JOB_BATCH_SLACK = 5.0


class _Worker:
    """One running worker process and the calls waiting for its replies."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pending: dict[int, asyncio.Future[Any]] = {}
        self.stderr: deque[str] = deque(maxlen=STDERR_TAIL)
        self.write_lock = asyncio.Lock()
        self.dead: SystemdError | None = None
        self.hello: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.tasks: list[asyncio.Task[None]] = []

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self) -> str:
        return " | ".join(self.stderr) if self.stderr else "(no stderr)"

    def fail(self, error: SystemdError) -> None:
        """Mark dead and fail every waiter with ``error``."""
        if self.dead is None:
            self.dead = error
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
                # retrieved: the call whose own send failed raises that error itself and never
                # awaits its future (no "Future exception was never retrieved" at shutdown)
                future.exception()
        self.pending.clear()
        if not self.hello.done():
            self.hello.set_exception(error)
            self.hello.exception()  # retrieved: no "never retrieved" warning if nobody waits

    async def read_replies(self) -> None:
        assert self.proc.stdout is not None
        while True:
            try:
                line = await self.proc.stdout.readline()
            except (ValueError, asyncio.LimitOverrunError) as exc:
                self.fail(SystemdWorkerDied(f"systemd worker {self.pid} sent garbage: {exc}"))
                return
            if not line:
                code = await self.proc.wait()
                await asyncio.sleep(0)  # let the stderr reader catch up for the message
                self.fail(
                    SystemdWorkerDied(
                        f"systemd worker {self.pid} exited with {code}; "
                        f"stderr: {self.stderr_tail()}"
                    )
                )
                return
            try:
                reply = json.loads(line)
                request_id = int(reply["id"])
            except (ValueError, KeyError, TypeError):
                log.warning("systemd worker sent an unparsable line", line=line[:200])
                continue
            if request_id == 0:
                if not self.hello.done():
                    if reply.get("ok"):
                        self.hello.set_result(reply.get("result") or {})
                    else:
                        self.hello.set_exception(
                            SystemdUnavailable(
                                f"systemd worker could not reach systemd: "
                                f"{_error_text(reply.get('error'))}"
                            )
                        )
                continue
            future = self.pending.pop(request_id, None)
            if future is None or future.done():
                continue  # its caller gave up already
            if reply.get("ok"):
                future.set_result(reply.get("result"))
            else:
                future.set_exception(_RemoteError(reply.get("error") or {}))

    async def read_stderr(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self.stderr.append(text)
            log.warning("systemd worker stderr", pid=self.pid, line=text)

    async def send(self, request: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        data = (json.dumps(request, separators=(",", ":")) + "\n").encode()
        async with self.write_lock:
            if self.dead is not None:
                raise self.dead
            try:
                self.proc.stdin.write(data)
                await self.proc.stdin.drain()
            except (BrokenPipeError, ConnectionResetError) as exc:
                error = SystemdWorkerDied(f"systemd worker {self.pid} is gone ({exc})")
                self.fail(error)
                raise error from exc

    async def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(5.0):
                await self.proc.wait()
        await cancel_and_wait(*self.tasks)


class _RemoteError(Exception):
    """An error reply from the worker, turned into a SystemdError by the caller."""

    def __init__(self, error: Mapping[str, Any]) -> None:
        super().__init__(_error_text(error))
        self.error = error


def _error_text(error: Any) -> str:
    if not isinstance(error, Mapping):
        return str(error)
    name = error.get("name")
    message = str(error.get("message", "unknown error"))
    return f"{name}: {message}" if name else message


class Systemd:
    """Asynchronous systemd manager over a worker process; satisfies ``SystemdSeam``.

    ``address`` is a D-Bus address (``unix:path=...``); None means the system bus.
    ``call_timeout`` bounds every call except job batches, which get their ``job_timeout`` plus
    a few seconds; ``bus_timeout`` is what the worker gives sd-bus for each single D-Bus call.
    """

    def __init__(
        self,
        address: str | bytes | None = None,
        *,
        call_timeout: float = 30.0,
        bus_timeout: float = 20.0,
        start_timeout: float = 15.0,
        python: str = sys.executable,
    ) -> None:
        self.address = address.decode() if isinstance(address, bytes) else address
        self.call_timeout = call_timeout
        self.bus_timeout = bus_timeout
        self.start_timeout = start_timeout
        self.python = python
        self._worker: _Worker | None = None
        self._spawn_lock = asyncio.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self.systemd_version: str = ""
        #: How many workers were spawned (a respawn after a hang or crash counts).
        self.spawn_count = 0
        #: set once a worker process exists (``start_early`` returns then)
        self.spawned = asyncio.Event()

    # -- life cycle ---------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the worker and wait until it is connected and subscribed."""
        self._closed = False
        await self._ensure_worker()

    async def close(self) -> None:
        """Stop the worker (closing its stdin makes it exit; killed if it lingers)."""
        self._closed = True
        worker, self._worker = self._worker, None
        if worker is None:
            return
        if worker.proc.stdin is not None:
            worker.proc.stdin.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await worker.proc.wait()
        worker.fail(SystemdWorkerDied("the systemd adapter was closed"))
        await worker.kill()

    async def __aenter__(self) -> Systemd:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def worker_pid(self) -> int | None:
        """PID of the live worker, if any (tests use it to kill or freeze the worker)."""
        worker = self._worker
        return worker.pid if worker is not None and worker.dead is None else None

    async def _ensure_worker(self) -> _Worker:
        worker = self._worker
        if worker is not None and worker.dead is None:
            return worker
        async with self._spawn_lock:
            if self._closed:
                raise SystemdUnavailable("the systemd adapter is closed")
            worker = self._worker
            if worker is not None and worker.dead is None:
                return worker
            if worker is not None:
                await worker.kill()
            self._worker = None
            worker = await self._spawn()
            self._worker = worker
            return worker

    async def _hello(self, worker: _Worker) -> dict[str, Any]:
        """The worker's hello. A worker that is still starting when ``start_timeout`` is up
        is given up to ``SLOW_START_PATIENCE`` times as long in all, with a warning: on a
        loaded machine (a boot, software emulation) a start can take that long, and a new
        worker would start no faster."""
        try:
            async with asyncio.timeout(self.start_timeout):
                return await asyncio.shield(worker.hello)
        except TimeoutError:
            if worker.proc.returncode is not None or worker.hello.done():
                raise
        log.warning(
            "systemd worker slow to connect, waiting longer",
            pid=worker.pid,
            seconds=self.start_timeout,
        )
        async with asyncio.timeout(self.start_timeout * (SLOW_START_PATIENCE - 1)):
            return await asyncio.shield(worker.hello)

    async def _spawn(self) -> _Worker:
        argv = [
            self.python,
            "-m",
            WORKER_MODULE,
            "--parent-pid",
            str(os.getpid()),
            "--bus-timeout",
            str(self.bus_timeout),
        ]
        if self.address:
            argv += ["--address", self.address]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                limit=LINE_LIMIT,
                start_new_session=True,  # a Ctrl-C to the agent's group is the agent's to handle
            )
        except OSError as exc:
            raise SystemdUnavailable(f"cannot start the systemd worker: {exc}") from exc
        self.spawn_count += 1
        self.spawned.set()
        worker = _Worker(proc)
        worker.tasks = [
            asyncio.create_task(worker.read_replies(), name=f"systemd-worker-{proc.pid}-out"),
            asyncio.create_task(worker.read_stderr(), name=f"systemd-worker-{proc.pid}-err"),
        ]
        try:
            hello = await self._hello(worker)
        except TimeoutError:
            worker.fail(SystemdUnavailable("systemd worker start timed out"))
            await worker.kill()
            raise SystemdUnavailable(
                f"systemd worker {proc.pid} did not connect within "
                f"{self.start_timeout * SLOW_START_PATIENCE:g}s; "
                f"stderr: {worker.stderr_tail()}"
            ) from None
        except SystemdError as exc:
            await worker.kill()
            raise SystemdUnavailable(str(exc)) from exc
        except BaseException:  # cancelled while waiting: leave no untracked process behind
            worker.fail(SystemdUnavailable("systemd worker start was cancelled"))
            await asyncio.shield(worker.kill())
            raise
        self.systemd_version = str(hello.get("systemd", ""))
        log.debug("systemd worker started", pid=proc.pid, systemd=self.systemd_version)
        return worker

    # -- calls --------------------------------------------------------------------------
    async def _call(
        self,
        op: str,
        args: dict[str, Any] | None = None,
        *,
        deadline: float | None = None,
        units: Sequence[str] = (),
    ) -> Any:
        if deadline is None:
            deadline = self.call_timeout
        loop = asyncio.get_running_loop()
        # Spawning is bounded by start_timeout on its own; the call's deadline starts after it.
        worker = await self._ensure_worker()
        started = loop.time()
        request_id = next(self._ids)
        future: asyncio.Future[Any] = loop.create_future()
        worker.pending[request_id] = future
        try:
            await worker.send({"id": request_id, "op": op, "args": args or {}})
            remaining = max(0.0, deadline - (loop.time() - started))
            async with asyncio.timeout(remaining):
                return await future
        except TimeoutError:
            pid = worker.pid
            error = SystemdTimeout(
                f"systemd {op} got no answer within {deadline:g}s; "
                f"killed worker {pid}, the next call starts a new one",
                op=op,
                timeout=deadline,
            )
            worker.fail(SystemdWorkerDied(f"systemd worker {pid} was killed: {error}"))
            await worker.kill()
            log.warning("systemd call timed out; worker killed", op=op, pid=pid)
            raise error from None
        except _RemoteError as exc:
            kind = exc.error.get("kind")
            text = f"systemd {op}{_for_units(units)} failed: {exc}"
            if kind == "request":
                raise SystemdError(text) from None
            raise SystemdCallError(
                text,
                op=op,
                name=str(exc.error.get("name", "")),
                errno=int(exc.error.get("errno", 0) or 0),
                units=tuple(units),
            ) from None
        except SystemdWorkerDied as exc:
            raise SystemdWorkerDied(f"systemd {op}{_for_units(units)}: {exc}") from None
        finally:
            worker.pending.pop(request_id, None)

    async def daemon_reload(self) -> None:
        """``systemctl daemon-reload``: re-read every unit file."""
        await self._call("daemon_reload")

    async def enable(self, units: Sequence[str]) -> list[UnitFileChange]:
        """Enable unit files (not runtime, forced). An alias name enables the unit it names."""
        if not units:
            return []
        result = await self._call("enable", {"units": list(units)}, units=units)
        return _changes(result)

    async def disable(self, units: Sequence[str]) -> list[UnitFileChange]:
        """Disable unit files (not runtime). systemd removes every symlink to the unit in /etc,
        an alias symlink too."""
        if not units:
            return []
        result = await self._call("disable", {"units": list(units)}, units=units)
        return _changes(result)

    async def run_jobs(
        self, jobs: Sequence[tuple[str, JobAction]], *, job_timeout: float = 10.0
    ) -> dict[str, JobResult]:
        """Queue all jobs at once (mode ``replace``) and wait up to ``job_timeout`` for them.

        Never raises for a job that fails: look at each ``JobResult``. Raises only when the
        worker itself fails or the batch exceeds ``job_timeout`` plus a few seconds.
        """
        seen: set[str] = set()
        for unit, action in jobs:
            if action not in JOB_ACTIONS:
                raise ValueError(f"unknown job action {action!r} for {unit}")
            if unit in seen:
                raise ValueError(f"unit {unit} appears twice in one job batch")
            seen.add(unit)
        if not jobs:
            return {}
        names = [unit for unit, _ in jobs]
        raw = await self._call(
            "jobs",
            {"jobs": [[unit, action] for unit, action in jobs], "timeout": job_timeout},
            deadline=job_timeout + JOB_BATCH_SLACK + 0.05 * len(jobs),
            units=names,
        )
        results = {
            item["unit"]: JobResult(
                unit=item["unit"],
                action=item["action"],
                result=str(item["result"]),
                finished=bool(item["finished"]),
                job=item.get("path"),
                message=str(item.get("message") or ""),
            )
            for item in raw
        }
        for result in results.values():
            if not result.ok:
                log.info("systemd job did not succeed", job=result.describe())
        return results

    async def start_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult:
        return (await self.run_jobs([(unit, "start")], job_timeout=job_timeout))[unit]

    async def stop_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult:
        return (await self.run_jobs([(unit, "stop")], job_timeout=job_timeout))[unit]

    async def restart_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult:
        return (await self.run_jobs([(unit, "restart")], job_timeout=job_timeout))[unit]

    async def unit_states(
        self, names: Sequence[str], *, brief: bool = False
    ) -> dict[str, UnitState]:
        """Current state of each named unit (a unit that does not exist has load_state
        ``not-found``). ``brief``: one ``ListUnitsByNames`` call for all of them (id, load,
        active and sub state only; the rest at zero values) instead of reading each unit's
        properties, e.g. for a periodic check of units that mostly just run."""
        if not names:
            return {}
        args: dict[str, Any] = {"units": list(names)}
        if brief:
            args["brief"] = True
        raw = await self._call("unit_states", args, units=names)
        return {name: _unit_state(name, raw[name]) for name in names}

    async def failed_units(self) -> list[str]:
        """Names of all units systemd currently has in the ``failed`` state."""
        return [str(name) for name in await self._call("failed_units")]


def _for_units(units: Sequence[str]) -> str:
    if not units:
        return ""
    shown = ", ".join(units[:5]) + (f" and {len(units) - 5} more" if len(units) > 5 else "")
    return f" of {shown}"


def _changes(result: Any) -> list[UnitFileChange]:
    return [UnitFileChange(kind, path, source) for kind, path, source in result["changes"]]


def _unit_state(name: str, raw: Mapping[str, Any]) -> UnitState:
    return UnitState(
        name=name,
        id=str(raw["id"]),
        load_state=str(raw["load_state"]),
        active_state=str(raw["active_state"]),
        sub_state=str(raw["sub_state"]),
        unit_file_state=str(raw["unit_file_state"]),
        invocation_id=str(raw["invocation_id"]),
        fragment_path=str(raw["fragment_path"]),
        drop_in_paths=tuple(str(p) for p in raw["drop_in_paths"]),
        state_change_timestamp=int(raw["state_change_timestamp"]),
        n_restarts=raw["n_restarts"],
        main_pid=raw["main_pid"],
        exec_main_start_timestamp=raw["exec_main_start_timestamp"],
        result=raw["result"],
        service_type=str(raw.get("service_type") or ""),
        triggered_by=tuple(str(u) for u in raw.get("triggered_by") or ()),
    )


EarlySystemd = tuple[Systemd, "asyncio.Task[None]"]


async def start_early(address: str | None, call_timeout: float) -> EarlySystemd:
    """Start the worker and return as soon as its process exists, with the task that finishes
    connecting: the daemon imports its modules meanwhile, while the worker boots on its own."""
    systemd = Systemd(address, call_timeout=call_timeout)
    connecting = asyncio.create_task(systemd.start(), name="systemd-connect")
    spawned = asyncio.create_task(systemd.spawned.wait())
    await asyncio.wait((connecting, spawned), return_when=asyncio.FIRST_COMPLETED)
    spawned.cancel()
    return systemd, connecting
