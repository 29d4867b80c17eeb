"""Which config file a ``--config-dir`` holds, and its bytes, decided without the config's models.

Why a module of its own: ``run`` names its config file in its very first log line, before the
pydantic models of :mod:`node_agent.config` are imported (a large part of a start's CPU).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from node_agent.base import versions
from node_agent.base.errors import ConfigError

#: the most a config file may hold. Gardener's are about 1 KiB; upstream reads any size, but a
#: file this large is no config, and reading it as Go reads YAML costs seconds and tens of MB.
MAX_CONFIG_BYTES = 256 * 1024

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
}

#: ``config-<version>.yaml`` with all three numbers, in ASCII (read by :mod:`.versions`)
_VERSIONED_CONFIG = re.compile(r"config-(v?[0-9]+\.[0-9]+\.[0-9]+(?:[-+].*)?)\.yaml")


def config_version_key(name: str) -> tuple[Any, ...] | None:
    """Sort key of ``config-<version>.yaml`` by semantic version precedence; None for any
    other name (one whose version is no semantic version in ASCII digits included)."""
    match = _VERSIONED_CONFIG.fullmatch(name)
    if match is None:
        return None
    try:
        return versions.precedence(versions.semver(match.group(1)))
    except versions.VersionError:
        return None


def config_release(name: str) -> str | None:
    """The Gardener release in a config file's name (``config-v1.145.0.yaml``: ``v1.145.0``);
    None for any other name (``config.yaml``), or one whose version is no semantic version."""
    if config_version_key(name) is None:
        return None
    match = _VERSIONED_CONFIG.fullmatch(name)
    assert match is not None
    version = match.group(1)
    return version if version.startswith("v") else f"v{version}"


def find_config(config_dir: Path) -> Path:
    """The agent's config in ``config_dir`` (upstream's ``--config-dir``).

    Gardener writes ``config-<gardener version>.yaml``; upstream's binary reads the one named
    after its own version. We carry no Gardener version, so during an upgrade (the new file
    written, the old one not yet deleted) the highest semantic version wins, never a lexical
    sort. Only regular files count (a symlink is not followed: nothing planted there decides
    which config runs). Without any versioned file, the standalone ``config.yaml``.
    """
    try:
        with os.scandir(config_dir) as entries:
            found = [(e.name, e.is_file(follow_symlinks=False), e.is_file()) for e in entries]
    except OSError as exc:
        raise ConfigError(f"cannot read config dir {config_dir}: {exc.strerror}") from exc
    names = [name for name, _regular, is_file in found if is_file]
    regular = [name for name, is_regular, _ in found if is_regular]
    keyed = [(key, name) for name in regular if (key := config_version_key(name)) is not None]
    if keyed:
        return config_dir / max(keyed)[1]
    if "config.yaml" in names:
        return config_dir / "config.yaml"
    raise ConfigError(f"no config-<version>.yaml or config.yaml in {config_dir}")


def read_config_file(path: Path) -> bytes:
    """The bytes of the config file at ``path`` (a symlink is followed, as upstream does).

    Only a regular file of at most :data:`MAX_CONFIG_BYTES` is read: a FIFO would block the
    reader for ever (``status`` too), a device could be endless, and a directory is no file.
    It is looked at before it is opened (opening some devices has effects) and once more
    through the open descriptor, which is opened non-blocking, so a file swapped in between
    is refused the same way. Every refusal is a ``ConfigError`` naming the file, in one line.
    """
    try:
        before = os.stat(path)
        if not stat.S_ISREG(before.st_mode):
            raise ConfigError(f"config {path} is not a regular file ({_kind(before)})")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"config {path} is not a regular file ({_kind(st)})")
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_CONFIG_BYTES:
            chunk = os.read(fd, MAX_CONFIG_BYTES + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"config {path} is larger than {MAX_CONFIG_BYTES // 1024} KiB (no config is; "
            "Gardener's are about 1 KiB)"
        )
    return b"".join(chunks)


def _kind(st: os.stat_result) -> str:
    return _KINDS.get(stat.S_IFMT(st.st_mode), "not a file")
