"""``node-agent bootstrap``: turn a freshly installed artifact into the running agent service.

Run by the user-data init script (``init/node-agent-init.sh``) on first boot and on every boot
after, so every step is idempotent and a re-run must never undo what the running agent did:

1. **Config.** The NodeAgentConfiguration from user-data is validated. If it was shipped somewhere
   else than the agent's config path, it seeds that path *only if the path is absent or does not
   parse*: once the agent runs, the OSC owns the config (Gardener ships it as an OSC file, and the
   agent rewrites it itself, e.g. on a secret-name label), so stale user-data never wins.
2. **Kubelet bootstrap kubeconfig.** With a bootstrap token present and the kubelet not yet
   holding a client certificate, ``/var/lib/kubelet/kubeconfig-bootstrap`` is written the way
   upstream writes it (server from ``apiServer.server``, CA file from ``apiServer.caFile``, token
   user), byte-identical on a re-run.
3. **Unit.** The unit shipped in the artifact (``systemd/node-agent.service``) is written to
   ``/etc/systemd/system/<agent unit>``; the name is ``AgentSettings.agent_unit``
   (``gardener-node-agent.service``), the name Gardener's OSC uses for the agent. Unchanged bytes
   are not rewritten (mtime kept).
4. **systemd.** daemon-reload only when the unit changed or systemd has not loaded it; enable if
   not enabled; start if not running; restart only if the unit file changed or the running agent
   is another installed version than ``/opt/node-agent/current`` (an upgrade by the init script).
   A running agent with an unchanged unit is left alone. Finally the init unit
   (``gardener-node-init.service``) is disabled if it is enabled, as upstream does.

With ``bootstrap.kubeletDataVolumeSize`` set, the kubelet's data volume is formatted and mounted
on ``/var/lib/kubelet`` before step 3 (``data_volume``). When that fails (no blank disk of that
size, or several), the error is logged and reported and every other step still runs, so the agent
comes up and the node can report; the command then exits non-zero, so the init unit shows the
failure (and Gardener's, which restarts on failure, looks again for a disk attached late).

Last-applied state and everything else the agent keeps are never touched.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import node_agent
from node_agent.base.configfile import MAX_CONFIG_BYTES, read_config_file
from node_agent.base.digest import sha256_hex
from node_agent.base.errors import ConfigError, HostError, NodeAgentError, UnsafePathError
from node_agent.base.layout import KUBELET_BOOTSTRAP_KUBECONFIG
from node_agent.base.log import get_logger
from node_agent.config import (
    BASE_DIR,
    BOOTSTRAP_TOKEN_FILE,
    AgentSettings,
    NodeAgentConfiguration,
    parse_config,
)
from node_agent.host.data_volume import (
    QUOTA_ENV,
    Commands,
    DataVolumeError,
    HostCommands,
    ensure_kubelet_data_volume,
)
from node_agent.host.documents import Claim
from node_agent.host.fs import HostFS, WriteResult
from node_agent.host.state import UNIT_DIR, StateStore
from node_agent.systemd import JobAction, SystemdSeam

log = get_logger("node-agent.bootstrap")

INIT_UNIT = "gardener-node-init.service"
TEMP_DIR = f"{BASE_DIR}/tmp"
#: Where the init script installs versions; ``current`` is the active one.
INSTALL_DIR = "/opt/node-agent"
CURRENT_BINARY = f"{INSTALL_DIR}/current/bin/node-agent"
KUBELET_DIR = "/var/lib/kubelet"
KUBELET_KUBECONFIG = f"{KUBELET_DIR}/kubeconfig-real"
KUBELET_CLIENT_CERT = f"{KUBELET_DIR}/pki/kubelet-client-current.pem"
UNIT_FILE_NAME = "node-agent.service"
#: Seconds to wait for the agent's start job (Type=notify: until it sent READY=1).
START_TIMEOUT = 90.0


class BootstrapError(NodeAgentError):
    """Bootstrapping the agent service failed; the message says which step and why."""


@dataclass
class BootstrapReport:
    """What one bootstrap run did; ``changed`` is empty when it changed nothing."""

    unit: str
    config: str = "unchanged"
    kubelet_kubeconfig: str = "not needed"
    service: str = "already running"
    init_unit: str = "absent"
    main_pid: int | None = None
    data_volume: str = "not configured"
    changed: list[str] = field(default_factory=list)
    #: Steps that failed while the others were done (the command exits non-zero).
    errors: list[NodeAgentError] = field(default_factory=list)

    def summary(self) -> str:
        pid = f" (pid {self.main_pid})" if self.main_pid else ""
        volume = (
            f"kubelet data volume {self.data_volume}; "
            if self.data_volume != "not configured"
            else ""
        )
        return (
            f"bootstrap: {self.unit} {self.service}{pid}; config {self.config}; "
            f"kubelet bootstrap kubeconfig {self.kubelet_kubeconfig}; "
            f"{volume}{INIT_UNIT} {self.init_unit}"
        )


def unit_template(exec_start: str | None = None) -> bytes:
    """The agent's unit as shipped: next to the package in the artifact, else in the source tree.

    ``exec_start`` replaces its ``ExecStart=`` line: installed the Gardener way (one file run
    with ``--config-dir``), the unit runs that file with that directory, as upstream's does."""
    package = Path(node_agent.__file__).resolve().parent
    for candidate in (package / UNIT_FILE_NAME, package.parent / "systemd" / UNIT_FILE_NAME):
        try:
            shipped = candidate.read_bytes()
        except FileNotFoundError:
            continue
        if exec_start is None:
            return shipped
        lines = [
            f"ExecStart={exec_start}" if line.startswith("ExecStart=") else line
            for line in shipped.decode().splitlines()
        ]
        return ("\n".join(lines) + "\n").encode()
    raise BootstrapError(f"the agent's unit file {UNIT_FILE_NAME} is missing from this build")


def kubelet_bootstrap_kubeconfig(
    server: str, ca_file: str, token: str, *, ca_data: bytes | None = None
) -> bytes:
    """The kubeconfig the kubelet uses to request its client certificate (upstream's shape;
    the CA inline for a release that gives the bundle itself, see ``cluster_ca``)."""
    from node_agent.kube.certificates import cluster_ca

    if not server.startswith("https://"):
        server = "https://" + server
    name = "kubelet-bootstrap"
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": {"server": server, **cluster_ca(ca_file, ca_data)}}],
        "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        "current-context": name,
        "preferences": {},
        "users": [{"name": name, "user": {"token": token.strip()}}],
    }
    return yaml.safe_dump(doc, sort_keys=False).encode()


def load_user_data_config(path: Path) -> tuple[bytes, NodeAgentConfiguration]:
    """Read and validate the config shipped in user-data (like ``--config`` of every command, a
    plain path, not one below ``--root``), bounded as every config is read
    (:func:`~node_agent.base.configfile.read_config_file`: a FIFO would block for ever)."""
    raw = read_config_file(path)
    return raw, parse_config(raw, source=str(path))


def seed_config(fs: HostFS, settings: AgentSettings, source: Path, raw: bytes) -> str:
    """Copy the user-data config to the agent's config path unless a valid one is there.

    The agent's copy is read as ``run`` reads a config: one larger than ``MAX_CONFIG_BYTES``
    would be refused there, so it is replaced like one that does not parse."""
    target = settings.config_file
    if os.path.normpath(source) == os.path.normpath(settings.root / target.lstrip("/")):
        return "in place"
    try:
        existing = fs.read(target, limit=MAX_CONFIG_BYTES)
        if existing is not None:
            parse_config(existing, source=target)
    except ConfigError as exc:
        log.warning("replacing an unreadable config with the user-data one", error=str(exc))
    except UnsafePathError as exc:
        st = fs.lstat(target)
        if st is None or not stat.S_ISREG(st.st_mode):
            raise  # a symlink, FIFO or directory there is refused, never replaced
        log.warning("replacing an unreadable config with the user-data one", error=str(exc))
    else:
        if existing is not None:
            return "kept (the agent's copy wins over user-data)"
    fs.write_atomic(target, raw, 0o600, dir_mode=0o755)
    return "written"


def write_kubelet_bootstrap_kubeconfig(fs: HostFS, config: NodeAgentConfiguration) -> str:
    """Upstream's rule: only with a bootstrap token and while the kubelet has no credentials."""
    token = fs.read(BOOTSTRAP_TOKEN_FILE)
    if token is None:
        return "not needed (no bootstrap token)"
    if fs.exists(KUBELET_KUBECONFIG) or fs.exists(KUBELET_CLIENT_CERT):
        return "not needed (kubelet has credentials)"
    if not config.api_server.server:
        raise ConfigError("apiServer.server is empty; the kubelet bootstrap kubeconfig needs it")
    data = kubelet_bootstrap_kubeconfig(
        config.api_server.server,
        config.api_server.ca_file,
        token.decode(errors="replace"),
        ca_data=config.api_server.ca_bundle,
    )
    result = fs.write_atomic(KUBELET_BOOTSTRAP_KUBECONFIG, data, 0o600, dir_mode=0o755)
    return "written" if result else "unchanged"


def _running_other_version(root: Path, main_pid: int | None) -> bool:
    """Whether the running agent is an installed artifact other than ``current`` (an upgrade).

    Only artifacts under INSTALL_DIR count (a unit pointed elsewhere is someone's choice), and
    only on the real root: below ``--root`` the host's /proc says nothing about that tree."""
    if not main_pid or root != Path("/"):
        return False
    try:
        running = os.readlink(f"/proc/{main_pid}/exe")
        current = os.path.realpath(CURRENT_BINARY)
    except OSError:
        return False
    return running.startswith(INSTALL_DIR + "/") and running != current


async def bootstrap(
    settings: AgentSettings,
    config_path: Path,
    systemd: SystemdSeam,
    *,
    exec_start: str | None = None,
    commands: Commands | None = None,
) -> BootstrapReport:
    """Install, enable and start the agent's unit; see the module docstring for the rules.

    ``commands`` runs mkfs, mount and the like for the kubelet data volume (the host's)."""
    fs = HostFS(settings.root, follow_system_symlinks=True)
    unit = settings.agent_unit
    report = BootstrapReport(unit=unit)
    try:
        raw, config = load_user_data_config(config_path)
        report.config = seed_config(fs, settings, config_path, raw)
        fs.ensure_dir(TEMP_DIR, 0o700)
        report.kubelet_kubeconfig = write_kubelet_bootstrap_kubeconfig(fs, config)
    except HostError as exc:
        raise BootstrapError(f"writing files: {exc}") from exc
    size = config.bootstrap.kubelet_data_volume_size if config.bootstrap else None
    if size:  # Gardener sets it only for a worker with a kubelet data volume, never to 0
        quota = os.environ.get(QUOTA_ENV, "").lower() not in ("off", "false", "0")
        await _data_volume(report, size, fs, systemd, commands or HostCommands(), quota=quota)
    try:
        unit_file = f"{UNIT_DIR}/{unit}"
        unit_text = unit_template(exec_start)
        # The agent installs itself: a unit file it creates is its own, for `reset` to remove.
        StateStore(fs).claim(
            [Claim("unit", unit_file, sha256_hex(unit_text), 0o644, by="bootstrap")]
        )
        written = fs.write_atomic(unit_file, unit_text, 0o644)
    except HostError as exc:
        raise BootstrapError(f"writing files: {exc}") from exc
    report.changed += [
        what
        for what, status in (
            ("config", report.config),
            ("kubelet bootstrap kubeconfig", report.kubelet_kubeconfig),
        )
        if status == "written"
    ]
    if written:
        report.changed.append("unit file")

    state = (await systemd.unit_states([unit]))[unit]
    if written or state.load_state != "loaded" or state.fragment_path != f"{UNIT_DIR}/{unit}":
        await systemd.daemon_reload()
        report.changed.append("daemon-reload")
        state = (await systemd.unit_states([unit]))[unit]
    if state.load_state != "loaded":
        raise BootstrapError(f"systemd cannot load {unit}: load state {state.load_state}")
    if state.unit_file_state != "enabled":
        await systemd.enable([unit])
        report.changed.append("enabled")

    action: JobAction | None = None
    if state.active_state not in ("active", "reloading"):
        action = "start"
    elif (written and written != WriteResult.ATTRS_CHANGED) or _running_other_version(
        settings.root, state.main_pid
    ):
        action = "restart"  # new unit content, or the init script switched versions
    if action is not None:
        result = (await systemd.run_jobs([(unit, action)], job_timeout=START_TIMEOUT))[unit]
        if not result.ok:
            raise BootstrapError(f"{result.describe()}; see `journalctl -u {unit}`")
        report.service = "started" if action == "start" else "restarted"
        report.changed.append(report.service)
        state = (await systemd.unit_states([unit]))[unit]
    report.main_pid = state.main_pid

    init = (await systemd.unit_states([INIT_UNIT]))[INIT_UNIT]
    if init.exists:
        report.init_unit = "already disabled"
        if init.unit_file_state == "enabled":
            await systemd.disable([INIT_UNIT])
            report.init_unit = "disabled"
            report.changed.append("init unit disabled")
    return report


async def _data_volume(
    report: BootstrapReport,
    size: int,
    fs: HostFS,
    systemd: SystemdSeam,
    commands: Commands,
    *,
    quota: bool,
) -> None:
    """Set up the kubelet data volume; a failure is reported, the bootstrap goes on."""
    try:
        result = await ensure_kubelet_data_volume(size, fs, systemd, commands, quota=quota)
    except (DataVolumeError, HostError) as exc:
        error = exc if isinstance(exc, DataVolumeError) else DataVolumeError(str(exc))
        log.error("kubelet data volume not set up", size=size, error=str(error))
        report.data_volume = "FAILED"
        report.errors.append(error)
        return
    report.data_volume = f"{result.state} ({result.device})"
    report.changed += result.changed


async def run_bootstrap(
    root: Path,
    config: str | None,
    *,
    systemd_address: str | None = None,
    exec_start: str | None = None,
) -> BootstrapReport:
    """The ``bootstrap`` command; ``config`` defaults to the agent's config path under ``root``;
    ``exec_start`` is the unit's command when it is not the shipped one."""
    from node_agent.systemd import Systemd

    settings = AgentSettings(root=root)
    config_path = Path(config) if config else root / settings.config_file.lstrip("/")
    systemd = Systemd(systemd_address)
    await systemd.start()
    try:
        report = await bootstrap(settings, config_path, systemd, exec_start=exec_start)
    finally:
        await systemd.close()
    log.info("bootstrap done", changed=report.changed or "nothing", unit=report.unit)
    return report
