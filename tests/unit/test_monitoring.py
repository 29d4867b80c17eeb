"""The monitoring mixin's files hang together: the dashboard's recording rules are defined in
the rules file, every panel has a query, and every raw metric they use is one the agent's
collector names (the live agent's scrape is compared in
``tests/integration/test_monitoring_metrics.py``)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "monitoring" / "rules.yaml"
DASHBOARD = REPO / "monitoring" / "dashboards" / "node-agent.json"
METRICS_SOURCE = REPO / "node_agent" / "observe" / "metrics.py"

#: an agent series (``node_agent_...``); recording rules have colons and are not matched
METRIC = re.compile(r"\bnode_agent_[a-z0-9_]+\b")
RECORD = re.compile(r"\bnode_agent:[a-z0-9_:]+\b")


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard_queries() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for panel in doc["panels"] for t in panel.get("targets", [])]


def expressions() -> list[str]:
    return [str(r["expr"]) for r in rules()] + dashboard_queries()


def used_metric_names() -> set[str]:
    """Every agent series the rules and the dashboard query."""
    return {name for expr in expressions() for name in METRIC.findall(expr)}


def test_dashboard_recordings_are_defined_and_every_panel_queries() -> None:
    defined = {r["record"] for r in rules() if "record" in r}
    used = {name for expr in dashboard_queries() for name in RECORD.findall(expr)}
    assert used
    assert used <= defined, used - defined
    doc = json.loads(DASHBOARD.read_text())
    assert all(panel.get("targets") for panel in doc["panels"])
    assert len({panel["id"] for panel in doc["panels"]}) == len(doc["panels"])


def test_every_alert_has_a_severity_summary_and_runbook() -> None:
    alerts = [r for r in rules() if "alert" in r]
    assert len(alerts) >= 10
    for alert in alerts:
        assert alert["labels"]["severity"] in ("warning", "critical"), alert["alert"]
        assert alert["annotations"]["summary"], alert["alert"]
        assert len(alert["annotations"]["runbook"]) > 40, alert["alert"]


def test_the_collector_names_every_used_metric() -> None:
    """Cheap early warning before the integration test: the family name (without the
    ``_total``/``_bucket`` suffixes the exposition adds) is written in the collector."""
    source = METRICS_SOURCE.read_text()
    for name in sorted(used_metric_names()):
        family = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{family}"' in source, name
