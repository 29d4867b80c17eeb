"""``node-agent status``: what the running agent is doing, over a unix socket; or, if it is not
running, what its persisted state says.

Why a socket and not the HTTP ports: the status carries the node's names, checksums, unit
states and recent errors, which only root should read; a unix socket (0600, in a 0700 directory
under ``/run``) gives that for free, and works when the API server or the network is down.

Protocol: connect, send one request line (``status\\n``), read one JSON document until EOF.
The document's field names are stable (``schema_version``; see docs/operations.md). It never holds
file contents, Secret data or tokens: only names, checksums, counts, times, unit states and error
messages (scrubbed of anything that looks like a credential).

This module is the client half (and the rendering; the document's shape is
:mod:`node_agent.observe.status_document`): the CLI imports it on
every ``node-agent status``, so it stays free of pydantic, aiohttp, the kube client and systemd, and
the command starts in tens of milliseconds. The server half is
:mod:`node_agent.observe.unix_socket`.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from node_agent.base.durations import human_duration
from node_agent.base.text import escape_controls
from node_agent.observe.status_document import (
    CLIENT_TIMEOUT,
    REQUEST,
    addressable,
    apply_entry,
    inventory_counts,
    pending_entry,
    skeleton,
    socket_path,
)

DEFAULT_CONFIG = "/var/lib/gardener-node-agent/config.yaml"  # = config.CONFIG_FILE
MAX_ANSWER = 8 * 1024 * 1024
#: Exit code of ``node-agent status`` when the agent is not running (LSB: program not running).
EXIT_NOT_RUNNING = 3
REMAINING_SHOWN = 10
#: Failed items of the last apply shown by the text output (``--json`` has them all).
FAILURES_SHOWN = 10


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
            with addressable(path) as address:
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

    from node_agent.base.digest import sha256_hex
    from node_agent.base.errors import ConfigError, HostError
    from node_agent.host.documents import (
        ApplyRecord,
        Inventory,
        JournalDoc,
        JournalProgress,
        LastAppliedMeta,
    )
    from node_agent.host.state import (
        CHANGES,
        CHANGES_DONE,
        INVENTORY,
        LAST_APPLIED_META,
        LAST_APPLIED_OSC,
        STATUS,
        journal_applied,
        last_applied_of,
        named_paths,
        read_state_file,
        vet_claims,
    )
    from node_agent.osc.steps import step_ids

    doc = skeleton()
    doc["agent"]["not_running_reason"] = reason

    def read(name: str) -> bytes | None:
        try:  # never through a symlink, never blocking on a FIFO, never unbounded
            return read_state_file(root, name)
        except (OSError, HostError):
            return None

    if config_file is not None:
        # only a regular file of a config's size is read (a FIFO would block here for ever),
        # and any config it holds gives a ConfigError or the config
        with contextlib.suppress(ConfigError):
            from node_agent.config import load_config

            config = load_config(config_file, validate=False)
            doc["osc"]["secret_name"] = config.controllers.operating_system_config.secret_name
    raw = read(LAST_APPLIED_OSC)
    if raw is not None:
        doc["osc"]["applied_checksum"] = sha256_hex(raw)
    status = read(STATUS)
    if status is not None:
        with contextlib.suppress(ValidationError):
            record = ApplyRecord.model_validate_json(status)
            doc["last_apply"] = apply_entry(record.model_dump(mode="json"))
    progress: JournalProgress | None = None
    progress_raw = read(CHANGES_DONE)
    if progress_raw is not None:
        with contextlib.suppress(ValidationError):
            progress = JournalProgress.model_validate_json(progress_raw)
    try:  # as read(), but a journal there and unreadable takes its claims (see below)
        journal = read_state_file(root, CHANGES)
    except (OSError, HostError):
        journal = b""
    jdoc: JournalDoc | None = None
    if journal:
        with contextlib.suppress(ValidationError):
            jdoc = JournalDoc.model_validate_json(journal)
            done: set[str] = set()
            if progress is not None and progress.id == jdoc.id:
                done = set(progress.done)
            steps = step_ids(jdoc.change_set)
            remaining = tuple(s for s in steps if s not in done)
            doc["change_in_progress"] = pending_entry(
                jdoc.osc_checksum, jdoc.started_at, steps, remaining
            )

    def named() -> frozenset[str] | None:
        """The paths a claim may name, as the agent reads them (``host.state.vet_claims``);
        None for a journal there and unreadable: its claims are the only record of its writes."""
        if journal is not None and jdoc is None:
            return None
        meta = None
        meta_raw = read(LAST_APPLIED_META)
        if meta_raw is not None:
            with contextlib.suppress(ValidationError):
                meta = LastAppliedMeta.model_validate_json(meta_raw)
        last = last_applied_of(raw, meta)
        records = [last.applied if last is not None else None]
        if jdoc is not None:
            records += journal_applied(jdoc, last)
        return named_paths(jdoc.change_set if jdoc is not None else None, records)

    inventory = read(INVENTORY)
    if inventory is not None:
        with contextlib.suppress(ValidationError):
            inv = Inventory.model_validate_json(inventory)
            claims = inv.unfolded(progress)  # an unfinished apply's, taken as the agent takes them
            if claims:
                before = jdoc.preexisting if jdoc is not None else ()
                claims = vet_claims(claims, inv.entries, named=named(), preexisting=before).claims
            entries = inv.updated(claims).entries.values()
            doc["inventory"] = inventory_counts((e.kind, e.created) for e in entries)
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


def _short(checksum: str | None) -> str:
    return checksum[:12] if checksum else "none"


class _Lines:
    """The text being rendered: ``row`` is a labelled line, ``add`` a free one (control
    characters in either are shown escaped)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def row(self, label: str, text: str) -> None:
        self.lines.append(escape_controls(f"{label + ':':<14}{text}"))

    def add(self, line: str) -> None:
        self.lines.append(escape_controls(line))


#: One section of the document, rendered for people: (the text so far, the document, now).
Renderer = Callable[[_Lines, Mapping[str, Any], float], None]


def _render_agent(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    agent = doc.get("agent") or {}
    if agent.get("running"):
        out.add(
            f"node-agent {agent.get('version')}: running (pid {agent.get('pid')}, up "
            f"{human_duration(float(agent.get('uptime_seconds') or 0))}, "
            f"since {agent.get('started_at')})"
        )
        out.row(
            "Node", f"{agent.get('node_name') or 'not found yet'} (host {agent.get('host_name')})"
        )
        fallback = agent.get("self_update_fallback")
        if isinstance(fallback, dict):
            out.row("Self-update", f"FELL BACK to the previous binary: {fallback.get('message')}")
    else:
        out.add(f"node-agent is NOT RUNNING: {agent.get('not_running_reason')}")
        out.add("Showing the state persisted on disk.")


def _render_api(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    api = doc.get("api_server")
    if api is not None:
        err = api.get("last_error")
        err_text = f"{err['error']} ({err['source']}, {err['at']})" if err else "none"
        out.row("API server", f"{api.get('server')}")
        out.row("  success", _ago(api.get("last_success_at"), now))
        out.row("  last error", err_text)


def _render_lease(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    lease = doc.get("lease")
    if lease is not None:
        out.row(
            "Lease",
            f"{lease.get('name') or 'not yet'}: renewed {_ago(lease.get('last_renew_time'), now)}"
            f"; {lease.get('renewals')} renewals, {lease.get('failures')} failures",
        )


def _render_certificate(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    cert = doc.get("certificate")
    if cert is not None and cert.get("subject"):
        out.row(
            "Certificate",
            f"{cert.get('subject')}, valid until {cert.get('not_after')}, renewal at "
            f"{cert.get('renew_at')} ({cert.get('rotations')} rotations)",
        )
    elif cert is not None:
        out.row("Certificate", str(cert.get("phase")))
    if cert is not None and cert.get("last_error"):
        out.row("  last error", str(cert.get("last_error")))


def _render_osc(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    osc = doc.get("osc") or {}
    secret = osc.get("secret_name")
    out.row("Secret", f"kube-system/{secret}" if secret else "unknown (no readable config)")
    applied, desired = osc.get("applied_checksum"), osc.get("desired_checksum")
    if not (doc.get("agent") or {}).get("running"):
        out.row(
            "Checksum", f"applied {_short(applied)} (desired unknown: the agent is not running)"
        )
    else:
        up_to_date = osc.get("up_to_date")
        verdict = (
            "up to date"
            if up_to_date is True
            else "NOT up to date"
            if up_to_date is False
            else None
        )
        out.row(
            "Checksum",
            f"applied {_short(applied)}, desired {_short(desired)} ({verdict or 'unknown yet'})",
        )


def _render_last_apply(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    last = doc.get("last_apply")
    if last is None:
        out.row("Last apply", "none recorded")
        return
    restarted = ", ".join(last.get("restarted_units") or ()) or "none"
    seconds = float(last.get("duration_seconds") or 0)
    text = (
        f"{last.get('result')} {_ago(last.get('finished_at'), now)} in {seconds:.3f}s, "
        f"OSC {_short(last.get('osc_checksum'))}"
    )
    out.row("Last apply", text)
    out.row("  restarted", restarted)
    if last.get("stopped_units"):
        out.row("  stopped", ", ".join(last["stopped_units"]))
    if last.get("error"):
        out.row("  error", last["error"])
    failures = last.get("failures") or []
    if failures:
        out.row("  failed", f"{len(failures)} item{'s' if len(failures) != 1 else ''}")
        for failure in failures[:FAILURES_SHOWN]:
            out.add(f"    {failure.get('kind')} {failure.get('item')}: {failure.get('error')}")
        if len(failures) > FAILURES_SHOWN:
            out.add(f"    and {len(failures) - FAILURES_SHOWN} more")


def _render_change(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    change = doc.get("change_in_progress")
    if change is None:
        out.row("In progress", "nothing")
        return
    remaining = change.get("remaining") or []
    shown = ", ".join(remaining[:REMAINING_SHOWN])
    more = f" and {len(remaining) - REMAINING_SHOWN} more" if len(remaining) > 10 else ""
    out.row(
        "In progress",
        f"OSC {_short(change.get('osc_checksum'))} since {change.get('started_at')}: "
        f"{change.get('steps_done')}/{change.get('steps_total')} steps done",
    )
    out.row("  remaining", (shown + more) or "none (finishing)")


def _render_units(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    units = doc.get("units")
    if units is None:
        out.row("Units", "unknown (agent not running)")
        return
    if not units:
        out.row("Units", "none managed")
        return
    out.add("Units:")
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
        out.add(f"  {unit['name']:<{width}}  {state}")


def _render_health(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    health = doc.get("health")
    if health is not None:
        words = (
            ("live" if health.get("live") else "NOT LIVE")
            + ", "
            + ("ready" if health.get("ready") else "NOT READY")
        )
        reasons = "; ".join(health.get("reasons") or ())
        out.row("Health", words + (f" ({reasons})" if reasons else ""))


def _render_inventory(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    inv = doc.get("inventory")
    if inv is not None:
        out.row(
            "Inventory",
            f"{inv['paths']} paths ({inv['files']} files, {inv['units']} units, "
            f"{inv['dropins']} drop-ins; {inv['created']} created by the agent)",
        )


def _render_errors(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    errors = doc.get("errors") or []
    if errors:
        out.add("Recent errors:")
        for err in errors[-10:]:
            out.add(f"  {err.get('at')} {err.get('source')}: {err.get('error')}")


def _render_units_check(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    check = doc.get("units_check")
    if not check or not check.get("condition"):
        return
    cond = check["condition"]
    out.row(
        "Units ready",
        f"{cond.get('status')} ({cond.get('reason')}), checked {_ago(check.get('checked_at'), now)}"
        + ("" if check.get("reported") else "; not on the Node yet"),
    )
    for message in (check.get("unhealthy") or []) + (check.get("progressing") or []):
        out.add(f"  {message}")
    for message in check.get("looping") or []:
        out.add(f"  {message} (node-agent's diagnosis; not in the condition)")


def _render_health_checks(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    checks = doc.get("health_checks")
    if not checks or not checks.get("enabled"):
        return
    for comp in checks.get("components") or []:
        if not comp.get("managed"):
            continue
        if comp.get("healthy") is None:
            state = "not checked yet"
        elif comp.get("healthy"):
            state = "healthy"
        else:
            state = (
                f"UNHEALTHY since {_ago(comp.get('failing_since'), now)}: {comp.get('last_error')}"
            )
        restarts = comp.get("restarts") or 0
        out.row(
            str(comp.get("name")),
            state + (f"; restarted {restarts} times by node-agent" if restarts else ""),
        )
    if checks.get("reboot_suggested"):
        out.row("  node readiness", f"flapping ({checks.get('ready_toggles')} toggles): reboot?")


def _render_health_gate(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    gate = doc.get("health_gate")
    if gate is None:
        return
    if not gate.get("enabled"):
        out.row("Health gate", "off")
    else:
        text = f"on (settle window {human_duration(gate.get('settle_window_seconds') or 0)})"
        if gate.get("watching"):
            units = ", ".join(gate.get("watched_units") or []) or "the restarted units"
            text += f"; watching {units} after {_short(gate['watching'])}"
        out.row("Health gate", text)
    if gate.get("quarantined"):
        out.row("  quarantined", f"{_short(gate['quarantined'])} (until the Secret changes)")
    last = gate.get("last_rollback")
    if last:
        out.row(
            "  rolled back",
            f"{_short(last.get('checksum'))} -> {_short(last.get('to_checksum'))} "
            f"{_ago(last.get('at'), now)}: {last.get('unit')}: {last.get('evidence')}",
        )
    for held in gate.get("held_units") or []:
        out.row("Held unit", str(held.get("describe")))
    strict = gate.get("strict") or []
    out.row(
        "Strictness",
        f"{', '.join(strict)} (node-agent-strict.yaml)" if strict else "upstream's contract",
    )


def _render_rollout(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    rollout = doc.get("rollout")
    if not rollout or (not rollout.get("serial") and not rollout.get("pacing")):
        return
    mode = ", ".join(
        part
        for part in ("serial" if rollout.get("serial") else "", rollout.get("pacing") or "")
        if part
    )
    out.row("Rollout", f"{mode}: {rollout.get('state')}")
    if rollout.get("reason"):
        text = f"{rollout.get('reason')} since {_ago(rollout.get('since'), now)}"
        out.row("  why", text + (f": {rollout['message']}" if rollout.get("message") else ""))
    if rollout.get("holders"):
        out.row("  holders", ", ".join(rollout["holders"]))
    if rollout.get("breaker_open"):
        out.row("  breaker", f"OPEN after {rollout.get('failures')} failed nodes")


def _render_in_place(out: _Lines, doc: Mapping[str, Any], now: float) -> None:
    in_place = doc.get("in_place_update")
    if not in_place or not in_place.get("phase"):
        return
    parts = ", ".join(in_place.get("parts") or []) or "-"
    out.row(
        "In-place update",
        f"{in_place['phase']} since {_ago(in_place.get('since'), now)} ({parts})",
    )
    if in_place.get("detail"):
        out.row("  now", str(in_place["detail"]))
    if in_place.get("remaining") and in_place["phase"] not in ("done", "failed"):
        out.row("  remaining", ", ".join(in_place["remaining"]))
    if in_place.get("reason"):
        out.row("  reason", str(in_place["reason"]))


#: The text of ``node-agent status``, section by section, in this order. A new section of the
#: document gets one renderer here (it must cope with ``null``: an older agent, or not running).
RENDERERS: tuple[Renderer, ...] = (
    _render_agent,
    _render_api,
    _render_lease,
    _render_certificate,
    _render_osc,
    _render_last_apply,
    _render_change,
    _render_units,
    _render_units_check,
    _render_health_checks,
    _render_health_gate,
    _render_rollout,
    _render_in_place,
    _render_health,
    _render_inventory,
    _render_errors,
)


def render(doc: Mapping[str, Any], *, now: float | None = None) -> str:
    """The status document for people, one fact per line."""
    now = time.time() if now is None else now
    out = _Lines()
    for section in RENDERERS:
        section(out, doc, now)
    return "\n".join(out.lines) + "\n"


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
