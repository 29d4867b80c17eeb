"""Patch containerd's ``config.toml`` for a criConfig: the keys the node needs, nothing else.

Pure: text in, text out. The patch is computed on plain data first (what the file should say),
then carried into the tomlkit document with the fewest edits: only keys whose value differs are
assigned or removed, so comments, order and formatting of everything else stay, and patching the
output again changes nothing at all (the planner compares bytes; an idempotent patch means no
write and no containerd restart when nothing changed).

Key paths depend on the file's ``version``. containerd 1.x reads a version 1 file (no
``version`` key) by each plugin's short ID (``[plugins.cri]``) and a version 2 file by its full
name (``io.containerd.grpc.v1.cri``); containerd 2.x reads versions 3 and 4
(``io.containerd.cri.v1.images`` and ``io.containerd.cri.v1.runtime``) and refuses version 1.
Upstream patches a version 1 file under the version 2 names, which containerd 1.x never reads:
the change is lost without a word; here each version gets the keys its containerd reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import tomlkit
from tomlkit.container import Container
from tomlkit.exceptions import TOMLKitError
from tomlkit.items import InlineTable, Item, Table

from node_agent.base import layout
from node_agent.base.errors import ContainerdConfigError
from node_agent.containerd.spec import ContainerdCRI

CONFIG_FILE = layout.CONTAINERD_CONFIG_FILE
BASE_DIR = layout.CONTAINERD_BASE_DIR
CERTS_DIR = layout.CONTAINERD_CERTS_DIR
CONF_DIR = layout.CONTAINERD_CONF_DIR
IMPORTS_GLOB = CONF_DIR + "/*.toml"
CNI_BIN_DIR = "/opt/cni/bin"
#: runc's shim, as every containerd since 1.6 names it in its default config
RUNC_RUNTIME_TYPE = "io.containerd.runc.v2"

Path = tuple[str, ...]

_V1_CRI = ("plugins", "cri")
_V2_CRI = ("plugins", "io.containerd.grpc.v1.cri")
_V3_IMAGES = ("plugins", "io.containerd.cri.v1.images")
_V3_RUNTIME = ("plugins", "io.containerd.cri.v1.runtime")
_RUNC_OPTIONS = ("containerd", "runtimes", "runc", "options")

# version -> (registry config_path, sandbox image, SystemdCgroup, cni table)
_PATHS: dict[int, tuple[Path, Path, Path, Path]] = {
    1: (
        (*_V1_CRI, "registry", "config_path"),
        (*_V1_CRI, "sandbox_image"),
        (*_V1_CRI, *_RUNC_OPTIONS, "SystemdCgroup"),
        (*_V1_CRI, "cni"),
    ),
    2: (
        (*_V2_CRI, "registry", "config_path"),
        (*_V2_CRI, "sandbox_image"),
        (*_V2_CRI, *_RUNC_OPTIONS, "SystemdCgroup"),
        (*_V2_CRI, "cni"),
    ),
    3: (
        (*_V3_IMAGES, "registry", "config_path"),
        (*_V3_IMAGES, "pinned_images", "sandbox"),
        (*_V3_RUNTIME, *_RUNC_OPTIONS, "SystemdCgroup"),
        (*_V3_RUNTIME, "cni"),
    ),
}
_PATHS[4] = _PATHS[3]

# Plugin paths written for containerd 1.x that containerd 2.x keeps elsewhere (as upstream maps).
_PLUGIN_MOVES: tuple[tuple[Path, Path], ...] = (
    ((*_V2_CRI, "containerd", "runtimes"), (*_V3_RUNTIME, "containerd", "runtimes")),
)


def config_version(doc: Mapping[str, Any]) -> int:
    """The ``version`` of a parsed config.toml; absent means 1 (containerd's own reading)."""
    version = _plain(doc.get("version", 1))
    if type(version) is not int or version not in _PATHS:
        raise ContainerdConfigError(f"unsupported config version {version!r} (1 to 4 are known)")
    return version


def patch_config(text: str, cri: ContainerdCRI) -> str:
    """``text`` (a config.toml) with what ``cri`` asks for; everything else as it was."""
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise ContainerdConfigError(f"not valid TOML ({_one_line(exc)})") from None
    target: dict[str, Any] = doc.unwrap()
    apply_cri(target, cri)
    _reconcile(doc, target)
    return doc.as_string()


def apply_cri(config: dict[str, Any], cri: ContainerdCRI) -> None:
    """Edit ``config`` (config.toml as plain data) in place the way ``cri`` asks; the same edits
    on the result change nothing."""
    version = config_version(config)
    registry_path, sandbox_path, cgroup_path, cni_path = _PATHS[version]
    _set(config, registry_path, CERTS_DIR)
    imports = config.get("imports")
    if not isinstance(imports, list):  # absent, or a value containerd would refuse anyway
        config["imports"] = [IMPORTS_GLOB]
    elif IMPORTS_GLOB not in imports:
        imports.append(IMPORTS_GLOB)
    if cri.containerd.sandbox_image:
        _set(config, sandbox_path, cri.containerd.sandbox_image)
    # containerd >= 2.2 writes the CNI dirs as a list (``bin_dirs``) in its default config and
    # deprecates ``bin_dir``: the file says which one this containerd reads.
    cni = _table(config, cni_path)
    if "bin_dirs" in cni:
        cni["bin_dirs"] = [CNI_BIN_DIR]
        cni.pop("bin_dir", None)
    else:
        cni["bin_dir"] = CNI_BIN_DIR
    if cri.cgroup_driver is not None:
        _set(config, cgroup_path, cri.cgroup_driver == "systemd")
    for plugin in cri.containerd.plugins:
        path = _plugin_path(("plugins", *plugin.path), version)
        if plugin.op == "remove":
            parent = _find(config, path[:-1])
            if isinstance(parent, dict):
                parent.pop(path[-1], None)
        else:
            _merge(_table(config, path, replace_value=True), plugin.values or {})
    # containerd decodes a runtime's table in place of its default one: a ``runc`` table that
    # the patch made (or found) without ``runtime_type`` leaves runc with no shim, and no pod
    # sandbox can start ("container.Runtime.Name must be set"). A distribution's short
    # config.toml (Debian's) is such a file; upstream's patch leaves it that way.
    runc = _find(config, cgroup_path[:-2])
    if isinstance(runc, dict) and "runtime_type" not in runc:
        runc["runtime_type"] = RUNC_RUNTIME_TYPE


def _plugin_path(path: Path, version: int) -> Path:
    """Where containerd of this config ``version`` reads a plugin path written for version 2."""
    if version == 1:
        return (path[0], _short_id(path[1]), *path[2:]) if len(path) > 1 else path
    if version >= 3:
        for old, new in _PLUGIN_MOVES:
            if path[: len(old)] == old:
                return new + path[len(old) :]
    return path


def _short_id(name: str) -> str:
    """A plugin's ID as a version 1 file names it: ``io.containerd.grpc.v1.cri`` -> ``cri``
    (a full name is ``io.containerd.<type>.<vN>.<id>``); any other key as it is."""
    parts = name.split(".")
    if len(parts) > 4 and parts[0] == "io" and parts[1] == "containerd":
        return ".".join(parts[4:])
    return name


def _find(config: dict[str, Any], path: Path) -> object:
    node: object = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _table(config: dict[str, Any], path: Path, *, replace_value: bool = False) -> dict[str, Any]:
    """The table at ``path``, created (with its parents) when missing. A plain value where a
    table is needed is an error, except at the end of ``path`` when ``replace_value``."""
    node = config
    for depth, key in enumerate(path):
        child = node.get(key)
        if not isinstance(child, dict):
            if child is not None and not (replace_value and depth == len(path) - 1):
                where = ".".join(path[: depth + 1])
                raise ContainerdConfigError(f"{where} is {_kind(child)}, a table is needed there")
            child = node[key] = {}
        node = child
    return node


def _set(config: dict[str, Any], path: Path, value: object) -> None:
    table = _table(config, path[:-1])
    if isinstance(table.get(path[-1]), dict):
        raise ContainerdConfigError(f"{'.'.join(path)} is a table, a value is needed there")
    table[path[-1]] = value


def _merge(table: dict[str, Any], values: Mapping[str, Any]) -> None:
    """Set each of ``values`` in ``table``; a table given for an existing table is merged into it
    (what the file has there besides stays, and a second apply finds everything equal)."""
    for key, value in values.items():
        current = table.get(key)
        if isinstance(value, Mapping) and isinstance(current, dict):
            _merge(current, value)
        else:
            table[key] = _copy(value)


def _copy(value: object) -> object:
    if isinstance(value, Mapping):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(item) for item in value]
    return value


# --- from plain data back into the document --------------------------------------------------


def _reconcile(table: Container | Table | InlineTable, target: Mapping[str, Any]) -> None:
    """Make ``table`` say ``target`` with the fewest edits."""
    for key in [key for key in table if key not in target]:
        del table[key]
    for key, value in target.items():
        current = table.get(key)
        if isinstance(value, Mapping) and isinstance(current, Table | InlineTable):
            _reconcile(current, value)
        elif current is None or not _same(_plain(current), value):
            table[key] = _toml(value)


def _toml(value: object) -> object:
    """A new value for the document: a mapping becomes a table (containerd's own style); one
    that only holds tables gets no header of its own."""
    if isinstance(value, Mapping):
        only_tables = bool(value) and all(isinstance(v, Mapping) for v in value.values())
        table = tomlkit.table(is_super_table=only_tables)
        for key, item in value.items():
            table[key] = _toml(item)
        return table
    return value


def _same(a: object, b: object) -> bool:
    """Equal values of equal types (``True == 1`` and ``1 == 1.0`` in Python, not in TOML)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _plain(item: object) -> object:
    return item.unwrap() if isinstance(item, Item | Container) else item


def _kind(value: object) -> str:
    kinds = {str: "a string", bool: "a boolean", int: "an integer", float: "a float"}
    return kinds.get(type(value), "a list" if isinstance(value, list) else "a value")


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())
