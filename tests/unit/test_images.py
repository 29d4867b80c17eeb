"""imageRef files: ``CtrImages`` against a fake ``ctr``, and the executor with a fake store."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.apply.applier import Applier
from node_agent.apply.executor import ApplyReport
from node_agent.base.digest import sha256_hex
from node_agent.base.errors import ApplyError, ImageError
from node_agent.containerd.images import (
    CtrImages,
    ctr_reason,
    normalize_reference,
    parse_images_ls,
    resolve_in_image,
)
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.osc import plan
from node_agent.osc.decode import parse_osc
from tests.unit.fakes import FakeSystemd

HOST = "node-a"
AGENT_UNIT = "node-agent-under-test.service"
DIGEST = "sha256:" + "ab" * 32

# --- pure logic ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("image", "expected"),
    [
        ("nginx", "docker.io/library/nginx:latest"),
        ("nginx:1.27", "docker.io/library/nginx:1.27"),
        ("gardener/hyperkube:v1.33.1", "docker.io/gardener/hyperkube:v1.33.1"),
        ("docker.io/nginx", "docker.io/library/nginx:latest"),
        ("docker.io/gardener/x:v1", "docker.io/gardener/x:v1"),
        ("localhost/x", "localhost/x:latest"),
        ("127.0.0.1:5000/test/kubelet:v1", "127.0.0.1:5000/test/kubelet:v1"),
        ("registry:5000/a/b", "registry:5000/a/b:latest"),
        (
            "europe-docker.pkg.dev/gardener-project/releases/hyperkube@" + DIGEST,
            "europe-docker.pkg.dev/gardener-project/releases/hyperkube@" + DIGEST,
        ),
        ("r.example/h:v1@" + DIGEST, "r.example/h:v1@" + DIGEST),
    ],
)
def test_references_are_qualified_as_ctr_needs_them(image: str, expected: str) -> None:
    assert normalize_reference(image) == expected


LISTING = f"""\
REF                              TYPE                                       DIGEST  SIZE    PLATFORMS   LABELS
127.0.0.1:5000/test/kube:v1      application/vnd.oci.image.manifest.v1+json {DIGEST} 2.0 MiB linux/amd64 -
127.0.0.1:5000/test/kube:v10     application/vnd.oci.image.manifest.v1+json sha256:{"cd" * 32} 2.0 MiB linux/amd64 -
"""  # noqa: E501


def test_images_ls_digest_of_the_exact_reference() -> None:
    assert parse_images_ls(LISTING, "127.0.0.1:5000/test/kube:v1") == DIGEST
    assert parse_images_ls(LISTING, "127.0.0.1:5000/test/kube:v10") == "sha256:" + "cd" * 32
    assert parse_images_ls(LISTING, "127.0.0.1:5000/test/kube") is None
    assert parse_images_ls("REF TYPE DIGEST SIZE PLATFORMS LABELS\n", "x") is None


def test_ctr_reason_is_its_last_error_line() -> None:
    stderr = (
        'time="2026" level=info msg="trying next host"\n'
        'ctr: failed to resolve reference "r/x:v9": r/x:v9: not found\n'
    )
    assert ctr_reason(stderr) == 'failed to resolve reference "r/x:v9": r/x:v9: not found'
    assert ctr_reason("", "only stdout\n") == "only stdout"
    assert ctr_reason("") == "no output"
    assert len(ctr_reason("ctr: " + "x" * 1000)) == 300


def test_symlinks_resolve_inside_the_image(tmp_path: Path) -> None:
    top = tmp_path / "image"
    (top / "usr/bin").mkdir(parents=True)
    (top / "usr/bin/kubelet").write_bytes(b"image kubelet")
    (top / "kubelet").symlink_to("/usr/bin/kubelet")  # absolute: the image's, not the host's
    (top / "rel").symlink_to("usr/bin/../bin/kubelet")
    (top / "up").symlink_to("../../../../etc/passwd")
    (top / "etc").mkdir()
    (top / "etc/passwd").write_bytes(b"image passwd")
    (top / "loop").symlink_to("loop")

    assert resolve_in_image(top, "/kubelet") == top / "usr/bin/kubelet"
    assert resolve_in_image(top, "rel") == top / "usr/bin/kubelet"
    assert resolve_in_image(top, "/up").read_bytes() == b"image passwd"
    assert resolve_in_image(top, "/../../etc/passwd") == top / "etc/passwd"
    with pytest.raises(OSError, match="symbolic links"):
        resolve_in_image(top, "/loop")
    with pytest.raises(FileNotFoundError):
        resolve_in_image(top, "/missing/kubelet")


# --- CtrImages against a fake ctr ----------------------------------------------------------------

FAKE_CTR = """\
#!{python}
# A fake ctr: logs its argv; pull/ls/mount/unmount behave as configured by the test.
import json, os, shutil, sys, time
state = json.load(open(os.environ["FAKE_CTR_STATE"]))
with open(os.environ["FAKE_CTR_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
args = sys.argv[1:]
assert args[0] == "-n", args
ns, cmd = args[1], args[2:]
root = os.environ.get("FAKE_NODE_ROOT", "")  # set when "inside the node": node paths
if cmd[:2] == ["images", "pull"]:
    if state.get("pull_sleep"):
        time.sleep(state["pull_sleep"])
    if state.get("pull_error"):
        print('time="x" level=info msg="trying next host"', file=sys.stderr)
        print("ctr: " + state["pull_error"], file=sys.stderr)
        sys.exit(1)
    print("done")
elif cmd[:2] == ["images", "ls"]:
    print("REF TYPE DIGEST SIZE PLATFORMS LABELS")
    for ref, digest in state.get("images", {{}}).items():
        print(f"{{ref}} application/vnd.oci.image.manifest.v1+json {{digest}} 1.0MiB linux/amd64 -")
elif cmd[:2] == ["images", "mount"]:
    ref, target = cmd[2], root + cmd[3]
    if not os.path.isdir(target):
        print(f"ctr: {{target}}: no such directory", file=sys.stderr)
        sys.exit(1)
    shutil.copytree(state["contents"], target, symlinks=True, dirs_exist_ok=True)
elif cmd[:3] == ["images", "unmount", "--rm"]:
    target = root + cmd[3]
    for name in os.listdir(target):
        path = os.path.join(target, name)
        shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
else:
    print("ctr: unexpected " + " ".join(cmd), file=sys.stderr)
    sys.exit(2)
"""


class FakeCtr:
    def __init__(self, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir = tmp / "fake-ctr"
        self.dir.mkdir()
        self.path = self.dir / "ctr"
        self.path.write_text(FAKE_CTR.format(python=sys.executable))
        self.path.chmod(0o755)
        self.state_file = self.dir / "state.json"
        self.log = self.dir / "log.jsonl"
        self.contents = tmp / "image-contents"
        self.contents.mkdir()
        self.state: dict[str, Any] = {"contents": str(self.contents), "images": {}}
        self.save()
        monkeypatch.setenv("FAKE_CTR_STATE", str(self.state_file))
        monkeypatch.setenv("FAKE_CTR_LOG", str(self.log))
        monkeypatch.setenv("PATH", f"{self.dir}{os.pathsep}{os.environ['PATH']}")

    def save(self) -> None:
        self.state_file.write_text(json.dumps(self.state))

    def set(self, **kw: Any) -> None:
        self.state.update(kw)
        self.save()

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def fake_ctr(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCtr:
    monkeypatch.delenv("CONTAINERD_NAMESPACE", raising=False)
    return FakeCtr(tmp_path, monkeypatch)


REF = "registry.example:5000/hyperkube:v1.33.1"


async def test_pull_uses_certs_d_and_returns_the_listed_digest(
    fake_ctr: FakeCtr, tmp_path: Path
) -> None:
    fake_ctr.set(images={REF: DIGEST, REF + "0": "sha256:" + "00" * 32})
    images = CtrImages(root=tmp_path / "root")
    assert await images.pull(REF) == DIGEST
    hosts_dir = str(tmp_path / "root/etc/containerd/certs.d")  # ctr shares the agent's view
    assert fake_ctr.calls() == [
        ["-n", "default", "images", "pull", "--hosts-dir", hosts_dir, REF],
        ["-n", "default", "images", "ls"],
    ]


async def test_namespace_from_the_environment(
    fake_ctr: FakeCtr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONTAINERD_NAMESPACE", "k8s.io")
    fake_ctr.set(images={"docker.io/library/busybox:latest": DIGEST})
    assert await CtrImages(root=tmp_path).pull("busybox") == DIGEST
    assert {tuple(c[:2]) for c in fake_ctr.calls()} == {("-n", "k8s.io")}
    assert fake_ctr.calls()[0][-1] == "docker.io/library/busybox:latest"


async def test_pull_failure_names_the_image_and_ctrs_reason(
    fake_ctr: FakeCtr, tmp_path: Path
) -> None:
    fake_ctr.set(pull_error=f'failed to resolve reference "{REF}": {REF}: not found')
    with pytest.raises(ImageError) as err:
        await CtrImages(root=tmp_path).pull(REF)
    assert str(err.value) == (
        f'image {REF}: pull failed: failed to resolve reference "{REF}": {REF}: not found'
    )
    assert err.value.image == REF
    assert "\n" not in str(err.value)


async def test_pulled_image_missing_from_the_listing_is_an_error(
    fake_ctr: FakeCtr, tmp_path: Path
) -> None:
    with pytest.raises(ImageError, match="containerd does not list"):
        await CtrImages(root=tmp_path).pull(REF)


async def test_hung_ctr_is_killed_at_its_limit(fake_ctr: FakeCtr, tmp_path: Path) -> None:
    fake_ctr.set(pull_sleep=30, images={REF: DIGEST})
    with pytest.raises(ImageError, match=r"pull: ctr did not finish within 0s"):
        await CtrImages(root=tmp_path, pull_timeout=0.3).pull(REF)


async def test_missing_ctr_is_an_image_error(tmp_path: Path) -> None:
    images = CtrImages(root=tmp_path, ctr=str(tmp_path / "no-such-ctr"))
    with pytest.raises(ImageError, match="cannot run"):
        await images.pull(REF)


async def test_read_file_mounts_reads_and_unmounts(fake_ctr: FakeCtr, tmp_path: Path) -> None:
    (fake_ctr.contents / "usr/local/bin").mkdir(parents=True)
    (fake_ctr.contents / "usr/local/bin/kubelet").write_bytes(b"\x7fELF kubelet")
    (fake_ctr.contents / "kubelet").symlink_to("/usr/local/bin/kubelet")
    root = tmp_path / "root"
    images = CtrImages(root=root)

    assert await images.read_file(REF, "/kubelet") == b"\x7fELF kubelet"

    mount, unmount = fake_ctr.calls()
    base = root / "run/node-agent/image-mounts"
    assert mount[:4] == ["-n", "default", "images", "mount"]
    assert mount[4] == REF
    assert Path(mount[5]).parent == base
    assert unmount == ["-n", "default", "images", "unmount", "--rm", mount[5]]
    assert list(base.iterdir()) == []  # the mount point is gone again
    assert stat.S_IMODE(base.stat().st_mode) == 0o700


async def test_inside_the_node_ctr_gets_node_paths(
    fake_ctr: FakeCtr, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a prefix, ctr runs inside the node: it is handed the node's paths, and the agent
    reads the mounted file through the node's root."""
    (fake_ctr.contents / "kubelet").write_bytes(b"kubelet in the node")
    fake_ctr.set(images={REF: DIGEST})
    node_root = tmp_path / "node"
    prefix = ["env", f"FAKE_NODE_ROOT={node_root}"]
    images = CtrImages(root=node_root, argv_prefix=prefix)

    assert await images.pull(REF) == DIGEST
    assert await images.read_file(REF, "kubelet") == b"kubelet in the node"
    pull, _ls, mount, _unmount = fake_ctr.calls()
    assert pull[4:6] == ["--hosts-dir", "/etc/containerd/certs.d"]
    assert mount[5].startswith("/run/node-agent/image-mounts/mount-")
    assert images.argv("version") == [*prefix, "ctr", "-n", "default", "version"]


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/no/kubelet", "/no/kubelet is not in the image"),
        ("/bin", "/bin is not a regular file in the image"),
        ("/dangling", "/dangling is not in the image"),
    ],
)
async def test_bad_file_path_in_image(
    fake_ctr: FakeCtr, tmp_path: Path, path: str, reason: str
) -> None:
    (fake_ctr.contents / "bin").mkdir()
    (fake_ctr.contents / "dangling").symlink_to("/nowhere")
    with pytest.raises(ImageError) as err:
        await CtrImages(root=tmp_path).read_file(REF, path)
    assert str(err.value) == f"image {REF}: {reason}"
    assert fake_ctr.calls()[-1][2:5] == ["images", "unmount", "--rm"]  # unmounted all the same


async def test_file_over_the_size_limit(fake_ctr: FakeCtr, tmp_path: Path) -> None:
    (fake_ctr.contents / "big").write_bytes(b"x" * 100)
    with pytest.raises(ImageError, match="100 bytes, over the limit of 99"):
        await CtrImages(root=tmp_path, max_file_size=99).read_file(REF, "/big")


async def test_failed_mount_is_an_image_error(fake_ctr: FakeCtr, tmp_path: Path) -> None:
    # Inside a node whose root the fake cannot find the mount point under: mount fails.
    prefix = ["env", f"FAKE_NODE_ROOT={tmp_path / 'elsewhere'}"]
    images = CtrImages(root=tmp_path / "node", argv_prefix=prefix)
    with pytest.raises(ImageError, match=r"^image .*: mount failed: .*no such directory$"):
        await images.read_file(REF, "/kubelet")
    assert [c[3] for c in fake_ctr.calls()] == ["mount"]  # nothing mounted, nothing to unmount


# --- the executor with a fake image store --------------------------------------------------------


class FakeImages:
    """Images by reference: ``{image: (digest, {path: bytes})}``; a string is a pull error."""

    def __init__(self) -> None:
        self.images: dict[str, tuple[str, dict[str, bytes]] | str] = {}
        self.pulls: list[str] = []

    async def pull(self, image: str) -> str:
        self.pulls.append(image)
        entry = self.images.get(image)
        if entry is None:
            raise ImageError(image, "pull failed: not found")
        if isinstance(entry, str):
            raise ImageError(image, f"pull failed: {entry}")
        return entry[0]

    async def read_file(self, image: str, path_in_image: str) -> bytes:
        entry = self.images[image]
        assert not isinstance(entry, str)
        if path_in_image not in entry[1]:
            raise ImageError(image, f"{path_in_image} is not in the image")
        return entry[1][path_in_image]


KUBELET = b"\x7fELF kubelet v1.33.1"
UNIT = "[Service]\nExecStart=/opt/bin/kubelet\n"


def osc_yaml(
    image: str,
    path_in_image: str = "/kubelet",
    *,
    extra: str = "a\n",
    extra_unit: str = "extra.service",
) -> bytes:
    doc = {
        "apiVersion": "extensions.gardener.cloud/v1alpha1",
        "kind": "OperatingSystemConfig",
        "metadata": {"name": "osc", "namespace": "kube-system"},
        "spec": {
            "type": "debian",
            "purpose": "reconcile",
            "files": [
                {
                    "path": "/opt/bin/kubelet",
                    "permissions": 0o755,
                    "content": {"imageRef": {"image": image, "filePathInImage": path_in_image}},
                },
                {
                    "path": "/etc/extra.conf",
                    "permissions": 0o644,
                    "content": {"inline": {"encoding": "", "data": extra}},
                },
            ],
            "units": [
                {
                    "name": "kubelet.service",
                    "enable": True,
                    "command": "start",
                    "content": UNIT,
                    "filePaths": ["/opt/bin/kubelet"],
                },
                {
                    "name": extra_unit,
                    "enable": True,
                    "command": "start",
                    "content": "[Service]\nExecStart=/bin/true\n",
                    "filePaths": ["/etc/extra.conf"],
                },
            ],
        },
    }
    return yaml.safe_dump(doc).encode()


class Node:
    def __init__(self, root: Path, images: FakeImages | None) -> None:
        self.fs = HostFS(root)
        self.root = root
        self.systemd = FakeSystemd()
        self.applier = Applier(
            self.fs,
            StateStore(self.fs),
            self.systemd,
            host_name=HOST,
            agent_unit=AGENT_UNIT,
            images=images,
        )

    async def apply(self, raw: bytes) -> Any:
        self.systemd.jobs = []
        return await self.applier.apply(raw, parse_osc(raw), sha256_hex(raw), {})

    def file(self, path: str) -> tuple[bytes, int]:
        host = self.root / path.lstrip("/")
        return host.read_bytes(), stat.S_IMODE(host.stat().st_mode)


@pytest.fixture
def images() -> FakeImages:
    store = FakeImages()
    store.images["r.example/hyperkube:v1"] = (DIGEST, {"/kubelet": KUBELET})
    store.images["r.example/hyperkube:v2"] = ("sha256:" + "02" * 32, {"/kubelet": KUBELET + b"2"})
    return store


async def test_image_file_is_written_claimed_and_its_unit_restarted(
    tmp_path: Path, images: FakeImages
) -> None:
    node = Node(tmp_path, images)
    outcome = await node.apply(osc_yaml("r.example/hyperkube:v1"))

    assert node.file("/opt/bin/kubelet") == (KUBELET, 0o755)
    rep = outcome.report
    assert rep.complete
    assert rep.skipped == []
    assert "/opt/bin/kubelet" in rep.files_written
    [pull] = rep.pulls
    assert (pull.image, pull.digest, pull.path_in_image, pull.target, pull.size) == (
        "r.example/hyperkube:v1",
        DIGEST,
        "/kubelet",
        "/opt/bin/kubelet",
        len(KUBELET),
    )
    assert ("kubelet.service", "restart") in node.systemd.jobs
    assert node.applier.state.owns("/opt/bin/kubelet")

    # The same OSC again: nothing to pull, write or restart.
    again = await node.apply(osc_yaml("r.example/hyperkube:v1", extra="a\n") + b"\n")
    assert again.change_set.rows() == []
    assert images.pulls == ["r.example/hyperkube:v1"]
    assert node.systemd.jobs == []


async def test_new_tag_restarts_exactly_the_dependent_unit(
    tmp_path: Path, images: FakeImages
) -> None:
    node = Node(tmp_path, images)
    await node.apply(osc_yaml("r.example/hyperkube:v1"))
    outcome = await node.apply(osc_yaml("r.example/hyperkube:v2"))
    assert node.file("/opt/bin/kubelet") == (KUBELET + b"2", 0o755)
    assert node.systemd.jobs == [("kubelet.service", "restart")]
    assert [p.image for p in outcome.report.pulls] == ["r.example/hyperkube:v2"]


@pytest.mark.parametrize(
    ("image", "path", "why"),
    [
        ("r.example/hyperkube:v9", "/kubelet", "pull failed: not found"),
        ("r.example/down:v2", "/kubelet", "pull failed: dial tcp: connection refused"),
        ("r.example/hyperkube:v2", "/no-kubelet", "/no-kubelet is not in the image"),
    ],
)
async def test_failed_image_is_a_per_item_failure_holding_back_its_unit(
    tmp_path: Path, images: FakeImages, image: str, path: str, why: str
) -> None:
    images.images["r.example/down:v2"] = "dial tcp: connection refused"
    node = Node(tmp_path, images)
    await node.apply(osc_yaml("r.example/hyperkube:v1"))

    with pytest.raises(ApplyError) as err:
        await node.apply(osc_yaml(image, path, extra="b\n"))

    rep = err.value.report
    assert isinstance(rep, ApplyReport)
    failures = {f.item: f for f in rep.failure_list()}
    assert failures["/opt/bin/kubelet"].kind == "file"
    assert failures["/opt/bin/kubelet"].error == f"image {image}: {why}"
    assert failures["kubelet.service"].kind == "blocked"
    assert "/opt/bin/kubelet was not written" in failures["kubelet.service"].error
    assert set(failures) == {"/opt/bin/kubelet", "kubelet.service"}
    # The old binary is in place, the rest of the OSC applied and restarted.
    assert node.file("/opt/bin/kubelet") == (KUBELET, 0o755)
    assert node.file("/etc/extra.conf") == (b"b\n", 0o644)
    assert node.systemd.jobs == [("extra.service", "restart")]
    assert str(err.value).startswith("2 item(s) not applied")


async def test_retry_after_a_failed_pull_writes_and_restarts(
    tmp_path: Path, images: FakeImages
) -> None:
    node = Node(tmp_path, images)
    raw = osc_yaml("r.example/hyperkube:v3")
    with pytest.raises(ApplyError):
        await node.apply(raw)
    images.images["r.example/hyperkube:v3"] = (DIGEST, {"/kubelet": b"v3"})
    outcome = await node.apply(raw)
    assert outcome.report.complete
    assert node.file("/opt/bin/kubelet") == (b"v3", 0o755)
    assert node.systemd.jobs == [("kubelet.service", "restart")]


async def test_one_pull_per_image_and_attempt(tmp_path: Path, images: FakeImages) -> None:
    images.images["r.example/hyperkube:v1"] = (DIGEST, {"/kubelet": b"k", "/kubectl": b"c"})
    doc = yaml.safe_load(osc_yaml("r.example/hyperkube:v1"))
    doc["spec"]["files"].append(
        {
            "path": "/opt/bin/kubectl",
            "permissions": 0o700,
            "content": {
                "imageRef": {"image": "r.example/hyperkube:v1", "filePathInImage": "/kubectl"}
            },
        }
    )
    node = Node(tmp_path, images)
    outcome = await node.apply(yaml.safe_dump(doc).encode())
    assert images.pulls == ["r.example/hyperkube:v1"]
    assert {p.target for p in outcome.report.pulls} == {"/opt/bin/kubelet", "/opt/bin/kubectl"}
    assert node.file("/opt/bin/kubectl") == (b"c", 0o700)


async def test_without_an_image_store_the_file_is_skipped(tmp_path: Path) -> None:
    node = Node(tmp_path, None)
    outcome = await node.apply(osc_yaml("r.example/hyperkube:v1"))
    assert outcome.report.skipped == [
        "/opt/bin/kubelet: imageRef content is not supported by this agent"
    ]
    assert not (tmp_path / "opt/bin/kubelet").exists()


def test_plan_shows_each_pull_with_image_target_and_why() -> None:
    first = parse_osc(osc_yaml("r.example/hyperkube:v1"))
    second = parse_osc(osc_yaml("r.example/hyperkube:v2"))
    rows = plan(first, second, HOST).rows()
    assert rows[0] == (
        "pull",
        "/opt/bin/kubelet (0755)",
        "from r.example/hyperkube:v2:/kubelet; image reference changed",
    )
    lines = {
        line.split()[1]: line.split() for line in plan(None, second, HOST).summary().split("\n")
    }
    assert lines["/opt/bin/kubelet"] == [
        "pull",
        "/opt/bin/kubelet",
        "(0755)",
        "from",
        "r.example/hyperkube:v2:/kubelet;",
        "new",
        "file",
    ]
    assert lines["/etc/extra.conf"][0] == "write"
    assert plan(second, second, HOST).summary() == "no changes"


async def test_a_hanging_pull_holds_only_the_units_of_its_file(
    tmp_path: Path, images: FakeImages
) -> None:
    """The rest of the OSC (files, restarts) goes on while an image is being pulled; the unit
    whose filePaths name the image's file waits for it and is held back when it fails."""
    node = Node(tmp_path, images)
    await node.apply(osc_yaml("r.example/hyperkube:v1"))
    release = asyncio.Event()
    pulling = asyncio.Event()
    pull = images.pull

    async def hanging_pull(image: str) -> str:
        if image == "r.example/hang:v2":
            pulling.set()
            await release.wait()
            raise ImageError(image, "pull: ctr did not finish within 300s")
        return await pull(image)

    images.pull = hanging_pull  # type: ignore[method-assign]
    apply = asyncio.create_task(node.apply(osc_yaml("r.example/hang:v2", extra="b\n")))
    await asyncio.wait_for(pulling.wait(), 5)
    for _ in range(500):  # the unrelated unit is restarted while the pull still hangs
        if ("extra.service", "restart") in node.systemd.jobs:
            break
        await asyncio.sleep(0.01)
    assert node.systemd.jobs == [("extra.service", "restart")]
    assert node.file("/etc/extra.conf") == (b"b\n", 0o644)
    assert not apply.done()

    release.set()
    with pytest.raises(ApplyError) as err:
        await apply
    rep = err.value.report
    assert isinstance(rep, ApplyReport)
    failures = {f.item: f for f in rep.failure_list()}
    assert failures["/opt/bin/kubelet"].error == (
        "image r.example/hang:v2: pull: ctr did not finish within 300s"
    )
    assert failures["kubelet.service"].kind == "blocked"
    assert node.systemd.jobs == [("extra.service", "restart")]
    assert node.file("/opt/bin/kubelet") == (KUBELET, 0o755)


async def test_an_image_file_s_unit_restarts_after_its_pull(
    tmp_path: Path, images: FakeImages
) -> None:
    node = Node(tmp_path, images)
    await node.apply(osc_yaml("r.example/hyperkube:v1"))
    outcome = await node.apply(osc_yaml("r.example/hyperkube:v2", extra="b\n"))
    assert outcome.report.complete
    assert sorted(node.systemd.jobs) == [
        ("extra.service", "restart"),
        ("kubelet.service", "restart"),
    ]
    assert node.file("/opt/bin/kubelet") == (KUBELET + b"2", 0o755)


async def test_containerd_is_not_restarted_under_a_pull_in_flight(
    tmp_path: Path, images: FakeImages
) -> None:
    """Image files are pulled through containerd: its own restart in the same apply waits for
    the pulls in flight (a restart under a pull cut it off: "transport is closing"), while
    every other unit goes on."""
    node = Node(tmp_path, images)
    await node.apply(osc_yaml("r.example/hyperkube:v1", extra_unit="containerd.service"))
    release = asyncio.Event()
    pulling = asyncio.Event()
    pull = images.pull

    async def slow_pull(image: str) -> str:
        if image == "r.example/hyperkube:v2":
            pulling.set()
            await release.wait()
        return await pull(image)

    images.pull = slow_pull  # type: ignore[method-assign]
    apply = asyncio.create_task(
        node.apply(osc_yaml("r.example/hyperkube:v2", extra="b\n", extra_unit="containerd.service"))
    )
    await asyncio.wait_for(pulling.wait(), 5)
    for _ in range(50):
        await asyncio.sleep(0.01)
    assert node.file("/etc/extra.conf") == (b"b\n", 0o644)
    assert ("containerd.service", "restart") not in node.systemd.jobs
    release.set()
    outcome = await apply
    assert outcome.report.complete
    assert sorted(node.systemd.jobs) == [
        ("containerd.service", "restart"),
        ("kubelet.service", "restart"),
    ]
