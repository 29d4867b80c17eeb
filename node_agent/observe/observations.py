"""What must be observed as it happens rather than read at scrape time: every apply's duration
and outcome. :class:`ObservedStateStore` hands each ``ApplyRecord`` the applier persists to
:class:`ApplyObservations`; the read side (:mod:`node_agent.observe.view`) reads the totals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from node_agent.base.log import get_logger
from node_agent.host.documents import ApplyRecord
from node_agent.host.state import StateStore

if TYPE_CHECKING:
    from node_agent.host.fs import HostFS

log = get_logger("node-agent.observability")

#: Apply durations (seconds): a no-op-ish apply takes tens of ms, a kubelet restart seconds, an
#: image pull or a stuck unit up to the job timeout.
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    buckets: tuple[float, ...] = DURATION_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass
class ApplyObservations:
    """What the applier's records tell, as they are written (see :class:`ObservedStateStore`)."""

    durations: Histogram = field(default_factory=Histogram)
    results: dict[str, int] = field(default_factory=dict)
    restarts: int = 0  # units restarted by applies (OSC changes and drift repairs)
    last: ApplyRecord | None = None
    failed_items: int = 0  # items of the last apply that did not reach their state
    #: ``osc.failures`` when the last apply succeeded: the failure streak starts there.
    failures_at_success: int = 0
    #: Reads the OSC controller's failure counter (0 until the controller exists).
    failure_count: Callable[[], int] = field(default=lambda: 0, repr=False)

    def observe(self, record: ApplyRecord) -> None:
        self.durations.observe(record.duration_seconds)
        self.results[record.result] = self.results.get(record.result, 0) + 1
        self.restarts += len(record.restarted_units)
        self.last = record
        self.failed_items = len(record.failures)
        if record.result == "succeeded":
            self.failures_at_success = self.failure_count()


class ObservedStateStore(StateStore):
    """A StateStore that also hands every saved ApplyRecord to ``on_status`` (for metrics)."""

    def __init__(self, fs: HostFS, on_status: Callable[[ApplyRecord], None]) -> None:
        super().__init__(fs)
        self._on_status = on_status

    def status_saved(self, record: ApplyRecord) -> None:
        try:
            self._on_status(record)
        except Exception as exc:  # metrics must never fail an apply
            log.warning("apply not observed", error=str(exc))
