"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest

from node_agent.osc import decode


@pytest.fixture(params=["libyaml", "python"])
def loader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with libyaml's loader and with the pure-Python fallback."""
    cls = decode.LIBYAML_LOADER if request.param == "libyaml" else decode.PYTHON_LOADER
    assert cls is not None, "PyYAML is built without libyaml"
    monkeypatch.setattr(decode, "OSCLoader", cls)
    return str(request.param)
