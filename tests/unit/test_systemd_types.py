"""Values of the systemd seam, and argument checks the adapter does before it spawns anything."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from node_agent.systemd import JobResult, Systemd, SystemdSeam, UnitState
from tests.unit.fakes import FakeSystemd


def test_job_result_ok_and_description() -> None:
    assert JobResult("a.service", "restart", "done").ok
    assert JobResult("a.service", "stop", "skipped").ok
    failed = JobResult("a.service", "start", "failed", message="unit is failed (failed)")
    assert not failed.ok
    assert failed.describe() == "start a.service: failed (unit is failed (failed))"
    late = JobResult("b.service", "start", "timeout", finished=False)
    assert not late.ok
    assert late.describe() == "start b.service: timeout"


def test_unit_state_timestamps_and_existence() -> None:
    state = UnitState(
        name="x.service",
        id="x.service",
        load_state="loaded",
        active_state="active",
        sub_state="running",
        unit_file_state="enabled",
        invocation_id="ab" * 16,
        fragment_path="/etc/systemd/system/x.service",
        drop_in_paths=(),
        state_change_timestamp=1_700_000_000_000_000,
        exec_main_start_timestamp=0,
    )
    assert state.exists
    assert state.state_change == datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)
    assert state.exec_main_start is None
    assert not UnitState("y", "y", "not-found", "inactive", "dead", "", "", "", ()).exists


async def test_run_jobs_rejects_bad_batches_before_calling_systemd() -> None:
    sd = Systemd("unix:path=/nonexistent")
    with pytest.raises(ValueError, match="twice"):
        await sd.run_jobs([("a.service", "start"), ("a.service", "stop")])
    with pytest.raises(ValueError, match="unknown job action"):
        await sd.run_jobs([("a.service", "reload")])  # type: ignore[list-item]
    assert await sd.run_jobs([]) == {}
    assert await sd.enable([]) == []
    assert await sd.unit_states([]) == {}
    assert sd.spawn_count == 0


async def test_the_shared_fake_satisfies_the_seam() -> None:
    fake: SystemdSeam = FakeSystemd()
    assert isinstance(fake, SystemdSeam)
    assert isinstance(Systemd(), SystemdSeam)
    assert (await fake.restart_unit("kubelet.service")).ok
