"""node-agent: applies a node's OperatingSystemConfig and reports back, like gardener-node-agent."""

__version__ = "0.1.0"
