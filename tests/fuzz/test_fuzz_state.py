"""Fuzz: the agent's state directory as a crash, a full disk or a hand left it.

Each state document (the journal, its progress file and claims, the inventory, the last applied
OSC's meta, the last apply's status, the in-place record, the history) is written as JSON shaped
like the real one with hostile values, or damaged, deep, huge or not JSON at all. Every reader
of the state store and the offline ``status`` document must take it without an exception
(an unusable document is set aside, never raised), and ``status`` shows no control character.

Then ``reset`` on that node (no systemd): it may report a typed host error, but it must remove
the agent's credentials in any case (issue 33, finding 3) and never a file whose content is not
what its claim says (finding 5). And the self-update guard (``sh``, in a throwaway directory)
must fall back to the previous binary after its threshold whatever its start counter held
(finding 8).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example as explicit
from hypothesis import given
from hypothesis import strategies as st

from node_agent.base import layout
from node_agent.base.digest import sha256_hex
from node_agent.commands import show_history, status
from node_agent.commands.reset import reset_node
from node_agent.controllers.osc.health_gate import GateRecord
from node_agent.controllers.osc.inplace import InPlaceRecord
from node_agent.host import selfupdate
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from tests.fuzz import harness
from tests.fuzz.harness import bounded, budget, expect, only
from tests.fuzz.strategies import state_bytes, state_documents

#: a failure takes minutes to shrink; a pass takes seconds
pytestmark = pytest.mark.timeout(900)

STATE = layout.BASE_DIR.lstrip("/")


@st.composite
def state_dirs(draw: st.DrawFn) -> dict[str, bytes]:
    docs = draw(state_documents())
    return {name: draw(state_bytes(doc)) for name, doc in docs.items()}


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory for the examples' node roots (one each, removed after it)."""
    base = tmp_path_factory.mktemp("fuzz-state")
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _plant(root: Path, files: dict[str, bytes]) -> None:
    state = root / STATE
    state.mkdir(parents=True, exist_ok=True)
    for name, raw in files.items():
        (state / name).write_bytes(raw)


def _no_controls(text: str) -> bool:
    return all(ch == "\n" or unicodedata.category(ch) not in ("Cc", "Cf") for ch in text)


def read_everything(root: Path) -> None:
    store = StateStore(HostFS(root))
    with only(harness.STATE, "state store"):
        store.load_last_applied()
        store.applied_checksum()
        pending = store.pending()
        if pending is not None:
            pending.remaining()
        inventory = store.inventory()
        for path in list(inventory.entries)[:20]:
            store.owns(path)
        store.load_status()
        store.load_history()
        store._load(layout.IN_PLACE, InPlaceRecord)
        store._load(layout.HEALTH_GATE, GateRecord)
        store.take_set_aside()
    with only(harness.HISTORY, "status --history") as outcome:
        log, skipped = show_history.read_history(root)
    if outcome.refused is None:
        with only(harness.STATE, "status --history (render)"):
            text = show_history.render_history(log, skipped=skipped)
            json.dumps(show_history.history_document(log))
            expect(_no_controls(text), "status --history", lambda: f"a control character: {text!r}")
    with only(harness.STATE, "status (offline)"):
        doc = status.offline_document(root, None, "not running (fuzz)")
        json.dumps(doc)
        text = status.render(doc, now=1_800_000_000.0)
        expect(_no_controls(text), "status (offline)", lambda: f"a control character: {text!r}")


_PROGRESS_CLAIMING = json.dumps(
    {"version": 1, "id": "j1", "claims": {
        "/etc/passwd": {"kind": "file", "created": True, "sha256": "0" * 64},
        layout.KUBECONFIG_FILE: {"kind": "file", "created": True, "sha256": "0" * 64},
    }}
).encode()  # fmt: skip


@budget(short=60)
@explicit(files={layout.CHANGES_DONE: _PROGRESS_CLAIMING})
@explicit(files={layout.INVENTORY: b"[" * 100_000})
@given(files=state_dirs())
def test_every_reader_takes_any_state_directory(roots: Path, files: dict[str, bytes]) -> None:
    harness.example(files)
    root = roots / "node"
    shutil.rmtree(root, ignore_errors=True)
    _plant(root, files)
    with bounded("state load"):
        read_everything(root)
    shutil.rmtree(root, ignore_errors=True)


# -- reset on a planted node -------------------------------------------------------------------

FOREIGN = b"not the agent's\n"
MINE = b"mine\n"
#: what a node holds before reset: paths, and what is there (bytes, "dir" or "symlink")
_TREE: dict[str, Any] = {
    "/etc/passwd": FOREIGN,
    "/etc/operator.conf": FOREIGN,
    "/etc/a": MINE,
    f"{layout.UNIT_DIR}/a.service": MINE,
    f"{layout.UNIT_DIR}/a.service.d/10-a.conf": MINE,
    f"{layout.BASE_DIR}/cluster-ca.crt": FOREIGN,
    layout.KUBECONFIG_FILE: b"kubeconfig\n",
    layout.TOKEN_FILE: b"token\n",
    "/etc/dir-now": "dir",
    "/etc/linked": "symlink",
}


def _plant_tree(root: Path, layout_: dict[str, Any]) -> None:
    for path, what in layout_.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if what == "dir":
            (target / "inside").mkdir(parents=True, exist_ok=True)
        elif what == "symlink":
            (target.parent / "elsewhere").mkdir(exist_ok=True)
            (target.parent / "elsewhere" / "file").write_bytes(MINE)
            os.symlink("elsewhere", target)  # a parent that became a symlink (inside the root)
        else:
            target.write_bytes(what)


def _claim(path: str, created: bool, mine: bool) -> dict[str, Any]:
    digest = sha256_hex(MINE) if mine else sha256_hex(b"something else")
    kind = "unit" if path.endswith(".service") else "dropin" if path.endswith(".conf") else "file"
    return {"kind": kind, "created": created, "sha256": digest, "mode": 0o644}


_CLAIMS = st.dictionaries(
    st.sampled_from([*_TREE, "/etc/linked/file", "/etc/dir-now/x", "/etc/gone"]),
    st.tuples(st.booleans(), st.booleans()),
    max_size=8,
)


async def _reset(root: Path) -> list[str]:
    return await reset_node(root, None, out=lambda line: None, caller_units=set())


def reset_checks(root: Path, claims: dict[str, tuple[bool, bool]], in_progress: bool) -> None:
    with only(harness.RESET, "reset") as outcome:
        asyncio.run(_reset(root))
    ended = type(outcome.refused).__name__ if outcome.refused else "no error"
    for credential in layout.CREDENTIAL_FILES:
        expect(
            not os.path.lexists(root / credential.lstrip("/")),
            "reset credentials",
            f"{credential} is still there after reset ({ended}; issue 33, finding 3)",
        )
    for path, what in _TREE.items():
        if not isinstance(what, bytes) or what != FOREIGN:
            continue
        expect(
            (root / path.lstrip("/")).exists(),
            "reset foreign files",
            f"{path} (not what its claim says) was removed by reset (issue 33, finding 5)",
        )
    if not in_progress and claims.get("/etc/a") == (True, True):
        expect(  # an item reset cannot remove never keeps it from removing the others
            not os.path.lexists(root / "etc/a"),
            "reset goes on",
            f"/etc/a (created by the agent, its bytes) is still there after reset ({ended}; "
            "issue 33, finding 3)",
        )


def reset_run(roots: Path, claims: dict[str, tuple[bool, bool]], in_progress: bool) -> None:
    harness.example((claims, in_progress))
    root = roots / "reset"
    shutil.rmtree(root, ignore_errors=True)
    _plant_tree(root, _TREE)
    entries = {path: _claim(path, created, mine) for path, (created, mine) in claims.items()}
    if in_progress:  # the claims of an unfinished apply, in its progress file
        doc: dict[str, Any] = {"version": 1, "id": "j1", "claims": entries}
        _plant(root, {layout.CHANGES_DONE: json.dumps(doc).encode()})
    else:
        _plant(root, {layout.INVENTORY: json.dumps({"version": 1, "entries": entries}).encode()})
    with bounded("reset"):
        reset_checks(root, claims, in_progress)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize(
    ("claims", "in_progress"),
    [
        ({"/etc/dir-now": (True, True), "/etc/a": (True, True)}, False),
        ({"/etc/linked/file": (True, True), "/etc/a": (True, True)}, False),
        ({"/etc/passwd": (True, False)}, True),
        ({f"{layout.BASE_DIR}/cluster-ca.crt": (True, False)}, False),
    ],
    ids=[
        "created-file-now-a-directory",
        "parent-now-a-symlink",
        "progress-file-claims-etc-passwd",
        "inventory-claims-cluster-ca",
    ],
)
def test_reset_known_to_stop_or_remove_too_much(
    roots: Path, claims: dict[str, tuple[bool, bool]], in_progress: bool
) -> None:
    """Issue 33's findings 3 (reset stops at a path it cannot remove, credentials kept) and 5
    (a claim makes reset delete what is not the agent's)."""
    reset_run(roots, claims, in_progress)


@budget(short=40)
@given(claims=_CLAIMS, in_progress=st.booleans())
def test_reset_removes_the_credentials_and_nothing_foreign(
    roots: Path, claims: dict[str, tuple[bool, bool]], in_progress: bool
) -> None:
    reset_run(roots, claims, in_progress)


# -- the self-update guard's start counter ------------------------------------------------------


def _counters() -> st.SearchStrategy[bytes]:
    """What the start counter file may hold after a crash, a full disk or a hand."""
    return st.one_of(
        st.integers(0, 2**70).map(lambda n: str(n).encode()),
        st.sampled_from(
            [b"", b"\n", b"2\n", b"-1", b"+3", b" 3", b"3 ", b"0x10", b"1e3", b"9" * 40,
             str(2**63).encode(), str(2**63 - 1).encode(), str(2**64).encode(), b"\x00",
             "\u0663".encode()]
        ),
        st.binary(max_size=24),
    )  # fmt: skip


def guard_checks(base: Path, counter: bytes) -> None:
    """THRESHOLD + 1 starts in a row without the agent getting ready, whatever the counter held
    before: the previous binary must be back in place by then."""
    binary, previous = base / "agent", base / "agent.previous"
    binary.write_bytes(b"new, broken\n")
    previous.write_bytes(b"old, good\n")
    (base / layout.SELF_UPDATE_STARTS).write_bytes(counter)
    script = base / "guard.sh"
    script.write_bytes(selfupdate.guard_script(str(base)))
    for _ in range(selfupdate.THRESHOLD + 1):
        subprocess.run(["/bin/sh", str(script), str(binary)], capture_output=True, check=False)
    expect(
        binary.read_bytes() == b"old, good\n",
        "self-update guard",
        f"a start counter holding {counter[:40]!r} kept the guard from falling back after "
        f"{selfupdate.THRESHOLD + 1} starts (issue 33, finding 8)",
    )


def guard_run(roots: Path, counter: bytes) -> None:
    harness.example(counter)
    base = roots / "guard"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir()
    with bounded("self-update guard"):
        guard_checks(base, counter)
    shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize(
    "counter", [str(2**63).encode(), str(2**63 - 1).encode(), b"99999999999999999999"]
)
def test_a_start_counter_known_to_disable_the_guard(roots: Path, counter: bytes) -> None:
    """Issue 33's finding 8: 2**63 or more (and 2**63 - 1, whose next start overflows)."""
    guard_run(roots, counter)


@budget(short=15)
@given(counter=_counters())
def test_no_start_counter_disables_the_self_update_guard(roots: Path, counter: bytes) -> None:
    guard_run(roots, counter)
