"""Text cut to a size limit keeps its head and its tail and stays valid UTF-8."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from node_agent.base.text import head_and_tail
from node_agent.kube.report import EVENT_MESSAGE_LIMIT, node_event


@given(st.text(), st.integers(min_value=128, max_value=4096))
def test_within_the_limit_and_valid_utf8(text: str, limit: int) -> None:
    cut = head_and_tail(text, limit)
    assert len(cut.encode()) <= limit
    if len(text.encode(errors="replace")) <= limit:
        assert cut == text.encode(errors="replace").decode()


def test_an_events_message_keeps_a_commands_last_words() -> None:
    message = "OS update failed: /opt/update.sh: " + "x" * 5000 + " exit status 1: disk full"
    event = node_event(node_name="n", node_uid=None, reason="InPlaceUpdateFailed", message=message)
    shown = event["message"]
    assert len(shown.encode()) <= EVENT_MESSAGE_LIMIT
    assert shown.startswith("OS update failed: /opt/update.sh: ")
    assert shown.endswith("exit status 1: disk full")
    assert "bytes cut" in shown
