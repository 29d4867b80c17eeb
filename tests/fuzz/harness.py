"""The fuzzing harness's rules: the budgets, the errors each boundary may let through, and a
bound on every example's time and memory.

Why: the agent's boundaries catch the project's typed errors (``node_agent.base.errors``) and
nothing else, so any other exception that a hostile OSC, config, state file or cluster object
can provoke ends a controller or a command. Every target of ``tests/fuzz`` drives one pure path
with generated input and lets only the errors listed here escape; everything else fails the
example with the original exception (so that Hypothesis tells distinct failures apart by where
they were raised) and a note naming the boundary.

Budgets. The short one runs in every ``make test`` (derandomized: the same examples every run,
no database, nothing stored between runs). ``make fuzz`` runs the long one:
``NODE_AGENT_FUZZ_EXAMPLES`` examples per target, random, seeded by ``NODE_AGENT_FUZZ_SEED``
(printed in pytest's header; set it to replay a run). ``NODE_AGENT_FUZZ_SURVEY=<file>`` turns
failures into JSON lines in that file (one per distinct failure, with the smallest example
seen) and lets the run go on, to count what a long run finds.

Bounds. Hypothesis' own ``deadline`` measures wall time and flakes on a loaded machine, so each
example runs under :func:`bounded`: a watchdog thread samples the process' CPU time and resident
memory every few milliseconds and interrupts the example (``OverBudget``, a BaseException so
that no ``except Exception`` in the code under test can swallow it) when it has used more than
``CPU_SECONDS`` of CPU, ``RSS_BYTES`` of memory above what the process held when it began, or
``WALL_SECONDS`` of wall time (``NODE_AGENT_FUZZ_CPU_SECONDS`` and ``NODE_AGENT_FUZZ_RSS_MIB``
change the first two). The kernel's peak (``ru_maxrss``) is checked afterwards too, so a spike
between two samples is not missed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import resource
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TypeVar

from hypothesis import HealthCheck, Phase, seed, settings

from node_agent.base.errors import (
    ConfigError,
    HostError,
    NodeAgentError,
    OSCChecksumError,
    OSCDecodeError,
    OSCError,
    OSCValidationError,
    ResetIncompleteError,
)
from node_agent.commands.show_history import HistoryUnreadable
from node_agent.osc.inplace import InPlaceError

F = TypeVar("F", bound=Callable[..., Any])

# -- budgets ---------------------------------------------------------------------------------------

#: examples per target in the long run (``make fuzz``); 0: the short budget of every test run
LONG_EXAMPLES = int(os.environ.get("NODE_AGENT_FUZZ_EXAMPLES") or 0)
SEED = int(os.environ.get("NODE_AGENT_FUZZ_SEED") or random.SystemRandom().randrange(2**32))
SURVEY = os.environ.get("NODE_AGENT_FUZZ_SURVEY") or None

_HEALTH = [
    HealthCheck.too_slow,
    HealthCheck.data_too_large,
    HealthCheck.large_base_example,
    HealthCheck.filter_too_much,
]


def budget(short: int) -> Callable[[F], F]:
    """Hypothesis settings of one target: ``short`` examples in every test run (derandomized,
    explicit examples first), ``LONG_EXAMPLES`` random ones under ``make fuzz`` (seeded by
    ``SEED``; the explicit examples are the short run's business)."""
    if LONG_EXAMPLES:
        chosen = settings(
            max_examples=LONG_EXAMPLES,
            deadline=None,
            database=None,
            derandomize=False,
            phases=(Phase.generate, Phase.shrink),
            print_blob=True,
            report_multiple_bugs=True,
            suppress_health_check=_HEALTH,
        )

        def long(fn: F) -> F:
            return seed(SEED)(chosen(fn))

        return long
    chosen = settings(
        max_examples=short,
        deadline=None,
        database=None,
        derandomize=True,
        print_blob=True,
        report_multiple_bugs=False,  # one failure shrunk well beats several shrunk for minutes
        suppress_health_check=_HEALTH,
    )

    def short_(fn: F) -> F:
        return chosen(fn)

    return short_


# -- what may escape, per boundary ----------------------------------------------------------

Allowed = tuple[type[BaseException], ...]

#: ``osc.decode.decode_osc``: the bad-OSC errors the OSC controller reports and skips
DECODE_OSC: Allowed = (OSCDecodeError, OSCValidationError, OSCChecksumError)
#: the containerd expansion of a decoded OSC (``containerd.expand.ContainerdExpander``): a
#: criConfig it refuses is a bad OSC (a file it cannot derive is a failed item, not an error)
EXPAND: Allowed = (OSCError,)
#: ``osc.plan.plan``, ``osc.steps.step_ids``, the ChangeSet's own methods, ``write_claims`` and
#: the patch builders of ``kube.report`` / ``osc.inplace``, on an OSC that decoded: nothing
PLAN: Allowed = ()
#: ``osc.inplace.detect`` (and its parts): InPlaceError, which the controller turns into a
#: failed update (``InPlaceUpdater.begin``); ``osc.inplace.plan``/``describe``: nothing
DETECT: Allowed = (InPlaceError,)
INPLACE_PLAN: Allowed = ()
#: the OSC controller's reconcile on fakes: what its loop (``_step``) catches
RECONCILE: Allowed = (NodeAgentError,)
#: ``config.decode_config`` / ``parse_config``: ConfigError
CONFIG: Allowed = (ConfigError,)
#: the state store's readers (``StateStore.load_*``, ``pending``, ``inventory``) and the offline
#: ``status`` document: nothing (an unusable document is set aside, never raised)
STATE: Allowed = ()
#: ``status --history``'s reader (``commands.show_history.read_history``): its own
#: HistoryUnreadable, which the command reports (exit 1); its rendering: nothing
HISTORY: Allowed = (HistoryUnreadable,)
#: ``reset`` on a node whose state was planted: ResetIncompleteError once it did all it could
#: (each item it could not remove named), or a typed host error it reports
RESET: Allowed = (ResetIncompleteError, HostError)
#: ``node-agent fleet``'s pure part (``summarize``, ``render``, ``dump``): nothing
FLEET: Allowed = ()

#: What the issue that introduced this harness (issue 33) found, by the look of an escaped
#: error: a hint in the failure's note so that a known finding is recognised at once.
_KNOWN: tuple[tuple[str, str, str], ...] = (
    ("RecursionError", "", "issue 33 finding 1/4: a document nested thousands deep"),
    ("ValueError", "invalid literal for int()", "issue 33 finding 1: a non-ASCII digit"),
    ("ValueError", "embedded null byte", "issue 33 finding 1: a NUL in the OS update command"),
    ("ValueError", "Exceeds the limit", "issue 33 finding 1's kind: a number of 4,300+ digits"),
    ("OverflowError", "", "a number too large for what reads it"),
    ("UnicodeEncodeError", "surrogates not allowed", "a lone surrogate taken for text"),
)


def hint(exc: BaseException) -> str:
    """Which known finding ``exc`` looks like, for the failure's message ("" if none)."""
    name, text = type(exc).__name__, str(exc)
    for kind, part, what in _KNOWN:
        if name == kind and part in text:
            return f" (looks like {what})"
    return ""


# -- the current example and the survey ---------------------------------------------------------

_example: list[object] = [None]


def example(value: object) -> None:
    """Name the example being run (for the survey's record of it)."""
    _example[0] = value


def _origin(exc: BaseException) -> str:
    """Where ``exc`` was raised: the innermost frame in the agent's own code, else the last."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if "/node_agent/" in f.filename]
    if not (mine or frames):
        return "?"
    frame = (mine or frames)[-1]
    return f"{frame.filename.rsplit('/node_agent/', 1)[-1]}:{frame.lineno} ({frame.name})"


def _survey(target: str, kind: str, message: str, origin: str) -> None:
    """Count one failure in the survey file: one line per (target, kind, origin), with the
    smallest example seen and its message."""
    assert SURVEY is not None
    path = Path(SURVEY)
    found: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found[row["key"]] = row
    key = f"{target}|{kind}|{origin}"
    text = repr(_example[0])
    row = found.get(key)
    if row is None:
        row = found[key] = {"key": key, "target": target, "kind": kind, "origin": origin,
                            "count": 0, "example": text, "message": message[:300]}  # fmt: skip
    row["count"] += 1
    if len(text) < len(row["example"]):
        row["example"], row["message"] = text, message[:300]
    path.write_text("".join(json.dumps(r) + "\n" for r in found.values()))


@dataclass
class Outcome:
    """What happened inside :func:`only`: ``refused`` holds an allowed error, if one came."""

    refused: BaseException | None = None


class Escaped(AssertionError):
    """An error crossed a boundary that does not allow it, or an invariant failed.

    Of a subclass per kind of failure, its cause's traceback dropped (it is in the message):
    Hypothesis tells failures apart by their type and where they (and their ``__context__``)
    were raised, and a RecursionError or an interruption is raised wherever the stack ran out
    or the signal came, which would make one failure look like many (its replay "flaky")."""


_KINDS: dict[tuple[str, ...], type[Escaped]] = {}


def _kind(name: str, *key: str) -> type[Escaped]:
    found = _KINDS.get((name, *key))
    if found is None:
        found = type(name, (Escaped,), {"__module__": __name__})
        _KINDS[(name, *key)] = found
    return found


def _forget(exc: BaseException) -> None:
    """Drop where ``exc`` was raised (see ``Escaped``)."""
    exc.__traceback__ = None
    exc.__context__ = None
    exc.__cause__ = None


def _excerpt(exc: BaseException) -> str:
    """The last frames of ``exc``'s traceback, for the failure's message."""
    lines = traceback.format_exception(exc, limit=-6, chain=False)
    return "".join(lines)[-3000:]


@contextlib.contextmanager
def only(allowed: Allowed, where: str) -> Iterator[Outcome]:
    """Run the block at the boundary ``where``: an error of ``allowed`` is kept in the outcome
    (``refused``); any other exception fails the example (``Escaped``, naming the boundary,
    the error and where the agent's code raised it)."""
    outcome = Outcome()
    escaped: Exception | None = None
    try:
        yield outcome
    except (OverBudget, Escaped):  # an invariant of the block failed, or the budget ran out
        raise
    except Exception as exc:
        if allowed and isinstance(exc, allowed):
            outcome.refused = exc
            return
        escaped = exc
    if escaped is None:
        return
    name = type(escaped).__name__
    origin = _origin(escaped)
    note = (
        f"fuzz: {name} escaped {where} (raised at {origin}); only "
        f"{', '.join(a.__name__ for a in allowed) or 'nothing'} may{hint(escaped)}"
    )
    if SURVEY is not None:
        _survey(where, name, f"{note}: {escaped}"[:600], origin)
        outcome.refused = escaped
        return
    stable = "" if isinstance(escaped, RecursionError) else origin  # see Escaped
    message = f"{note}\n{name}: {str(escaped)[:500]}\n{_excerpt(escaped)}"
    _forget(escaped)
    raise _kind(f"{name}Escaped", where, stable)(message)


def expect(condition: bool, where: str, message: str | Callable[[], str], key: str = "") -> None:
    """An invariant of the target ``where``: fails the example (or is surveyed) when false.
    ``message`` says what failed (a callable: built only then); ``key`` tells different
    failures of one invariant apart in the survey."""
    if condition:
        return
    text = message if isinstance(message, str) else message()
    if SURVEY is not None:
        _survey(where, "invariant", text[:600], key or where)
        return
    raise _kind("InvariantFailed", where)(f"{where}: {text}")


# -- the bound on each example ---------------------------------------------------------------

CPU_SECONDS = float(os.environ.get("NODE_AGENT_FUZZ_CPU_SECONDS") or 10.0)
WALL_SECONDS = 60.0
RSS_BYTES = int(os.environ.get("NODE_AGENT_FUZZ_RSS_MIB") or 512) << 20
_TICK = 0.005
_IDLE = 0.02
_AGAIN = 0.1
_PAGE = os.sysconf("SC_PAGE_SIZE")


class OverBudget(BaseException):
    """An example used more time or memory than :func:`bounded` allows."""


def _rss() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * _PAGE


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _unraisable(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs where an exception is dropped (a finalizer, a callback of the
    garbage collector) or would escape the bound (its ``__exit__``, which checks the budget
    itself)."""
    if frame is not None and frame.f_code is bounded.__exit__.__code__:
        return True
    while frame is not None:
        if frame.f_code.co_name in ("__del__", "gc_callback"):
            return True
        frame = frame.f_back
    return False


class _Watchdog:
    """One thread for the whole run: while an example is armed, it samples CPU time and memory
    every few milliseconds and signals the main thread (SIGUSR2) once a limit is crossed."""

    def __init__(self) -> None:
        self.armed: tuple[float, int, float] | None = None  # cpu, rss, wall at the start
        #: the limit crossed, and by which arming (a late signal must not hit the next example)
        self.reason: tuple[tuple[float, int, float], str] | None = None
        self.main = threading.main_thread().ident
        signal.signal(signal.SIGUSR2, self._interrupt)
        threading.Thread(target=self._run, name="fuzz-watchdog", daemon=True).start()

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        reason = self.reason
        if reason is None or self.armed is not reason[0] or _unraisable(frame):
            return  # not this example's, or it would be dropped: the watchdog signals again
        raise OverBudget(reason[1])

    def _run(self) -> None:
        while True:
            armed = self.armed
            if armed is None:
                time.sleep(_IDLE)
                continue
            time.sleep(_TICK)
            cpu, rss, wall = armed
            used_cpu = time.process_time() - cpu
            used_rss = _rss() - rss
            used_wall = time.monotonic() - wall
            reason = None
            if used_cpu > CPU_SECONDS:
                reason = f"used {used_cpu:.1f} s of CPU (limit {CPU_SECONDS:g} s)"
            elif used_rss > RSS_BYTES:
                reason = f"grew by {used_rss >> 20} MiB (limit {RSS_BYTES >> 20} MiB)"
            elif used_wall > WALL_SECONDS:
                reason = f"ran {used_wall:.0f} s (limit {WALL_SECONDS:g} s)"
            if reason is not None and self.armed is armed:
                self.reason = (armed, reason)
                assert self.main is not None
                # again and again until the example has ended: an exception raised while the
                # interpreter runs a callback of its own (the garbage collector's) is dropped
                while self.armed is armed:
                    signal.pthread_kill(self.main, signal.SIGUSR2)
                    time.sleep(_AGAIN)


_WATCHDOG: list[_Watchdog] = []


class bounded:
    """Run one example within ``CPU_SECONDS``, ``RSS_BYTES`` and ``WALL_SECONDS`` (see the
    module's docstring); over budget fails it (or is surveyed).

    A class, not a generator: the watchdog is armed by the very last statement of
    ``__enter__`` and disarmed by the first of ``__exit__``, so that no interruption can land
    where it would not be caught."""

    def __init__(self, where: str) -> None:
        self.where = where
        if not _WATCHDOG:
            _WATCHDOG.append(_Watchdog())
        self.dog = _WATCHDOG[0]
        self.start_rss = self.start_peak = 0
        self.start_cpu = 0.0

    def __enter__(self) -> None:
        self.start_rss, self.start_peak, self.start_cpu = _rss(), _peak(), time.process_time()
        self.dog.reason = None
        self.dog.armed = (self.start_cpu, self.start_rss, time.monotonic())

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        self.dog.armed = None
        why: str | None = None
        if isinstance(exc, OverBudget):
            why = str(exc)
            _forget(exc)
        elif exc is not None:
            return False
        else:
            peak = _peak()
            used = time.process_time() - self.start_cpu
            if peak > self.start_peak and peak - self.start_rss > RSS_BYTES:
                why = f"peaked {(peak - self.start_rss) >> 20} MiB above its start"
            elif used > CPU_SECONDS:
                why = f"used {used:.1f} s of CPU"
        if why is None:
            return False
        text = f"an example {why}"
        if SURVEY is not None:
            _survey(self.where, "over-budget", text, why.split(" ")[0])
            return True
        raise _kind("OverBudgetFailure", self.where)(
            f"{self.where}: {text} (time and memory are bounded)"
        )
