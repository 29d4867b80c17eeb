"""A CSR approver for node agents that decides the way Gardener's does, in the test process.

Gardener's resource manager approves the CertificateSigningRequests of gardener-node-agent;
kube-controller-manager then signs them. This one watches CSRs with the admin client and, for
those with signer ``kubernetes.io/kube-apiserver-client`` whose common name starts with
``gardener.cloud:node-agent:machine:`` and that are neither approved, denied nor issued:

- checks the organization is exactly ``gardener.cloud:node-agents`` and the usages are exactly
  digital signature, key encipherment, client auth (stricter than Gardener, which leaves the
  usages to the signer; the agent must ask for exactly these anyway);
- a requester ``system:bootstrap:*`` is denied once the Node named like the machine exists
  (the machine is already bootstrapped); a requester ``gardener.cloud:node-agent:machine:*``
  must equal the common name; anyone else is denied;
- approves or denies through the ``/approval`` subresource with Gardener's reasons/messages.

Other CSRs are left alone (no opinion). Every decision is recorded for assertions. ``mode``
``"hold"`` leaves matching CSRs pending (recorded once as held) until ``release()``;
``"deny"`` denies every matching CSR.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from dataclasses import dataclass
from typing import Literal

from cryptography import x509
from cryptography.x509.oid import NameOID
from kubernetes_asyncio import client, watch
from kubernetes_asyncio.client import ApiClient

from tests.testbed.bootstrap import NODE_AGENT_USER_PREFIX, NODE_AGENTS_GROUP

SIGNER = "kubernetes.io/kube-apiserver-client"
BOOTSTRAP_USER_PREFIX = "system:bootstrap:"
USAGES = frozenset({"digital signature", "key encipherment", "client auth"})

Mode = Literal["approve", "hold", "deny"]
Outcome = Literal["approved", "denied", "held"]


@dataclass(frozen=True)
class Decision:
    csr: str
    username: str
    common_name: str
    outcome: Outcome
    reason: str


class CSRApprover:
    """Start with ``await approver.start()`` (or ``async with``); stop with ``stop()``."""

    def __init__(self, admin: ApiClient, mode: Mode = "approve") -> None:
        self.admin = admin
        self.mode: Mode = mode
        self.decisions: list[Decision] = []
        self.errors: list[Exception] = []
        self._certs = client.CertificatesV1Api(admin)
        self._core = client.CoreV1Api(admin)
        self._task: asyncio.Task[None] | None = None
        self._held: set[str] = set()
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition()

    # -- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        assert self._task is None, "already started"
        ready = asyncio.Event()
        self._task = asyncio.create_task(self._run(ready), name="csr-approver")
        await asyncio.wait_for(ready.wait(), timeout=30)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def __aenter__(self) -> CSRApprover:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def set_mode(self, mode: Mode) -> None:
        """Switch mode; pending CSRs (e.g. held ones) are looked at again at once."""
        self.mode = mode
        self._held.clear()
        await self._sweep()

    async def release(self) -> None:
        """Stop holding: approve (or deny) what was held, as the checks decide."""
        await self.set_mode("approve")

    # -- queries for tests ------------------------------------------------------------
    def decision(self, csr_name: str) -> Decision | None:
        for d in reversed(self.decisions):
            if d.csr == csr_name:
                return d
        return None

    async def wait_for_decision(
        self,
        csr_name: str | None = None,
        *,
        outcome: Outcome | None = None,
        timeout: float = 30.0,
    ) -> Decision:
        """The first recorded decision on ``csr_name`` (any CSR if None) with ``outcome``."""

        def find() -> Decision | None:
            for d in self.decisions:
                if (csr_name is None or d.csr == csr_name) and (
                    outcome is None or d.outcome == outcome
                ):
                    return d
            return None

        async with self._changed:
            found = await asyncio.wait_for(self._changed.wait_for(find), timeout)
        assert found is not None
        return found

    # -- the loop ---------------------------------------------------------------------
    async def _run(self, ready: asyncio.Event) -> None:
        while True:
            try:
                listed = await self._certs.list_certificate_signing_request()
                for csr in listed.items:
                    await self._consider(csr)
                ready.set()
                w = watch.Watch()
                async with w.stream(
                    self._certs.list_certificate_signing_request,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=60,
                ) as stream:
                    async for event in stream:
                        if event["type"] in ("ADDED", "MODIFIED"):
                            await self._consider(event["object"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keeps watching, like a controller; kept for asserts
                self.errors.append(exc)
                await asyncio.sleep(0.5)

    async def _sweep(self) -> None:
        listed = await self._certs.list_certificate_signing_request()
        for csr in listed.items:
            await self._consider(csr)

    async def _consider(self, csr: client.V1CertificateSigningRequest) -> None:
        async with self._lock:
            name = csr.metadata.name
            conditions = (csr.status.conditions if csr.status else None) or []
            if any(c.type in ("Approved", "Denied") for c in conditions):
                return
            if csr.status is not None and csr.status.certificate:
                return
            if csr.spec.signer_name != SIGNER:
                return
            try:
                request = x509.load_pem_x509_csr(base64.b64decode(csr.spec.request))
            except ValueError:
                return
            cns = request.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
            common_name = str(cns[0].value) if cns else ""
            if not common_name.startswith(NODE_AGENT_USER_PREFIX):
                return
            username = csr.spec.username or ""
            if self.mode == "hold":
                if name not in self._held:
                    self._held.add(name)
                    await self._record(
                        Decision(name, username, common_name, "held", "held by the test")
                    )
                return
            if self.mode == "deny":
                approve, reason = False, "denied by the test"
            else:
                approve, reason = await self._check(csr, request, common_name, username)
            try:
                await self._decide(csr, approve, reason)
            except client.ApiException as exc:
                if exc.status in (404, 409):
                    return  # gone, or changed meanwhile: the watch brings the new version
                raise
            await self._record(
                Decision(name, username, common_name, "approved" if approve else "denied", reason)
            )

    async def _check(
        self,
        csr: client.V1CertificateSigningRequest,
        request: x509.CertificateSigningRequest,
        common_name: str,
        username: str,
    ) -> tuple[bool, str]:
        orgs = [
            str(a.value) for a in request.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
        ]
        if orgs != [NODE_AGENTS_GROUP]:
            return False, f"organization {orgs} is not [{NODE_AGENTS_GROUP!r}]"
        usages = csr.spec.usages or []
        if len(usages) != len(USAGES) or set(usages) != USAGES:
            return False, f"usages {sorted(usages)} are not {sorted(USAGES)}"
        machine = common_name.removeprefix(NODE_AGENT_USER_PREFIX)
        if username.startswith(BOOTSTRAP_USER_PREFIX):
            try:
                await self._core.read_node(machine)
            except client.ApiException as exc:
                if exc.status != 404:
                    raise
            else:
                return False, (
                    "Cannot use bootstrap token since gardener-node-agent for machine "
                    f"{machine!r} is already bootstrapped"
                )
        elif username.startswith(NODE_AGENT_USER_PREFIX):
            if username != common_name:
                return False, f"username {username!r} and commonName {common_name!r} do not match"
        else:
            return False, (
                f"username {username!r} is not allowed to create CSRs for a gardener-node-agent"
            )
        return True, "all checks passed"

    async def _decide(
        self, csr: client.V1CertificateSigningRequest, approve: bool, reason: str
    ) -> None:
        verb = "Approving" if approve else "Denying"
        condition = client.V1CertificateSigningRequestCondition(
            type="Approved" if approve else "Denied",
            status="True",
            reason="RequestApproved" if approve else "RequestDenied",
            message=f"{verb} gardener-node-agent certificate CSR ({reason})",
        )
        if csr.status is None:
            csr.status = client.V1CertificateSigningRequestStatus()
        csr.status.conditions = [*(csr.status.conditions or []), condition]
        await self._certs.replace_certificate_signing_request_approval(csr.metadata.name, csr)

    async def _record(self, decision: Decision) -> None:
        async with self._changed:
            self.decisions.append(decision)
            self._changed.notify_all()
