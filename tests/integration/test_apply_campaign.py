"""A randomized campaign on the real test bed: whatever happens, the next good OSC converges.

One throwaway node, one real ``node-agent run`` process, at least 50 random scenarios per run
(``NODE_AGENT_CAMPAIGN_SCENARIOS``), drawn from a seeded RNG (``NODE_AGENT_CAMPAIGN_SEED``; the
seed is printed). Each scenario starts from the previous one's converged node, publishes a short
random sequence of OSCs drawn from a pool of units, drop-ins and files (added, changed, removed;
sometimes a unit that never starts), injects kill -9s (the crash hook after a random step kind,
or an external SIGKILL at a random moment), sometimes publishes a newer Secret while the agent is
down, and ends with a good OSC that must converge: checksum on the Node, every file, unit and
drop-in as it says, every unit active with its newest version.

Restarts are counted exactly: each unit logs a tag naming its versions (unit text, drop-in, the
file in its ``filePaths``) and the time on every start, and every change gets fresh versions,
so a tag logged twice is a unit restarted twice for one change. A kill between a restart and its
journal record can legitimately cause one such extra start: those (a kill landed between the
first start's job and the second start) are counted and printed separately; all others fail the
campaign.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from node_agent.apply.executor import CRASH_HOOK_ENV
from node_agent.host.fs import HostFS
from node_agent.host.state import StateStore
from tests.testbed.agent_harness import (
    AgentProcess,
    OSCAgent,
    eventually,
    inline_file,
    osc_document,
    service,
    status_json,
    wait_for,
    warning_messages,
)
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

UNITS = 5  # pool units camp-u<i>.service, each with /etc/camp/u<i>.conf in its filePaths
PLAIN_FILES = 4  # /etc/camp/plain-<i>.conf, used by no unit
BAD = "camp-bad.service"
LOG_DIR = "/var/log/camp"
UNIT_DIR = "/etc/systemd/system"
ANNOTATION = "checksum/cloud-config-data"
CONVERGE_BOUND = 60.0  # seconds for the final OSC of a scenario
JOB_SLACK = 0.5  # seconds a restart job may run before its start is logged (stop, then start)
# The kinds of apply steps each change of the pool brings (a changed unit is re-enabled).
STEP_KINDS = {
    "unit-text": {"unit", "enable", "reload", "cmd"},
    "unit-file": {"file", "enable", "reload", "cmd"},
    "dropin": {"dropin", "enable", "reload", "cmd"},
    "drop-dropin": {"unit", "enable", "reload", "cmd"},
    "remove-unit": {"delete-unit", "delete-file"},
    "add-unit": {"file", "unit", "enable", "reload", "cmd"},
    "plain": {"file"},
    "remove-plain": {"delete-file"},
    "bad": {"unit", "enable", "reload", "cmd"},
}


def scenario_count() -> int:
    return int(os.environ.get("NODE_AGENT_CAMPAIGN_SCENARIOS", "60"))


def campaign_seed() -> int:
    raw = os.environ.get("NODE_AGENT_CAMPAIGN_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(2**32)


def unit_name(i: int) -> str:
    return f"camp-u{i}.service"


def unit_conf(i: int) -> str:
    return f"/etc/camp/u{i}.conf"


# --- the model: what the OSC says ---------------------------------------------------------------


@dataclass
class UnitSpec:
    unit_gen: int
    dropin_gen: int | None
    file_gen: int

    def tag(self) -> str:
        dropin = self.dropin_gen if self.dropin_gen is not None else "none"
        return f"U{self.unit_gen}/D{dropin}/F{self.file_gen}"


def unit_text(i: int, spec: UnitSpec) -> str:
    # $$ and %% reach the shell as $ and %; the tag is what this start runs with.
    log = f"{LOG_DIR}/{unit_name(i)}"
    record = (
        f'echo "U$${{UNIT_GEN}}/D$${{DROPIN_GEN:-none}}/F$$(cat {unit_conf(i)}) '
        f'$$(date +%%s.%%N)" >> {log}'
    )
    return (
        "[Unit]\nStartLimitIntervalSec=0\n\n[Service]\n"
        f"Environment=UNIT_GEN={spec.unit_gen}\n"
        f"ExecStartPre=/bin/sh -c 'mkdir -p {LOG_DIR} && {record}'\n"
        "ExecStart=/bin/sleep infinity\n\n[Install]\nWantedBy=multi-user.target\n"
    )


def dropin_text(spec: UnitSpec) -> str:
    return f"[Service]\nEnvironment=DROPIN_GEN={spec.dropin_gen}\n"


@dataclass
class Model:
    units: dict[int, UnitSpec] = field(default_factory=dict)
    files: dict[int, int] = field(default_factory=dict)  # plain file -> generation
    bad: bool = False
    #: kinds of apply steps the changes since the last publish bring (where a crash hook fires)
    step_kinds: set[str] = field(default_factory=set)
    _gen: int = 0

    def next_gen(self) -> int:
        self._gen += 1
        return self._gen

    def new_unit(self, rng: random.Random) -> UnitSpec:
        dropin = self.next_gen() if rng.random() < 0.5 else None
        return UnitSpec(self.next_gen(), dropin, self.next_gen())

    def mutate(self, rng: random.Random) -> str:
        """One random change; every changed unit gets versions it never had, so its tag is new."""
        present = sorted(self.units)
        absent = [i for i in range(UNITS) if i not in self.units]
        choices = ["unit-text", "unit-file", "dropin", "plain"]
        if any(self.units[i].dropin_gen is not None for i in present):
            choices.append("drop-dropin")
        if len(present) > 1:
            choices.append("remove-unit")
        if absent:
            choices.append("add-unit")
        what = rng.choice(choices)
        if what == "unit-text":
            i = rng.choice(present)
            self.units[i].unit_gen = self.next_gen()
        elif what == "unit-file":
            i = rng.choice(present)
            self.units[i].file_gen = self.next_gen()
        elif what == "dropin":
            i = rng.choice(present)
            self.units[i].dropin_gen = self.next_gen()
        elif what == "drop-dropin":
            i = rng.choice([i for i in present if self.units[i].dropin_gen is not None])
            # The unit text changes too: without it the tag could repeat an older version's.
            self.units[i] = UnitSpec(self.next_gen(), None, self.units[i].file_gen)
        elif what == "remove-unit":
            i = rng.choice(present)
            del self.units[i]
        elif what == "add-unit":
            i = rng.choice(absent)
            self.units[i] = self.new_unit(rng)
        else:
            j = rng.randrange(PLAIN_FILES)
            if j in self.files and rng.random() < 0.4:
                del self.files[j]
                self.step_kinds |= STEP_KINDS["remove-plain"]
                return f"remove plain-{j}"
            self.files[j] = self.next_gen()
            self.step_kinds |= STEP_KINDS["plain"]
            return f"plain-{j}"
        self.step_kinds |= STEP_KINDS[what]
        return f"{what} u{i}"

    def osc(self) -> dict[str, Any]:
        files = [
            inline_file(f"/etc/camp/plain-{j}.conf", f"plain {g}\n") for j, g in self.files.items()
        ]
        units = []
        for i, spec in sorted(self.units.items()):
            files.append(inline_file(unit_conf(i), f"{spec.file_gen}\n"))
            unit: dict[str, Any] = {
                "name": unit_name(i),
                "content": unit_text(i, spec),
                "filePaths": [unit_conf(i)],
            }
            if spec.dropin_gen is not None:
                unit["dropIns"] = [{"name": "10-gen.conf", "content": dropin_text(spec)}]
            units.append(unit)
        if self.bad:
            units.append(service(BAD, "/bin/false", extra="Type=oneshot\n"))
        return osc_document(files, units)


# --- the node, seen from the test ---------------------------------------------------------------


def start_log(node: IsolatedSystemd, i: int) -> list[tuple[str, float]]:
    """(tag, time) of every start of pool unit ``i``, oldest first."""
    try:
        text = node.path(f"{LOG_DIR}/{unit_name(i)}").read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        tag, _, when = line.partition(" ")
        out.append((tag, float(when)))
    return out


def systemctl(node: IsolatedSystemd, verb: str, unit: str) -> str:
    return node.run(["systemctl", verb, unit], check=False).stdout.strip()


def converged_problems(node: IsolatedSystemd, model: Model) -> list[str]:
    """Everything on the node that differs from what the model's OSC says ([] if converged)."""
    problems = []

    def expect_file(path: str, text: str | None) -> None:
        host = node.path(path)
        if text is None:
            if host.exists():
                problems.append(f"{path} still exists")
        elif not host.exists():
            problems.append(f"{path} missing")
        elif host.read_text() != text:
            problems.append(f"{path} has {host.read_text()!r}, not {text!r}")

    for j in range(PLAIN_FILES):
        gen = model.files.get(j)
        expect_file(f"/etc/camp/plain-{j}.conf", None if gen is None else f"plain {gen}\n")
    for i in range(UNITS):
        name, spec = unit_name(i), model.units.get(i)
        dropin = f"{UNIT_DIR}/{name}.d/10-gen.conf"
        if spec is None:
            expect_file(unit_conf(i), None)
            expect_file(f"{UNIT_DIR}/{name}", None)
            expect_file(dropin, None)
            if systemctl(node, "is-active", name) != "inactive":
                problems.append(f"{name} removed but still {systemctl(node, 'is-active', name)}")
            continue
        expect_file(unit_conf(i), f"{spec.file_gen}\n")
        expect_file(f"{UNIT_DIR}/{name}", unit_text(i, spec))
        expect_file(dropin, dropin_text(spec) if spec.dropin_gen is not None else None)
        for verb, want in (("is-active", "active"), ("is-enabled", "enabled")):
            if (got := systemctl(node, verb, name)) != want:
                problems.append(f"{name} {verb}: {got}")
        log = start_log(node, i)
        if not log or log[-1][0] != spec.tag():
            problems.append(f"{name} runs {log[-1][0] if log else 'nothing'}, not {spec.tag()}")
    expect_file(f"{UNIT_DIR}/{BAD}", None)
    if systemctl(node, "is-active", BAD) not in ("inactive", "failed"):
        problems.append(f"{BAD} not gone")
    leftovers = node.run(["find", "/etc/camp", UNIT_DIR, "-name", ".node-agent-tmp-*"]).stdout
    if leftovers:
        problems.append(f"temp files left: {leftovers.split()}")
    return problems


# --- the campaign -------------------------------------------------------------------------------


@dataclass
class Figures:
    scenarios: int = 0
    oscs: int = 0
    oscs_with_failing_unit: int = 0
    hook_kills: int = 0
    external_kills: int = 0
    external_kills_mid_change: int = 0  # the status showed a change in progress afterwards
    hooks_not_fired: int = 0
    published_while_down: int = 0
    converged: int = 0
    changes_started: int = 0  # distinct (unit, tag) pairs that ran
    extra_restarts: list[str] = field(default_factory=list)  # no kill in between: a defect
    extra_restarts_after_kill: list[str] = field(default_factory=list)
    #: when each external SIGKILL was sent. The crash hook kills right after journaling a step,
    #: so it never leaves a restart unrecorded: only these explain a second start.
    kill_times: list[float] = field(default_factory=list)

    @property
    def kills(self) -> int:
        return self.hook_kills + self.external_kills

    def summary(self, seed: int, seconds: float) -> str:
        return (
            f"campaign seed {seed}: {self.scenarios} scenarios, {self.oscs} OSCs "
            f"({self.oscs_with_failing_unit} with a failing unit), kills injected {self.kills} "
            f"({self.hook_kills} by the crash hook, {self.external_kills} external SIGKILLs, "
            f"{self.external_kills_mid_change} of them with a change in progress; "
            f"{self.hooks_not_fired} armed hooks found no such step), "
            f"{self.published_while_down} Secrets published while the agent was down, "
            f"converged {self.converged}/{self.scenarios}, unit changes started "
            f"{self.changes_started}, units restarted more than once per change "
            f"{len(self.extra_restarts)} (+{len(self.extra_restarts_after_kill)} with a kill "
            f"between the two starts), {seconds:.0f} s"
        )


class Campaign:
    def __init__(self, harness: OSCAgent, agent: AgentProcess, seed: int) -> None:
        self.harness = harness
        self.node = harness.node
        self.agent = agent
        self.seed = seed
        self.figures = Figures()
        self.model = Model()
        self.running = False
        self.counted: set[tuple[int, str]] = set()  # (unit, tag) pairs seen to start
        self.judged: set[str] = set()  # repeated starts already judged

    async def start(self, **env: str) -> None:
        await self.agent.start(**env)
        self.running = True

    async def sigkill(self) -> None:
        if self.running:
            self.figures.external_kills += 1
            self.figures.kill_times.append(time.time())
            await self.agent.kill()
            self.running = False
            # What the kill interrupted, as an operator would see it (the agent is down: the
            # status command reads the node's files).
            if (await status_json(self.node.root)).get("change_in_progress"):
                self.figures.external_kills_mid_change += 1

    async def publish(self) -> str:
        self.figures.oscs += 1
        self.figures.oscs_with_failing_unit += self.model.bad
        self.model.step_kinds.clear()
        return await self.harness.publish(self.model.osc())

    async def annotation(self) -> str | None:
        return (await self.harness.node_annotations()).get(ANNOTATION)

    async def settled(self, checksum: str, warnings_before: int) -> bool:
        """The agent applied ``checksum``, or reported its failing unit again."""
        if await self.annotation() == checksum:
            return True
        if self.model.bad:
            name = self.harness.node_name
            return len(await warning_messages(self.harness.admin, name, BAD)) > warnings_before
        return False

    async def bad_warnings(self) -> int:
        return len(await warning_messages(self.harness.admin, self.harness.node_name, BAD))

    async def wait_settled(self, checksum: str, before: int, timeout: float = 20.0) -> None:
        await eventually(lambda: self.settled(checksum, before), timeout, poll=0.1)

    async def warm_up(self) -> None:
        rng = random.Random(self.seed)
        self.model.units = {i: self.model.new_unit(rng) for i in range(UNITS - 1)}
        self.model.files = {j: self.model.next_gen() for j in range(PLAIN_FILES - 1)}
        checksum = await self.publish()
        await self.start()
        await self.harness.wait_applied(checksum, timeout=CONVERGE_BOUND)
        assert converged_problems(self.node, self.model) == []
        self.judge_restarts()

    async def scenario(self, index: int) -> str:
        rng = random.Random(f"{self.seed}/{index}")
        steps: list[str] = []
        for _ in range(rng.randint(1, 3)):
            changes = [self.model.mutate(rng) for _ in range(rng.randint(1, 3))]
            self.model.bad = rng.random() < 0.3
            steps.append("+".join(changes) + (" +bad" if self.model.bad else ""))
            steps.append(await self.intermediate(rng))
        changes = [self.model.mutate(rng) for _ in range(rng.randint(1, 2))]
        self.model.bad = False
        steps.append("final " + "+".join(changes))
        checksum = await self.publish()
        if not self.running:
            await self.start()
        started = time.monotonic()
        try:
            await self.harness.wait_applied(checksum, timeout=CONVERGE_BOUND)
            # The final OSC can be byte-identical to one the Node already carries (a change
            # and its undo): the annotation alone would say "applied" before the restarted
            # agent even looked. Converged also means no change set is left unfinished.
            await wait_for(
                lambda: StateStore(HostFS(self.node.root)).pending() is None,
                CONVERGE_BOUND,
                "no unfinished change set",
            )
        except AssertionError:
            problems = converged_problems(self.node, self.model)
            raise AssertionError(
                f"scenario {index} (seed {self.seed}) did not converge within "
                f"{CONVERGE_BOUND:.0f} s: {' | '.join(steps)}\nstill different: {problems}\n"
                f"agent log:\n{self.agent.log_tail(40)}"
            ) from None
        took = time.monotonic() - started
        problems = converged_problems(self.node, self.model)
        assert problems == [], (
            f"scenario {index} (seed {self.seed}): Node says applied but {problems}; "
            f"{' | '.join(steps)}"
        )
        self.figures.converged += 1
        self.figures.scenarios += 1
        self.judge_restarts(index)
        return f"{' | '.join(steps)} -> converged in {took:.1f} s"

    async def intermediate(self, rng: random.Random) -> str:
        """Publish the model's OSC and do one random thing to the agent meanwhile."""
        action = rng.choice(["apply", "apply", "burst", "hook-kill", "external-kill"])
        if not self.running and action in ("apply", "burst"):
            await self.start()
        before = await self.bad_warnings() if self.model.bad else 0
        if action == "hook-kill":
            kinds = self.model.step_kinds | (STEP_KINDS["bad"] if self.model.bad else set())
            kind = rng.choice(sorted(kinds))
            await self.sigkill()  # whatever it was doing: a kill at a random moment too
            checksum = await self.publish()
            await self.start(**{CRASH_HOOK_ENV: kind})
            proc = self.agent.proc
            assert proc is not None
            deadline = time.monotonic() + 20
            while proc.returncode is None and time.monotonic() < deadline:
                if await self.settled(checksum, before):
                    break
                await asyncio.sleep(0.05)
            if proc.returncode == -9:
                self.figures.hook_kills += 1
                self.running = False
                action = f"hook-kill after {kind}"
            else:
                self.figures.hooks_not_fired += 1
                await self.sigkill()
                action = f"hook {kind} not fired, external kill"
        else:
            checksum = await self.publish()
            if action == "apply":
                await self.wait_settled(checksum, before)
            elif action == "external-kill":
                delay = rng.uniform(0.0, 0.25)  # an apply takes about 0.1 s
                if not self.running:
                    await self.start()
                    delay += rng.uniform(0.8, 1.5)  # the agent starts applying after about 1 s
                await asyncio.sleep(delay)
                await self.sigkill()
        if not self.running and rng.random() < 0.6:
            await self.start()  # else: the next OSC is published while the agent is down
        elif not self.running:
            self.figures.published_while_down += 1
            action += ", next OSC published while down"
        return action

    def judge_restarts(self, scenario: int | None = None) -> None:
        """Count each unit's starts per tag; a tag started twice is a unit restarted twice for
        one change, legitimate only when a kill landed between the two starts."""
        for i in range(UNITS):
            log = start_log(self.node, i)
            times: dict[str, list[float]] = {}
            for tag, when in log:
                times.setdefault(tag, []).append(when)
            for tag, starts_of_tag in times.items():
                if (i, tag) not in self.counted:
                    self.counted.add((i, tag))
                    self.figures.changes_started += 1
                for n in range(1, len(starts_of_tag)):
                    key = f"{unit_name(i)} {tag} start #{n + 1}"
                    if key in self.judged:
                        continue
                    self.judged.add(key)
                    first, again = starts_of_tag[n - 1], starts_of_tag[n]
                    # The agent queues the restart job a moment before the start is logged: a
                    # kill in that moment leaves a restart its journal cannot know about.
                    since = first - JOB_SLACK
                    kills = [t for t in self.figures.kill_times if since <= t <= again]
                    where = f"{key} (scenario {scenario}, {again - first:.2f} s after the previous"
                    if kills:
                        where += f"; SIGKILL {kills[0] - first:+.3f} s from the first start)"
                        self.figures.extra_restarts_after_kill.append(where)
                    else:
                        self.figures.extra_restarts.append(where + "; no kill in between)")
                        print(f"  restarted twice: {where}; starts of {unit_name(i)}:")
                        for logged, when in log[-8:]:
                            print(f"    {logged} at {when:.3f}")
                        print(
                            f"    last kills: {[f'{t:.3f}' for t in self.figures.kill_times[-4:]]}"
                        )


@pytest.mark.timeout(900)
async def test_random_scenarios_with_kills_always_converge(
    harness: OSCAgent, tmp_path: Path
) -> None:
    seed, scenarios = campaign_seed(), scenario_count()
    print(
        f"campaign seed {seed} (NODE_AGENT_CAMPAIGN_SEED={seed} replays it), {scenarios} scenarios"
    )
    agent = AgentProcess(harness, tmp_path / "agent.log")
    campaign = Campaign(harness, agent, seed)
    started = time.monotonic()
    try:
        await campaign.warm_up()
        for index in range(scenarios):
            print(f"scenario {index}: {await campaign.scenario(index)}")
    finally:
        print(campaign.figures.summary(seed, time.monotonic() - started))
        for key in campaign.figures.extra_restarts_after_kill:
            print(f"  restarted again after a kill: {key}")
        await agent.kill()
    figures = campaign.figures
    assert figures.scenarios == scenarios
    assert figures.converged == scenarios
    assert figures.kills >= scenarios // 2, "too few kills to mean anything"
    assert figures.extra_restarts == [], figures.extra_restarts
