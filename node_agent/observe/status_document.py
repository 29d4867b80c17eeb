"""The status document's shape: one definition for the agent that serves it and the command that
reads or rebuilds it.

``node-agent status`` asks the running agent over a unix socket (the server half,
:mod:`node_agent.observe.unix_socket`) or, with the agent down, builds the same document from
the persisted state (:mod:`node_agent.commands.status`). Both fill :func:`skeleton` with the
entries made here, so the field names and their order are the same either way (``schema_version``;
see docs/operations.md). Nothing here may hold file contents, Secret data or tokens: errors are
scrubbed of anything that looks like a credential. The command imports this module on every
``node-agent status``: it stays free of pydantic, aiohttp, the kube client and systemd.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from node_agent.base.text import scrub

#: Same as ``AgentSettings.status_socket`` (a unit test keeps them equal; importing config here
#: would load pydantic and cost the CLI ~100 ms).
DEFAULT_SOCKET = "/run/gardener-node-agent/status.sock"
SCHEMA_VERSION = 1
REQUEST = b"status\n"
CLIENT_TIMEOUT = 2.0
_UNIX_PATH_MAX = 107


def socket_path(root: Path, configured: str = DEFAULT_SOCKET) -> Path:
    return root / configured.lstrip("/")


@contextlib.contextmanager
def addressable(path: Path) -> Iterator[str]:
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


def iso(moment: float | datetime | None) -> str | None:
    if moment is None:
        return None
    if isinstance(moment, datetime):
        return moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
    return iso(datetime.fromtimestamp(moment, UTC))


def apply_entry(record: Mapping[str, Any]) -> dict[str, Any]:
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


def pending_entry(
    checksum: str, started: datetime | str, steps: tuple[str, ...], remaining: tuple[str, ...]
) -> dict[str, Any]:
    return {
        "osc_checksum": checksum,
        "started_at": iso(started) if isinstance(started, datetime) else started,
        "steps_total": len(steps),
        "steps_done": len(steps) - len(remaining),
        "remaining": list(remaining),
    }


def inventory_counts(entries: Iterable[tuple[str, bool]]) -> dict[str, int]:
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


def skeleton() -> dict[str, Any]:
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
            "self_update_fallback": None,
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
        "units_check": None,
        "health_checks": None,
        "health_gate": None,
        "rollout": None,
        "in_place_update": None,
    }
