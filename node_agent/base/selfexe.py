"""The agent's own executable, for self-update.

Shipped in an image, the agent is one file (``/opt/bin/gardener-node-agent``): a launcher that
unpacks the frozen bundle once into a cache directory and execs the bundle's bootloader there, so
``sys.executable`` is the unpacked bootloader, not the file that was installed. The launcher
tells the agent both: ``NODE_AGENT_EXECUTABLE`` (the single file) and ``NODE_AGENT_BUNDLE`` (the
unpacked directory). Both are trusted only when this process really is that bundle's bootloader,
so a value inherited by some other program is never taken for ours.
"""

from __future__ import annotations

import os
import sys


def own_executable() -> str | None:
    """Path of the single-file executable this agent was started from, or None when it was not
    started through the launcher (tarball install, venv, tests)."""
    executable = os.environ.get("NODE_AGENT_EXECUTABLE")
    bundle = os.environ.get("NODE_AGENT_BUNDLE")
    if not executable or not bundle or not getattr(sys, "frozen", False):
        return None
    if os.path.dirname(os.path.realpath(sys.executable)) != os.path.realpath(bundle):
        return None
    return executable


if __name__ == "__main__":  # `gardener-node-agent -m node_agent.base.selfexe`: what the agent sees
    print(own_executable() or "")
