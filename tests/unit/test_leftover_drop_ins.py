"""The plan's base learns the drop-ins an apply wrote before its journal was lost."""

from __future__ import annotations

from node_agent.apply.applier import LEFTOVER_CONTENT, with_leftover_drop_ins
from node_agent.osc.applied import Applied, AppliedUnit

D = "/etc/systemd/system"


def test_unknown_owned_drop_in_joins_the_base_under_its_unit() -> None:
    base = Applied(units={"a.service": AppliedUnit(name="a.service", drop_ins={"1.conf": "x"})})
    target = Applied(units={"a.service": AppliedUnit(name="a.service")})
    owned = {f"{D}/a.service.d/1.conf", f"{D}/a.service.d/2.conf", f"{D}/b.service.d/3.conf"}
    got = with_leftover_drop_ins(base, target, owned)
    assert got.units["a.service"].drop_ins == {"1.conf": "x", "2.conf": LEFTOVER_CONTENT}
    assert got.units["b.service"] == AppliedUnit(
        name="b.service", drop_ins={"3.conf": LEFTOVER_CONTENT}
    )


def test_nothing_unknown_leaves_the_base_as_it_is() -> None:
    base = Applied(units={"a.service": AppliedUnit(name="a.service", drop_ins={"1.conf": "x"})})
    owned = {f"{D}/a.service.d/1.conf", "/etc/other/file", f"{D}/a.service"}
    assert with_leftover_drop_ins(base, Applied(), owned) is base


def test_a_leftover_unit_the_target_lacks_is_left_to_the_sweep() -> None:
    owned = {f"{D}/gone.service", f"{D}/gone.service.d/1.conf"}
    assert with_leftover_drop_ins(Applied(), Applied(), owned) == Applied()
    target = Applied(units={"gone.service": AppliedUnit(name="gone.service", content="[Unit]\n")})
    got = with_leftover_drop_ins(Applied(), target, owned)
    assert got.units["gone.service"].drop_ins == {"1.conf": LEFTOVER_CONTENT}
