"""The containerd expander: derived files and unit, directories, readiness probe; no writes."""

from __future__ import annotations

import base64
import os
import stat
import tomllib
from pathlib import Path
from typing import Any

import pytest

from node_agent.base.errors import OSCValidationError
from node_agent.containerd.config import CERTS_DIR, CONFIG_FILE, IMPORTS_GLOB
from node_agent.containerd.expand import (
    DIRECTORIES,
    ENV_DROP_IN,
    FALLBACK_CONFIG,
    ContainerdExpander,
    env_drop_in,
)
from node_agent.containerd.spec import RegistryConfig
from node_agent.host.fs import HostFS
from node_agent.osc.applied import Applied
from node_agent.osc.models import File, OperatingSystemConfig

DEFAULT_16 = (
    Path(__file__).parent / "data" / "containerd" / "config-default-1.6.toml"
).read_bytes()
MIRROR = {
    "upstream": "registry.local:5000",
    "server": "https://registry.local:5000",
    "hosts": [{"url": "https://mirror.local:5001", "caCerts": ["/etc/ssl/mirror-ca.crt"]}],
}


HOSTS = f"{CERTS_DIR}/registry.local:5000/hosts.toml"
PROBED = {**MIRROR, "readinessProbe": True}


def osc(
    cri: dict[str, Any] | None, *, files: list[dict[str, Any]] | None = None
) -> OperatingSystemConfig:
    doc: dict[str, Any] = {
        "spec": {
            "files": files or [],
            "units": [{"name": "containerd.service", "filePaths": ["/etc/sysctl.d/x.conf"]}],
        }
    }
    if cri is not None:
        doc["spec"]["criConfig"] = cri
    return OperatingSystemConfig.model_validate(doc)


def gardener_cri(**containerd: Any) -> dict[str, Any]:
    return {
        "name": "containerd",
        "cgroupDriver": "systemd",
        "containerd": {"sandboxImage": "registry.k8s.io/pause:3.10", **containerd},
    }


class Defaults:
    def __init__(self, data: bytes = DEFAULT_16) -> None:
        self.data = data
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.data


def content(file: File) -> bytes:
    assert file.content.inline is not None
    assert file.content.inline.encoding == "b64"
    return base64.b64decode(file.content.inline.data)


def derived_files(out: OperatingSystemConfig, before: OperatingSystemConfig) -> dict[str, File]:
    return {f.path: f for f in out.spec.files[len(before.spec.files) :]}


def tree(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_mode) for p in root.rglob("*"))


@pytest.fixture
def fs(tmp_path: Path) -> HostFS:
    return HostFS(tmp_path)


def test_no_cri_config_or_another_runtime_leaves_the_osc_as_it_is(fs: HostFS) -> None:
    expander = ContainerdExpander(fs, default_config=Defaults())
    for cri in (None, {"name": "cri-o", "containerd": {}}, {"name": "containerd"}):
        before = osc(cri)
        assert expander(before) is before
        expander.prepare(before)
    assert list(fs.root.iterdir()) == []


def test_a_fresh_node_gets_config_toml_from_the_default_patched_and_the_drop_in(
    fs: HostFS, tmp_path: Path
) -> None:
    defaults = Defaults()
    expander = ContainerdExpander(fs, default_config=defaults)
    before = osc(gardener_cri(registries=[MIRROR]))
    out = expander(before)
    files = derived_files(out, before)
    assert list(files) == [CONFIG_FILE, f"{CERTS_DIR}/registry.local:5000/hosts.toml"]
    assert {f.permissions for f in files.values()} == {0o644}
    config = tomllib.loads(content(files[CONFIG_FILE]).decode())
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "registry.k8s.io/pause:3.10"
    assert cri["registry"]["config_path"] == CERTS_DIR
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert config["imports"] == [IMPORTS_GLOB]
    hosts = tomllib.loads(content(files[f"{CERTS_DIR}/registry.local:5000/hosts.toml"]).decode())
    assert hosts["server"] == "https://registry.local:5000"
    assert hosts["host"]["https://mirror.local:5001"]["ca"] == ["/etc/ssl/mirror-ca.crt"]

    # The unit merges with the OSC's own containerd.service: its filePaths plus config.toml.
    applied = Applied.of_osc(out, "node")
    unit = applied.units["containerd.service"]
    assert unit.content is None
    assert unit.drop_ins == {ENV_DROP_IN: env_drop_in()}
    assert unit.file_paths == ("/etc/sysctl.d/x.conf", CONFIG_FILE)
    assert env_drop_in() == (
        '[Service]\nEnvironment="PATH=/var/bin/containerruntimes:'
        '/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"\n'
    )
    # Deterministic, `containerd config default` asked once, and nothing written.
    assert expander(before) == out
    assert defaults.calls == 1
    assert list(tmp_path.iterdir()) == []


def test_the_config_on_disk_is_patched_not_replaced(fs: HostFS) -> None:
    own = b"# tuned by the image\nversion = 2\noom_score = -999\n"
    fs.write_atomic(CONFIG_FILE, own, 0o644)
    defaults = Defaults()
    before = osc(gardener_cri())
    out = ContainerdExpander(fs, default_config=defaults)(before)
    data = content(derived_files(out, before)[CONFIG_FILE])
    assert data.startswith(b"# tuned by the image\nversion = 2\noom_score = -999\n")
    assert tomllib.loads(data.decode())["plugins"]["io.containerd.grpc.v1.cri"]["sandbox_image"]
    assert defaults.calls == 0


def test_an_empty_config_is_seeded_like_a_missing_one(fs: HostFS) -> None:
    fs.write_atomic(CONFIG_FILE, b"\n", 0o644)
    defaults = Defaults()
    before = osc(gardener_cri())
    out = ContainerdExpander(fs, default_config=defaults)(before)
    assert defaults.calls == 1
    assert b'plugin_dir = ""' in content(derived_files(out, before)[CONFIG_FILE])


def test_a_config_already_patched_on_disk_is_derived_byte_for_byte(fs: HostFS) -> None:
    before = osc(gardener_cri())
    first = ContainerdExpander(fs, default_config=Defaults())(before)
    data = content(derived_files(first, before)[CONFIG_FILE])
    fs.write_atomic(CONFIG_FILE, data, 0o644)
    again = ContainerdExpander(fs, default_config=Defaults(b"version = 3\n"))(before)
    assert content(derived_files(again, before)[CONFIG_FILE]) == data


def test_containerd_config_default_failing_seeds_a_minimal_config(fs: HostFS) -> None:
    def broken() -> bytes:
        raise FileNotFoundError("containerd")

    before = osc(gardener_cri())
    out = ContainerdExpander(fs, default_config=broken)(before)
    data = content(derived_files(out, before)[CONFIG_FILE])
    assert data.startswith(FALLBACK_CONFIG)
    assert tomllib.loads(data.decode())["version"] == 2


def test_the_osc_s_own_file_at_a_derived_path_wins(fs: HostFS) -> None:
    own = {"path": CONFIG_FILE, "permissions": 0o600, "content": {"inline": {"data": "x"}}}
    before = osc(gardener_cri(), files=[own])
    out = ContainerdExpander(fs, default_config=Defaults())(before)
    assert [f.path for f in out.spec.files] == [CONFIG_FILE]
    assert out.spec.files[0].permissions == 0o600


def test_a_malformed_cri_config_is_refused_by_expand(fs: HostFS) -> None:
    bad = osc(gardener_cri(registries=[{"upstream": "a/b"}]))
    with pytest.raises(OSCValidationError) as err:
        ContainerdExpander(fs, default_config=Defaults())(bad)
    assert err.value.field == "spec.criConfig.containerd.registries[0].upstream"


@pytest.mark.parametrize(
    ("on_disk", "why"),
    [
        (b"[plugins\n", "not valid TOML"),
        (b"\xff\xfe", "not UTF-8 text"),
        (b"version = 9\n", "unsupported config version 9"),
        (None, "is not a regular file"),
    ],
)
def test_a_config_that_cannot_be_patched_is_one_failed_item_and_the_rest_is_derived(
    fs: HostFS, tmp_path: Path, on_disk: bytes | None, why: str
) -> None:
    if on_disk is None:
        (tmp_path / CONFIG_FILE.lstrip("/")).mkdir(parents=True)
    else:
        fs.write_atomic(CONFIG_FILE, on_disk, 0o644)
    before = osc(gardener_cri(registries=[MIRROR]))
    expander = ContainerdExpander(fs, default_config=Defaults())
    out = expander(before)
    assert list(derived_files(out, before)) == [HOSTS]  # config.toml left out, as it is
    assert list(expander.failed) == [CONFIG_FILE]
    assert why in expander.failed[CONFIG_FILE]
    assert "\n" not in expander.failed[CONFIG_FILE]
    assert not expander.failed[CONFIG_FILE].startswith(CONFIG_FILE)  # the path is named beside
    assert [u.name for u in out.status.extension_units] == ["containerd.service"]
    # fixed on disk: derived again, nothing failed
    if on_disk is None:
        (tmp_path / CONFIG_FILE.lstrip("/")).rmdir()
    fs.write_atomic(CONFIG_FILE, DEFAULT_16, 0o644)
    assert CONFIG_FILE in derived_files(expander(before), before)
    assert expander.failed == {}


def test_a_registry_whose_ca_cannot_be_read_is_one_failed_item(fs: HostFS) -> None:
    bad_ca = {
        **PROBED,
        "hosts": [{"url": "https://mirror.local:5001", "caCerts": ["../../../../etc/ca.crt"]}],
    }
    before = osc(gardener_cri(registries=[bad_ca, {**MIRROR, "upstream": "other"}]))
    expander = ContainerdExpander(fs, default_config=Defaults())  # the real probe
    out = expander(before)
    assert sorted(derived_files(out, before)) == [f"{CERTS_DIR}/other/hosts.toml", CONFIG_FILE]
    assert list(expander.failed) == [HOSTS]
    assert expander.failed[HOSTS].startswith("registry registry.local:5000: ")
    assert "contains '..'" in expander.failed[HOSTS]


def test_prepare_creates_the_directories_once(fs: HostFS, tmp_path: Path) -> None:
    expander = ContainerdExpander(fs, default_config=Defaults())
    desired = expander(osc(gardener_cri(registries=[MIRROR])))
    old = os.umask(0o077)
    try:
        expander.prepare(desired)
        snapshot = tree(tmp_path)
        expander.prepare(desired)
    finally:
        os.umask(old)
    assert tree(tmp_path) == snapshot
    expected = [*DIRECTORIES, f"{CERTS_DIR}/registry.local:5000"]
    for directory in expected:
        mode = (tmp_path / directory.lstrip("/")).stat().st_mode
        assert stat.S_ISDIR(mode)
        assert stat.S_IMODE(mode) == 0o755, directory
    assert DIRECTORIES == (
        "/var/bin/containerruntimes",
        "/etc/containerd",
        "/etc/containerd/conf.d",
        "/etc/containerd/certs.d",
    )


# --- readiness probe ---------------------------------------------------------------------------


class Probe:
    def __init__(self, reason: str | None) -> None:
        self.reason = reason
        self.asked: list[str] = []

    def __call__(self, registry: RegistryConfig, read: Any) -> str | None:
        self.asked.append(registry.upstream)
        return self.reason


def test_a_reachable_registry_gets_its_hosts_toml(fs: HostFS) -> None:
    probe = Probe(None)
    before = osc(gardener_cri(registries=[PROBED, {**MIRROR, "upstream": "other"}]))
    expander = ContainerdExpander(fs, default_config=Defaults(), probe=probe)
    expander.held_back = {"registry.local:5000": "down before"}
    out = expander(before)
    assert HOSTS in derived_files(out, before)
    assert expander.held_back == {}
    assert probe.asked == ["registry.local:5000"]  # only registries that ask for it


def test_an_unreachable_new_registry_gets_no_hosts_toml_yet(fs: HostFS, tmp_path: Path) -> None:
    probe = Probe("https://mirror.local:5001/v2/: connection refused")
    before = osc(gardener_cri(registries=[PROBED]))
    expander = ContainerdExpander(fs, default_config=Defaults(), probe=probe)
    out = expander(before)
    assert list(derived_files(out, before)) == [CONFIG_FILE]
    assert expander.held_back == {
        "registry.local:5000": "https://mirror.local:5001/v2/: connection refused"
    }
    expander.prepare(out)
    assert (tmp_path / CERTS_DIR.lstrip("/")).is_dir()
    assert list((tmp_path / CERTS_DIR.lstrip("/")).iterdir()) == []


def test_an_unreachable_changed_registry_keeps_the_file_on_disk(fs: HostFS) -> None:
    fs.write_atomic(HOSTS, b"# the working one\n", 0o644)
    probe = Probe("down")
    before = osc(gardener_cri(registries=[PROBED]))
    out = ContainerdExpander(fs, default_config=Defaults(), probe=probe)(before)
    assert content(derived_files(out, before)[HOSTS]) == b"# the working one\n"


def test_a_hosts_toml_already_on_disk_is_not_probed_again(fs: HostFS) -> None:
    first = ContainerdExpander(fs, default_config=Defaults(), probe=Probe(None))
    before = osc(gardener_cri(registries=[PROBED]))
    data = content(derived_files(first(before), before)[HOSTS])
    fs.write_atomic(HOSTS, data, 0o644)
    probe = Probe("down")
    out = ContainerdExpander(fs, default_config=Defaults(), probe=probe)(before)
    assert content(derived_files(out, before)[HOSTS]) == data
    assert probe.asked == []
