"""The Node's ``status`` as the agent reports it: the right to write it, and reading it back.

Gardener's node-agent authorizer lets an agent patch its own Node's ``status`` subresource (the
``SystemdUnitsReady`` condition); ``grant_node_status`` gives the test bed's agent identity the
same right, on exactly its Node.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed.credentials import NAMESPACE

CONDITION = "SystemdUnitsReady"


async def grant_node_status(admin: ApiClient, service_account: str, node: str) -> None:
    """get/patch/update of ``nodes/status`` of ``node`` for the ServiceAccount (idempotent)."""
    rbac = client.RbacAuthorizationV1Api(admin)
    name = f"{service_account}-node-status"
    role = client.V1ClusterRole(
        metadata=client.V1ObjectMeta(name=name),
        rules=[
            client.V1PolicyRule(
                api_groups=[""],
                resources=["nodes/status"],
                verbs=["get", "patch", "update"],
                resource_names=[node],
            )
        ],
    )
    binding = client.V1ClusterRoleBinding(
        metadata=client.V1ObjectMeta(name=name),
        role_ref=client.V1RoleRef(
            api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=name
        ),
        subjects=[
            client.RbacV1Subject(kind="ServiceAccount", name=service_account, namespace=NAMESPACE)
        ],
    )
    for create, body in (
        (rbac.create_cluster_role, role),
        (rbac.create_cluster_role_binding, binding),
    ):
        try:
            await create(body)
        except client.ApiException as exc:
            if exc.status != 409:
                raise


async def units_ready(admin: ApiClient, node: str) -> dict[str, Any] | None:
    """The Node's SystemdUnitsReady condition as on the wire (camelCase keys), or None."""
    obj = await client.CoreV1Api(admin).read_node_status(node, _preload_content=False)
    body = await obj.json()
    for condition in (body.get("status") or {}).get("conditions") or []:
        if condition.get("type") == CONDITION:
            return dict(condition)
    return None
