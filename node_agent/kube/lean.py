"""kubernetes-asyncio's ``ApiClient`` without the package initialisers that import everything;
aiohttp without the system trust store it loads on import.

Why: ``from kubernetes_asyncio.client.api_client import ApiClient`` first runs
``kubernetes_asyncio/__init__.py`` and ``kubernetes_asyncio/client/__init__.py``, which import
every API class and every generated model — about 900 modules, a quarter of a second at each start
and tens of MiB that stay resident — although the agent talks to the API through
``ApiClient.call_api`` with ``_preload_content=False`` and never builds a model. Before the first
import, the two packages are registered from their specs without running their ``__init__``
(their submodules still load from the same files), and ``kubernetes_asyncio.client.models`` is an
empty module: ``ApiClient`` only looks into it to deserialize into models, which the agent never
asks for. ``urllib3``, which ``Configuration`` imports for its basic-auth helper alone (the agent
authenticates by token or client certificate), is registered as a lazy module: it loads on first
use, if ever. If kubernetes-asyncio is already imported (a test process), nothing changes.

``aiohttp.connector`` builds two default TLS contexts when it is imported, and both read and
parse the system's whole CA bundle (the verifying one through ``load_default_certs``, the
non-verifying one by calling ``set_default_verify_paths`` itself): tens of milliseconds of CPU
each, at every start. The agent never uses them: the Kubernetes client makes its TLS context from
the kubeconfig's CA, the registry probes make their own, the health checks speak plain HTTP to
localhost. ``load_aiohttp`` imports aiohttp with both default contexts left without trust
anchors, so a connection that relied on the verifying one fails verification rather than going
unverified (the other one verifies nothing, with or without anchors).
"""

from __future__ import annotations

import importlib
import importlib.util
import ssl
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kubernetes_asyncio.client.api_client import ApiClient
    from kubernetes_asyncio.client.configuration import Configuration

_PACKAGES = ("kubernetes_asyncio", "kubernetes_asyncio.client")
_MODELS = "kubernetes_asyncio.client.models"
#: imported by the client's modules, used only on paths the agent never takes
_LAZY = ("urllib3",)


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


class _OnFirstUse(types.ModuleType):
    """Stands in for a module until one of its attributes is used, then imports it for real.

    Not ``importlib.util.LazyLoader``: on Python 3.11 a plain ``import`` of a lazy module already
    touches its ``__spec__``, which loads it."""

    def __getattr__(self, attr: str) -> object:
        # Any attribute not set on the stand-in, ``__path__`` of a submodule import included.
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return getattr(importlib.import_module(self.__name__), attr)


def _register_lazy(name: str) -> None:
    """``name`` in ``sys.modules`` as a stand-in that imports it on first use."""
    if name not in sys.modules and importlib.util.find_spec(name) is not None:
        sys.modules[name] = _OnFirstUse(name, "imported on first use (node_agent.kube.lean)")


def load() -> tuple[type[ApiClient], type[Configuration]]:
    """``ApiClient`` and ``Configuration``, importing as little of kubernetes-asyncio as works."""
    if "kubernetes_asyncio.client.api_client" not in sys.modules:
        for name in _PACKAGES:
            _register_bare(name)
        if _MODELS not in sys.modules:
            models = types.ModuleType(_MODELS, "not loaded: the agent never deserializes models")
            sys.modules[_MODELS] = models
            sys.modules["kubernetes_asyncio.client"].models = models  # type: ignore[attr-defined]
        for name in _LAZY:
            _register_lazy(name)
    from kubernetes_asyncio.client.api_client import ApiClient
    from kubernetes_asyncio.client.configuration import Configuration

    return ApiClient, Configuration


def load_aiohttp() -> None:
    """Import aiohttp, skipping the system trust store for its default TLS context (see the
    module). Call before anything else imports aiohttp; if something did, nothing changes."""
    if "aiohttp" in sys.modules:
        return
    real = ssl.SSLContext.set_default_verify_paths

    def without_trust_store(self: ssl.SSLContext) -> None:
        del self

    # Where both contexts load the trust store (``load_default_certs`` calls it, on Linux).
    ssl.SSLContext.set_default_verify_paths = without_trust_store  # type: ignore[method-assign]
    try:
        importlib.import_module("aiohttp")
    finally:
        ssl.SSLContext.set_default_verify_paths = real  # type: ignore[method-assign]
