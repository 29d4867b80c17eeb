"""``reset`` removes exactly what the agent created, stops first, and is idempotent."""

from __future__ import annotations

from pathlib import Path

import pytest

from node_agent.base import layout
from node_agent.base.errors import SystemdError
from node_agent.commands.reset import NOTHING_TO_DO, reset_node
from node_agent.host.documents import Claim
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore, claims_for
from node_agent.osc.plan import ChangeSet, FileWrite
from tests.unit.fakes import ACTIVE, FakeSystemd


def running(*units: str) -> dict[str, tuple[str, str]]:
    return dict.fromkeys(units, ACTIVE)


def _node(root: Path) -> None:
    """A node after an apply: two created files, a created unit, a drop-in on a distro unit,
    and a pre-existing file the OSC overwrote."""
    fs = HostFS(root)
    for path in ("/etc/demo/a.conf", "/etc/pre-existing.conf", "/usr/lib/systemd/system/x"):
        fs.write_atomic(path, b"x\n", 0o644)
    fs.write_atomic("/etc/systemd/system/demo.service", b"[Service]\n", 0o600)
    fs.write_atomic("/etc/systemd/system/containerd.service.d/10.conf", b"[Service]\n", 0o600)
    fs.write_atomic(f"{layout.BASE_DIR}/config-v1.150.0.yaml", b"kind: x\n", 0o600)
    fs.write_atomic(layout.TOKEN_FILE, b"secret", 0o600)
    store = StateStore(fs)
    store.claim([Claim("file", "/etc/pre-existing.conf", None, None)], created=False)
    store.claim(
        [
            Claim("file", "/etc/demo/a.conf", None, None),
            Claim("unit", "/etc/systemd/system/demo.service", None, None),
            Claim("dropin", "/etc/systemd/system/containerd.service.d/10.conf", None, None),
        ],
        created=True,
    )


async def test_reset_removes_what_the_agent_created_and_nothing_else(tmp_path: Path) -> None:
    _node(tmp_path)
    systemd = FakeSystemd(
        running("gardener-node-agent.service", "kubelet.service", "demo.service"),
        enabled={"demo.service"},
    )
    lines: list[str] = []
    actions = await reset_node(tmp_path, systemd, out=lines.append, caller_units=set())
    assert systemd.calls == [
        ("stop", "gardener-node-agent.service"),
        ("stop", "kubelet.service"),
        ("stop", "demo.service"),
        ("disable", "demo.service"),
        ("daemon_reload",),
    ]
    assert actions == lines
    assert "removed empty directory /etc/systemd/system/containerd.service.d" in lines
    assert not (tmp_path / "etc/demo/a.conf").exists()
    assert not (tmp_path / "etc/systemd/system/demo.service").exists()
    assert not (tmp_path / "etc/systemd/system/containerd.service.d").exists()
    assert not (tmp_path / layout.TOKEN_FILE.lstrip("/")).exists()
    assert not (tmp_path / layout.BASE_DIR.lstrip("/") / layout.INVENTORY).exists()
    assert (tmp_path / "etc/pre-existing.conf").read_text() == "x\n"  # not the agent's
    assert (tmp_path / "usr/lib/systemd/system/x").exists()
    assert (tmp_path / layout.BASE_DIR.lstrip("/") / "config-v1.150.0.yaml").exists()

    again: list[str] = []
    assert await reset_node(tmp_path, systemd, out=again.append, caller_units=set()) == []
    assert again == [NOTHING_TO_DO]


async def test_reset_removes_what_an_unfinished_apply_created(tmp_path: Path) -> None:
    """An apply killed after a write: the file's entry is only in its journal's progress file
    (folded into ``inventory.json`` when an apply ends), and reset removes it too."""
    _node(tmp_path)
    fs = HostFS(tmp_path)
    new = FileWrite(path="/etc/demo/b.conf", mode=0o644, content=b"b", sha256=None, reason="r")
    store = StateStore(fs)
    pending = store.begin(ChangeSet(files_to_write=(new,)), "c" * 64)
    fs.write_atomic(new.path, b"b", 0o644)
    store.record_written(claims_for(pending.change_set))
    lines: list[str] = []
    await reset_node(tmp_path, FakeSystemd({}), out=lines.append, caller_units=set())
    assert not (tmp_path / "etc/demo/b.conf").exists()
    assert not (tmp_path / "etc/demo/a.conf").exists()
    assert (tmp_path / "etc/pre-existing.conf").exists()


async def test_reset_inside_the_agent_unit_does_not_stop_it(tmp_path: Path) -> None:
    _node(tmp_path)
    systemd = FakeSystemd(running("gardener-node-agent.service"))
    lines: list[str] = []
    await reset_node(
        tmp_path, systemd, out=lines.append, caller_units={"gardener-node-agent.service"}
    )
    assert ("stop", "gardener-node-agent.service") not in systemd.calls
    assert lines[0] == "not stopping gardener-node-agent.service: reset runs inside it"


async def test_reset_stops_before_deleting_and_a_failed_stop_deletes_nothing(
    tmp_path: Path,
) -> None:
    _node(tmp_path)
    systemd = FakeSystemd(running("kubelet.service"), failing={"kubelet.service"})
    with pytest.raises(SystemdError, match=r"^cannot stop kubelet.service: stop kubelet"):
        await reset_node(tmp_path, systemd, out=lambda _: None, caller_units=set())
    assert (tmp_path / "etc/demo/a.conf").exists()


async def test_reset_without_systemd_on_an_untouched_node(tmp_path: Path) -> None:
    lines: list[str] = []
    assert await reset_node(tmp_path, None, out=lines.append) == []
    assert lines == [NOTHING_TO_DO]


@pytest.mark.parametrize(
    ("exec_start", "in_inventory", "kind", "removed"),
    [
        (
            "/opt/bin/gardener-node-agent --config-dir=/var/lib/gardener-node-agent",
            True,
            "file",
            True,
        ),
        ("-/opt/bin/gardener-node-agent run", True, "file", True),
        (
            "/opt/bin/gardener-node-agent --config-dir=/x",
            False,
            "file",
            False,
        ),  # not the agent's unit
        ("/opt/bin/gardener-node-agent run", True, "symlink", False),  # standalone: bin/ symlink
    ],
)
async def test_reset_removes_the_agent_program_its_unit_names(
    tmp_path: Path, exec_start: str, in_inventory: bool, kind: str, removed: bool
) -> None:
    fs = HostFS(tmp_path)
    unit = "/etc/systemd/system/gardener-node-agent.service"
    fs.write_atomic(unit, f"[Service]\nExecStart={exec_start}\n".encode(), 0o644)
    binary = tmp_path / "opt/bin/gardener-node-agent"
    binary.parent.mkdir(parents=True)
    if kind == "file":
        binary.write_bytes(b"\x7fELF v2")
    else:
        (tmp_path / "opt/real").write_bytes(b"\x7fELF")
        binary.symlink_to(tmp_path / "opt/real")
    (tmp_path / "opt/bin/gardener-node-agent.previous").write_bytes(b"\x7fELF v1")
    unpacked = tmp_path / "var/cache/node-agent/0123abcd"
    unpacked.mkdir(parents=True)
    if in_inventory:
        StateStore(fs).claim([Claim("unit", unit, None, None)], created=True)
    lines: list[str] = []
    await reset_node(tmp_path, None, out=lines.append)
    assert (not binary.is_symlink() and not binary.exists()) is removed
    # the kept copy goes whenever the unit is the agent's (it is always a regular file)
    assert (tmp_path / "opt/bin/gardener-node-agent.previous").exists() is not in_inventory
    assert not unpacked.parent.exists()  # the launcher's copies go in any case
    assert ("removed /opt/bin/gardener-node-agent" in lines) is removed
