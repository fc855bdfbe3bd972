//! What a hostile or broken client cannot do: hold connections with
//! headers or bodies that never finish, open more connections than the
//! limit, or make the server hold memory by the size of its request rather
//! than by the context.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};
use slipstream_server::conn::ConnLimits;
use slipstream_server::{RunningServer, ServerConfig};

/// A server whose connections have these limits.
fn server_with_limits(header_ms: u64, body_ms: u64, max_connections: usize) -> RunningServer {
    server(ServerConfig {
        conn_limits: ConnLimits {
            header_timeout: Duration::from_millis(header_ms),
            body_timeout: Duration::from_millis(body_ms),
            max_connections,
        },
        ..config()
    })
}

/// Reads until the server closes the connection (or `wait` passes):
/// what it sent, and how long it took to close.
fn read_until_closed(t: &mut TcpStream, wait: Duration) -> (String, Option<Duration>) {
    let t0 = Instant::now();
    t.set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while t0.elapsed() < wait {
        match t.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&got).into(), Some(t0.elapsed())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            // Reset: closed too.
            Err(_) => return (String::from_utf8_lossy(&got).into(), Some(t0.elapsed())),
        }
    }
    (String::from_utf8_lossy(&got).into(), None)
}

fn health_ok(s: &slipstream_server::RunningServer) {
    rt().block_on(async {
        let r = reqwest::get(url(s, "/health")).await.unwrap();
        assert_eq!(r.status(), 200);
    });
}

#[test]
fn headers_that_never_finish_are_cut_at_the_header_timeout() {
    let s = server_with_limits(500, 10_000, 16);
    let mut t = TcpStream::connect(s.addr).unwrap();
    t.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        .unwrap();
    let (_, closed) = read_until_closed(&mut t, Duration::from_secs(10));
    let closed = closed.expect("the server closes a connection whose headers stall");
    assert!(closed < Duration::from_secs(5), "{closed:?}");
    // An idle connection that never sends a byte is closed as well.
    let mut idle = TcpStream::connect(s.addr).unwrap();
    let (_, closed) = read_until_closed(&mut idle, Duration::from_secs(10));
    assert!(closed.is_some(), "an idle connection stays open");
    health_ok(&s);
}

#[test]
fn a_trickling_body_is_cut_at_the_body_timeout() {
    let s = server_with_limits(10_000, 700, 16);
    let body = json!({"model": "demo", "max_tokens": 1,
        "messages": [{"role": "user", "content": "hello there"}]})
    .to_string();
    let mut t = TcpStream::connect(s.addr).unwrap();
    write!(
        t,
        "POST /v1/messages HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    )
    .unwrap();
    // Read while writing: the reply arrives before the connection closes.
    let mut reader = t.try_clone().unwrap();
    let replies =
        std::thread::spawn(move || read_until_closed(&mut reader, Duration::from_secs(8)));
    // A byte every 100 ms: each arrives well within any per-read timeout,
    // the whole would take seconds.
    let t0 = Instant::now();
    for b in body.as_bytes() {
        if t.write_all(&[*b]).is_err() || replies.is_finished() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
        if t0.elapsed() > Duration::from_secs(3) {
            break;
        }
    }
    let (reply, closed) = replies.join().unwrap();
    assert!(closed.is_some(), "the connection stays open: {reply}");
    assert!(
        reply.starts_with("HTTP/1.1 408"),
        "a request timeout in the API's shape: {reply}"
    );
    assert!(reply.contains("\"type\":\"error\""), "{reply}");
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    health_ok(&s);
}

#[test]
fn connections_past_the_limit_are_refused_and_the_server_recovers() {
    let s = server_with_limits(20_000, 20_000, 4);
    // Four held connections, each in the middle of its headers.
    let held: Vec<TcpStream> = (0..4)
        .map(|_| {
            let mut t = TcpStream::connect(s.addr).unwrap();
            t.write_all(b"GET /health HTTP/1.1\r\n").unwrap();
            t
        })
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut extra = TcpStream::connect(s.addr).unwrap();
    let _ = extra.write_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n");
    let (reply, closed) = read_until_closed(&mut extra, Duration::from_secs(5));
    assert!(closed.is_some(), "the extra connection is closed at once");
    assert!(
        reply.is_empty() || reply.starts_with("HTTP/1.1 503"),
        "{reply}"
    );
    drop(held);
    // Their slots come back once they close.
    let t0 = Instant::now();
    loop {
        let ok = rt().block_on(async {
            reqwest::get(url(&s, "/health"))
                .await
                .is_ok_and(|r| r.status() == 200)
        });
        if ok {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no slot came back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Peak resident memory of this process (the server runs in it), bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with("VmHWM:"))
        .expect("VmHWM in /proc/self/status");
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// Posts a body over the server's limit: `Some(error body)` when the 413
/// arrived, `None` when the server closed the connection while the client
/// was still sending (it answers from Content-Length without reading the
/// body, so under load the client's write can fail before it reads the 413).
/// Any other outcome fails the test.
async fn post_refused_by_size(s: &RunningServer, path: &str, body: Value) -> Option<Value> {
    let sent = reqwest::Client::new()
        .post(url(s, path))
        .json(&body)
        .send()
        .await;
    match sent {
        Ok(r) => {
            assert_eq!(r.status().as_u16(), 413);
            Some(r.json().await.expect("a JSON error body"))
        }
        Err(e) => {
            assert!(
                e.is_request() || e.is_body(),
                "not a closed connection: {e:?}"
            );
            None
        }
    }
}

#[test]
fn request_memory_follows_the_context_not_the_body() {
    let mut c = config();
    c.max_context = Some(4096);
    let s = server(c);
    // The default body limit follows the context: 4096 tokens, 1 MiB.
    assert_eq!(s.app.max_body_bytes, 1 << 20);
    let words = "many words of a long prompt ".repeat(100_000); // 2.8 MB
    rt().block_on(async {
        let t0 = Instant::now();
        let refused = post_refused_by_size(
            &s,
            "/v1/chat/completions",
            json!({"model": "demo", "messages": [{"role": "user", "content": words}]}),
        )
        .await;
        if let Some(v) = refused {
            assert!(openai_error(&v).contains("larger than the server's limit"));
        }
        let refused = post_refused_by_size(
            &s,
            "/v1/messages",
            json!({"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": words}]}),
        )
        .await;
        if let Some(v) = refused {
            assert_eq!(anthropic_error(&v).0, "request_too_large");
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    });
    drop(s);

    // With the body limit raised, a prompt of megabytes is refused after
    // counting about twice the context, and memory stays bounded.
    let mut c = config();
    c.max_context = Some(4096);
    c.max_body_bytes = Some(64 << 20);
    let s = server(c);
    let words = "many words of a long prompt ".repeat(300_000); // 8.4 MB
    let before = peak_rss();
    rt().block_on(async {
        let t0 = Instant::now();
        let (st, v) = post(
            &s,
            "/v1/chat/completions",
            json!({"model": "demo", "messages": [{"role": "user", "content": words}]}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert_eq!(v["error"]["code"], "context_length_exceeded", "{v}");
        assert!(openai_error(&v).contains("at least"), "{v}");
        let (st, v) = post(
            &s,
            "/v1/messages",
            json!({"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": words}]}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert!(anthropic_error(&v).1.starts_with("prompt is too long"), "{v}");
        // count_tokens: up to twice the model's positions (262144 here).
        let (st, v) = post(
            &s,
            "/v1/messages/count_tokens",
            json!({"model": "demo", "messages": [{"role": "user", "content": words}]}),
        )
        .await;
        assert_eq!(st, 400, "{v}");
        assert!(anthropic_error(&v).1.contains("more than 524288 tokens"), "{v}");
        assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    });
    let grew = peak_rss().saturating_sub(before);
    // Whole tokenization of such a body took gigabytes; the body itself,
    // its JSON and the rendered prompt are tens of megabytes.
    assert!(grew < 400 << 20, "peak RSS grew {} MB", grew >> 20);
    let v = rt().block_on(get_json(&s, "/health"));
    assert_eq!(v["status"], "ok");
}
