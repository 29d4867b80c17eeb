"""Stable ids for the steps of a ChangeSet, in execution order, for the crash-resume journal.

The executor marks each step done in the journal as it completes it (``StateStore.mark_done``);
after a crash it skips the done ones. Ids are plain strings so the journal stays readable and
survives a change of the ChangeSet model:

    file:<path>                  write a file           delete-dropin:<unit>/<name>
    unit:<unit>                  write a unit file      enable:<unit> / disable:<unit>
    dropin:<unit>/<name>         write a drop-in        reload                (daemon-reload)
    cmd:<unit>                   start/stop/restart     delete-unit:<unit>
    delete-file:<path>           delete a file          reload-after-delete   (when units deleted)
                                                        reload-after-enable   (after late enables)

``reload`` is present only when a unit file or drop-in is written or deleted, or enablement
changes, or the change set carries a command an earlier, unfinished apply owed (that apply may
have changed unit files without reloading). The unit file of a unit that stays in the OSC but
loses its content is deleted before the reload; that of a unit leaving the OSC after its stop.

Order follows DESIGN §2: files, units, drop-ins, drop-in deletions, enable/disable, reload, unit
commands, unit and file deletions; the agent's own restart, if any, is the very last step. One
exception: a unit restarted while none of its unit files changes (a file in its ``filePaths``
did) has its enablement re-asserted *after* its command (``ChangeSet.late_enables``), then
systemd is reloaded only if that changed a symlink. Enablement is about boot and the targets
that want the unit, not the job that restarts it, and the call costs systemd ~5 ms that a
one-file change would otherwise wait for before its restart.
"""

from __future__ import annotations

from node_agent.osc.plan import ChangeSet

RELOAD = "reload"
RELOAD_AFTER_DELETE = "reload-after-delete"
RELOAD_AFTER_ENABLE = "reload-after-enable"


def file_step(path: str) -> str:
    return f"file:{path}"


def unit_step(unit: str) -> str:
    return f"unit:{unit}"


def dropin_step(unit: str, name: str) -> str:
    return f"dropin:{unit}/{name}"


def delete_dropin_step(unit: str, name: str) -> str:
    return f"delete-dropin:{unit}/{name}"


def enable_step(unit: str) -> str:
    return f"enable:{unit}"


def disable_step(unit: str) -> str:
    return f"disable:{unit}"


def cmd_step(unit: str) -> str:
    return f"cmd:{unit}"


def delete_unit_step(unit: str) -> str:
    return f"delete-unit:{unit}"


def delete_file_step(path: str) -> str:
    return f"delete-file:{path}"


def step_ids(cs: ChangeSet) -> tuple[str, ...]:
    """Every step of ``cs`` in execution order; empty for an empty change set."""
    late = cs.late_enables()
    steps = [file_step(f.path) for f in cs.files_to_write]
    unit_steps = [unit_step(u.name) for u in cs.units_to_write]
    unit_steps += [dropin_step(d.unit, d.name) for d in cs.dropins_to_write]
    unit_steps += [delete_dropin_step(d.unit, d.name) for d in cs.dropins_to_delete]
    unit_steps += [enable_step(u) for u in cs.units_to_enable if u not in late]
    unit_steps += [disable_step(u) for u in cs.units_to_disable]
    # A unit that stays in the OSC but loses its content (the distribution's file takes over)
    # loses our file before the reload, so its command runs the definition it will have.
    staying = {c.unit for c in cs.unit_commands if not c.removed}
    unit_steps += [delete_unit_step(u.name) for u in cs.units_to_delete if u.name in staying]
    steps += unit_steps
    if unit_steps or cs.reload:
        steps.append(RELOAD)
    steps += [cmd_step(c.unit) for c in cs.unit_commands if not c.is_agent]
    if late:
        steps += [enable_step(u) for u in cs.units_to_enable if u in late]
        steps.append(RELOAD_AFTER_ENABLE)
    gone = [u for u in cs.units_to_delete if u.name not in staying]
    steps += [delete_unit_step(u.name) for u in gone]
    if gone:
        steps.append(RELOAD_AFTER_DELETE)
    steps += [delete_file_step(f.path) for f in cs.files_to_delete]
    steps += [cmd_step(c.unit) for c in cs.unit_commands if c.is_agent]
    return tuple(steps)
