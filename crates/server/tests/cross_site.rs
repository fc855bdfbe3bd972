//! A web page the user opens must not drive the model: foreign origins,
//! DNS-rebound host names and non-JSON bodies are refused; the chat page's
//! own requests and allowed origins pass.

mod common;

use common::{config, rt, scripted, url};
use reqwest::header::{HeaderName, CONTENT_TYPE, HOST, ORIGIN};
use slipstream_server::RunningServer;

const BODY: &str =
    r#"{"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}"#;
const CHAT: &str = "/v1/chat/completions";
const JSON: &str = "application/json";

/// Posts [`BODY`] to `path` with `headers`, as a browser page might.
async fn post_with(
    s: &RunningServer,
    path: &str,
    headers: &[(HeaderName, &str)],
) -> reqwest::Response {
    let mut r = reqwest::Client::new().post(url(s, path)).body(BODY);
    for (name, value) in headers {
        r = r.header(name, *value);
    }
    r.send().await.unwrap()
}

#[test]
fn cross_site_and_rebinding_requests_are_refused() {
    let s = scripted(config(), &["ok"]);
    let own = format!("http://{}", s.addr);
    rt().block_on(async {
        // A form-like body from a foreign page: what a browser sends
        // without asking first.
        let r = post_with(
            &s,
            CHAT,
            &[
                (ORIGIN, "http://evil.example"),
                (CONTENT_TYPE, "text/plain"),
            ],
        )
        .await;
        assert_eq!(r.status(), 403);
        let r = post_with(&s, CHAT, &[(CONTENT_TYPE, "text/plain")]).await;
        assert_eq!(r.status(), 415);
        let r = post_with(
            &s,
            CHAT,
            &[(HOST, "rebind.evil.example"), (CONTENT_TYPE, JSON)],
        )
        .await;
        assert_eq!(r.status(), 403);
        assert!(r.text().await.unwrap().contains("rebind.evil.example"));
        // The chat page (same origin) and a plain client pass.
        let r = post_with(&s, CHAT, &[(ORIGIN, &own), (CONTENT_TYPE, JSON)]).await;
        assert_eq!(r.status(), 200);
        let r = post_with(
            &s,
            CHAT,
            &[(CONTENT_TYPE, "application/json; charset=utf-8")],
        )
        .await;
        assert_eq!(r.status(), 200);
        // Anthropic errors keep their shape.
        let r = post_with(
            &s,
            "/v1/messages",
            &[(ORIGIN, "http://evil.example"), (CONTENT_TYPE, JSON)],
        )
        .await;
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
        let r = post_with(
            &s,
            CHAT,
            &[(ORIGIN, "http://localhost:3000"), (CONTENT_TYPE, JSON)],
        )
        .await;
        assert_eq!(r.status(), 200);
    });
}
