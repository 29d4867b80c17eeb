"""kubernetes-asyncio's ``ApiClient`` without the package initialisers that import everything.

Why: ``from kubernetes_asyncio.client.api_client import ApiClient`` first runs
``kubernetes_asyncio/__init__.py`` and ``kubernetes_asyncio/client/__init__.py``, which import
every API class and every generated model — about 900 modules, a quarter of a second at each start
and tens of MiB that stay resident — although the agent talks to the API through
``ApiClient.call_api`` with ``_preload_content=False`` and never builds a model. Before the first
import, the two packages are registered from their specs without running their ``__init__``
(their submodules still load from the same files), and ``kubernetes_asyncio.client.models`` is an
empty module: ``ApiClient`` only looks into it to deserialize into models, which the agent never
asks for. If kubernetes-asyncio is already imported (a test process), nothing changes.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubernetes_asyncio.client.api_client import ApiClient
    from kubernetes_asyncio.client.configuration import Configuration

_PACKAGES = ("kubernetes_asyncio", "kubernetes_asyncio.client")
_MODELS = "kubernetes_asyncio.client.models"


def _register_bare(name: str) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"{name} is not an importable package")
    module = importlib.util.module_from_spec(spec)  # created, not executed
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)


def load() -> tuple[type[ApiClient], type[Configuration]]:
    """``ApiClient`` and ``Configuration``, importing as little of kubernetes-asyncio as works."""
    if "kubernetes_asyncio.client.api_client" not in sys.modules:
        for name in _PACKAGES:
            _register_bare(name)
        if _MODELS not in sys.modules:
            models = types.ModuleType(_MODELS, "not loaded: the agent never deserializes models")
            sys.modules[_MODELS] = models
            sys.modules["kubernetes_asyncio.client"].models = models  # type: ignore[attr-defined]
    from kubernetes_asyncio.client.api_client import ApiClient
    from kubernetes_asyncio.client.configuration import Configuration

    return ApiClient, Configuration
