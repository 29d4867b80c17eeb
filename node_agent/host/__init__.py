"""The host seam: file-system access under a root prefix (``fs``) and the agent's persisted state
(``state``, ``history``), kept apart from the planner so the planner
stays pure and every host write goes through one small, tested place."""

from node_agent.host.documents import ApplyRecord, Claim, Inventory, LastApplied, Pending
from node_agent.host.fs import TEMP_PREFIX, HostFS, WriteResult, host_parts
from node_agent.host.state import StateStore, claims_for

__all__ = [
    "TEMP_PREFIX",
    "ApplyRecord",
    "Claim",
    "HostFS",
    "Inventory",
    "LastApplied",
    "Pending",
    "StateStore",
    "WriteResult",
    "claims_for",
    "host_parts",
]
