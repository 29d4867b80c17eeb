"""containerd on the node, derived from ``spec.criConfig``: its config.toml, registry mirrors
(``certs.d``), directories and the environment drop-in of ``containerd.service``."""

from node_agent.containerd.config import ContainerdConfigError, patch_config
from node_agent.containerd.expand import ContainerdExpander
from node_agent.containerd.registries import hosts_toml, probe_registry
from node_agent.containerd.spec import ContainerdCRI, containerd_cri

__all__ = [
    "ContainerdCRI",
    "ContainerdConfigError",
    "ContainerdExpander",
    "containerd_cri",
    "hosts_toml",
    "patch_config",
    "probe_registry",
]
