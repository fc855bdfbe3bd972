"""Fixtures: a real `slipstream serve` process on a free loopback port.

The server command comes from SLIPSTREAM_SERVE (a shell-split command line,
set by run.sh), e.g. "target/release/slipstream serve".
"""

import json
import os
import shlex
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def serve_command():
    cmd = os.environ.get("SLIPSTREAM_SERVE")
    if not cmd:
        pytest.skip("SLIPSTREAM_SERVE is not set (run tests/server/run.sh)")
    return shlex.split(cmd)


class Server:
    def __init__(self, extra_args=(), script=None):
        args = serve_command() + ["--host", "127.0.0.1", "--port", "0", "--prefill-chunk", "16"]
        args += list(extra_args)
        self.script_file = None
        if script is not None:
            self.script_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
            json.dump(script, self.script_file)
            self.script_file.close()
            args += ["--test-script", self.script_file.name]
        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # Ctrl-C reaches the server even when this runs where SIGINT is
            # ignored (a background job of a non-interactive shell).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.stderr = []
        threading.Thread(target=self._drain_stderr, daemon=True).start()
        deadline = time.time() + 120
        self.addr = None
        while time.time() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("listening on "):
                self.addr = line.split()[-1]
                break
        if self.addr is None:
            self.stop()
            raise RuntimeError("server did not start:\n" + "".join(self.stderr))
        self.base = f"http://{self.addr}"

    def _drain_stderr(self):
        for line in self.proc.stderr:
            self.stderr.append(line)

    def health(self):
        with urllib.request.urlopen(self.base + "/health", timeout=10) as r:
            return json.loads(r.read())

    def rss_bytes(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.script_file:
            os.unlink(self.script_file.name)


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
