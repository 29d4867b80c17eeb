"""The systemd seam: everything node-agent asks of systemd goes through ``SystemdSeam``.

Why a seam: the real adapter (``Systemd``) runs pystemd in a worker process so a hung D-Bus call
can never freeze the agent; other layers depend only on this Protocol, so their unit tests can
pass a small fake instead.

``Systemd`` is loaded on first use: the worker process (``python -m node_agent.systemd.worker``)
imports this package too, and must not pay for asyncio and structlog that only the agent's side
of the pipe needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from node_agent.systemd.types import (
    JOB_ACTIONS,
    JobAction,
    JobResult,
    UnitFileChange,
    UnitState,
)

if TYPE_CHECKING:
    from node_agent.systemd.client import Systemd

__all__ = [
    "JOB_ACTIONS",
    "JobAction",
    "JobResult",
    "Systemd",
    "SystemdSeam",
    "UnitFileChange",
    "UnitState",
]


def __getattr__(name: str) -> Any:
    if name == "Systemd":
        from node_agent.systemd.client import Systemd

        return Systemd
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@runtime_checkable
class SystemdSeam(Protocol):
    """What node-agent needs from systemd. Errors are ``node_agent.base.errors.SystemdError``s."""

    async def start(self) -> None:
        """Connect (the real adapter spawns its worker)."""

    async def close(self) -> None:
        """Disconnect and release resources."""

    async def daemon_reload(self) -> None:
        """Re-read all unit files."""

    async def enable(self, units: Sequence[str]) -> list[UnitFileChange]:
        """Enable unit files (forced, persistent); aliases resolve to their unit."""
        ...

    async def disable(self, units: Sequence[str]) -> list[UnitFileChange]:
        """Disable unit files (symlinks to the unit in /etc go, aliases too)."""
        ...

    async def run_jobs(
        self, jobs: Sequence[tuple[str, JobAction]], *, job_timeout: float = 10.0
    ) -> dict[str, JobResult]:
        """Queue start/stop/restart jobs together, wait ``job_timeout``; result per unit."""
        ...

    async def start_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult: ...

    async def stop_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult: ...

    async def restart_unit(self, unit: str, *, job_timeout: float = 10.0) -> JobResult: ...

    async def unit_states(
        self, names: Sequence[str], *, brief: bool = False
    ) -> dict[str, UnitState]:
        """Current state per name (``load_state`` ``not-found`` for unknown units). ``brief``:
        only ``id``, ``load_state``, ``active_state`` and ``sub_state`` are read (one call for
        all units); the other fields may be left at their zero values."""
        ...

    async def failed_units(self) -> list[str]:
        """Names of units in the ``failed`` state."""
        ...
