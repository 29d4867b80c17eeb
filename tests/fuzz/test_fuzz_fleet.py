"""Fuzz: ``node-agent fleet`` on whatever the agents of a cluster wrote.

Nodes, OSC Secrets, Leases and Events shaped as the API server returns them (the fields it
types are typed; names and label values are what it lets through) with hostile text wherever
any node's agent or an administrator may write text: annotations, condition and Event
messages, a Lease's holder, the pool's ledger. ``summarize``, the text screen and the JSON and
YAML documents must take it without an exception; the screen shows no control or format
character raw (issue 33, finding 6: they are escaped as ``status`` escapes them) while JSON
and YAML carry every value exactly; and ``fleet`` reads a Secret's rollout policy as the agents
read it (finding 9).
"""

from __future__ import annotations

import json
import math
import unicodedata
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from node_agent.commands import fleet
from node_agent.controllers.osc import pacing
from node_agent.kube import report
from tests.fuzz import harness
from tests.fuzz.harness import bounded, budget, expect, only
from tests.fuzz.strategies import events, leases, nodes, policy_annotations, secrets

#: a failure takes minutes to shrink; a pass takes seconds
pytestmark = pytest.mark.timeout(900)

NOW = 1_800_000_000.0
JSON = dict[str, Any]


def _raw_controls(text: str) -> list[str]:
    return sorted(
        {ch for ch in text if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf")},
    )


def check(
    node_list: list[JSON], secret_list: list[JSON], lease_list: list[JSON], event_list: list[JSON]
) -> None:
    with only(harness.FLEET, "fleet summarize"):
        summary = fleet.summarize(node_list, secret_list, lease_list, event_list, NOW)
    with only(harness.FLEET, "fleet render"):
        text = fleet.render(summary)
        raw = _raw_controls(text)
        expect(
            not raw,
            "fleet render",
            lambda: f"shows {[hex(ord(c)) for c in raw]} raw (issue 33, finding 6): {text!r}"[:600],
        )
    with only(harness.FLEET, "fleet JSON/YAML"):
        document = fleet.to_document(summary)
        again = json.loads(fleet.dump(summary, "json"))
        expect(again == document, "fleet JSON", lambda: "does not read back as the report")
        back = yaml.safe_load(fleet.dump(summary, "yaml"))
        expect(back == document, "fleet YAML", lambda: "does not read back as the report")
        applied = {str(n["metadata"]["name"]): n for n in node_list}
        for pool in document["pools"]:
            for line in pool["nodeStates"]:
                node = applied.get(line["name"])
                if node is None:
                    continue
                annotations = node["metadata"]["annotations"]
                wrote = annotations.get(report.ANNOTATION_APPLIED_CHECKSUM) or None
                if line["applied"] != wrote:
                    expect(False, "fleet JSON exact", f"applied {line['applied']!r} != {wrote!r}")


_OWNED_TITLE = "\x1b]0;owned\x07\x1b[2J"
_ESCAPES = {"metadata": {"name": "n1", "labels": {fleet.LABEL_POOL: "p1"},
                         "annotations": {report.ANNOTATION_APPLIED_CHECKSUM: _OWNED_TITLE}},
            "status": {"conditions": [{"type": report.CONDITION_UNITS_READY, "status": "False",
                                       "reason": "UnhealthyUnits",
                                       "message": "a.service: \x1b[31mfailed\u202e"}]}}  # fmt: skip
_LEASE = {"metadata": {"name": fleet.LEASE_PREFIX + "n1"},
          "spec": {"renewTime": "2027-01-15T08:00:00.000000Z", "leaseDurationSeconds": 40,
                   "holderIdentity": "\x1b[2J"}}  # fmt: skip


def test_terminal_escapes_a_node_wrote_are_shown_escaped() -> None:
    """Issue 33's finding 6: an agent's escapes in the applied checksum, a condition message
    and its Lease's holder."""
    harness.example(_ESCAPES)
    with bounded("fleet (a known input)"):
        check([_ESCAPES], [], [_LEASE], [])


@budget(short=100)
@given(
    node_list=st.lists(nodes(), max_size=5, unique_by=lambda n: str(n["metadata"]["name"])),
    secret_list=st.lists(secrets(), max_size=3),
    lease_list=st.lists(leases(), max_size=5),
    event_list=st.lists(events(), max_size=5),
)
def test_fleet_renders_any_cluster_escaped_and_exact(
    node_list: list[JSON], secret_list: list[JSON], lease_list: list[JSON], event_list: list[JSON]
) -> None:
    harness.example((node_list, secret_list, lease_list, event_list))
    with bounded("fleet"):
        check(node_list, secret_list, lease_list, event_list)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def test_a_soak_above_the_cap_reads_as_the_agents_read_it() -> None:
    """Issue 33's finding 9: ``rollout-canary-soak: 1000h`` (the agents cap it at 86,400 s)."""
    policy_check({pacing.ANNOTATION_MAX_PARALLEL: "2", pacing.ANNOTATION_SOAK: "1000h"})


@budget(short=300)
@given(annotations=policy_annotations())
def test_fleet_reads_the_rollout_policy_as_the_agents_do(annotations: dict[str, str]) -> None:
    policy_check(annotations)


def policy_check(annotations: dict[str, str]) -> None:
    """One rule, one reading: what ``fleet`` shows of a Secret's rollout annotations is what
    the agents (``pacing.parse_policy``) act on."""
    harness.example(annotations)
    with bounded("rollout policy"):
        with only(harness.FLEET, "fleet read_policy"):
            ours = fleet.read_policy(annotations)
        with only((), "pacing parse_policy"):
            theirs = pacing.parse_policy(annotations)
        expect(
            ours == theirs,
            "rollout policy",
            lambda: f"fleet reads {ours}, the agents {theirs} (issue 33, finding 9)",
        )
