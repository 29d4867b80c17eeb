"""The apply pipeline: a planned change set carried out on the host, item by item, crash-safe.

``applier`` runs decode → plan → persist → execute → record for the OSC controller and for
``node-agent apply``; ``executor`` carries out a persisted change set step by step; the
``restart_guard`` stops restarts that do not heal a unit."""
