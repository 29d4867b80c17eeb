"""The OSC controller's boundary: whatever a reconcile raises, the controller stays up.

An error of a kind no layer expected becomes a typed error, reported like any failed reconcile
(one log event naming the Secret, one Warning Event, the health error) and retried on the
backoff; a write the API server refuses as invalid (422) is not retried on the backoff at all.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from node_agent.base.errors import KubeInvalid
from node_agent.base.loop import DONE, RETRY, SKIPPED
from node_agent.base.retry import Backoff
from node_agent.controllers.osc import controller as controller_module
from node_agent.kube import report
from node_agent.osc.decode import decode_osc
from tests.unit.test_osc_controller import (
    SECRET,
    applied_annotation,
    checksum_of,
    controller,
    osc_bytes,
    secret,
)


def warnings(events: list[Any]) -> list[str]:
    return [str(c[1]["message"]) for c in events if c[1]["type"] == "Warning"]


async def test_an_unexpected_error_in_a_reconcile_is_reported_and_retried_on_the_backoff(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctl, ctx, kube, _ = controller(tmp_path)
    tries: list[float] = []

    def broken(*_args: Any) -> Any:
        tries.append(time.monotonic())  # called in a worker thread
        raise LookupError("injected: a kind of error nobody expected")

    monkeypatch.setattr(controller_module, "decode_osc", broken)
    ctl.observe("ADDED", secret(osc_bytes("one\n")))
    with capture_logs() as logs:
        assert await ctl._step(True) is RETRY  # the step answers; nothing escapes it
    failed = [e for e in logs if e["event"] == "OSC not applied"]
    assert len(failed) == 1  # one event, naming the Secret and where the error came from
    assert failed[0]["item"] == f"secret kube-system/{SECRET}"
    assert "UnexpectedError" in failed[0]["error"]
    assert "LookupError" in failed[0]["error"]
    assert any("broken" in frame for frame in failed[0]["at"])
    (warning,) = warnings(kube.writes("create_event"))
    assert warning.startswith(f"UnexpectedError: secret kube-system/{SECRET}: LookupError")
    assert "LookupError" in ctx.health.errors[-1]["error"]

    # the loop itself: it stays up and retries on the backoff, not in a hot loop
    ctl._backoff = Backoff(base=0.2, cap=0.2)
    tries.clear()
    loop = asyncio.create_task(ctl._reconcile_loop())
    ctl.observe("MODIFIED", secret(osc_bytes("one\n")))
    await asyncio.sleep(0.75)
    assert not loop.done()
    assert 2 <= len(tries) <= 8, tries
    assert all(b - a >= 0.09 for a, b in itertools.pairwise(tries))
    assert len(warnings(kube.writes("create_event"))) == 1  # the same failure said once

    monkeypatch.setattr(controller_module, "decode_osc", decode_osc)  # fixed: applied
    ctl.observe("MODIFIED", secret(osc_bytes("one\n")))
    await asyncio.sleep(0.5)
    loop.cancel()
    await asyncio.gather(loop, return_exceptions=True)
    assert await applied_annotation(kube) == checksum_of(osc_bytes("one\n"))


async def test_a_patch_refused_as_invalid_is_not_retried_on_the_backoff(tmp_path: Path) -> None:
    ctl, _, kube, _ = controller(tmp_path)
    refused = KubeInvalid(
        'Node "n1" is invalid: metadata.labels: Invalid value', status=422, reason="Invalid"
    )
    kube.fail("patch_node", refused)
    ctl.observe("ADDED", secret(osc_bytes("one\n")))
    assert await ctl._step(True) is SKIPPED  # the same body would be refused again
    assert warnings(kube.writes("create_event"))[-1].startswith("KubeInvalid: ")
    assert await applied_annotation(kube) is None
    # the periodic full check looks again (the Node may have changed meanwhile)
    assert await ctl._step(False) is DONE
    assert await applied_annotation(kube) == checksum_of(osc_bytes("one\n"))
    assert [r for r in (c[1]["reason"] for c in kube.writes("create_event"))].count(
        report.REASON_OSC_FAILED
    ) == 1
