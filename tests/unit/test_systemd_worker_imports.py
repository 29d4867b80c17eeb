"""The systemd worker process imports only what it runs.

It lives as long as the agent, on every node: whatever it imports is memory paid all the time.
It needs pystemd's sd-bus binding, JSON and select; not asyncio or structlog (the agent's side of
the pipe), pydantic or the Kubernetes client, nor pystemd's object layer (lxml).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# What the worker program does before serving: import its module, then load the binding the way
# its main() does. Reports the modules loaded and the resident memory.
PROBE = """
import json, sys
import node_agent.systemd.worker as worker
worker.load_dbuslib(bare_package=True)
rss_kib = 0
with open("/proc/self/status") as status:
    for line in status:
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
print(json.dumps({"modules": sorted(sys.modules), "rss_kib": rss_kib}))
"""

FORBIDDEN = ("asyncio", "structlog", "pydantic", "kubernetes_asyncio", "aiohttp", "yaml", "lxml")


def probe() -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    report: dict[str, object] = json.loads(out)
    return report


def test_worker_imports_no_asyncio_structlog_pydantic_or_kube_client() -> None:
    report = probe()
    modules = report["modules"]
    assert isinstance(modules, list)
    loaded = {m.split(".")[0] for m in modules}
    rss_mib = int(str(report["rss_kib"])) / 1024
    print(f"\nsystemd worker: {len(modules)} modules, VmRSS {rss_mib:.1f} MiB")
    # The binding it works with is there (so the probe did load what the worker uses).
    assert "pystemd.dbuslib" in modules
    assert "node_agent.systemd.worker" in modules
    assert sorted(name for name in FORBIDDEN if name in loaded) == []
    # pystemd's object layer and the agent's asyncio client stay out.
    assert "pystemd.systemd1" not in modules
    assert "node_agent.systemd.client" not in modules
    assert "node_agent.base.log" not in modules


def test_package_still_exports_the_adapter_lazily() -> None:
    import node_agent.systemd as seam
    from node_agent.systemd.client import Systemd

    assert seam.Systemd is Systemd
    with pytest.raises(AttributeError):
        _ = seam.NoSuchThing


def test_binding_loaded_bare_serves_the_worker() -> None:
    """Without pystemd's initialiser the binding still builds D-Bus arguments and buses."""
    code = (
        "import node_agent.systemd.worker as w\n"
        "lib = w.load_dbuslib(bare_package=True)\n"
        "import sys\n"
        "assert 'pystemd.systemd1' not in sys.modules\n"
        "print(lib.apply_signature(b'ss', [b'a.service', b'replace']) is not None,"
        " type(lib.DBusAddress(b'unix:path=/nonexistent', False)).__name__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert out == ["True", "DBusAddress"]
