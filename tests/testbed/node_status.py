"""The Node's ``status`` as the agent reports it, read back (the agent identity's right to
patch it is in the shared rules, ``tests.testbed.credentials``)."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

CONDITION = "SystemdUnitsReady"


async def units_ready(admin: ApiClient, node: str) -> dict[str, Any] | None:
    """The Node's SystemdUnitsReady condition as on the wire (camelCase keys), or None."""
    obj: Any = await client.CoreV1Api(admin).read_node_status(node, _preload_content=False)
    body = await obj.json()
    for condition in (body.get("status") or {}).get("conditions") or []:
        if condition.get("type") == CONDITION:
            return dict(condition)
    return None
