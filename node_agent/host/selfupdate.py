"""Falling back to the previous agent binary when an updated one cannot start.

A self-update replaces the agent's single file (``/opt/bin/gardener-node-agent``) and keeps the
old one as ``<binary>.previous``. If the new file cannot even start (a broken build, a binary for
another architecture, a crash before any Python runs), the unit's ``Restart=always`` would start
it every 5 s for ever and the node would have no agent. The fallback must therefore not depend on
the new binary: a drop-in of the agent's unit (the unit itself is the OSC's, Gardener's text)
adds ``ExecStartPre=-/bin/sh <guard script> <binary>``. The script counts starts; the agent sets
the count back to 0 once it is ready and records the sha256 of the binary that got there. When
three starts in a row did not get the agent ready, before the fourth, if the binary is not one
that was ever ready and a different ``.previous`` exists, the script copies ``.previous`` back
into place and writes a record of what it did. The previous agent then starts, reads the
record, logs it, shows it in ``node-agent status`` and records a Warning Event on its Node. The
drift check leaves the agent's own binary alone, so the fallback stands until an OSC brings a
new binary; that one is installed as any update is (``.previous`` is then the binary that fell
back, which ran).

Everything here is files under the ``--root`` prefix; the caller reloads systemd when the
drop-in changed.
"""

from __future__ import annotations

import hashlib
import shlex
from dataclasses import dataclass
from pathlib import Path

from node_agent.base import layout
from node_agent.base.errors import HostError
from node_agent.host.fs import HostFS

#: Starts in a row that did not get the agent ready, after which the previous binary is put back
#: (before the next start: with RestartSec=5, about 15 s after the update's restart).
THRESHOLD = 3
GUARD_SCRIPT = f"{layout.BASE_DIR}/{layout.SELF_UPDATE_GUARD}"
STARTS_FILE = f"{layout.BASE_DIR}/{layout.SELF_UPDATE_STARTS}"
GOOD_FILE = f"{layout.BASE_DIR}/{layout.SELF_UPDATE_GOOD}"
RECORD_FILE = f"{layout.BASE_DIR}/{layout.SELF_UPDATE_FALLBACK}"

# POSIX sh and coreutils only: it must work when the new binary cannot run at all. Every step
# that fails leaves the binary as it is (the unit goes on as before); the ExecStartPre= line has
# the "-" prefix, so the script can never keep the agent from starting.
_SCRIPT = """#!/bin/sh
# node-agent's self-update guard (written by the agent; run by systemd before every start of
# its unit). When @THRESHOLD@ starts in a row did not get the agent ready, a binary that was
# never ready is replaced by <binary>.previous before the next start, and a record says so.
set -u
bin=$1
starts=@STARTS@
good=@GOOD@
record=@RECORD@
# The count as written here and by the agent is 0 or up to 9 digits not starting with 0.
# Anything else (missing, unreadable, a NUL, a number sh's arithmetic cannot take: 2^63 and
# up, "08") starts a new count at 1: the guard is never switched off by its own file.
n=$(head -c 16 "$starts" 2>/dev/null | tr '\\000' x)
case $n in '' | *[!0-9]* | 0?* | ??????????*) n=0 ;; esac
n=$((n + 1))
echo "$n" >"$starts.tmp" && mv -f "$starts.tmp" "$starts"
[ "$n" -gt @THRESHOLD@ ] || exit 0
[ -f "$bin" ] && [ -f "$bin.previous" ] || exit 0
cmp -s "$bin" "$bin.previous" && exit 0
failed=$(sha256sum <"$bin" | cut -d ' ' -f 1)
[ "$failed" = "$(cat "$good" 2>/dev/null)" ] && exit 0
restored=$(sha256sum <"$bin.previous" | cut -d ' ' -f 1)
cp -p "$bin.previous" "$bin.fallback.tmp" && mv -f "$bin.fallback.tmp" "$bin" || exit 0
at=$(date -u +%Y-%m-%dT%H:%M:%SZ)
printf 'binary=%s\\nfailed=%s\\nrestored=%s\\nstarts=%s\\nat=%s\\n' \\
    "$bin" "$failed" "$restored" "$((n - 1))" "$at" >"$record.tmp" && mv -f "$record.tmp" "$record"
echo 0 >"$starts"
echo "node-agent: $bin was not ready after $((n - 1)) starts; the previous binary is back in place"
"""


def guard_script(base_dir: str = layout.BASE_DIR) -> bytes:
    """The guard script, with the state files in ``base_dir`` (a host path)."""
    names = {
        "@THRESHOLD@": str(THRESHOLD),
        "@STARTS@": shlex.quote(f"{base_dir}/{layout.SELF_UPDATE_STARTS}"),
        "@GOOD@": shlex.quote(f"{base_dir}/{layout.SELF_UPDATE_GOOD}"),
        "@RECORD@": shlex.quote(f"{base_dir}/{layout.SELF_UPDATE_FALLBACK}"),
    }
    text = _SCRIPT
    for name, value in names.items():
        text = text.replace(name, value)
    return text.encode()


def drop_in(binary: str) -> bytes:
    """The agent unit's drop-in that runs the guard before every start of ``binary``."""
    command = shlex.join(["/bin/sh", GUARD_SCRIPT, binary])
    return (
        "# Written by node-agent: puts the previous agent binary back when an updated one is\n"
        f"# not ready after {THRESHOLD} starts in a row (see docs/operations.md, Self-update).\n"
        f"[Service]\nExecStartPre=-{command}\n"
    ).encode()


def drop_in_path(unit: str) -> str:
    return layout.drop_in_path(unit, layout.SELF_UPDATE_DROP_IN)


def install(fs: HostFS, unit: str, binary: str) -> bool:
    """Write the guard script and ``unit``'s drop-in for ``binary`` where they differ; True
    when the drop-in was written (systemd must reload)."""
    fs.write_atomic(GUARD_SCRIPT, guard_script(), 0o755, dir_mode=0o755)
    return bool(fs.write_atomic(drop_in_path(unit), drop_in(binary), 0o644, dir_mode=0o755))


@dataclass(frozen=True)
class Fallback:
    """What the guard did: ``binary`` was not ready ``starts`` times in a row, so the file with
    sha256 ``failed`` was replaced by the previous one (``restored``) at ``at``."""

    binary: str
    failed: str
    restored: str
    starts: int
    at: str
    #: when the running agent reported it on its Node (empty: not yet)
    reported: str = ""

    def message(self) -> str:
        return (
            f"the updated agent binary {self.binary} (sha256 {self.failed[:12]}) was not ready "
            f"after {self.starts} starts in a row; the previous binary (sha256 "
            f"{self.restored[:12]}) was put back at {self.at} and runs now. The OSC's agent "
            "image is kept from being installed again until the OSC changes it"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "binary": self.binary,
            "failed_sha256": self.failed,
            "restored_sha256": self.restored,
            "starts": self.starts,
            "at": self.at,
            "reported": self.reported or None,
            "message": self.message(),
        }


def read_fallback(fs: HostFS) -> Fallback | None:
    """The guard's record, or None (none, or unreadable: it is only a report)."""
    try:
        raw = fs.read(RECORD_FILE)
    except HostError:
        return None
    if raw is None:
        return None
    fields = dict(
        line.partition("=")[::2] for line in raw.decode(errors="replace").splitlines() if line
    )
    try:
        return Fallback(
            binary=fields["binary"],
            failed=fields["failed"],
            restored=fields["restored"],
            starts=int(fields["starts"]),
            at=fields["at"],
            reported=fields.get("reported", ""),
        )
    except (KeyError, ValueError):
        return None


def mark_reported(fs: HostFS, record: Fallback, at: str) -> None:
    """Note in the record that the Node was told (the Event is sent once)."""
    lines = [
        f"binary={record.binary}",
        f"failed={record.failed}",
        f"restored={record.restored}",
        f"starts={record.starts}",
        f"at={record.at}",
        f"reported={at}",
    ]
    fs.write_atomic(RECORD_FILE, ("\n".join(lines) + "\n").encode(), 0o644)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def reached_ready(fs: HostFS, binary: str) -> Fallback | None:
    """The agent running from ``binary`` is ready: the start count goes back to 0 and the
    binary's sha256 is recorded as one that was ready (the guard never replaces it). Returns
    the guard's record while it still describes the running binary; a record of an earlier
    fallback is removed once another binary got ready (a later update worked)."""
    digest = sha256_file(fs.resolve(binary))
    fs.write_atomic(GOOD_FILE, f"{digest}\n".encode(), 0o644)
    fs.write_atomic(STARTS_FILE, b"0\n", 0o644)
    record = read_fallback(fs)
    if record is not None and record.restored != digest:
        fs.remove(RECORD_FILE)
        return None
    return record
