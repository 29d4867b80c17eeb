"""containerd's configuration as items of the OSC (the applier's ``expand``/``prepare`` seam).

The derived items are ordinary files and a unit, so the planner diffs, journals, writes
atomically, restarts and deletes them like the OSC's own: ``config.toml`` is in
``containerd.service``'s ``filePaths`` (a real change restarts containerd, nothing else does);
a registry's ``hosts.toml`` is read by containerd per pull (no restart) and is deleted by the
planner when the registry leaves the OSC (only files the agent wrote are ever deleted).

A derived file that cannot be made (config.toml that is not TOML or not a regular file, a
registry whose CA file cannot be read) is one failed item (``failed``): it is left out of the
expansion, and the applier keeps what is on disk for it and reports it, while everything else
of the OSC is applied.
"""

from __future__ import annotations

import base64
import subprocess
from collections.abc import Callable

from node_agent.base import layout
from node_agent.base.errors import ContainerdConfigError, HostError
from node_agent.base.log import get_logger
from node_agent.containerd.registries import (
    hosts_toml,
    hosts_toml_path,
    probe_registry,
    registry_dir,
)
from node_agent.containerd.spec import ContainerdCRI, RegistryConfig, containerd_cri
from node_agent.host.fs import HostFS
from node_agent.osc.models import (
    DropIn,
    File,
    FileContent,
    InlineContent,
    OperatingSystemConfig,
    Unit,
)

log = get_logger("node-agent.containerd")

CONFIG_FILE = layout.CONTAINERD_CONFIG_FILE
UNIT = "containerd.service"
RUNTIME_BIN_DIR = "/var/bin/containerruntimes"
ENV_DROP_IN = "30-env_config.conf"
# systemd's PATH for system services. Upstream appends its own process's PATH instead, which
# makes the drop-in depend on how the agent was started; a constant keeps it stable.
SERVICE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DIRECTORIES = (
    RUNTIME_BIN_DIR,
    layout.CONTAINERD_BASE_DIR,
    layout.CONTAINERD_CONF_DIR,
    layout.CONTAINERD_CERTS_DIR,
)
FILE_MODE = 0o644
DIR_MODE = 0o755
# Written when ``containerd config default`` cannot run: containerd 1.x reads it as is, 2.x
# migrates it; the patch adds every key the node needs.
FALLBACK_CONFIG = b"version = 2\n"

Probe = Callable[[RegistryConfig, Callable[[str], bytes | None]], str | None]


def env_drop_in(path: str = SERVICE_PATH) -> str:
    """The drop-in that puts the runtime binaries (e.g. extra shims) first on containerd's PATH."""
    return f'[Service]\nEnvironment="PATH={RUNTIME_BIN_DIR}:{path}"\n'


def containerd_default_config() -> bytes:
    """``containerd config default`` of the containerd on this machine."""
    result = subprocess.run(
        ["containerd", "config", "default"], capture_output=True, timeout=30, check=True
    )
    return result.stdout


class ContainerdExpander:
    """``expand`` (``__call__``) and ``prepare`` for an OSC whose criConfig names containerd.

    ``__call__`` reads the host (config.toml, hosts.toml already there) and may probe registry
    hosts, but writes nothing; ``prepare`` only creates containerd's directories."""

    def __init__(
        self,
        fs: HostFS,
        *,
        default_config: Callable[[], bytes] = containerd_default_config,
        probe: Probe = probe_registry,
        service_path: str = SERVICE_PATH,
    ) -> None:
        self.fs = fs
        self._default_config = default_config
        self._default: bytes | None = None
        self._probe = probe
        self._service_path = service_path
        #: upstream -> why its new hosts.toml was held back by the last expansion (its readiness
        #: probe failed); empty when every registry's file is as desired. A caller may check
        #: again sooner than its usual period while this is not empty.
        self.held_back: dict[str, str] = {}
        #: host path -> why the last expansion could not derive that file; the file is left out
        #: of the expansion (what is on disk stays) and the applier reports it as failed.
        self.failed: dict[str, str] = {}

    def __call__(self, osc: OperatingSystemConfig) -> OperatingSystemConfig:
        cri = containerd_cri(osc.spec.cri_config)
        if cri is None:
            self.failed = {}
            return osc
        taken = {f.path for f in (*osc.spec.files, *osc.status.extension_files)}
        held: dict[str, str] = {}
        failed: dict[str, str] = {}
        derived: list[File] = []
        if CONFIG_FILE not in taken:  # the OSC's own config.toml, if it has one, wins
            try:
                derived.append(_file(CONFIG_FILE, self._config(cri)))
            except HostError as exc:
                failed[CONFIG_FILE] = _reason(exc)
        for registry in cri.containerd.registries:
            path = hosts_toml_path(registry.upstream)
            if path not in taken:
                try:
                    data = self._hosts_toml(registry, held)
                except HostError as exc:
                    failed[path] = f"registry {registry.upstream}: {_reason(exc)}"
                    continue
                if data is not None:
                    derived.append(_file(path, data))
        for path, reason in failed.items():
            log.warning("containerd file not derived; left as it is", path=path, reason=reason)
        self.held_back = held
        self.failed = failed
        unit = Unit(
            name=UNIT,
            drop_ins=(DropIn(name=ENV_DROP_IN, content=env_drop_in(self._service_path)),),
            file_paths=(CONFIG_FILE,),
        )
        spec = osc.spec.model_copy(update={"files": (*osc.spec.files, *derived)})
        status = osc.status.model_copy(
            update={"extension_units": (*osc.status.extension_units, unit)}
        )
        return osc.model_copy(update={"spec": spec, "status": status})

    def prepare(self, osc: OperatingSystemConfig) -> None:
        cri = containerd_cri(osc.spec.cri_config)
        if cri is None:
            return
        for directory in DIRECTORIES:
            self.fs.ensure_dir(directory, DIR_MODE)
        for registry in cri.containerd.registries:
            # only for a hosts.toml that is written (not one held back by its readiness probe)
            if any(f.path == hosts_toml_path(registry.upstream) for f in osc.spec.files):
                self.fs.ensure_dir(registry_dir(registry.upstream), DIR_MODE)

    def _config(self, cri: ContainerdCRI) -> bytes:
        # tomlkit with it: loaded only for an OSC whose criConfig names containerd
        from node_agent.containerd.config import patch_config

        current = self.fs.read(CONFIG_FILE)
        if current is None or not current.strip():
            current = self._seed()
        try:
            text = current.decode("utf-8")
        except UnicodeDecodeError:
            raise ContainerdConfigError("not UTF-8 text") from None
        return patch_config(text, cri).encode("utf-8")

    def _seed(self) -> bytes:
        if self._default is None:
            try:
                self._default = self._default_config()
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning(
                    "containerd config default failed; seeding a minimal config.toml",
                    error=" ".join(str(exc).split()),
                )
                return FALLBACK_CONFIG
        return self._default

    def _hosts_toml(self, registry: RegistryConfig, held: dict[str, str]) -> bytes | None:
        """The registry's hosts.toml; with ``readinessProbe``, a new or changed one only once
        its hosts answer. Until then the file on disk stays as it is (a working mirror is never
        replaced by one that is not up yet, nor deleted); the next check tries again."""
        text = hosts_toml(registry)
        if text is None:
            return None
        data = text.encode("utf-8")
        if not registry.readiness_probe:
            return data
        path = hosts_toml_path(registry.upstream)
        on_disk = self.fs.read(path)
        if on_disk == data:
            return data
        reason = self._probe(registry, self.fs.read)
        if reason is None:
            return data
        held[registry.upstream] = reason
        log.warning(
            "registry hosts not reachable; hosts.toml left as it is",
            upstream=registry.upstream,
            path=path,
            reason=reason,
            kept="previous" if on_disk is not None else "none",
        )
        return on_disk


def _reason(exc: HostError) -> str:
    """The cause alone (the failed item's path is named beside it)."""
    return exc.reason if isinstance(exc, ContainerdConfigError) else str(exc)


def _file(path: str, data: bytes) -> File:
    content = FileContent(
        inline=InlineContent(encoding="b64", data=base64.b64encode(data).decode("ascii"))
    )
    return File(path=path, permissions=FILE_MODE, content=content)
