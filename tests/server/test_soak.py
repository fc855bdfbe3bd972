"""Bounded soak: a few hundred requests, some cut off mid-stream, on
loopback only. The server must keep serving and its RSS stay flat."""

import http.client
import json
import os
import random
import time

SOAK_REQUESTS = int(os.environ.get("SLIPSTREAM_SOAK_REQUESTS", "300"))


def one(server, rng):
    host, port = server.addr.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    kind = rng.choice(["openai", "openai-stream", "anthropic-stream", "completion"])
    if kind.startswith("openai"):
        path = "/v1/chat/completions"
        body = {"model": "demo", "messages": [{"role": "user", "content": rng.choice(["And God said", "In the beginning", "hi"])}],
                "max_tokens": rng.randint(1, 24), "stream": kind.endswith("stream")}
    elif kind == "anthropic-stream":
        path = "/v1/messages"
        body = {"model": "demo", "max_tokens": rng.randint(1, 24), "stream": True,
                "messages": [{"role": "user", "content": "And it came to pass"}]}
    else:
        path = "/v1/completions"
        body = {"model": "demo", "prompt": "And it came to pass", "max_tokens": rng.randint(1, 24)}
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    disconnect = rng.random() < 0.3
    if disconnect and rng.random() < 0.5:
        conn.sock.close()  # before reading anything
        return "cut"
    r = conn.getresponse()
    if disconnect:
        r.read(rng.randint(1, 200))
        conn.sock.close()
        return "cut"
    data = r.read()
    conn.close()
    assert r.status in (200, 429, 529), (r.status, data[:200])
    return r.status


def test_soak_rss_flat(server):
    rng = random.Random(1234)
    # Warm up so allocator pools and caches are in place before measuring.
    for _ in range(30):
        one(server, rng)
    time.sleep(0.5)
    rss0 = server.rss_bytes()
    t0 = time.time()
    counts = {}
    for _ in range(SOAK_REQUESTS):
        k = one(server, rng)
        counts[k] = counts.get(k, 0) + 1
    # Let cancelled jobs finish.
    deadline = time.time() + 30
    while time.time() < deadline:
        h = server.health()
        if not h["busy"] and h["queue"]["pending"] == 0:
            break
        time.sleep(0.05)
    rss1 = server.rss_bytes()
    growth = (rss1 - rss0) / rss0
    print(f"soak: {SOAK_REQUESTS} requests in {time.time() - t0:.1f} s {counts}; "
          f"RSS {rss0 / 1e6:.1f} MB -> {rss1 / 1e6:.1f} MB ({100 * growth:+.2f} %)")
    assert server.health()["status"] == "ok"
    assert growth < 0.05, f"RSS grew {100 * growth:.2f} %"
