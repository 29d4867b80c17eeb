"""Command-line entry point: one sub-command per job the agent does on a node.

``run`` is the daemon; ``plan`` shows what an OSC would change, changing nothing; ``apply``
applies a local OSC without any API server (image builds, recovery); ``reset`` takes back what
the agent put on the node. Errors print one clear line to stderr and exit non-zero; tracebacks
are for bugs only.

Upstream's command line works unchanged, whatever the executable is called (Gardener installs
it as ``/opt/bin/gardener-node-agent``): ``--config-dir DIR`` on its own runs the agent,
``bootstrap --config-dir DIR`` and ``reset`` do what upstream's do. The config in that directory
is ``config-<version>.yaml`` (see ``base.configfile.find_config``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from node_agent import __version__
from node_agent.base.text import escape_controls

if TYPE_CHECKING:
    from node_agent.apply.applier import Applier
    from node_agent.config import AgentSettings, NodeAgentConfiguration
    from node_agent.osc.models import OperatingSystemConfig

EXIT_ERROR = 1
EXIT_USAGE = 2
COMMANDS = frozenset({"version", "run", "plan", "apply", "bootstrap", "status", "reset", "fleet"})
NAMES = ("node-agent", "gardener-node-agent", "kubectl-node_agent")
#: kubectl runs a plugin ``kubectl-<name>`` for ``kubectl <name>`` ("-" in the name is "_")
KUBECTL_PLUGIN = "kubectl-node_agent"


def _prog() -> str:
    """Our name as invoked (``gardener-node-agent`` when installed as upstream's binary)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name in NAMES else NAMES[0]


def _plugin_argv(argv: Sequence[str]) -> list[str]:
    """As ``kubectl node-agent`` (``kubectl-node_agent``), the command is ``fleet`` unless
    another one is named: ``kubectl node-agent --pool a`` is ``node-agent fleet --pool a``
    (and ``--help`` is the fleet view's)."""
    tokens = list(argv)
    if tokens and (tokens[0] in COMMANDS or tokens[0] == "--version"):
        return tokens
    return ["fleet", *tokens]


def kubectl_plugin() -> int:
    """Entry of the ``kubectl-node_agent`` console script."""
    return main(_plugin_argv(sys.argv[1:]))


def _upstream_argv(argv: Sequence[str]) -> list[str]:
    """Upstream's root command runs the agent: ``--config-dir DIR`` alone means ``run``."""
    tokens = list(argv)
    if not any(t in COMMANDS for t in tokens) and any(
        t == "--config-dir" or t.startswith("--config-dir=") for t in tokens
    ):
        return ["run", *tokens]
    return tokens


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_prog(),
        description="On-node configuration agent for Kubernetes worker machines.",
    )
    parser.add_argument("--version", action="version", version=f"node-agent {__version__}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--root", type=Path, default=Path("/"), help="prefix for every host path (default /)"
    )
    source = common.add_mutually_exclusive_group()
    source.add_argument(
        "--config",
        default=None,
        help="NodeAgentConfiguration file (default /var/lib/gardener-node-agent/config.yaml "
        "under --root)",
    )
    source.add_argument(
        "--config-dir",
        default=None,
        help="upstream's flag: directory holding config-<version>.yaml (the highest version "
        "wins); an absolute path is a host path under --root",
    )
    common.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"])
    common.add_argument("--log-format", default=None, choices=["json", "text"])
    common.add_argument(
        "--hostname", default=None, help="host name to act as (default: this machine's)"
    )
    common.add_argument(
        "--systemd-bus",
        default=None,
        help="D-Bus address of the system bus (default: the local system bus)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print the version and exit")
    sub.add_parser("run", parents=[common], help="run the agent (as the systemd service does)")
    plan = sub.add_parser(
        "plan", parents=[common], help="print what applying an OSC would change; change nothing"
    )
    plan.add_argument("--osc", type=Path, help="OSC file (default: the node's Secret)")
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    apply = sub.add_parser(
        "apply", parents=[common], help="apply a local OSC file without an API server"
    )
    apply.add_argument("--osc", type=Path, required=True, help="OSC file (osc.yaml)")
    apply.add_argument(
        "--offline",
        action="store_true",
        help="do not talk to systemd (image build): write files and units only",
    )
    sub.add_parser(
        "bootstrap",
        parents=[common],
        help="install, enable and start the agent's own unit (run by the init script)",
    )
    status = sub.add_parser(
        "status",
        parents=[common],
        help="what the running agent is doing (or, if it is not running, its saved state)",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "--history", action="store_true", help="the last 50 applies, newest first (from the file)"
    )
    fleet = sub.add_parser(
        "fleet",
        help="the pools of a cluster as their agents report them (from a kubeconfig)",
        description="Nodes by state, checksums, the rollout ledger, units not ready, Lease "
        "freshness and versions, per pool; reads only what the agents publish.",
    )
    fleet.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)",
    )
    fleet.add_argument(
        "--pool", action="append", default=[], help="only this worker pool (repeatable)"
    )
    fleet.add_argument(
        "-o", "--output", choices=["text", "json", "yaml"], default="text", help="output format"
    )
    fleet.add_argument(
        "-w",
        "--watch",
        action="store_true",
        help="refresh until every node of the chosen pools is up to date",
    )
    fleet.add_argument(
        "--interval", type=float, default=5.0, help="seconds between refreshes (--watch)"
    )
    fleet.add_argument(
        "--max-nodes", type=int, default=20, help="nodes listed per pool in the text (default 20)"
    )
    sub.add_parser(
        "reset",
        parents=[common],
        help="stop the agent and kubelet, remove the units, files and state the agent created",
    )
    status.add_argument(
        "--socket",
        type=Path,
        default=None,
        help="the agent's socket (default /run/gardener-node-agent/status.sock under --root)",
    )
    return parser


def _fail(message: str) -> int:
    """Say ``message`` on stderr (its control characters escaped: it may carry the API
    server's or a unit's words); the exit code of a failure."""
    print(escape_controls(f"{_prog()}: {message}"), file=sys.stderr)
    return EXIT_ERROR


def _say(text: str) -> None:
    """Print ``text`` for people, control characters escaped (paths and names come from the
    OSC)."""
    print("\n".join(escape_controls(line) for line in text.split("\n")))


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    if argv is None and _prog() == KUBECTL_PLUGIN:  # a symlink of that name to the artifact
        argv = _plugin_argv(sys.argv[1:])
    args = parser.parse_args(_upstream_argv(sys.argv[1:] if argv is None else argv))
    if args.command == "version":
        print(f"node-agent {__version__}")
        return 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    if args.command == "status" and args.history:
        return _status_history(args)
    if args.command == "status":
        return _status(args)  # before the imports below: status must start fast
    if args.command == "reset":
        return _reset(args)
    if args.command == "fleet":
        return _fleet(args)

    from node_agent.base import log
    from node_agent.base.errors import NodeAgentError

    # The agent has no pydantic plugins: no scan of every installed package's entry points
    # when the first model is built (set before pydantic reads it, inherited by nothing that
    # minds).
    os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")
    try:
        if args.command == "run":
            _log_start(args)
            settings, config = _load_settings(args, require_config=True)
            log.configure(args.log_level or config.log_level, args.log_format or config.log_format)
            return asyncio.run(_run(args, settings, config))
        if args.command == "bootstrap":
            log.configure(args.log_level or "warning", args.log_format or "text", stream=sys.stderr)
            from node_agent.commands.bootstrap import run_bootstrap

            config_file = _config_path(args)
            report = asyncio.run(
                run_bootstrap(
                    args.root,
                    str(config_file) if config_file else None,
                    systemd_address=args.systemd_bus,
                    exec_start=_gardener_exec_start(args),
                )
            )
            _say(report.summary())
            for error in report.errors:  # the other steps were done; say what was not
                _fail(f"{type(error).__name__}: {error}")
            return 1 if report.errors else 0
        log.configure(args.log_level or "warning", args.log_format or "text", stream=sys.stderr)
        if args.command == "plan":
            return asyncio.run(_plan(args))
        if args.command == "apply":
            return asyncio.run(_apply(args))
    except NodeAgentError as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        return 130
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def _log_start(args: argparse.Namespace) -> None:
    """The daemon's first log line, logged before the config's models and the agent's modules are
    imported (most of a start's CPU), so the journal shows when the process came up and which
    binary and config it runs. It is JSON at info level unless the command line says otherwise:
    the config's ``logLevel`` and ``logFormat`` are read next and apply from the following line
    on."""
    from node_agent.base import log
    from node_agent.base.layout import CONFIG_FILE
    from node_agent.base.selfexe import own_executable

    chosen = _config_path(args)  # a missing config is one line on stderr, as before
    log.configure(args.log_level or "info", args.log_format or "json")
    log.get_logger("node-agent").info(
        "node-agent starting",
        version=__version__,
        executable=own_executable(),
        config=str(chosen.absolute() if chosen else args.root / CONFIG_FILE.lstrip("/")),
        pid=os.getpid(),
    )


async def _run(
    args: argparse.Namespace, settings: AgentSettings, config: NodeAgentConfiguration
) -> int:
    """The daemon: its systemd worker boots while the agent's modules are imported."""
    from node_agent.systemd.client import start_early

    early = await start_early(args.systemd_bus, settings.systemd_job_timeout + 10)
    from node_agent.kube.lean import load_aiohttp

    load_aiohttp()  # before any module imports it
    from node_agent.agent import run_agent

    return await run_agent(
        settings, config, host_name=args.hostname, systemd_address=args.systemd_bus, early=early
    )


def _load_settings(
    args: argparse.Namespace, *, require_config: bool
) -> tuple[AgentSettings, NodeAgentConfiguration]:
    from node_agent.config import AgentSettings, NodeAgentConfiguration, load_config

    settings = AgentSettings(root=args.root)
    default = settings.root / settings.config_file.lstrip("/")
    chosen = _config_path(args)
    path = chosen.absolute() if chosen else default
    if chosen and path.is_relative_to(settings.root):
        # The agent rewrites its config (secret-name label): keep it pointing at this file.
        inner = "/" + str(path.relative_to(settings.root))
        settings = settings.model_copy(update={"config_file": inner})
    config = load_config(path) if path.exists() or require_config else NodeAgentConfiguration()
    return settings, config


def _gardener_exec_start(args: argparse.Namespace) -> str | None:
    """Installed the Gardener way (``bootstrap --config-dir``), the unit runs this very file with
    that directory, as upstream's unit does; otherwise the shipped unit is used as it is."""
    if not args.config_dir:
        return None
    from node_agent.base.selfexe import own_executable

    binary = own_executable() or os.path.abspath(sys.argv[0])
    return f"{binary} --config-dir={args.config_dir}"


def _config_path(args: argparse.Namespace) -> Path | None:
    """The config file named by ``--config`` or found in ``--config-dir``; None for the default."""
    if args.config:
        return Path(args.config)
    if not args.config_dir:
        return None
    from node_agent.base.configfile import find_config  # without the config's models

    directory = Path(args.config_dir)
    if directory.is_absolute():
        directory = args.root / str(directory).lstrip("/")
    return find_config(directory)


def _fleet(args: argparse.Namespace) -> int:
    """``node-agent fleet``: the lean kube client and the fleet module only (no daemon parts)."""
    from node_agent.base.errors import NodeAgentError
    from node_agent.kube.lean import load_aiohttp

    load_aiohttp()  # before any module imports it
    from node_agent.commands.fleet import kubeconfig_path, run_fleet

    if args.interval <= 0:
        return _fail("--interval must be positive")
    path = kubeconfig_path(args.kubeconfig)
    if not path.is_file():
        return _fail(f"kubeconfig {path} not found (use --kubeconfig or $KUBECONFIG)")
    try:
        return asyncio.run(
            run_fleet(
                path,
                args.pool,
                output=args.output,
                watch=args.watch,
                interval=args.interval,
                max_nodes=args.max_nodes,
            )
        )
    except NodeAgentError as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        return 130


def _reset(args: argparse.Namespace) -> int:
    """``reset``: one line per item on stdout for people; on stderr, as the agent logs, one JSON
    event per item kept or not removed (``--log-format text`` for people). The config is not
    needed (nor read)."""
    from node_agent.base import log
    from node_agent.base.errors import NodeAgentError
    from node_agent.commands.reset import reset_lock, reset_node
    from node_agent.config import AgentSettings
    from node_agent.systemd import Systemd

    log.configure(args.log_level or "warning", args.log_format or "json", stream=sys.stderr)
    settings = AgentSettings(root=args.root)

    async def go() -> None:
        systemd = Systemd(args.systemd_bus)
        await systemd.start()
        try:
            await reset_node(
                settings.root,
                systemd,
                agent_unit=settings.agent_unit,
                job_timeout=settings.systemd_job_timeout,
            )
        finally:
            await systemd.close()

    try:
        with reset_lock(settings.root):  # one reset at a time; a second one waits its turn
            asyncio.run(go())
    except NodeAgentError as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    except KeyboardInterrupt:
        return 130
    return 0


def _read_osc(path: Path) -> tuple[bytes, OperatingSystemConfig]:
    from node_agent.base.errors import OSCDecodeError
    from node_agent.osc.decode import parse_osc

    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise OSCDecodeError(f"cannot read {path}: {exc.strerror}") from exc
    osc = parse_osc(raw)
    return raw, osc


async def _plan(args: argparse.Namespace) -> int:
    import json

    from node_agent.osc import inplace

    applier, osc, _raw, resolved = await _prepare(args, offline=True)
    change_set = (await applier.plan(osc, resolved)).change_set
    old, os_release = _in_place_inputs(applier)
    in_place = inplace.plan(old, osc, os_release)
    if args.json:
        doc = change_set.model_dump(
            mode="json", exclude={"files_to_write": {"__all__": {"content"}}}
        )
        doc["in_place"] = in_place.model_dump(mode="json") if in_place is not None else None
        print(json.dumps(doc, indent=2))
    else:
        _say(change_set.summary())
        for line in inplace.describe(in_place) if in_place is not None else ():
            _say(line)
    return 0


def _in_place_inputs(applier: Applier) -> tuple[OperatingSystemConfig | None, str | None]:
    """What the in-place part of ``plan`` compares with: the applied OSC and the host's
    os-release (``/usr/lib/os-release`` when ``/etc``'s is missing)."""
    from node_agent.base.errors import NodeAgentError
    from node_agent.osc.decode import parse_osc

    last = applier.state.load_last_applied()
    old = parse_osc(last.raw) if last is not None else None
    for path in ("/etc/os-release", "/usr/lib/os-release"):
        try:
            raw = applier.fs.read(path, limit=1 << 16)
        except NodeAgentError:
            continue
        if raw is not None:
            return old, raw.decode(errors="replace")
    return old, None


async def _apply(args: argparse.Namespace) -> int:
    from node_agent.base.digest import sha256_hex

    applier, osc, raw, resolved = await _prepare(args, offline=args.offline)
    try:
        outcome = await applier.apply(raw, osc, sha256_hex(raw), resolved)
    finally:
        if applier.systemd is not None:
            await applier.systemd.close()
    _say(outcome.change_set.summary())
    rep = outcome.report
    _say(
        f"applied in {rep.duration:.3f}s: {len(rep.files_written)} files, "
        f"{len(rep.units_written)} units written, restarted: {', '.join(rep.restarted) or 'none'}"
    )
    for pull in rep.pulls:
        _say(f"pulled: {pull.target} from {pull.image} ({pull.digest}, {pull.size} bytes)")
    for note in rep.skipped:
        _say(f"skipped: {note}")
    return 0


async def _prepare(
    args: argparse.Namespace, *, offline: bool
) -> tuple[Applier, OperatingSystemConfig, bytes, dict[str, bytes]]:
    """The applier for --root, and the OSC with its secretRef contents.

    Without --osc the OSC comes from the node's Secret; secretRef contents always come from the
    API server named in the config (so a local OSC with secretRefs needs the config too).
    """
    import socket

    from node_agent.agent import build_applier
    from node_agent.containerd.images import CtrImages
    from node_agent.host.fs import HostFS
    from node_agent.host.state import StateStore
    from node_agent.osc.decode import validate_osc
    from node_agent.osc.merge import secret_refs
    from node_agent.systemd import Systemd

    from_secret = args.osc is None
    settings, config = _load_settings(args, require_config=from_secret)
    host_name = args.hostname or socket.gethostname()
    resolved: dict[str, bytes] = {}
    if from_secret:
        raw, osc, resolved = await _from_api(settings, config, host_name, secret=True)
    else:
        raw, osc = _read_osc(args.osc)
        validate_osc(osc, host_name)
        if secret_refs(osc, host_name):  # their contents live in the cluster
            _, _, resolved = await _from_api(settings, config, host_name, osc=osc)
    fs = HostFS(settings.root, follow_system_symlinks=True)
    systemd = None
    if not offline:
        systemd = Systemd(args.systemd_bus)
        await systemd.start()
    applier = build_applier(
        fs,
        StateStore(fs),
        systemd,
        settings,
        host_name=host_name,
        images=None  # offline: imageRef skipped
        if offline
        else CtrImages(
            root=settings.root, pull_timeout=config.node_agent.images.pull_timeout.total_seconds()
        ),
    )
    return applier, osc, raw, resolved


async def _from_api(
    settings: AgentSettings,
    config: NodeAgentConfiguration,
    host_name: str,
    *,
    secret: bool = False,
    osc: OperatingSystemConfig | None = None,
) -> tuple[bytes, OperatingSystemConfig, dict[str, bytes]]:
    """Read the node's OSC Secret (``secret=True``) and resolve secretRefs through the API."""
    from node_agent.controllers.osc.controller import (
        DATA_KEY,
        resolve_secret_refs,
        secret_bytes,
    )
    from node_agent.kube.client import KubeClient
    from node_agent.kube.report import ANNOTATION_SECRET_CHECKSUM, NAMESPACE
    from node_agent.osc.decode import decode_osc

    kubeconfig = settings.root / config.client_connection.kubeconfig.lstrip("/")
    async with KubeClient.from_kubeconfig(kubeconfig) as kube:
        raw = b""
        if secret:
            name = config.controllers.operating_system_config.secret_name
            obj = await kube.get_secret(NAMESPACE, name)
            raw = secret_bytes(obj, DATA_KEY, f"secret {NAMESPACE}/{name}")
            annotated = ((obj.get("metadata") or {}).get("annotations") or {}).get(
                ANNOTATION_SECRET_CHECKSUM
            )
            osc = decode_osc(raw, annotated, host_name)
        assert osc is not None
        return raw, osc, await resolve_secret_refs(kube, osc, host_name)


def _status(args: argparse.Namespace) -> int:
    """``node-agent status``: asks the agent over its socket; reads files if it is not running."""
    from node_agent.base.errors import ConfigError
    from node_agent.commands.status import DEFAULT_CONFIG, run_status

    try:
        chosen = _config_path(args)
    except ConfigError:
        chosen = None  # status still reports from the socket and the saved state
    config = chosen or args.root / DEFAULT_CONFIG.lstrip("/")
    try:
        return run_status(args.root, config_file=config, socket_file=args.socket, as_json=args.json)
    except KeyboardInterrupt:
        return 130


def _status_history(args: argparse.Namespace) -> int:
    """``node-agent status --history``: read from the state directory under --root, so the
    same with or without a running agent."""
    from node_agent.commands.show_history import run_history

    return run_history(args.root, as_json=args.json)
