"""``node-agent status``: what the running agent is doing, over a unix socket; or, if it is not
running, what its persisted state says.

Why a socket and not the HTTP ports: the status carries the node's names, checksums, unit
states and recent errors, which only root should read; a unix socket (0600, in a 0700 directory
under ``/run``) gives that for free, and works when the API server or the network is down.

Protocol: connect, send one request line (``status\\n``), read one JSON document until EOF.
The document's field names are stable (``schema_version``; see docs/operations.md). It never holds
file contents, Secret data or tokens: only names, checksums, counts, times, unit states and error
messages (scrubbed of anything that looks like a credential).

The client half is imported by the CLI on every ``node-agent status``: it stays free of pydantic,
the kube client and systemd, so the command starts in tens of milliseconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import socket
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node_agent import __version__

if TYPE_CHECKING:
    import asyncio

    from node_agent.context import AgentContext
    from node_agent.observability import Probes

#: Same as ``AgentSettings.status_socket`` (a unit test keeps them equal; importing config here
#: would load pydantic and cost the CLI ~100 ms).
DEFAULT_SOCKET = "/run/gardener-node-agent/status.sock"
DEFAULT_CONFIG = "/var/lib/gardener-node-agent/config.yaml"  # = config.CONFIG_FILE
SCHEMA_VERSION = 1
REQUEST = b"status\n"
CLIENT_TIMEOUT = 2.0
#: The server's bound on asking systemd for unit states, below the client's timeout.
UNIT_STATES_TIMEOUT = 1.0
MAX_ANSWER = 8 * 1024 * 1024
#: Exit code of ``node-agent status`` when the agent is not running (LSB: program not running).
EXIT_NOT_RUNNING = 3
REMAINING_SHOWN = 10
#: Failed items of the last apply shown by the text output (``--json`` has them all).
FAILURES_SHOWN = 10
_UNIX_PATH_MAX = 107

# Anything that looks like a credential in an error message (same idea as the log redaction).
_SECRET_VALUES = re.compile(
    r"eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*"
    r"|[a-z0-9]{6}\.[a-z0-9]{16}"
    r"|Bearer\s+\S+"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----"
)


def scrub(text: str) -> str:
    return _SECRET_VALUES.sub("[redacted]", text)


def socket_path(root: Path, configured: str = DEFAULT_SOCKET) -> Path:
    return root / configured.lstrip("/")


@contextlib.contextmanager
def _addressable(path: Path) -> Iterator[str]:
    """A path for bind/connect: unix socket paths are limited to 107 bytes, a deep ``--root``
    is not; then go through ``/proc/self/fd/<dir>``."""
    if len(os.fsencode(str(path))) <= _UNIX_PATH_MAX:
        yield str(path)
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def _iso(moment: float | datetime | None) -> str | None:
    if moment is None:
        return None
    if isinstance(moment, datetime):
        return moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    return _iso(datetime.fromtimestamp(moment, UTC))


# --- server ------------------------------------------------------------------------------------


def open_socket_directory(directory: Path) -> int:
    """The socket's directory, opened without following a symlink: created 0700 if missing,
    refused if it is a symlink, not a directory or owned by another user, made 0700 through the
    returned fd (O_DIRECTORY|O_NOFOLLOW). A symlink is refused rather than replaced: the agent
    never removes what it did not create, and a planted link must be looked at.

    Why: ``chmod`` and ``bind`` on the path would follow a symlink and act on its target."""
    from node_agent.errors import UnsafePathError

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
    """Answers ``status`` requests on the agent's unix socket."""

    def __init__(
        self,
        ctx: AgentContext,
        probes: Probes,
        path: Path | None = None,
        *,
        endpoints: Callable[[], Mapping[str, str | None]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.probes = probes
        self.endpoints = endpoints
        self.path = path or socket_path(ctx.settings.root, ctx.settings.status_socket)
        self._server: asyncio.Server | None = None
        self._inode: int | None = None
        self._dir_fd: int | None = None  # the socket's directory, as checked at start
        self._units: tuple[str, tuple[str, ...]] | None = None  # checksum -> unit names

    async def start(self) -> None:
        import asyncio

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
        import asyncio

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
        import asyncio

        from node_agent.log import get_logger

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
            get_logger("node-agent.status").warning("status request failed", error=str(exc))
        finally:
            writer.close()

    async def document(self) -> dict[str, Any]:
        """The live status document (see the module docstring for the rules)."""
        from node_agent.observability import api_last_success, applied_and_desired

        ctx = self.ctx
        health = ctx.health
        info = health.info
        osc, lease = info.get("osc"), info.get("lease")
        lease_stats = getattr(lease, "stats", None)
        lease_name = getattr(lease, "name", None)
        await ctx.state.applied_checksum_async()  # known in memory after this: no re-read
        applied, desired = applied_and_desired(ctx)
        api_errors = [e for e in health.errors if _is_api_error(e)]
        live, ready = self.probes.live(), self.probes.ready()
        doc = _skeleton()
        doc["agent"].update(
            running=True,
            version=__version__,
            pid=os.getpid(),
            started_at=_iso(health.started),
            uptime_seconds=round(time.time() - health.started, 1),
            host_name=ctx.host_name,
            node_name=ctx.node_name,
        )
        doc["api_server"] = {
            "server": str(getattr(ctx.kube, "server", "")) or None,
            "last_success_at": _iso(api_last_success(ctx)),
            "last_error": _error_entry(api_errors[-1]) if api_errors else None,
        }
        doc["lease"] = {
            "name": f"kube-system/{lease_name}" if lease_name else None,
            "last_renew_time": getattr(lease_stats, "last_renew_time", None),
            "renewals": int(getattr(lease_stats, "renewals", 0)),
            "failures": int(getattr(lease_stats, "failures", 0)),
        }
        certs = info.get("certificate")
        view = certs.view() if certs is not None else None
        doc["certificate"] = dataclasses.asdict(view) if view is not None else None
        doc["osc"] = {
            "secret_name": ctx.secret_name,
            "applied_checksum": applied or None,
            "desired_checksum": desired,
            "up_to_date": (applied == desired) if applied and desired else None,
            "applies": int(getattr(osc, "applies", 0)),
            "failures": int(getattr(osc, "failures", 0)),
        }
        record = await ctx.state.load_status_async()
        doc["last_apply"] = _apply_entry(record.model_dump(mode="json")) if record else None
        pending = await ctx.state.pending_async()
        if pending is not None:
            doc["change_in_progress"] = _pending_entry(
                pending.osc_checksum, pending.started_at, pending.steps, pending.remaining()
            )
        doc["units"] = await self._unit_health(applied)
        doc["errors"] = [_error_entry(e) for e in health.errors]
        doc["inventory"] = _inventory_counts(
            (e.kind, e.created) for e in (await ctx.state.inventory_async()).entries.values()
        )
        doc["endpoints"] = {
            "health": None,
            "metrics": None,
            **(self.endpoints() if self.endpoints else {}),
            "status_socket": str(self.path),
        }
        doc["health"] = {
            "live": live.ok,
            "ready": ready.ok,
            "reasons": list(live.reasons + ready.reasons),
        }
        return doc

    async def _unit_health(self, applied: str) -> list[dict[str, Any]] | None:
        """States of the units of the last applied OSC; bounded, so status always answers."""
        import asyncio

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
        import asyncio

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
    from node_agent.errors import NodeAgentError
    from node_agent.osc.decode import parse_osc
    from node_agent.osc.merge import osc_units

    try:
        return tuple(sorted(u.name for u in osc_units(parse_osc(raw))))
    except NodeAgentError:
        return ()


def _is_api_error(entry: Mapping[str, Any]) -> bool:
    source, error = str(entry.get("source", "")), str(entry.get("error", ""))
    return source in ("lease", "node", "token") or error.startswith("Kube")


def _error_entry(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "at": entry.get("at"),
        "source": entry.get("source"),
        "error": scrub(str(entry.get("error", ""))),
    }


def _apply_entry(record: Mapping[str, Any]) -> dict[str, Any]:
    error = record.get("error")
    return {
        "osc_checksum": record.get("osc_checksum"),
        "started_at": record.get("started_at"),
        "finished_at": record.get("finished_at"),
        "duration_seconds": record.get("duration_seconds"),
        "result": record.get("result"),
        "restarted_units": list(record.get("restarted_units") or ()),
        "stopped_units": list(record.get("stopped_units") or ()),
        "error": scrub(str(error)) if error else None,
        "failures": [
            {
                "kind": f.get("kind"),
                "item": f.get("item"),
                "error": scrub(str(f.get("error", ""))),
            }
            for f in record.get("failures") or ()
            if isinstance(f, Mapping)
        ],
    }


def _pending_entry(
    checksum: str, started: datetime | str, steps: tuple[str, ...], remaining: tuple[str, ...]
) -> dict[str, Any]:
    return {
        "osc_checksum": checksum,
        "started_at": _iso(started) if isinstance(started, datetime) else started,
        "steps_total": len(steps),
        "steps_done": len(steps) - len(remaining),
        "remaining": list(remaining),
    }


def _inventory_counts(entries: Iterable[tuple[str, bool]]) -> dict[str, int]:
    """Counts of (kind, created) pairs of the inventory."""
    pairs = list(entries)
    kinds = [kind for kind, _ in pairs]
    return {
        "paths": len(pairs),
        "files": kinds.count("file"),
        "units": kinds.count("unit"),
        "dropins": kinds.count("dropin"),
        "created": sum(1 for _, created in pairs if created),
    }


def _skeleton() -> dict[str, Any]:
    """Every field, in order; ``null`` where nothing is known."""
    return {
        "schema_version": SCHEMA_VERSION,
        "agent": {
            "running": False,
            "not_running_reason": None,
            "version": None,
            "pid": None,
            "started_at": None,
            "uptime_seconds": None,
            "host_name": None,
            "node_name": None,
        },
        "api_server": None,
        "lease": None,
        "certificate": None,
        "osc": {
            "secret_name": None,
            "applied_checksum": None,
            "desired_checksum": None,
            "up_to_date": None,
            "applies": None,
            "failures": None,
        },
        "last_apply": None,
        "change_in_progress": None,
        "units": None,
        "errors": [],
        "inventory": None,
        "health": None,
        "endpoints": None,
    }


# --- client ------------------------------------------------------------------------------------


class NotRunning(Exception):
    """The agent did not answer on its socket; the message says why in one line."""


def query(path: Path, timeout: float = CLIENT_TIMEOUT) -> dict[str, Any]:
    """Ask the agent at ``path`` for its status; raise :class:`NotRunning` if it cannot answer
    within ``timeout`` seconds (connect + answer)."""
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            with _addressable(path) as address:
                sock.connect(address)
        except FileNotFoundError as exc:
            raise NotRunning(f"no socket at {path}") from exc
        except ConnectionRefusedError as exc:
            raise NotRunning(f"nothing listens on {path} (stale socket)") from exc
        except PermissionError as exc:
            raise NotRunning(f"no permission to connect to {path} (run as root)") from exc
        except TimeoutError as exc:
            raise NotRunning(f"no answer on {path} within {timeout:g}s") from exc
        except OSError as exc:
            raise NotRunning(f"cannot connect to {path}: {exc.strerror or exc}") from exc
        chunks: list[bytes] = []
        size = 0
        try:
            sock.sendall(REQUEST)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_ANSWER:
                    raise NotRunning(f"answer on {path} is too large")
        except TimeoutError as exc:
            raise NotRunning(f"no answer on {path} within {timeout:g}s") from exc
        except OSError as exc:
            raise NotRunning(f"connection to {path} failed: {exc.strerror or exc}") from exc
    finally:
        sock.close()
    try:
        doc = json.loads(b"".join(chunks))
    except ValueError as exc:
        raise NotRunning(f"the answer on {path} is not JSON (another program?)") from exc
    if not isinstance(doc, dict) or "schema_version" not in doc:
        raise NotRunning(f"unexpected answer on {path}: {str(doc)[:200]}")
    return doc


def offline_document(root: Path, config_file: Path | None, reason: str) -> dict[str, Any]:
    """The status from files under ``root`` only: no API server, no systemd, no writes."""
    from pydantic import ValidationError

    from node_agent.host.state import (
        CHANGES,
        CHANGES_DONE,
        INVENTORY,
        LAST_APPLIED_OSC,
        STATE_DIR,
        STATUS,
        ApplyRecord,
        Inventory,
        JournalDoc,
        JournalProgress,
        sha256_hex,
    )
    from node_agent.host.steps import step_ids

    doc = _skeleton()
    doc["agent"]["not_running_reason"] = reason
    state_dir = root / STATE_DIR.lstrip("/")

    def read(name: str) -> bytes | None:
        try:
            return (state_dir / name).read_bytes()
        except OSError:
            return None

    if config_file is not None:
        with contextlib.suppress(Exception):
            from node_agent.config import load_config

            config = load_config(config_file)
            doc["osc"]["secret_name"] = config.controllers.operating_system_config.secret_name
    raw = read(LAST_APPLIED_OSC)
    if raw is not None:
        doc["osc"]["applied_checksum"] = sha256_hex(raw)
    status = read(STATUS)
    if status is not None:
        with contextlib.suppress(ValidationError):
            record = ApplyRecord.model_validate_json(status)
            doc["last_apply"] = _apply_entry(record.model_dump(mode="json"))
    journal = read(CHANGES)
    if journal is not None:
        with contextlib.suppress(ValidationError):
            jdoc = JournalDoc.model_validate_json(journal)
            done: set[str] = set()
            progress_raw = read(CHANGES_DONE)
            if progress_raw is not None:
                with contextlib.suppress(ValidationError):
                    progress = JournalProgress.model_validate_json(progress_raw)
                    if progress.id == jdoc.id:
                        done = set(progress.done)
            steps = step_ids(jdoc.change_set)
            remaining = tuple(s for s in steps if s not in done)
            doc["change_in_progress"] = _pending_entry(
                jdoc.osc_checksum, jdoc.started_at, steps, remaining
            )
    inventory = read(INVENTORY)
    if inventory is not None:
        with contextlib.suppress(ValidationError):
            entries = Inventory.model_validate_json(inventory).entries.values()
            doc["inventory"] = _inventory_counts((e.kind, e.created) for e in entries)
    return doc


# --- rendering ---------------------------------------------------------------------------------


def _ago(iso: str | None, now: float) -> str:
    if not iso:
        return "never"
    try:
        moment = datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return iso
    return f"{iso} ({human_duration(now - moment)} ago)"


def human_duration(seconds: float) -> str:
    """``45s``, ``3m05s``, ``2h03m``, ``4d02h``: short, for people."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s" if seconds >= 10 else f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _short(checksum: str | None) -> str:
    return checksum[:12] if checksum else "none"


def render(doc: Mapping[str, Any], *, now: float | None = None) -> str:
    """The status document for people, one fact per line."""
    now = time.time() if now is None else now
    agent = doc.get("agent") or {}
    lines: list[str] = []

    def row(label: str, text: str) -> None:
        lines.append(f"{label + ':':<14}{text}")

    if agent.get("running"):
        lines.append(
            f"node-agent {agent.get('version')}: running (pid {agent.get('pid')}, up "
            f"{human_duration(float(agent.get('uptime_seconds') or 0))}, "
            f"since {agent.get('started_at')})"
        )
        row("Node", f"{agent.get('node_name') or 'not found yet'} (host {agent.get('host_name')})")
    else:
        lines.append(f"node-agent is NOT RUNNING: {agent.get('not_running_reason')}")
        lines.append("Showing the state persisted on disk.")
    api = doc.get("api_server")
    if api is not None:
        err = api.get("last_error")
        err_text = f"{err['error']} ({err['source']}, {err['at']})" if err else "none"
        row("API server", f"{api.get('server')}")
        row("  success", _ago(api.get("last_success_at"), now))
        row("  last error", err_text)
    lease = doc.get("lease")
    if lease is not None:
        row(
            "Lease",
            f"{lease.get('name') or 'not yet'}: renewed {_ago(lease.get('last_renew_time'), now)}"
            f"; {lease.get('renewals')} renewals, {lease.get('failures')} failures",
        )
    cert = doc.get("certificate")
    if cert is not None and cert.get("subject"):
        row(
            "Certificate",
            f"{cert.get('subject')}, valid until {cert.get('not_after')}, renewal at "
            f"{cert.get('renew_at')} ({cert.get('rotations')} rotations)",
        )
    elif cert is not None:
        row("Certificate", str(cert.get("phase")))
    if cert is not None and cert.get("last_error"):
        row("  last error", str(cert.get("last_error")))
    osc = doc.get("osc") or {}
    secret = osc.get("secret_name")
    row("Secret", f"kube-system/{secret}" if secret else "unknown (no readable config)")
    applied, desired = osc.get("applied_checksum"), osc.get("desired_checksum")
    if not agent.get("running"):
        row("Checksum", f"applied {_short(applied)} (desired unknown: the agent is not running)")
    else:
        up_to_date = osc.get("up_to_date")
        verdict = (
            "up to date"
            if up_to_date is True
            else "NOT up to date"
            if up_to_date is False
            else None
        )
        row(
            "Checksum",
            f"applied {_short(applied)}, desired {_short(desired)} ({verdict or 'unknown yet'})",
        )
    last = doc.get("last_apply")
    if last is None:
        row("Last apply", "none recorded")
    else:
        restarted = ", ".join(last.get("restarted_units") or ()) or "none"
        seconds = float(last.get("duration_seconds") or 0)
        text = (
            f"{last.get('result')} {_ago(last.get('finished_at'), now)} in {seconds:.3f}s, "
            f"OSC {_short(last.get('osc_checksum'))}"
        )
        row("Last apply", text)
        row("  restarted", restarted)
        if last.get("stopped_units"):
            row("  stopped", ", ".join(last["stopped_units"]))
        if last.get("error"):
            row("  error", last["error"])
        failures = last.get("failures") or []
        if failures:
            row("  failed", f"{len(failures)} item{'s' if len(failures) != 1 else ''}")
            for failure in failures[:FAILURES_SHOWN]:
                lines.append(
                    f"    {failure.get('kind')} {failure.get('item')}: {failure.get('error')}"
                )
            if len(failures) > FAILURES_SHOWN:
                lines.append(f"    and {len(failures) - FAILURES_SHOWN} more")
    change = doc.get("change_in_progress")
    if change is None:
        row("In progress", "nothing")
    else:
        remaining = change.get("remaining") or []
        shown = ", ".join(remaining[:REMAINING_SHOWN])
        more = f" and {len(remaining) - REMAINING_SHOWN} more" if len(remaining) > 10 else ""
        row(
            "In progress",
            f"OSC {_short(change.get('osc_checksum'))} since {change.get('started_at')}: "
            f"{change.get('steps_done')}/{change.get('steps_total')} steps done",
        )
        row("  remaining", (shown + more) or "none (finishing)")
    units = doc.get("units")
    if units is None:
        row("Units", "unknown (agent not running)")
    elif not units:
        row("Units", "none managed")
    else:
        lines.append("Units:")
        width = max(len(u["name"]) for u in units)
        for unit in units:
            if unit.get("error"):
                state = f"unknown: {unit['error']}"
            else:
                state = f"{unit.get('active_state')}/{unit.get('sub_state')}"
                if unit.get("load_state") not in ("loaded", None):
                    state += f" ({unit.get('load_state')})"
                if unit.get("active_state") == "failed":
                    state += "  <- FAILED"
            lines.append(f"  {unit['name']:<{width}}  {state}")
    health = doc.get("health")
    if health is not None:
        words = (
            ("live" if health.get("live") else "NOT LIVE")
            + ", "
            + ("ready" if health.get("ready") else "NOT READY")
        )
        reasons = "; ".join(health.get("reasons") or ())
        row("Health", words + (f" ({reasons})" if reasons else ""))
    inv = doc.get("inventory")
    if inv is not None:
        row(
            "Inventory",
            f"{inv['paths']} paths ({inv['files']} files, {inv['units']} units, "
            f"{inv['dropins']} drop-ins; {inv['created']} created by the agent)",
        )
    errors = doc.get("errors") or []
    if errors:
        lines.append("Recent errors:")
        for err in errors[-10:]:
            lines.append(f"  {err.get('at')} {err.get('source')}: {err.get('error')}")
    return "\n".join(lines) + "\n"


def run_status(
    root: Path, *, config_file: Path | None, socket_file: Path | None, as_json: bool
) -> int:
    """The ``status`` command: 0 if the agent answered, ``EXIT_NOT_RUNNING`` if not."""
    path = socket_file or socket_path(root)
    try:
        doc = query(path)
        code = 0
    except NotRunning as exc:
        doc = offline_document(root, config_file, str(exc))
        code = EXIT_NOT_RUNNING
    if as_json:
        print(json.dumps(doc, indent=2))
    else:
        print(render(doc), end="")
    return code
