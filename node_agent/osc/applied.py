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

import hashlib
from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

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
        files = {f.path: file_state(f, refs, required=required) for f in osc_files(osc, host_name)}
        units = {u.name: AppliedUnit.of(u) for u in osc_units(osc)}
        return cls(files=files, units=units)


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
        digest = sha256_of(raw) if raw is not None else None
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
    return AppliedFile(mode=mode, sha256=sha256_of(data), source=("inline",))


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
