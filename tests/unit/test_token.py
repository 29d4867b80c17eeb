"""Token sync with a fake API: exact bytes, mode 0640, parents 0755, rewrite after deletion,
a failed write retried on the backoff policy."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path
from typing import Any

import pytest

from node_agent.base.retry import Backoff
from node_agent.config import TokenSyncConfig
from node_agent.context import AgentContext
from node_agent.controllers.token import TokenSync, token_bytes
from node_agent.host.inotify import RemovalWatch
from tests.unit.fakes import FakeKube, FakeResource, make_ctx

pytestmark = pytest.mark.usefixtures("virtual_clock")


def _secret(token: bytes) -> dict[str, Any]:
    return {"metadata": {"name": "tok"}, "data": {"token": base64.b64encode(token).decode()}}


def _secrets(kube: FakeKube) -> FakeResource:
    return kube.secrets("kube-system")


def _sync(
    tmp_path: Path,
    kube: FakeKube,
    check_period: float = 0.02,
    backoff: Backoff | None = None,
    removals: RemovalWatch | None = None,
) -> TokenSync:
    ctx: AgentContext = make_ctx(tmp_path, kube=kube, node_name=None, node_uid=None)
    entry = TokenSyncConfig(secretName="tok", path="/var/lib/x/credentials/token")
    return TokenSync(
        ctx,
        entry,
        sync_period=3600,
        check_period=check_period,
        backoff=backoff,
        removals=removals,
    )


async def _until(done: Any, what: str) -> None:
    for _ in range(500):
        if done():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within 5 s: {what}")


def test_token_bytes() -> None:
    assert token_bytes(_secret(b"abc\n")) == b"abc\n"
    assert token_bytes({"data": {"other": "YQ=="}}) is None
    assert token_bytes({"data": {"token": "not base64!"}}) is None
    assert token_bytes(None) is None


async def test_sync_writes_exact_bytes_with_modes(tmp_path: Path) -> None:
    kube = FakeKube()
    _secrets(kube).put(_secret(b"t0ken-\x00-bytes"))
    sync = _sync(tmp_path, kube)
    old = os.umask(0o077)
    try:
        assert await sync.sync()
    finally:
        os.umask(old)
    path = tmp_path / "var/lib/x/credentials/token"
    assert path.read_bytes() == b"t0ken-\x00-bytes"
    assert path.stat().st_mode & 0o7777 == 0o640
    assert (tmp_path / "var/lib/x").stat().st_mode & 0o7777 == 0o755
    assert (tmp_path / "var/lib/x/credentials").stat().st_mode & 0o7777 == 0o755
    assert sync.stats.writes == 1
    assert await sync.sync()  # same bytes: nothing written
    assert sync.stats.writes == 1


async def test_missing_secret_or_key_leaves_the_file(tmp_path: Path) -> None:
    kube = FakeKube()
    sync = _sync(tmp_path, kube)
    assert not await sync.sync()
    _secrets(kube).put({"metadata": {"name": "tok"}, "data": {}})
    assert not await sync.sync()
    assert not (tmp_path / "var/lib/x/credentials/token").exists()


async def test_deleted_file_is_rewritten_from_the_last_token(tmp_path: Path) -> None:
    kube = FakeKube()
    _secrets(kube).put(_secret(b"abc"))
    sync = _sync(tmp_path, kube)
    await sync.sync()
    _secrets(kube).items.clear()  # no API needed for the rewrite
    path = tmp_path / "var/lib/x/credentials/token"
    task = asyncio.create_task(sync._existence_loop())
    try:
        path.unlink()
        await _until(lambda: sync.stats.rewrites_after_delete == 1, "rewrite")
        assert path.read_bytes() == b"abc"
    finally:
        task.cancel()


async def test_failed_write_is_retried_with_backoff_from_the_last_token(tmp_path: Path) -> None:
    kube = FakeKube()
    _secrets(kube).put(_secret(b"fresh"))
    backoff = Backoff(base=0.05, cap=0.1)
    sync = _sync(tmp_path, kube, backoff=backoff)
    blocker = tmp_path / "var/lib/x"
    blocker.parent.mkdir(parents=True)
    blocker.write_text("a file where the token's directory belongs")
    assert not await sync.sync()  # the write fails (ENOTDIR)
    assert backoff.attempt == 1
    assert sync.stats.last_error is not None
    _secrets(kube).items.clear()  # the retry needs no API call: the token is kept
    path = tmp_path / "var/lib/x/credentials/token"
    task = asyncio.create_task(sync._existence_loop())
    try:
        for _ in range(20):
            await asyncio.sleep(0.02)
        assert backoff.attempt > 1  # still failing: retried, each time a little later
        blocker.unlink()
        for _ in range(300):
            if sync.stats.writes:
                break
            await asyncio.sleep(0.01)
        assert path.read_bytes() == b"fresh"
        assert backoff.attempt == 0  # reset by the success
        assert sync.stats.writes == 1
    finally:
        task.cancel()


async def test_the_existence_check_takes_no_thread_hop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It runs for the agent's whole life (every 2 s where no inotify watch can be armed): a
    hop to a worker thread would cost more than the lstat walk itself."""
    kube = FakeKube()
    _secrets(kube).put(_secret(b"tok"))
    sync = _sync(tmp_path, kube)
    assert await sync.sync()

    async def no_thread(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a thread hop")

    monkeypatch.setattr(asyncio, "to_thread", no_thread)
    await sync._existence_step(False)
    assert sync.stats.rewrites_after_delete == 0


@pytest.mark.parametrize("how", ["unlink", "rename away", "directory removed", "directory moved"])
async def test_the_kernels_word_rewrites_a_deleted_file_without_polling(
    tmp_path: Path, how: str
) -> None:
    """With a watch on its directory the file is put back when it goes, though the poll would
    not look for an hour; then the watch is armed again on the (new) directory."""
    kube = FakeKube()
    _secrets(kube).put(_secret(b"abc"))
    removals = RemovalWatch()
    sync = _sync(tmp_path, kube, check_period=3600, removals=removals)
    await sync.sync()
    path = tmp_path / "var/lib/x/credentials/token"
    task = asyncio.create_task(sync._existence_loop())
    try:
        await _until(lambda: removals.watching("/var/lib/x/credentials/token"), "watch armed")
        for round_ in (1, 2):
            if how == "unlink":
                path.unlink()
            elif how == "rename away":
                path.rename(path.with_name("token.old"))
            elif how == "directory removed":
                path.unlink()
                path.parent.rmdir()
            else:
                path.parent.rename(tmp_path / f"var/lib/x/moved-{round_}")
            await _until(  # counted once the rewrite is done
                lambda n=round_: sync.stats.rewrites_after_delete == n and path.exists(),
                f"rewrite {round_}",
            )
            assert path.read_bytes() == b"abc"
            await _until(lambda: removals.watching("/var/lib/x/credentials/token"), "re-armed")
    finally:
        task.cancel()
        removals.close()


async def test_other_names_in_the_directory_wake_nothing(tmp_path: Path) -> None:
    kube = FakeKube()
    _secrets(kube).put(_secret(b"abc"))
    removals = RemovalWatch()
    sync = _sync(tmp_path, kube, check_period=3600, removals=removals)
    await sync.sync()
    steps = 0
    real_step = sync._existence_step

    async def counted(woken: bool) -> Any:
        nonlocal steps
        steps += 1
        return await real_step(woken)

    sync._existence_step = counted  # type: ignore[method-assign]
    task = asyncio.create_task(sync._existence_loop())
    try:
        await _until(lambda: removals.watching("/var/lib/x/credentials/token"), "watch armed")
        assert steps == 1
        other = tmp_path / "var/lib/x/credentials/other"
        for _ in range(5):
            other.write_text("x")
            other.unlink()
        (tmp_path / "var/lib/x/credentials/token").unlink()
        await _until(lambda: sync.stats.rewrites_after_delete == 1, "rewrite")
        assert steps == 2  # the other name's deletions did not wake the check
    finally:
        task.cancel()
        removals.close()


async def test_without_inotify_the_file_is_polled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No inotify instance to be had (the per-user limit reached): the check polls."""
    kube = FakeKube()
    _secrets(kube).put(_secret(b"abc"))
    removals = RemovalWatch()

    def refused(self: RemovalWatch) -> int:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(RemovalWatch, "_instance", refused)
    sync = _sync(tmp_path, kube, check_period=0.02, removals=removals)
    await sync.sync()
    task = asyncio.create_task(sync._existence_loop())
    try:
        await _until(lambda: removals.unavailable is not None, "inotify found unavailable")
        assert "Too many open files" in (removals.unavailable or "")
        (tmp_path / "var/lib/x/credentials/token").unlink()
        await _until(lambda: sync.stats.rewrites_after_delete == 1, "rewrite by the poll")
    finally:
        task.cancel()


async def test_the_first_round_is_done_before_the_osc_may_apply(tmp_path: Path) -> None:
    """The OSC's units read the token files (a collector's access token): the controller
    syncs every entry once, then says so (``tokens_synced``), before it watches."""
    from node_agent.controllers.token import TokenController

    kube = FakeKube()
    _secrets(kube).put(_secret(b"tok-1"))
    ctx: AgentContext = make_ctx(
        tmp_path,
        config={
            "controllers": {
                "operatingSystemConfig": {"secretName": "osc"},
                "token": {"syncConfigs": [{"secretName": "tok", "path": "/var/lib/x/token"}]},
            }
        },
        kube=kube,
        node_name=None,
        node_uid=None,
    )
    controller = TokenController(ctx)
    assert not ctx.tokens_synced.is_set()
    task = asyncio.create_task(controller.run())
    try:
        async with asyncio.timeout(5):
            await ctx.tokens_synced.wait()
        assert (tmp_path / "var/lib/x/token").read_bytes() == b"tok-1"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
