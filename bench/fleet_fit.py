"""How a rollout's API cost grows with the pool: a fit over ``bench.fleet --json`` runs.

Reads the figures ``bench/fleet.py --json`` wrote for several pool sizes (same scenarios), prints
them side by side, fits each per-node figure against N by least squares (intercept + slope per
node: a slope near 0 means the cost per node does not grow with the pool), and models 1,000 and
5,000 nodes from the measured per-event costs: requests per node from the fit, 409 conflicts
from the fit of conflicts per node, kube-apiserver CPU from its measured cost per agent request,
the rollout's wall time from the fit of wall time against N (the heartbeat Lease's 6 updates per
node per minute over that wall time are shown apart: they are paid whether a rollout runs or not).
An ``outage`` scenario's figures are modelled as the return of an API server outage (see
``outage_model``).

    .venv/bin/python -m bench.fleet_fit RESULT.json [RESULT.json ...] [--model 1000,5000]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

#: the heartbeat Lease's updates per node per minute (one every 10 s)
HEARTBEATS_PER_MINUTE = 6.0


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b·x: (a, b); one point: (y, 0)."""
    if len(points) < 2:
        return (points[0][1] if points else 0.0), 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    b = sxy / sxx if sxx else 0.0
    return my - b * mx, b


def rollout_requests(figures: dict[str, Any], wall: float) -> float:
    """Requests per node without the heartbeat Lease (measured, or estimated from the wall
    time for runs that did not count it apart)."""
    if "rollout_requests_per_node" in figures:
        return float(figures["rollout_requests_per_node"])
    return float(figures["requests_per_node"]) - HEARTBEATS_PER_MINUTE * wall / 60


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path)
    parser.add_argument("--model", default="1000,5000", help="pool sizes to model")
    args = parser.parse_args()
    runs = sorted((json.loads(p.read_text()) for p in args.results), key=lambda r: int(r["agents"]))
    labels = sorted({label for r in runs for label in r["scenarios"]})
    models = [int(m) for m in args.model.split(",") if m]
    for label in labels:
        rows = [(int(r["agents"]), r["scenarios"][label]) for r in runs if label in r["scenarios"]]
        if label.startswith("outage"):
            outage_model(label, rows, models)
            continue
        if label == "crash":  # the costs of a dead node: time, not load (nothing to fit)
            for n, f in rows:
                print(f"== crash, N = {n}: {json.dumps(f, sort_keys=True)}")
            continue
        print(f"== {label}")
        print(
            f"  {'N':>5} {'req/node':>9} {'w/o hb':>7} {'pool Lease':>10} {'409':>6} "
            f"{'apisrv CPU s':>12} {'wall s':>7} {'max down':>8} {'load':>5}"
        )
        for n, f in rows:
            pool = f.get("pool_lease_per_node")
            print(
                f"  {n:>5} {f['requests_per_node']:>9.1f} "
                f"{rollout_requests(f, f['wall_s']):>7.1f} "
                f"{'-' if pool is None else format(pool, '.1f'):>10} {f['conflicts']:>6} "
                f"{f['apiserver_cpu_s']:>12.1f} {f['wall_s']:>7.1f} {f['max_down']:>8} "
                f"{f['load_average']:>5.1f}"
            )
        if len(rows) < 2:
            print("  one pool size only: no fit, no model")
            continue
        req = fit([(n, rollout_requests(f, f["wall_s"])) for n, f in rows])
        total = fit([(n, f["requests_per_node"]) for n, f in rows])
        conflicts = fit([(n, f["conflicts"] / n) for n, f in rows])
        wall = fit([(n, f["wall_s"]) for n, f in rows])
        cpu_per_request = sum(f["apiserver_cpu_s"] for _, f in rows) / max(
            1.0, sum(f["requests_per_node"] * n for n, f in rows)
        )
        print(
            f"  fit, requests / node without heartbeats = {req[0]:.1f} + {req[1]:.3f}·N; "
            f"all requests / node = {total[0]:.1f} + {total[1]:.3f}·N; "
            f"409 / node = {conflicts[0]:.2f} + {conflicts[1]:.4f}·N; "
            f"wall = {wall[0]:.1f} + {wall[1]:.2f}·N s; "
            f"kube-apiserver {cpu_per_request * 1000:.2f} CPU ms per agent request"
        )
        for m in models:
            per_node = req[0] + req[1] * m
            seconds = max(0.0, wall[0] + wall[1] * m)
            beats = HEARTBEATS_PER_MINUTE * seconds / 60
            requests = m * (per_node + beats)
            print(
                f"  model N = {m}: {per_node:.0f} requests / node (+{beats:.0f} heartbeats over "
                f"{seconds / 60:.0f} min), {requests / 1e6:.2f} M requests in all, "
                f"{m * max(0.0, conflicts[0] + conflicts[1] * m):.0f} conflicts (409), "
                f"kube-apiserver {requests * cpu_per_request / 60:.0f} CPU min"
            )


def outage_model(label: str, rows: list[tuple[int, dict[str, Any]]], models: list[int]) -> None:
    """An outage's return (``bench.fleet --scenarios outage``): the agents' requests in the
    first window after kube-apiserver came back, per node, fitted against N and priced with the
    measured kube-apiserver CPU per request (from the idle window and the return: its own
    background and a cost per request). Every request of the return is on the agent's own objects
    (its Lease, its Node, its watches), so the cost per node should not grow with the pool: the
    model shows the fit and the flat mean side by side, and a slope means more runs are needed,
    not that 5,000 nodes pay it. The busiest second per node falls with N (the agents' own
    jitter averages out); the model bounds it by the largest pool measured. What does not depend
    on N is shown as measured: when the last Lease was renewed and the last watch re-opened."""
    print(f"== {label}")
    print(
        f"  {'N':>5} {'idle/min':>8} {'after/min':>9} {'ratio':>5} {'lists':>5} {'watches':>7} "
        f"{'busiest s':>9} {'409':>4} {'CPU s':>6} {'Lease max':>9} {'reopen max':>10} "
        f"{'OSC all':>7} {'load':>5}"
    )
    for n, f in rows:
        print(
            f"  {n:>5} {f['idle_per_node_min']:>8.2f} {f['after_per_node_min']:>9.2f} "
            f"{f['after_per_node_min'] / f['idle_per_node_min']:>5.2f} "
            f"{f['after_lists_per_node']:>5.2f} {f['after_watches_per_node']:>7.2f} "
            f"{f['busiest_second']:>9} {f.get('conflicts', 0):>4} "
            f"{f.get('apiserver_cpu_after_s', f['apiserver_cpu_after'] * f['window_s']):>6.1f} "
            f"{f['lease_max_s']:>8.1f}s "
            f"{f.get('watch_reopen_max_s') or 0.0:>9.1f}s {f['osc_all_s'] or 0.0:>6.1f}s "
            f"{float(str(f['load_average']).split('/')[0]):>5.1f}"
        )
    per_node = fit([(n, f["after_per_node_min"]) for n, f in rows])
    flat = sum(f["after_per_node_min"] for _, f in rows) / len(rows)
    largest, at_largest = max(rows, key=lambda r: r[0])
    peak_per_node = at_largest["busiest_second"] / largest
    idle = sum(f["idle_per_node_min"] for _, f in rows) / len(rows)
    window = rows[0][1]["window_s"]
    # (runs written before these two were kept: from the rates over the window)
    requests = sum(
        f.get("after_requests", f["after_per_node_min"] * n * f["window_s"] / 60) for n, f in rows
    )
    cpu = sum(
        f.get("apiserver_cpu_after_s", f["apiserver_cpu_after"] * f["window_s"]) for _, f in rows
    )
    # kube-apiserver's CPU is its own background plus a cost per request: the idle window and
    # the return give two points per run; the slope is the cost of an agent's request
    idle_requests = sum(f["idle_per_node_min"] * n * f["window_s"] / 60 for n, f in rows)
    idle_cpu = sum(f["apiserver_cpu_idle"] * f["window_s"] for _, f in rows)
    cpu_per_request = max(0.0, cpu - idle_cpu) / max(1.0, requests - idle_requests)
    background = max(0.0, idle_cpu - idle_requests * cpu_per_request) / len(rows)
    print(
        f"  inputs: requests / node / min after = {per_node[0]:.2f} + {per_node[1]:.4f}·N (flat "
        f"mean {flat:.2f}), idle {idle:.2f}; busiest second / node {peak_per_node:.2f} at N = "
        f"{largest}; kube-apiserver {cpu_per_request * 1000:.2f} CPU ms per agent request + "
        f"{background:.1f} CPU s of its own per window (idle: {idle_requests:.0f} requests, "
        f"{idle_cpu:.1f} CPU s; return: {requests:.0f} requests, {cpu:.1f} CPU s); window "
        f"{window:g} s" + ("" if len(rows) > 1 else " (one pool size: the fit is flat)")
    )
    for m in models:
        minute = per_node[0] + per_node[1] * m
        total, total_flat = m * minute * window / 60, m * flat * window / 60
        print(
            f"  model N = {m}: {minute:.1f} (flat {flat:.1f}) requests / node / min = "
            f"{minute / idle:.1f}x ({flat / idle:.1f}x) idle; {total:,.0f} ({total_flat:,.0f}) "
            f"requests in the first {window:g} s, {total / window:,.0f} "
            f"({total_flat / window:,.0f}) / s; busiest second <= {m * peak_per_node:,.0f}; "
            "kube-apiserver "
            f"{(background + total * cpu_per_request) / window:.1f} "
            f"({(background + total_flat * cpu_per_request) / window:.1f}) cores over the window"
        )


if __name__ == "__main__":
    main()
