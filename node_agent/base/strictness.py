"""Where node-agent may be stricter than upstream in what Gardener reads: off unless asked for.

By default node-agent keeps upstream gardener-node-agent's contract in everything Gardener reads
from a Node (conditions and their reasons, the checksum annotation and when it comes, the version
label, how a failing restart is retried). An operator of a landscape can turn node-agent's
stricter behaviour on for a pool with one small file beside Gardener's config
(``/var/lib/gardener-node-agent/node-agent-strict.yaml``, which an OSC-mutating extension can add
to the pool's OSC; ``docs/operations.md``)::

    apiVersion: node-agent.gardener.cloud/v1alpha1
    kind: Strictness
    restartLoops: true        # SystemdUnitsReady False for a service in a Restart= loop
    reportAfterSettle: true   # the checksum annotation only after the health gate's window
    holdFailingUnits: true    # the restart guard holds a unit until the OSC changes

Every field defaults to false (upstream's contract); ``all: true`` turns every one on. An unknown
key or a value that is not a boolean is a ``ConfigError`` naming the file and the field.
"""

from __future__ import annotations

from typing import Final, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError

from node_agent.base.errors import ConfigError
from node_agent.base.layout import BASE_DIR

#: the file's name, in the directory of the agent's config file
STRICTNESS_FILE_NAME = "node-agent-strict.yaml"
STRICTNESS_FILE = f"{BASE_DIR}/{STRICTNESS_FILE_NAME}"
API_VERSION: Final = "node-agent.gardener.cloud/v1alpha1"
KIND: Final = "Strictness"
#: the most the file may hold (it has three booleans)
MAX_BYTES = 16 * 1024


class Strictness(BaseModel):
    """Which of node-agent's stricter verdicts an operator asked for (all off: upstream's)."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    api_version: Literal["node-agent.gardener.cloud/v1alpha1"] = Field(
        default=API_VERSION, alias="apiVersion"
    )
    kind: Literal["Strictness"] = KIND
    #: every one of the below
    all: StrictBool = False
    #: a service waiting in ``auto-restart`` after failed runs makes ``SystemdUnitsReady`` False
    #: (upstream: healthy); off, it is still a Warning Event, in ``status`` and the metrics
    restart_loops: StrictBool = Field(default=False, alias="restartLoops")
    #: the checksum annotation of an update that restarted running units only after the health
    #: gate's settle window (upstream: right after the apply); off, the gate watches after it
    report_after_settle: StrictBool = Field(default=False, alias="reportAfterSettle")
    #: the restart guard holds a unit whose restarts keep failing until the OSC changes or it
    #: comes up by itself (upstream: retried with backoff); off, its retries are only spaced out
    hold_failing_units: StrictBool = Field(default=False, alias="holdFailingUnits")

    @property
    def strict_restart_loops(self) -> bool:
        return self.all or self.restart_loops

    @property
    def strict_report_after_settle(self) -> bool:
        return self.all or self.report_after_settle

    @property
    def strict_hold_failing_units(self) -> bool:
        return self.all or self.hold_failing_units

    def names(self) -> tuple[str, ...]:
        """The stricter behaviours turned on, by their keys (for logs and ``status``)."""
        on = (
            ("restartLoops", self.strict_restart_loops),
            ("reportAfterSettle", self.strict_report_after_settle),
            ("holdFailingUnits", self.strict_hold_failing_units),
        )
        return tuple(name for name, enabled in on if enabled)


UPSTREAM = Strictness()


def parse_strictness(raw: bytes, *, source: str) -> Strictness:
    """The file's bytes as a ``Strictness``; an empty file is upstream's contract. Errors name
    ``source`` and every field at fault, in one line."""
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{source}: larger than {MAX_BYTES} bytes")
    try:
        doc = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not YAML: {str(exc).splitlines()[0]}") from exc
    if doc is None:
        return UPSTREAM
    if not isinstance(doc, dict):
        raise ConfigError(f"{source}: a mapping is expected, not {type(doc).__name__}")
    try:
        return Strictness.model_validate(doc)
    except ValidationError as exc:
        problems = [
            f"{'.'.join(str(p) for p in e['loc']) or '(document)'}: {e['msg']}"
            for e in exc.errors()
        ]
        raise ConfigError(f"{source}: {'; '.join(problems)}") from exc
