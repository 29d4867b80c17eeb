"""The Kubernetes seam: everything the controllers ask of the API server goes through ``KubeSeam``.

``node_agent.kube.client.KubeClient`` is the real implementation (it satisfies the protocol
structurally; mypy checks that below). Code that only needs these calls can depend on the
protocol, and unit tests of pure logic can pass an in-memory fake instead of an API server.

Importing this module is cheap: the client module (and kubernetes-asyncio under it) is only named
for the type checker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from node_agent.kube.watch import Watchable

if TYPE_CHECKING:
    from node_agent.kube.client import ClientStats, KubeClient, Resource

JSON = dict[str, Any]


class ResourceSeam(Watchable, Protocol):
    """One collection (``node_agent.kube.client.Resource``): list and watch, and item calls."""

    async def get(self, name: str) -> JSON: ...

    async def list(
        self,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        limit: int | None = None,
        continue_token: str | None = None,
        metadata_only: bool = False,
    ) -> JSON:
        """One List (``limit``/``continue_token``: a page; ``metadata_only``: the items'
        metadata alone)."""
        ...

    async def create(self, body: Mapping[str, Any]) -> JSON: ...

    async def replace(self, name: str, body: Mapping[str, Any]) -> JSON:
        """PUT; the body's ``metadata.resourceVersion`` makes it a compare-and-swap (409)."""
        ...

    async def merge_patch(self, name: str, patch: Mapping[str, Any]) -> JSON:
        """JSON merge patch: ``None`` values delete keys, maps merge, lists replace."""
        ...


class KubeSeam(Protocol):
    """What node-agent needs from the API server. Errors are ``node_agent.base.errors.KubeError``s;
    answers are the wire's JSON objects."""

    @property
    def server(self) -> str:
        """The API server's URL (for status and logs)."""
        ...

    @property
    def stats(self) -> ClientStats:
        """Request counters, and whether the server currently refuses the credentials."""
        ...

    async def close(self) -> None:
        """Release the connections."""

    def nodes(self) -> ResourceSeam: ...

    def secrets(self, namespace: str) -> ResourceSeam: ...

    def leases(self, namespace: str) -> ResourceSeam: ...

    def certificate_signing_requests(self) -> ResourceSeam: ...

    async def get_node(self, name: str) -> JSON: ...

    async def patch_node(self, name: str, patch: Mapping[str, Any]) -> JSON:
        """Merge patch of the Node (labels, annotations); ``None`` values remove keys."""
        ...

    async def patch_node_status(self, name: str, patch: Mapping[str, Any]) -> JSON:
        """Merge patch of the Node's ``status`` subresource (conditions)."""
        ...

    async def patch_node_condition(self, name: str, condition: Mapping[str, Any]) -> JSON:
        """One condition of the Node's ``status``, merged by ``type`` (no read needed)."""
        ...

    async def get_secret(self, namespace: str, name: str) -> JSON: ...

    async def get_lease(self, namespace: str, name: str) -> JSON: ...

    async def create_lease(self, namespace: str, body: Mapping[str, Any]) -> JSON: ...

    async def update_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> JSON:
        """PUT with the read ``metadata.resourceVersion``: a concurrent writer gives 409."""
        ...

    async def create_event(self, body: Mapping[str, Any]) -> JSON:
        """Create a core/v1 Event in the body's ``metadata.namespace`` (default ``default``)."""
        ...

    async def list_pods_on_node(self, node: str) -> list[JSON]:
        """The Pods bound to ``node`` (field selector ``spec.nodeName``, the only list
        Gardener's node-agent authorizer allows)."""
        ...

    async def delete_pod(self, namespace: str, name: str) -> None:
        """Delete one Pod (its default grace period); one already gone is fine."""
        ...


if TYPE_CHECKING:
    # mypy proves the real client and its collections satisfy the seam.
    _client: type[KubeSeam] = KubeClient

    def _resource_is_a_seam(resource: Resource) -> ResourceSeam:
        return resource
