"""The OperatingSystemConfig controller and everything that decides when it may apply.

``controller`` watches the OSC Secret and reconciles it through the apply pipeline; ``rollout``
coordinates a pool on its Lease (serial mode, paced rollouts) with the pure decisions of
``pacing``; ``health_gate`` watches what an update restarted and rolls back what it broke,
judged by the pure rules of ``breakage``."""
