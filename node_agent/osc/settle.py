"""What is applied after a partial apply: the base ``Applied`` overlaid with the steps that ran.

An apply journals its change set, the ``Applied`` it started from (``base``) and the one it aims
at (``target``), and marks each step done. When it stops part-way — a unit that fails, a file on
a read-only mount, kill -9 — the host holds ``base`` for the items whose steps did not run and
``target`` for those that did. ``settle`` computes exactly that, so the next plan (a retry, or a
newer OSC) starts from the truth: nothing already done is redone, nothing is undone wrongly, and
a unit whose files changed but whose command did not succeed still owes that command (``owed``).

Pure: the caller decides which steps are done (journal marks, plus writes and deletions it
observed on disk after a crash between a step and its mark).
"""

from __future__ import annotations

from collections.abc import Collection

from node_agent.osc import steps as S
from node_agent.osc.applied import Applied, AppliedUnit, Owed
from node_agent.osc.plan import ChangeSet

OWED_REASON = "an earlier apply changed it and its {action} has not succeeded yet"


def settle(base: Applied, target: Applied, cs: ChangeSet, done: Collection[str]) -> Applied:
    """The ``Applied`` after running the steps ``done`` of ``cs`` (planned from ``base``)."""
    files = dict(base.files)
    for fw in cs.files_to_write:
        if S.file_step(fw.path) in done and fw.path in target.files:
            files[fw.path] = target.files[fw.path]
    for fd in cs.files_to_delete:
        if S.delete_file_step(fd.path) in done:
            files.pop(fd.path, None)

    units: dict[str, AppliedUnit] = dict(base.units)
    touched: set[str] = set()

    def update(name: str, **changes: object) -> None:
        current = units.get(name) or AppliedUnit(name=name)
        units[name] = current.model_copy(update=changes)
        touched.add(name)

    for uw in cs.units_to_write:
        if S.unit_step(uw.name) in done:
            update(uw.name, content=uw.content)
    for ud in cs.units_to_delete:
        if S.delete_unit_step(ud.name) in done:
            update(ud.name, content=None)
    for dw in cs.dropins_to_write:
        if S.dropin_step(dw.unit, dw.name) in done:
            current = units.get(dw.unit) or AppliedUnit(name=dw.unit)
            update(dw.unit, drop_ins={**current.drop_ins, dw.name: dw.content})
    for dd in cs.dropins_to_delete:
        if S.delete_dropin_step(dd.unit, dd.name) in done:
            current = units.get(dd.unit) or AppliedUnit(name=dd.unit)
            rest = {k: v for k, v in current.drop_ins.items() if k != dd.name}
            update(dd.unit, drop_ins=rest)
    for name in (*cs.units_to_enable, *cs.units_to_disable):
        step = S.enable_step(name) if name in cs.units_to_enable else S.disable_step(name)
        if step in done:
            wanted = target.units.get(name)
            update(name, enable=wanted.enable if wanted is not None else False)

    changed_files = {fw.path for fw in cs.files_to_write if S.file_step(fw.path) in done}
    changed_files |= {fd.path for fd in cs.files_to_delete if S.delete_file_step(fd.path) in done}

    owed: dict[str, Owed] = {}
    commanded = {c.unit for c in cs.unit_commands}
    for name, debt in base.owed.items():
        if name not in commanded:
            owed[name] = debt
    for cmd in cs.unit_commands:
        name = cmd.unit
        if S.cmd_step(name) in done:
            wanted = target.units.get(name)
            if wanted is not None:
                # The command ran for the target definition: its fields are now in effect.
                have = units.get(name) or AppliedUnit(name=name)
                units[name] = have.model_copy(
                    update={
                        "enable": wanted.enable,
                        "command": wanted.command,
                        "file_paths": wanted.file_paths,
                    }
                )
            continue
        paths = set(target.units[name].file_paths) if name in target.units else set()
        paths |= set(base.units[name].file_paths) if name in base.units else set()
        if name in touched or name in base.owed or paths & changed_files:
            why = OWED_REASON.format(action=cmd.action)
            owed[name] = Owed(action=cmd.action, reasons=(why,))

    for name in list(units):
        gone = name not in target.units and units[name].is_empty() and name not in owed
        if gone:
            del units[name]
    return Applied(files=files, units=units, owed=owed)
