"""What is applied on the host, item by item: the planner's starting point.

Upstream diffs a new OSC against the last OSC that applied completely. That base is wrong as soon
as an apply stops half-way (a unit that fails, a read-only file, kill -9): part of the newer OSC is
already on disk, part is not, and planning the next OSC from the old one re-does or un-does the
wrong things — e.g. disabling a unit file that is already gone, forever. node-agent plans from an
``Applied`` instead: per file its mode and digest, per unit its definition, and the units that
still owe a start/stop/restart because something of theirs changed and the command has not
succeeded yet. ``Applied.of_osc`` gives the base of a fully applied OSC; ``osc.settle`` gives the
base after a partial apply, from its journal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from node_agent.base.digest import sha256_hex
from node_agent.base.errors import SecretRefError
from node_agent.osc.decode import decode_inline
from node_agent.osc.memo import ITEM_MEMO_BYTES, Memo, item_weight
from node_agent.osc.merge import osc_files, osc_units
from node_agent.osc.models import File, ImageRefContent, OperatingSystemConfig, Unit

DEFAULT_FILE_MODE = 0o600


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class AppliedFile(_Frozen):
    """A file as the OSC defines it: ``sha256`` None when its bytes are unknown (a secretRef whose
    bytes were not recorded, an imageRef); then it compares by ``source``."""

    mode: int
    sha256: str | None = None
    source: tuple[str, ...] = ()
    image_ref: ImageRefContent | None = None


class AppliedUnit(_Frozen):
    """A unit's definition: its file, drop-ins, and the fields that decide its command."""

    name: str
    content: str | None = None
    drop_ins: dict[str, str] = Field(default_factory=dict)
    enable: bool | None = None
    command: str | None = None
    file_paths: tuple[str, ...] = ()

    @classmethod
    def of(cls, unit: Unit) -> AppliedUnit:
        """The unit's definition (the same object for the same unit: see ``_UNITS``)."""
        return _UNITS.get(unit, cls._of)

    @classmethod
    def _of(cls, unit: Unit) -> AppliedUnit:
        return cls(
            name=unit.name,
            content=unit.content,
            drop_ins={d.name: d.content for d in unit.drop_ins},
            enable=unit.enable,
            command=unit.command,
            file_paths=unit.file_paths,
        )

    def is_empty(self) -> bool:
        """Nothing of it is on the host: no unit file, no drop-ins."""
        return self.content is None and not self.drop_ins


class Owed(_Frozen):
    """A command a unit still owes: an earlier apply changed it on disk and the command did not
    succeed (it failed, was blocked, or the agent was killed before it)."""

    action: Literal["restart", "stop"]
    reasons: tuple[str, ...]


class Applied(_Frozen):
    files: dict[str, AppliedFile] = Field(default_factory=dict)
    units: dict[str, AppliedUnit] = Field(default_factory=dict)
    #: unit -> why a command is still owed (its definition changed on disk, the command did not
    #: succeed yet); the next plan carries these into its commands.
    owed: dict[str, Owed] = Field(default_factory=dict)

    @classmethod
    def of_osc(
        cls,
        osc: OperatingSystemConfig | None,
        host_name: str,
        resolved: Mapping[str, bytes] | None = None,
        *,
        required: bool = False,
    ) -> Applied:
        """The items of ``osc`` (None: nothing). ``resolved`` holds secretRef bytes by path; with
        ``required`` a secretRef file whose bytes are missing is an error (a desired OSC),
        otherwise its digest is unknown (an old OSC whose secret bytes were not recorded)."""
        if osc is None:
            return cls()
        refs = resolved or {}
        file_list, unit_list = osc_files(osc, host_name), osc_units(osc)
        last = _LAST_OF_OSC[0]
        if last is not None and last.required == required:
            files = last.files_by_change(file_list, refs)
            units = last.units_by_change(unit_list)
        else:
            files = units = None
        if files is None:
            files = {f.path: file_state(f, refs, required=required) for f in file_list}
        if units is None:
            units = {u.name: AppliedUnit.of(u) for u in unit_list}
        _LAST_OF_OSC[0] = _ItemsOf(required, file_list, unit_list, files, units)
        return cls(files=files, units=units)


class AppliedChanges(_Frozen):
    """An ``Applied`` written as its changes to another (the base): the items added or
    replaced, the paths and names removed (None), and the commands owed in full. A journal
    keeps its target this way, so what it writes before an apply follows the change, not the
    OSC."""

    files: dict[str, AppliedFile | None] = Field(default_factory=dict)
    units: dict[str, AppliedUnit | None] = Field(default_factory=dict)
    owed: dict[str, Owed] = Field(default_factory=dict)

    @classmethod
    def between(cls, base: Applied, target: Applied) -> AppliedChanges:
        """What turns ``base`` into ``target`` (an item object both share is unchanged)."""
        return cls(
            files=_changed(base.files, target.files),
            units=_changed(base.units, target.units),
            owed=target.owed,
        )

    def apply_to(self, base: Applied) -> Applied:
        return Applied(
            files=_with_changes(base.files, self.files),
            units=_with_changes(base.units, self.units),
            owed=self.owed,
        )


_Item = TypeVar("_Item")


def _changed(base: Mapping[str, _Item], target: Mapping[str, _Item]) -> dict[str, _Item | None]:
    changes: dict[str, _Item | None] = {
        key: item for key, item in target.items() if base.get(key) is not item
    }
    changes.update(dict.fromkeys(base.keys() - target.keys()))
    return changes


def _with_changes(
    base: Mapping[str, _Item], changes: Mapping[str, _Item | None]
) -> dict[str, _Item]:
    items = dict(base)
    for key, item in changes.items():
        if item is None:
            items.pop(key, None)
        else:
            items[key] = item
    return items


@dataclass(frozen=True)
class _ItemsOf:
    """The items of the OSC ``Applied.of_osc`` last made an ``Applied`` of, and what it made.

    An update usually replaces a few item objects of the OSC before and keeps the others
    (decoding reuses them), so the next OSC's items are found by what changed, in place, when
    every item is where it was: the cost follows the change, not the OSC."""

    required: bool
    file_list: tuple[File, ...]
    unit_list: tuple[Unit, ...]
    files: dict[str, AppliedFile]
    units: dict[str, AppliedUnit]

    def files_by_change(
        self, file_list: tuple[File, ...], refs: Mapping[str, bytes]
    ) -> dict[str, AppliedFile] | None:
        """The files' states, or None when the files are not the same paths in the same
        places. Files that are not inline are always made again (their bytes are in ``refs``)."""
        if len(file_list) != len(self.file_list) or len(self.files) != len(file_list):
            return None  # another shape, or a path twice (the last one counts)
        files = dict(self.files)
        for new, old in zip(file_list, self.file_list, strict=True):
            if new is old and new.content.inline is not None:
                continue
            if new.path != old.path:
                return None
            files[new.path] = file_state(new, refs, required=self.required)
        return files

    def units_by_change(self, unit_list: tuple[Unit, ...]) -> dict[str, AppliedUnit] | None:
        if len(unit_list) != len(self.unit_list) or len(self.units) != len(unit_list):
            return None
        units = dict(self.units)
        for new, old in zip(unit_list, self.unit_list, strict=True):
            if new is old:
                continue
            if new.name != old.name:
                return None
            units[new.name] = AppliedUnit.of(new)
        return units


#: the last OSC ``Applied.of_osc`` was asked about (None: none yet)
_LAST_OF_OSC: list[_ItemsOf | None] = [None]


def file_state(file: File, resolved: Mapping[str, bytes], *, required: bool) -> AppliedFile:
    """What ``file`` puts on the host; an inline file's is kept for the next OSC (``_INLINE``):
    base64-decoding and hashing every file of the OSC again on each update would cost in
    proportion to the OSC, not to the change."""
    if file.content.inline is not None:
        return _INLINE.get(file, _inline_state)
    mode = DEFAULT_FILE_MODE if file.permissions is None else file.permissions
    content = file.content
    if content.secret_ref is not None:
        ref = content.secret_ref
        raw = resolved.get(file.path)
        if raw is None and required:
            raise SecretRefError(
                ref.name, ref.data_key, path=file.path, reason="content was not resolved"
            )
        digest = sha256_hex(raw) if raw is not None else None
        return AppliedFile(mode=mode, sha256=digest, source=("secretRef", ref.name, ref.data_key))
    if content.image_ref is not None:
        img = content.image_ref
        return AppliedFile(
            mode=mode, source=("imageRef", img.image, img.file_path_in_image), image_ref=img
        )
    return AppliedFile(mode=mode, source=("none",))


def _inline_state(file: File) -> AppliedFile:
    assert file.content.inline is not None
    data = decode_inline(file.content.inline, path=file.path)
    mode = DEFAULT_FILE_MODE if file.permissions is None else file.permissions
    return AppliedFile(mode=mode, sha256=sha256_hex(data), source=("inline",))


#: the state of inline files and the definition of units, by the (frozen, hashable) OSC item
_INLINE: Memo[File, AppliedFile] = Memo(ITEM_MEMO_BYTES, item_weight)
_UNITS: Memo[Unit, AppliedUnit] = Memo(ITEM_MEMO_BYTES, item_weight)


def adopt(
    base: Applied, target: Applied, matching: set[str], unit_dir: str, running: set[str]
) -> Applied:
    """``base`` plus the target's files and drop-ins that are new to it but already on disk as
    the target wants them (``matching``: host paths whose bytes and mode match), so they are
    neither rewritten nor a reason to restart anything; and the target's units without content
    that ask for nothing themselves (no ``enable``, no ``command``), are ``running`` (active
    now) and have nothing left to change — e.g. the distribution's containerd service whose
    drop-in is already in place: they are not restarted merely for being new. Units with
    content, or that ask to be enabled, started or restarted, are never adopted: the first apply
    does what they ask."""
    files = dict(base.files)
    for path, state in target.files.items():
        if path not in files and path in matching:
            files[path] = state
    units = dict(base.units)
    for name, unit in target.units.items():
        asks = unit.enable is not None or unit.command is not None
        if name in units or unit.content is not None or asks or name not in running:
            continue
        dropins = {n: c for n, c in unit.drop_ins.items() if f"{unit_dir}/{name}.d/{n}" in matching}
        if dropins != unit.drop_ins:
            if dropins:
                units[name] = unit.model_copy(update={"drop_ins": dropins})
            continue
        units[name] = unit
    return base.model_copy(update={"files": files, "units": units})
