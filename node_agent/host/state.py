"""The agent's persisted state under ``/var/lib/gardener-node-agent`` (below the ``--root``).

Why: an apply must survive a crash or reboot at any instant and converge afterwards, and removal
must only ever touch what the agent itself created. Four small documents, each written
atomically through HostFS, each a versioned pydantic model:

- ``last-applied-osc.yaml`` — the raw ``osc.yaml`` bytes last applied, byte for byte (the upstream
  name and format, so an upstream agent can read it and we can read upstream's), plus
  ``last-applied-osc.meta.json`` with their sha256, the time, and the resolved secretRef
  contents the planner needs as ``previous_resolved``. Both are mode 0600 (Secret data). The meta
  belongs to the OSC only if its checksum matches the yaml bytes, so a crash between the two
  writes degrades to "previous secret contents unknown", never to wrong contents.
- ``last-computed-osc-changes.yaml`` — the ChangeSet being executed (written once by ``begin``;
  JSON, which is valid YAML; mode 0600, it carries file contents) and
  ``last-computed-osc-changes.done.json`` — the ids of the steps completed so far (see
  ``steps.py``), rewritten atomically by ``mark_done``. Both carry a journal id, so a stale
  progress file can never be matched with a newer change set.
- ``inventory.json`` — every path the agent wrote (files, unit files, drop-ins) with its sha256
  and whether the agent *created* it or found it already there. Entries describe what exists:
  a path is claimed once its write succeeded (``record_written``), so a write that failed (a
  read-only mount) leaves no claim that a later apply would have to remove. A journal's claims
  are kept in its progress file and folded into the inventory when it ends, so an update does
  not rewrite every entry before its restart; ``Inventory.folded`` names the last journal
  folded in, so a progress file a crash left behind is not folded in twice. ``begin`` notes in
  the journal which paths existed before; a crash between a write and its claim is settled
  from the journal and the disk before the next apply. What a journal will create (paths absent
  when it begins) is written into the inventory's ``intended`` first, with the bytes it will
  write: should the journal and its progress file both be lost, a file found there with exactly
  those bytes is still taken as the agent's (one write more, only for change sets that create
  paths). ``owns()`` is true only for created paths: a
  distro unit that merely gets drop-ins, or a pre-existing file the OSC overwrote, is never
  deleted. Claims read back from a progress file are taken only as far as the agent can show
  they are its own writes (``vet_claims``, the rule the offline status counts them by too), and
  a removal by an inventory entry (``remove_created``) never touches the agent's own directory
  and removes only the bytes the entry recorded: nothing in these files can make the agent
  delete what it did not write. ``OwnedEntry.by`` says who had a path written: what
  ``bootstrap`` wrote is never an orphan of an apply, only ``reset`` takes it back.
- ``status.json`` — the last apply's outcome, for ``node-agent status`` (mode 0644, no secrets).

There is one way to persist: every operation is written once, synchronously, and every byte goes
through HostFS, which walks each path from a directory fd without following a symlink anywhere
in it (a ``/var/lib`` planted as a symlink is refused, not followed) and writes atomically and
durably (temp file with its exact mode, fsync, rename, directory fsync). The async methods
(``*_async``) are what code on the event loop calls: each runs that same sync operation in a
worker thread, one hop per operation (state changes under the store's asyncio lock), so neither
a state write nor the read and parse of a large document stalls the loop. The hop is aiofiles'
own (``aiofiles.os.wrap``, what each ``aiofiles.os`` call is built on) with the caller's context
variables carried over, as ``asyncio.to_thread`` would: aiofiles' path-based calls cannot walk
directory fds, and a read or write made of several aiofiles calls would cost a hop each. The
sync methods are for the CLI and tests. The applied checksum is kept in memory once known
(``applied_checksum``), so ``/metrics``, ``/readyz`` and ``status`` never re-read and hash the
last applied OSC.

A document that cannot be read (corrupt, or written by a newer agent) is moved aside to
``<name>.corrupt`` and treated as absent: that always errs towards re-applying (writes are
idempotent) and towards deleting nothing. The same goes for something that is not a regular file
(a directory, a symlink, a FIFO, a device) or is larger than ``STATE_READ_LIMIT``: it is opened
without following symlinks and without blocking, never read, and renamed aside (through HostFS
too); a write finding a directory, FIFO, socket or device in its place does the same first.
Each file set aside is noted once (``take_set_aside``) so that the agent can say it on the Node.
"""

from __future__ import annotations

import asyncio
import contextvars
import errno
import functools
import stat
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, ParamSpec, TypeVar, cast

import aiofiles.os
import structlog
from pydantic import (
    BaseModel,
    ValidationError,
)

from node_agent.base import layout
from node_agent.base.digest import sha256_hex
from node_agent.base.errors import HostError, HostIOError, UnsafePathError
from node_agent.base.layout import drop_in_path, unit_path
from node_agent.host.documents import (
    ApplyRecord,
    Claim,
    Inventory,
    JournalDoc,
    JournalProgress,
    LastApplied,
    LastAppliedMeta,
    OwnedEntry,
    Pending,
)
from node_agent.host.fs import HostFS, Removed
from node_agent.osc.applied import Applied, AppliedChanges
from node_agent.osc.plan import ChangeSet
from node_agent.osc.steps import dropin_step, file_step, step_ids, unit_step

if TYPE_CHECKING:
    from node_agent.host.history import HistoryEntry, HistoryLog

STATE_DIR = layout.BASE_DIR
UNIT_DIR = layout.UNIT_DIR
LAST_APPLIED_OSC = layout.LAST_APPLIED_OSC
LAST_APPLIED_META = layout.LAST_APPLIED_META
CHANGES = layout.CHANGES
CHANGES_DONE = layout.CHANGES_DONE
INVENTORY = layout.INVENTORY
STATUS = layout.STATUS
CORRUPT_SUFFIX = layout.CORRUPT_SUFFIX

#: The largest state file read (bytes); anything larger is set aside unread. Far above any real
#: one (a journal of a 1 MiB OSC is a few MiB), low enough that a runaway file cannot exhaust
#: the agent's memory.
STATE_READ_LIMIT = 64 << 20
_SHOWN = 20  # paths named in one Warning about claims not trusted
_SHOWN_CHARS = 200  # characters of each

SECRET_MODE = 0o600
PUBLIC_MODE = 0o644
UNIT_FILE_MODE = 0o600  # as upstream: a unit's Environment= often holds credentials

_log = structlog.get_logger(__name__)


def _now() -> datetime:
    return datetime.now(UTC)


def write_claims(cs: ChangeSet) -> dict[str, Claim]:
    """The inventory claim of every write of ``cs``, by its step id (``steps.py``)."""
    claims = {file_step(f.path): Claim("file", f.path, f.sha256, f.mode) for f in cs.files_to_write}
    for u in cs.units_to_write:
        digest = sha256_hex(u.content.encode())
        claims[unit_step(u.name)] = Claim("unit", unit_path(u.name), digest, UNIT_FILE_MODE)
    for d in cs.dropins_to_write:
        digest = sha256_hex(d.content.encode())
        path = drop_in_path(d.unit, d.name)
        claims[dropin_step(d.unit, d.name)] = Claim("dropin", path, digest, UNIT_FILE_MODE)
    return claims


def claims_for(cs: ChangeSet) -> list[Claim]:
    """The inventory claims for every write of ``cs``."""
    return list(write_claims(cs).values())


def written_paths(cs: ChangeSet) -> set[str]:
    """The host path of every write of ``cs`` (``write_claims`` without hashing anything)."""
    paths = {f.path for f in cs.files_to_write}
    paths |= {unit_path(u.name) for u in cs.units_to_write}
    paths |= {drop_in_path(d.unit, d.name) for d in cs.dropins_to_write}
    return paths


def applied_paths(applied: Applied) -> set[str]:
    """Every host path ``applied`` puts on the host: files, unit files, drop-ins."""
    paths = set(applied.files)
    for unit in applied.units.values():
        if unit.content is not None:
            paths.add(unit_path(unit.name))
        paths |= {drop_in_path(unit.name, name) for name in unit.drop_ins}
    return paths


def own_path(path: str) -> bool:
    """Whether ``path`` is in the agent's own directory: its state, credentials, config, the
    cluster's CA, the machine's name. Nothing there is removed because an inventory entry names
    it, whatever the entry says (``reset`` removes the state files and credentials by name)."""
    return path == STATE_DIR or path.startswith(STATE_DIR + "/")


@dataclass(frozen=True)
class Removal:
    """What removing a path the inventory says the agent created did."""

    removed: bool = False  # it was there and is gone now
    kept: str | None = None  # what is there stays: why it is not provably what the agent wrote


def refusal(
    path: str, entry: OwnedEntry, keep: Collection[str] = (), *, by_osc: bool = False
) -> str | None:
    """Why an inventory entry can never make the agent remove ``path``, without looking at the
    disk: the agent's own directory, ``keep`` (its program, its unit), no recorded digest.

    ``by_osc``: the applied OSC itself removes ``path`` (the executor), not an entry alone. The
    agent's own directory is no bar then: no OSC file can be a state file or a credential
    (``layout.RESERVED_FILES``), and an old ``config-<version>.yaml`` must go as upstream
    removes it, or a Gardener downgrade would keep running the higher version's config."""
    if own_path(path) and not by_osc:
        return "it is in the agent's own directory (state, credentials, config)"
    if path in keep:
        return "it is the agent's own program or unit"
    if entry.sha256 is None:
        return "no digest recorded for it: what the agent wrote there is unknown"
    return None


def not_written(fs: HostFS, path: str, entry: OwnedEntry, keep: Collection[str] = ()) -> str | None:
    """Why what is at ``path`` is not provably what the agent wrote (see :func:`refusal`; a
    file with other bytes, or not a regular file); None if it is, or if nothing is there. For
    deciding before the removal, e.g. whether to stop a unit whose file is to go."""
    why = refusal(path, entry, keep)
    if why is not None or fs.lstat(path) is None:
        return why
    assert entry.sha256 is not None  # refusal() said so
    return None if fs.stat_matches(path, sha256=entry.sha256) else Removed.OTHER_CONTENT.value


def remove_created(
    fs: HostFS, path: str, entry: OwnedEntry, keep: Collection[str] = (), *, by_osc: bool = False
) -> Removal:
    """Remove ``path``, which the inventory says the agent created, only if what is there is
    provably what the agent wrote: outside its own directory (unless ``by_osc``, see
    :func:`refusal`) and ``keep``, and a regular file whose bytes have the recorded digest
    (read from the file that is then unlinked). Anything else stays (``Removal.kept`` says
    why). HostError when it cannot be removed: a directory there, a parent that is a symlink
    (never followed), a read-only file system."""
    why = refusal(path, entry, keep, by_osc=by_osc)
    if why is not None:
        return Removal(kept=why)
    assert entry.sha256 is not None  # refusal() said so
    done = fs.remove_written(path, entry.sha256)
    if done is Removed.REMOVED:
        return Removal(removed=True)
    if done is Removed.ABSENT:
        return Removal()
    return Removal(kept=done.value)


@dataclass(frozen=True)
class Vetting:
    """A progress file's claims as the agent takes them (:func:`vet_claims`)."""

    claims: Mapping[str, OwnedEntry]  # taken, "created" turned to "found" where it must be
    dropped: tuple[str, ...] = ()  # named by no change set or applied record: not the agent's
    found: tuple[str, ...] = ()  # said "created" of a path the agent found there


def vet_claims(
    claims: Mapping[str, OwnedEntry],
    entries: Mapping[str, OwnedEntry],
    *,
    named: Collection[str] | None,
    preexisting: Collection[str] = (),
) -> Vetting:
    """The rule for the claims of a progress file, for the store and the offline status alike.

    A claim for a path not in ``named`` (:func:`named_paths`; None: every path, when the
    journal is there but unreadable and the claims are the only record of its writes) is
    dropped. A claim that says "created" of a path in ``preexisting`` (the journal saw it
    before its first write) or that ``entries`` (the inventory) hold as found says "found": a
    claim never turns a file the agent found into one it may delete."""
    vetted: dict[str, OwnedEntry] = {}
    dropped: list[str] = []
    found: list[str] = []
    for path, entry in claims.items():
        if named is not None and path not in named:
            dropped.append(path)
            continue
        old = entries.get(path)
        if entry.created and (path in preexisting or (old is not None and not old.created)):
            entry = entry.model_copy(update={"created": False})
            found.append(path)
        vetted[path] = entry
    if not dropped and not found:
        return Vetting(claims)
    return Vetting(vetted, tuple(dropped), tuple(found))


def named_paths(change_set: ChangeSet | None, records: Iterable[Applied | None]) -> frozenset[str]:
    """Every host path a journal's change set writes and the applied ``records`` (its base and
    target, the last applied OSC's record) name: the paths a progress file may claim."""
    paths = written_paths(change_set) if change_set is not None else set()
    for applied in records:
        if applied is not None:
            paths |= applied_paths(applied)
    return frozenset(paths)


def last_applied_of(raw: bytes | None, meta: LastAppliedMeta | None) -> LastApplied | None:
    """The last applied OSC from its bytes and its meta document (which counts only when it
    is of those bytes)."""
    if raw is None:
        return None
    checksum = sha256_hex(raw)
    if meta is None or meta.checksum != checksum:
        return LastApplied(raw=raw, checksum=checksum, applied_at=None, resolved=None)
    return LastApplied(
        raw=raw,
        checksum=checksum,
        applied_at=meta.applied_at,
        resolved=dict(meta.resolved),
        applied=meta.applied,
    )


def journal_applied(
    doc: JournalDoc, last: LastApplied | None
) -> tuple[Applied | None, Applied | None]:
    """The journal's base and target, written whole or by reference to the last applied OSC's
    record (``base_checksum``, ``target_changes``).

    The record changes only when an apply completes, just before its journal is dropped: a
    journal that finds the record of its own checksum completed before a crash kept it from
    being dropped, and its target is that record (its base is then the same, since nothing is
    left to do). A record that is gone or unreadable leaves both unknown, as in a journal of an
    older agent: the plan then starts from the last applied OSC and owes the commands not
    done."""
    if doc.base_checksum is None:
        return doc.base, doc.target
    if last is None or last.applied is None:
        return None, None
    if last.checksum == doc.base_checksum:
        base = last.applied
        changes = doc.target_changes
        return base, changes.apply_to(base) if changes is not None else doc.target
    if last.checksum == doc.osc_checksum:
        return None, last.applied
    return None, None


_D = TypeVar("_D", bound=BaseModel)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _call(thunk: Callable[[], object]) -> object:
    return thunk()


_in_worker = aiofiles.os.wrap(_call)  # loop.run_in_executor: the default thread pool


async def _off_loop(fn: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
    """``fn(*args, **kwargs)`` in a worker thread, the one hop of an async method, with the
    caller's context variables (structlog's bound fields) as ``asyncio.to_thread`` has them."""
    thunk = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return cast(_R, await _in_worker(thunk))


class StateStore:
    """Load and save the agent's state through ``fs``. Not thread-safe: one apply at a time."""

    def __init__(self, fs: HostFS, state_dir: str = STATE_DIR) -> None:
        self.fs = fs
        self.state_dir = state_dir.rstrip("/")
        self._pending: Pending | None = None
        self._inventory: Inventory | None = None
        #: the entries the current journal wrote, kept in its progress file and in
        #: ``_inventory``, not yet in ``inventory.json`` (see ``record_written``)
        self._claims: dict[str, OwnedEntry] = {}
        self._claims_of: str | None = None  # the id of the journal they belong to
        #: sha256 of last-applied-osc.yaml as last read or written ('' none); None: not read yet
        self._applied: str | None = None
        #: the last applied OSC as last read or written (None: none); kept in memory so that
        #: an update does not read, hash and parse the whole previous OSC again (the agent is
        #: its only writer); ``_last_known`` False: not read yet
        self._last: LastApplied | None = None
        self._last_known = False
        self._no_journal = False  # True: read once and found none, and none begun since
        self._lock = asyncio.Lock()  # one state change at a time from the loop
        self._history: HistoryLog | None = None  # the apply history once read (history.py)
        self._set_aside: list[str] = []  # state files set aside and not yet reported
        #: the journal (its change set or progress) was set aside since the last look: what it
        #: had changed is no longer known (see ``take_journal_lost``)
        self._journal_lost = False
        #: the journal file was there and could not be read (set aside) since the last begin
        self._journal_unreadable = False

    def take_set_aside(self) -> list[str]:
        """One line per state file set aside since the last call (for a Warning Event)."""
        notes, self._set_aside = self._set_aside, []
        return notes

    def take_journal_lost(self) -> bool:
        """Whether the journal was set aside since the last call: what its unfinished change set
        had already done is unknown, so the caller should compare the host with what is
        applied (a drift check) instead of trusting the last applied OSC."""
        lost, self._journal_lost = self._journal_lost, False
        return lost

    def path(self, name: str) -> str:
        """Host path of state file ``name``."""
        return f"{self.state_dir}/{name}"

    # --- last applied OSC ------------------------------------------------------------------------

    def load_last_applied(self) -> LastApplied | None:
        """The last applied OSC: read from disk once, then from memory."""
        if self._last_known:
            return self._last
        raw = self._read(LAST_APPLIED_OSC)
        last = self._last_applied(raw, self._load(LAST_APPLIED_META, LastAppliedMeta))
        self._last, self._last_known = last, True
        return last

    async def load_last_applied_async(self) -> LastApplied | None:
        if self._last_known:
            return self._last
        return await _off_loop(self.load_last_applied)  # reading and hashing up to 1 MiB

    def _last_applied(self, raw: bytes | None, meta: LastAppliedMeta | None) -> LastApplied | None:
        last = last_applied_of(raw, meta)
        self._applied = last.checksum if last is not None else ""
        return last

    def save_last_applied(
        self,
        raw: bytes,
        resolved: Mapping[str, bytes] | None = None,
        *,
        applied_at: datetime | None = None,
        applied: Applied | None = None,
    ) -> LastApplied:
        """Persist the applied ``osc.yaml`` bytes and the secretRef contents resolved for them.
        Call before ``finish()``: a crash in between then resumes an all-done journal."""
        when = applied_at or _now()
        meta = LastAppliedMeta(
            checksum=sha256_hex(raw),
            applied_at=when,
            resolved=dict(resolved or {}),
            applied=applied,
        )
        self._last_known = False  # unknown if a write below fails half-way
        self._save(LAST_APPLIED_META, meta, SECRET_MODE)
        self._applied = None
        self._save_bytes(LAST_APPLIED_OSC, raw, SECRET_MODE)
        self._applied = meta.checksum
        self._last = LastApplied(
            raw=raw,
            checksum=meta.checksum,
            applied_at=when,
            resolved=dict(meta.resolved),
            applied=applied,
        )
        self._last_known = True
        return self._last

    async def save_last_applied_async(
        self,
        raw: bytes,
        resolved: Mapping[str, bytes] | None = None,
        *,
        applied_at: datetime | None = None,
        applied: Applied | None = None,
    ) -> LastApplied:
        async with self._lock:
            return await _off_loop(
                self.save_last_applied, raw, resolved, applied_at=applied_at, applied=applied
            )

    def clear_last_applied(self) -> None:
        self._applied = None
        self._last_known = False
        self.fs.remove(self.path(LAST_APPLIED_OSC))
        self.fs.remove(self.path(LAST_APPLIED_META))
        self._applied = ""
        self._last, self._last_known = None, True

    def applied_checksum(self) -> str:
        """sha256 of the last applied osc.yaml ('' if none), from memory once known: read and
        hashed only the first time (the loop calls ``applied_checksum_async`` before)."""
        if self._applied is None:
            self.load_last_applied()
        return self._applied or ""

    async def applied_checksum_async(self) -> str:
        if self._applied is None:
            await self.load_last_applied_async()
        return self._applied or ""

    # --- journal ---------------------------------------------------------------------------------

    def begin(
        self,
        change_set: ChangeSet,
        osc_checksum: str,
        *,
        base: Applied | None = None,
        target: Applied | None = None,
    ) -> Pending:
        """Persist ``change_set`` (with the ``Applied`` it starts from and aims at) before
        executing it. Replaces any pending journal: settle that one first. Inventory claims are
        made as writes succeed (``record_written``), so they describe what exists."""
        inventory = self._fold_claims()  # the replaced journal's, before its progress goes
        inventory = self._adopt_intended(inventory, live=None)  # and what it meant to create
        journal_id = uuid.uuid4().hex
        claims = [c for c in claims_for(change_set) if c.path not in inventory.entries]
        found = {c.path for c in claims if self.fs.exists(c.path)}
        preexisting = tuple(sorted(found))
        # What this journal will create, in the inventory before the journal: should the
        # journal and its progress file both be lost, a file there with exactly these bytes
        # is still known to be the agent's (imageRef files, bytes unknown up front, are not).
        intended = {
            c.path: OwnedEntry(kind=c.kind, created=True, sha256=c.sha256, mode=c.mode, by=c.by)
            for c in claims
            if c.path not in found and c.sha256 is not None
        }
        if intended or inventory.intended or not self.has_inventory():
            inventory = inventory.with_intended(intended, journal_id if intended else None)
            self._save(INVENTORY, inventory, SECRET_MODE)
            self._inventory = inventory
        self._remove(CHANGES_DONE)
        self._no_journal = self._journal_unreadable = False
        # The base is usually the last applied OSC's record, the very object: the journal
        # names it by checksum and keeps the target as its changes (see ``_journal_applied``).
        last = self._last if self._last_known else None
        ref = last if last is not None and base is not None and base is last.applied else None
        changes = (
            AppliedChanges.between(base, target)
            if ref is not None and base is not None and target is not None
            else None
        )
        doc = JournalDoc(
            id=journal_id,
            osc_checksum=osc_checksum,
            started_at=_now(),
            change_set=change_set,
            base=None if ref is not None else base,
            target=None if changes is not None else target,
            base_checksum=ref.checksum if ref is not None else None,
            target_changes=changes,
            preexisting=preexisting,
        )
        self._save(CHANGES, doc, SECRET_MODE)
        self._pending = Pending(
            id=doc.id,
            change_set=change_set,
            osc_checksum=osc_checksum,
            started_at=doc.started_at,
            done=frozenset(),
            base=base,
            target=target,
            preexisting=frozenset(preexisting),
        )
        return self._pending

    async def begin_async(
        self,
        change_set: ChangeSet,
        osc_checksum: str,
        *,
        base: Applied | None = None,
        target: Applied | None = None,
    ) -> Pending:
        async with self._lock:
            return await _off_loop(self.begin, change_set, osc_checksum, base=base, target=target)

    async def pending_async(self) -> Pending | None:
        """``pending()``; the journal (it carries file contents) is read off the loop."""
        if self._pending is not None or self._no_journal:
            return self._pending
        async with self._lock:
            if self._pending is None and not self._no_journal:
                await _off_loop(self.pending)
            return self._pending

    def pending(self) -> Pending | None:
        """The journal left by an unfinished apply, with the steps already done; None if none."""
        if self._pending is not None:
            return self._pending
        if self._no_journal:
            return None
        doc = self._load(CHANGES, JournalDoc)
        if doc is None:
            self._no_journal = True
            return None
        progress = self._load(CHANGES_DONE, JournalProgress)
        known = set(step_ids(doc.change_set))
        mine = progress is not None and progress.id == doc.id
        done = frozenset(s for s in progress.done if s in known) if progress and mine else None
        failed = (
            {k: v for k, v in progress.failed.items() if k in known} if progress and mine else {}
        )
        base, target = self._journal_applied(doc)
        self._pending = Pending(
            id=doc.id,
            change_set=doc.change_set,
            osc_checksum=doc.osc_checksum,
            started_at=doc.started_at,
            done=done or frozenset(),
            base=base,
            target=target,
            preexisting=frozenset(doc.preexisting),
            failed=failed,
        )
        return self._pending

    def _journal_applied(self, doc: JournalDoc) -> tuple[Applied | None, Applied | None]:
        """The journal's base and target (:func:`journal_applied`); the last applied OSC is
        read only when the journal refers to it."""
        if doc.base_checksum is None:
            return doc.base, doc.target
        return journal_applied(doc, self.load_last_applied())

    def mark_done(self, *steps: str, failed: Mapping[str, str] | None = None) -> Pending:
        """Record ``steps`` (ids from ``steps.py``) as completed and, when given, the steps that
        failed in this attempt (replacing the previous attempt's); durable when this returns."""
        pending = self.pending()
        if pending is None:
            raise RuntimeError("mark_done() without a journal: call begin() first")
        known = set(pending.steps)
        unknown = [s for s in (*steps, *(failed or {})) if s not in known]
        if unknown:
            raise ValueError(f"steps not in the pending change set: {', '.join(unknown)}")
        done = pending.done | set(steps)
        new_failed = dict(pending.failed if failed is None else failed)
        for step in steps:
            new_failed.pop(step, None)
        if done == pending.done and new_failed == dict(pending.failed):
            return pending
        self._pending = replace(pending, done=frozenset(done), failed=new_failed)
        self._save_progress(self._pending)
        return self._pending

    def _save_progress(self, pending: Pending) -> None:
        """The journal's progress file: the steps done and failed, and the inventory entries of
        its writes (``record_written``); durable when this returns."""
        self._claims_of_journal(pending.id)
        ordered = tuple(s for s in pending.steps if s in pending.done)
        progress = JournalProgress(
            id=pending.id, done=ordered, failed=dict(pending.failed), claims=self._claims
        )
        self._save(CHANGES_DONE, progress, SECRET_MODE)

    async def mark_done_async(
        self, *steps: str, failed: Mapping[str, str] | None = None
    ) -> Pending:
        async with self._lock:
            return await _off_loop(self.mark_done, *steps, failed=failed)

    async def record_written_async(self, claims: Iterable[Claim]) -> Inventory:
        claims = list(claims)
        async with self._lock:
            return await _off_loop(self.record_written, claims)

    async def finish_async(self) -> None:
        async with self._lock:
            await _off_loop(self.finish)

    def record_written(self, claims: Iterable[Claim]) -> Inventory:
        """Claim paths that were just written (call before marking their steps done); durable
        when this returns. A path new to the inventory counts as created by the agent unless
        the journal saw it before.

        During a journal the entries go into its progress file, a few hundred bytes, and into
        ``inventory.json`` when the journal ends (``finish``, or ``begin`` of the next one):
        rewriting the whole inventory (150 KB at 1,200 files) before each unit restart cost
        the update ~4 ms. Until then the inventory is read with them (``inventory``)."""
        pending = self.pending()
        if pending is not None:
            self._claims_of_journal(pending.id)  # before the inventory is read: it may fold
        before = pending.preexisting if pending is not None else frozenset()
        inv = self.inventory()
        entries = inv.entries
        updates: dict[str, OwnedEntry] = {}
        for c in claims:
            old = entries.get(c.path)
            created = old.created if old is not None else c.path not in before
            by = old.by if old is not None else c.by
            entry = OwnedEntry(kind=c.kind, created=created, sha256=c.sha256, mode=c.mode, by=by)
            if entry != old:
                updates[c.path] = entry
        if not updates and self.has_inventory():
            return inv
        new = inv.updated(updates)
        if pending is not None and self.has_inventory():
            self._claims.update(updates)
            self._save_progress(pending)
            self._inventory = new
            return new
        return self._save_inventory(new.entries)

    def _claims_of_journal(self, journal: str) -> None:
        """Make the claims in memory those of ``journal``: claims of another one (read from a
        progress file that did not belong to the journal read) are folded in first."""
        if self._claims_of != journal:
            self._fold_claims()
            self._claims_of = journal

    def _fold_claims(self) -> Inventory:
        """Write the current journal's claims into ``inventory.json`` (before its progress file
        is dropped or replaced); the inventory."""
        inv = self.inventory()
        if self._claims:
            inv = inv.with_entries(inv.entries, folded=self._claims_of)
            self._save(INVENTORY, inv, SECRET_MODE)
            self._inventory = inv
            self._claims = {}
        return inv

    def finish(self) -> None:
        """Drop the journal once the apply is complete (after ``save_last_applied``)."""
        inv = self.inventory()
        if inv.intended:  # its writes are claimed now, each as it succeeded: one write for both
            folded = self._claims_of if self._claims else inv.folded
            inv = inv.with_entries(inv.entries, folded=folded).with_intended({}, None)
            self._save(INVENTORY, inv, SECRET_MODE)
            self._inventory, self._claims = inv, {}
        else:
            self._fold_claims()
        self._remove(CHANGES)  # first: a lone progress file never matches a new id
        self._remove(CHANGES_DONE)
        self._pending = None
        self._no_journal = True

    # --- inventory -------------------------------------------------------------------------------

    def inventory(self) -> Inventory:
        """Every path the agent wrote, with the claims of an unfinished journal."""
        if self._inventory is None:
            self._inventory = self._read_inventory()
        return self._inventory

    async def inventory_async(self) -> Inventory:
        if self._inventory is None:
            async with self._lock:
                if self._inventory is None:  # an apply may have read or saved it meanwhile
                    self._inventory = await _off_loop(self._read_inventory)
        return self._inventory

    def _read_inventory(self) -> Inventory:
        """``inventory.json`` with the claims of the journal whose progress file is there, unless
        they were folded in already (``Inventory.folded``), as far as the agent can show they
        are its own (``_vetted``)."""
        inv = self._load(INVENTORY, Inventory) or Inventory()
        if inv.intended:
            pending = self.pending()
            inv = self._adopt_intended(inv, live=pending.id if pending is not None else None)
        progress = self._load(CHANGES_DONE, JournalProgress)
        claims = inv.unfolded(progress)
        if progress is None or not claims:
            return inv
        claims = self._vetted(claims, inv)
        if self._journal_unreadable and claims:
            # Their journal was set aside: fold them in now, so that they do not hang on a
            # journal that is no longer there (a lone progress file is not trusted).
            inv = inv.with_entries(inv.updated(claims).entries, folded=progress.id)
            self._save(INVENTORY, inv, SECRET_MODE)
            return inv
        if claims:
            self._claims, self._claims_of = dict(claims), progress.id
        return inv.updated(claims)

    def _adopt_intended(self, inv: Inventory, *, live: str | None) -> Inventory:
        """``inv`` with what a journal other than ``live`` (the one still there, if any) meant
        to create taken as created where the file holds exactly the intended bytes, and the
        rest forgotten; saved if that changed anything. A journal still there settles its own
        writes (its progress file, and the journal and the disk before the next apply)."""
        if not inv.intended or inv.intended_by == live:
            return inv
        adopted = {
            path: entry
            for path, entry in inv.intended.items()
            if path not in inv.entries
            and entry.sha256 is not None
            and self.fs.stat_matches(path, sha256=entry.sha256)
        }
        if adopted:
            _log.info(
                "files of an unfinished change set claimed",
                journal=inv.intended_by,
                count=len(adopted),
                paths=sorted(adopted)[:_SHOWN],
                reason="absent when it began, and holding the bytes it wrote",
            )
        inv = inv.with_entries(dict(sorted({**inv.entries, **adopted}.items())))
        inv = inv.with_intended({}, None)
        self._save(INVENTORY, inv, SECRET_MODE)
        self._inventory = inv
        return inv

    def _vetted(self, claims: Mapping[str, OwnedEntry], inv: Inventory) -> Mapping[str, OwnedEntry]:
        """The claims of a progress file, as far as the agent can show they are its own writes.

        A journal claims only paths its change set writes, and its progress file is written
        only while its journal is there. So with the journal readable, a claim for a path that
        neither it nor the last applied record names (``_named_paths``) is not the agent's; with
        no journal at all (a lone progress file is never one the agent left with claims not
        folded in), only the last applied record can name them. Such claims are dropped, with a
        Warning naming them. With the journal there but unreadable (set aside), the claims are
        the only record of what it wrote and are taken. A claim that says "created" for a path
        the journal saw before its first write, or that the inventory holds as found, says
        "found": a claim never turns a file the agent found into one it may delete (the rule:
        :func:`vet_claims`; here each claim not taken as it is is also said). Each removal
        still checks the bytes (``remove_created``). Runs only with the inventory read from
        disk (a start, ``reset``), never on an apply's way."""
        pending = self.pending()
        named = None if self._journal_unreadable else self._named_paths()
        before = pending.preexisting if pending is not None else frozenset()
        vetting = vet_claims(claims, inv.entries, named=named, preexisting=before)
        for paths, why in (
            (vetting.dropped, "no change set or applied OSC of the agent names them; dropped"),
            (
                vetting.found,
                "they existed before the agent wrote them; kept as found, never deleted",
            ),
        ):
            if paths:
                self._distrust(list(paths), why)
        return vetting.claims

    def _distrust(self, paths: list[str], why: str) -> None:
        """Say once (log, and a note for a Warning on the Node) which claims were not taken as
        they are; the list in the note is bounded, the count is not."""
        cut = _SHOWN_CHARS
        first = [p[:cut] + ("..." if len(p) > cut else "") for p in sorted(paths)[:_SHOWN]]
        shown = ", ".join(first) + (" ..." if len(paths) > _SHOWN else "")
        _log.warning(
            "claims of the progress file not trusted",
            file=self.path(CHANGES_DONE),
            count=len(paths),
            paths=first,
            reason=why,
        )
        self._set_aside.append(
            f"{len(paths)} claim(s) in {self.path(CHANGES_DONE)} not trusted ({why}): {shown}"
        )

    def _named_paths(self) -> frozenset[str]:
        """Every host path a persisted change set or applied record names: the journal's writes,
        its base and target, and the last applied OSC's record (derived items included)."""
        pending = self.pending()
        last = self.load_last_applied()
        records = [last.applied if last is not None else None]
        if pending is None:
            return named_paths(None, records)
        return named_paths(pending.change_set, [pending.base, pending.target, *records])

    def has_inventory(self) -> bool:
        """False on a node never touched by this agent version (e.g. taken over from upstream)."""
        return self.fs.exists(self.path(INVENTORY))

    def owns(self, path: str) -> bool:
        """True if the agent created ``path`` (a host path), so removing it is allowed."""
        return self.inventory().owns(path)

    def claim(self, claims: Iterable[Claim], *, created: bool | None = None) -> Inventory:
        """Record paths about to be written. A path seen for the first time counts as created
        by the agent if nothing exists there now (``created`` overrides that, e.g. to adopt
        files an upstream agent wrote); a known path keeps its flag and gets the new digest. A
        path ``bootstrap`` claims is bootstrap's from then on (``OwnedEntry.by``): no later
        OSC's write makes it the OSC's, so the orphan sweep never takes it."""
        inv = self.inventory()
        entries = dict(inv.entries)
        for c in claims:
            old = entries.get(c.path)
            if old is not None:
                flag = old.created if created is None else created
            else:
                flag = not self.fs.exists(c.path) if created is None else created
            by = old.by if old is not None and c.by == "osc" else c.by
            entries[c.path] = OwnedEntry(
                kind=c.kind, created=flag, sha256=c.sha256, mode=c.mode, by=by
            )
        return self._save_inventory(entries)

    def keep_only(self, entries: Mapping[str, OwnedEntry]) -> Inventory:
        """Make ``entries`` the whole inventory, with no journal's claims pending (``reset``:
        what it could not remove, for the next reset to try again)."""
        new = self.inventory().with_entries(dict(sorted(entries.items())), folded=None)
        self._save(INVENTORY, new, SECRET_MODE)
        self._inventory, self._claims, self._claims_of = new, {}, None
        return new

    def release(self, paths: Iterable[str]) -> Inventory:
        """Forget paths after deleting them."""
        entries = dict(self.inventory().entries)
        for p in paths:
            entries.pop(p, None)
        return self._save_inventory(entries)

    async def release_async(self, paths: Iterable[str]) -> Inventory:
        paths = list(paths)
        async with self._lock:
            return await _off_loop(self.release, paths)

    def _save_inventory(self, entries: dict[str, OwnedEntry]) -> Inventory:
        """Save ``entries`` as the inventory. During a journal its claims stay in its progress
        file too (folding them in again later changes nothing: a change set never deletes a
        path it writes); outside one, claims read from a progress file are folded in here."""
        inv = self.inventory()
        if entries == inv.entries and self.has_inventory():
            return inv
        folded = inv.folded
        if self._claims and self.pending() is None:
            folded, self._claims = self._claims_of, {}
        new = inv.with_entries(dict(sorted(entries.items())), folded=folded)
        self._save(INVENTORY, new, SECRET_MODE)
        self._inventory = new
        return new

    # --- status ----------------------------------------------------------------------------------

    def save_status(self, record: ApplyRecord) -> None:
        self._save(STATUS, record, PUBLIC_MODE)
        self.status_saved(record)

    async def save_status_async(self, record: ApplyRecord) -> None:
        async with self._lock:
            await _off_loop(self._save, STATUS, record, PUBLIC_MODE)
        self.status_saved(record)  # on the loop, as the metrics it feeds

    def status_saved(self, record: ApplyRecord) -> None:
        """Called after ``record`` was saved (a hook for metrics)."""

    def load_status(self) -> ApplyRecord | None:
        return self._load(STATUS, ApplyRecord)

    async def load_status_async(self) -> ApplyRecord | None:
        return await _off_loop(self.load_status)

    # --- apply history (history.py) --------------------------------------------------------------

    def load_history(self) -> HistoryLog:
        """The last applies, oldest first; empty if none (an unreadable file is set aside)."""
        from node_agent.host.history import HISTORY, HistoryLog

        if self._history is None:
            self._history = self._load(HISTORY, HistoryLog) or HistoryLog()
        return self._history

    async def load_history_async(self) -> HistoryLog:
        from node_agent.host.history import HISTORY, HistoryLog

        if self._history is None:
            loaded = await _off_loop(self._load, HISTORY, HistoryLog)
            if self._history is None:  # appended meanwhile
                self._history = loaded or HistoryLog()
        return self._history

    async def append_history_async(self, entry: HistoryEntry) -> HistoryLog:
        """Add ``entry`` (the oldest beyond 50 dropped) and rewrite the file atomically. A
        failed read or write is logged, never raised: the history must not fail an apply (the
        entry stays in memory and is written with the next one)."""
        async with self._lock:
            return await _off_loop(self.append_history, entry)

    def append_history(self, entry: HistoryEntry) -> HistoryLog:
        """``append_history_async`` for code off the event loop (the CLI, tests)."""
        from node_agent.host.history import HISTORY, HistoryLog

        try:
            log = self.load_history().appended(entry)
        except (OSError, HostError) as exc:  # a read that even setting aside did not fix
            _log.warning("apply history not read; starting a new one", error=str(exc))
            log = HistoryLog().appended(entry)
        self._history = log
        try:
            self._save_bytes(HISTORY, log.to_json(), SECRET_MODE)
        except (OSError, HostError) as exc:
            _log.warning("apply history not written", error=str(exc))
        return log

    # --- documents of other parts (the health gate) ----------------------------------------------

    async def save_doc_async(self, name: str, doc: BaseModel, mode: int = SECRET_MODE) -> None:
        """Persist ``doc`` as state file ``name`` (atomically, durably)."""
        async with self._lock:
            await _off_loop(self._save, name, doc, mode)

    async def load_doc_async(self, name: str, model: type[_D]) -> _D | None:
        """State file ``name`` as ``model``; None when missing (or unreadable: moved aside)."""
        return await _off_loop(self._load, name, model)

    async def remove_doc_async(self, name: str) -> None:
        async with self._lock:
            await _off_loop(self.fs.remove, self.path(name))

    async def keep_last_applied_async(self, name: str) -> bool:
        """Keep the last applied ``osc.yaml`` as it is now as state file ``name``: a hard link,
        no copy (the last applied file is only ever replaced whole, never changed in place).
        False when there is none, or the file system refused the link."""
        async with self._lock:
            try:
                last = self.path(LAST_APPLIED_OSC)
                return await _off_loop(self.fs.keep_previous, last, keep_as=name)
            except HostError as exc:
                _log.warning("cannot keep the last applied osc.yaml", keep=name, error=str(exc))
                return False

    async def load_kept_async(self, name: str, checksum: str) -> bytes | None:
        """The bytes state file ``name`` kept, if their sha256 is ``checksum``; else None."""
        raw = await _off_loop(self._read, name)
        return raw if raw is not None and sha256_hex(raw) == checksum else None

    # --- crash leftovers -------------------------------------------------------------------------

    def temp_dirs(self) -> list[str]:
        """Directories that may hold temp files of an interrupted write: the state directory,
        the unit directory, and the directories of pending writes and of inventory entries."""
        dirs = {self.state_dir, UNIT_DIR}
        pending = self.pending()
        paths = [c.path for c in claims_for(pending.change_set)] if pending else []
        paths += list(self.inventory().entries)
        dirs.update(p.rsplit("/", 1)[0] or "/" for p in paths)
        return sorted(dirs)

    def cleanup_temp_files(self) -> list[str]:
        """Remove leftover temp files; call once at start-up, before applying."""
        removed = self.fs.cleanup_temp_files(self.temp_dirs())
        if removed:
            _log.warning("removed temp files left by an interrupted write", paths=removed)
        return removed

    # --- internals -------------------------------------------------------------------------------

    def _save(self, name: str, doc: BaseModel, mode: int) -> None:
        self._save_bytes(name, doc.model_dump_json(indent=2).encode() + b"\n", mode)

    def _save_bytes(self, name: str, data: bytes, mode: int) -> None:
        """Replace state file ``name`` with ``data`` atomically and durably (HostFS); a
        directory, FIFO, socket or device in its place is set aside first."""
        try:
            self.fs.write_atomic(self.path(name), data, mode)
        except UnsafePathError:
            if not self._clear_for_write(name):
                raise
            self.fs.write_atomic(self.path(name), data, mode)

    def _remove(self, name: str) -> None:
        """Remove state file ``name``. A directory in its place (only a file is ever removed
        there: nothing read it, e.g. a progress file without a journal) is set aside instead,
        so it cannot fail every apply from then on."""
        try:
            self.fs.remove(self.path(name))
        except HostError:
            if not self._clear_for_write(name):
                raise

    def _read(self, name: str) -> bytes | None:
        """The bytes of state file ``name``; None if missing, or if it is not a regular file or
        too large (then it is set aside)."""
        try:
            return _read_state(self.fs, self.path(name), STATE_READ_LIMIT)
        except HostError as exc:
            self._set_aside_unreadable(name, exc)
            return None

    def _load(self, name: str, model: type[_D]) -> _D | None:
        raw = self._read(name)
        if raw is None:
            return None
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            self._quarantine(name, raw, exc)
            return None

    def _quarantine(self, name: str, raw: bytes, exc: Exception) -> None:
        aside = self.path(name + CORRUPT_SUFFIX)
        why = str(exc).splitlines()[0]
        _log.warning(
            "unreadable state file moved aside and ignored",
            path=self.path(name),
            moved_to=aside,
            error=why,
        )
        try:
            self.fs.write_atomic(aside, raw, SECRET_MODE)
            self.fs.remove(self.path(name))
        except HostError:  # e.g. a directory at the ``.corrupt`` name: rename it aside instead
            self._rename_aside(name)
        self._set_aside.append(f"{self.path(name)}: not readable ({why}); moved to {aside}")
        self._journal_lost |= name in (CHANGES, CHANGES_DONE)
        self._journal_unreadable |= name == CHANGES

    def _set_aside_unreadable(self, name: str, exc: Exception) -> None:
        """Rename state file ``name`` (a directory, symlink, FIFO, device, a file too large)
        to ``<name>.corrupt`` without reading it, so it is absent for the agent from now on."""
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        aside = self.path(name + CORRUPT_SUFFIX)
        moved = self._rename_aside(name)
        _log.warning(
            "unusable state file moved aside and ignored" if moved else "unusable state file",
            path=self.path(name),
            moved_to=aside if moved else None,
            error=why,
        )
        where = f"moved to {aside}" if moved else "could not be moved aside"
        self._set_aside.append(f"{why}; {where}")
        self._journal_lost |= name in (CHANGES, CHANGES_DONE)
        self._journal_unreadable |= name == CHANGES

    def _clear_for_write(self, name: str) -> bool:
        """Before writing state file ``name``: set aside what is in its place if that is not a
        regular file or a symlink (which a rename replaces). True if something was moved."""
        path = self.path(name)
        try:
            st = self.fs.lstat(path)
        except HostError:  # e.g. a symlink in a parent: nothing to clear, the write is refused
            return False
        if st is None or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            return False
        self._set_aside_unreadable(name, UnsafePathError(path, _kind(st.st_mode)))
        try:
            return not self.fs.exists(path)
        except HostError:
            return False

    def _rename_aside(self, name: str) -> bool:
        """Rename ``name`` to ``<name>.corrupt`` (replacing an older one of any kind)."""
        try:
            return self.fs.move_aside(self.path(name), CORRUPT_SUFFIX) is not None
        except HostError as exc:
            _log.warning("state file not moved aside", path=self.path(name), error=str(exc))
            return False


def _kind(mode: int) -> str:
    kinds = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket"}
    return f"is {kinds.get(stat.S_IFMT(mode), 'a device')}, not a regular file"


def _read_state(fs: HostFS, path: str, limit: int) -> bytes | None:
    """The bytes of state file ``path`` (a host path) through ``fs``; None if missing. Never
    follows a symlink anywhere in the path, never blocks on a FIFO, never reads more than
    ``limit`` bytes: anything else is an UnsafePathError saying what is there."""
    try:
        return fs.read(path, limit=limit)
    except UnsafePathError as exc:
        try:
            st = fs.lstat(path)
        except HostError:
            raise exc from None
        if st is None or stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            raise
        raise UnsafePathError(path, _kind(st.st_mode)) from exc


def read_state_file(root: Path | str, name: str, limit: int | None = None) -> bytes | None:
    """The bytes of state file ``name`` of the agent whose ``--root`` is ``root``; None if
    missing. For readers outside the agent (``status``, ``status --history``): the same read as
    the agent's own (HostFS: no symlink followed anywhere in the path, no blocking on a FIFO,
    at most ``limit`` bytes, UnsafePathError otherwise), and nothing set aside or written."""
    limit = STATE_READ_LIMIT if limit is None else limit
    try:
        return _read_state(HostFS(root), f"{STATE_DIR}/{name}", limit)
    except HostIOError as exc:
        if exc.errno == errno.ENOENT:  # the root itself is missing: no state at all
            return None
        raise
