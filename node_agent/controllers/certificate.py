"""The certificate controller: the agent's own credentials, obtained and renewed in place.

On a node Gardener provisions, the agent starts with a bootstrap token and no kubeconfig.
:meth:`CertificateController.bootstrap` turns the token into a client certificate (a
CertificateSigningRequest that Gardener's approver approves and kube-controller-manager signs)
before any other controller runs. :meth:`CertificateController.run` then renews the certificate
at a jittered 80 % of its lifetime with a request authenticated by the certificate itself, and
writes the new kubeconfig atomically. The Kubernetes client notices the file change and builds a
new connection for the next request: unlike upstream, the agent does not restart for a rotation,
so no watch, Lease renewal or apply is interrupted.

A certificate that expired (the node was off for weeks) or that the server rejects falls back to
the bootstrap token while that file is still there; the OSC controller deletes the token after the
first OSC is applied, as upstream does. A kubeconfig without an inline certificate (a standalone
install with a token) is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from node_agent.base import retry
from node_agent.base.errors import CertificateError, ConfigError, KubeError
from node_agent.base.layout import BOOTSTRAP_TOKEN_FILE
from node_agent.base.log import get_logger
from node_agent.config import MACHINE_NAME_FILE, AgentSettings, NodeAgentConfiguration
from node_agent.host.fs import HostFS
from node_agent.kube import certificates
from node_agent.kube.certificates import CertificateInfo

if TYPE_CHECKING:
    from node_agent.kube.client import KubeClient
    from node_agent.kube.seam import KubeSeam

log = get_logger("node-agent.certificate")

#: How often the running controller looks at its certificate and at the server's verdict on it.
CHECK_PERIOD = 30.0


class _Refused(Exception):
    """A rotation cannot succeed: the server refuses the current certificate."""


@dataclass(frozen=True)
class CertificateView:
    """What ``node-agent status`` shows of the agent's credentials."""

    phase: str
    subject: str | None
    not_after: str | None
    renew_at: str | None
    rotations: int
    last_error: str | None


async def _nothing(_message: str) -> None:
    return None


def _iso(moment: datetime | None) -> str | None:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if moment else None


class CertificateController:
    def __init__(
        self,
        settings: AgentSettings,
        config: NodeAgentConfiguration,
        fs: HostFS,
        *,
        client_for_token: Callable[[str, Path, Path], KubeClient] | None = None,
        rng: random.Random | None = None,
        approval_timeout: float = certificates.APPROVAL_TIMEOUT,
        poll: float = 2.0,
        check_period: float = CHECK_PERIOD,
    ) -> None:
        self.settings = settings
        self.config = config
        self.fs = fs
        self.kubeconfig = config.client_connection.kubeconfig
        self._client_for_token = client_for_token
        self._rng = rng or random.Random()
        self._approval_timeout = approval_timeout
        self._poll = poll
        self._check_period = check_period
        self.phase = "unknown"
        self.info: CertificateInfo | None = None
        self.renew_at: datetime | None = None
        self.rotations = 0
        self.last_error: str | None = None
        #: Called while waiting (the daemon extends systemd's start timeout and pings it).
        self.on_wait: Callable[[str], None] = lambda line: None
        #: Called with the error when a request ends without a usable certificate (denied, not
        #: issued in time, or a certificate that failed the checks): the daemon records a
        #: Warning Event on its Node, once it knows the Node.
        self.on_refused: Callable[[str], Awaitable[None]] = _nothing

    # -- the read side ---------------------------------------------------------------------------

    def view(self) -> CertificateView:
        return CertificateView(
            phase=self.phase,
            subject=self.info.subject if self.info else None,
            not_after=_iso(self.info.not_after) if self.info else None,
            renew_at=_iso(self.renew_at),
            rotations=self.rotations,
            last_error=self.last_error,
        )

    # -- files -----------------------------------------------------------------------------------

    def _host(self, path: str) -> Path:
        return Path(self.settings.root) / path.lstrip("/")

    def current(self) -> CertificateInfo | None:
        """The certificate in the kubeconfig, or None (no kubeconfig, or one without a
        certificate of its own, e.g. a token)."""
        raw = self.fs.read(self.kubeconfig)
        if raw is None:
            return None
        try:
            return certificates.kubeconfig_certificate_info(raw)
        except CertificateError as exc:
            log.warning("kubeconfig certificate unreadable", path=self.kubeconfig, error=str(exc))
            return None

    def has_bootstrap_token(self) -> bool:
        return self.fs.read(BOOTSTRAP_TOKEN_FILE) is not None

    def _machine_name(self) -> str:
        raw = self.fs.read(MACHINE_NAME_FILE)
        name = raw.decode(errors="replace").strip() if raw is not None else ""
        if not name:
            raise ConfigError(
                f"{MACHINE_NAME_FILE} is missing or empty: the certificate names the machine"
            )
        return name

    # -- the flow --------------------------------------------------------------------------------

    def needs_bootstrap(self) -> bool:
        """No usable kubeconfig, and a bootstrap token to get one with."""
        if self.fs.read(self.kubeconfig) is None:
            if not self.has_bootstrap_token():
                raise ConfigError(
                    f"neither the kubeconfig {self.kubeconfig} nor the bootstrap token "
                    f"{BOOTSTRAP_TOKEN_FILE} exists: the agent has no way to authenticate"
                )
            return True
        info = self.current()
        if info is not None and info.expired() and self.has_bootstrap_token():
            log.warning(
                "client certificate expired; using the bootstrap token",
                not_after=_iso(info.not_after),
            )
            return True
        return False

    def token_client(self) -> KubeClient:
        """A client authenticated by the bootstrap token (server and CA from the config)."""
        return self._token_client()

    async def bootstrap(self, kube: KubeSeam) -> None:
        """Obtain the first certificate with ``kube``, a :meth:`token_client`."""
        await self._obtain(kube, "bootstrap")

    def settle(self) -> None:
        """Take the kubeconfig's certificate as the one in use (no bootstrap was needed)."""
        self._settled()

    def _token_client(self) -> KubeClient:
        server = self.config.api_server.server
        if not server:
            raise ConfigError("apiServer.server is empty: the bootstrap token has no server")
        ca = self._host(self.config.api_server.ca_file)
        token = self._host(BOOTSTRAP_TOKEN_FILE)
        if self._client_for_token is not None:
            return self._client_for_token(server, ca, token)
        from node_agent.kube.client import KubeClient

        return KubeClient.from_token_file(
            server, ca, token, ca_data=self.config.api_server.ca_bundle
        )

    async def _obtain(self, kube: KubeSeam, how: str) -> None:
        """Ask with ``kube`` until a certificate is issued and written (retrying with backoff)."""
        backoff = retry.Backoff.of(retry.CERTIFICATE, self._rng)
        machine = self._machine_name()
        while True:
            request = await asyncio.to_thread(certificates.make_request, machine)
            self.phase = f"{how}: requesting CertificateSigningRequest {request.name}"
            log.info(
                "requesting a client certificate",
                csr=request.name,
                common_name=request.common_name,
                using=how,
            )
            try:
                issued = await certificates.request_certificate(
                    kube,
                    request,
                    give_up_after=self._approval_timeout,
                    poll=self._poll,
                    on_wait=self._waiting,
                )
            except (CertificateError, KubeError) as exc:
                self.last_error = str(exc)
                if how == "rotation" and self._refused(kube):
                    raise _Refused from exc
                delay = backoff.next()
                log.warning(
                    "client certificate not obtained", csr=request.name, error=str(exc), retry=delay
                )
                if isinstance(exc, CertificateError):
                    await self.on_refused(str(exc))
                self.on_wait(f"no certificate yet: {exc}")
                await asyncio.sleep(delay)
                continue
            await self._write(issued.cert_pem, request.key_pem, issued.info)
            self.last_error = None
            info = self._settled(received=datetime.now(UTC))
            log.info(
                "client certificate obtained",
                csr=issued.name,
                subject=info.subject if info else None,
                not_after=_iso(info.not_after) if info else None,
                waited=round(issued.waited, 3),
                using=how,
            )
            return

    def _waiting(self, line: str) -> None:
        if line != self.phase:
            log.info("certificate", progress=line)
        self.phase = line
        self.on_wait(line)

    async def _write(self, cert_pem: bytes, key_pem: bytes, info: CertificateInfo) -> None:
        data = certificates.kubeconfig(
            self.config.api_server.server or self._server_of_current(),
            str(self._host(self.config.api_server.ca_file)),
            cert_pem,
            key_pem,
            info,
            ca_data=self.config.api_server.ca_bundle,
        )
        await self.fs.write_atomic_async(self.kubeconfig, data, 0o600, dir_mode=0o700)

    def _server_of_current(self) -> str:
        from node_agent.kube.client import parse_kubeconfig

        return parse_kubeconfig(self._host(self.kubeconfig)).server

    def _settled(self, received: datetime | None = None) -> CertificateInfo | None:
        """Read the certificate in use and schedule its renewal (``received``: when it was
        issued to us, if just now)."""
        self.info = self.current()
        if self.info is None:
            self.phase = "not managed (the kubeconfig has no client certificate of its own)"
            self.renew_at = None
            return None
        self.renew_at = self.info.renew_at(self._rng.random(), received=received)
        self.phase = "valid"
        return self.info

    async def run(self, kube: KubeSeam) -> None:
        """Renew the certificate in time; fall back to the bootstrap token when it is refused."""
        while True:
            if self.info is None or self.renew_at is None:
                return  # nothing of ours to renew
            now = datetime.now(UTC)
            if self._refused(kube):
                if self.has_bootstrap_token():
                    await self._fall_back(kube)
                    continue
                self.phase = "refused by the server, and no bootstrap token is left to fall back to"
            elif now >= self.renew_at:
                # Refused: the next turn falls back to the bootstrap token, if there is one.
                with contextlib.suppress(_Refused):
                    await self._rotate(kube)
                continue
            wait = min(self._check_period, (self.renew_at - now).total_seconds())
            await asyncio.sleep(max(wait, 0.05))

    async def renew(self, kube: KubeSeam) -> None:
        """A new certificate now, whatever its age: the cluster's CA is being rotated (an
        in-place update). Only a certificate of the agent's own is renewed."""
        if self.info is not None:
            await self._rotate(kube)

    def _refused(self, kube: KubeSeam) -> bool:
        """The certificate expired, or the server's latest verdict on it was 401."""
        return self.info is not None and (self.info.expired() or kube.stats.rejected())

    async def _rotate(self, kube: KubeSeam) -> None:
        started = time.monotonic()
        before = self.info
        await self._obtain(kube, "rotation")
        kube.stats.credentials_replaced()
        self.rotations += 1
        log.info(
            "client certificate rotated without a restart",
            old_not_after=_iso(before.not_after) if before else None,
            seconds=round(time.monotonic() - started, 3),
        )

    async def _fall_back(self, main: KubeSeam) -> None:
        log.warning(
            "client certificate expired or refused; requesting a new one with the bootstrap token"
        )
        kube = self._token_client()
        try:
            await self._obtain(kube, "bootstrap")
        finally:
            await kube.close()
        main.stats.credentials_replaced()
