"""The server half of ``node-agent status``: the agent's unix socket and the live status document.

The document is the read side's :class:`~node_agent.observe.view.AgentView` as JSON (one builder per
section in :data:`SECTIONS`), plus what only the disk and systemd know (the last apply record, a
change set in progress, the inventory, the units' states), read per request without blocking the
loop. Field names and order are ``status_document.skeleton()``'s; see
:mod:`node_agent.commands.status` for the protocol and the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import json
import os
import socket
import stat
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node_agent.base.errors import NodeAgentError, UnsafePathError
from node_agent.base.log import get_logger
from node_agent.base.text import scrub
from node_agent.host import selfupdate
from node_agent.observe.status_document import (
    CLIENT_TIMEOUT,
    REQUEST,
    apply_entry,
    inventory_counts,
    iso,
    pending_entry,
    skeleton,
    socket_path,
)
from node_agent.observe.view import AgentView, ErrorView

if TYPE_CHECKING:
    from node_agent.context import AgentContext

log = get_logger("node-agent.status")

#: The server's bound on asking systemd for unit states, below the client's timeout.
UNIT_STATES_TIMEOUT = 1.0


# --- the sections read from the view -----------------------------------------------------------


def _error_entry(entry: ErrorView) -> dict[str, Any]:
    return {"at": entry.at, "source": entry.source, "error": scrub(entry.error)}


def agent_section(view: AgentView) -> dict[str, Any]:
    process = view.process
    return {
        "running": True,
        "not_running_reason": None,
        "version": process.version,
        "pid": process.pid,
        "started_at": iso(process.started_at),
        "uptime_seconds": round(time.time() - process.started_at, 1),
        "host_name": process.host_name,
        "node_name": process.node_name,
    }


def api_section(view: AgentView) -> dict[str, Any]:
    api = view.api
    return {
        "server": api.server,
        "last_success_at": iso(api.last_success_at),
        "last_error": _error_entry(api.last_error) if api.last_error else None,
    }


def lease_section(view: AgentView) -> dict[str, Any]:
    lease = view.lease
    return {
        "name": lease.name if lease else None,
        "last_renew_time": lease.last_renew_time if lease else None,
        "renewals": lease.renewals if lease else 0,
        "failures": lease.failures if lease else 0,
    }


def certificate_section(view: AgentView) -> dict[str, Any] | None:
    cert = view.certificate
    return dataclasses.asdict(cert) if cert is not None else None


def osc_section(view: AgentView) -> dict[str, Any]:
    osc = view.osc
    return {
        "secret_name": osc.secret_name,
        "applied_checksum": osc.applied_checksum,
        "desired_checksum": osc.desired_checksum,
        "up_to_date": osc.up_to_date,
        "applies": osc.applies,
        "failures": osc.failures,
    }


def errors_section(view: AgentView) -> list[dict[str, Any]]:
    return [_error_entry(e) for e in view.errors]


def health_section(view: AgentView) -> dict[str, Any]:
    live, ready = view.health.live, view.health.ready
    return {"live": live.ok, "ready": ready.ok, "reasons": list(live.reasons + ready.reasons)}


def endpoints_section(view: AgentView) -> dict[str, Any]:
    out: dict[str, Any] = {"health": None, "metrics": None}
    for endpoint in view.endpoints:
        for what in endpoint.serves:
            out[what] = endpoint.address
    return out


def _jsonable(value: Any) -> Any:
    """A view record as JSON values: datetimes as RFC 3339, dataclasses and tuples unfolded."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, datetime):
        return iso(value)
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def units_check_section(view: AgentView) -> dict[str, Any] | None:
    return _jsonable(view.units_check) if view.units_check is not None else None


def health_checks_section(view: AgentView) -> dict[str, Any] | None:
    return _jsonable(view.health_checks) if view.health_checks is not None else None


def health_gate_section(view: AgentView) -> dict[str, Any] | None:
    """The health gate and the restart-storm guard: what protects the node from a bad update."""
    if view.gate is None:
        return None
    out: dict[str, Any] = _jsonable(view.gate)
    out["held_units"] = [
        {**_jsonable(held), "since": iso(held.since), "describe": held.describe()}
        for held in view.held_units
    ]
    return out


def rollout_section(view: AgentView) -> dict[str, Any] | None:
    rollout = view.rollout
    if rollout is None:
        return None
    out: dict[str, Any] = _jsonable(rollout)
    out["since"] = iso(rollout.since)
    return out


def in_place_section(view: AgentView) -> dict[str, Any] | None:
    """The in-place update: None until one was detected by this process."""
    in_place = view.in_place
    if in_place is None or in_place.phase is None:
        return None
    out: dict[str, Any] = _jsonable(in_place)
    out["since"] = iso(in_place.since)
    return out


#: Document key -> its builder from the view. A new section of the view gets one entry here (and
#: its key in ``status.skeleton()``, its lines in ``status.render``).
SECTIONS: Mapping[str, Callable[[AgentView], Any]] = {
    "agent": agent_section,
    "api_server": api_section,
    "lease": lease_section,
    "certificate": certificate_section,
    "osc": osc_section,
    "errors": errors_section,
    "health": health_section,
    "endpoints": endpoints_section,
    "units_check": units_check_section,
    "health_checks": health_checks_section,
    "health_gate": health_gate_section,
    "rollout": rollout_section,
    "in_place_update": in_place_section,
}


# --- the socket --------------------------------------------------------------------------------


def open_socket_directory(directory: Path) -> int:
    """The socket's directory, opened without following a symlink: created 0700 if missing,
    refused if it is a symlink, not a directory or owned by another user, made 0700 through the
    returned fd (O_DIRECTORY|O_NOFOLLOW). A symlink is refused rather than replaced: the agent
    never removes what it did not create, and a planted link must be looked at.

    Why: ``chmod`` and ``bind`` on the path would follow a symlink and act on its target."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(directory, 0o700)  # never follows a symlink (an existing link: FileExistsError)
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        what = "is a symlink" if os.path.islink(directory) else "is not a directory"
        raise UnsafePathError(
            str(directory), f"{what}; the status socket is not started there"
        ) from exc
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise UnsafePathError(
                str(directory), f"owned by uid {info.st_uid}, not by the agent (uid {os.geteuid()})"
            )
        if stat.S_IMODE(info.st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


class StatusServer:
    """Answers ``status`` requests on the agent's unix socket from ``read()`` (a fresh view)."""

    def __init__(
        self, ctx: AgentContext, read: Callable[[], AgentView], path: Path | None = None
    ) -> None:
        self.ctx = ctx
        self.read = read
        self.path = path or socket_path(ctx.settings.root, ctx.settings.status_socket)
        self._server: asyncio.Server | None = None
        self._inode: int | None = None
        self._dir_fd: int | None = None  # the socket's directory, as checked at start
        self._units: tuple[str, tuple[str, ...]] | None = None  # checksum -> unit names

    async def start(self) -> None:
        fd = open_socket_directory(self.path.parent)
        name = self.path.name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with contextlib.suppress(FileNotFoundError):
                if stat.S_ISSOCK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    os.unlink(name, dir_fd=fd)  # a stale socket of a previous run
            # Through the checked directory's fd: a path swapped meanwhile is never followed.
            sock.bind(f"/proc/self/fd/{fd}/{name}")
            os.chmod(name, 0o600, dir_fd=fd)  # the directory is 0700: nobody could connect yet
            self._inode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_ino
            sock.listen(16)
            sock.setblocking(False)
            self._server = await asyncio.start_unix_server(self._handle, sock=sock)
        except BaseException:
            sock.close()
            os.close(fd)
            raise
        self._dir_fd = fd

    async def close(self) -> None:
        if self._server is None:
            return
        self._server.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self._server.wait_closed()
        self._server = None
        fd, self._dir_fd = self._dir_fd, None
        if fd is None:
            return
        # Only our own socket: a newer agent may already have bound a fresh one at this path.
        with contextlib.suppress(OSError):
            if os.stat(self.path.name, dir_fd=fd, follow_symlinks=False).st_ino == self._inode:
                os.unlink(self.path.name, dir_fd=fd)
        os.close(fd)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(CLIENT_TIMEOUT):
                line = await reader.readline()
            if line.strip() == REQUEST.strip():
                doc = await self.document()
            else:
                doc = {"error": "unknown request; send 'status'"}
            writer.write(json.dumps(doc, indent=None, sort_keys=False).encode() + b"\n")
            async with asyncio.timeout(CLIENT_TIMEOUT):
                await writer.drain()
        except (TimeoutError, ConnectionError, ValueError):
            pass
        except Exception as exc:  # never let a status request hurt the agent
            log.warning("status request failed", error=str(exc))
        finally:
            writer.close()

    async def document(self) -> dict[str, Any]:
        """The live status document (the rules: :mod:`node_agent.observe.status_document`)."""
        state = self.ctx.state
        await state.applied_checksum_async()  # known in memory after this: no re-read
        view = self.read()
        doc = skeleton()
        for key, section in SECTIONS.items():
            doc[key] = section(view)
        doc["endpoints"]["status_socket"] = str(self.path)
        fallback = await asyncio.to_thread(selfupdate.read_fallback, self.ctx.fs)
        doc["agent"]["self_update_fallback"] = fallback.as_dict() if fallback else None
        record = await state.load_status_async()
        doc["last_apply"] = apply_entry(record.model_dump(mode="json")) if record else None
        pending = await state.pending_async()
        if pending is not None:
            doc["change_in_progress"] = pending_entry(
                pending.osc_checksum, pending.started_at, pending.steps, pending.remaining()
            )
        doc["units"] = await self._unit_health(view.osc.applied_checksum or "")
        doc["inventory"] = inventory_counts(
            (e.kind, e.created) for e in (await state.inventory_async()).entries.values()
        )
        return doc

    async def _unit_health(self, applied: str) -> list[dict[str, Any]] | None:
        """States of the units of the last applied OSC; bounded, so status always answers."""
        names = await self._unit_names(applied)
        if not names:
            return []
        try:
            async with asyncio.timeout(UNIT_STATES_TIMEOUT):
                states = await self.ctx.systemd.unit_states(names)
        except Exception as exc:
            return [
                {"name": n, "load_state": None, "active_state": None, "sub_state": None,
                 "error": scrub(str(exc) or type(exc).__name__)}
                for n in names
            ]  # fmt: skip
        out = []
        for name in names:
            state = states.get(name)
            out.append(
                {
                    "name": name,
                    "load_state": state.load_state if state else None,
                    "active_state": state.active_state if state else None,
                    "sub_state": state.sub_state if state else None,
                    "error": None,
                }
            )
        return out

    async def _unit_names(self, applied: str) -> tuple[str, ...]:
        if not applied:
            return ()
        if self._units is not None and self._units[0] == applied:
            return self._units[1]
        last = await self.ctx.state.load_last_applied_async()
        if last is None:
            return ()
        names = await asyncio.to_thread(_osc_unit_names, last.raw)
        self._units = (last.checksum, names)
        return names


def _osc_unit_names(raw: bytes) -> tuple[str, ...]:
    from node_agent.osc.decode import parse_osc
    from node_agent.osc.merge import osc_units

    try:
        return tuple(sorted(u.name for u in osc_units(parse_osc(raw))))
    except NodeAgentError:
        return ()
