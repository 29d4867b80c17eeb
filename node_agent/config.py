"""Settings: Gardener's ``NodeAgentConfiguration`` as shipped in user-data, plus our own knobs.

The component config is read unchanged from what Gardener writes (camelCase, Go durations,
unknown fields ignored so a newer Gardener does not break an older agent). Defaults follow
upstream's defaulting. Settings that Gardener has no field for (paths, the agent's own unit
name, timeouts) live in ``AgentSettings``, each with its default documented next to it.
"""

from __future__ import annotations

import os
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)
from pydantic_core import PydanticUseDefault

from node_agent.base.durations import format_duration, parse_duration
from node_agent.base.errors import ConfigError
from node_agent.base.layout import AGENT_UNIT
from node_agent.base.layout import BASE_DIR as BASE_DIR
from node_agent.base.layout import BOOTSTRAP_TOKEN_FILE as BOOTSTRAP_TOKEN_FILE
from node_agent.base.layout import CREDENTIALS_DIR as CREDENTIALS_DIR
from node_agent.base.layout import KUBECONFIG_FILE as KUBECONFIG_FILE
from node_agent.base.layout import TOKEN_FILE as TOKEN_FILE

API_VERSION = "nodeagent.config.gardener.cloud/v1alpha1"
KIND = "NodeAgentConfiguration"

# Upstream's on-disk layout; every path is relative to the --root prefix. The agent's own
# directory and credentials are defined in node_agent.base.layout (re-exported above).
CLUSTER_CA_FILE = f"{BASE_DIR}/cluster-ca.crt"
MACHINE_NAME_FILE = f"{BASE_DIR}/machine-name"
ZONE_FILE = f"{BASE_DIR}/zone"
CONFIG_FILE = f"{BASE_DIR}/config.yaml"

Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


def _zero_is_unset(value: object) -> object:
    """Gardener's encoder writes Go zero values for fields it does not set (``kubeconfig: ""``,
    ``qps: 0``, ``logLevel: ""``); upstream's defaulting treats them as unset, so do we."""
    if value == "" or (value == 0 and not isinstance(value, bool)):
        raise PydanticUseDefault()
    return value


#: a field whose zero value ("" or 0) takes the default, as upstream's SetDefaults_* do
ZeroIsUnset = BeforeValidator(_zero_is_unset)


class _Config(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A null field is an absent one: Go decodes null into a struct, slice, map or pointer
        as its zero value, and upstream's defaulting then fills it in."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class ClientConnection(_Config):
    kubeconfig: Annotated[str, ZeroIsUnset] = Field(
        default=KUBECONFIG_FILE, description="kubeconfig of the agent"
    )
    qps: Annotated[float, ZeroIsUnset] = 50.0
    burst: Annotated[int, ZeroIsUnset] = 100


class ServerEndpoint(_Config):
    bind_address: str = Field(default="", alias="bindAddress", description="'' = all addresses")
    port: int


class HealthProbesEndpoint(ServerEndpoint):
    port: Annotated[int, ZeroIsUnset] = 2751


class MetricsEndpoint(ServerEndpoint):
    port: Annotated[int, ZeroIsUnset] = 2752


class ServerConfiguration(_Config):
    health_probes: HealthProbesEndpoint = Field(
        default=HealthProbesEndpoint(), alias="healthProbes", description="/healthz, /readyz"
    )
    metrics: MetricsEndpoint = Field(default=MetricsEndpoint(), description="Prometheus metrics")


class APIServer(_Config):
    server: str = ""
    #: upstream leaves an empty caFile empty; Gardener always writes the cluster CA's path, which
    #: is also what we take for "" (an empty host path would stop the agent)
    ca_file: Annotated[str, ZeroIsUnset] = Field(default=CLUSTER_CA_FILE, alias="caFile")


class BootstrapConfiguration(_Config):
    kubelet_data_volume_size: int | None = Field(default=None, alias="kubeletDataVolumeSize")


class OSCControllerConfig(_Config):
    sync_period: Duration = Field(
        default=timedelta(minutes=10),
        alias="syncPeriod",
        description="full re-check of the OSC and the disk even without events (min 15s)",
    )
    secret_name: str = Field(default="", alias="secretName")
    kubernetes_version: str | None = Field(default=None, alias="kubernetesVersion")


class TokenSyncConfig(_Config):
    secret_name: str = Field(alias="secretName")
    path: str


class TokenControllerConfig(_Config):
    sync_configs: tuple[TokenSyncConfig, ...] = Field(default=(), alias="syncConfigs")
    sync_period: Duration = Field(default=timedelta(hours=1), alias="syncPeriod")


class SystemdUnitCheckConfig(_Config):
    sync_period: Duration = Field(default=timedelta(minutes=1), alias="syncPeriod")
    stuck_threshold: Duration = Field(default=timedelta(minutes=5), alias="stuckThreshold")


class ControllerConfiguration(_Config):
    operating_system_config: OSCControllerConfig = Field(
        default=OSCControllerConfig(), alias="operatingSystemConfig"
    )
    token: TokenControllerConfig = TokenControllerConfig()
    systemd_unit_check: SystemdUnitCheckConfig = Field(
        default=SystemdUnitCheckConfig(), alias="systemdUnitCheck"
    )


class HealthGateConfig(_Config):
    """The health-gated apply (our extension): units an apply restarted are watched for
    ``settleWindow``; one that was healthy before and breaks rolls the node back."""

    enabled: bool = True
    settle_window: Duration = Field(default=timedelta(seconds=30), alias="settleWindow")


class RestartGuardConfig(_Config):
    """The restart-storm guard (our extension): a unit the agent restarted ``maxRestarts``
    times within ``window`` and that keeps failing is left alone until the OSC changes or it
    comes up by itself."""

    max_restarts: int = Field(default=3, alias="maxRestarts", ge=1)
    window: Duration = Field(default=timedelta(minutes=10))


class HealthCheckConfig(_Config):
    """Health checks of kubelet and containerd (our extension; upstream hard-codes them)."""

    enabled: bool = True
    #: kubelet's /healthz URL; empty: the address kubelet serves it on, from the flags of the
    #: OSC's kubelet unit and its config file (``--config``), else http://127.0.0.1:10248/healthz
    kubelet_healthz: str = Field(default="", alias="kubeletHealthz")
    containerd_socket: str = Field(
        default="/run/containerd/containerd.sock", alias="containerdSocket"
    )
    sync_period: Duration = Field(default=timedelta(seconds=20), alias="syncPeriod")
    timeout: Duration = Field(default=timedelta(seconds=10))
    restart_after: Duration = Field(default=timedelta(minutes=1), alias="restartAfter")


class ImagesConfig(_Config):
    """Files from container images (imageRef): ``pullTimeout`` bounds one image's pull, after
    which its files fail (naming the image) and the units that use them are not restarted;
    nothing else of an OSC waits for a pull."""

    pull_timeout: Duration = Field(
        default=timedelta(minutes=5), alias="pullTimeout", gt=timedelta(0)
    )


class RolloutConfig(_Config):
    """Rollout coordination of the pool (serial mode, paced rollout): what the Secret's
    annotations do not carry. ``serialLeaseDuration`` is Gardener's fixed 600 s; change it only
    in tests. A node that has to wait checks again after a random time between ``recheckMin``
    and ``recheckMax`` (and at once when the Secret changes)."""

    serial_lease_duration: Duration = Field(
        default=timedelta(seconds=600), alias="serialLeaseDuration"
    )
    recheck_min: Duration = Field(default=timedelta(seconds=5), alias="recheckMin")
    recheck_max: Duration = Field(default=timedelta(seconds=15), alias="recheckMax")


class NodeAgentExtensions(_Config):
    """Settings of this agent beyond Gardener's config, under the top-level key ``nodeAgent``
    of the same file (Gardener's agent ignores unknown keys, so the file stays valid for it).
    Every field has a safe default; the whole section may be absent."""

    health_gate: HealthGateConfig = Field(default=HealthGateConfig(), alias="healthGate")
    restart_guard: RestartGuardConfig = Field(default=RestartGuardConfig(), alias="restartGuard")
    health_check: HealthCheckConfig = Field(default=HealthCheckConfig(), alias="healthCheck")
    rollout: RolloutConfig = RolloutConfig()
    images: ImagesConfig = ImagesConfig()

    def dump(self) -> dict[str, Any]:
        """camelCase with Go durations, as the file carries it."""
        data: dict[str, Any] = _go_durations(self.model_dump(by_alias=True, mode="python"))
        return data


def _go_durations(value: Any) -> Any:
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, dict):
        return {k: _go_durations(v) for k, v in value.items()}
    return value


class NodeAgentConfiguration(_Config):
    """Gardener's component config, ``nodeagent.config.gardener.cloud/v1alpha1``."""

    api_version: str = Field(default=API_VERSION, alias="apiVersion")
    kind: str = KIND
    client_connection: ClientConnection = Field(
        default=ClientConnection(), alias="clientConnection"
    )
    log_level: Annotated[str, ZeroIsUnset] = Field(default="info", alias="logLevel")
    log_format: Annotated[str, ZeroIsUnset] = Field(default="json", alias="logFormat")
    server: ServerConfiguration = ServerConfiguration()
    feature_gates: dict[str, bool] = Field(default_factory=dict, alias="featureGates")
    api_server: APIServer = Field(default=APIServer(), alias="apiServer")
    bootstrap: BootstrapConfiguration | None = None
    controllers: ControllerConfiguration = ControllerConfiguration()
    #: this agent's own settings (not Gardener's); see NodeAgentExtensions
    node_agent: NodeAgentExtensions = Field(default=NodeAgentExtensions(), alias="nodeAgent")

    def dump(self) -> dict[str, Any]:
        """The config as Gardener would write it (camelCase, Go durations)."""
        data: dict[str, Any] = self.model_dump(by_alias=True, mode="json", exclude_none=True)
        controllers = data["controllers"]
        osc = self.controllers.operating_system_config
        controllers["operatingSystemConfig"]["syncPeriod"] = format_duration(osc.sync_period)
        controllers["token"]["syncPeriod"] = format_duration(self.controllers.token.sync_period)
        check = self.controllers.systemd_unit_check
        controllers["systemdUnitCheck"] = {
            "syncPeriod": format_duration(check.sync_period),
            "stuckThreshold": format_duration(check.stuck_threshold),
        }
        if self.node_agent == NodeAgentExtensions():
            data.pop("nodeAgent", None)  # as Gardener writes it: without our section
        else:
            data["nodeAgent"] = self.node_agent.dump()
        return data

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.dump(), sort_keys=False)


MIN_OSC_SYNC_PERIOD = timedelta(seconds=15)


def parse_config(raw: bytes | str, *, source: str = "config") -> NodeAgentConfiguration:
    """Parse and check a NodeAgentConfiguration; errors name the file and field."""
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping, got {type(data).__name__}")
    if data.get("apiVersion", API_VERSION) != API_VERSION or data.get("kind", KIND) != KIND:
        raise ConfigError(
            f"{source}: expected apiVersion {API_VERSION} kind {KIND}, "
            f"got {data.get('apiVersion')!r} {data.get('kind')!r}"
        )
    try:
        config = NodeAgentConfiguration.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{source}: {where}: {first['msg']}") from exc
    osc = config.controllers.operating_system_config
    if osc.sync_period < MIN_OSC_SYNC_PERIOD:
        raise ConfigError(
            f"{source}: controllers.operatingSystemConfig.syncPeriod must be at least 15s, "
            f"got {format_duration(osc.sync_period)}"
        )
    return config


def load_config(path: Path) -> NodeAgentConfiguration:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from exc
    return parse_config(raw, source=str(path))


_VERSIONED_CONFIG = re.compile(
    r"config-v?(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z.-]+))?(?:\+[0-9A-Za-z.-]+)?\.yaml"
)


def _prerelease_key(text: str | None) -> tuple[int, tuple[tuple[int, int, str], ...]]:
    """Semver precedence of a prerelease: a release sorts after all of its prereleases; numeric
    identifiers compare as numbers and sort before alphanumeric ones."""
    if text is None:
        return (1, ())
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in text.split("."))
    return (0, parts)


def config_version_key(name: str) -> tuple[Any, ...] | None:
    """Sort key of ``config-<version>.yaml`` by semantic version; None for any other name."""
    match = _VERSIONED_CONFIG.fullmatch(name)
    if match is None:
        return None
    major, minor, patch, pre = match.groups()
    return (int(major), int(minor), int(patch), _prerelease_key(pre))


def find_config(config_dir: Path) -> Path:
    """The agent's config in ``config_dir`` (upstream's ``--config-dir``).

    Gardener writes ``config-<gardener version>.yaml``; upstream's binary reads the one named
    after its own version. We carry no Gardener version, so during an upgrade (the new file
    written, the old one not yet deleted) the highest semantic version wins, never a lexical
    sort. Only regular files count (a symlink is not followed: nothing planted there decides
    which config runs). Without any versioned file, the standalone ``config.yaml``.
    """
    try:
        with os.scandir(config_dir) as entries:
            found = [(e.name, e.is_file(follow_symlinks=False), e.is_file()) for e in entries]
    except OSError as exc:
        raise ConfigError(f"cannot read config dir {config_dir}: {exc.strerror}") from exc
    names = [name for name, _regular, is_file in found if is_file]
    regular = [name for name, is_regular, _ in found if is_regular]
    keyed = [(key, name) for name in regular if (key := config_version_key(name)) is not None]
    if keyed:
        return config_dir / max(keyed)[1]
    if "config.yaml" in names:
        return config_dir / "config.yaml"
    raise ConfigError(f"no config-<version>.yaml or config.yaml in {config_dir}")


class AgentSettings(_Config):
    """Knobs of this agent that Gardener's config has no field for. Defaults suit a real node."""

    root: Path = Field(default=Path("/"), description="prefix for every host path (--root)")
    config_file: str = Field(default=CONFIG_FILE, description="NodeAgentConfiguration path")
    agent_unit: str = Field(
        default=AGENT_UNIT,
        description="the agent's own systemd unit: restarted last, never stopped or removed",
    )
    status_socket: str = Field(
        default="/run/gardener-node-agent/status.sock",
        description="unix socket (0600) that `node-agent status` talks to",
    )
    request_timeout: float = Field(default=15.0, description="seconds per API request")
    systemd_job_timeout: float = Field(
        default=60.0, description="seconds to wait for one start/stop/restart job"
    )
