"""StateStore on a real temporary root: round trips, journal resume, inventory ownership."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from node_agent.base.layout import drop_in_path, unit_path
from node_agent.host.documents import ApplyRecord, Claim
from node_agent.host.fs import HostFS
from node_agent.host.state import (
    CHANGES,
    CHANGES_DONE,
    CORRUPT_SUFFIX,
    INVENTORY,
    LAST_APPLIED_META,
    LAST_APPLIED_OSC,
    STATE_DIR,
    STATUS,
    StateStore,
    claims_for,
)
from node_agent.osc.applied import Applied, AppliedFile, AppliedUnit, Owed
from node_agent.osc.plan import (
    ChangeSet,
    DropInDelete,
    DropInWrite,
    FileDelete,
    FileWrite,
    UnitCommand,
    UnitDelete,
    UnitWrite,
)
from node_agent.osc.steps import RELOAD, RELOAD_AFTER_DELETE, RELOAD_AFTER_ENABLE, step_ids


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    old = os.umask(0o000)  # state files must be private regardless
    try:
        yield tmp_path
    finally:
        os.umask(old)


@pytest.fixture
def fs(root: Path) -> HostFS:
    return HostFS(root)


@pytest.fixture
def store(fs: HostFS) -> StateStore:
    return StateStore(fs)


def state_file(root: Path, name: str) -> Path:
    return root / STATE_DIR.lstrip("/") / name


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fw(path: str, data: bytes, mode: int = 0o644) -> FileWrite:
    return FileWrite(path=path, mode=mode, content=data, sha256=sha(data), reason="new file")


def full_change_set() -> ChangeSet:
    return ChangeSet(
        files_to_write=(fw("/etc/a.conf", b"a"), fw("/opt/bin/tool", b"#!/bin/sh\n", 0o755)),
        files_to_delete=(FileDelete(path="/etc/old.conf", reason="removed"),),
        units_to_write=(UnitWrite(name="kubelet.service", content="[Unit]\n", reason="new"),),
        units_to_delete=(UnitDelete(name="gone.service", reason="removed"),),
        dropins_to_write=(
            DropInWrite(unit="containerd.service", name="10-x.conf", content="[S]\n", reason="n"),
        ),
        dropins_to_delete=(DropInDelete(unit="gone.service", name="50-y.conf", reason="r"),),
        units_to_enable=("kubelet.service",),
        units_to_disable=("gone.service",),
        unit_commands=(
            UnitCommand(
                unit="gardener-node-agent.service", action="restart", reasons=("x",), is_agent=True
            ),
            UnitCommand(unit="gone.service", action="stop", reasons=("r",), removed=True),
            UnitCommand(unit="kubelet.service", action="restart", reasons=("new",)),
        ),
    )


# --- step ids --------------------------------------------------------------------------------


def test_step_ids_order_and_scheme() -> None:
    assert step_ids(full_change_set()) == (
        "file:/etc/a.conf",
        "file:/opt/bin/tool",
        "unit:kubelet.service",
        "dropin:containerd.service/10-x.conf",
        "delete-dropin:gone.service/50-y.conf",
        "enable:kubelet.service",
        "disable:gone.service",
        RELOAD,
        "cmd:gone.service",
        "cmd:kubelet.service",
        "delete-unit:gone.service",
        RELOAD_AFTER_DELETE,
        "delete-file:/etc/old.conf",
        "cmd:gardener-node-agent.service",  # the agent restarts itself last of all
    )


def test_step_ids_reload_only_when_units_change() -> None:
    cs = ChangeSet(
        files_to_write=(fw("/etc/k", b"k"),),
        unit_commands=(UnitCommand(unit="k.service", action="restart", reasons=("k",)),),
    )
    assert step_ids(cs) == ("file:/etc/k", "cmd:k.service")
    assert step_ids(ChangeSet()) == ()


def test_step_ids_enable_a_unit_whose_unit_files_stay_after_its_command() -> None:
    """Re-asserting the enablement of a unit restarted for a changed file waits until after the
    restart (and reloads only when it changed a symlink); a unit whose unit file or drop-in is
    written, the agent's own unit, or a change set that reloads anyway keeps it before."""
    k = UnitCommand(unit="k.service", action="restart", reasons=("k",))
    cs = ChangeSet(files_to_write=(fw("/etc/k", b"k"),), units_to_enable=("k.service",),
                   unit_commands=(k,))  # fmt: skip
    assert cs.late_enables() == {"k.service"}
    assert step_ids(cs) == ("file:/etc/k", "cmd:k.service", "enable:k.service", RELOAD_AFTER_ENABLE)
    assert cs.rows()[-1] == ("enable", "k.service", "after its restart")
    drop_in = DropInWrite(unit="k.service", name="10-x.conf", content="[S]\n", reason="n")
    for early in (
        cs.model_copy(update={"dropins_to_write": (drop_in,)}),
        cs.model_copy(update={"reload": True}),
        cs.model_copy(update={"unit_commands": (k.model_copy(update={"is_agent": True}),)}),
    ):
        assert early.late_enables() == frozenset()
        assert step_ids(early).index("enable:k.service") < step_ids(early).index(RELOAD)
    assert full_change_set().late_enables() == frozenset()  # kubelet's unit file is written


# --- last applied ----------------------------------------------------------------------------


def test_last_applied_round_trip_with_private_modes(store: StateStore, root: Path) -> None:
    assert store.load_last_applied() is None
    raw = b"apiVersion: extensions.gardener.cloud/v1alpha1\nkind: OperatingSystemConfig\n"
    secrets = {"/var/lib/kubelet/token": b"\x00secret\xff", "/etc/x": b""}
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    store.save_last_applied(raw, secrets, applied_at=when)
    loaded = StateStore(HostFS(root)).load_last_applied()
    assert loaded is not None
    assert (loaded.raw, loaded.checksum, loaded.applied_at) == (raw, sha(raw), when)
    assert loaded.resolved == secrets
    assert state_file(root, LAST_APPLIED_OSC).read_bytes() == raw  # upstream-compatible: raw
    assert mode_of(state_file(root, LAST_APPLIED_OSC)) == 0o600
    assert mode_of(state_file(root, LAST_APPLIED_META)) == 0o600
    assert mode_of(root / STATE_DIR.lstrip("/")) == 0o755
    assert b"secret" not in state_file(root, LAST_APPLIED_META).read_bytes()  # base64, not raw


def test_last_applied_meta_of_another_osc_is_not_trusted(store: StateStore, root: Path) -> None:
    store.save_last_applied(b"osc: 1\n", {"/f": b"one"})
    # crash between the two writes of the next save: the yaml is new, the meta still old
    state_file(root, LAST_APPLIED_OSC).write_bytes(b"osc: 2\n")
    loaded = StateStore(HostFS(root)).load_last_applied()  # the agent after the crash
    assert loaded is not None
    assert (loaded.raw, loaded.checksum, loaded.resolved) == (b"osc: 2\n", sha(b"osc: 2\n"), None)


def test_last_applied_written_by_upstream_has_unknown_secrets(fs: HostFS, root: Path) -> None:
    fs.write_atomic(f"{STATE_DIR}/{LAST_APPLIED_OSC}", b"upstream\n", 0o600)
    loaded = StateStore(fs).load_last_applied()
    assert loaded is not None
    assert (loaded.checksum, loaded.resolved, loaded.applied_at) == (sha(b"upstream\n"), None, None)


def test_clear_last_applied(store: StateStore) -> None:
    store.save_last_applied(b"x")
    store.clear_last_applied()
    assert store.load_last_applied() is None


# --- journal ---------------------------------------------------------------------------------


def test_journal_begin_mark_resume_finish(store: StateStore, root: Path) -> None:
    cs = full_change_set()
    assert store.pending() is None
    began = store.begin(cs, "sum1")
    assert began.done == frozenset()
    assert mode_of(state_file(root, CHANGES)) == 0o600  # carries file contents
    store.mark_done("file:/etc/a.conf")
    store.mark_done("file:/opt/bin/tool", "unit:kubelet.service", "file:/etc/a.conf")

    resumed = StateStore(HostFS(root)).pending()  # a new process after a crash
    assert resumed is not None
    assert resumed.change_set == cs
    assert resumed.osc_checksum == "sum1"
    assert resumed.id == began.id
    assert resumed.done == {"file:/etc/a.conf", "file:/opt/bin/tool", "unit:kubelet.service"}
    assert resumed.remaining() == step_ids(cs)[3:]
    assert mode_of(state_file(root, CHANGES_DONE)) == 0o600

    store.finish()
    assert store.pending() is None
    assert StateStore(HostFS(root)).pending() is None
    assert not state_file(root, CHANGES).exists()
    assert not state_file(root, CHANGES_DONE).exists()


def test_mark_done_rejects_unknown_steps_and_missing_journal(store: StateStore) -> None:
    with pytest.raises(RuntimeError, match="begin"):
        store.mark_done("reload")
    store.begin(full_change_set(), "s")
    with pytest.raises(ValueError, match="file:/typo"):
        store.mark_done("file:/typo")
    before = store.pending()
    assert store.mark_done() == before  # nothing new: nothing written


def test_mark_done_is_idempotent_without_rewriting(store: StateStore, root: Path) -> None:
    store.begin(full_change_set(), "s")
    store.mark_done(RELOAD)
    path = state_file(root, CHANGES_DONE)
    os.utime(path, ns=(1, 1))
    store.mark_done(RELOAD)
    assert os.stat(path).st_mtime_ns == 1


def test_begin_replaces_a_pending_journal(store: StateStore, root: Path) -> None:
    store.begin(full_change_set(), "s1")
    store.mark_done("file:/etc/a.conf")
    store.begin(full_change_set(), "s2")
    fresh = StateStore(HostFS(root)).pending()
    assert fresh is not None
    assert (fresh.osc_checksum, fresh.done) == ("s2", frozenset())


def test_stale_progress_file_never_matches_a_new_journal(store: StateStore, root: Path) -> None:
    store.begin(full_change_set(), "s1")
    store.mark_done("file:/etc/a.conf")
    stale = state_file(root, CHANGES_DONE).read_bytes()
    store.finish()
    store.begin(full_change_set(), "s2")
    state_file(root, CHANGES_DONE).write_bytes(stale)  # e.g. a crash mid-finish, then a begin
    fresh = StateStore(HostFS(root)).pending()
    assert fresh is not None
    assert fresh.done == frozenset()


def test_progress_with_unknown_steps_is_filtered(store: StateStore, root: Path) -> None:
    began = store.begin(full_change_set(), "s")
    doc = {"version": 1, "id": began.id, "done": ["reload", "file:/not/in/the/set"]}
    state_file(root, CHANGES_DONE).write_text(json.dumps(doc))
    fresh = StateStore(HostFS(root)).pending()
    assert fresh is not None
    assert fresh.done == {"reload"}


class Crash(Exception):
    pass


def execute(store: StateStore, fs: HostFS, log: list[str], crash_after: int | None) -> None:
    """A miniature executor: does each remaining step, then marks it done; may 'crash' after
    doing step number ``crash_after`` but before recording it."""
    pending = store.pending()
    assert pending is not None
    cs = pending.change_set
    writes = {f"file:{f.path}": f for f in cs.files_to_write}
    deletes = {f"delete-file:{f.path}": f for f in cs.files_to_delete}
    for n, step in enumerate(pending.remaining()):
        if step in writes:
            f = writes[step]
            assert f.content is not None
            fs.write_atomic(f.path, f.content, f.mode)
            store.record_written([Claim("file", f.path, f.sha256, f.mode)])
        elif step in deletes and store.owns(deletes[step].path):
            fs.remove(deletes[step].path)
            store.release([deletes[step].path])
        log.append(step)
        if crash_after is not None and n == crash_after:
            raise Crash
        store.mark_done(step)


@pytest.mark.parametrize("crash_after", range(14))
def test_crash_at_any_step_resumes_and_converges(root: Path, crash_after: int) -> None:
    cs = full_change_set()
    # the file to delete was created by the agent in an earlier apply
    first = StateStore(HostFS(root))
    first.begin(ChangeSet(files_to_write=(fw("/etc/old.conf", b"old"),)), "s0")
    HostFS(root).write_atomic("/etc/old.conf", b"old", 0o644)
    first.record_written([Claim("file", "/etc/old.conf", None, 0o644)])
    first.finish()

    store = StateStore(HostFS(root))
    store.begin(cs, "s1")
    log: list[str] = []
    with pytest.raises(Crash):
        execute(store, HostFS(root), log, crash_after)

    restarted = StateStore(HostFS(root))  # a new process
    restarted.cleanup_temp_files()
    pending = restarted.pending()
    assert pending is not None
    assert pending.remaining()[0] == step_ids(cs)[crash_after]  # the interrupted step re-runs
    execute(restarted, HostFS(root), log, None)
    restarted.save_last_applied(b"osc s1")
    restarted.finish()

    steps = step_ids(cs)
    # every step ran, in order; only the interrupted one ran twice
    assert log == [*steps[: crash_after + 1], *steps[crash_after:]]
    assert (root / "etc/a.conf").read_bytes() == b"a"
    assert mode_of(root / "opt/bin/tool") == 0o755
    assert not (root / "etc/old.conf").exists()
    assert not restarted.owns("/etc/old.conf")
    assert restarted.pending() is None


# --- inventory -------------------------------------------------------------------------------


def test_claims_describe_what_was_written(store: StateStore, root: Path) -> None:
    cs = full_change_set()
    store.begin(cs, "s")
    assert StateStore(HostFS(root)).inventory().entries == {}  # nothing written yet
    store.record_written(claims_for(cs))  # the executor claims each path once it is written
    inv = StateStore(HostFS(root)).inventory()
    assert set(inv.entries) == {
        "/etc/a.conf",
        "/opt/bin/tool",
        unit_path("kubelet.service"),
        drop_in_path("containerd.service", "10-x.conf"),
    }
    assert inv.entries["/opt/bin/tool"].mode == 0o755
    assert inv.entries["/etc/a.conf"].sha256 == sha(b"a")
    assert inv.entries[unit_path("kubelet.service")].kind == "unit"
    assert inv.entries[unit_path("kubelet.service")].sha256 == sha(b"[Unit]\n")
    assert all(e.created for e in inv.entries.values())
    assert mode_of(state_file(root, INVENTORY)) == 0o600
    assert sorted(c.path for c in claims_for(cs)) == list(inv.entries)  # stored sorted


def test_preexisting_paths_are_never_owned(store: StateStore, fs: HostFS, root: Path) -> None:
    fs.write_atomic(unit_path("containerd.service"), b"[Unit]\ndistro\n", 0o644)
    fs.write_atomic("/etc/hosts", b"127.0.0.1 localhost\n", 0o644)
    cs = ChangeSet(
        files_to_write=(fw("/etc/hosts", b"mine"), fw("/etc/new", b"n")),
        units_to_write=(
            UnitWrite(name="containerd.service", content="[Unit]\nours\n", reason="r"),
        ),
        dropins_to_write=(
            DropInWrite(unit="containerd.service", name="10-x.conf", content="", reason="r"),
        ),
    )
    store.begin(cs, "s")  # records which paths existed before
    for claim in claims_for(cs):  # the executor writes after begin, then claims
        fs.write_atomic(claim.path, b"written", 0o644)
    store.record_written(claims_for(cs))
    fresh = StateStore(HostFS(root))
    assert not fresh.owns("/etc/hosts")
    assert not fresh.owns(unit_path("containerd.service"))  # a distro unit, overwritten
    assert fresh.owns(drop_in_path("containerd.service", "10-x.conf"))
    assert fresh.owns("/etc/new")
    assert not fresh.owns(unit_path("never-seen.service"))

    # re-applying (the files now exist) keeps each path's original flag
    fresh.begin(cs, "s2")
    fresh.record_written(claims_for(cs))
    assert fresh.owns("/etc/new")
    assert not fresh.owns("/etc/hosts")


def test_claim_updates_digest_release_forgets_and_adoption(store: StateStore, root: Path) -> None:
    store.claim([Claim("file", "/etc/f", sha(b"1"), 0o600)])
    store.claim([Claim("file", "/etc/f", sha(b"2"), 0o644)])
    entry = StateStore(HostFS(root)).inventory().entries["/etc/f"]
    assert (entry.sha256, entry.mode, entry.created) == (sha(b"2"), 0o644, True)
    store.release(["/etc/f", "/never/claimed"])
    assert not StateStore(HostFS(root)).owns("/etc/f")
    HostFS(root).write_atomic("/etc/upstream", b"u", 0o600)
    store.claim([Claim("file", "/etc/upstream", None, None)], created=True)  # adopt
    assert StateStore(HostFS(root)).owns("/etc/upstream")


def test_has_inventory(store: StateStore) -> None:
    assert not store.has_inventory()
    assert store.inventory().entries == {}
    store.begin(ChangeSet(), "s")  # even an empty apply marks the node as managed
    assert store.has_inventory()


def test_unchanged_inventory_is_not_rewritten(store: StateStore, root: Path) -> None:
    claims = [Claim("file", "/etc/f", sha(b"1"), 0o600)]
    store.claim(claims)
    os.utime(state_file(root, INVENTORY), ns=(1, 1))
    store.claim(claims)
    assert os.stat(state_file(root, INVENTORY)).st_mtime_ns == 1


def test_claims_during_a_journal_go_to_its_progress_and_into_the_inventory_at_its_end(
    store: StateStore, root: Path
) -> None:
    store.claim([Claim("file", "/etc/old", sha(b"o"), 0o644)])
    cs = ChangeSet(files_to_write=(fw("/etc/a.conf", b"a"),))
    pending = store.begin(cs, "s")
    os.utime(state_file(root, INVENTORY), ns=(1, 1))
    store.record_written(claims_for(cs))
    assert os.stat(state_file(root, INVENTORY)).st_mtime_ns == 1  # not rewritten before a restart
    progress = json.loads(state_file(root, CHANGES_DONE).read_bytes())
    assert progress["id"] == pending.id
    assert progress["claims"]["/etc/a.conf"]["sha256"] == sha(b"a")
    assert mode_of(state_file(root, CHANGES_DONE)) == 0o600
    assert store.owns("/etc/a.conf")
    assert StateStore(HostFS(root)).owns("/etc/a.conf")  # a crash now: read from the progress
    store.mark_done(*step_ids(cs))  # marking steps keeps the claims
    assert "/etc/a.conf" in json.loads(state_file(root, CHANGES_DONE).read_bytes())["claims"]

    store.save_last_applied(b"osc s")
    store.finish()
    on_disk = json.loads(state_file(root, INVENTORY).read_bytes())
    assert set(on_disk["entries"]) == {"/etc/a.conf", "/etc/old"}
    assert on_disk["folded"] == pending.id
    assert not state_file(root, CHANGES_DONE).exists()


def test_a_progress_file_left_by_a_crash_in_finish_is_not_folded_in_again(
    store: StateStore, root: Path
) -> None:
    cs = ChangeSet(files_to_write=(fw("/etc/a.conf", b"a"),))
    store.begin(cs, "s")
    store.record_written(claims_for(cs))
    store.mark_done(*step_ids(cs))
    left = state_file(root, CHANGES_DONE).read_bytes()
    store.save_last_applied(b"osc s")
    store.finish()
    state_file(root, CHANGES_DONE).write_bytes(left)  # the crash came before its removal
    after = StateStore(HostFS(root))
    assert after.pending() is None
    after.release(["/etc/a.conf"])  # the next OSC dropped it: deleted and forgotten
    assert not StateStore(HostFS(root)).owns("/etc/a.conf")


def test_claims_count_when_their_journal_cannot_be_read(store: StateStore, root: Path) -> None:
    """The journal is there but unreadable (set aside): its progress file's claims are the only
    record of what it wrote; they count, and go into ``inventory.json`` at once (a progress
    file without a journal is not trusted, so they must not hang on the one set aside)."""
    cs = ChangeSet(files_to_write=(fw("/etc/a.conf", b"a"),))
    store.begin(cs, "s")
    store.record_written(claims_for(cs))
    state_file(root, CHANGES).write_bytes(b"{not json")
    after = StateStore(HostFS(root))
    assert after.pending() is None
    assert after.owns("/etc/a.conf")  # the agent created it: a later OSC may remove it
    assert json.loads(state_file(root, INVENTORY).read_bytes())["entries"]["/etc/a.conf"]
    assert StateStore(HostFS(root)).owns("/etc/a.conf")  # a crash now: no journal, still known
    after.release(["/etc/a.conf"])
    assert not StateStore(HostFS(root)).owns("/etc/a.conf")  # and never brings them back


def test_a_lone_progress_files_claims_count_where_an_applied_record_names_them(
    store: StateStore, root: Path
) -> None:
    """No journal at all: the agent never leaves a progress file with claims not folded in so,
    and only what the last applied OSC's record names is taken from it; the rest is said."""
    store.save_last_applied(b"osc s", applied=applied_of(("/etc/a.conf", "a")))
    cs = ChangeSet(files_to_write=(fw("/etc/a.conf", b"a"), fw("/etc/new.conf", b"n")))
    store.begin(cs, "s2")
    store.record_written(claims_for(cs))
    state_file(root, CHANGES).unlink()
    after = StateStore(HostFS(root))
    assert after.owns("/etc/a.conf")
    assert "/etc/new.conf" not in after.inventory().entries
    (note,) = after.take_set_aside()
    assert "/etc/new.conf" in note
    assert "/etc/a.conf" not in note


def test_claims_of_a_progress_file_from_another_journal_are_kept(tmp_path: Path) -> None:
    """A progress file that does not belong to the journal read (its id differs): its claims
    still count where a record names their paths, and they are in the inventory before the
    journal's own progress replaces it."""
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first, second = HostFS(tmp_path / "one"), HostFS(tmp_path / "two")
    a = ChangeSet(files_to_write=(fw("/etc/a.conf", b"a"),))
    StateStore(first).begin(a, "s1")
    StateStore(first).record_written(claims_for(a))
    StateStore(second).save_last_applied(b"osc s1", applied=applied_of(("/etc/a.conf", "a")))
    b = ChangeSet(files_to_write=(fw("/etc/b.conf", b"b"),))
    StateStore(second).begin(b, "s2")
    progress = STATE_DIR.lstrip("/") + "/" + CHANGES_DONE
    (tmp_path / "two" / progress).write_bytes((tmp_path / "one" / progress).read_bytes())
    store = StateStore(second)
    assert store.owns("/etc/a.conf")
    store.record_written(claims_for(b))  # the journal's own claims: its progress file now
    after = StateStore(second)  # a crash here
    assert after.owns("/etc/a.conf")
    assert after.owns("/etc/b.conf")


def test_a_new_journal_takes_the_replaced_ones_claims_into_the_inventory(
    store: StateStore, root: Path
) -> None:
    first = ChangeSet(files_to_write=(fw("/etc/a.conf", b"a"),))
    store.begin(first, "s1")
    store.record_written(claims_for(first))  # then a crash; the next OSC begins over it
    after = StateStore(HostFS(root))
    after.begin(ChangeSet(files_to_write=(fw("/etc/b.conf", b"b"),)), "s2")
    assert "/etc/a.conf" in json.loads(state_file(root, INVENTORY).read_bytes())["entries"]
    assert StateStore(HostFS(root)).owns("/etc/a.conf")


def write_host(root: Path, path: str, data: bytes) -> None:
    host = root / path.lstrip("/")
    host.parent.mkdir(parents=True, exist_ok=True)
    host.write_bytes(data)


@pytest.mark.parametrize("unreadable", ["journal", "removed"])
def test_what_a_lost_journal_created_stays_the_agents(
    store: StateStore, root: Path, unreadable: str
) -> None:
    """A journal writes a new file (its claim in the progress file) and the agent dies; the
    journal and its progress file are then both lost. What the journal meant to create was in
    the inventory before it began: the file with exactly those bytes is still the agent's (a
    later OSC without it removes it), one with other bytes, or where something already was,
    is not."""
    write_host(root, "/etc/there.conf", b"someone else's")
    cs = ChangeSet(
        files_to_write=(
            fw("/etc/new.conf", b"n"),
            fw("/etc/other.conf", b"o"),
            fw("/etc/there.conf", b"t"),
            fw("/etc/never.conf", b"x"),
        ),
    )
    store.begin(cs, "s1")
    write_host(root, "/etc/new.conf", b"n")
    write_host(root, "/etc/other.conf", b"replaced by someone")
    write_host(root, "/etc/there.conf", b"t")
    store.record_written(claims_for(cs)[:3])
    state_file(root, CHANGES_DONE).unlink()
    if unreadable == "journal":
        state_file(root, CHANGES).write_bytes(b"{not json")
    else:
        state_file(root, CHANGES).unlink()
    after = StateStore(HostFS(root))
    assert after.owns("/etc/new.conf")
    assert not after.owns("/etc/other.conf")
    assert not after.owns("/etc/there.conf")
    assert not after.owns("/etc/never.conf")
    saved = json.loads(state_file(root, INVENTORY).read_bytes())
    assert set(saved["entries"]) == {"/etc/new.conf"}
    assert saved["intended"] == {}  # settled once, and in the file
    assert StateStore(HostFS(root)).owns("/etc/new.conf")


def test_a_journal_still_there_settles_its_own_writes(store: StateStore, root: Path) -> None:
    """With the journal readable, what it meant to create is not taken by the bytes alone: its
    own record decides (it resumes); a finished journal leaves nothing intended behind."""
    cs = ChangeSet(files_to_write=(fw("/etc/new.conf", b"n"),))
    store.begin(cs, "s1")
    write_host(root, "/etc/new.conf", b"n")
    after = StateStore(HostFS(root))  # a crash between the write and its claim
    assert after.pending() is not None
    assert not after.owns("/etc/new.conf")
    assert set(json.loads(state_file(root, INVENTORY).read_bytes())["intended"]) == {
        "/etc/new.conf"
    }
    after.record_written(claims_for(cs))
    after.mark_done(*step_ids(cs))
    after.finish()
    saved = json.loads(state_file(root, INVENTORY).read_bytes())
    assert saved["intended"] == {}
    assert saved["intended_by"] is None
    assert set(saved["entries"]) == {"/etc/new.conf"}


def test_an_update_of_known_paths_does_not_rewrite_the_inventory(
    store: StateStore, root: Path
) -> None:
    """Recording intent costs a write only when a change set creates paths: an update of
    paths the agent already holds leaves ``inventory.json`` as it was until the journal ends."""
    first = ChangeSet(files_to_write=(fw("/etc/a.conf", b"a"),))
    store.begin(first, "s1")
    write_host(root, "/etc/a.conf", b"a")
    store.record_written(claims_for(first))
    store.finish()
    before = state_file(root, INVENTORY).stat().st_ino
    store.begin(ChangeSet(files_to_write=(fw("/etc/a.conf", b"a2"),)), "s2")
    assert state_file(root, INVENTORY).stat().st_ino == before


# --- status ----------------------------------------------------------------------------------


def test_status_round_trip(store: StateStore, root: Path) -> None:
    assert store.load_status() is None
    start = datetime(2026, 5, 6, 7, 8, 9, tzinfo=UTC)
    record = ApplyRecord(
        osc_checksum="abc",
        started_at=start,
        finished_at=start + timedelta(seconds=2.5),
        duration_seconds=2.5,
        result="failed",
        steps=7,
        restarted_units=("kubelet.service",),
        error="write /etc/x: No space left on device",
    )
    store.save_status(record)
    assert StateStore(HostFS(root)).load_status() == record
    assert mode_of(state_file(root, STATUS)) == 0o644
    assert json.loads(state_file(root, STATUS).read_text())["version"] == 1


# --- corruption and versions -----------------------------------------------------------------


@pytest.mark.parametrize(
    "content", [b"{not json", b'{"version": 2, "entries": {}}', b"[]", b"\xff\xfe"]
)
def test_unreadable_documents_are_moved_aside(
    store: StateStore, fs: HostFS, root: Path, content: bytes
) -> None:
    for name in (INVENTORY, CHANGES, STATUS):
        fs.write_atomic(f"{STATE_DIR}/{name}", content, 0o600)
    assert StateStore(fs).inventory().entries == {}
    assert StateStore(fs).pending() is None
    assert StateStore(fs).load_status() is None
    for name in (INVENTORY, CHANGES, STATUS):
        assert not state_file(root, name).exists()
        assert state_file(root, name + CORRUPT_SUFFIX).read_bytes() == content
        assert mode_of(state_file(root, name + CORRUPT_SUFFIX)) == 0o600


def test_meta_of_a_newer_version_degrades_to_unknown_secrets(store: StateStore, fs: HostFS) -> None:
    store.save_last_applied(b"osc", {"/f": b"s"})
    doc = json.loads(fs.read(f"{STATE_DIR}/{LAST_APPLIED_META}") or b"")
    doc["version"] = 2
    fs.write_atomic(f"{STATE_DIR}/{LAST_APPLIED_META}", json.dumps(doc).encode(), 0o600)
    loaded = StateStore(fs).load_last_applied()
    assert loaded is not None
    assert loaded.resolved is None


# --- crash leftovers -------------------------------------------------------------------------


def test_store_cleans_temp_files_of_pending_and_owned_paths(
    store: StateStore, fs: HostFS, root: Path
) -> None:
    store.claim([Claim("file", "/srv/owned/f", None, None)])
    store.begin(ChangeSet(files_to_write=(fw("/opt/pending/g", b"g"),)), "s")
    for d in ("srv/owned", "opt/pending", "etc/systemd/system", STATE_DIR.lstrip("/"), "other"):
        (root / d).mkdir(parents=True, exist_ok=True)
        (root / d / ".node-agent-tmp-x").write_bytes(b"")
    assert StateStore(fs).temp_dirs() == sorted(
        ["/etc/systemd/system", "/opt/pending", "/srv/owned", STATE_DIR]
    )
    removed = StateStore(fs).cleanup_temp_files()
    assert len(removed) == 4
    assert (root / "other/.node-agent-tmp-x").exists()  # unknown directories are left alone


def applied_of(*files: tuple[str, str]) -> Applied:
    return Applied(
        files={path: AppliedFile(mode=0o644, sha256=sha(body.encode())) for path, body in files},
        units={"a.service": AppliedUnit(name="a.service", content="[Service]\n")},
    )


def test_a_journal_over_the_last_applied_record_names_it_and_writes_the_target_as_changes(
    store: StateStore, root: Path
) -> None:
    """The usual base (the last applied OSC's record, the very object) is named by checksum
    and the target written as its changes: the journal does not grow with the OSC. A new
    process reads back the same base and target; after a crash between the completion's record
    and dropping the journal, the target is that record; without a usable record both are
    unknown (as in an older agent's journal)."""
    many = [(f"/etc/f{i}", "same") for i in range(300)]
    base = applied_of(*many, ("/etc/a", "one"), ("/etc/gone", "x"))
    last = store.save_last_applied(b"osc one", applied=base)
    assert last.applied is base
    target = Applied(
        files={**{p: f for p, f in base.files.items() if p != "/etc/gone"},
               "/etc/a": AppliedFile(mode=0o644, sha256=sha(b"two"))},
        units=base.units,
        owed={"a.service": Owed(action="restart", reasons=("/etc/a changed",))},
    )  # fmt: skip
    cs = ChangeSet(files_to_write=(fw("/etc/a", b"two"),))
    store.begin(cs, sha(b"osc two"), base=base, target=target)
    journal = json.loads(state_file(root, CHANGES).read_text())
    assert journal["base"] is None
    assert journal["target"] is None
    assert journal["base_checksum"] == sha(b"osc one")
    assert journal["target_changes"]["files"] == {
        "/etc/a": {"mode": 0o644, "sha256": sha(b"two"), "source": [], "image_ref": None},
        "/etc/gone": None,
    }
    assert len(state_file(root, CHANGES).read_bytes()) < 2000  # not 300 files' worth

    resumed = StateStore(HostFS(root)).pending()
    assert resumed is not None
    assert (resumed.base, resumed.target) == (base, target)

    store.save_last_applied(b"osc two", applied=target)  # the completion's record ...
    resumed = StateStore(HostFS(root)).pending()  # ... and a crash before the journal went
    assert resumed is not None
    assert (resumed.base, resumed.target) == (None, target)

    state_file(root, LAST_APPLIED_META).write_text("{")
    resumed = StateStore(HostFS(root)).pending()
    assert resumed is not None
    assert (resumed.base, resumed.target) == (None, None)
    assert resumed.change_set == cs


def test_a_journal_over_another_base_writes_it_whole(store: StateStore, root: Path) -> None:
    """A base that is not the last applied record (an unfinished journal's result, say) and
    its target are written whole."""
    store.save_last_applied(b"osc one", applied=applied_of(("/etc/a", "one")))
    base, target = applied_of(("/etc/a", "half")), applied_of(("/etc/a", "two"))
    store.begin(ChangeSet(files_to_write=(fw("/etc/a", b"two"),)), "sum", base=base, target=target)
    journal = json.loads(state_file(root, CHANGES).read_text())
    assert journal["base_checksum"] is None
    assert journal["target_changes"] is None
    resumed = StateStore(HostFS(root)).pending()
    assert resumed is not None
    assert (resumed.base, resumed.target) == (base, target)


def test_an_inventory_of_the_previous_version_loads_its_entries_as_the_oscs(
    store: StateStore, root: Path
) -> None:
    """Entries written before they said who wrote them read as the OSC's, as they were."""
    doc = {
        "version": 1,
        "entries": {
            "/etc/a.conf": {"kind": "file", "created": True, "sha256": sha(b"a"), "mode": 420},
            "/etc/found.conf": {"kind": "file", "created": False, "sha256": None, "mode": None},
        },
        "folded": None,
    }
    state_file(root, INVENTORY).parent.mkdir(parents=True)
    state_file(root, INVENTORY).write_text(json.dumps(doc))
    inv = store.inventory()
    assert store.take_set_aside() == []  # nothing set aside as unreadable
    assert inv.owns("/etc/a.conf")
    assert {p: e.by for p, e in inv.entries.items()} == {
        "/etc/a.conf": "osc",
        "/etc/found.conf": "osc",
    }


def test_an_entry_bootstrap_claimed_stays_bootstraps_when_an_osc_writes_it(
    store: StateStore, root: Path
) -> None:
    unit = unit_path("x.service")
    store.claim([Claim("unit", unit, sha(b"1"), 0o644, by="bootstrap")])
    cs = ChangeSet(units_to_write=(UnitWrite(name="x.service", content="2", reason="r"),))
    store.begin(cs, "s")
    store.record_written(claims_for(cs))
    store.finish()
    entry = StateStore(HostFS(root)).inventory().entries[unit]
    assert (entry.created, entry.by, entry.sha256) == (True, "bootstrap", sha(b"2"))
    store.claim([Claim("file", "/etc/b.conf", sha(b"b"), 0o644)])
    assert StateStore(HostFS(root)).inventory().entries["/etc/b.conf"].by == "osc"
