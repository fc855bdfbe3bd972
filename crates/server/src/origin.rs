//! Keeping web pages out: any page the user opens can send requests to a
//! server on loopback. Three checks stop it, before authentication:
//! - `Host` must name this server (loopback names or the bind address)
//!   when no API key guards it, so a DNS-rebinding page, whose requests
//!   carry its own host name, is refused;
//! - a browser's `Origin` must be the server's own (the chat page) or one
//!   allowed with `--allow-origin`;
//! - API requests must be JSON: browsers send `text/plain` and form bodies
//!   cross-site without asking first, never `application/json`.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::{flavor_of, App};

/// The host part of a `Host` header value (`name`, `name:port`,
/// `[v6]:port`), lowercased.
fn host_name(value: &str) -> String {
    let v = value.trim();
    let name = if let Some(rest) = v.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        v.rsplit_once(':').map_or(v, |(h, _)| h)
    };
    name.to_ascii_lowercase()
}

/// Whether `host` (a `Host` header value) names this server.
pub fn host_allowed(host: &str, bind_host: &str) -> bool {
    let name = host_name(host);
    let bind = host_name(bind_host);
    matches!(name.as_str(), "localhost" | "127.0.0.1" | "::1")
        || name.ends_with(".localhost")
        || name == bind
}

/// Whether a request with `origin` may be served: the server's own origin
/// (`http://` + the request's `Host`), or one of `allowed` (`*` allows any).
pub fn origin_allowed(origin: &str, host: Option<&str>, allowed: &[String]) -> bool {
    let own = host.map(|h| format!("http://{}", h.trim().to_ascii_lowercase()));
    let origin = origin.trim().trim_end_matches('/').to_ascii_lowercase();
    own.as_deref() == Some(origin.as_str())
        || allowed
            .iter()
            .any(|a| a == "*" || a.trim_end_matches('/').eq_ignore_ascii_case(&origin))
}

/// Whether a `Content-Type` is JSON (`application/json`, `...+json`, with
/// parameters).
fn is_json(content_type: &str) -> bool {
    let essence = content_type
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    essence == "application/json"
        || (essence.starts_with("application/") && essence.ends_with("+json"))
}

fn header_str(h: &HeaderMap, name: header::HeaderName) -> Option<&str> {
    h.get(name).and_then(|v| v.to_str().ok())
}

/// The middleware; see the module doc.
pub async fn cross_site_guard(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_string();
    let flavor = flavor_of(&path);
    let h = req.headers();
    let host = header_str(h, header::HOST);
    if app.config.api_key.is_none() {
        if let Some(host) = host.filter(|v| !host_allowed(v, &app.config.host)) {
            return ApiError::new(
                flavor,
                StatusCode::FORBIDDEN,
                format!(
                    "Host {host:?} is not this server: requests must name it by a loopback address \
                     or its bind address (a web page using DNS rebinding names its own host)"
                ),
            )
            .into_response();
        }
    }
    if let Some(origin) = header_str(h, header::ORIGIN) {
        if !origin_allowed(origin, host, &app.config.allowed_origins) {
            return ApiError::new(
                flavor,
                StatusCode::FORBIDDEN,
                format!(
                    "requests from the web origin {origin} are refused; start the server with \
                     --allow-origin {origin} to let that page use it"
                ),
            )
            .into_response();
        }
    }
    if req.method() == Method::POST && path.starts_with("/v1/") {
        let content_type = header_str(h, header::CONTENT_TYPE).unwrap_or("");
        if !is_json(content_type) {
            return ApiError::new(
                flavor,
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                format!(
                    "the request body must be JSON with `Content-Type: application/json` (got {:?})",
                    content_type
                ),
            )
            .into_response();
        }
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts() {
        for ok in [
            "127.0.0.1:8091",
            "localhost:8091",
            "LOCALHOST",
            "[::1]:80",
            "a.localhost:1",
        ] {
            assert!(host_allowed(ok, "127.0.0.1"), "{ok}");
        }
        assert!(host_allowed("10.0.0.5:8091", "10.0.0.5"));
        for bad in [
            "rebind.evil.example",
            "evil.example:8091",
            "127.0.0.1.evil.example",
        ] {
            assert!(!host_allowed(bad, "127.0.0.1"), "{bad}");
        }
    }

    #[test]
    fn origins() {
        let host = Some("127.0.0.1:8091");
        assert!(origin_allowed("http://127.0.0.1:8091", host, &[]));
        assert!(!origin_allowed("http://evil.example", host, &[]));
        assert!(!origin_allowed("http://127.0.0.1:9999", host, &[]));
        let allowed = vec!["http://localhost:3000/".to_string()];
        assert!(origin_allowed("http://localhost:3000", host, &allowed));
        assert!(origin_allowed(
            "https://x.example",
            host,
            &["*".to_string()]
        ));
        assert!(!origin_allowed("null", host, &allowed));
    }

    #[test]
    fn json_types() {
        for ok in [
            "application/json",
            "application/json; charset=utf-8",
            "Application/JSON",
            "application/vnd.x+json",
        ] {
            assert!(is_json(ok), "{ok}");
        }
        for bad in [
            "text/plain",
            "",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
        ] {
            assert!(!is_json(bad), "{bad}");
        }
    }
}
