"""The Node's ``status`` as the agent reports it, read back (the agent identity's right to
patch it is in the shared rules, ``tests.testbed.credentials``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed.agent_harness import wait_for

CONDITION = "SystemdUnitsReady"


async def units_ready(admin: ApiClient, node: str) -> dict[str, Any] | None:
    """The Node's SystemdUnitsReady condition as on the wire (camelCase keys), or None."""
    obj: Any = await client.CoreV1Api(admin).read_node_status(node, _preload_content=False)
    body = await obj.json()
    for condition in (body.get("status") or {}).get("conditions") or []:
        if condition.get("type") == CONDITION:
            return dict(condition)
    return None


async def wait_condition(
    admin: ApiClient,
    node: str,
    accept: Callable[[dict[str, Any]], bool],
    what: str,
    timeout: float = 45.0,
) -> dict[str, Any]:
    """Wait until the Node's SystemdUnitsReady condition is there and ``accept`` takes it; the
    last one seen in the timeout's message."""
    seen: list[dict[str, Any] | None] = [None]

    async def check() -> bool:
        seen[0] = await units_ready(admin, node)
        return seen[0] is not None and accept(seen[0])

    try:
        await wait_for(check, timeout, what, poll=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last seen: {seen[0]}") from None
    assert seen[0] is not None
    return seen[0]
