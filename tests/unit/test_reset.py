"""``reset`` removes exactly what the agent created, stops first, and is idempotent."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs

from node_agent.base import layout
from node_agent.base.digest import sha256_hex
from node_agent.base.errors import NodeAgentError, ResetIncompleteError
from node_agent.cli import main
from node_agent.commands.reset import NOTHING_TO_DO, reset_node
from node_agent.host.documents import Claim, EntryKind
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore, claims_for
from node_agent.osc.plan import ChangeSet, FileWrite
from node_agent.systemd import client as systemd_client
from tests.unit.fakes import ACTIVE, FakeSystemd


def running(*units: str) -> dict[str, tuple[str, str]]:
    return dict.fromkeys(units, ACTIVE)


def _node(root: Path) -> None:
    """A node after an apply: two created files, a created unit, a drop-in on a distro unit,
    and a pre-existing file the OSC overwrote; each entry records the bytes written."""
    fs = HostFS(root)
    for path in ("/etc/demo/a.conf", "/etc/pre-existing.conf", "/usr/lib/systemd/system/x"):
        fs.write_atomic(path, b"x\n", 0o644)
    fs.write_atomic("/etc/systemd/system/demo.service", b"[Service]\n", 0o600)
    fs.write_atomic("/etc/systemd/system/containerd.service.d/10.conf", b"[Service]\n", 0o600)
    fs.write_atomic(f"{layout.BASE_DIR}/config-v1.150.0.yaml", b"kind: x\n", 0o600)
    fs.write_atomic(layout.TOKEN_FILE, b"secret", 0o600)
    store = StateStore(fs)
    store.claim([_claim("file", "/etc/pre-existing.conf", b"x\n")], created=False)
    store.claim(
        [
            _claim("file", "/etc/demo/a.conf", b"x\n"),
            _claim("unit", "/etc/systemd/system/demo.service", b"[Service]\n"),
            _claim("dropin", "/etc/systemd/system/containerd.service.d/10.conf", b"[Service]\n"),
        ],
        created=True,
    )


def _claim(kind: EntryKind, path: str, data: bytes) -> Claim:
    return Claim(kind, path, sha256_hex(data), 0o644 if kind == "file" else 0o600)


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
    new = FileWrite(
        path="/etc/demo/b.conf", mode=0o644, content=b"b", sha256=sha256_hex(b"b"), reason="r"
    )
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


async def test_a_unit_that_does_not_stop_keeps_its_files_and_the_rest_is_reset(
    tmp_path: Path,
) -> None:
    """A failed stop is named and makes reset fail, at the end: the unit keeps its unit file
    (and its inventory entry, for the next reset), everything else goes, credentials too."""
    _node(tmp_path)
    systemd = FakeSystemd(
        running("kubelet.service", "demo.service"), failing={"kubelet.service", "demo.service"}
    )
    lines: list[str] = []
    with pytest.raises(NodeAgentError, match=r"^reset incomplete: 2 item\(s\) not removed") as err:
        await reset_node(tmp_path, systemd, out=lines.append, caller_units=set())
    assert "kubelet.service" in str(err.value)
    assert "demo.service" in str(err.value)
    assert any(line.startswith("not stopped kubelet.service: ") for line in lines), lines
    assert (tmp_path / "etc/systemd/system/demo.service").exists()  # its unit did not stop
    assert not (tmp_path / "etc/demo/a.conf").exists()
    assert not (tmp_path / layout.TOKEN_FILE.lstrip("/")).exists()
    assert set(StateStore(HostFS(tmp_path)).inventory().entries) == {
        "/etc/systemd/system/demo.service"
    }
    systemd.failing.clear()
    again: list[str] = []
    await reset_node(tmp_path, systemd, out=again.append, caller_units=set())
    assert "removed unit /etc/systemd/system/demo.service" in again
    assert not (tmp_path / "etc/systemd/system/demo.service").exists()


def _obstacles(root: Path, outside: Path) -> None:
    """Two created files reset cannot remove: one is now a directory, the other sits under a
    parent that became a symlink (to a directory outside the node holding the same name)."""
    fs = HostFS(root)
    fs.write_atomic("/etc/linked/b.conf", b"b\n", 0o644)
    fs.write_atomic("/etc/zz/later.conf", b"z\n", 0o644)
    fs.write_atomic(layout.KUBECONFIG_FILE, b"kubeconfig", 0o600)
    fs.write_atomic(f"{layout.BASE_DIR}/{layout.STATUS}", b"{}", 0o644)
    StateStore(fs).claim(
        [
            _claim("file", "/etc/linked/b.conf", b"b\n"),
            _claim("file", "/etc/zz/later.conf", b"z\n"),
        ],
        created=True,
    )
    (root / "etc/demo/a.conf").unlink()
    (root / "etc/demo/a.conf").mkdir()
    (root / "etc/demo/a.conf/inside").write_text("not the agent's\n")
    (outside / "linked").mkdir(parents=True)
    (outside / "linked/b.conf").write_text("b\n")
    (root / "etc/linked/b.conf").unlink()
    (root / "etc/linked").rmdir()
    (root / "etc/linked").symlink_to(outside / "linked")


async def test_reset_goes_on_past_each_item_it_cannot_remove(tmp_path: Path) -> None:
    root, outside = tmp_path / "node", tmp_path / "outside"
    root.mkdir()
    _node(root)
    _obstacles(root, outside)
    lines: list[str] = []
    with capture_logs() as logs, pytest.raises(ResetIncompleteError) as err:
        await reset_node(root, FakeSystemd({}), out=lines.append, caller_units=set())
    message = str(err.value)
    assert message.startswith("reset incomplete: 2 item(s) not removed"), message
    assert [item for item, _ in err.value.items] == ["/etc/demo/a.conf", "/etc/linked/b.conf"]
    assert "/etc/demo/a.conf" in message
    assert "/etc/linked/b.conf" in message
    # each named on its own line and in its own log event
    assert [line.split(":")[0] for line in lines if line.startswith("not removed")] == [
        "not removed file /etc/demo/a.conf",
        "not removed file /etc/linked/b.conf",
    ]
    events = [e for e in logs if e["event"] == "not removed"]
    assert [e["path"] for e in events] == ["/etc/demo/a.conf", "/etc/linked/b.conf"]
    assert all(e["log_level"] == "error" and e["error"] for e in events)
    # everything after them was done
    assert not (root / "etc/zz/later.conf").exists()
    assert not (root / "etc/systemd/system/demo.service").exists()
    assert not (root / "etc/systemd/system/containerd.service.d").exists()
    assert not (root / layout.TOKEN_FILE.lstrip("/")).exists()
    assert not (root / layout.KUBECONFIG_FILE.lstrip("/")).exists()
    assert not (root / layout.BASE_DIR.lstrip("/") / layout.STATUS).exists()
    # nothing it did not write, nothing outside the node
    assert (root / "etc/demo/a.conf/inside").exists()
    assert (outside / "linked/b.conf").read_text() == "b\n"
    assert (root / "etc/pre-existing.conf").exists()
    # the inventory keeps exactly what is left, so the next reset tries again
    left = StateStore(HostFS(root)).inventory().entries
    assert set(left) == {"/etc/demo/a.conf", "/etc/linked/b.conf"}

    again: list[str] = []
    with pytest.raises(NodeAgentError, match=r"^reset incomplete: 2 item\(s\)"):
        await reset_node(root, FakeSystemd({}), out=again.append, caller_units=set())
    assert [line.split(":")[0] for line in again] == [
        "not removed file /etc/demo/a.conf",
        "not removed file /etc/linked/b.conf",
    ]

    shutil.rmtree(root / "etc/demo/a.conf")  # the operator clears the way
    (root / "etc/linked").unlink()
    last: list[str] = []
    await reset_node(root, FakeSystemd({}), out=last.append, caller_units=set())
    assert f"removed {layout.BASE_DIR}/{layout.INVENTORY}" in last
    assert not (root / layout.BASE_DIR.lstrip("/") / layout.INVENTORY).exists()
    assert (outside / "linked/b.conf").exists()


async def test_reset_removes_the_credentials_whatever_fails_before(tmp_path: Path) -> None:
    """Even an error of a kind reset does not expect leaves no token on the node."""
    _node(tmp_path)
    HostFS(tmp_path).write_atomic(layout.KUBECONFIG_FILE, b"kubeconfig", 0o600)

    class Broken(FakeSystemd):
        async def daemon_reload(self) -> None:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await reset_node(tmp_path, Broken({}), out=lambda _: None, caller_units=set())
    assert not (tmp_path / layout.TOKEN_FILE.lstrip("/")).exists()
    assert not (tmp_path / layout.KUBECONFIG_FILE.lstrip("/")).exists()


async def test_reset_never_follows_a_symlink_to_the_unpacked_copies(tmp_path: Path) -> None:
    root, outside = tmp_path / "node", tmp_path / "outside"
    (outside / "node-agent/0123abcd").mkdir(parents=True)
    (outside / "node-agent/0123abcd/keep").write_text("someone else's\n")
    (root / "var").mkdir(parents=True)
    (root / "var/cache").symlink_to(outside)
    lines: list[str] = []
    with pytest.raises(NodeAgentError, match=layout.UNPACK_ROOT):
        await reset_node(root, None, out=lines.append)
    assert (outside / "node-agent/0123abcd/keep").exists()
    assert not any(line.startswith("removed unpacked") for line in lines), lines


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
    text = f"[Service]\nExecStart={exec_start}\n".encode()
    fs.write_atomic(unit, text, 0o644)
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
        StateStore(fs).claim([_claim("unit", unit, text)], created=True)
    lines: list[str] = []
    await reset_node(tmp_path, None, out=lines.append)
    assert (not binary.is_symlink() and not binary.exists()) is removed
    # the kept copy goes whenever the unit is the agent's (it is always a regular file)
    assert (tmp_path / "opt/bin/gardener-node-agent.previous").exists() is not in_inventory
    assert not unpacked.parent.exists()  # the launcher's copies go in any case
    assert ("removed /opt/bin/gardener-node-agent" in lines) is removed


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """The command configures logging for the process, onto a stream capsys closes: the
    configuration of before is put back."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**config)
    root.handlers[:], root.level = handlers, level


@pytest.mark.usefixtures("logging_restored")
def test_the_reset_command_logs_one_json_event_per_item_and_prints_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As the agent does, ``node-agent reset`` logs JSON by default (on stderr: stdout has the
    lines for people): one event for each item kept or not removed, naming it."""
    root, outside = tmp_path / "node", tmp_path / "outside"
    root.mkdir()
    _node(root)
    _obstacles(root, outside)
    (root / "etc/pre-existing.conf").write_bytes(b"changed\n")
    StateStore(HostFS(root)).claim([_claim("file", "/etc/edited.conf", b"x\n")], created=True)
    (root / "etc/edited.conf").write_bytes(b"the operator's\n")
    monkeypatch.setattr(systemd_client, "Systemd", lambda _address: FakeSystemd({}))

    assert main(["reset", "--root", str(root)]) == 1

    captured = capsys.readouterr()
    assert "not removed file /etc/demo/a.conf: remove /etc/demo/a.conf: Is a directory" in (
        captured.out.splitlines()
    )
    *events, last = captured.err.splitlines()
    assert last.startswith("node-agent: ResetIncompleteError: reset incomplete: 2 item(s)")
    logged = [json.loads(line) for line in events]
    assert [(e["event"], e["level"], e["path"]) for e in logged] == [
        ("not removed", "error", "/etc/demo/a.conf"),
        ("kept", "warning", "/etc/edited.conf"),
        ("not removed", "error", "/etc/linked/b.conf"),
    ]


async def test_reset_leaves_the_standalone_install_its_unit_reaches_through_a_symlink(
    tmp_path: Path,
) -> None:
    """The standalone install runs ``/opt/node-agent/current/bin/node-agent``, ``current`` a
    symlink to the release: no symlink is followed to remove it, and that is no failure."""
    fs = HostFS(tmp_path)
    unit = "/etc/systemd/system/gardener-node-agent.service"
    text = b"[Service]\nExecStart=/opt/node-agent/current/bin/node-agent run\n"
    fs.write_atomic(unit, text, 0o644)
    fs.write_atomic("/opt/node-agent/releases/v1/bin/node-agent", b"\x7fELF", 0o755)
    (tmp_path / "opt/node-agent/current").symlink_to("releases/v1")
    StateStore(fs).claim([_claim("unit", unit, text)], created=True)
    lines: list[str] = []
    await reset_node(tmp_path, None, out=lines.append)
    assert f"removed unit {unit}" in lines
    assert (tmp_path / "opt/node-agent/current/bin/node-agent").read_bytes() == b"\x7fELF"
