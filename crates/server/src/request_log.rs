//! `serve --log-requests FILE`: every API request appended to a file as one
//! JSON line, `{"time": unix seconds, "method", "path" (with the query),
//! "user_agent", "body"}` (the body as JSON when it parses, else as text),
//! to see what a client sends while setting it up, and to capture test
//! fixtures. Bodies hold whatever the client sent (prompts, file contents):
//! the file is as private as the conversation.

use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::error::read_error;
use crate::{flavor_of, App};

/// The open log file.
pub struct RequestLog {
    file: Mutex<File>,
}

impl RequestLog {
    /// Opens `path` for appending, creating it when missing.
    pub fn open(path: &Path) -> anyhow::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening the request log {}", path.display()))?;
        Ok(RequestLog {
            file: Mutex::new(file),
        })
    }

    /// Appends one line (one `write` call, so lines never interleave).
    fn append(&self, entry: &Value) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(entry)?;
        line.push(b'\n');
        let mut f = self.file.lock().unwrap_or_else(|e| e.into_inner());
        f.write_all(&line)
    }
}

/// Middleware: records an API request (a `/v1/` path, routed or not, with
/// the API key when one is set), then hands it on unchanged.
pub async fn record(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let Some(log) = app.request_log.clone() else {
        return next.run(req).await;
    };
    if !req.uri().path().starts_with("/v1/") || !app.key_accepted(req.headers()) {
        return next.run(req).await;
    }
    let method = req.method().to_string();
    let path = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str().to_string())
        .unwrap_or_default();
    let user_agent = req
        .headers()
        .get(header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let (parts, body) = req.into_parts();
    // Read as the handlers would (same size limit, same errors).
    let probe = Request::from_parts(parts.clone(), body);
    let bytes = match Bytes::from_request(probe, &()).await {
        Ok(b) => b,
        Err(e) => return read_error(flavor_of(parts.uri.path()), e).into_response(),
    };
    let logged_body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes)
            .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
    };
    let entry = json!({
        "time": std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0),
        "method": method,
        "path": path,
        "user_agent": user_agent,
        "body": logged_body,
    });
    let written = tokio::task::spawn_blocking(move || log.append(&entry)).await;
    if let Ok(Err(e)) | Err(e) = written.map_err(std::io::Error::other) {
        tracing::warn!("writing the request log failed: {e}");
    }
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}
