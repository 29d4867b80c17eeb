"""Flatten an OSC into what one host should have: its files and its merged units.

Gardener splits the configuration between ``spec`` (written by gardenlet) and ``status`` (added by
the OS extension). The agent applies their union: units of the same name are merged field by field,
and files marked with another ``hostName`` are left out.
"""

from __future__ import annotations

from collections.abc import Iterable

from node_agent.osc.memo import Last
from node_agent.osc.models import DropIn, File, OperatingSystemConfig, SecretRefContent, Unit


def merge_units(*groups: Iterable[Unit]) -> tuple[Unit, ...]:
    """Merge units by name, later groups (and later entries) over earlier ones.

    Scalar fields that are set override; drop-ins are appended, a later drop-in replacing an
    earlier one of the same name; file paths are appended without repeats. The result keeps the
    order in which names first appear.
    """
    merged: dict[str, Unit] = {}
    for group in groups:
        for unit in group:
            base = merged.get(unit.name)
            merged[unit.name] = unit if base is None else _merge_pair(base, unit)
    return tuple(_dedupe(unit) for unit in merged.values())


def osc_units(osc: OperatingSystemConfig) -> tuple[Unit, ...]:
    """The units of ``osc``: ``spec.units`` merged with ``status.extensionUnits``."""
    return _UNITS.get(osc, lambda o: merge_units(o.spec.units, o.status.extension_units))


def osc_files(osc: OperatingSystemConfig, host_name: str) -> tuple[File, ...]:
    """``spec.files`` then ``status.extensionFiles``, without files meant for other hosts."""
    by_host = _FILES.get(osc, lambda _: {})
    files = by_host.get(host_name)
    if files is None:
        files = by_host[host_name] = tuple(
            file
            for file in (*osc.spec.files, *osc.status.extension_files)
            if file.host_name is None or file.host_name == host_name
        )
    return files


#: the items of the last OSC asked about (an OSC is frozen): an update asks for them several
#: times (validation, plan, report), each a pass over the whole OSC
_UNITS: Last[OperatingSystemConfig, tuple[Unit, ...]] = Last()
_FILES: Last[OperatingSystemConfig, dict[str, tuple[File, ...]]] = Last()


def secret_refs(osc: OperatingSystemConfig, host_name: str) -> dict[str, SecretRefContent]:
    """Map each file path whose content lives in a Secret to that Secret reference.

    The caller fetches these and passes the bytes to the planner, which does no I/O itself.
    """
    return {
        file.path: file.content.secret_ref
        for file in osc_files(osc, host_name)
        if file.content.secret_ref is not None
    }


def _merge_pair(base: Unit, extra: Unit) -> Unit:
    return base.model_copy(
        update={
            "command": extra.command if extra.command is not None else base.command,
            "enable": extra.enable if extra.enable is not None else base.enable,
            "content": extra.content if extra.content is not None else base.content,
            "drop_ins": (*base.drop_ins, *extra.drop_ins),
            "file_paths": (*base.file_paths, *extra.file_paths),
        }
    )


def _dedupe(unit: Unit) -> Unit:
    drop_ins: dict[str, DropIn] = {}
    for drop_in in unit.drop_ins:
        drop_ins[drop_in.name] = drop_in
    file_paths = tuple(dict.fromkeys(unit.file_paths))
    if len(drop_ins) == len(unit.drop_ins) and len(file_paths) == len(unit.file_paths):
        return unit
    return unit.model_copy(update={"drop_ins": tuple(drop_ins.values()), "file_paths": file_paths})
