"""Resident memory the daemon's imports cost, attributed to the top-level package that runs them.

Run by ``bench.footprint`` in a separate interpreter (the repo's venv): it imports what
``node-agent run`` imports and prints one JSON object. Every module load (``create_module``, which
maps an extension's shared library, and ``exec_module``) is wrapped: the VmRSS growth while it runs,
minus what the imports nested in it grew, is that module's own growth, summed per top-level package
(``kubernetes_asyncio``, ``pydantic``, ``node_agent``...). Only stdlib is imported before the hook.

    .venv/bin/python bench/footprint_imports.py
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from typing import Any

PAGE = os.sysconf("SC_PAGE_SIZE")
#: What ``node-agent run`` imports before its loop starts (cli, then the agent it runs); aiohttp
#: is imported through ``load_aiohttp`` first, as ``run`` does.
DAEMON_MODULES = (
    "node_agent.cli",
    "node_agent.base.log",
    "node_agent.kube.lean",
    "node_agent.agent",
    "node_agent.kube.client",
)


def rss() -> int:
    with open("/proc/self/statm", "rb") as statm:
        return int(statm.read().split()[1]) * PAGE


class Tally:
    def __init__(self) -> None:
        self.own: dict[str, int] = {}
        self.modules: dict[str, int] = {}
        self.agent_modules: dict[str, int] = {}  # node_agent.* by module
        self.stack: list[int] = []  # growth of nested loads, per open frame

    def measure(self, name: str, call: Any, *args: Any) -> Any:
        top = name.split(".")[0]
        self.stack.append(0)
        before = rss()
        try:
            return call(*args)
        finally:
            grown = rss() - before
            nested = self.stack.pop()
            self.own[top] = self.own.get(top, 0) + grown - nested
            if top == "node_agent":
                self.agent_modules[name] = self.agent_modules.get(name, 0) + grown - nested
            self.modules[top] = self.modules.get(top, 0) + (call.__name__ == "exec_module")
            if self.stack:
                self.stack[-1] += grown


class MeasuredLoader(importlib.abc.Loader):
    def __init__(self, inner: Any, name: str, tally: Tally) -> None:
        self._inner = inner
        self._name = name
        self._tally = tally

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self._tally.measure(self._name, self._inner.create_module, spec)

    def exec_module(self, module: Any) -> None:
        self._tally.measure(self._name, self._inner.exec_module, module)

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)


class MeasuringFinder(importlib.abc.MetaPathFinder):
    def __init__(self, tally: Tally) -> None:
        self.tally = tally

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = MeasuredLoader(spec.loader, name, self.tally)
                return spec
        return None


def main() -> None:
    base_rss, base_modules = rss(), len(sys.modules)
    tally = Tally()
    sys.meta_path.insert(0, MeasuringFinder(tally))
    started = time.process_time()
    for name in DAEMON_MODULES:
        module = importlib.import_module(name)
        if name == "node_agent.kube.lean":
            module.load_aiohttp()
    cpu = time.process_time() - started
    print(
        json.dumps(
            {
                "base_rss": base_rss,
                "base_modules": base_modules,
                "rss": rss(),
                "modules": len(sys.modules),
                "cpu_s": cpu,
                "own": tally.own,
                "module_count": tally.modules,
                "agent_modules": tally.agent_modules,
            }
        )
    )


if __name__ == "__main__":
    main()
