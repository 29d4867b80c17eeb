"""Patching containerd's config.toml from a criConfig: the needed keys, nothing else, idempotent."""

from __future__ import annotations

import copy
import difflib
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node_agent.base.errors import ContainerdConfigError, HostError, OSCValidationError
from node_agent.containerd.config import (
    CERTS_DIR,
    CNI_BIN_DIR,
    IMPORTS_GLOB,
    RUNC_RUNTIME_TYPE,
    config_version,
    patch_config,
)
from node_agent.containerd.spec import ContainerdCRI, containerd_cri
from node_agent.osc.models import CRIConfig

DATA = Path(__file__).parent / "data" / "containerd"
# `containerd config default` of containerd 1.6.20 (Debian 12), as written on a fresh node.
DEFAULT_16 = (DATA / "config-default-1.6.toml").read_text()
CRI_V2 = "io.containerd.grpc.v1.cri"

# The shape of a containerd 2.x default config (version 3), the parts the patch touches.
V3 = """\
version = 3
root = '/var/lib/containerd'
state = '/run/containerd'
imports = []

[grpc]
  address = '/run/containerd/containerd.sock'

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'

    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = 'registry.k8s.io/pause:3.10'

    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = ''

  [plugins.'io.containerd.cri.v1.runtime']
    enable_selinux = false

    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dir = '/opt/cni/bin'
      conf_dir = '/etc/cni/net.d'

    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'

      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes]
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
          runtime_type = 'io.containerd.runc.v2'

          [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
            SystemdCgroup = false
"""
# A version 1 file as containerd 1.x nodes still carry: no ``version``, plugins by short ID.
V1 = """\
root = "/var/lib/containerd"
state = "/run/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"

[plugins]
  [plugins.cri]
    sandbox_image = "registry.k8s.io/pause:3.6"
    max_container_log_line_size = 16384
    [plugins.cri.containerd]
      snapshotter = "overlayfs"
      [plugins.cri.containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins.cri.containerd.runtimes.runc.options]
          SystemdCgroup = false
    [plugins.cri.cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
    [plugins.cri.registry]
      config_path = ""
"""
# containerd 2.2 writes the CNI dirs as a list.
V3_BIN_DIRS = V3.replace("bin_dir = '/opt/cni/bin'", "bin_dirs = ['/opt/cni/bin']")


def cri(
    *,
    sandbox: str = "registry.k8s.io/pause:3.10",
    cgroup: str | None = "systemd",
    plugins: list[dict[str, Any]] | None = None,
) -> ContainerdCRI:
    parsed = containerd_cri(
        CRIConfig.model_validate(
            {
                "name": "containerd",
                "cgroupDriver": cgroup,
                "containerd": {"sandboxImage": sandbox, "plugins": plugins or []},
            }
        )
    )
    assert parsed is not None
    return parsed


def at(doc: dict[str, Any], *path: str) -> Any:
    for key in path:
        doc = doc[key]
    return doc


def changed_lines(before: str, after: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


# --- containerd 1.6 default (version 2) --------------------------------------------------------


def test_default_16_gets_exactly_the_needed_keys_and_keeps_everything_else() -> None:
    out = patch_config(DEFAULT_16, cri())
    after = tomllib.loads(out)
    plugin = at(after, "plugins", CRI_V2)
    assert at(plugin, "registry", "config_path") == CERTS_DIR
    assert after["imports"] == [IMPORTS_GLOB]
    assert plugin["sandbox_image"] == "registry.k8s.io/pause:3.10"
    assert at(plugin, "containerd", "runtimes", "runc", "options", "SystemdCgroup") is True
    assert at(plugin, "cni", "bin_dir") == CNI_BIN_DIR

    # Everything else is what containerd wrote: compare with the expected edits undone.
    expected = tomllib.loads(DEFAULT_16)
    exp_plugin = at(expected, "plugins", CRI_V2)
    exp_plugin["registry"]["config_path"] = CERTS_DIR
    exp_plugin["sandbox_image"] = "registry.k8s.io/pause:3.10"
    at(exp_plugin, "containerd", "runtimes", "runc", "options")["SystemdCgroup"] = True
    expected["imports"] = [IMPORTS_GLOB]
    assert after == expected
    # ... and so is the text: four lines edited in place (bin_dir already was /opt/cni/bin).
    assert changed_lines(DEFAULT_16, out) == [
        "-imports = []",
        f'+imports = ["{IMPORTS_GLOB}"]',
        '-    sandbox_image = "registry.k8s.io/pause:3.6"',
        '+    sandbox_image = "registry.k8s.io/pause:3.10"',
        "-            SystemdCgroup = false",
        "+            SystemdCgroup = true",
        '-      config_path = ""',
        f'+      config_path = "{CERTS_DIR}"',
    ]


def test_patching_the_output_again_gives_the_same_bytes() -> None:
    config = cri(
        plugins=[
            {"path": [CRI_V2, "containerd", "runtimes", "runsc"], "values": {"runtime_type": "x"}},
            {"op": "remove", "path": ["io.containerd.internal.v1.opt"]},
        ]
    )
    once = patch_config(DEFAULT_16, config)
    assert once != DEFAULT_16
    assert patch_config(once, config) == once


def test_cgroupfs_is_false_and_no_driver_leaves_the_key_alone() -> None:
    systemd = patch_config(DEFAULT_16, cri(cgroup="systemd"))
    cgroupfs = patch_config(systemd, cri(cgroup="cgroupfs"))
    options = ("plugins", CRI_V2, "containerd", "runtimes", "runc", "options")
    assert at(tomllib.loads(cgroupfs), *options)["SystemdCgroup"] is False
    untouched = patch_config(systemd, cri(cgroup=None))
    assert at(tomllib.loads(untouched), *options)["SystemdCgroup"] is True


def test_an_empty_sandbox_image_keeps_containerd_s_own() -> None:
    out = patch_config(DEFAULT_16, cri(sandbox=""))
    assert at(tomllib.loads(out), "plugins", CRI_V2)["sandbox_image"] == "registry.k8s.io/pause:3.6"


def test_a_changed_cni_dir_is_set_back() -> None:
    moved = DEFAULT_16.replace('bin_dir = "/opt/cni/bin"', 'bin_dir = "/usr/lib/cni"')
    out = patch_config(moved, cri())
    assert at(tomllib.loads(out), "plugins", CRI_V2, "cni", "bin_dir") == CNI_BIN_DIR


def test_comments_and_foreign_keys_survive() -> None:
    text = (
        "# node image tuning, keep\n"
        "version = 2\n"
        "oom_score = -999  # the OOM killer spares containerd\n\n"
        '[plugins."io.containerd.grpc.v1.cri"]\n'
        "  # mirrors live in certs.d\n"
        '  sandbox_image = "old"\n'
        "  max_concurrent_downloads = 7\n"
    )
    out = patch_config(text, cri())
    assert out.startswith("# node image tuning, keep\nversion = 2\n")
    assert "oom_score = -999  # the OOM killer spares containerd\n" in out
    assert "  # mirrors live in certs.d\n" in out
    doc = tomllib.loads(out)
    assert doc["oom_score"] == -999
    assert at(doc, "plugins", CRI_V2, "max_concurrent_downloads") == 7
    assert at(doc, "plugins", CRI_V2, "registry", "config_path") == CERTS_DIR
    assert patch_config(out, cri()) == out


def test_missing_tables_are_created_and_a_file_without_version_is_version_1() -> None:
    out = patch_config("", cri())
    doc = tomllib.loads(out)
    assert "version" not in doc  # nothing but the needed keys is added
    assert doc["imports"] == [IMPORTS_GLOB]
    assert at(doc, "plugins", "cri", "registry", "config_path") == CERTS_DIR
    assert at(doc, "plugins", "cri", "containerd", "runtimes", "runc", "options") == {
        "SystemdCgroup": True
    }
    assert patch_config(out, cri()) == out


# --- containerd 1.x, version 1 (no version key) ----------------------------------------------


def test_version_1_is_patched_under_the_short_plugin_ids_containerd_1x_reads() -> None:
    out = patch_config(V1, cri())
    doc = tomllib.loads(out)
    assert "version" not in doc
    assert list(doc["plugins"]) == ["cri"]  # never the version 2 name, which 1.x ignores here
    cri_v1 = at(doc, "plugins", "cri")
    assert cri_v1["sandbox_image"] == "registry.k8s.io/pause:3.10"
    assert at(cri_v1, "containerd", "runtimes", "runc", "options", "SystemdCgroup") is True
    assert at(cri_v1, "registry", "config_path") == CERTS_DIR
    assert at(cri_v1, "cni", "bin_dir") == CNI_BIN_DIR
    assert cri_v1["max_container_log_line_size"] == 16384
    assert doc["imports"] == [IMPORTS_GLOB]
    assert patch_config(out, cri()) == out


def test_version_1_takes_plugin_paths_by_their_short_id() -> None:
    plugin = {
        "path": [CRI_V2, "containerd", "runtimes", "runsc"],
        "values": {"runtime_type": "io.containerd.runsc.v1"},
    }
    snapshotter = {"path": ["io.containerd.snapshotter.v1.overlayfs"], "values": {"x": 1}}
    out = patch_config(V1, cri(plugins=[plugin, snapshotter]))
    doc = tomllib.loads(out)
    runtimes = at(doc, "plugins", "cri", "containerd", "runtimes")
    assert runtimes["runsc"] == {"runtime_type": "io.containerd.runsc.v1"}
    assert at(doc, "plugins", "overlayfs") == {"x": 1}
    assert sorted(doc["plugins"]) == ["cri", "overlayfs"]


@pytest.mark.parametrize(
    ("version", "sandbox", "cgroup", "registry"),
    [
        (
            "",
            ("cri", "sandbox_image"),
            ("cri", "containerd", "runtimes", "runc", "options", "SystemdCgroup"),
            ("cri", "registry", "config_path"),
        ),
        (
            "version = 2\n",
            (CRI_V2, "sandbox_image"),
            (CRI_V2, "containerd", "runtimes", "runc", "options", "SystemdCgroup"),
            (CRI_V2, "registry", "config_path"),
        ),
        *[
            (
                f"version = {v}\n",
                ("io.containerd.cri.v1.images", "pinned_images", "sandbox"),
                (
                    "io.containerd.cri.v1.runtime",
                    *("containerd", "runtimes", "runc", "options", "SystemdCgroup"),
                ),
                ("io.containerd.cri.v1.images", "registry", "config_path"),
            )
            for v in (3, 4)
        ],
    ],
)
def test_each_version_gets_its_own_key_paths_and_only_those(
    version: str, sandbox: tuple[str, ...], cgroup: tuple[str, ...], registry: tuple[str, ...]
) -> None:
    doc = tomllib.loads(patch_config(version, cri()))
    plugins = doc["plugins"]
    assert at(plugins, *sandbox) == "registry.k8s.io/pause:3.10"
    assert at(plugins, *cgroup) is True
    assert at(plugins, *registry) == CERTS_DIR
    assert set(plugins) == {sandbox[0], cgroup[0], registry[0]}


@pytest.mark.parametrize(
    ("imports", "expected"),
    [
        ('imports = ["/etc/a.toml"]', ["/etc/a.toml", IMPORTS_GLOB]),
        (f'imports = ["{IMPORTS_GLOB}", "/etc/b.toml"]', [IMPORTS_GLOB, "/etc/b.toml"]),
        ('imports = "/etc/a.toml"', [IMPORTS_GLOB]),
    ],
)
def test_imports_keep_other_entries_and_hold_the_glob_once(
    imports: str, expected: list[str]
) -> None:
    out = patch_config(f"version = 2\n{imports}\n", cri())
    assert tomllib.loads(out)["imports"] == expected
    assert patch_config(out, cri()) == out


def test_imports_added_to_a_file_without_them_stay_top_level() -> None:
    out = patch_config('version = 2\n\n[grpc]\n  address = "/run/x.sock"\n', cri())
    doc = tomllib.loads(out)
    assert doc["imports"] == [IMPORTS_GLOB]
    assert doc["grpc"] == {"address": "/run/x.sock"}


# --- containerd 2.x (version 3) ------------------------------------------------------------------


def test_version_3_uses_the_containerd_2_key_paths() -> None:
    out = patch_config(V3, cri())
    doc = tomllib.loads(out)
    images = at(doc, "plugins", "io.containerd.cri.v1.images")
    runtime = at(doc, "plugins", "io.containerd.cri.v1.runtime")
    assert at(images, "registry", "config_path") == CERTS_DIR
    assert at(images, "pinned_images", "sandbox") == "registry.k8s.io/pause:3.10"
    assert at(runtime, "containerd", "runtimes", "runc", "options", "SystemdCgroup") is True
    assert at(runtime, "cni", "bin_dir") == CNI_BIN_DIR
    assert CRI_V2 not in doc["plugins"]
    assert doc["imports"] == [IMPORTS_GLOB]
    assert images["snapshotter"] == "overlayfs"
    assert patch_config(out, cri()) == out


def test_version_3_with_bin_dirs_sets_the_list_and_drops_the_old_key() -> None:
    with_both = V3_BIN_DIRS.replace(
        "bin_dirs = ['/opt/cni/bin']", "bin_dirs = ['/usr/lib/cni']\n      bin_dir = '/x'"
    )
    out = patch_config(with_both, cri())
    cni = at(tomllib.loads(out), "plugins", "io.containerd.cri.v1.runtime", "cni")
    assert cni == {"bin_dirs": [CNI_BIN_DIR], "conf_dir": "/etc/cni/net.d"}
    assert patch_config(out, cri()) == out


def test_version_3_moves_a_v1_runtime_plugin_path_as_upstream_does() -> None:
    plugin = {
        "path": [CRI_V2, "containerd", "runtimes", "runsc"],
        "values": {"runtime_type": "io.containerd.runsc.v1"},
    }
    out = patch_config(V3, cri(plugins=[plugin]))
    runtimes = at(
        tomllib.loads(out), "plugins", "io.containerd.cri.v1.runtime", "containerd", "runtimes"
    )
    assert runtimes["runsc"] == {"runtime_type": "io.containerd.runsc.v1"}
    assert CRI_V2 not in tomllib.loads(out)["plugins"]
    # version 2 keeps the path as given
    out2 = patch_config(DEFAULT_16, cri(plugins=[plugin]))
    runtimes2 = at(tomllib.loads(out2), "plugins", CRI_V2, "containerd", "runtimes")
    assert runtimes2["runsc"] == {"runtime_type": "io.containerd.runsc.v1"}


@pytest.mark.parametrize(
    ("text", "version"), [("", 1), ("version = 2", 2), ("version = 3", 3), ("version = 4", 4)]
)
def test_config_version(text: str, version: int) -> None:
    assert config_version(tomllib.loads(text)) == version


# --- runc's runtime_type --------------------------------------------------------------------------

#: Debian's containerd package's /etc/containerd/config.toml (bookworm, containerd 1.6.20)
DEBIAN_CONFIG = """version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"""


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (DEBIAN_CONFIG, (CRI_V2, "containerd", "runtimes", "runc")),
        ("version = 1\n", ("cri", "containerd", "runtimes", "runc")),
        ("version = 3\n", ("io.containerd.cri.v1.runtime", "containerd", "runtimes", "runc")),
    ],
)
def test_a_runc_table_the_patch_makes_names_runcs_shim(text: str, path: tuple[str, ...]) -> None:
    """containerd decodes the file's runc table in place of its default one: without
    ``runtime_type`` no pod sandbox starts, so a table without it gets runc's."""
    out = patch_config(text, cri())
    runc = at(tomllib.loads(out), "plugins", *path)
    assert runc["runtime_type"] == RUNC_RUNTIME_TYPE
    assert runc["options"]["SystemdCgroup"] is True
    assert patch_config(out, cri()) == out


def test_a_runtime_type_already_there_is_kept() -> None:
    base = (
        "version = 2\n\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]\n'
        '  runtime_type = "io.containerd.runsc.v1"\n'
    )
    out = patch_config(base, cri())
    runc = at(tomllib.loads(out), "plugins", CRI_V2, "containerd", "runtimes", "runc")
    assert runc["runtime_type"] == "io.containerd.runsc.v1"


def test_without_a_cgroup_driver_and_no_runc_table_none_is_made() -> None:
    out = patch_config(DEBIAN_CONFIG, cri(cgroup=None))
    assert "runtimes" not in at(tomllib.loads(out), "plugins", CRI_V2).get("containerd", {})


# --- plugins[] -----------------------------------------------------------------------------------


def test_plugin_add_merges_into_what_is_there_and_remove_deletes() -> None:
    base = (
        "version = 2\n\n"
        '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
        '  BinaryName = "/usr/bin/runc"\n'
        "  SystemdCgroup = false\n"
    )
    runc = [CRI_V2, "containerd", "runtimes", "runc"]
    plugins: list[dict[str, Any]] = [
        {"path": runc, "values": {"options": {"BinaryName": "/opt/runc"}, "privileged": True}},
        {"path": ["io.containerd.tracing.processor.v1.otlp"]},  # no values: the table only
        {"op": "remove", "path": [*runc, "options", "NoPivotRoot"]},  # absent: nothing to do
    ]
    out = patch_config(base, cri(plugins=plugins))
    doc = tomllib.loads(out)
    assert at(doc, "plugins", *runc) == {
        "options": {"BinaryName": "/opt/runc", "SystemdCgroup": True},
        "privileged": True,
        "runtime_type": RUNC_RUNTIME_TYPE,
    }
    assert at(doc, "plugins", "io.containerd.tracing.processor.v1.otlp") == {}
    assert patch_config(out, cri(plugins=plugins)) == out

    removed = patch_config(out, cri(plugins=[{"op": "remove", "path": [*runc, "options"]}]))
    runc_after = at(tomllib.loads(removed), "plugins", *runc)
    # The cgroup patch (before the plugin ops) recreated options; the remove op wins.
    assert runc_after == {"privileged": True, "runtime_type": RUNC_RUNTIME_TYPE}


def test_plugin_values_of_every_json_type() -> None:
    values = {"s": "x", "i": 3, "f": 1.5, "b": False, "l": ["a", "b"], "n": [1, 2], "t": {"k": 1}}
    out = patch_config(DEFAULT_16, cri(plugins=[{"path": ["io.test"], "values": values}]))
    assert at(tomllib.loads(out), "plugins", "io.test") == values


def test_a_value_of_another_type_is_replaced_even_when_python_calls_it_equal() -> None:
    out = patch_config(
        "[plugins.x]\n  a = 1\n", cri(plugins=[{"path": ["x"], "values": {"a": True}}])
    )
    assert at(tomllib.loads(out), "plugins", "x", "a") is True


# --- refused -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("version = [", "not valid TOML"),
        ("version = 9\n", "unsupported config version 9"),
        ('version = "2"\n', "unsupported config version '2'"),
        ('version = 2\nplugins = "none"\n', "plugins is a string, a table is needed"),
        (
            'version = 2\n[plugins."io.containerd.grpc.v1.cri".registry.config_path]\n',
            "io.containerd.grpc.v1.cri.registry.config_path is a table",
        ),
        ("[plugins.cri.registry.config_path]\n", "plugins.cri.registry.config_path is a table"),
    ],
)
def test_a_config_that_cannot_be_patched_is_a_host_error_naming_the_file(
    text: str, needle: str
) -> None:
    with pytest.raises(ContainerdConfigError) as err:
        patch_config(text, cri())
    assert isinstance(err.value, HostError)
    message = str(err.value)
    assert message.startswith("/etc/containerd/config.toml: ")
    assert needle in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("containerd", "field"),
    [
        ({"sandboxImage": 3}, "spec.criConfig.containerd.sandboxImage"),
        (
            {"plugins": [{"op": "replace", "path": ["a"]}]},
            "spec.criConfig.containerd.plugins[0].op",
        ),
        ({"plugins": [{"path": []}]}, "spec.criConfig.containerd.plugins[0].path"),
        ({"plugins": [{"path": ["a"], "values": {"x": None}}]}, "containerd.plugins[0].values"),
        (
            {"plugins": [{"path": ["a"], "values": [1]}]},
            "spec.criConfig.containerd.plugins[0].values",
        ),
        ({"plugins": [{"path": ["a"], "values": {"n": 2**64}}]}, "containerd.plugins[0].values"),
        (
            {"registries": [{"upstream": "../etc"}]},
            "spec.criConfig.containerd.registries[0].upstream",
        ),
        ({"registries": [{"upstream": "a", "hosts": [{"url": "ftp://x"}]}]}, "hosts[0].url"),
        (
            {
                "registries": [
                    {"upstream": "a", "hosts": [{"url": "https://x", "capabilities": ["x"]}]}
                ]
            },
            "registries[0].hosts[0].capabilities[0]",
        ),
        ({"registries": [{"upstream": "a"}, {"upstream": "a"}]}, "containerd.registries"),
    ],
)
def test_a_malformed_cri_config_is_a_validation_error_naming_the_field(
    containerd: dict[str, Any], field: str
) -> None:
    with pytest.raises(OSCValidationError) as err:
        containerd_cri(CRIConfig.model_validate({"name": "containerd", "containerd": containerd}))
    assert err.value.field is not None
    assert err.value.field.endswith(field)
    assert str(err.value).startswith(err.value.field)


@pytest.mark.parametrize(
    ("registry", "needle"),
    [
        ({"upstream": "docker.io\n"}, "'docker.io\\n'"),
        ({"upstream": "docker.io\r"}, "'docker.io\\r'"),
        ({"upstream": "my registry"}, "'my registry'"),
        ({"upstream": 'docker"io'}, 'docker"io'),
        ({"upstream": "docker'io"}, "docker'io"),
        ({"upstream": "a", "server": "https://x\ny"}, "registry 'a': server"),
        ({"upstream": "a", "hosts": [{"url": "https://m 1"}]}, "registry 'a': host 'https://m 1'"),
        ({"upstream": "a", "hosts": [{"url": 'https://m"x'}]}, "registry 'a': host"),
        ({"upstream": "a", "hosts": [{"url": "https://m\r\n"}]}, "registry 'a': host"),
    ],
)
def test_registry_names_and_urls_with_spaces_quotes_or_line_breaks_are_refused(
    registry: dict[str, Any], needle: str
) -> None:
    cri = CRIConfig.model_validate({"name": "containerd", "containerd": {"registries": [registry]}})
    with pytest.raises(OSCValidationError) as err:
        containerd_cri(cri)
    message = str(err.value)
    assert message.startswith("spec.criConfig.containerd.registries[0]")
    assert needle in message
    assert "\n" not in message
    assert "\r" not in message


def test_a_bad_cgroup_driver_is_refused() -> None:
    with pytest.raises(OSCValidationError, match=r"spec\.criConfig\.cgroupDriver"):
        containerd_cri(
            CRIConfig.model_validate(
                {"name": "containerd", "cgroupDriver": "Systemd", "containerd": {}}
            )
        )


def test_only_containerd_with_its_section_is_configured() -> None:
    assert containerd_cri(None) is None
    assert containerd_cri(CRIConfig.model_validate({"name": "containerd"})) is None
    other = CRIConfig.model_validate({"name": "cri-o", "containerd": {"sandboxImage": 1}})
    assert containerd_cri(other) is None


# --- properties ----------------------------------------------------------------------------------

_key = st.text(alphabet="abcxyz_.-", min_size=1, max_size=6)
_scalar = st.one_of(
    st.text(max_size=8),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=False),
)
_json = st.recursive(
    _scalar,
    lambda inner: st.one_of(
        st.lists(_scalar, max_size=3), st.dictionaries(_key, inner, max_size=3)
    ),
    max_leaves=6,
)
# Plugin paths below a plugin of their own (so they cannot undo the keys the node needs), and the
# runtimes path that version 3 moves.
_plugin_path = st.one_of(
    st.lists(_key, min_size=1, max_size=3).map(lambda p: ["io.containerd.test.v1", *p]),
    st.lists(_key, min_size=1, max_size=2).map(
        lambda p: [CRI_V2, "containerd", "runtimes", "t-" + p[0], *p[1:]]
    ),
)
_plugin = st.one_of(
    st.fixed_dictionaries(
        {"path": _plugin_path},
        optional={"values": st.dictionaries(_key, _json, max_size=3), "op": st.just("add")},
    ),
    st.fixed_dictionaries({"op": st.just("remove"), "path": _plugin_path}),
)
_bases = st.sampled_from([DEFAULT_16, V3, V3_BIN_DIRS, "", "version = 2\n"])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=_bases,
    sandbox=st.text(max_size=20),
    cgroup=st.sampled_from([None, "systemd", "cgroupfs"]),
    plugins=st.lists(_plugin, max_size=4),
)
def test_patch_is_idempotent_and_holds_the_needed_keys(
    base: str, sandbox: str, cgroup: str | None, plugins: list[dict[str, Any]]
) -> None:
    config = cri(sandbox=sandbox, cgroup=cgroup, plugins=copy.deepcopy(plugins))
    once = patch_config(base, config)
    assert patch_config(once, config) == once
    doc = tomllib.loads(once)  # an independent parser reads it
    assert IMPORTS_GLOB in doc["imports"]
    v3 = doc.get("version") == 3
    cri_name = CRI_V2 if "version" in doc else "cri"  # version 1: the plugin's short ID
    images = ("plugins", "io.containerd.cri.v1.images") if v3 else ("plugins", cri_name)
    runtime = ("plugins", "io.containerd.cri.v1.runtime") if v3 else ("plugins", cri_name)
    assert at(doc, *images, "registry", "config_path") == CERTS_DIR
    if sandbox:
        sandbox_key = ("pinned_images", "sandbox") if v3 else ("sandbox_image",)
        assert at(doc, *images, *sandbox_key) == sandbox
    if cgroup is not None:
        options = at(doc, *runtime, "containerd", "runtimes", "runc", "options")
        assert options["SystemdCgroup"] is (cgroup == "systemd")
