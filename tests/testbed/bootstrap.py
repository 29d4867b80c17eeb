"""Bootstrap tokens and the certificate identity of a node agent, as Gardener sets them up.

A new node has no kubeconfig, only a bootstrap token: a Secret ``bootstrap-token-<id>`` of
type ``bootstrap.kubernetes.io/token`` in kube-system. kube-apiserver (with
``--enable-bootstrap-token-auth``) authenticates ``<id>.<secret>`` as the user
``system:bootstrap:<id>`` in the group ``system:bootstrappers``, which Gardener binds to the
ClusterRole ``system:node-bootstrapper`` (create/get/list/watch CertificateSigningRequests).

The agent's certificate identity is the user ``gardener.cloud:node-agent:machine:<machine>``
in the group ``gardener.cloud:node-agents``. It gets the same least-privilege rules as the
ServiceAccount of ``tests.testbed.credentials`` (one rule set), plus CSRs for its renewal.
"""

from __future__ import annotations

import datetime as dt
import secrets
import string
from dataclasses import dataclass
from pathlib import Path

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

from tests.testbed.controlplane import write_kubeconfig
from tests.testbed.credentials import NAMESPACE, _apply, grant_node_agent_rules

BOOTSTRAPPERS_GROUP = "system:bootstrappers"
NODE_BOOTSTRAPPER_ROLE = "system:node-bootstrapper"
NODES_GROUP = "system:nodes"
KUBELET_CLIENT_ROLE = "system:certificates.k8s.io:certificatesigningrequests:nodeclient"
KUBELET_RENEWAL_ROLE = "system:certificates.k8s.io:certificatesigningrequests:selfnodeclient"
NODE_AGENT_USER_PREFIX = "gardener.cloud:node-agent:machine:"
NODE_AGENTS_GROUP = "gardener.cloud:node-agents"
_TOKEN_ALPHABET = string.ascii_lowercase + string.digits


@dataclass(frozen=True)
class BootstrapToken:
    token_id: str
    token_secret: str

    @property
    def token(self) -> str:
        """What a node gets in ``credentials/bootstrap-token``."""
        return f"{self.token_id}.{self.token_secret}"

    @property
    def secret_name(self) -> str:
        return f"bootstrap-token-{self.token_id}"

    @property
    def username(self) -> str:
        return f"system:bootstrap:{self.token_id}"


def node_agent_user(machine_name: str) -> str:
    return f"{NODE_AGENT_USER_PREFIX}{machine_name}"


def _random(length: int) -> str:
    return "".join(secrets.choice(_TOKEN_ALPHABET) for _ in range(length))


async def create_bootstrap_token(
    admin: ApiClient,
    *,
    expiration: dt.datetime | None = None,
    usage_signing: bool = False,
    description: str = "bootstrap token for a node agent test",
    token_id: str | None = None,
) -> BootstrapToken:
    """Create the Secret ``bootstrap-token-<id>`` in kube-system and return the token.

    ``expiration`` (timezone-aware) is written as RFC 3339; once it has passed the API
    server no longer accepts the token and kube-controller-manager's token cleaner deletes
    the Secret.
    """
    token = BootstrapToken(token_id or _random(6), _random(16))
    data = {
        "token-id": token.token_id,
        "token-secret": token.token_secret,
        "usage-bootstrap-authentication": "true",
        "description": description,
    }
    if usage_signing:
        data["usage-bootstrap-signing"] = "true"
    if expiration is not None:
        if expiration.tzinfo is None:
            raise ValueError("expiration must be timezone-aware")
        data["expiration"] = expiration.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    await client.CoreV1Api(admin).create_namespaced_secret(
        NAMESPACE,
        client.V1Secret(
            metadata=client.V1ObjectMeta(name=token.secret_name),
            type="bootstrap.kubernetes.io/token",
            string_data=data,
        ),
    )
    return token


async def _bind_node_bootstrapper(
    admin: ApiClient, binding: str, group: str, role: str = NODE_BOOTSTRAPPER_ROLE
) -> None:
    await _apply(
        client.RbacAuthorizationV1Api(admin).create_cluster_role_binding,
        client.V1ClusterRoleBinding(
            metadata=client.V1ObjectMeta(name=binding),
            role_ref=client.V1RoleRef(
                api_group="rbac.authorization.k8s.io",
                kind="ClusterRole",
                name=role,
            ),
            subjects=[
                client.RbacV1Subject(
                    api_group="rbac.authorization.k8s.io", kind="Group", name=group
                )
            ],
        ),
    )


async def allow_bootstrappers(admin: ApiClient) -> None:
    """Gardener's binding: group ``system:bootstrappers`` -> ``system:node-bootstrapper``
    (create/get/list/watch CSRs, nothing else). Idempotent."""
    await _bind_node_bootstrapper(admin, NODE_BOOTSTRAPPER_ROLE, BOOTSTRAPPERS_GROUP)


async def allow_kubelet_bootstrap(admin: ApiClient) -> None:
    """Gardener's bindings for the kubelet's own TLS bootstrap: bootstrap tokens may have a
    kubelet client certificate approved (kube-controller-manager's ``csrapproving``), nodes
    may renew theirs. Idempotent."""
    for binding, group in (
        (KUBELET_CLIENT_ROLE, BOOTSTRAPPERS_GROUP),
        (KUBELET_RENEWAL_ROLE, NODES_GROUP),
    ):
        await _bind_node_bootstrapper(admin, binding, group, role=binding)


async def grant_node_agent_identity(
    admin: ApiClient,
    machine_name: str,
    *,
    secret_names: list[str],
    node_name: str | None = None,
) -> str:
    """Give the user ``gardener.cloud:node-agent:machine:<machine_name>`` exactly the node
    agent's rule set (its Node and Lease — named after ``node_name``, which defaults to the
    machine name as in a cluster without machine objects —, the named Secrets in kube-system,
    Events) and let the group ``gardener.cloud:node-agents`` create/get/list/watch CSRs to
    renew its certificate. Idempotent; returns the user name."""
    user = node_agent_user(machine_name)
    subject = client.RbacV1Subject(api_group="rbac.authorization.k8s.io", kind="User", name=user)
    await grant_node_agent_rules(
        admin,
        f"node-agent-machine-{machine_name}",
        subject,
        node_name=node_name or machine_name,
        secret_names=secret_names,
    )
    await _bind_node_bootstrapper(admin, "gardener.cloud:node-agents:csr", NODE_AGENTS_GROUP)
    return user


def token_kubeconfig(path: Path, *, server: str, ca_file: Path, token: str) -> Path:
    """A kubeconfig that logs in with a (bootstrap) token."""
    return write_kubeconfig(path, server=server, ca_file=ca_file, user={"token": token})


def certificate_kubeconfig(
    path: Path, *, server: str, ca_file: Path, cert_file: Path, key_file: Path
) -> Path:
    """A kubeconfig that logs in with a client certificate (e.g. one a CSR got signed)."""
    return write_kubeconfig(
        path,
        server=server,
        ca_file=ca_file,
        user={"client-certificate": str(cert_file), "client-key": str(key_file)},
    )
