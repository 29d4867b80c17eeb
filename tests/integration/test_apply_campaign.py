"""A randomized campaign on the real test bed: whatever happens, the next good OSC converges.

One throwaway node, one real ``node-agent run`` process, 100 random scenarios per run by default
(``NODE_AGENT_CAMPAIGN_SCENARIOS``), drawn from a seeded RNG (``NODE_AGENT_CAMPAIGN_SEED``; the
seed is printed). Each scenario starts from the previous one's converged node, publishes a short
random sequence of OSCs drawn from a pool of units, drop-ins, template units (``foo@.service``:
only files, never a job) and files (added, changed, removed; sometimes a unit that never starts),
injects kill -9s (the crash hook after a random step kind, or an external SIGKILL at a random
moment), sometimes publishes a newer Secret while the agent is down, and ends with a good OSC that
must converge: checksum on the Node, every file, unit and drop-in as it says, every unit active
with its newest version, every template loaded by systemd as it says.

Host faults drawn on the way: the binary of a ``Restart=always`` unit removed or put back (its
restart job is done at the fork, then the unit fails: the unit check's business, never a reason
to hold the checksum), and, while the agent is down, an unusable state file planted where the
apply history, ``status.json`` or the journal should be (a directory, a FIFO, a symlink, garbage):
the agent sets it aside, never follows the symlink, and converges; the status command still
answers.

Restarts are counted exactly: each unit logs a tag naming its versions (unit text, drop-in, the
file in its ``filePaths``) and the time on every start, and every change gets fresh versions,
so a tag logged twice is a unit restarted twice for one change. A kill between a restart and its
journal record can legitimately cause one such extra start: those (a kill landed between the
first start's job and the second start) are counted and printed separately; all others fail the
campaign. A journal set aside after a kill loses the record of what was done, so a restart
between that kill and the plant may repeat once too: those are counted with the kills.
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
from node_agent.base.layout import CHANGES, CHANGES_DONE, HISTORY, STATUS
from node_agent.host.fs import HostFS
from node_agent.host.state import STATE_DIR, StateStore
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
from tests.testbed.state_shapes import PLANT_SHAPES, plant_unusable
from tests.testbed.systemd_ns import IsolatedSystemd

pytestmark = pytest.mark.integration

UNITS = 5  # pool units camp-u<i>.service, each with /etc/camp/u<i>.conf in its filePaths
PLAIN_FILES = 4  # /etc/camp/plain-<i>.conf, used by no unit
TEMPLATES = 2  # template units camp-t<k>@.service
BAD = "camp-bad.service"
#: Type=simple, Restart=always: its restart job is done at the fork, whether its binary is there
FLAKY = "camp-flaky.service"
FLAKY_BIN = "/opt/camp/bin/flaky"
FLAKY_SCRIPT = (
    f'#!/bin/sh\nmkdir -p /var/log/camp\necho "$FLAKY_GEN" >> /var/log/camp/{FLAKY}\n'
    "exec sleep infinity\n"
)
#: the state files an unusable thing is planted at while the agent is down
STATE_FILES = {"history": HISTORY, "status": STATUS, "journal": CHANGES, "progress": CHANGES_DONE}
#: a symlink planted at a state file points here (relative, so inside the node's root)
VICTIM = "/etc/camp-victim"
VICTIM_TEXT = "never written through a symlink\n"
LOG_DIR = "/var/log/camp"
UNIT_DIR = "/etc/systemd/system"
ANNOTATION = "checksum/cloud-config-data"
CONVERGE_BOUND = 60.0  # seconds for the final OSC of a scenario
JOB_SLACK = 0.5  # seconds a restart job may run before its start is logged (stop, then start)
# The kinds of apply steps each change of the pool brings (a changed unit is re-enabled, after
# its restart when none of its unit files changes).
STEP_KINDS = {
    "unit-text": {"unit", "enable", "reload", "cmd"},
    "unit-file": {"file", "cmd", "enable", "reload-after-enable"},
    "dropin": {"dropin", "enable", "reload", "cmd"},
    "drop-dropin": {"unit", "enable", "reload", "cmd"},
    "remove-unit": {"delete-unit", "delete-file"},
    "add-unit": {"file", "unit", "enable", "reload", "cmd"},
    "plain": {"file"},
    "remove-plain": {"delete-file"},
    "bad": {"unit", "enable", "reload", "cmd"},
    "flaky-text": {"unit", "enable", "reload", "cmd"},
    # A template unit is only files: no enable, no job.
    "tpl-add": {"unit", "reload"},
    "tpl-text": {"unit", "reload"},
    "tpl-dropin": {"dropin", "reload"},
    "tpl-drop-dropin": {"delete-dropin", "reload"},
    "tpl-remove": {"delete-unit", "reload-after-delete"},
}


def scenario_count() -> int:
    return int(os.environ.get("NODE_AGENT_CAMPAIGN_SCENARIOS", "100"))


def campaign_seed() -> int:
    raw = os.environ.get("NODE_AGENT_CAMPAIGN_SEED")
    return int(raw) if raw else random.SystemRandom().randrange(2**32)


def unit_name(i: int) -> str:
    return f"camp-u{i}.service"


def unit_conf(i: int) -> str:
    return f"/etc/camp/u{i}.conf"


def template_name(k: int) -> str:
    return f"camp-t{k}@.service"


def instance_name(k: int) -> str:
    """An instance systemd loads from template ``k`` on demand (never started)."""
    return f"camp-t{k}@probe.service"


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


#: what an extension may set on a template; none of it may lead to a job
TEMPLATE_FIELDS: tuple[dict[str, Any], ...] = (
    {},
    {"enable": True, "command": "start"},
    {"command": "restart"},
    {"enable": False},
)


@dataclass
class TemplateSpec:
    unit_gen: int
    dropin_gen: int | None
    fields: int  # index into TEMPLATE_FIELDS

    def environment(self) -> list[str]:
        """What an instance's ``Environment`` shows when systemd loaded this version."""
        env = [f"TPL_GEN={self.unit_gen}"]
        return env + ([f"TPL_DROPIN={self.dropin_gen}"] if self.dropin_gen is not None else [])


def template_text(spec: TemplateSpec) -> str:
    return (
        "[Unit]\nDescription=campaign template %i\n\n[Service]\n"
        f"Environment=TPL_GEN={spec.unit_gen}\nExecStart=/bin/sleep infinity\n"
    )


def template_dropin_text(spec: TemplateSpec) -> str:
    return f"[Service]\nEnvironment=TPL_DROPIN={spec.dropin_gen}\n"


def flaky_text(gen: int) -> str:
    return (
        "[Unit]\nStartLimitIntervalSec=0\n\n[Service]\n"
        f"Environment=FLAKY_GEN={gen}\nExecStart={FLAKY_BIN}\nRestart=always\nRestartSec=1\n"
        "\n[Install]\nWantedBy=multi-user.target\n"
    )


@dataclass
class Model:
    units: dict[int, UnitSpec] = field(default_factory=dict)
    files: dict[int, int] = field(default_factory=dict)  # plain file -> generation
    templates: dict[int, TemplateSpec] = field(default_factory=dict)
    flaky_gen: int = 0
    bad: bool = False
    #: kinds of apply steps the changes since the last publish bring (where a crash hook fires)
    step_kinds: set[str] = field(default_factory=set)
    template_changes: int = 0
    flaky_changes: int = 0
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
        choices += ["template", "template", "flaky-text"]
        what = rng.choice(choices)
        if what == "template":
            self.template_changes += 1
            return self.mutate_template(rng)
        if what == "flaky-text":
            self.flaky_changes += 1
            self.flaky_gen = self.next_gen()
            self.step_kinds |= STEP_KINDS[what]
            return what
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

    def mutate_template(self, rng: random.Random) -> str:
        present = sorted(self.templates)
        absent = [k for k in range(TEMPLATES) if k not in self.templates]
        choices = ["tpl-add"] if absent else []
        if present:
            choices += ["tpl-text", "tpl-dropin", "tpl-remove"]
        if any(self.templates[k].dropin_gen is not None for k in present):
            choices.append("tpl-drop-dropin")
        what = rng.choice(choices)
        if what == "tpl-add":
            k = rng.choice(absent)
            dropin = self.next_gen() if rng.random() < 0.5 else None
            fields = rng.randrange(len(TEMPLATE_FIELDS))
            self.templates[k] = TemplateSpec(self.next_gen(), dropin, fields)
            if dropin is not None:
                self.step_kinds.add("dropin")
        elif what == "tpl-text":
            k = rng.choice(present)
            self.templates[k].unit_gen = self.next_gen()
            self.templates[k].fields = rng.randrange(len(TEMPLATE_FIELDS))
        elif what == "tpl-dropin":
            k = rng.choice(present)
            self.templates[k].dropin_gen = self.next_gen()
        elif what == "tpl-drop-dropin":
            k = rng.choice([k for k in present if self.templates[k].dropin_gen is not None])
            self.templates[k].dropin_gen = None
        else:
            k = rng.choice(present)
            del self.templates[k]
        self.step_kinds |= STEP_KINDS[what]
        return f"{what} t{k}"

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
        for k, tpl in sorted(self.templates.items()):
            template: dict[str, Any] = {
                "name": template_name(k),
                "content": template_text(tpl),
                **TEMPLATE_FIELDS[tpl.fields],
            }
            if tpl.dropin_gen is not None:
                template["dropIns"] = [
                    {"name": "10-tpl.conf", "content": template_dropin_text(tpl)}
                ]
            units.append(template)
        units.append({"name": FLAKY, "content": flaky_text(self.flaky_gen), "enable": True})
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
    for k in range(TEMPLATES):
        name, tpl = template_name(k), model.templates.get(k)
        dropin = f"{UNIT_DIR}/{name}.d/10-tpl.conf"
        expect_file(f"{UNIT_DIR}/{name}", None if tpl is None else template_text(tpl))
        want_dropin = None if tpl is None or tpl.dropin_gen is None else template_dropin_text(tpl)
        expect_file(dropin, want_dropin)
        # What systemd loaded: an instance's environment is the template's newest version.
        show = ["systemctl", "show", "-P", "LoadState,Environment", instance_name(k)]
        loaded = node.run(show, check=False).stdout.split()
        loaded_want = ["not-found"] if tpl is None else ["loaded", *tpl.environment()]
        # systemctl show -P prints the properties in its own order; compare as sets
        if sorted(loaded) != sorted(loaded_want):
            problems.append(f"systemd loaded {instance_name(k)} as {loaded}, not {loaded_want}")
    expect_file(f"{UNIT_DIR}/{FLAKY}", flaky_text(model.flaky_gen))
    if (got := systemctl(node, "is-enabled", FLAKY)) != "enabled":
        problems.append(f"{FLAKY} is-enabled: {got}")
    if node.path(VICTIM).read_text() != VICTIM_TEXT:
        problems.append(f"{VICTIM} was written through a symlink planted at a state file")
    expect_file(f"{UNIT_DIR}/{BAD}", None)
    if systemctl(node, "is-active", BAD) not in ("inactive", "failed"):
        problems.append(f"{BAD} not gone")
    leftovers = node.run(["find", "/etc/camp", UNIT_DIR, "-name", ".node-agent-tmp-*"]).stdout
    if leftovers:
        problems.append(f"temp files left: {leftovers.split()}")
    return problems


def flaky_problems(node: IsolatedSystemd, model: Model) -> list[str]:
    """With its binary there, the Restart=always unit runs its newest version ([] if so)."""
    state = systemctl(node, "is-active", FLAKY)
    try:
        starts = node.path(f"{LOG_DIR}/{FLAKY}").read_text().split()
    except FileNotFoundError:
        starts = []
    last = starts[-1] if starts else "nothing"
    if state != "active" or last != str(model.flaky_gen):
        return [f"{FLAKY} is {state}, last started {last}, not {model.flaky_gen}"]
    return []


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
    #: when an unusable thing was planted at the journal (or its progress): the journal is set
    #: aside, so what it recorded as done after a hook kill may be done once more
    journal_lost_times: list[float] = field(default_factory=list)
    template_changes: int = 0
    flaky_changes: int = 0
    binary_removed: int = 0
    binary_restored: int = 0
    oscs_with_binary_missing: int = 0
    converged_with_binary_missing: int = 0
    plants: dict[str, int] = field(default_factory=dict)  # "<state file>/<shape>" -> count
    status_after_plant: int = 0  # the status command answered with the plant in place
    set_aside_warnings: int = 0

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
            f"between the two starts); template unit changes {self.template_changes}, "
            f"Restart=always unit changes {self.flaky_changes}, its binary removed "
            f"{self.binary_removed} times and put back {self.binary_restored} "
            f"({self.oscs_with_binary_missing} OSCs published and "
            f"{self.converged_with_binary_missing} scenarios converged without it); "
            f"unusable state files planted {sum(self.plants.values())} "
            f"({', '.join(f'{k} {n}' for k, n in sorted(self.plants.items()))}), "
            f"status answered with one in place {self.status_after_plant}, "
            f"{self.set_aside_warnings} StateFileSetAside Warnings on the Node; {seconds:.0f} s"
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
        self.binary_present = True

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
        self.figures.oscs_with_binary_missing += not self.binary_present
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

    def set_binary(self, present: bool) -> None:
        """Put the Restart=always unit's binary on the host, or take it away (a host fault)."""
        path = self.node.path(FLAKY_BIN)
        if present:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(".flaky.new")
            tmp.write_text(FLAKY_SCRIPT)
            tmp.chmod(0o755)
            tmp.rename(path)
        else:
            path.unlink()
        self.binary_present = present

    async def plant(self, rng: random.Random) -> str:
        """While the agent is down: something unusable where a state file should be."""
        assert not self.running
        what, shape = rng.choice(sorted(STATE_FILES)), rng.choice(PLANT_SHAPES)
        path = self.node.path(f"{STATE_DIR}/{STATE_FILES[what]}")
        if shape == "symlink":  # the victim relative to the state directory: inside the node
            target = "/dev/zero" if rng.random() < 0.5 else VICTIM
            relative = "../" * STATE_DIR.count("/") + VICTIM[1:]
            plant_unusable(path, shape, symlink_to=target if target == "/dev/zero" else relative)
            shape = f"symlink to {target}"
        elif shape == "garbage":
            plant_unusable(path, shape, garbage=b"\x00{not json: " + rng.randbytes(16) + b"\n")
        else:
            plant_unusable(path, shape)
        key = f"{what}/{shape.split()[0]}"
        self.figures.plants[key] = self.figures.plants.get(key, 0) + 1
        if what in ("journal", "progress"):
            self.figures.journal_lost_times.append(time.time())
        # An operator looks meanwhile: the status command answers (it reads, never hangs).
        await status_json(self.node.root)
        self.figures.status_after_plant += 1
        return f"{shape} planted at {STATE_FILES[what]}"

    async def warm_up(self) -> None:
        rng = random.Random(self.seed)
        self.model.units = {i: self.model.new_unit(rng) for i in range(UNITS - 1)}
        self.model.files = {j: self.model.next_gen() for j in range(PLAIN_FILES - 1)}
        self.model.templates = {0: TemplateSpec(self.model.next_gen(), self.model.next_gen(), 0)}
        self.model.flaky_gen = self.model.next_gen()
        self.set_binary(True)
        victim = self.node.path(VICTIM)
        victim.parent.mkdir(parents=True, exist_ok=True)
        victim.write_text(VICTIM_TEXT)
        checksum = await self.publish()
        await self.start()
        await self.harness.wait_applied(checksum, timeout=CONVERGE_BOUND)
        assert converged_problems(self.node, self.model) == []
        await wait_for(lambda: not flaky_problems(self.node, self.model), 20, f"{FLAKY} up")
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
            if rng.random() < 0.3:
                steps.append(await self.plant(rng))
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
        if self.binary_present:  # Restart= retries every second: it comes up by itself
            if not await eventually(lambda: not flaky_problems(self.node, self.model), 20):
                raise AssertionError(
                    f"scenario {index} (seed {self.seed}): {flaky_problems(self.node, self.model)}"
                    f"; {' | '.join(steps)}"
                )
        else:
            self.figures.converged_with_binary_missing += 1
        self.figures.converged += 1
        self.figures.scenarios += 1
        self.judge_restarts(index)
        return f"{' | '.join(steps)} -> converged in {took:.1f} s"

    async def intermediate(self, rng: random.Random) -> str:
        """Publish the model's OSC and do one random thing to the agent meanwhile."""
        action = rng.choice(["apply", "apply", "burst", "hook-kill", "external-kill"])
        host_fault = ""
        if rng.random() < 0.25:  # the Restart=always unit's binary goes, or comes back
            self.set_binary(not self.binary_present)
            if self.binary_present:
                self.figures.binary_restored += 1
                host_fault = f"{FLAKY_BIN} put back, "
            else:
                self.figures.binary_removed += 1
                host_fault = f"{FLAKY_BIN} removed, "
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
        if not self.running and rng.random() < 0.4:
            action += ", " + await self.plant(rng)
        if not self.running and rng.random() < 0.6:
            await self.start()  # else: the next OSC is published while the agent is down
        elif not self.running:
            self.figures.published_while_down += 1
            action += ", next OSC published while down"
        return host_fault + action

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
                    lost = [t for t in self.figures.journal_lost_times if first <= t <= again]
                    where = f"{key} (scenario {scenario}, {again - first:.2f} s after the previous"
                    if kills:
                        where += f"; SIGKILL {kills[0] - first:+.3f} s from the first start)"
                        self.figures.extra_restarts_after_kill.append(where)
                    elif lost:
                        where += f"; journal set aside {lost[0] - first:+.3f} s from the first)"
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
        figures = campaign.figures
        figures.template_changes = campaign.model.template_changes
        figures.flaky_changes = campaign.model.flaky_changes
        figures.set_aside_warnings = len(
            [m for m in await warning_messages(harness.admin, harness.node_name) if STATE_DIR in m]
        )
        print(figures.summary(seed, time.monotonic() - started))
        for key in campaign.figures.extra_restarts_after_kill:
            print(f"  restarted again after a kill: {key}")
        await agent.kill()
    figures = campaign.figures
    assert figures.scenarios == scenarios
    assert figures.converged == scenarios
    assert figures.kills >= scenarios // 2, "too few kills to mean anything"
    assert figures.extra_restarts == [], figures.extra_restarts
    read_at_start = [k for k in figures.plants if not k.startswith("status/")]
    if read_at_start:  # the history and the journal are read by the first apply after a start
        assert figures.set_aside_warnings > 0, f"planted {read_at_start}, no Warning said so"
