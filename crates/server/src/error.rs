//! Errors in each API's own shape.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde_json::json;

/// Which API's error shape to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Anthropic,
}

#[derive(Debug, Clone)]
pub struct ApiError {
    pub flavor: Flavor,
    pub status: StatusCode,
    pub message: String,
    pub code: Option<&'static str>,
    pub param: Option<String>,
    /// Seconds for the `Retry-After` header.
    pub retry_after_s: Option<u64>,
}

impl ApiError {
    pub fn new(flavor: Flavor, status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            flavor,
            status,
            message: message.into(),
            code: None,
            param: None,
            retry_after_s: None,
        }
    }

    pub fn bad_request(flavor: Flavor, message: impl Into<String>) -> Self {
        Self::new(flavor, StatusCode::BAD_REQUEST, message)
    }

    pub fn not_found(flavor: Flavor, message: impl Into<String>) -> Self {
        Self::new(flavor, StatusCode::NOT_FOUND, message)
    }

    pub fn unauthorized(flavor: Flavor, message: impl Into<String>) -> Self {
        Self::new(flavor, StatusCode::UNAUTHORIZED, message).code("invalid_api_key")
    }

    pub fn internal(flavor: Flavor, message: impl Into<String>) -> Self {
        Self::new(flavor, StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// The queue is full: 429 (OpenAI) or 529 overloaded (Anthropic), both
    /// retried by the official SDKs, after `retry_after_s` (`Retry-After`).
    pub fn queue_full(flavor: Flavor, capacity: usize, retry_after_s: u64) -> Self {
        let status = match flavor {
            Flavor::OpenAi => StatusCode::TOO_MANY_REQUESTS,
            Flavor::Anthropic => StatusCode::from_u16(529).unwrap_or(StatusCode::TOO_MANY_REQUESTS),
        };
        Self::new(
            flavor,
            status,
            format!("the server is busy: {capacity} requests are already waiting; retry in {retry_after_s} s"),
        )
        .code("queue_full")
        .retry_after(retry_after_s)
    }

    pub fn retry_after(mut self, seconds: u64) -> Self {
        self.retry_after_s = Some(seconds);
        self
    }

    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn param(mut self, p: impl Into<String>) -> Self {
        self.param = Some(p.into());
        self
    }

    /// The error type string of the API.
    pub fn type_name(&self) -> &'static str {
        let s = self.status.as_u16();
        match self.flavor {
            Flavor::OpenAi => match s {
                401 => "authentication_error",
                404 => "invalid_request_error",
                429 => "rate_limit_error",
                500..=599 => "server_error",
                _ => "invalid_request_error",
            },
            Flavor::Anthropic => match s {
                401 => "authentication_error",
                403 => "permission_error",
                404 => "not_found_error",
                413 => "request_too_large",
                429 => "rate_limit_error",
                529 => "overloaded_error",
                500..=599 => "api_error",
                _ => "invalid_request_error",
            },
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.type_name(),
                "param": self.param,
                "code": self.code,
            }}),
            Flavor::Anthropic => json!({"type": "error", "error": {
                "type": self.type_name(),
                "message": self.message,
            }}),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after_s {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}

/// A body that could not be read (too large, cut off), in the API's shape.
pub fn read_error(flavor: Flavor, e: BytesRejection) -> ApiError {
    let status = e.status();
    if crate::conn::is_body_timeout(&e) {
        return ApiError::new(flavor, StatusCode::REQUEST_TIMEOUT, e.body_text());
    }
    let msg = if status == StatusCode::PAYLOAD_TOO_LARGE {
        "the request body is larger than the server's limit".to_string()
    } else {
        format!("cannot read the request body: {e}")
    };
    ApiError::new(flavor, status, msg)
}

/// Reads a JSON body, every failure an error in the API's shape.
pub fn parse_body<T: DeserializeOwned>(
    flavor: Flavor,
    body: Result<Bytes, BytesRejection>,
) -> Result<T, ApiError> {
    let bytes = body.map_err(|e| read_error(flavor, e))?;
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            flavor,
            "the request body is empty; expected a JSON object",
        ));
    }
    let mut de = serde_json::Deserializer::from_slice(&bytes);
    let v = T::deserialize(&mut de)
        .and_then(|v| de.end().map(|_| v))
        .map_err(|e| {
            let kind = if e.is_syntax() || e.is_eof() {
                "the request body is not valid JSON"
            } else {
                "invalid request"
            };
            ApiError::bad_request(flavor, format!("{kind}: {e}"))
        })?;
    Ok(v)
}
