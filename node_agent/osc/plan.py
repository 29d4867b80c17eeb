"""The planner: a pure diff from the last-applied OSC to the desired one.

``plan()`` does no I/O. The caller resolves ``secretRef`` contents beforehand and passes the bytes
in, persists the returned ``ChangeSet`` before touching the host, and then executes it. Everything
is sorted so that the same inputs always give byte-identical JSON.

Decisions beyond upstream gardener-node-agent:
- files compare by decoded bytes and mode, so moving a file between ``spec`` and ``status``, or
  re-encoding it, is not a change; a secretRef file compares by bytes when the previous bytes are
  known (``previous_resolved``), otherwise by its reference, as upstream does;
- a unit is restarted when its content, drop-ins, ``enable`` or ``command`` changed, or when a file
  in its old or new ``filePaths`` was written or deleted; a reordered or extended ``filePaths``
  list alone does not restart it;
- changed units are restarted, never merely started (upstream does the same): ``restart`` starts a
  stopped unit and also picks up a new definition of a unit that is already running;
- the agent's own unit is always enabled, never stopped or removed, and its restart comes last,
  flagged ``is_agent``, so the executor can do it after everything else;
- a template unit (``foo@.service``) is only files: its unit file and drop-ins are written and
  deleted (and systemd reloaded), but it gets no enable, disable or job, whatever ``enable`` and
  ``command`` say: systemd refuses a job for a name without an instance, so upstream's attempt
  fails every retry and the OSC is never reported. Its instances are left as they are.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, PlainSerializer

from node_agent.base.layout import AGENT_UNIT
from node_agent.osc.applied import (
    DEFAULT_FILE_MODE,
    Applied,
    AppliedFile,
    AppliedUnit,
    Owed,
)
from node_agent.osc.decode import decode_inline
from node_agent.osc.merge import osc_files
from node_agent.osc.models import File, ImageRefContent, OperatingSystemConfig

__all__ = ["AGENT_UNIT", "DEFAULT_FILE_MODE", "Applied", "ChangeSet", "UnitCommand", "plan"]

UnitAction = Literal["restart", "stop"]


def is_template(name: str) -> bool:
    """``foo@.service``: a template, which systemd can load instances of but never runs by this
    name (start, stop, restart are refused: "missing the instance name")."""
    stem, dot, _ = name.rpartition(".")
    return bool(dot) and stem.endswith("@")


class _Entry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _from_base64(value: object) -> object:
    return base64.b64decode(value, validate=True) if isinstance(value, str) else value


# File bytes appear in JSON/YAML as standard base64 (``base64 -d`` reads them back).
Base64Bytes = Annotated[
    bytes,
    BeforeValidator(_from_base64),
    PlainSerializer(lambda data: base64.b64encode(data).decode(), when_used="json"),
]


class FileWrite(_Entry):
    """Write ``content`` to ``path`` with ``mode``; for imageRef files, copy it from the image."""

    path: str
    mode: int
    content: Base64Bytes | None = None
    sha256: str | None = None
    image_ref: ImageRefContent | None = None
    reason: str


class FileDelete(_Entry):
    path: str
    reason: str


class UnitWrite(_Entry):
    name: str
    content: str
    reason: str


class UnitDelete(_Entry):
    """Delete the unit file the agent wrote (the unit's drop-ins are listed separately)."""

    name: str
    reason: str


class DropInWrite(_Entry):
    unit: str
    name: str
    content: str
    reason: str


class DropInDelete(_Entry):
    unit: str
    name: str
    reason: str


class UnitCommand(_Entry):
    """What to do with a changed unit once files and units are written and systemd reloaded.

    ``removed`` units left the OSC: stop them before their unit files are deleted. ``is_agent``
    marks the agent's own unit, always the last command.
    """

    unit: str
    action: UnitAction
    reasons: tuple[str, ...]
    removed: bool = False
    is_agent: bool = False

    def describe(self) -> str:
        verb = "restarts" if self.action == "restart" else "stops"
        return f"{self.unit} {verb} because {'; '.join(self.reasons)}"


class ChangeSet(_Entry):
    files_to_write: tuple[FileWrite, ...] = ()
    files_to_delete: tuple[FileDelete, ...] = ()
    units_to_write: tuple[UnitWrite, ...] = ()
    units_to_delete: tuple[UnitDelete, ...] = ()
    dropins_to_write: tuple[DropInWrite, ...] = ()
    dropins_to_delete: tuple[DropInDelete, ...] = ()
    units_to_enable: tuple[str, ...] = ()
    units_to_disable: tuple[str, ...] = ()
    unit_commands: tuple[UnitCommand, ...] = ()
    agent_unit: str = AGENT_UNIT
    #: reload systemd before the commands even if no unit file changes: a command is carried
    #: over from an unfinished apply, which may have changed unit files without reloading
    reload: bool = False

    def is_empty(self) -> bool:
        return not any(
            (
                self.files_to_write,
                self.files_to_delete,
                self.units_to_write,
                self.units_to_delete,
                self.dropins_to_write,
                self.dropins_to_delete,
                self.units_to_enable,
                self.units_to_disable,
                self.unit_commands,
            )
        )

    def late_enables(self) -> frozenset[str]:
        """Units enabled after their command (see ``steps.py``): each is restarted or started
        (not the agent, not a unit leaving the OSC), none of its unit files or drop-ins is
        written or deleted, and no command carried over from an unfinished apply asks for a
        reload first. Re-asserting their enablement cannot change what the command runs."""
        if self.reload:
            return frozenset()
        touched = {u.name for u in self.units_to_write}
        touched |= {u.name for u in self.units_to_delete}
        touched |= {d.unit for d in self.dropins_to_write}
        touched |= {d.unit for d in self.dropins_to_delete}
        commanded = {c.unit for c in self.unit_commands if not c.is_agent and not c.removed}
        return frozenset(u for u in self.units_to_enable if u in commanded and u not in touched)

    @property
    def restarts_agent(self) -> bool:
        return any(cmd.is_agent for cmd in self.unit_commands)

    def reasons(self) -> list[str]:
        """One sentence per unit command, e.g. ``kubelet.service restarts because ...``."""
        return [cmd.describe() for cmd in self.unit_commands]

    def rows(self) -> list[tuple[str, str, str]]:
        """(action, target, reason) rows in the order an executor applies them, for a table."""
        rows = [_file_row(f) for f in self.files_to_write]
        rows += [("write unit", u.name, u.reason) for u in self.units_to_write]
        rows += [("write drop-in", f"{d.unit}/{d.name}", d.reason) for d in self.dropins_to_write]
        rows += [("delete drop-in", f"{d.unit}/{d.name}", d.reason) for d in self.dropins_to_delete]
        late = self.late_enables()
        rows += [("enable", name, "") for name in self.units_to_enable if name not in late]
        rows += [("disable", name, "") for name in self.units_to_disable]
        rows += [(c.action, c.unit, "; ".join(c.reasons)) for c in self.unit_commands]
        rows += [("enable", name, "after its restart") for name in sorted(late)]
        rows += [("delete unit", u.name, u.reason) for u in self.units_to_delete]
        rows += [("delete", f.path, f.reason) for f in self.files_to_delete]
        return rows

    def summary(self) -> str:
        rows = self.rows()
        if not rows:
            return "no changes"
        table = [("ACTION", "TARGET", "REASON"), *rows]
        widths = [max(len(row[i]) for row in table) for i in range(2)]
        return "\n".join(f"{a:<{widths[0]}}  {t:<{widths[1]}}  {r}".rstrip() for a, t, r in table)

    def to_json(self) -> str:
        return self.model_dump_json(indent=2)

    @classmethod
    def from_json(cls, text: str | bytes) -> ChangeSet:
        return cls.model_validate_json(text)

    def to_yaml(self) -> str:
        data: dict[str, Any] = json.loads(self.to_json())
        return yaml.safe_dump(data, sort_keys=False)

    @classmethod
    def from_yaml(cls, text: str | bytes) -> ChangeSet:
        # Round-trip through JSON so bytes fields are read back from base64.
        return cls.model_validate_json(json.dumps(yaml.safe_load(text)))


def _file_row(f: FileWrite) -> tuple[str, str, str]:
    """A file from an image is a pull: the row names the image and the file in it."""
    if f.image_ref is None:
        return ("write", f"{f.path} ({f.mode:04o})", f.reason)
    source = f"from {f.image_ref.image}:{f.image_ref.file_path_in_image}"
    return ("pull", f"{f.path} ({f.mode:04o})", f"{source}; {f.reason}")


def plan(
    previous: Applied | OperatingSystemConfig | None,
    desired: OperatingSystemConfig,
    host_name: str,
    resolved: Mapping[str, bytes] | None = None,
    *,
    previous_resolved: Mapping[str, bytes] | None = None,
    agent_unit: str = AGENT_UNIT,
    target: Applied | None = None,
) -> ChangeSet:
    """Compute what to change on the host to go from ``previous`` to ``desired``.

    ``previous`` is what is applied: an ``Applied`` (item by item, e.g. after a partial apply),
    an OSC that applied completely, or None (nothing is known to be applied: every file and unit
    is new and nothing is deleted). ``resolved`` maps the path of every desired secretRef file
    (see ``merge.secret_refs``) to its bytes; ``previous_resolved`` does the same for a previous
    OSC, if known. Inputs are expected to have passed ``decode.validate_osc``. ``target``:
    ``Applied.of_osc(desired, host_name, resolved, required=True)`` when the caller has it
    already (it is not made twice).
    """
    base = (
        previous
        if isinstance(previous, Applied)
        else Applied.of_osc(previous, host_name, previous_resolved)
    )
    refs = resolved or {}
    wanted = {f.path: f for f in osc_files(desired, host_name)}
    if target is None:
        target = Applied.of_osc(desired, host_name, refs, required=True)
    new_files = target.files
    # An item object the base shares with the target is unchanged (both are frozen; decoding
    # and ``Applied.of_osc`` reuse the objects of items an update did not touch), so only the
    # others are compared: the plan's cost follows the change, not the OSC.
    old_files = base.files
    writes = [
        _file_write(wanted[path], new, refs, reason)
        for path, new in sorted(
            (path, new) for path, new in new_files.items() if old_files.get(path) is not new
        )
        if (reason := _file_change(old_files.get(path), new))
    ]
    deletes = [
        FileDelete(path=p, reason="removed from the OSC")
        for p in sorted(base.files.keys() - new_files.keys())
    ]
    changed_paths = {w.path: "changed" for w in writes} | {d.path: "was removed" for d in deletes}

    builder = _UnitPlanner(agent_unit, changed_paths, base.owed)
    new_units = target.units
    for name in sorted(new_units):
        builder.desired(base.units.get(name), new_units[name])
    for name in sorted(base.units.keys() - new_units.keys()):
        builder.removed(base.units[name])
    return builder.change_set(files_to_write=tuple(writes), files_to_delete=tuple(deletes))


def _file_change(old: AppliedFile | None, new: AppliedFile) -> str | None:
    if old is None:
        return "new file"
    reasons = []
    if old.mode != new.mode:
        reasons.append(f"mode changed from {old.mode:04o} to {new.mode:04o}")
    if new.image_ref is not None or old.image_ref is not None:
        if old.source != new.source:
            reasons.append("image reference changed")
    elif old.sha256 is not None and new.sha256 is not None:
        if old.sha256 != new.sha256:
            reasons.append("content changed")
    elif old.source != new.source:
        reasons.append("content source changed")
    return "; ".join(reasons) or None


def _file_write(
    file: File, state: AppliedFile, refs: Mapping[str, bytes], reason: str
) -> FileWrite:
    content: bytes | None = None
    if file.content.inline is not None:
        content = decode_inline(file.content.inline, path=file.path)
    elif file.content.secret_ref is not None:
        content = refs[file.path]
    return FileWrite(
        path=file.path,
        mode=state.mode,
        content=content,
        sha256=state.sha256 if content is not None else None,
        image_ref=state.image_ref,
        reason=reason,
    )


class _UnitPlanner:
    """Accumulates the unit part of a change set, one unit at a time."""

    def __init__(
        self, agent_unit: str, changed_paths: Mapping[str, str], owed: Mapping[str, Owed]
    ) -> None:
        self.agent_unit = agent_unit
        self.changed_paths = changed_paths
        self.owed = owed
        self.writes: list[UnitWrite] = []
        self.deletes: list[UnitDelete] = []
        self.dropin_writes: list[DropInWrite] = []
        self.dropin_deletes: list[DropInDelete] = []
        self.enable: list[str] = []
        self.disable: list[str] = []
        self.commands: list[UnitCommand] = []
        self.reload = False

    def desired(self, old: AppliedUnit | None, new: AppliedUnit) -> None:
        name = new.name
        if (
            old is new
            and name not in self.owed
            and self.changed_paths.keys().isdisjoint(new.file_paths)
        ):
            return  # the same definition, none of its files changed, nothing owed
        reasons = ["it is new"] if old is None else []
        old_content = old.content if old is not None else None
        if new.content is not None and new.content != old_content:
            why = "unit file changed" if old_content is not None else "new unit file"
            self.writes.append(UnitWrite(name=name, content=new.content, reason=why))
            if old is not None:
                reasons.append(f"its {why}")
        elif new.content is None and old_content is not None:
            self.deletes.append(UnitDelete(name=name, reason="content removed from the OSC"))
            reasons.append("its unit file was removed")
        reasons += self._drop_in_changes(old, new)
        if old is not None:
            reasons += _field_changes(old, new)
            for path in sorted({*old.file_paths, *new.file_paths} & self.changed_paths.keys()):
                reasons.append(f"{path} {self.changed_paths[path]}")
        if name in self.owed:
            reasons += [r for r in self.owed[name].reasons if r not in reasons]
            self.reload = True
        if not reasons or is_template(name):
            return  # a template: its files are all there is to change
        is_agent = name == self.agent_unit
        stop_why = [] if is_agent else _stop_reasons(new)
        if is_agent and _stop_reasons(new):
            reasons.append("it is node-agent's own unit, which is never stopped")
        # Like upstream: re-assert enablement of every changed unit; only enable=false disables.
        (self.disable if new.enable is False and not is_agent else self.enable).append(name)
        self.commands.append(
            UnitCommand(
                unit=name,
                action="stop" if stop_why else "restart",
                reasons=(*stop_why, *reasons),
                is_agent=is_agent,
            )
        )

    def removed(self, old: AppliedUnit) -> None:
        if old.name == self.agent_unit:
            return  # never remove ourselves; an OSC without the agent unit is a Gardener bug
        why = "unit removed from the OSC"
        for name in sorted(old.drop_ins):
            self.dropin_deletes.append(DropInDelete(unit=old.name, name=name, reason=why))
        owed = self.owed.get(old.name)
        if owed is not None:
            self.reload = True
        if is_template(old.name):
            if old.content is not None:  # no job for a template: only its file goes
                self.deletes.append(UnitDelete(name=old.name, reason=why))
            return
        if old.content is None and owed is not None and owed.action == "stop":
            # An earlier apply already deleted its unit file but did not get to stop it.
            self.disable.append(old.name)
            self.commands.append(
                UnitCommand(unit=old.name, action="stop", reasons=owed.reasons, removed=True)
            )
        elif old.content is not None:
            self.deletes.append(UnitDelete(name=old.name, reason=why))
            self.disable.append(old.name)
            reasons: tuple[str, ...] = ("it was removed from the OSC",)
            self.commands.append(
                UnitCommand(unit=old.name, action="stop", reasons=reasons, removed=True)
            )
        elif old.drop_ins or owed is not None:
            # Not our unit (e.g. containerd.service): restart so the removed drop-ins stop applying.
            reasons = ("it was removed from the OSC and its drop-ins deleted",)
            self.commands.append(
                UnitCommand(unit=old.name, action="restart", reasons=reasons, removed=True)
            )

    def _drop_in_changes(self, old: AppliedUnit | None, new: AppliedUnit) -> list[str]:
        old_d = old.drop_ins if old is not None else {}
        new_d = new.drop_ins
        reasons = []
        for name in sorted(new_d):
            if old_d.get(name) == new_d[name]:
                continue
            why = "drop-in changed" if name in old_d else "new drop-in"
            self.dropin_writes.append(
                DropInWrite(unit=new.name, name=name, content=new_d[name], reason=why)
            )
            if old is not None:
                reasons.append(f"its drop-in {name} {'changed' if name in old_d else 'is new'}")
        for name in sorted(old_d.keys() - new_d.keys()):
            self.dropin_deletes.append(
                DropInDelete(unit=new.name, name=name, reason="drop-in removed from the OSC")
            )
            reasons.append(f"its drop-in {name} was removed")
        return reasons

    def change_set(
        self, *, files_to_write: tuple[FileWrite, ...], files_to_delete: tuple[FileDelete, ...]
    ) -> ChangeSet:
        return ChangeSet(
            files_to_write=files_to_write,
            files_to_delete=files_to_delete,
            units_to_write=tuple(sorted(self.writes, key=lambda u: u.name)),
            units_to_delete=tuple(sorted(self.deletes, key=lambda u: u.name)),
            dropins_to_write=tuple(sorted(self.dropin_writes, key=lambda d: (d.unit, d.name))),
            dropins_to_delete=tuple(sorted(self.dropin_deletes, key=lambda d: (d.unit, d.name))),
            units_to_enable=tuple(sorted(self.enable)),
            units_to_disable=tuple(sorted(self.disable)),
            unit_commands=tuple(sorted(self.commands, key=lambda c: (c.is_agent, c.unit))),
            agent_unit=self.agent_unit,
            reload=self.reload and bool(self.commands),
        )


def _stop_reasons(unit: AppliedUnit) -> list[str]:
    reasons = []
    if unit.command == "stop":
        reasons.append("command is stop")
    if unit.enable is False:
        reasons.append("enable is false")
    return reasons


def _field_changes(old: AppliedUnit, new: AppliedUnit) -> list[str]:
    def show(value: object) -> str:
        return "unset" if value is None else json.dumps(value)

    return [
        f"{field} changed from {show(getattr(old, field))} to {show(getattr(new, field))}"
        for field in ("enable", "command")
        if getattr(old, field) != getattr(new, field)
    ]
