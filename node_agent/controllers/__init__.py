"""The agent's controllers, one module (or package) each: ``osc`` (the OperatingSystemConfig and
its rollout), ``certificate``, ``lease``, ``node``, ``token``, ``unitcheck``, ``healthcheck`` and
``lifecycle``. Each runs as one task of the agent and reads what it shares from ``AgentContext``."""
