"""Fixtures: a real `slipstream serve` process on a free loopback port
(tests/common/slipserve.py, shared with tests/clients)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "common"))
from slipserve import ROOT, Server  # noqa: E402,F401


@pytest.fixture(scope="module")
def server():
    s = Server(["--model-name", "demo"])
    yield s
    s.stop()


QWEN3_CALL = (
    "<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)
CODER_CALL = (
    "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
    "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture(scope="module")
def scripted():
    """TEST FACILITY: replies come from a fixed script (--test-script)."""
    s = Server(["--model-name", "demo"], script=[QWEN3_CALL, "It is sunny in Paris.", CODER_CALL])
    yield s
    s.stop()
