"""Least-privilege credentials for one node agent, made the way a real cluster hands them out.

A ServiceAccount per node, RBAC that names exactly the objects that node's agent may touch
(its Node, its Leases, the named Secrets in kube-system, Events: ``node_agent_rules``, which
the certificate identity of ``tests.testbed.bootstrap`` gets too), and a bound token issued
through the TokenRequest API. The token can be bound to a Secret so that deleting that
Secret invalidates it on the server, which is how tests rotate credentials for real.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed.controlplane import write_kubeconfig

NAMESPACE = "kube-system"


@dataclass(frozen=True)
class NodeAgentCredentials:
    service_account: str
    kubeconfig: Path
    token_file: Path
    token: str
    binding_secret: str | None


def _rule(
    groups: list[str], resources: list[str], verbs: list[str], names: list[str] | None = None
) -> client.V1PolicyRule:
    return client.V1PolicyRule(
        api_groups=groups, resources=resources, verbs=verbs, resource_names=names
    )


async def _apply(create: object, *args: object) -> None:
    """Create an object; an existing one (409) is fine: the helper is idempotent."""
    assert callable(create)
    try:
        await create(*args)
    except client.ApiException as exc:
        if exc.status != 409:
            raise


async def issue_token(
    admin: ApiClient, service_account: str, *, binding_secret: str | None, seconds: int = 3600
) -> str:
    """A fresh bound token for the ServiceAccount (bound to a Secret if one is named)."""
    core = client.CoreV1Api(admin)
    bound = None
    if binding_secret is not None:
        secret = await core.read_namespaced_secret(binding_secret, NAMESPACE)
        bound = client.V1BoundObjectReference(
            api_version="v1", kind="Secret", name=binding_secret, uid=secret.metadata.uid
        )
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=seconds, bound_object_ref=bound
        )
    )
    response = await core.create_namespaced_service_account_token(
        service_account, NAMESPACE, request
    )
    return str(response.status.token)


async def issue_token_bound_to_new_secret(admin: ApiClient, service_account: str) -> str:
    """A fresh token bound to a Secret of its own, so that deleting the old binding Secret
    invalidates the old token while this one stays valid (a real rotation)."""
    binding = f"{service_account}-binding-{uuid.uuid4().hex[:8]}"
    await client.CoreV1Api(admin).create_namespaced_secret(
        NAMESPACE, client.V1Secret(metadata=client.V1ObjectMeta(name=binding))
    )
    return await issue_token(admin, service_account, binding_secret=binding)


def node_agent_rules(
    node_name: str, secret_names: list[str]
) -> tuple[list[client.V1PolicyRule], list[client.V1PolicyRule]]:
    """The one rule set of a node agent, whatever its identity: (rules in kube-system,
    cluster-wide rules). Its own Node (and the list and watch of all), the named Secrets,
    Events, and the Leases Gardener's node agent authorizer allows: get/list/watch/update of
    ``gardener-node-agent-<node>`` (the
    heartbeat) and of the Lease named like the pool's OSC Secret (the serial reconciliation
    Lease; the first of ``secret_names`` is the OSC Secret, the one the Node's
    ``worker.gardener.cloud/gardener-node-agent-secret-name`` label names), create of any Lease
    in kube-system (a name is not known at create time) — no patch, no delete — and the get,
    list, watch and delete of Pods (those left on its Node after an in-place update)."""
    leases = [f"gardener-node-agent-{node_name}", *secret_names[:1]]
    namespaced = [
        _rule([""], ["secrets"], ["get", "list", "watch"], sorted(set(secret_names))),
        _rule(["coordination.k8s.io"], ["leases"], ["get", "list", "watch", "update"], leases),
        _rule(["coordination.k8s.io"], ["leases"], ["create"]),
        _rule(["", "events.k8s.io"], ["events"], ["create", "patch"]),
    ]
    cluster = [
        _rule([""], ["nodes"], ["get", "list", "watch", "patch", "update"], [node_name]),
        # list and watch of every Node, as Gardener's node-agent authorizer allows them: an
        # agent knows its host name, not yet its Node's name (upstream lists by the hostname
        # label at its start)
        _rule([""], ["nodes"], ["list", "watch"]),
        # its Node's conditions (SystemdUnitsReady), as Gardener's node-agent authorizer allows
        _rule([""], ["nodes/status"], ["get", "patch", "update"], [node_name]),
        _rule(["", "events.k8s.io"], ["events"], ["create", "patch"]),
        # the Pods left on its Node after an in-place update (Gardener's authorizer allows
        # list with spec.nodeName=<node> and delete of that node's Pods; RBAC cannot scope
        # by node, so this is wider)
        _rule([""], ["pods"], ["get", "list", "watch", "delete"]),
    ]
    return namespaced, cluster


async def grant_node_agent_rules(
    admin: ApiClient,
    name: str,
    subject: client.RbacV1Subject,
    *,
    node_name: str,
    secret_names: list[str],
) -> None:
    """A Role, a ClusterRole (both called ``name``) holding ``node_agent_rules`` and their
    bindings to ``subject`` (a ServiceAccount, or the user of a client certificate)."""
    rbac = client.RbacAuthorizationV1Api(admin)
    namespaced, cluster = node_agent_rules(node_name, secret_names)
    await _apply(
        rbac.create_namespaced_role,
        NAMESPACE,
        client.V1Role(metadata=client.V1ObjectMeta(name=name), rules=namespaced),
    )
    await _apply(
        rbac.create_cluster_role,
        client.V1ClusterRole(metadata=client.V1ObjectMeta(name=name), rules=cluster),
    )
    await _apply(
        rbac.create_namespaced_role_binding,
        NAMESPACE,
        client.V1RoleBinding(
            metadata=client.V1ObjectMeta(name=name),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="Role", name=name
            ),
            subjects=[subject],
        ),
    )
    await _apply(
        rbac.create_cluster_role_binding,
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=name),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=name
            ),
            subjects=[subject],
        ),
    )


async def node_agent_credentials(
    admin: ApiClient,
    directory: Path,
    *,
    server: str,
    ca_file: Path,
    node_name: str,
    secret_names: list[str],
    bind_token_to_secret: bool = True,
) -> NodeAgentCredentials:
    """Create RBAC + token for ``node_name`` and write a kubeconfig using a token file."""
    core = client.CoreV1Api(admin)
    name = f"node-agent-{node_name}"

    await _apply(
        core.create_namespaced_service_account,
        NAMESPACE,
        client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name)),
    )
    subject = client.RbacV1Subject(kind="ServiceAccount", name=name, namespace=NAMESPACE)
    await grant_node_agent_rules(
        admin, name, subject, node_name=node_name, secret_names=secret_names
    )
    binding_secret = None
    if bind_token_to_secret:
        binding_secret = f"{name}-token-binding"
        await _apply(
            core.create_namespaced_secret,
            NAMESPACE,
            client.V1Secret(metadata=client.V1ObjectMeta(name=binding_secret)),
        )
    token = await issue_token(admin, name, binding_secret=binding_secret)
    directory.mkdir(parents=True, exist_ok=True)
    token_file = directory / "token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    kubeconfig = write_kubeconfig(
        directory / "kubeconfig",
        server=server,
        ca_file=ca_file,
        user={"tokenFile": str(token_file)},
        name=name,
    )
    return NodeAgentCredentials(name, kubeconfig, token_file, token, binding_secret)
