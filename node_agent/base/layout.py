"""Where the agent keeps its own files on the node: one definition of every name.

Why a module of its own: the same names are needed by the layers that write these files
(``host.state``, ``bootstrap``), by the config defaults, and by OSC validation, which must refuse
an OperatingSystemConfig file that would overwrite them. This module imports nothing from the
agent, so any of them can use it without an import cycle. Every path is absolute and relative to
the ``--root`` prefix.
"""

from __future__ import annotations

# Upstream's directory for the agent's config, state and credentials (``config-<version>.yaml``,
# ``cluster-ca.crt``, ``machine-name`` ... live here too and are written by a real OSC).
BASE_DIR = "/var/lib/gardener-node-agent"
#: The standalone config file (``--config-dir`` picks ``config-<version>.yaml`` there first).
CONFIG_FILE = f"{BASE_DIR}/config.yaml"
CREDENTIALS_DIR = f"{BASE_DIR}/credentials"
KUBECONFIG_FILE = f"{CREDENTIALS_DIR}/kubeconfig"
TOKEN_FILE = f"{CREDENTIALS_DIR}/token"
BOOTSTRAP_TOKEN_FILE = f"{CREDENTIALS_DIR}/bootstrap-token"

# The kubelet's bootstrap kubeconfig (written by ``bootstrap`` from the bootstrap token; removed
# with the token once the first OSC is applied and the Node registered).
KUBELET_BOOTSTRAP_KUBECONFIG = "/var/lib/kubelet/kubeconfig-bootstrap"

# Where the single-file executable of the agent's image unpacks its bundle (one directory per
# content key; see packaging/launcher.c). ``reset`` removes it.
UNPACK_ROOT = "/var/cache/node-agent"

# containerd's files the agent derives from an OSC's criConfig: its config.toml, and its registry
# host configuration (one ``<upstream>/hosts.toml`` directory per registry).
CONTAINERD_BASE_DIR = "/etc/containerd"
CONTAINERD_CONFIG_FILE = f"{CONTAINERD_BASE_DIR}/config.toml"
CONTAINERD_CONF_DIR = f"{CONTAINERD_BASE_DIR}/conf.d"
CONTAINERD_CERTS_DIR = f"{CONTAINERD_BASE_DIR}/certs.d"

#: The unit types systemd knows, as the suffix of a unit's name (``kubelet.service``).
UNIT_TYPES = (
    "service",
    "socket",
    "timer",
    "mount",
    "automount",
    "path",
    "target",
    "slice",
    "scope",
    "swap",
    "device",
)

# Directory of the unit files and ``<unit>.d`` drop-in directories the agent writes.
UNIT_DIR = "/etc/systemd/system"

# The agent's persisted state, file names inside ``BASE_DIR``.
LAST_APPLIED_OSC = "last-applied-osc.yaml"
LAST_APPLIED_META = "last-applied-osc.meta.json"
CHANGES = "last-computed-osc-changes.yaml"
CHANGES_DONE = "last-computed-osc-changes.done.json"
INVENTORY = "inventory.json"
STATUS = "status.json"
# The health gate of an update in progress, or the verdict on a rolled-back OSC (quarantine).
HEALTH_GATE = "health-gate.json"
# The gate's last-known-good osc.yaml: a hard link to the last applied one as the update began.
HEALTH_GATE_PREVIOUS = "health-gate-previous-osc.yaml"
# The in-place parts of the update being applied (OS, kubelet, credentials), step by step.
IN_PLACE = "in-place-update.json"
# The last 50 applies, for ``node-agent status --history``.
HISTORY = "apply-history.json"
# The self-update guard (``host/selfupdate.py``): its script, the count of starts without a
# ready agent, the sha256 of the last binary that got ready, and the record of a fallback to the
# previous binary. The drop-in of the agent's unit that runs the script is SELF_UPDATE_DROP_IN.
SELF_UPDATE_GUARD = "self-update-guard.sh"
SELF_UPDATE_STARTS = "self-update-starts"
SELF_UPDATE_GOOD = "self-update-good"
SELF_UPDATE_FALLBACK = "self-update-fallback"
SELF_UPDATE_DROP_IN = "50-node-agent-self-update-guard.conf"
# A state document that cannot be read is moved aside to ``<name>.corrupt``.
CORRUPT_SUFFIX = ".corrupt"

STATE_FILES = (
    LAST_APPLIED_OSC,
    LAST_APPLIED_META,
    CHANGES,
    CHANGES_DONE,
    INVENTORY,
    STATUS,
    HEALTH_GATE,
    HEALTH_GATE_PREVIOUS,
    IN_PLACE,
    HISTORY,
    SELF_UPDATE_GUARD,
    SELF_UPDATE_STARTS,
    SELF_UPDATE_GOOD,
    SELF_UPDATE_FALLBACK,
)
CREDENTIAL_FILES = (KUBECONFIG_FILE, TOKEN_FILE, BOOTSTRAP_TOKEN_FILE)

# Paths no OSC file may take: the state files, their ``.corrupt`` siblings and the credentials.
# An OSC writing one of them would corrupt what the agent knows it created, or lock it out.
RESERVED_FILES = frozenset(
    [f"{BASE_DIR}/{name}" for name in STATE_FILES]
    + [f"{BASE_DIR}/{name}{CORRUPT_SUFFIX}" for name in STATE_FILES]
    + list(CREDENTIAL_FILES)
)
# Directories holding reserved files: an OSC file there would have to replace the directory.
RESERVED_DIRS = frozenset({BASE_DIR, CREDENTIALS_DIR})

# The agent's own unit: restarted last, after everything else of an apply.
AGENT_UNIT = "gardener-node-agent.service"


def unit_path(unit: str) -> str:
    """The unit file of ``unit``."""
    return f"{UNIT_DIR}/{unit}"


def drop_in_dir(unit: str) -> str:
    """The directory of ``unit``'s drop-ins."""
    return f"{UNIT_DIR}/{unit}.d"


def drop_in_path(unit: str, name: str) -> str:
    """The drop-in file ``name`` of ``unit``."""
    return f"{drop_in_dir(unit)}/{name}"
