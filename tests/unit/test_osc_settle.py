"""The base after a partial apply (``settle``) and the plans made from it: the cases that used to
wedge a node, one example each."""

from __future__ import annotations

from typing import Any

from node_agent.osc.applied import Applied, Owed, adopt
from node_agent.osc.models import OperatingSystemConfig
from node_agent.osc.plan import plan
from node_agent.osc.settle import settle
from node_agent.osc.steps import step_ids

HOST = "node-1"
CONF = "/etc/app/app.conf"


def make(files: list[dict[str, Any]] | None = None, units: list[Any] | None = None) -> Any:
    return OperatingSystemConfig.model_validate(
        {
            "apiVersion": "extensions.gardener.cloud/v1alpha1",
            "kind": "OperatingSystemConfig",
            "spec": {"files": files or [], "units": units or []},
        }
    )


def text(path: str, data: str) -> dict[str, Any]:
    return {"path": path, "permissions": 0o644, "content": {"inline": {"data": data}}}


def unit(name: str, body: str = "[Service]\nExecStart=/bin/true\n", **extra: Any) -> Any:
    return {"name": name, "content": body, "enable": True, **extra}


def applied(osc: Any) -> Applied:
    return Applied.of_osc(osc, HOST)


def run(a: Any, b: Any, *, fail: set[str]) -> Applied:
    """Plan ``a`` → ``b``, pretend every step but ``fail`` ran, and settle."""
    base = applied(a)
    cs = plan(base, b, HOST)
    done = [s for s in step_ids(cs) if s not in fail]
    return settle(base, applied(b), cs, done)


def test_a_unit_deleted_by_a_failed_apply_is_not_disabled_again() -> None:
    """Finding 1: B removed x.service and added a failing unit; C must not touch x again."""
    a = make(units=[unit("x.service")])
    b = make(units=[unit("bad.service", "[Service]\nType=oneshot\nExecStart=/bin/false\n")])
    settled = run(a, b, fail={"cmd:bad.service"})
    assert "x.service" not in settled.units
    assert settled.owed == {
        "bad.service": Owed(
            action="restart",
            reasons=("an earlier apply changed it and its restart has not succeeded yet",),
        )
    }
    c = make(units=[unit("y.service")])
    cs = plan(settled, c, HOST)
    assert "x.service" not in cs.units_to_disable
    assert [u.name for u in cs.units_to_delete] == ["bad.service"]
    assert {c.unit: c.action for c in cs.unit_commands} == {
        "bad.service": "stop",
        "y.service": "restart",
    }


def test_a_file_that_could_not_be_written_leaves_nothing_to_undo() -> None:
    """Finding 3: v2's file on a read-only mount failed; v3 without it plans no deletion."""
    v1 = make([text("/etc/a", "1")])
    v2 = make([text("/etc/a", "2"), text("/srv/ro/new", "n")])
    settled = run(v1, v2, fail={"file:/srv/ro/new"})
    assert "/srv/ro/new" not in settled.files
    cs = plan(settled, make([text("/etc/a", "2")]), HOST)
    assert cs.is_empty()


def test_a_change_that_landed_without_its_restart_is_owed_once() -> None:
    """Finding 4: the unit's config was written, its restart failed; the retry (or a newer OSC
    with the same config) restarts it once and rewrites nothing."""
    a = make([text(CONF, "v1")], [unit("app.service", filePaths=[CONF])])
    b = make([text(CONF, "v2")], [unit("app.service", filePaths=[CONF])])
    settled = run(a, b, fail={"cmd:app.service"})
    cs = plan(settled, b, HOST)
    assert cs.files_to_write == ()
    assert [(c.unit, c.action) for c in cs.unit_commands] == [("app.service", "restart")]


def test_a_healthy_sibling_is_not_owed_anything() -> None:
    a = make([text(CONF, "v1")], [unit("app.service", filePaths=[CONF]), unit("bad.service")])
    b = make(
        [text(CONF, "v2")],
        [unit("app.service", filePaths=[CONF]), unit("bad.service", "[Service]\nbroken\n")],
    )
    settled = run(a, b, fail={"cmd:bad.service"})
    assert set(settled.owed) == {"bad.service"}
    cs = plan(settled, b, HOST)
    assert [c.unit for c in cs.unit_commands] == ["bad.service"]


def test_a_write_that_never_ran_is_not_assumed() -> None:
    """Finding 2: killed after the first file of B; C reverts the other file to A's bytes, so
    only the file B did write is rewritten, and its unit restarts once."""
    a = make(
        [text(CONF, "v1"), text("/etc/other", "o1")],
        [unit("app.service", filePaths=[CONF]), unit("other.service", filePaths=["/etc/other"])],
    )
    b = make(
        [text(CONF, "v2"), text("/etc/other", "o2")],
        [unit("app.service", filePaths=[CONF]), unit("other.service", filePaths=["/etc/other"])],
    )
    base = applied(a)
    cs = plan(base, b, HOST)
    settled = settle(base, applied(b), cs, [f"file:{CONF}"])  # then kill -9
    assert settled.files["/etc/other"] == base.files["/etc/other"]
    assert set(settled.owed) == {"app.service"}
    cs_c = plan(settled, a, HOST)  # C == A
    assert [f.path for f in cs_c.files_to_write] == [CONF]
    assert [c.unit for c in cs_c.unit_commands] == ["app.service"]


def test_a_removed_unit_whose_file_is_gone_but_not_stopped_is_still_stopped() -> None:
    a = make(units=[unit("x.service")])
    base = applied(a)
    cs = plan(base, make(), HOST)
    settled = settle(base, Applied(), cs, ["disable:x.service", "reload", "delete-unit:x.service"])
    # (the stop failed, yet the file was deleted: an older agent did this)
    cs2 = plan(settled, make(), HOST)
    assert [(c.unit, c.action) for c in cs2.unit_commands] == [("x.service", "stop")]
    assert cs2.units_to_delete == ()


def test_everything_done_settles_to_the_target() -> None:
    a = make([text(CONF, "v1")], [unit("app.service", filePaths=[CONF]), unit("x.service")])
    b = make([text(CONF, "v2"), text("/etc/new", "n")], [unit("app.service", filePaths=[CONF])])
    settled = run(a, b, fail=set())
    assert settled == applied(b)
    assert plan(settled, b, HOST).is_empty()


def test_items_already_on_disk_are_adopted_without_a_restart() -> None:
    """A first apply where containerd's drop-in and config already match: nothing to do for
    containerd; a unit with content or one that asks to be started is still started."""
    cfg = "/etc/containerd/config.toml"
    osc = make(
        [text(cfg, "cfg")],
        [
            {
                "name": "containerd.service",
                "filePaths": [cfg],
                "dropIns": [{"name": "30.conf", "content": "x"}],
            },
            {"name": "systemd-sysctl.service", "command": "restart"},
            unit("kubelet.service"),
        ],
    )
    target = applied(osc)
    dropin = "/etc/systemd/system/containerd.service.d/30.conf"
    base = adopt(Applied(), target, {cfg, dropin}, "/etc/systemd/system", {"containerd.service"})
    cs = plan(base, osc, HOST)
    assert cs.files_to_write == ()
    assert cs.dropins_to_write == ()
    assert [c.unit for c in cs.unit_commands] == ["kubelet.service", "systemd-sysctl.service"]


def test_a_changed_drop_in_of_an_adopted_unit_still_restarts_it() -> None:
    osc = make(
        units=[{"name": "containerd.service", "dropIns": [{"name": "30.conf", "content": "new"}]}]
    )
    base = adopt(
        Applied(), applied(osc), set(), "/etc/systemd/system", {"containerd.service"}
    )  # not on disk as wanted
    cs = plan(base, osc, HOST)
    assert [d.name for d in cs.dropins_to_write] == ["30.conf"]
    assert [c.unit for c in cs.unit_commands] == ["containerd.service"]


def test_a_distro_unit_that_left_the_osc_keeps_its_owed_restart() -> None:
    """B wrote a file of a unit without content and its restart did not happen; C drops both:
    the debt is paid (the executor turns it into a stop when systemd no longer knows the unit),
    after a reload, and the file is deleted."""
    a = make([text("/etc/a", "1")], [unit("h.service")])
    b = make(
        [text("/etc/a", "1"), text("/etc/c.conf", "c")],
        [unit("h.service"), {"name": "absent.service", "filePaths": ["/etc/c.conf"]}],
    )
    base = adopt(applied(a), applied(b), set(), "/etc/systemd/system", {"absent.service"})
    cs = plan(base, b, HOST)
    done = [s for s in step_ids(cs) if "absent" not in s]
    settled = settle(base, applied(b), cs, done)
    assert "absent.service" in settled.owed
    cs_c = plan(settled, a, HOST)
    assert [(c.unit, c.action, c.removed) for c in cs_c.unit_commands] == [
        ("absent.service", "restart", True)
    ]
    assert cs_c.reload
    assert "reload" in step_ids(cs_c)
    assert [f.path for f in cs_c.files_to_delete] == ["/etc/c.conf"]
