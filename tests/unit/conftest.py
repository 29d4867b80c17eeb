"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from node_agent.osc import decode
from tests.unit.fakes import VirtualClock, virtual_time


@pytest.fixture(params=["libyaml", "python"])
def loader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with libyaml's loader and with the pure-Python fallback."""
    cls = decode.LIBYAML_LOADER if request.param == "libyaml" else decode.PYTHON_LOADER
    assert cls is not None, "PyYAML is built without libyaml"
    monkeypatch.setattr(decode, "OSCLoader", cls)
    return str(request.param)


@pytest.fixture
async def virtual_clock() -> AsyncIterator[VirtualClock]:
    """The test runs on the loop's virtual clock (``fakes.virtual_time``): waits on timers take
    no wall time. Modules whose code waits on timers use it with
    ``pytestmark = pytest.mark.usefixtures("virtual_clock")``."""
    async with virtual_time() as clock:
        yield clock
