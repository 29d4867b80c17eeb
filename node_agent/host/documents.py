"""The documents the agent persists in its state directory, as data: what each file holds.

Kept apart from :mod:`node_agent.host.state` (which reads and writes them safely) so that every
reader of a document (the history, the status command, the read side) depends on its shape only,
not on the store. Each document carries ``version``: a newer format fails validation instead of
being misread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime
from typing import Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field

from node_agent.osc.applied import Applied, AppliedChanges
from node_agent.osc.plan import Base64Bytes, ChangeSet
from node_agent.osc.steps import step_ids

SCHEMA_VERSION: Literal[1] = 1

EntryKind = Literal["file", "unit", "dropin"]
#: who had the agent write a path: an OSC, or ``bootstrap`` (the agent's own unit, the kubelet
#: data volume's mount unit), which no OSC names and only ``reset`` takes back
Origin = Literal["osc", "bootstrap"]


class _Doc(BaseModel):
    """A persisted document; ``version`` makes a newer format fail validation, not misparse."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    version: Literal[1] = SCHEMA_VERSION


Document = _Doc  # the base of every persisted state document


class LastAppliedMeta(_Doc):
    checksum: str  # sha256 hex of last-applied-osc.yaml
    applied_at: AwareDatetime
    resolved: dict[str, Base64Bytes] = Field(default_factory=dict)  # secretRef file path -> bytes
    #: what this OSC put on the host, item by item, derived items (e.g. from criConfig) included;
    #: the next plan starts from it (None: written by an older agent, derive it from the OSC)
    applied: Applied | None = None


class JournalDoc(_Doc):
    id: str
    osc_checksum: str
    started_at: AwareDatetime
    change_set: ChangeSet
    #: what was applied before this change set and what it aims at, item by item (None in a
    #: journal written by an older agent: then the last applied OSC is the base)
    base: Applied | None = None
    target: Applied | None = None
    #: instead of ``base``: the base is what the last applied OSC of this checksum applied
    #: (``LastAppliedMeta.applied``), as it usually is, so it is not written twice
    base_checksum: str | None = None
    #: instead of ``target``: the target as its changes to the base, so the journal written
    #: before an apply follows the change, not the OSC
    target_changes: AppliedChanges | None = None
    #: paths written by this change set that existed before and were not the agent's
    preexisting: tuple[str, ...] = ()


class OwnedEntry(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    kind: EntryKind
    created: bool  # False: the path existed before the agent first wrote it
    sha256: str | None = None  # None: content not known up front (imageRef files)
    mode: int | None = None
    #: who wrote it first; an entry of a version that did not say is an OSC's, as it was
    by: Origin = "osc"


class JournalProgress(_Doc):
    id: str
    done: tuple[str, ...] = ()
    failed: dict[str, str] = Field(default_factory=dict)  # step id -> why, from the last attempt
    #: inventory entries of the paths this journal wrote, not yet in ``inventory.json`` (folded
    #: in when the journal ends; see ``StateStore.record_written``)
    claims: dict[str, OwnedEntry] = Field(default_factory=dict)


class Inventory(_Doc):
    entries: dict[str, OwnedEntry] = Field(default_factory=dict)  # host path -> entry
    #: the id of the last journal whose claims were folded in: a progress file of that id left
    #: behind by a crash is not folded in again (its claims may have been superseded since)
    folded: str | None = None
    #: the paths journal ``intended_by`` is about to create, with the bytes it will write there
    #: (written before that journal): each was absent when the journal began, so a file found
    #: there later with exactly those bytes is the agent's even when the journal and its
    #: progress file are both lost (``StateStore.adopt_intended``)
    intended: dict[str, OwnedEntry] = Field(default_factory=dict)
    intended_by: str | None = None

    def owns(self, path: str) -> bool:
        entry = self.entries.get(path)
        return entry is not None and entry.created

    def unfolded(self, progress: JournalProgress | None) -> Mapping[str, OwnedEntry]:
        """The claims of ``progress`` (the journal's progress file) this inventory does not
        hold yet: none once that journal was folded in."""
        if progress is None or progress.id == self.folded:
            return {}
        return progress.claims

    def updated(self, updates: Mapping[str, OwnedEntry]) -> Inventory:
        """This inventory with ``updates`` over its entries, without validating the others
        again (they are valid and in order; a new path puts them in order again)."""
        if not updates:
            return self
        merged = {**self.entries, **updates}
        if not updates.keys() <= self.entries.keys():
            merged = dict(sorted(merged.items()))
        return self.with_entries(merged)

    def with_entries(
        self, entries: dict[str, OwnedEntry], *, folded: str | Literal[False] | None = False
    ) -> Inventory:
        """This inventory with ``entries`` (valid, in order) and, when given, ``folded``; what
        is intended stays."""
        return Inventory.model_construct(
            entries=entries,
            folded=self.folded if folded is False else folded,
            intended=self.intended,
            intended_by=self.intended_by,
        )

    def with_intended(self, intended: dict[str, OwnedEntry], by: str | None) -> Inventory:
        """This inventory with ``intended`` (by journal ``by``) in place of what it had."""
        return Inventory.model_construct(
            entries=self.entries, folded=self.folded, intended=intended, intended_by=by
        )


class ItemFailure(BaseModel):
    """One item of an apply that did not reach its desired state; the others went on."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    #: what failed: ``file``, ``unit``, ``dropin``, ``enable``, ``disable``, ``reload``,
    #: ``command`` (a start/stop/restart job), ``delete`` or ``blocked`` (not attempted because
    #: something it depends on failed)
    kind: str
    item: str  # the host path or unit name
    error: str  # one line, naming the cause (systemd's reason, the OS error)


class ApplyRecord(_Doc):
    osc_checksum: str | None = None
    started_at: AwareDatetime
    finished_at: AwareDatetime
    duration_seconds: float
    result: Literal["succeeded", "failed"]
    steps: int = 0
    restarted_units: tuple[str, ...] = ()
    stopped_units: tuple[str, ...] = ()
    error: str | None = None
    failures: tuple[ItemFailure, ...] = ()  # per item; empty when the apply succeeded


@dataclass(frozen=True)
class LastApplied:
    raw: bytes  # the osc.yaml bytes
    checksum: str  # sha256 hex of raw, = the Secret's checksum/data-script
    applied_at: datetime | None
    resolved: dict[str, bytes] | None  # None: unknown (no or mismatching meta)
    applied: Applied | None = None  # None: unknown (no or mismatching meta, older agent)


@dataclass(frozen=True)
class Pending:
    """A change set that was begun and not finished: resume it by running ``remaining()``."""

    id: str
    change_set: ChangeSet
    osc_checksum: str
    started_at: datetime
    done: frozenset[str]
    base: Applied | None = None
    target: Applied | None = None
    preexisting: frozenset[str] = frozenset()
    failed: Mapping[str, str] = dataclass_field(default_factory=dict)

    @property
    def steps(self) -> tuple[str, ...]:
        return step_ids(self.change_set)

    def remaining(self) -> tuple[str, ...]:
        return tuple(s for s in self.steps if s not in self.done)


@dataclass(frozen=True)
class Claim:
    """A path the agent is about to write; recorded in the inventory first."""

    kind: EntryKind
    path: str
    sha256: str | None
    mode: int | None
    by: Origin = "osc"
