"""Ctrl-C stops `slipstream serve` cleanly: the HTTP runtime winds down, then
the engine loop (on the main thread) ends with it, also when a stream was
open at the time."""

import http.client
import json
import signal
import urllib.request

from conftest import Server


def completion(server, body):
    req = urllib.request.Request(
        server.base + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_ctrl_c_after_a_request_exits_with_success():
    s = Server(["--model-name", "demo"])
    try:
        reply = completion(s, {"model": "demo", "prompt": "And it came to pass", "max_tokens": 8})
        assert reply["choices"][0]["text"]
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=20) == 0
    finally:
        s.stop()


def test_ctrl_c_during_a_stream_exits_once_the_client_leaves():
    s = Server(["--model-name", "demo"])
    try:
        host, port = s.addr.rsplit(":", 1)
        conn = http.client.HTTPConnection(host, int(port), timeout=60)
        body = {"model": "demo", "prompt": "And it came to pass", "max_tokens": 5000, "stream": True}
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200
        assert r.read(64)
        s.proc.send_signal(signal.SIGINT)
        conn.close()
        assert s.proc.wait(timeout=30) == 0
    finally:
        s.stop()
