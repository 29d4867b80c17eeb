"""A claim never makes the agent delete what it cannot show it wrote.

The progress file of a journal (``last-computed-osc-changes.done.json``) and ``inventory.json``
are forged here as root or a corrupt disk could leave them: claims for ``/etc/passwd``, an
operator's file, the agent's kubeconfig, the cluster's CA and config, and a file the agent found
marked "created". Neither the orphan sweep of the next apply nor ``reset`` deletes any of them,
and each claim not taken as it is gets said.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from node_agent.apply.applier import Applier
from node_agent.base import layout
from node_agent.base.layout import AGENT_UNIT, unit_path
from node_agent.commands.reset import reset_node
from node_agent.host.documents import Claim
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from node_agent.osc.applied import Applied, AppliedFile, AppliedUnit
from node_agent.osc.plan import ChangeSet, FileWrite
from tests.unit.fakes import ACTIVE, FakeSystemd

PASSWD = "/etc/passwd"
OPERATOR = "/etc/operator.conf"
OPERATOR_UNIT = unit_path("operator.service")
KUBECONFIG = layout.KUBECONFIG_FILE
CA = f"{layout.BASE_DIR}/cluster-ca.crt"
CONFIG = f"{layout.BASE_DIR}/config-v1.150.0.yaml"
PRE = "/etc/pre.conf"  # found on the node; the OSC overwrote it
OURS = "/etc/app/ours.conf"  # created by the agent, named by the last applied OSC
EDITED = "/etc/app/edited.conf"  # created by the agent, changed by an operator since
EDITED_UNIT = unit_path("edited.service")  # the same, a unit
FOREIGN = (PASSWD, OPERATOR, OPERATOR_UNIT, KUBECONFIG, CA, CONFIG)

BYTES = {
    PASSWD: b"root:x:0:0:root:/root:/bin/sh\n",
    OPERATOR: b"the operator's\n",
    OPERATOR_UNIT: b"[Service]\nExecStart=/bin/true\n",
    KUBECONFIG: b"apiVersion: v1\nkind: Config\n",
    CA: b"-----BEGIN CERTIFICATE-----\n",
    CONFIG: b"kind: NodeAgentConfiguration\n",
    PRE: b"written by the OSC\n",
    OURS: b"ours\n",
    EDITED: b"as the agent wrote it\n",
    EDITED_UNIT: b"[Service]\nExecStart=/bin/agent-wrote-this\n",
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def claim(path: str, *, kind: str = "file") -> Claim:
    return Claim("unit" if kind == "unit" else "file", path, sha(BYTES[path]), 0o644)


def entry(path: str, *, created: bool = True, digest: str | None = "exact") -> dict[str, object]:
    """An inventory entry as JSON; ``digest`` "exact" is the sha256 of what is on disk now."""
    kind = "unit" if path.startswith(layout.UNIT_DIR + "/") else "file"
    sha256 = sha(BYTES[path]) if digest == "exact" else digest
    return {"kind": kind, "created": created, "sha256": sha256, "mode": 0o644}


def state(root: Path, name: str) -> Path:
    return root / layout.BASE_DIR.lstrip("/") / name


@pytest.fixture
def node(tmp_path: Path) -> Path:
    """A node the agent applied one OSC to (PRE, OURS, EDITED, EDITED_UNIT), with the
    operator's and the system's own files and the agent's credentials beside them."""
    fs = HostFS(tmp_path)
    for path, data in BYTES.items():
        fs.write_atomic(path, data, 0o644)
    store = StateStore(fs)
    files = {p: AppliedFile(mode=0o644, sha256=sha(BYTES[p])) for p in (PRE, OURS, EDITED)}
    unit = AppliedUnit(name="edited.service", content=BYTES[EDITED_UNIT].decode())
    store.save_last_applied(b"osc", applied=Applied(files=files, units={unit.name: unit}))
    store.claim([claim(PRE)], created=False)
    store.claim([claim(OURS), claim(EDITED), claim(EDITED_UNIT, kind="unit")], created=True)
    (tmp_path / EDITED.lstrip("/")).write_bytes(b"changed by the operator\n")
    (tmp_path / EDITED_UNIT.lstrip("/")).write_bytes(b"[Service]\nExecStart=/bin/operator\n")
    return tmp_path


def forge_progress(root: Path) -> None:
    """A progress file of no journal on disk claiming every foreign file, with its exact digest,
    and the found PRE, as created by the agent."""
    claims = {path: entry(path) for path in (*FOREIGN, PRE)}
    doc = {"version": 1, "id": "forged", "claims": claims}
    state(root, layout.CHANGES_DONE).write_text(json.dumps(doc))


def forge_inventory(root: Path, entries: dict[str, dict[str, object]]) -> None:
    doc = json.loads(state(root, layout.INVENTORY).read_text())
    doc["entries"].update(entries)
    state(root, layout.INVENTORY).write_text(json.dumps(doc))


def untouched(root: Path, *paths: str) -> None:
    for path in paths:
        assert (root / path.lstrip("/")).read_bytes() == BYTES[path], path


def sweeper(root: Path, systemd: FakeSystemd | None = None) -> Applier:
    fs = HostFS(root)
    return Applier(fs, StateStore(fs), systemd, host_name="h", agent_unit=AGENT_UNIT)


def test_forged_claims_are_dropped_or_taken_as_found_and_said(node: Path) -> None:
    forge_progress(node)
    store = StateStore(HostFS(node))
    inv = store.inventory()
    for path in FOREIGN:  # named by no change set or applied OSC
        assert path not in inv.entries, path
    assert not inv.owns(PRE)  # found there: a claim does not make it the agent's
    assert inv.owns(OURS)
    notes = store.take_set_aside()
    assert len(notes) == 2
    assert all(path in notes[0] for path in FOREIGN)
    assert "6 claim(s)" in notes[0]
    assert "no change set or applied OSC" in notes[0]
    assert PRE in notes[1]


async def test_the_orphan_sweep_deletes_nothing_a_forged_progress_file_claims(
    node: Path,
) -> None:
    forge_progress(node)
    systemd = FakeSystemd({"edited.service": ACTIVE, "operator.service": ACTIVE})
    removed = await sweeper(node, systemd).remove_orphans(Applied())
    assert removed == [OURS]  # the one leftover the agent can show it wrote
    untouched(node, *FOREIGN, PRE)
    assert (node / EDITED.lstrip("/")).read_bytes() == b"changed by the operator\n"
    assert (node / EDITED_UNIT.lstrip("/")).exists()
    assert systemd.calls == []  # neither unit is the agent's: not stopped, not disabled
    left = StateStore(HostFS(node)).inventory().entries
    assert EDITED not in left  # not the agent's any more: forgotten
    assert EDITED_UNIT not in left


async def test_reset_deletes_nothing_a_forged_progress_file_claims(node: Path) -> None:
    forge_progress(node)
    lines: list[str] = []
    await reset_node(node, None, out=lines.append)
    assert not (node / OURS.lstrip("/")).exists()
    untouched(node, PASSWD, OPERATOR, OPERATOR_UNIT, CA, CONFIG, PRE)
    assert f"kept file {EDITED}: its content is not what the agent wrote" in lines
    assert f"kept unit {EDITED_UNIT}: its content is not what the agent wrote" in lines
    # the credentials go by name, as always; never as a claimed "file"
    assert f"removed {KUBECONFIG}" in lines
    assert f"removed file {KUBECONFIG}" not in lines


async def test_the_orphan_sweep_deletes_nothing_of_its_own_or_unproven_a_forged_inventory_names(
    node: Path,
) -> None:
    """inventory.json carries the same lie: the sweep never removes anything in the agent's own
    directory (even a CA an applied OSC named), and only the bytes recorded for an entry."""
    forge_inventory(
        node,
        {path: entry(path) for path in (KUBECONFIG, CA, CONFIG)}
        | {
            PASSWD: entry(PASSWD, digest=sha(b"what a corrupt record says")),
            OPERATOR: entry(OPERATOR, digest=None),
            OPERATOR_UNIT: entry(OPERATOR_UNIT, digest=sha(b"another unit")),
        },
    )
    store = StateStore(HostFS(node))
    last = store.load_last_applied()
    assert last is not None
    assert last.applied is not None
    files = {**last.applied.files, CA: AppliedFile(mode=0o644, sha256=sha(BYTES[CA]))}
    store.save_last_applied(b"osc", applied=last.applied.model_copy(update={"files": files}))
    systemd = FakeSystemd({"operator.service": ACTIVE})
    assert await sweeper(node, systemd).remove_orphans(Applied()) == [OURS]
    untouched(node, *FOREIGN)
    assert systemd.calls == []  # the operator's unit is neither stopped nor disabled


async def test_reset_deletes_nothing_of_its_own_or_unproven_a_forged_inventory_names(
    node: Path,
) -> None:
    """reset takes back every created entry of inventory.json (bootstrap's units too, which no
    OSC names), but never the agent's own directory, and only the bytes recorded."""
    forge_inventory(
        node,
        {
            CA: entry(CA),
            CONFIG: entry(CONFIG),
            PASSWD: entry(PASSWD, digest=sha(b"what a corrupt record says")),
            OPERATOR: entry(OPERATOR, digest=None),
        },
    )
    lines: list[str] = []
    await reset_node(node, None, out=lines.append)
    untouched(node, CA, CONFIG, PASSWD, OPERATOR, PRE)
    assert f"kept file {PASSWD}: its content is not what the agent wrote" in lines
    assert any(line.startswith(f"kept file {CA}: it is in the agent's own") for line in lines)
    assert any(line.startswith(f"kept file {OPERATOR}: no digest recorded") for line in lines)


async def test_the_sweep_leaves_the_agents_own_unit_to_reset(node: Path) -> None:
    fs = HostFS(node)
    agent = unit_path(AGENT_UNIT)
    text = b"[Service]\nExecStart=/opt/bin/gardener-node-agent\n"
    StateStore(fs).claim([Claim("unit", agent, sha(text), 0o644)])
    fs.write_atomic(agent, text, 0o644)
    systemd = FakeSystemd({AGENT_UNIT: ACTIVE})
    assert await sweeper(node, systemd).remove_orphans(Applied()) == [OURS]
    assert (node / agent.lstrip("/")).exists()
    assert systemd.calls == []
    assert StateStore(fs).owns(agent)


async def test_claims_of_a_readable_journal_are_held_to_it(node: Path) -> None:
    """With the journal there, a claim must be for a path its change set (or an applied record)
    names, and a path the journal saw before its first write stays "found"."""
    fs = HostFS(node)
    found = "/etc/found.conf"
    fs.write_atomic(found, b"the operator's\n", 0o644)
    new = "/etc/app/new.conf"
    store = StateStore(fs)
    cs = ChangeSet(
        files_to_write=tuple(
            FileWrite(path=p, mode=0o644, content=b"n\n", sha256=sha(b"n\n"), reason="r")
            for p in (found, new)
        )
    )
    pending = store.begin(cs, "c" * 64)
    assert found in pending.preexisting
    for path in (found, new):
        fs.write_atomic(path, b"n\n", 0o644)
    claims = {p: {"kind": "file", "created": True, "sha256": sha(b"n\n")} for p in (found, new)}
    claims[PASSWD] = entry(PASSWD)
    doc = {"version": 1, "id": pending.id, "claims": claims}
    state(node, layout.CHANGES_DONE).write_text(json.dumps(doc))
    after = StateStore(fs)
    inv = after.inventory()
    assert PASSWD not in inv.entries
    assert inv.owns(new)
    assert not inv.owns(found)
    assert len(after.take_set_aside()) == 2
    assert await sweeper(node).remove_orphans(Applied()) == [new, OURS]
    assert (node / "etc/found.conf").exists()
    untouched(node, PASSWD)


async def test_a_leftover_that_did_not_stop_is_tried_again_by_the_next_sweep(
    node: Path,
) -> None:
    fs = HostFS(node)
    text = b"[Service]\nExecStart=/bin/old\n"
    old = unit_path("old.service")
    store = StateStore(fs)
    unit = AppliedUnit(name="old.service", content=text.decode())
    store.save_last_applied(b"osc old", applied=Applied(units={unit.name: unit}))
    store.claim([Claim("unit", old, sha(text), 0o600)])
    fs.write_atomic(old, text, 0o600)
    systemd = FakeSystemd({"old.service": ACTIVE}, failing={"old.service"})
    applier = sweeper(node, systemd)
    assert old not in await applier.remove_orphans(Applied())
    assert (node / old.lstrip("/")).exists()
    await applier.state.save_last_applied_async(b"osc new", applied=Applied())  # names it no more
    systemd.failing.clear()
    assert old in await applier.remove_orphans(Applied())
    assert not (node / old.lstrip("/")).exists()


def test_what_is_said_of_untrusted_claims_is_bounded(node: Path) -> None:
    long = "/etc/a" + "x" * 10_000  # sorted first: shown, cut
    many = [f"/etc/forged/{i:02d}" for i in range(30)] + [long]
    claims = {path: {"kind": "file", "created": True, "sha256": "0" * 64} for path in many}
    doc = {"version": 1, "id": "forged", "claims": claims}
    state(node, layout.CHANGES_DONE).write_text(json.dumps(doc))
    store = StateStore(HostFS(node))
    assert not set(many) & set(store.inventory().entries)
    (note,) = store.take_set_aside()
    assert note.startswith(f"31 claim(s) in {layout.BASE_DIR}/{layout.CHANGES_DONE} not trusted")
    assert note.endswith(" ...")
    assert long[:200] + "..." in note
    assert len(note) < 2_000
