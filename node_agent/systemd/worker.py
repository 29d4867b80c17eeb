"""The worker process that owns the D-Bus connection to systemd.

Why a process: every pystemd call holds the GIL for its whole round trip, so a slow or hung
systemd (or dbus-daemon) would freeze the agent's event loop, Lease heartbeat included, and a
thread cannot help. This program does all the D-Bus work; the agent talks to it over pipes
(``node_agent.systemd.client``) and can kill and respawn it when a call hangs.

Protocol: one JSON object per line. Requests on stdin ``{"id": n, "op": ..., "args": {...}}``,
replies on stdout ``{"id": n, "ok": true, "result": ...}`` or ``{"id": n, "ok": false, "error":
{...}}``. The first line the worker writes is a hello with id 0 once the bus is open and
subscribed. Job batches are answered when their jobs finish or their deadline passes; other
requests are served meanwhile. The worker exits when stdin closes or its parent dies.

Run as ``python -m node_agent.systemd.worker [--address ADDR]`` (default: the system bus).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pystemd.dbuslib import DBus

# The worker imports only what it runs: no asyncio, structlog, pydantic or kubernetes client (the
# package ``node_agent.systemd`` loads its asyncio client lazily), and pystemd's sd-bus binding
# without pystemd's package initialiser (see ``load_dbuslib``). tests/unit/
# test_systemd_worker_imports.py keeps it so.

PROTOCOL = 1
DEST = b"org.freedesktop.systemd1"
MANAGER_PATH = b"/org/freedesktop/systemd1"
MANAGER = b"org.freedesktop.systemd1.Manager"
UNIT = b"org.freedesktop.systemd1.Unit"
SERVICE = b"org.freedesktop.systemd1.Service"
PROPERTIES = b"org.freedesktop.DBus.Properties"
JOB_METHODS = {"start": b"StartUnit", "stop": b"StopUnit", "restart": b"RestartUnit"}
#: Results of JobRemoved we did not claim yet are forgotten after this long.
UNCLAIMED_TTL = 300.0
PR_SET_PDEATHSIG = 1


def load_dbuslib(*, bare_package: bool = False) -> ModuleType:
    """pystemd's sd-bus binding (``pystemd.dbuslib``), the only part of pystemd the worker uses.

    ``pystemd/__init__`` imports its object layer (``pystemd.systemd1``, ``pystemd.base``, lxml,
    inspect...): about 8 MiB of a process that only needs the binding. With ``bare_package`` and
    pystemd not imported yet, the package is registered without running its initialiser, so that
    importing the submodule loads just ``dbuslib`` and what it imports itself. Only the worker
    program does this (its process uses nothing else of pystemd); anywhere else pystemd is imported
    the ordinary way.
    """
    loaded = sys.modules.get("pystemd.dbuslib")
    if loaded is not None:
        return loaded
    if bare_package and "pystemd" not in sys.modules:
        spec = importlib.util.find_spec("pystemd")
        if spec is not None and spec.submodule_search_locations is not None:
            sys.modules["pystemd"] = importlib.util.module_from_spec(spec)
    return importlib.import_module("pystemd.dbuslib")


class RequestError(Exception):
    """The request itself is malformed; reported back, the worker carries on."""


def _s(value: Any) -> str:
    """D-Bus strings arrive as bytes; keep odd bytes round-trippable through JSON."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "surrogateescape")
    return str(value)


def _b(value: str) -> bytes:
    return value.encode("utf-8", "surrogateescape")


def describe_dbus_error(exc: BaseException) -> dict[str, Any]:
    """Name, errno and message of a pystemd DBusError, without its boilerplate."""
    name = getattr(exc, "err_name", b"") or type(exc).__name__
    message = getattr(exc, "err_message", b"") or str(exc)
    return {
        "kind": "dbus",
        "name": _s(name),
        "errno": int(getattr(exc, "errno", 0) or 0),
        "message": _s(message),
    }


def is_dbus_error(exc: BaseException) -> bool:
    return any(cls.__name__ == "DBusBaseError" for cls in type(exc).__mro__)


@dataclass
class Job:
    unit: str
    action: str
    path: str | None = None
    result: str | None = None
    finished: bool = False
    message: str = ""
    #: the start limit was reset once for this job (see ``_retry_past_start_limit``)
    limit_reset: bool = False


@dataclass
class Batch:
    request_id: int
    deadline: float
    timeout: float
    jobs: list[Job] = field(default_factory=list)


class Worker:
    """Serves requests on one long-lived bus; collects JobRemoved signals by job path."""

    def __init__(self, bus: DBus, out_fd: int) -> None:
        self.bus = bus
        self.out_fd = out_fd
        self.batches: list[Batch] = []
        # job path -> (unit, result, monotonic time it arrived)
        self.removed: dict[str, tuple[str, str, float]] = {}
        self._on_job_removed = self._make_callback()
        self._apply_signature: Callable[[bytes, list[Any]], Any] = load_dbuslib().apply_signature

    # -- D-Bus plumbing ---------------------------------------------------------------------
    def _make_callback(self) -> Callable[..., None]:
        removed = self.removed

        # A plain function (pystemd sets an attribute on it, which a bound method refuses),
        # kept referenced by self: sd-bus holds only a raw pointer to it.
        def on_job_removed(msg: Any, error: Any = None, userdata: Any = None) -> None:
            msg.process_reply(False)
            _job_id, job_path, unit, result = msg.body
            removed[_s(job_path)] = (_s(unit), _s(result), time.monotonic())

        return on_job_removed

    def subscribe(self) -> None:
        self.bus.match_signal(DEST, MANAGER_PATH, MANAGER, b"JobRemoved", self._on_job_removed)
        self.manager(b"Subscribe")

    def manager(self, method: bytes, signature: bytes = b"", *args: Any) -> Any:
        call_args = self._apply_signature(signature, list(args)) if signature else []
        return self.bus.call_method(DEST, MANAGER_PATH, MANAGER, method, call_args).body

    def get_all(self, path: bytes, interface: bytes) -> dict[bytes, Any]:
        body = self.bus.call_method(
            DEST, path, PROPERTIES, b"GetAll", self._apply_signature(b"s", [interface])
        ).body
        return body if isinstance(body, dict) else {}

    def get_property(self, path: bytes, interface: bytes, name: bytes, rtype: bytes) -> Any:
        return self.bus.get_property(DEST, path, interface, name, rtype)

    def drain_bus(self) -> bool:
        """Dispatch every queued message (signals queued during a method call included);
        True if there was any."""
        for turn in range(10_000):
            if self.bus.process().is_empty():
                return turn > 0
        return True

    # -- operations -------------------------------------------------------------------------
    def op_daemon_reload(self, args: dict[str, Any]) -> None:
        self.manager(b"Reload")

    def op_enable(self, args: dict[str, Any]) -> dict[str, Any]:
        names = _names(args)
        try:
            reply = self.manager(b"EnableUnitFiles", b"asbb", [_b(n) for n in names], False, True)
            resolved: dict[str, str] = {}
        except Exception as exc:
            if not _is_unit_linked(exc):
                raise
            # A name that is an alias (or a linked unit file) cannot be enabled itself
            # (gardener#11026): enable the unit it resolves to instead.
            resolved = {n: self.canonical_name(n) for n in names}
            targets = list(dict.fromkeys(resolved.values()))
            reply = self.manager(b"EnableUnitFiles", b"asbb", [_b(n) for n in targets], False, True)
        carries_install_info, changes = reply
        return {
            "carries_install_info": bool(carries_install_info),
            "changes": _changes(changes),
            "resolved": {k: v for k, v in resolved.items() if k != v},
        }

    def op_disable(self, args: dict[str, Any]) -> dict[str, Any]:
        # Unlike enable, disable accepts an alias name; note that systemd then removes every
        # symlink to the unit in /etc, the alias symlink included (measured on 252).
        changes = self.manager(b"DisableUnitFiles", b"asb", [_b(n) for n in _names(args)], False)
        return {"changes": _changes(changes)}

    def canonical_name(self, name: str) -> str:
        """The unit's own name when ``name`` is one of its aliases, else ``name``."""
        try:
            path = self.manager(b"LoadUnit", b"s", _b(name))
            load_state = _s(self.get_property(path, UNIT, b"LoadState", b"s"))
            if load_state != "loaded":
                return name
            return _s(self.get_property(path, UNIT, b"Id", b"s")) or name
        except Exception as exc:
            if is_dbus_error(exc):
                return name
            raise

    def op_unit_states(self, args: dict[str, Any]) -> dict[str, Any]:
        names = _names(args)
        if args.get("brief"):
            return self.brief_states(names)
        return {name: self.unit_state(name) for name in names}

    def brief_states(self, names: list[str]) -> dict[str, Any]:
        """Load, active and sub state of every unit in one ``ListUnitsByNames`` call (systemd
        answers in the order asked, loading units as ``LoadUnit`` does)."""
        rows = self.manager(b"ListUnitsByNames", b"as", [_b(n) for n in names]) or []
        return {
            name: {
                **_ZERO_STATE,
                "id": _s(row[0]),
                "load_state": _s(row[2]),
                "active_state": _s(row[3]),
                "sub_state": _s(row[4]),
            }
            for name, row in zip(names, rows, strict=False)
        }

    def unit_state(self, name: str) -> dict[str, Any]:
        path = self.manager(b"LoadUnit", b"s", _b(name))
        unit = self.get_all(path, UNIT)
        state: dict[str, Any] = {
            "id": _s(unit.get(b"Id", name)),
            "load_state": _s(unit.get(b"LoadState", "")),
            "active_state": _s(unit.get(b"ActiveState", "")),
            "sub_state": _s(unit.get(b"SubState", "")),
            "unit_file_state": _s(unit.get(b"UnitFileState", "")),
            "invocation_id": bytes(unit.get(b"InvocationID") or b"").hex(),
            "fragment_path": _s(unit.get(b"FragmentPath", "")),
            "drop_in_paths": [_s(p) for p in unit.get(b"DropInPaths") or []],
            "state_change_timestamp": int(unit.get(b"StateChangeTimestamp") or 0),
            "n_restarts": None,
            "main_pid": None,
            "exec_main_start_timestamp": None,
            "result": None,
            "service_type": "",
            "triggered_by": [_s(u) for u in unit.get(b"TriggeredBy") or []],
        }
        if state["id"].endswith(".service") and state["load_state"] == "loaded":
            # Five properties one by one: the Service interface's GetAll answers some 250 (the
            # command lines, the sandboxing...), which cost systemd and this process three times
            # as much as these calls.
            def get(name: bytes, rtype: bytes) -> Any:
                return self.get_property(path, SERVICE, name, rtype)

            state["n_restarts"] = int(get(b"NRestarts", b"u") or 0)
            state["main_pid"] = int(get(b"MainPID", b"u") or 0)
            state["exec_main_start_timestamp"] = int(get(b"ExecMainStartTimestamp", b"t") or 0)
            state["result"] = _s(get(b"Result", b"s") or "")
            state["service_type"] = _s(get(b"Type", b"s") or "")
        return state

    def op_failed_units(self, args: dict[str, Any]) -> list[str]:
        units = self.manager(b"ListUnitsFiltered", b"as", [b"failed"])
        return sorted(_s(u[0]) for u in units or [])

    def op_jobs(self, request_id: int, args: dict[str, Any]) -> Batch:
        raw = args.get("jobs")
        timeout = float(args.get("timeout", 10.0))
        if not isinstance(raw, list) or timeout <= 0:
            raise RequestError("jobs needs a list of [unit, action] and a positive timeout")
        batch = Batch(request_id, time.monotonic() + timeout, timeout)
        for item in raw:
            if not (isinstance(item, list) and len(item) == 2 and item[1] in JOB_METHODS):
                raise RequestError(f"bad job {item!r}: want [unit, start|stop|restart]")
            batch.jobs.append(Job(str(item[0]), str(item[1])))
        for job in batch.jobs:
            self.queue(job)
        return batch

    def queue(self, job: Job) -> None:
        try:
            path = self.manager(JOB_METHODS[job.action], b"ss", _b(job.unit), b"replace")
            job.path = _s(path)
        except Exception as exc:
            if not is_dbus_error(exc):
                raise
            err = describe_dbus_error(exc)
            job.finished = True
            if job.action == "stop" and err["name"] == "DBusNoSuchUnitError":
                job.result, job.message = "done", "unit not loaded, nothing to stop"
            else:
                job.result = "error"
                job.message = f"{err['name']}: {err['message']}"

    def _retry_past_start_limit(self, job: Job) -> None:
        """A start or restart the agent asked for that failed only on the unit's start limit
        (``StartLimitBurst`` starts within ``StartLimitIntervalSec``, e.g. several OSC updates
        in a row restarting containerd) is not a verdict on the unit: reset the limit, as
        ``systemctl reset-failed`` does, and queue the job again, once. A unit that then fails
        by itself fails the job with its own result."""
        if job.limit_reset or job.action == "stop" or job.result != "failed":
            return
        try:
            if self.unit_state(job.unit)["result"] != "start-limit-hit":
                return
            self.manager(b"ResetFailedUnit", b"s", _b(job.unit))
        except Exception as exc:
            if is_dbus_error(exc):
                return
            raise
        job.limit_reset, job.finished, job.result = True, False, None
        job.message = ""
        self.queue(job)

    # -- job batches ------------------------------------------------------------------------
    def settle_batches(self) -> None:
        """Answer the batches that are complete or past their deadline. Its own D-Bus calls
        (a failed job's unit state, a job queued again) can read signals into sd-bus's queue,
        where select() on the socket does not see them: the caller drains the bus again."""
        now = time.monotonic()
        for batch in list(self.batches):
            for job in batch.jobs:
                if not job.finished and job.path in self.removed:
                    _unit, result, _at = self.removed.pop(job.path)
                    job.result, job.finished = result, True
                    self._retry_past_start_limit(job)
            expired = now >= batch.deadline
            if not expired and not all(job.finished for job in batch.jobs):
                continue
            self.batches.remove(batch)
            for job in batch.jobs:
                if not job.finished:
                    job.result = "timeout"
                    job.message = (
                        f"job {job.path} still running after {batch.timeout:g}s"
                        f"{self.status_note(job.unit)}"
                    )
                elif job.result not in ("done", "skipped", "error") and not job.message:
                    job.message = f"job {job.result}{self.status_note(job.unit)}"
                if job.limit_reset and job.message:
                    job.message += " (after its start limit was reset once)"
            self.reply(batch.request_id, True, [job.__dict__ for job in batch.jobs])
        for path, (_unit, _result, at) in list(self.removed.items()):
            if now - at > UNCLAIMED_TTL:
                del self.removed[path]

    def status_note(self, unit: str) -> str:
        """A short 'unit is failed (exit-code, status 1)' note for a job that went wrong."""
        try:
            state = self.unit_state(unit)
            note = f"; unit is {state['active_state']} ({state['sub_state']}"
            if state["result"]:
                note += f", result {state['result']}"
            return note + ")"
        except Exception as exc:
            if is_dbus_error(exc):
                return ""
            raise

    def next_wakeup(self) -> float:
        if not self.batches:
            return 30.0
        return max(0.0, min(b.deadline for b in self.batches) - time.monotonic())

    # -- request loop -----------------------------------------------------------------------
    def reply(self, request_id: int, ok: bool, payload: Any) -> None:
        message = {"id": request_id, "ok": ok, ("result" if ok else "error"): payload}
        data = (json.dumps(message, separators=(",", ":")) + "\n").encode()
        view = memoryview(data)
        while view:
            written = os.write(self.out_fd, view)
            view = view[written:]

    def handle_line(self, line: bytes) -> None:
        request_id = 0
        try:
            request = json.loads(line)
            request_id = int(request["id"])
            op = str(request["op"])
            args = request.get("args") or {}
            if op == "jobs":
                self.batches.append(self.op_jobs(request_id, args))
                return
            handler = getattr(self, f"op_{op}", None)
            if handler is None:
                raise RequestError(f"unknown operation {op!r}")
            self.reply(request_id, True, handler(args))
        except RequestError as exc:
            self.reply(request_id, False, {"kind": "request", "message": str(exc)})
        except (ValueError, KeyError, TypeError) as exc:
            self.reply(request_id, False, {"kind": "request", "message": repr(exc)})
        except Exception as exc:
            if not is_dbus_error(exc):
                raise
            self.reply(request_id, False, describe_dbus_error(exc))

    def serve(self, in_fd: int) -> None:
        buffer = b""
        bus_fd = self.bus.get_fd()
        while True:
            self.drain_bus()
            self.settle_batches()
            while self.drain_bus():  # what settling's own calls read meanwhile
                self.settle_batches()
            readable, _, _ = select.select([in_fd, bus_fd], [], [], self.next_wakeup())
            if in_fd in readable:
                chunk = os.read(in_fd, 1 << 16)
                if not chunk:
                    return  # the agent closed our stdin: it is gone or wants us gone
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        self.handle_line(line)


#: The fields of a unit state that a brief read leaves at their zero values.
_ZERO_STATE: dict[str, Any] = {
    "unit_file_state": "",
    "invocation_id": "",
    "fragment_path": "",
    "drop_in_paths": [],
    "state_change_timestamp": 0,
    "n_restarts": None,
    "main_pid": None,
    "exec_main_start_timestamp": None,
    "result": None,
    "service_type": "",
    "triggered_by": [],
}


def _names(args: dict[str, Any]) -> list[str]:
    names = args.get("units")
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise RequestError("units must be a list of unit names")
    return names


def _changes(changes: Any) -> list[list[str]]:
    return [[_s(kind), _s(path), _s(source)] for kind, path, source in changes or []]


def _is_unit_linked(exc: BaseException) -> bool:
    return is_dbus_error(exc) and (
        _s(getattr(exc, "err_name", b"")).endswith(".UnitLinked")
        or "linked unit file" in _s(getattr(exc, "err_message", b""))
    )


def die_with_parent(parent_pid: int | None) -> None:
    """SIGKILL us when the agent dies, even if it could not close our stdin."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before prctl took effect


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="node_agent.systemd.worker")
    parser.add_argument("--address", help="D-Bus address (default: the system bus)")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--bus-timeout", type=float, default=20.0, help="seconds per D-Bus call")
    opts = parser.parse_args(argv)
    die_with_parent(opts.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides when we stop
    # sd-bus reads this for its default method-call timeout.
    os.environ["SYSTEMD_BUS_TIMEOUT"] = f"{max(opts.bus_timeout, 0.001):.3f}s"
    # Keep the protocol pipe to ourselves: anything else printing goes to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)
    dbuslib = load_dbuslib(bare_package=True)
    bus: DBus = (
        dbuslib.DBusAddress(opts.address.encode(), False) if opts.address else dbuslib.DBus()
    )
    worker: Worker | None = None
    try:
        bus.open()
        worker = Worker(bus, out_fd)
        worker.subscribe()
        version = worker.get_property(MANAGER_PATH, MANAGER, b"Version", b"s")
    except Exception as exc:
        if not is_dbus_error(exc):
            raise
        error = describe_dbus_error(exc)
        Worker(bus, out_fd).reply(0, False, error)
        return 2
    worker.reply(0, True, {"protocol": PROTOCOL, "pid": os.getpid(), "systemd": _s(version)})
    try:
        worker.serve(0)
    except BrokenPipeError:
        return 0
    finally:
        with contextlib.suppress(Exception):
            bus.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
