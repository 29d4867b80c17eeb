"""``node-agent status``: the server and client over a real unix socket, the offline document
from real state files, and the rendering for people. Also holds the context the metrics tests
use."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import stat
import time
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.base.durations import human_duration
from node_agent.base.errors import UnsafePathError
from node_agent.commands import status
from node_agent.config import CONFIG_FILE, AgentSettings
from node_agent.context import AgentContext
from node_agent.controllers.lease import LeaseStats
from node_agent.controllers.node import NodeStats
from node_agent.host.documents import ApplyRecord, Claim, ItemFailure
from node_agent.host.fs import HostFS
from node_agent.host.state import CHANGES, CHANGES_DONE, STATE_DIR, StateStore, claims_for
from node_agent.kube.client import ClientStats
from node_agent.observe import status_document, unix_socket
from node_agent.observe.observations import ApplyObservations
from node_agent.observe.probes import Probes
from node_agent.observe.view import AgentView, EndpointView, Sources, reader
from node_agent.osc.applied import Applied, AppliedFile
from node_agent.osc.decode import parse_osc
from node_agent.osc.plan import ChangeSet, FileWrite, plan
from tests.unit import fakes
from tests.unit.fakes import ACTIVE, FakeKube, FakeSystemd

SECRET = "gardener-node-agent-pool-a-0123456789abcdef"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def osc_yaml(units: list[str], text: str = "x=1\n") -> bytes:
    doc = fakes.osc_document(
        text,
        [
            {"name": u, "command": "start", "enable": True,
             "content": "[Service]\nExecStart=/bin/true\n"}
            for u in units
        ],
    )  # fmt: skip
    return yaml.safe_dump(doc).encode()


@dataclass
class FakeOSC:
    applies: int = 0
    failures: int = 0
    desired_checksum: str | None = None
    latest_secret: dict[str, Any] | None = None


@dataclass
class FakeLease:
    name: str | None = "gardener-node-agent-node-a"
    stats: LeaseStats = field(default_factory=LeaseStats)


@dataclass
class FakeNode:
    stats: NodeStats = field(default_factory=NodeStats)
    missing: str | None = None


@dataclass
class ReadCtx(AgentContext):
    """A context with the read side's sources beside it, as the agent's wiring keeps them."""

    sources: Sources = field(default_factory=Sources)


def make_ctx(root: Path, systemd: FakeSystemd | None = None, **settings: Any) -> ReadCtx:
    ctx = fakes.make_ctx(
        root,
        config={"controllers": {"operatingSystemConfig": {"secretName": SECRET}}},
        kube=FakeKube(server="https://api.example:6443", stats=ClientStats(requests=7, timeouts=1)),
        systemd=systemd,
        host_name="Node-A",
        node_name=None,
        node_uid=None,
        context_type=ReadCtx,
        **settings,
    )
    ctx.sources = Sources(watches=ctx.watches, osc=FakeOSC(), lease=FakeLease(), node=FakeNode())
    return ctx


def read(ctx: ReadCtx, observations: ApplyObservations | None = None) -> Callable[[], AgentView]:
    """The view of ``ctx`` as the agent's servers read it."""
    observations = observations or ApplyObservations()
    return reader(ctx, ctx.sources, observations, Probes(ctx, ctx.sources, observations))


def _record(checksum: str, restarted: tuple[str, ...] = ("a.service",)) -> ApplyRecord:
    now = datetime.now(UTC)
    return ApplyRecord(
        osc_checksum=checksum,
        started_at=now - timedelta(seconds=1.5),
        finished_at=now,
        duration_seconds=1.5,
        result="succeeded",
        restarted_units=restarted,
    )


def _applied(ctx: AgentContext, units: list[str]) -> str:
    raw = osc_yaml(units)
    last = ctx.state.save_last_applied(raw)
    ctx.state.save_status(_record(last.checksum))
    return last.checksum


async def _server(ctx: ReadCtx) -> unix_socket.StatusServer:
    ctx.sources.endpoints = lambda: (EndpointView("health", "127.0.0.1:1", serves=("health",)),)
    server = unix_socket.StatusServer(ctx, read(ctx))
    await server.start()
    return server


def test_defaults_match_the_settings() -> None:
    assert AgentSettings().status_socket == status_document.DEFAULT_SOCKET
    assert status.DEFAULT_CONFIG == CONFIG_FILE


async def test_the_running_agent_answers_over_a_0600_socket(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, FakeSystemd({"a.service": ACTIVE}))
    checksum = _applied(ctx, ["a.service", "b.service"])
    osc = ctx.sources.osc
    assert isinstance(osc, FakeOSC)
    osc.latest_secret = {"data": {"osc.yaml": _b64(osc_yaml(["a.service", "b.service"]))}}
    ctx.node_name = "node-a"
    ctx.health.error("lease", "renew lease: connection refused")
    server = await _server(ctx)
    try:
        path = status_document.socket_path(tmp_path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        doc = await asyncio.to_thread(status.query, path)
    finally:
        await server.close()
    assert not path.exists()
    assert doc["schema_version"] == 1
    assert doc["agent"]["running"] is True
    assert doc["agent"]["pid"] == os.getpid()
    assert doc["agent"]["node_name"] == "node-a"
    assert doc["osc"] == {
        "secret_name": SECRET,
        "applied_checksum": checksum,
        "desired_checksum": checksum,
        "up_to_date": True,
        "applies": 0,
        "failures": 0,
    }
    assert doc["last_apply"]["result"] == "succeeded"
    assert doc["last_apply"]["restarted_units"] == ["a.service"]
    assert doc["units"] == [
        {"name": "a.service", "load_state": "loaded", "active_state": "active",
         "sub_state": "running", "error": None},
        {"name": "b.service", "load_state": "not-found", "active_state": "inactive",
         "sub_state": "dead", "error": None},
    ]  # fmt: skip
    assert doc["api_server"]["server"] == "https://api.example:6443"
    assert doc["api_server"]["last_error"]["source"] == "lease"
    assert doc["lease"]["name"] == "kube-system/gardener-node-agent-node-a"
    assert doc["endpoints"]["health"] == "127.0.0.1:1"
    assert doc["endpoints"]["metrics"] is None
    assert list(doc) == list(status_document.skeleton())  # every documented field, in order


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode()


async def test_a_hanging_systemd_does_not_stall_the_answer(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path, FakeSystemd(hang=True))
    _applied(ctx, ["a.service"])
    server = await _server(ctx)
    try:
        started = time.monotonic()
        doc = await asyncio.to_thread(status.query, status_document.socket_path(tmp_path))
        took = time.monotonic() - started
    finally:
        await server.close()
    assert took < status_document.CLIENT_TIMEOUT
    assert doc["units"][0]["name"] == "a.service"
    assert doc["units"][0]["active_state"] is None
    assert doc["units"][0]["error"]


async def test_errors_are_scrubbed_and_contents_never_shown(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    _applied(ctx, ["a.service"])
    jwt = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2EifQ.c2lnbmF0dXJl"
    ctx.health.error("token", f"bad token {jwt}")
    server = await _server(ctx)
    try:
        doc = await asyncio.to_thread(status.query, status_document.socket_path(tmp_path))
    finally:
        await server.close()
    text = json.dumps(doc) + status.render(doc)
    assert jwt not in text
    assert "[redacted]" in text
    assert "x=1" not in text
    assert "ExecStart" not in text


def test_not_running_no_socket(tmp_path: Path) -> None:
    with pytest.raises(status.NotRunning, match="no socket"):
        status.query(status_document.socket_path(tmp_path))


def test_not_running_stale_socket(tmp_path: Path) -> None:
    path = status_document.socket_path(tmp_path)
    path.parent.mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with status_document.addressable(path) as address:
        sock.bind(address)  # bound, never listening: what a killed agent leaves behind
    sock.close()
    with pytest.raises(status.NotRunning, match="stale socket"):
        status.query(path)


def test_not_running_when_nobody_answers_in_time(tmp_path: Path) -> None:
    path = status_document.socket_path(tmp_path)
    path.parent.mkdir(parents=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with status_document.addressable(path) as address:
        sock.bind(address)
    sock.listen(1)  # accepts into the backlog, never answers: a hung agent
    try:
        started = time.monotonic()
        with pytest.raises(status.NotRunning, match="no answer"):
            status.query(path, timeout=0.3)
        assert time.monotonic() - started < 1.0
    finally:
        sock.close()


def test_offline_document_reads_only_the_persisted_state(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    checksum = _applied(ctx, ["a.service"])
    osc = parse_osc(osc_yaml(["a.service", "c.service"], text="y=2\n"))
    pending = ctx.state.begin(plan(None, osc, "node-a"), "f" * 64)
    # its writes, claimed as the executor claims them: in the journal's progress file
    ctx.state.record_written(claims_for(pending.change_set))
    ctx.state.mark_done(pending.steps[0])
    config = tmp_path / CONFIG_FILE.lstrip("/")
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(
        yaml.safe_dump({"controllers": {"operatingSystemConfig": {"secretName": SECRET}}})
    )
    before = sorted(p.name for p in ctx.state.fs.root.rglob("*"))
    doc = status.offline_document(tmp_path, config, "no socket at /x")
    assert sorted(p.name for p in ctx.state.fs.root.rglob("*")) == before  # wrote nothing
    assert doc["agent"] == {
        **status_document.skeleton()["agent"],
        "not_running_reason": "no socket at /x",
    }
    assert doc["osc"]["secret_name"] == SECRET
    assert doc["osc"]["applied_checksum"] == checksum
    assert doc["osc"]["desired_checksum"] is None
    assert doc["last_apply"]["osc_checksum"] == checksum
    change = doc["change_in_progress"]
    assert change["osc_checksum"] == "f" * 64
    assert change["steps_done"] == 1
    assert change["steps_total"] == len(pending.steps)
    assert change["remaining"] == list(pending.steps[1:])
    assert doc["inventory"]["files"] == 1
    assert doc["inventory"]["units"] == 2
    assert doc["units"] is None


def test_offline_document_of_an_untouched_node(tmp_path: Path) -> None:
    doc = status.offline_document(tmp_path, tmp_path / "missing.yaml", "no socket")
    assert doc["osc"]["applied_checksum"] is None
    assert doc["last_apply"] is None
    assert doc["change_in_progress"] is None
    text = status.render(doc)
    assert "NOT RUNNING: no socket" in text
    assert "Last apply:   none recorded" in text


def test_render_running_with_a_failed_unit_and_a_change_in_progress() -> None:
    now = time.time()
    doc = status_document.skeleton()
    doc["agent"].update(running=True, version="0.1.0", pid=42, started_at="2026-01-01T00:00:00Z",
                        uptime_seconds=7300, host_name="node-a", node_name="node-a")  # fmt: skip
    doc["api_server"] = {"server": "https://api:6443", "last_success_at": None, "last_error": None}
    doc["lease"] = {"name": "kube-system/l", "last_renew_time": None, "renewals": 0, "failures": 2}
    doc["osc"].update(secret_name=SECRET, applied_checksum="a" * 64, desired_checksum="b" * 64,
                      up_to_date=False, applies=1, failures=3)  # fmt: skip
    doc["change_in_progress"] = status_document.pending_entry(
        "b" * 64,
        "2026-01-01T00:00:00Z",
        tuple(f"s{i}" for i in range(14)),
        tuple(f"s{i}" for i in range(2, 14)),
    )
    doc["units"] = [
        {"name": "kubelet.service", "load_state": "loaded", "active_state": "failed",
         "sub_state": "failed", "error": None},
    ]  # fmt: skip
    doc["errors"] = [{"at": "2026-01-01T00:00:00Z", "source": "osc", "error": "ApplyError: boom"}]
    doc["health"] = {"live": True, "ready": False, "reasons": ["OSC apply failed 3 times in a row"]}
    text = status.render(doc, now=now)
    assert "running (pid 42, up 2h01m" in text
    assert f"applied {'a' * 12}, desired {'b' * 12} (NOT up to date)" in text
    assert "2/14 steps done" in text
    assert "s2, s3" in text
    assert "and 2 more" in text
    assert "kubelet.service  failed/failed  <- FAILED" in text
    assert "NOT READY (OSC apply failed 3 times in a row)" in text
    assert "osc: ApplyError: boom" in text
    assert "0 renewals, 2 failures" in text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.25, "0.2s"),
        (42, "42s"),
        (185, "3m05s"),
        (7380, "2h03m"),
        (93600, "1d02h"),
        (-5, "0.0s"),
        # a state file's number need not be one (the fuzzing harness found inf)
        (float("inf"), "unknown"),
        (float("nan"), "unknown"),
    ],
)
def test_human_duration(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def test_cli_status_without_an_agent_exits_3(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from node_agent.cli import main

    assert main(["status", "--root", str(tmp_path), "--json"]) == status.EXIT_NOT_RUNNING
    doc = json.loads(capsys.readouterr().out)
    assert doc["agent"]["running"] is False
    assert main(["status", "--root", str(tmp_path)]) == status.EXIT_NOT_RUNNING
    assert "NOT RUNNING" in capsys.readouterr().out


JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJzeXN0ZW06c2EifQ.c2lnbmF0dXJl"


def _failed_record(checksum: str, count: int) -> ApplyRecord:
    failures = [ItemFailure(kind="command", item="bad.service", error=f"start: failed {JWT}")]
    failures += [
        ItemFailure(kind="file", item=f"/srv/ro/f{i}", error="write: Read-only file system")
        for i in range(count - 1)
    ]
    return _record(checksum).model_copy(
        update={"result": "failed", "error": "3 items failed", "failures": tuple(failures)}
    )


async def test_failed_items_in_text_json_and_offline_status(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    checksum = _applied(ctx, ["a.service"])
    ctx.state.save_status(_failed_record(checksum, 13))
    server = await _server(ctx)
    try:
        live = await asyncio.to_thread(status.query, status_document.socket_path(tmp_path))
    finally:
        await server.close()
    offline = status.offline_document(tmp_path, None, "no socket")
    for doc in (live, offline):
        failures = doc["last_apply"]["failures"]
        assert len(failures) == 13  # --json has every one
        assert failures[0] == {
            "kind": "command",
            "item": "bad.service",
            "error": "start: failed [redacted]",
        }
        assert failures[1] == {
            "kind": "file",
            "item": "/srv/ro/f0",
            "error": "write: Read-only file system",
        }
        text = status.render(doc)
        assert JWT not in text + json.dumps(doc)
        lines = text.splitlines()
        start = lines.index("  failed:     13 items")
        shown = lines[start + 1 : start + 12]
        assert shown[0] == "    command bad.service: start: failed [redacted]"
        assert shown[1] == "    file /srv/ro/f0: write: Read-only file system"
        assert all(line.startswith("    file /srv/ro/f") for line in shown[1:10])
        assert shown[10] == "    and 3 more"  # ten shown, the rest counted


def test_a_successful_apply_shows_no_failed_items(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    _applied(ctx, ["a.service"])
    doc = status.offline_document(tmp_path, None, "no socket")
    assert doc["last_apply"]["failures"] == []
    assert "failed:" not in status.render(doc)


async def test_a_deleted_node_is_shown(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    ctx.node_name = "node-a"
    ctx.node_known.set()
    ctx.health.progress("lease")
    ctx.health.progress("osc-watch")
    why = "node node-a not found (deleted from the API server); waiting for it"
    node = ctx.sources.node
    assert isinstance(node, FakeNode)
    node.missing = why
    ctx.health.error("node", why)
    server = await _server(ctx)
    try:
        doc = await asyncio.to_thread(status.query, status_document.socket_path(tmp_path))
    finally:
        await server.close()
    assert doc["health"]["ready"] is False
    assert doc["health"]["reasons"] == [why]
    text = status.render(doc)
    assert f"NOT READY ({why})" in text
    assert f"node: {why}" in text  # also among the recent errors


def _socket_dir(root: Path) -> Path:
    return status_document.socket_path(root).parent


async def test_a_symlinked_socket_directory_is_refused(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    elsewhere.chmod(0o755)
    link = _socket_dir(root)
    link.parent.mkdir(parents=True)
    link.symlink_to(elsewhere)
    ctx = make_ctx(root)
    server = unix_socket.StatusServer(ctx, read(ctx))
    with pytest.raises(UnsafePathError, match="is a symlink"):
        await server.start()
    assert stat.S_IMODE(elsewhere.stat().st_mode) == 0o755  # the target was not chmodded
    assert list(elsewhere.iterdir()) == []  # and nothing was bound there
    assert link.is_symlink()  # refused, not replaced: the agent removes only what it made


async def test_a_socket_directory_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = _socket_dir(tmp_path)
    path.parent.mkdir(parents=True)
    path.write_text("not a directory")
    ctx = make_ctx(tmp_path)
    with pytest.raises(UnsafePathError, match="is not a directory"):
        await unix_socket.StatusServer(ctx, read(ctx)).start()
    assert path.read_text() == "not a directory"


async def test_an_existing_socket_directory_is_made_0700(tmp_path: Path) -> None:
    path = _socket_dir(tmp_path)
    path.mkdir(parents=True, mode=0o755)
    path.chmod(0o755)
    ctx = make_ctx(tmp_path)
    server = await _server(ctx)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert stat.S_ISSOCK(status_document.socket_path(tmp_path).lstat().st_mode)
    finally:
        await server.close()
    assert not status_document.socket_path(tmp_path).exists()


async def test_a_socket_directory_of_another_owner_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _socket_dir(tmp_path)
    path.mkdir(parents=True, mode=0o700)
    owner = path.stat().st_uid
    monkeypatch.setattr(f"{unix_socket.__name__}.os.geteuid", lambda: owner + 1)
    ctx = make_ctx(tmp_path)
    with pytest.raises(UnsafePathError, match=f"owned by uid {owner}"):
        await unix_socket.StatusServer(ctx, read(ctx)).start()
    assert list(path.iterdir()) == []


async def test_the_status_command_against_a_running_agent_stays_lean(tmp_path: Path) -> None:
    """``node-agent status`` talks to the socket without the agent's heavy imports: no HTTP
    server, metrics library, kube client or pydantic (``-X importtime`` lists every import)."""
    import sys

    ctx = make_ctx(tmp_path)
    server = await _server(ctx)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-X",
            "importtime",
            "-m",
            "node_agent",
            "status",
            "--json",
            "--root",
            str(tmp_path),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await server.close()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert json.loads(out)["agent"]["running"] is True
    imported = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in err.decode().splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "node_agent" in imported  # the listing works
    heavy = {"aiohttp", "prometheus_client", "kubernetes_asyncio", "pydantic", "yaml", "structlog"}
    assert imported & heavy == set()


async def test_the_view_before_the_controllers_exist(tmp_path: Path) -> None:
    """Right after the start nothing but the context is wired: every reader still answers, with
    zeros and nulls where a part is missing."""
    from node_agent.observe.metrics import AgentMetrics

    ctx = make_ctx(tmp_path)
    ctx.sources = Sources()  # as the daemon has it before build_agent()
    view = read(ctx)()
    assert view.lease is None
    assert view.certificate is None
    assert (view.osc.applies, view.osc.failures, view.osc.desired_checksum) == (0, 0, None)
    assert view.osc.up_to_date is None
    assert view.watches == ()
    assert not view.health.ready.ok
    server = unix_socket.StatusServer(ctx, read(ctx))
    doc = await server.document()
    assert doc["lease"] == {"name": None, "last_renew_time": None, "renewals": 0, "failures": 0}
    assert doc["certificate"] is None
    assert doc["endpoints"] == {
        "health": None,
        "metrics": None,
        "status_socket": str(status_document.socket_path(tmp_path)),
    }
    assert list(doc) == list(status_document.skeleton())
    assert "Lease:        not yet: renewed never; 0 renewals, 0 failures" in status.render(doc)
    text = AgentMetrics(read(ctx)).render()
    assert "node_agent_lease_renewals_total 0.0" in text
    assert "# TYPE node_agent_watch_reconnects_total counter" in text


def test_control_characters_of_stored_errors_are_escaped_in_the_text(tmp_path: Path) -> None:
    ctx = make_ctx(tmp_path)
    checksum = _applied(ctx, ["a.service"])
    failures = (ItemFailure(kind="command", item="x\x1b]0;t\x07.service", error="\x1b[2Jgone"),)
    record = _record(checksum).model_copy(
        update={"result": "failed", "error": "boom\x1b[31m\r", "failures": failures}
    )
    ctx.state.save_status(record)
    text = status.render(status.offline_document(tmp_path, None, "no socket"))
    for line in text.splitlines():
        assert [ch for ch in line if unicodedata.category(ch) in ("Cc", "Cf")] == [], line
    assert "x\\x1b]0;t\\x07.service: \\x1b[2Jgone" in text
    assert "boom\\x1b[31m\\r" in text


@pytest.mark.parametrize(
    ("journal", "paths", "created"),
    [
        ("readable", 4, 3),  # /etc/passwd named by nothing; found.conf was there before
        ("absent", 2, 2),  # a lone progress file: only the last applied record names paths
        ("unreadable", 5, 5),  # the claims are the only record of what it wrote: taken
    ],
)
def test_offline_counts_only_the_claims_the_agent_takes(
    tmp_path: Path, journal: str, paths: int, created: int
) -> None:
    """The offline status counts a progress file's claims as the agent reads them (the same
    rule), never as they are written: a forged claim is no path of the agent's there either."""
    root = tmp_path / "node"
    root.mkdir()
    fs = HostFS(root)
    store = StateStore(fs)
    store.claim([Claim("file", "/etc/base.conf", _sha(b"b"), 0o644)], created=True)
    fs.write_atomic("/etc/found.conf", b"the operator's\n", 0o644)
    old = AppliedFile(mode=0o644, sha256=_sha(b"o"))
    store.save_last_applied(b"osc", applied=Applied(files={"/etc/old.conf": old}))
    writes = tuple(
        FileWrite(path=p, mode=0o644, content=b"n", sha256=_sha(b"n"), reason="r")
        for p in ("/etc/new.conf", "/etc/found.conf")
    )
    pending = store.begin(ChangeSet(files_to_write=writes), "c" * 64)
    claimed = ("/etc/old.conf", "/etc/new.conf", "/etc/found.conf", "/etc/passwd")
    claims = {p: {"kind": "file", "created": True, "sha256": _sha(b"n")} for p in claimed}
    state = root / STATE_DIR.lstrip("/")
    (state / CHANGES_DONE).write_text(
        json.dumps({"version": 1, "id": pending.id, "claims": claims})
    )
    if journal == "absent":
        (state / CHANGES).unlink()
    elif journal == "unreadable":
        (state / CHANGES).write_text("{not json")

    doc = status.offline_document(root, None, "no socket")

    counts = doc["inventory"]
    assert (counts["paths"], counts["created"]) == (paths, created)
    copy = tmp_path / "copy"  # the agent's own reading, which may set files aside: on a copy
    shutil.copytree(root, copy, symlinks=True)
    entries = StateStore(HostFS(copy)).inventory().entries.values()
    assert counts == status_document.inventory_counts((e.kind, e.created) for e in entries)
