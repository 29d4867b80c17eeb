"""What Gardener's own code sends to a worker node, for the tests to feed to the agent.

``gardener-gen`` (``gardener/main.go``, built by ``build-gardener.sh`` together with upstream
gardener-node-agent, for each release of ``gardener/releases``) runs Gardener's
OperatingSystemConfig component and its gardener-node-agent
Secret for one named pool shape. Hand-written fixtures only look like Gardener's output; this is
it, down to the Go zero values and the machine-controller-manager machine name.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.testbed.systemd_ns import HarnessError

BUILD_SCRIPT = Path(__file__).with_name("build-gardener.sh")
RELEASES_FILE = Path(__file__).parent / "gardener" / "releases"


def _releases() -> tuple[str, ...]:
    lines = (line.strip() for line in RELEASES_FILE.read_text().splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


#: the Gardener releases the bed serves, oldest first (``gardener/releases``, one a line)
RELEASES = _releases()
OLDEST, NEWEST = RELEASES[0], RELEASES[-1]
#: what NODE_AGENT_GARDENER_RELEASES selects: ``all`` (``make compat``), a comma-separated list,
#: or, unset, the oldest and the newest (``make test``)
RELEASES_ENV = "NODE_AGENT_GARDENER_RELEASES"


def _tested_releases() -> tuple[str, ...]:
    chosen = os.environ.get(RELEASES_ENV, "").strip()
    if chosen == "all":
        return RELEASES
    if not chosen:
        return tuple(dict.fromkeys((OLDEST, NEWEST)))
    picked = tuple(r.strip() for r in chosen.split(",") if r.strip())
    unknown = [r for r in picked if r not in RELEASES]
    if unknown:
        raise ValueError(f"{RELEASES_ENV}: {', '.join(unknown)} not in {RELEASES_FILE.name}")
    return picked


#: the releases the per-release integration tests run
TESTED_RELEASES = _tested_releases()
#: the releases the differential twin runs (about 6 minutes each): the newest unless
#: NODE_AGENT_GARDENER_RELEASES chooses
TWIN_RELEASES = TESTED_RELEASES if os.environ.get(RELEASES_ENV, "").strip() else (NEWEST,)

#: the pool shapes gardener-gen knows, in the order of a rollout where it matters:
#: a Kubernetes patch update keeps the Secret's name, a minor update changes it
SHAPES = (
    "k8s-1.33",
    "k8s-1.33-patch",
    "k8s-1.34",
    "k8s-1.34-patch",
    "mirrors",
    "kubelet-config",
    "inplace",
    "serial",
)


@dataclass(frozen=True)
class ProvisionFile:
    """One file of the provision (user-data) OSC as cloud-init writes it."""

    path: str
    permissions: int | None
    content: str
    image: str


@dataclass(frozen=True)
class Generated:
    """gardener-gen's output for one shape."""

    shape: str
    gardener_version: str
    machine_name: str
    #: the gardener-node-agent Secret as a Kubernetes manifest (``data`` base64-encoded)
    secret: dict[str, Any]
    #: ``data["osc.yaml"]`` of that Secret, as Gardener encoded it
    osc_yaml: str
    #: the reconcile OperatingSystemConfig the Secret was made from (with the extension's status)
    reconcile_osc: dict[str, Any]
    #: ``/var/lib/gardener-node-agent/config-<gardener version>.yaml`` and its text
    config_path: str
    config: str
    init_script: str
    provision_files: tuple[ProvisionFile, ...]
    provision_units: tuple[dict[str, Any], ...]
    #: the provision OSC as a machine's user data (a bash script, as provider-local's OS
    #: extension renders it), machine name and bootstrap token filled in
    user_data: str

    @property
    def secret_name(self) -> str:
        return str(self.secret["metadata"]["name"])

    @property
    def osc(self) -> dict[str, Any]:
        doc: dict[str, Any] = yaml.safe_load(self.osc_yaml)
        return doc


@functools.cache
def binaries_dir(release: str = NEWEST) -> Path:
    """Build (or reuse from the cache) gardener-gen and gardener-node-agent of ``release``;
    their directory."""
    if release not in RELEASES:
        raise ValueError(f"unknown Gardener release {release!r}; served: {', '.join(RELEASES)}")
    result = subprocess.run(
        ["sh", str(BUILD_SCRIPT), release],
        capture_output=True,
        text=True,
        timeout=3600,
        check=False,
    )
    if result.returncode != 0:
        raise HarnessError(
            f"building Gardener {release}'s test binaries failed:\n{result.stderr[-4000:]}"
        )
    return Path(result.stdout.strip().splitlines()[-1])


def gardener_node_agent(release: str = NEWEST) -> Path:
    """Upstream gardener-node-agent of ``release`` (default: the newest the bed serves)."""
    return binaries_dir(release) / "gardener-node-agent"


def generate(
    shape: str,
    *,
    machine_name: str = "",
    api_server: str = "",
    ca_file: Path | None = None,
    bootstrap_token: str = "",
    release: str = NEWEST,
    in_place: bool = False,
    image_version: str = "",
    kubelet_data_volume: str = "",
    architecture: str = "",
) -> Generated:
    """Gardener ``release``'s output for ``shape``; empty arguments take gardener-gen's test
    values. ``in_place`` makes any shape's pool update in place, ``image_version`` is its
    machine image's (the OS version an in-place pool updates to), ``kubelet_data_volume`` the
    size of the pool's data volume for the kubelet (a quantity such as ``1Gi``),
    ``architecture`` its machines' (``amd64``, the default, or ``arm64``).

    With the test values (no arguments), the result is kept next to the binaries (the
    generator is deterministic), so a session runs it once per shape; a run with a test's own
    machine, token or CA (unique each time) is not kept.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    args = [f"--shape={shape}"]
    if machine_name:
        args.append(f"--machine-name={machine_name}")
    if api_server:
        args.append(f"--api-server={api_server}")
    if ca_file is not None:
        args.append(f"--ca-file={ca_file}")
    if bootstrap_token:
        args.append(f"--bootstrap-token={bootstrap_token}")
    if in_place:
        args.append("--in-place")
    if image_version:
        args.append(f"--image-version={image_version}")
    if kubelet_data_volume:
        args.append(f"--kubelet-data-volume={kubelet_data_volume}")
    if architecture:
        args.append(f"--architecture={architecture}")
    binaries = binaries_dir(release)
    cached = binaries / "generated" / f"{shape}.json" if len(args) == 1 else None
    if cached is not None and cached.exists():
        return _parse(json.loads(cached.read_text()))
    result = subprocess.run(
        [str(binaries / "gardener-gen"), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise HarnessError(f"gardener-gen {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    raw = result.stdout
    if cached is not None:
        cached.parent.mkdir(exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(raw)
        tmp.replace(cached)
    return _parse(json.loads(raw))


def _parse(doc: dict[str, Any]) -> Generated:
    secret = doc["secret"]
    osc_yaml = str(secret["data"]["osc.yaml"])
    manifest = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": secret["name"],
            "namespace": secret["namespace"],
            "labels": dict(secret.get("labels") or {}),
            "annotations": dict(secret.get("annotations") or {}),
        },
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in secret["data"].items()},
    }
    return Generated(
        shape=doc["shape"],
        gardener_version=doc["gardenerVersion"],
        machine_name=doc["machineName"],
        secret=manifest,
        osc_yaml=osc_yaml,
        reconcile_osc=doc["reconcileOSC"],
        config_path=doc["configPath"],
        config=doc["config"],
        init_script=doc["initScript"],
        provision_files=tuple(
            ProvisionFile(
                path=f["path"],
                permissions=f.get("permissions"),
                content=f.get("content", ""),
                image=f.get("image", ""),
            )
            for f in doc["provisionFiles"]
        ),
        provision_units=tuple(doc["provisionUnits"]),
        user_data=doc["userData"],
    )
