"""A real `slipstream serve` process on a free loopback port, for the
Python test suites (tests/server, tests/clients).

The server command comes from SLIPSTREAM_SERVE (a shell-split command line,
set by each suite's run.sh), e.g. "target/release/slipstream serve".
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
        pytest.skip("SLIPSTREAM_SERVE is not set (run the suite's run.sh)")
    return shlex.split(cmd)


class Server:
    """`script`: the TEST FACILITY's replies (`--test-script`, a list of
    strings and `{"when", "reply", "times"}` rules). `log_requests`: a file
    that gets every API request as a JSON line (`--log-requests`)."""

    def __init__(self, extra_args=(), script=None, log_requests=None):
        args = serve_command() + ["--host", "127.0.0.1", "--port", "0", "--prefill-chunk", "16"]
        args += list(extra_args)
        self.script_file = None
        if script is not None:
            self.script_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
            json.dump(script, self.script_file)
            self.script_file.close()
            args += ["--test-script", self.script_file.name]
        self.log_path = log_requests
        if log_requests is not None:
            args += ["--log-requests", str(log_requests)]
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

    def requests(self):
        """The requests recorded so far (with `log_requests`)."""
        if self.log_path is None or not os.path.exists(self.log_path):
            return []
        with open(self.log_path) as f:
            return [json.loads(line) for line in f if line.strip()]

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
