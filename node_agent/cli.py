"""Command-line entry point: one sub-command per job the agent does on a node."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from node_agent import __version__


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="node-agent",
        description="On-node configuration agent for Kubernetes worker machines.",
    )
    parser.add_argument("--version", action="version", version=f"node-agent {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("version", help="print the version and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        print(f"node-agent {__version__}")
        return 0
    parser.print_help(sys.stderr)
    return 2
