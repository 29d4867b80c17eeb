"""Real OCI registries on loopback: Debian's ``docker-registry`` (the CNCF distribution registry).

Each instance serves TLS with a certificate from a test CA, so that the CA handling of
containerd's ``hosts.toml`` is exercised for real, and keeps its blobs in its own directory.
A second instance configured as a pull-through cache of the first plays the registry mirror;
its access log tells which repositories and blobs were fetched through it.
"""

from __future__ import annotations

import http.server
import os
import re
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.testbed import oci
from tests.testbed.controlplane import GUEST_ALIAS, _Proc, free_port
from tests.testbed.pki import CertificateAuthority
from tests.testbed.systemd_ns import HarnessError

REGISTRY_BINARY = Path("/usr/bin/docker-registry")
START_TIMEOUT = 30.0
# Combined log format: "METHOD PATH HTTP/x" STATUS SIZE "REFERER" "USER-AGENT"
_ACCESS_LINE = re.compile(
    r'"(GET|HEAD|PUT|POST|PATCH|DELETE) (\S+) HTTP/[0-9.]+" (\d{3}) \S+ "[^"]*" "([^"]*)"'
)


@dataclass(frozen=True)
class AccessEntry:
    """One request from the registry's access log."""

    method: str
    path: str
    """The request path without its query (containerd adds ``?ns=<upstream>`` on mirrors)."""
    status: int
    user_agent: str


class Registry:
    """One ``docker-registry serve`` process on ``127.0.0.1:<random port>`` with TLS.

    ``upstream`` turns it into a pull-through cache (a mirror) of that registry; the Go
    process then trusts only the test CA for its upstream connection (``SSL_CERT_FILE``).
    """

    def __init__(
        self,
        workdir: Path,
        ca: CertificateAuthority,
        *,
        name: str = "registry",
        upstream: Registry | None = None,
    ) -> None:
        self.name = name
        self.workdir = workdir
        self.ca = ca
        self.upstream = upstream
        self.port = free_port()
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"https://{self.host}"
        self.storage = workdir / "storage"
        self.config_path = workdir / "config.yml"
        self.log_path = workdir / f"{name}.log"
        workdir.mkdir(parents=True, exist_ok=True)
        self.storage.mkdir(exist_ok=True)
        serving = ca.issue(
            f"{name}-serving",
            common_name=name,
            server_ips=("127.0.0.1", GUEST_ALIAS),
            server_dns=("localhost",),
        )
        config: dict[str, object] = {
            "version": 0.1,
            "log": {"level": "info", "formatter": "text", "accesslog": {"disabled": False}},
            "storage": {
                "filesystem": {"rootdirectory": str(self.storage)},
                "delete": {"enabled": True},
                "cache": {"blobdescriptor": "inmemory"},
            },
            "http": {
                "addr": self.host,
                "secret": f"node-agent-test-{name}",
                "tls": {"certificate": str(serving.cert), "key": str(serving.key)},
            },
        }
        if upstream is not None:
            config["proxy"] = {"remoteurl": upstream.url}
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=True))
        self._proc = _Proc(
            name, [str(REGISTRY_BINARY), "serve", str(self.config_path)], self.log_path
        )

    # -- life cycle -------------------------------------------------------------------
    def start(self, timeout: float = START_TIMEOUT) -> None:
        if not REGISTRY_BINARY.exists():
            raise HarnessError(f"{REGISTRY_BINARY} is missing (Debian package docker-registry)")
        # The Go process trusts the test CA alone, for its upstream when it is a mirror.
        env = dict(os.environ, SSL_CERT_FILE=str(self.ca.cert_path))
        with self.log_path.open("ab") as log:
            self._proc.popen = subprocess.Popen(
                self._proc.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while not self._ready():
            if not self._proc.running():
                self.stop()
                raise HarnessError(
                    f"{self.name} exited during start-up; log tail:\n{self._proc.tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise HarnessError(
                    f"{self.name} not ready within {timeout:.0f}s; log tail:\n{self._proc.tail()}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        self._proc.stop()

    def __enter__(self) -> Registry:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- access -------------------------------------------------------------------------
    def ssl_context(self) -> ssl.SSLContext:
        """A client context that trusts exactly the test CA."""
        return ssl.create_default_context(cafile=str(self.ca.cert_path))

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(
                self.url + path, context=self.ssl_context(), timeout=timeout
            ) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as err:
            return int(err.code), bytes(err.read())

    def _ready(self) -> bool:
        try:
            status, _ = self.get("/v2/", timeout=2.0)
        except OSError:
            return False
        return status == 200

    def ref(self, repository: str, tag: str) -> str:
        """The image reference ``<host:port>/<repository>:<tag>`` on this registry."""
        return f"{self.host}/{repository}:{tag}"

    def push(self, repository: str, tag: str, image: oci.Image | oci.Index) -> str:
        """Push a test image (``oci.build_image``) or a multi-platform one (``oci.build_index``);
        return its manifest (or index) digest."""
        if self.upstream is not None:
            raise HarnessError(f"{self.name} is a pull-through cache; push to its upstream")
        return oci.push(self.url, repository, tag, image, self.ssl_context())

    def access_log(self) -> list[AccessEntry]:
        """Every request the registry answered so far, in order."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        return [
            AccessEntry(m.group(1), m.group(2).split("?", 1)[0], int(m.group(3)), m.group(4))
            for m in _ACCESS_LINE.finditer(text)
        ]

    def served(self, repository: str, *, user_agent: str = "") -> list[AccessEntry]:
        """The successful GETs and HEADs of ``repository``'s manifests and blobs (what a pull
        fetches), optionally only from clients whose user agent starts with ``user_agent``
        (``containerd/<version>``; a mirror fetching from its upstream is ``Go-http-client``)."""
        prefix = f"/v2/{repository}/"
        return [
            entry
            for entry in self.access_log()
            if entry.method in ("GET", "HEAD")
            and entry.status == 200
            and entry.user_agent.startswith(user_agent)
            and entry.path.startswith(prefix)
            and entry.path[len(prefix) :].split("/", 1)[0] in ("manifests", "blobs")
        ]

    def has_blob(self, digest: str) -> bool:
        """Whether the registry's storage holds ``digest`` (for a mirror: it was fetched)."""
        algorithm, _, hexdigest = digest.partition(":")
        blob = (
            self.storage / "docker/registry/v2/blobs" / algorithm / hexdigest[:2] / hexdigest
        ) / "data"
        return blob.is_file()

    def log_tail(self, lines: int = 25) -> str:
        return self._proc.tail(lines)


class StallingRegistry:
    """A registry stand-in on loopback (TLS from the test CA) that serves one image's manifest
    and config, then stalls in the middle of its first layer: the first half of the bytes, then
    nothing until ``stall`` seconds passed or it is stopped (or made ``healthy``). Plays a
    registry or network that hangs mid-blob; the real ``Registry`` cannot."""

    def __init__(
        self,
        ca: CertificateAuthority,
        repository: str,
        tag: str,
        image: oci.Image,
        *,
        stall: float = 120.0,
    ) -> None:
        self.repository = repository
        self.tag = tag
        self.image = image
        self.stall = stall
        #: serve every blob in full (the registry recovered)
        self.healthy = False
        self.stalled = 0  # blob downloads that were cut off
        self._stop = threading.Event()
        serving = ca.issue("stalling-registry", common_name="stalling", server_ips=("127.0.0.1",))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(serving.cert), str(serving.key))
        blobs = {b.digest: b for b in (image.config, *image.layers)}
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, *, body: bool) -> None:
                prefix = f"/v2/{owner.repository}/"
                path = self.path.split("?", 1)[0]
                blob: oci.Blob | None = None
                if path == "/v2/":
                    blob = oci.Blob("application/json", b"{}")
                elif path in (
                    f"{prefix}manifests/{owner.tag}",
                    f"{prefix}manifests/{owner.image.digest}",
                ):
                    blob = owner.image.manifest
                elif path.startswith(f"{prefix}blobs/"):
                    blob = blobs.get(path.rsplit("/", 1)[1])
                if blob is None:
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Type", blob.media_type)
                self.send_header("Content-Length", str(blob.size))
                self.send_header("Docker-Content-Digest", blob.digest)
                self.end_headers()
                if not body:
                    return
                cut = blob in owner.image.layers and not owner.healthy
                if not cut:
                    self.wfile.write(blob.data)
                    return
                owner.stalled += 1
                self.wfile.write(blob.data[: blob.size // 2])
                self.wfile.flush()
                owner._stop.wait(owner.stall)
                self.close_connection = True

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
        self.port = self._server.server_address[1]
        self.host = f"127.0.0.1:{self.port}"
        self.url = f"https://{self.host}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def ref(self) -> str:
        return f"{self.host}/{self.repository}:{self.tag}"

    def recover(self) -> None:
        """Serve everything in full from now on; cut off the stalled downloads."""
        self.healthy = True
        self._stop.set()

    def __enter__(self) -> StallingRegistry:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._server.shutdown()
        self._server.server_close()
