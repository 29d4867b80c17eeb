"""Entry point of the frozen artifact (``bin/node-agent``).

The agent starts its systemd worker as ``sys.executable -m node_agent.systemd.worker``. Frozen,
``sys.executable`` is this program, not a Python interpreter, so ``-m`` is emulated here for the
agent's own modules only (nothing else can be run through the artifact).
"""

from __future__ import annotations

import runpy
import sys


def _main() -> int:
    if len(sys.argv) >= 3 and sys.argv[1] == "-m":
        module = sys.argv[2]
        if module != "node_agent" and not module.startswith("node_agent."):
            print(f"node-agent: -m {module}: only node_agent modules can be run", file=sys.stderr)
            return 2
        sys.argv = [sys.argv[0], *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    from node_agent.cli import main

    return main()


if __name__ == "__main__":
    raise SystemExit(_main())
