"""The systemd client's side of a worker pipe that breaks mid-call (a worker gone while the
agent stops): the caller gets the typed error, and nothing is left for asyncio to complain
about afterwards ("Future exception was never retrieved" is an error line in the journal)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from node_agent.base.errors import SystemdWorkerDied
from node_agent.systemd import client


class _BrokenStdin:
    def write(self, data: bytes) -> None:
        pass

    async def drain(self) -> None:
        raise ConnectionResetError("Connection lost")


class _Proc:
    pid = 4242
    stdin = _BrokenStdin()
    returncode = None


async def _call_on_a_broken_pipe() -> str:
    """One call whose send fails; returns its error's text. The worker, the adapter and the
    error (whose traceback holds the call's future) are all gone when this returns."""
    worker = client._Worker(_Proc())  # type: ignore[arg-type]
    adapter = client.Systemd()

    async def the_worker() -> client._Worker:
        return worker

    adapter._ensure_worker = the_worker  # type: ignore[method-assign]
    try:
        await adapter._call("failed_units")
    except SystemdWorkerDied as exc:
        assert worker.pending == {}
        return str(exc)
    raise AssertionError("the call did not fail")


async def test_a_call_whose_send_breaks_leaves_no_unretrieved_future() -> None:
    loop = asyncio.get_running_loop()
    reported: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    text = await _call_on_a_broken_pipe()
    assert "4242 is gone (Connection lost)" in text
    gc.collect()  # the call's future goes now; an unretrieved exception would be reported
    await asyncio.sleep(0)
    assert [context["message"] for context in reported] == []
