//! A web page the user opens must not drive the model: foreign origins,
//! DNS-rebound host names and non-JSON bodies are refused; the chat page's
//! own requests and allowed origins pass.

mod common;

use common::{config, rt, scripted, url};
use reqwest::header::{CONTENT_TYPE, HOST, ORIGIN};
use slipstream_server::RunningServer;

const BODY: &str =
    r#"{"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}"#;
const CHAT: &str = "/v1/chat/completions";

/// Posts [`BODY`] to `path` as a browser page might: with an `Origin`
/// and a `Host` header when given, and a content type of `ctype`.
async fn post_from(
    s: &RunningServer,
    path: &str,
    origin: Option<&str>,
    host: Option<&str>,
    ctype: &str,
) -> reqwest::Result<reqwest::Response> {
    let mut r = reqwest::Client::new()
        .post(url(s, path))
        .header(CONTENT_TYPE, ctype)
        .body(BODY);
    if let Some(o) = origin {
        r = r.header(ORIGIN, o);
    }
    if let Some(h) = host {
        r = r.header(HOST, h);
    }
    r.send().await
}

#[test]
fn cross_site_and_rebinding_requests_are_refused() {
    let s = scripted(config(), &["ok"]);
    let own = format!("http://{}", s.addr);
    rt().block_on(async {
        let post = |origin, host, ctype| post_from(&s, CHAT, origin, host, ctype);
        // A form-like body from a foreign page: what a browser sends
        // without asking first.
        let r = post(Some("http://evil.example"), None, "text/plain")
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
        let r = post(None, None, "text/plain").await.unwrap();
        assert_eq!(r.status(), 415);
        let r = post(None, Some("rebind.evil.example"), "application/json")
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
        assert!(r.text().await.unwrap().contains("rebind.evil.example"));
        // The chat page (same origin) and a plain client pass.
        let r = post(Some(&own), None, "application/json").await.unwrap();
        assert_eq!(r.status(), 200);
        let r = post(None, None, "application/json; charset=utf-8")
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        // Anthropic errors keep their shape.
        let r = post_from(
            &s,
            "/v1/messages",
            Some("http://evil.example"),
            None,
            "application/json",
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 403);
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["type"], "error");
    });
}

#[test]
fn an_allowed_origin_may_call_the_api() {
    let mut c = config();
    c.allowed_origins = vec!["http://localhost:3000".into()];
    let s = scripted(c, &["ok"]);
    rt().block_on(async {
        let r = post_from(
            &s,
            CHAT,
            Some("http://localhost:3000"),
            None,
            "application/json",
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 200);
    });
}
