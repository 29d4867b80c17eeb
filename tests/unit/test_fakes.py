"""The shared seam fakes answer like the real seams where the unit tests rely on it."""

from __future__ import annotations

import asyncio

import pytest

from node_agent.base.errors import KubeAlreadyExists, KubeConflict, KubeNotFound, KubeTransportError
from node_agent.kube.watch import list_watch
from node_agent.systemd import SystemdSeam
from tests.unit.fakes import ACTIVE, FakeKube, FakeSystemd


async def test_missing_objects_answer_404_and_merge_patches_merge() -> None:
    kube = FakeKube()
    with pytest.raises(KubeNotFound):
        await kube.get_node("n1")
    node = kube.nodes().put({"metadata": {"name": "n1", "annotations": {"a": "1", "b": "2"}}})
    await kube.patch_node("n1", {"metadata": {"annotations": {"a": None, "c": "3"}}})
    assert node["metadata"]["annotations"] == {"b": "2", "c": "3"}
    assert await kube.get_node("n1") is node
    assert kube.calls == [
        ("patch_node", "n1", {"metadata": {"annotations": {"a": None, "c": "3"}}})
    ]
    assert kube.reads == [("get_node", "n1"), ("get_node", "n1")]


async def test_leases_are_compare_and_swap() -> None:
    kube = FakeKube()
    lease = {"metadata": {"name": "l", "resourceVersion": "1"}, "spec": {}}
    await kube.create_lease("kube-system", lease)
    with pytest.raises(KubeAlreadyExists):
        await kube.create_lease("kube-system", lease)
    current = await kube.get_lease("kube-system", "l")
    updated = await kube.update_lease("kube-system", "l", current)
    assert updated["metadata"]["resourceVersion"] != "1"
    with pytest.raises(KubeConflict):
        await kube.update_lease("kube-system", "l", lease)  # read before the update: stale


async def test_injected_failures_come_first_then_the_call_works() -> None:
    kube = FakeKube()
    kube.secrets("kube-system").put({"metadata": {"name": "s"}})
    kube.fail("get_secret", KubeTransportError("down"), times=2)
    for _ in range(2):
        with pytest.raises(KubeTransportError):
            await kube.get_secret("kube-system", "s")
    assert (await kube.get_secret("kube-system", "s"))["metadata"]["name"] == "s"


async def test_list_watch_sees_the_fakes_changes() -> None:
    kube = FakeKube()
    secrets = kube.secrets("kube-system")
    secrets.put({"metadata": {"name": "s"}, "data": {"k": "1"}})
    seen: list[tuple[str, object]] = []
    stream = list_watch(secrets, field_selector="metadata.name=s")
    async with asyncio.timeout(5):
        async for event in stream:
            seen.append((event.type, event.object and event.object["data"]))
            if event.type == "SYNC":
                secrets.put({"metadata": {"name": "other"}})  # not selected
                secrets.put({"metadata": {"name": "s"}, "data": {"k": "2"}})
            else:
                break
    assert seen == [("SYNC", {"k": "1"}), ("MODIFIED", {"k": "2"})]


async def test_fake_systemd_jobs_change_states_and_are_recorded() -> None:
    calls: list[tuple[object, ...]] = []
    systemd = FakeSystemd({"a.service": ACTIVE}, failing={"b.service"}, calls=calls)
    assert isinstance(systemd, SystemdSeam)
    assert (await systemd.stop_unit("a.service")).ok
    assert not (await systemd.restart_unit("b.service")).ok
    await systemd.enable(["a.service"])
    await systemd.daemon_reload()
    states = await systemd.unit_states(["a.service", "b.service", "c.service"])
    assert (states["a.service"].active_state, states["a.service"].unit_file_state) == (
        "inactive",
        "enabled",
    )
    assert states["b.service"].active_state == "failed"
    assert states["c.service"].load_state == "not-found"
    assert await systemd.failed_units() == ["b.service"]
    assert calls == [
        ("stop", "a.service"),
        ("restart", "b.service"),
        ("enable", "a.service"),
        ("daemon_reload",),
    ]
    assert systemd.jobs == [("a.service", "stop"), ("b.service", "restart")]
