//! Errors as OpenAI's API returns them (`{"error": {"message", "type", "param", "code"}}`,
//! `code` a string such as `"model_not_found"` or null, as OpenAI's), and reading a request
//! body with its size cap.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// A failed request: its status and the OpenAI-style error body.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, `rate_limit_error`,
    /// `upstream_error`, `server_error`.
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<String>,
    /// OpenAI's `code`: a machine-readable string where OpenAI has one for the case
    /// (`model_not_found`, `invalid_api_key`, `rate_limit_exceeded`,
    /// `context_length_exceeded`), else null.
    pub code: Option<&'static str>,
    /// Seconds a client should wait before retrying (429).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), kind, param: None, code: None, retry_after: None }
    }

    /// A malformed request: 400, naming the field.
    pub fn field(param: &str, message: impl Into<String>) -> Self {
        ApiError { param: Some(param.to_string()), ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message) }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn busy(message: impl Into<String>) -> Self {
        ApiError { retry_after: Some(1), ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message).with_code("rate_limit_exceeded") }
    }

    /// The same error with OpenAI's `code`.
    pub fn with_code(self, code: &'static str) -> Self {
        ApiError { code: Some(code), ..self }
    }

    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout_error", message)
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

/// The request body as JSON: at most `limit` bytes (413 past it), an object (400 otherwise).
pub async fn json_body(body: Body, limit: usize) -> Result<serde_json::Map<String, Value>, ApiError> {
    let bytes = axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large = std::error::Error::source(&e).is_some_and(|s| s.to_string().contains("length limit"));
        if too_large || e.to_string().contains("length limit") {
            ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "invalid_request_error", format!("the request body is larger than {limit} bytes (--max-body-bytes)"))
        } else {
            ApiError::bad_request(format!("the request body could not be read: {e}"))
        }
    })?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err(ApiError::bad_request("the request body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("the request body is not valid JSON: {e}"))),
    }
}

/// An optional non-negative integer field.
pub fn opt_usize(req: &serde_json::Map<String, Value>, name: &str) -> Result<Option<usize>, ApiError> {
    match req.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| ApiError::field(name, format!("`{name}` must be a non-negative integer"))),
    }
}

/// An optional string field.
pub fn opt_str<'a>(req: &'a serde_json::Map<String, Value>, name: &str) -> Result<Option<&'a str>, ApiError> {
    match req.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(ApiError::field(name, format!("`{name}` must be a string"))),
    }
}
