//! The one error type of the HTTP API, and the one place it becomes a status code and an
//! OpenAI-shaped body: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// Malformed or invalid request (400).
    InvalidRequest,
    /// Missing or wrong API key (401).
    Unauthorized,
    NotFound,
    MethodNotAllowed,
    /// Request body over the limit (413).
    PayloadTooLarge,
    /// The queue is full (429).
    QueueFull,
    /// Loading, shutting down, or out of memory for more sequences with a full queue (503).
    Unavailable,
    /// The model failed while running a request (500).
    Internal,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// Seconds a client should wait before trying again (429 and 503).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        ApiError { kind, message: message.into(), param: None, retry_after: None }
    }

    /// A 400 naming the field at fault.
    pub fn invalid(param: &str, message: impl Into<String>) -> ApiError {
        ApiError { param: Some(param.to_string()), ..ApiError::new(ErrorKind::InvalidRequest, message) }
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::InvalidRequest, message)
    }

    pub fn unavailable(message: impl Into<String>, retry_after: u64) -> ApiError {
        ApiError { retry_after: Some(retry_after), ..ApiError::new(ErrorKind::Unavailable, message) }
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::Internal, message)
    }

    pub fn status(&self) -> StatusCode {
        match self.kind {
            ErrorKind::InvalidRequest => StatusCode::BAD_REQUEST,
            ErrorKind::Unauthorized => StatusCode::UNAUTHORIZED,
            ErrorKind::NotFound => StatusCode::NOT_FOUND,
            ErrorKind::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorKind::PayloadTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorKind::QueueFull => StatusCode::TOO_MANY_REQUESTS,
            ErrorKind::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            ErrorKind::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `type` and `code` for this kind.
    fn type_and_code(&self) -> (&'static str, &'static str) {
        match self.kind {
            ErrorKind::InvalidRequest => ("invalid_request_error", "invalid_value"),
            ErrorKind::Unauthorized => ("invalid_request_error", "invalid_api_key"),
            ErrorKind::NotFound => ("invalid_request_error", "not_found"),
            ErrorKind::MethodNotAllowed => ("invalid_request_error", "method_not_allowed"),
            ErrorKind::PayloadTooLarge => ("invalid_request_error", "request_too_large"),
            ErrorKind::QueueFull => ("rate_limit_error", "rate_limit_exceeded"),
            ErrorKind::Unavailable => ("server_error", "service_unavailable"),
            ErrorKind::Internal => ("server_error", "internal_error"),
        }
    }

    /// The body's JSON.
    pub fn body(&self) -> serde_json::Value {
        let (ty, code) = self.type_and_code();
        serde_json::json!({
            "error": { "message": self.message, "type": ty, "param": self.param, "code": code }
        })
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status(), axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if self.kind == ErrorKind::Unauthorized {
            r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if self.kind == ErrorKind::PayloadTooLarge {
            // The rest of the body is never read, so this connection cannot carry another
            // request: saying so keeps a keep-alive client from sending its next request
            // into a socket the server is closing.
            r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        r
    }
}
