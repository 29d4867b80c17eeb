"""The base every other part stands on: typed errors, logging, the agent's file layout, Go
durations, the one backoff, sd_notify and the agent's own executable. Nothing here imports
another part of node-agent."""
