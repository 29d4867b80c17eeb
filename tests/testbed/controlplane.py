"""A real kube-apiserver and etcd on loopback, for tests and the demo.

The binaries are built from their Go modules by ``build-controlplane.sh`` (cached by
version). Each instance gets random free ports, fresh certificates, its own etcd data
directory, and runs with ``--authorization-mode=Node,RBAC`` so that a node agent's
least-privilege credentials are checked for real. Bootstrap tokens authenticate, and on
request a kube-controller-manager runs beside it with only the controllers the certificate
flow needs: it signs ``kubernetes.io/kube-apiserver-client`` CSRs with the test CA and
removes expired bootstrap tokens.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.testbed.pki import CertificateAuthority, CertPair, service_account_keys
from tests.testbed.systemd_ns import HarnessError

BUILD_SCRIPT = Path(__file__).with_name("build-controlplane.sh")
START_TIMEOUT = 90.0
#: where a bed VM reaches the host's loopback services (QEMU user networking forwards this
#: address's ports to them, ``tests/testbed/vm.py``): the servers' certificates name it too
GUEST_ALIAS = "10.0.2.100"
# What the certificate flow needs of kube-controller-manager: the CSR signer, the bootstrap
# token cleaner, and the cleaner of old CSRs (harmless: it only removes CSRs hours old).
# The kubelet's own bootstrap adds the approver of kubelet client CSRs (Gardener's bindings let
# bootstrap tokens and nodes ask for them: ``bootstrap.allow_kubelet_bootstrap``).
KCM_CONTROLLERS = ("csrsigning", "csrapproving", "tokencleaner", "csrcleaner")


def _thread_stopped(task: Path) -> bool:
    """Whether a thread (/proc/<pid>/task/<tid>) is stopped by a signal, or gone."""
    try:
        stat = (task / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def binaries_dir(module: str = "controlplane", arch: str = "amd64") -> Path:
    """Build (or reuse from the cache) the bed's binaries of ``module``: ``controlplane``
    (kube-apiserver, kube-controller-manager, etcd) or ``kubelet-<version>`` (for ``arch``:
    amd64, or arm64 for the emulated arm64 node); return their directory."""
    result = subprocess.run(
        ["sh", str(BUILD_SCRIPT), module, arch],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if result.returncode != 0:
        raise HarnessError(f"building the test bed's {module} failed:\n{result.stderr[-4000:]}")
    return Path(result.stdout.strip().splitlines()[-1])


def write_kubeconfig(
    path: Path,
    *,
    server: str,
    ca_file: Path,
    user: dict[str, str],
    name: str = "test",
) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": name, "cluster": {"server": server, "certificate-authority": str(ca_file)}}
        ],
        "users": [{"name": name, "user": user}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclass
class _Proc:
    name: str
    argv: list[str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def running(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self, timeout: float = 15.0) -> None:
        if self.popen is None:
            return
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, signal.SIGCONT)
                os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=timeout)
        self.popen = None

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class ControlPlane:
    """etcd + kube-apiserver, with knobs tests use to break them on purpose."""

    def __init__(self, workdir: Path, bin_dir: Path | None = None) -> None:
        self.workdir = workdir
        self.controller_manager: _Proc | None = None
        self.controller_manager_port = 0
        self.bin_dir = bin_dir or binaries_dir()
        workdir.mkdir(parents=True, exist_ok=True)
        pki_dir = workdir / "pki"
        self.ca = CertificateAuthority(pki_dir)
        self.ca_file = self.ca.cert_path
        self.etcd_port, peer_port, self.port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        serving = self.ca.issue(
            "apiserver",
            common_name="kube-apiserver",
            server_ips=("127.0.0.1", GUEST_ALIAS),
            server_dns=("localhost", "kubernetes", "kubernetes.default.svc"),
        )
        self.admin: CertPair = self.ca.issue(
            "admin", common_name="test-admin", organizations=("system:masters",), client=True
        )
        sa = service_account_keys(pki_dir)
        self.admin_kubeconfig = write_kubeconfig(
            workdir / "admin.kubeconfig",
            server=self.server,
            ca_file=self.ca_file,
            user={"client-certificate": str(self.admin.cert), "client-key": str(self.admin.key)},
        )
        peer = f"http://127.0.0.1:{peer_port}"
        self.etcd = _Proc(
            "etcd",
            [
                str(self.bin_dir / "etcd"),
                "--name=test",
                f"--data-dir={workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
            workdir / "etcd.log",
        )
        self.apiserver = _Proc(
            "kube-apiserver",
            [
                str(self.bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                "--endpoint-reconciler-type=none",
                f"--secure-port={self.port}",
                f"--cert-dir={workdir / 'apiserver-certs'}",
                f"--tls-cert-file={serving.cert}",
                f"--tls-private-key-file={serving.key}",
                f"--client-ca-file={self.ca_file}",
                "--enable-bootstrap-token-auth",
                "--authorization-mode=Node,RBAC",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={sa.cert}",
                f"--service-account-signing-key-file={sa.key}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--profiling=false",
                "--v=1",
            ],
            workdir / "kube-apiserver.log",
        )

    # -- life cycle -------------------------------------------------------------------
    def start(self) -> None:
        try:
            self.etcd.start()
            self._wait(self._etcd_healthy, "etcd", self.etcd)
            self.start_apiserver()
        except BaseException:
            self.stop()
            raise

    def start_apiserver(self, timeout: float = START_TIMEOUT) -> None:
        self.apiserver.start()
        self._wait(self._apiserver_ready, "kube-apiserver", self.apiserver, timeout)

    def stop_apiserver(self) -> None:
        self.apiserver.stop()

    def kill_apiserver(self) -> None:
        """SIGKILL, as a crash would."""
        if self.apiserver.popen is not None:
            self.apiserver.popen.kill()
            self.apiserver.popen.wait(timeout=10)
            self.apiserver.popen = None

    def freeze_apiserver(self, timeout: float = 5.0) -> None:
        """SIGSTOP kube-apiserver, and return once every one of its threads has stopped: kill()
        returns before a thread running on another core has taken the signal, and such a thread
        could still answer a request sent right after."""
        assert self.apiserver.popen is not None
        pid = self.apiserver.popen.pid
        os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while not all(_thread_stopped(t) for t in Path(f"/proc/{pid}/task").iterdir()):
            if time.monotonic() > deadline:
                raise HarnessError(f"kube-apiserver (pid {pid}) did not stop within {timeout}s")
            time.sleep(0.01)

    def thaw_apiserver(self) -> None:
        assert self.apiserver.popen is not None
        os.kill(self.apiserver.popen.pid, signal.SIGCONT)

    def start_controller_manager(
        self,
        *,
        signing_duration: str = "720h",
        controllers: tuple[str, ...] = KCM_CONTROLLERS,
        timeout: float = START_TIMEOUT,
    ) -> None:
        """Start kube-controller-manager against this API server (admin credentials).

        It signs ``kubernetes.io/kube-apiserver-client`` CSRs with the test CA. A signed
        certificate lasts min(spec.expirationSeconds, ``signing_duration``); the API refuses
        expirationSeconds below 600, so a shorter certificate for rotation tests must come
        from ``signing_duration`` (a Go duration such as ``"90s"``). Note that the signer
        backdates notBefore by 5 minutes. Stopped with the control plane.
        """
        if self.controller_manager is not None and self.controller_manager.running():
            raise HarnessError("kube-controller-manager is already running")
        port = free_port()
        self.controller_manager_port = port
        kubeconfig = str(self.admin_kubeconfig)
        self.controller_manager = _Proc(
            "kube-controller-manager",
            [
                str(self.bin_dir / "kube-controller-manager"),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                f"--controllers={','.join(controllers)}",
                f"--cluster-signing-kube-apiserver-client-cert-file={self.ca_file}",
                f"--cluster-signing-kube-apiserver-client-key-file={self.ca.key_path}",
                f"--cluster-signing-kubelet-client-cert-file={self.ca_file}",
                f"--cluster-signing-kubelet-client-key-file={self.ca.key_path}",
                f"--cluster-signing-duration={signing_duration}",
                "--use-service-account-credentials=false",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                f"--cert-dir={self.workdir / 'controller-manager-certs'}",
                "--profiling=false",
                "--v=1",
            ],
            self.workdir / "kube-controller-manager.log",
        )
        self.controller_manager.start()
        try:
            self._wait(
                self._controller_manager_healthy,
                "kube-controller-manager",
                self.controller_manager,
                timeout,
            )
        except BaseException:
            self.stop_controller_manager()
            raise

    def stop_controller_manager(self) -> None:
        if self.controller_manager is not None:
            self.controller_manager.stop()

    def restart_controller_manager(self, *, signing_duration: str = "720h") -> None:
        """Run kube-controller-manager again, e.g. with a shorter certificate duration."""
        self.stop_controller_manager()
        self.start_controller_manager(signing_duration=signing_duration)

    def stop(self) -> None:
        self.stop_controller_manager()
        self.apiserver.stop()
        self.etcd.stop()

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- readiness --------------------------------------------------------------------
    def _wait(self, probe: object, what: str, proc: _Proc, timeout: float = START_TIMEOUT) -> None:
        assert callable(probe)
        deadline = time.monotonic() + timeout
        while not probe():
            if not proc.running():
                raise HarnessError(f"{what} exited during start-up; log tail:\n{proc.tail()}")
            if time.monotonic() > deadline:
                raise HarnessError(
                    f"{what} not ready within {timeout:.0f}s; log tail:\n{proc.tail()}"
                )
            time.sleep(0.1)

    def _etcd_healthy(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.etcd_port}/health", timeout=2
            ) as resp:
                return bool(json.load(resp).get("health") == "true")
        except (OSError, ValueError):
            return False

    def admin_ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
        ctx.load_cert_chain(str(self.admin.cert), str(self.admin.key))
        return ctx

    def get(self, path: str, timeout: float = 3.0) -> tuple[int, bytes]:
        """A raw admin GET, for probes that must not depend on the code under test."""
        try:
            with urllib.request.urlopen(
                self.server + path, context=self.admin_ssl_context(), timeout=timeout
            ) as resp:
                return int(resp.status), bytes(resp.read())
        except urllib.error.HTTPError as err:
            return int(err.code), bytes(err.read())

    def _controller_manager_healthy(self) -> bool:
        # Its serving certificate is self-signed (no verification); /healthz needs no login.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        url = f"https://127.0.0.1:{self.controller_manager_port}/healthz"
        try:
            with urllib.request.urlopen(url, context=ctx, timeout=2) as resp:
                return bool(resp.status == 200)
        except (OSError, urllib.error.HTTPError):
            return False

    def _apiserver_ready(self) -> bool:
        try:
            status, _ = self.get("/readyz")
            if status != 200:
                return False
            status, _ = self.get("/api/v1/namespaces/kube-system")
            return status == 200
        except OSError:
            return False
