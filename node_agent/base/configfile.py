"""Which config file a ``--config-dir`` holds, decided without the config's models.

Why a module of its own: ``run`` names its config file in its very first log line, before the
pydantic models of :mod:`node_agent.config` are imported (a large part of a start's CPU).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from node_agent.base.errors import ConfigError

_VERSIONED_CONFIG = re.compile(
    r"config-v?(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?\.yaml"
)


def _prerelease_key(text: str | None) -> tuple[int, tuple[tuple[int, int, str], ...]]:
    """Semver precedence of a prerelease: a release sorts after all of its prereleases; numeric
    identifiers compare as numbers and sort before alphanumeric ones."""
    if text is None:
        return (1, ())
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in text.split("."))
    return (0, parts)


def config_version_key(name: str) -> tuple[Any, ...] | None:
    """Sort key of ``config-<version>.yaml`` by semantic version; None for any other name."""
    match = _VERSIONED_CONFIG.fullmatch(name)
    if match is None:
        return None
    major, minor, patch, pre = match.groups()
    return (int(major), int(minor), int(patch), _prerelease_key(pre))


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
