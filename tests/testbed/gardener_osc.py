"""The reconcile OSC of an ordinary containerd worker pool, shaped like the one Gardener generates.

Written from the facts in the design notes (a Gardener v1.150 node, Kubernetes 1.33): the same
unit set and kinds of file, with everything made runnable inside a throwaway node that has no
network: the kubelet binary comes by imageRef from a hyperkube image, the real kubelet
(``push_images(..., kubelet_image=real_kubelet.hyperkube_image)``, run standalone: no API server
to ask, its server port free, no QoS cgroups) or the stand-in, which serves ``/healthz`` only
and ignores the rest of its flags; the log shipper's binary is a shell script from a second test
image, and every other unit runs ``/bin/sleep infinity``, ``/bin/true`` or ``/bin/sh``.

Left out on purpose: the agent's own unit and binary (``gardener-node-agent.service``,
``/opt/bin/gardener-node-agent``); the agent under test is not the one Gardener would install.

``GardenerPool.osc(version)`` builds the document; a patch update (``1.33.0`` → ``1.33.1``)
changes exactly what it changes upstream: the kubelet config file, the hyperkube tag, the agent's
config file (the Kubernetes version in it) and the kubelet unit text.
"""

from __future__ import annotations

import base64
import datetime
import functools
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.testbed import oci, standin
from tests.testbed.containerd import NODE_CA_PATH
from tests.testbed.controlplane import free_port
from tests.testbed.registry import Registry
from tests.testbed.systemd_ns import IsolatedSystemd

KUBELET_BINARY = "/opt/bin/kubelet"
KUBELET_CONFIG = "/var/lib/kubelet/config/kubelet"
KUBELET_CA = "/var/lib/kubelet/ca.crt"
NODE_CA_BUNDLE = "/var/lib/ca-certificates-local/ROOTcerts.crt"
CONTAINERD_ENV = "/etc/containerd/pool.env"
SYSCTL_FILE = "/etc/sysctl.d/99-k8s-general.conf"
LOGROTATE_CONFIG = "/etc/containerd-logrotate.conf"
SHIPPER_BINARY = "/opt/bin/log-shipper"
SHIPPER_CONFIG = "/var/lib/log-shipper/config.yaml"
SHIPPER_KUBECONFIG = "/var/lib/log-shipper/kubeconfig"
SHIPPER_TOKEN = "/var/lib/log-shipper/auth-token"
USER_KEYS = "/var/lib/gardener-user/authorized_keys"
USER_SCRIPT = "/var/lib/gardener-user/run.sh"
AGENT_CONFIG = "/var/lib/gardener-node-agent/config-v1.150.0.yaml"
SANDBOX_IMAGE = "registry.k8s.io/pause:3.10"

KUBELET = "kubelet.service"
#: what the throwaway node's real kubelet needs beside the pool's flags (the host's cgroup
#: hierarchy has no controllers for QoS cgroups; see ``real_kubelet.NO_QOS_CGROUPS``); no
#: kubeconfig: the pool's kubelet runs standalone, serving its /healthz
NO_QOS_CGROUPS = "--cgroups-per-qos=false --enforce-node-allocatable=none"
CONTAINERD = "containerd.service"
SYSCTL = "systemd-sysctl.service"
LOGROTATE = "containerd-logrotate.service"
LOGROTATE_TIMER = "containerd-logrotate.timer"
CA_UPDATE = "updatecacerts.service"
SSH_ENSURER = "sshd-ensurer.service"
SHIPPER = "log-shipper.service"
SHIPPER_HEALTH = "log-shipper-health.service"
SHIPPER_HEALTH_TIMER = "log-shipper-health.timer"
USER = "gardener-user.service"
USER_PATH = "gardener-user.path"

#: every unit of the OSC (containerd.service and systemd-sysctl.service are the distribution's)
UNITS = (
    KUBELET,
    CONTAINERD,
    SYSCTL,
    LOGROTATE,
    LOGROTATE_TIMER,
    CA_UPDATE,
    SSH_ENSURER,
    SHIPPER,
    SHIPPER_HEALTH,
    SHIPPER_HEALTH_TIMER,
    USER,
    USER_PATH,
)


# Not a certificate anyone parses: the bytes only have to be a CA file's shape.
@functools.cache
def pool_ca() -> str:
    """The pool's cluster CA (PEM): a certificate a real kubelet loads as its client CA; one per
    session, no key kept."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node-agent test pool CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=7))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM).decode()


_SHIPPER_SCRIPT = (
    b"#!/bin/sh\n# a stand-in log shipper: runs until it is stopped\nexec /bin/sleep infinity\n"
)


def _plain(path: str, text: str, mode: int) -> dict[str, Any]:
    return {"path": path, "permissions": mode, "content": {"inline": {"data": text}}}


def _b64(path: str, data: bytes, mode: int) -> dict[str, Any]:
    encoded = base64.b64encode(data).decode()
    return {
        "path": path,
        "permissions": mode,
        "content": {"inline": {"encoding": "b64", "data": encoded}},
    }


def _image_file(path: str, image: str, in_image: str, mode: int) -> dict[str, Any]:
    return {
        "path": path,
        "permissions": mode,
        "content": {"imageRef": {"image": image, "filePathInImage": in_image}},
    }


def _unit(name: str, content: str | None = None, **fields: Any) -> dict[str, Any]:
    unit: dict[str, Any] = {"name": name, **fields}
    if content is not None:
        unit["content"] = content
    return unit


@dataclass
class GardenerPool:
    """One worker pool's reconcile OSC against the test registries.

    ``registry`` holds the images, ``mirror`` is the pull-through cache the criConfig routes
    ``registry``'s pulls to (trusted with the test CA at ``NODE_CA_PATH``)."""

    registry: Registry
    mirror: Registry
    hyperkube: str
    """repository of the hyperkube-like images (tag ``v<version>``) in ``registry``"""
    shipper: str
    """repository of the log shipper image (tag ``v1``) in ``registry``"""
    healthz_port: int = 10248
    #: the kubelet's server port (the real kubelet's; the stand-in ignores it)
    server_port: int = 10250
    readiness_probe: bool = True
    digests: dict[str, str] = field(default_factory=dict)

    @classmethod
    def fresh(cls, registry: Registry, mirror: Registry, **options: Any) -> GardenerPool:
        """A pool whose image repositories no other test uses, its kubelet on a free port."""
        suffix = uuid.uuid4().hex[:8]
        return cls(
            registry,
            mirror,
            hyperkube=f"gardener/hyperkube-{suffix}",
            shipper=f"gardener/log-shipper-{suffix}",
            healthz_port=free_port(),
            server_port=free_port(),
            **options,
        )

    # -- images -------------------------------------------------------------------------
    def push_images(
        self,
        versions: tuple[str, ...],
        *,
        kubelet_image: Callable[[str], oci.Image] | None = None,
    ) -> None:
        """The hyperkube image of each version and the log shipper's image, into ``registry``:
        the stand-in kubelet inside, or the image ``kubelet_image(version)`` gives (the real
        kubelet's, ``real_kubelet.hyperkube_image``)."""
        for version in versions:
            if kubelet_image is None:
                image = oci.build_image(standin.kubelet_image_files(f"v{version}"))
            else:
                image = kubelet_image(version)
            self.digests[self.hyperkube_ref(version)] = self.registry.push(
                self.hyperkube, f"v{version}", image
            )
        shipper = oci.build_image({"/log-shipper": (_SHIPPER_SCRIPT, 0o755)})
        self.digests[self.shipper_ref()] = self.registry.push(self.shipper, "v1", shipper)

    def hyperkube_ref(self, version: str) -> str:
        return self.registry.ref(self.hyperkube, f"v{version}")

    def shipper_ref(self) -> str:
        return self.registry.ref(self.shipper, "v1")

    @staticmethod
    def shipper_binary() -> bytes:
        return _SHIPPER_SCRIPT

    # -- the document -------------------------------------------------------------------
    def osc(self, version: str = "1.33.0", *, sandbox_image: str = SANDBOX_IMAGE) -> dict[str, Any]:
        """The reconcile OSC for Kubernetes ``version`` (``1.33.0``)."""
        return {
            "apiVersion": "extensions.gardener.cloud/v1alpha1",
            "kind": "OperatingSystemConfig",
            "metadata": {"name": "pool-a-reconcile", "namespace": "kube-system"},
            "spec": {
                "type": "gardenlinux",
                "purpose": "reconcile",
                "criConfig": self.cri_config(sandbox_image),
                "units": self.units(version),
                "files": self.files(version),
            },
            "status": {"extensionUnits": [self.containerd_extension()]},
        }

    def cri_config(self, sandbox_image: str) -> dict[str, Any]:
        registry = {
            "upstream": self.registry.host,
            "server": self.registry.url,
            "hosts": [
                {
                    "url": self.mirror.url,
                    "capabilities": ["pull", "resolve"],
                    "caCerts": [NODE_CA_PATH],
                }
            ],
            "readinessProbe": self.readiness_probe,
        }
        return {
            "name": "containerd",
            "cgroupDriver": "systemd",
            "containerd": {"sandboxImage": sandbox_image, "registries": [registry]},
        }

    def kubelet_unit_text(self, version: str) -> str:
        # Wants=, not Requires=: a containerd restart must not take kubelet with it.
        return (
            "[Unit]\n"
            "Description=kubelet daemon\n"
            "Documentation=https://kubernetes.io/docs/admin/kubelet\n"
            "Wants=containerd.service\n"
            "After=containerd.service\n"
            "StartLimitIntervalSec=0\n"
            "\n[Service]\n"
            f'Environment="KUBELET_VERSION=v{version}"\n'
            "Restart=always\n"
            "RestartSec=5\n"
            f"ExecStart={KUBELET_BINARY} --config={KUBELET_CONFIG} "
            "--container-runtime-endpoint=unix:///run/containerd/containerd.sock "
            f"--healthz-port={self.healthz_port} --port={self.server_port} --read-only-port=0 "
            f"{NO_QOS_CGROUPS} --v=2\n"
            "\n[Install]\nWantedBy=multi-user.target\n"
        )

    def units(self, version: str) -> list[dict[str, Any]]:
        long_running = "[Service]\nExecStart=/bin/sleep infinity\n"
        oneshot = "[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/true\n"
        install = "\n[Install]\nWantedBy=multi-user.target\n"
        timer_install = "\n[Install]\nWantedBy=timers.target\n"
        # Timers fire an hour after they start: never while a test compares restarts.
        hourly = "[Timer]\nOnActiveSec=1h\nOnUnitActiveSec=1h\n"
        return [
            _unit(
                KUBELET,
                self.kubelet_unit_text(version),
                command="start",
                enable=True,
                filePaths=[KUBELET_CA, KUBELET_CONFIG, KUBELET_BINARY, NODE_CA_BUNDLE],
            ),
            # The distribution's unit: no content, the OSC only names the files it depends on.
            _unit(CONTAINERD, enable=True, filePaths=[CONTAINERD_ENV]),
            _unit(SYSCTL, command="restart", filePaths=[SYSCTL_FILE]),
            _unit(
                LOGROTATE,
                "[Unit]\nDescription=rotate containerd's logs\n\n[Service]\nType=oneshot\n"
                f"ExecStart=/bin/true {LOGROTATE_CONFIG}\n",
                filePaths=[LOGROTATE_CONFIG],
            ),
            _unit(
                LOGROTATE_TIMER,
                "[Unit]\nDescription=rotate containerd's logs regularly\n\n"
                f"{hourly}{timer_install}",
                command="start",
                enable=True,
            ),
            _unit(
                CA_UPDATE,
                f"[Unit]\nDescription=add the node's CA bundle\n\n{oneshot}{install}",
                command="start",
                enable=True,
                filePaths=[NODE_CA_BUNDLE],
            ),
            _unit(
                SSH_ENSURER,
                f"[Unit]\nDescription=keep sshd as configured\n\n{long_running}"
                f"Restart=always\n{install}",
                command="start",
                enable=True,
            ),
            _unit(
                SHIPPER,
                "[Unit]\nDescription=ship the node's logs\n\n[Service]\n"
                f"ExecStart={SHIPPER_BINARY} -config.file={SHIPPER_CONFIG}\n"
                f"Restart=always\nRestartSec=5\n{install}",
                command="start",
                enable=True,
                filePaths=[SHIPPER_BINARY, SHIPPER_CONFIG, SHIPPER_KUBECONFIG],
            ),
            _unit(
                SHIPPER_HEALTH,
                f"[Unit]\nDescription=check the log shipper's health\n\n{oneshot}{install}",
                command="start",
                enable=False,
            ),
            _unit(
                SHIPPER_HEALTH_TIMER,
                "[Unit]\nDescription=check the log shipper regularly\n\n"
                f"{hourly}Unit={SHIPPER_HEALTH}\n{timer_install}",
                command="start",
                enable=True,
            ),
            _unit(
                USER,
                "[Unit]\nDescription=keep the gardener user's ssh keys\n\n[Service]\n"
                f"Type=oneshot\nExecStart=/bin/sh {USER_SCRIPT}\n",
                filePaths=[USER_SCRIPT, USER_KEYS],
            ),
            _unit(
                USER_PATH,
                f"[Unit]\nDescription=watch the gardener user's ssh keys\n\n[Path]\n"
                f"PathChanged={USER_KEYS}\nUnit={USER}\n{install}",
                command="start",
                enable=True,
            ),
        ]

    def containerd_extension(self) -> dict[str, Any]:
        """The OS extension's drop-in for containerd (``status.extensionUnits``)."""
        override = (
            "[Service]\n"
            f"EnvironmentFile=-{CONTAINERD_ENV}\n"
            "LimitMEMLOCK=67108864\n"
            "LimitNOFILE=1048576\n"
        )
        return {"name": CONTAINERD, "dropIns": [{"name": "override.conf", "content": override}]}

    def kubelet_config(self, version: str) -> str:
        doc = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # the pool's kubelet has no API server to ask (standalone, see NO_QOS_CGROUPS)
            "authentication": {"x509": {"clientCAFile": KUBELET_CA}, "webhook": {"enabled": False}},
            "authorization": {"mode": "AlwaysAllow"},
            "cgroupDriver": "systemd",
            "clusterDNS": ["100.64.0.10"],
            "clusterDomain": "cluster.local",
            "containerRuntimeEndpoint": "unix:///run/containerd/containerd.sock",
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "maxPods": 110,
            # What a patch release changes in the generated file: defaults keyed to the version.
            "containerLogMaxFiles": 5 if version.endswith(".0") else 6,
            "serverTLSBootstrap": True,
        }
        return f"# Kubernetes v{version}\n" + yaml.safe_dump(doc, sort_keys=True)

    def agent_config(self, version: str) -> str:
        doc = {
            "apiVersion": "nodeagent.config.gardener.cloud/v1alpha1",
            "kind": "NodeAgentConfiguration",
            "apiServer": {
                "server": "https://api.pool-a.example.invalid",
                "caFile": "/var/lib/gardener-node-agent/cluster-ca.crt",
            },
            "controllers": {
                "operatingSystemConfig": {
                    "secretName": "gardener-node-agent-pool-a",
                    "kubernetesVersion": version,
                    "syncPeriod": "12h",
                },
                "token": {
                    "syncConfigs": [
                        {"secretName": "gardener-log-shipper", "path": SHIPPER_TOKEN},
                    ]
                },
            },
        }
        return yaml.safe_dump(doc, sort_keys=True)

    def files(self, version: str) -> list[dict[str, Any]]:
        shipper_kubeconfig = yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "shoot",
                        "cluster": {
                            "server": "https://api.pool-a.example.invalid",
                            "certificate-authority": KUBELET_CA,
                        },
                    }
                ],
                "users": [{"name": "log-shipper", "user": {"tokenFile": SHIPPER_TOKEN}}],
                "contexts": [
                    {"name": "shoot", "context": {"cluster": "shoot", "user": "log-shipper"}}
                ],
                "current-context": "shoot",
            },
            sort_keys=True,
        )
        return [
            _b64(KUBELET_CA, pool_ca().encode(), 0o644),
            _plain(KUBELET_CONFIG, self.kubelet_config(version), 0o644),
            _image_file(KUBELET_BINARY, self.hyperkube_ref(version), "/kubelet", 0o755),
            _plain(NODE_CA_BUNDLE, pool_ca(), 0o644),
            _plain(CONTAINERD_ENV, "CONTAINERD_POOL=pool-a\n", 0o644),
            _plain(SYSCTL_FILE, "kernel.msgmax = 65536\nkernel.msgmnb = 65536\n", 0o644),
            _plain(LOGROTATE_CONFIG, "/var/log/pods/*/*/*.log {\n  rotate 14\n  daily\n}\n", 0o644),
            _image_file(SHIPPER_BINARY, self.shipper_ref(), "/log-shipper", 0o700),
            _b64(SHIPPER_CONFIG, b"server:\n  disable: true\nclients: []\n", 0o644),
            _plain(SHIPPER_KUBECONFIG, shipper_kubeconfig, 0o600),
            _b64(USER_KEYS, b"ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAtest gardener\n", 0o400),
            _plain(USER_SCRIPT, "#!/bin/sh\n# keys are in place already\nexit 0\n", 0o755),
            _plain(AGENT_CONFIG, self.agent_config(version), 0o600),
        ]


# -- the node -----------------------------------------------------------------------------------


def unmask(node: IsolatedSystemd, *units: str) -> None:
    """Lift the test bed's masks of distribution units the OSC drives (systemd-sysctl.service).

    Safe inside the throwaway node: ``/proc/sys`` is read-only there, so systemd-sysctl's own
    condition (``/proc/sys/net/`` writable) skips its work; the unit still starts each time."""
    for unit in units:
        node.path(f"/run/systemd/system/{unit}").unlink(missing_ok=True)
    node.run(["systemctl", "daemon-reload"])


@dataclass(frozen=True)
class UnitMark:
    """What tells one start of a unit from the next.

    ``invocation`` is systemd's InvocationID (a new one per activation); ``tested`` the
    monotonic time its start conditions were last checked, which moves on every start job,
    also for a unit whose condition skips it (then it has no InvocationID at all)."""

    invocation: str
    tested: str
    active: str
    sub: str
    enabled: str


def unit_marks(node: IsolatedSystemd, units: tuple[str, ...] = UNITS) -> dict[str, UnitMark]:
    props = "Id,InvocationID,ConditionTimestampMonotonic,ActiveState,SubState,UnitFileState"
    out = node.run(["systemctl", "show", "-p", props, *units]).stdout
    marks: dict[str, UnitMark] = {}
    for block in out.strip().split("\n\n"):
        values = dict(line.split("=", 1) for line in block.splitlines() if "=" in line)
        marks[values["Id"]] = UnitMark(
            values.get("InvocationID", ""),
            values.get("ConditionTimestampMonotonic", ""),
            values.get("ActiveState", ""),
            values.get("SubState", ""),
            values.get("UnitFileState", ""),
        )
    missing = set(units) - set(marks)
    if missing:
        raise subprocess.SubprocessError(f"systemctl show gave nothing for {sorted(missing)}")
    return marks


def started_again(before: dict[str, UnitMark], after: dict[str, UnitMark]) -> set[str]:
    """The units that were started (or restarted) between two ``unit_marks``."""
    return {
        name
        for name, mark in before.items()
        if (after[name].invocation, after[name].tested) != (mark.invocation, mark.tested)
    }
