"""The agent's own binary keeps its previous content beside it when an OSC replaces it."""

from __future__ import annotations

import os
from pathlib import Path

from node_agent.host.fs import HostFS


def test_keep_previous_links_the_old_file_and_replaces_an_older_copy(tmp_path: Path) -> None:
    fs = HostFS(tmp_path)
    target = tmp_path / "opt/bin/gardener-node-agent"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"v1")
    target.chmod(0o755)
    (tmp_path / "opt/bin/gardener-node-agent.previous").write_bytes(b"v0")
    assert fs.keep_previous("/opt/bin/gardener-node-agent") is True
    previous = tmp_path / "opt/bin/gardener-node-agent.previous"
    assert previous.read_bytes() == b"v1"
    assert os.stat(previous).st_ino == os.stat(target).st_ino  # a link, not a copy
    fs.write_atomic("/opt/bin/gardener-node-agent", b"v2", 0o755)
    assert target.read_bytes() == b"v2"
    assert previous.read_bytes() == b"v1"
    assert oct(previous.stat().st_mode & 0o7777) == "0o755"
    assert sorted(p.name for p in target.parent.iterdir()) == [
        "gardener-node-agent",
        "gardener-node-agent.previous",
    ]


def test_keep_previous_of_nothing_keeps_nothing(tmp_path: Path) -> None:
    fs = HostFS(tmp_path)
    assert fs.keep_previous("/opt/bin/missing") is False
    (tmp_path / "opt/bin").mkdir(parents=True)
    os.symlink("/etc/passwd", tmp_path / "opt/bin/link")
    assert fs.keep_previous("/opt/bin/link") is False
    assert not (tmp_path / "opt/bin/link.previous").exists()
