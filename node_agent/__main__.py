"""Allow ``python -m node_agent``."""

from node_agent.cli import main

raise SystemExit(main())
