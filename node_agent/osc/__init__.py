"""The OperatingSystemConfig core without I/O: models, decoding and validation, merging, planning.

Everything here is pure so it can be tested exhaustively and run offline (``node-agent plan``);
the host, systemd and kube layers feed it bytes and execute the ``ChangeSet`` it returns.
"""

from node_agent.osc.decode import decode_osc, parse_osc, validate_osc
from node_agent.osc.merge import merge_units, osc_files, osc_units, secret_refs
from node_agent.osc.models import OperatingSystemConfig
from node_agent.osc.plan import AGENT_UNIT, ChangeSet, UnitCommand, plan

__all__ = [
    "AGENT_UNIT",
    "ChangeSet",
    "OperatingSystemConfig",
    "UnitCommand",
    "decode_osc",
    "merge_units",
    "osc_files",
    "osc_units",
    "parse_osc",
    "plan",
    "secret_refs",
    "validate_osc",
]
