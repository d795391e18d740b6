//! Every way an API request ends short of an answer, as one type: the handlers return
//! `Result<Response, ApiError>`, and [`super::answer`] counts the failure once and turns it into
//! the response. The body is always `{"error": "…"}` naming what is wrong.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use super::super::auth::{AuthError, Forbidden};
use crate::api::check::BadRequest;
use crate::telemetry::{KindLabels, Metrics, ReasonLabels, StatusLabels};

#[derive(Debug)]
pub enum ApiError {
    /// 400: the request (body, header, query) is malformed; the message names what.
    Bad(BadRequest),
    /// 413: the body is larger than this endpoint reads.
    TooLarge { limit: usize },
    /// 400: the body could not be read (the connection broke, a bad chunk).
    Unreadable,
    /// 401 with a Bearer challenge, or 503 when the credential cannot be verified now.
    Unauthenticated(AuthError),
    /// 403, or 401 where a denial itself is 403 (nginx): the caller asked about what it may not.
    Forbidden { error: Forbidden, status: StatusCode },
    /// 404: what the request names is not there (or not the caller's to know of).
    NotFound(String),
    /// 413 with a message of its own.
    TooLargeBecause(String),
    /// 503: the store did not answer; `message` says what did not happen and what to do.
    Store { kind: &'static str, message: String },
    /// 500: an answer could not be encoded.
    Encoding(String),
}

impl From<BadRequest> for ApiError {
    fn from(error: BadRequest) -> Self {
        ApiError::Bad(error)
    }
}

impl From<AuthError> for ApiError {
    fn from(error: AuthError) -> Self {
        ApiError::Unauthenticated(error)
    }
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError::Bad(BadRequest(message.into()))
    }

    /// 403 for a request about another namespace than the caller's.
    pub fn forbidden(error: Forbidden) -> ApiError {
        ApiError::Forbidden { error, status: StatusCode::FORBIDDEN }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Bad(_) | ApiError::Unreadable => StatusCode::BAD_REQUEST,
            ApiError::TooLarge { .. } | ApiError::TooLargeBecause(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Unauthenticated(AuthError::Unavailable(_)) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden { status, .. } => *status,
            ApiError::Store { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Encoding(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Counts the failure: by status, and by reason for authentication and authorization, by
    /// kind for the store. An encoding failure is a bug, not a response class: not counted.
    pub fn count(&self, metrics: &Metrics) {
        let reason = match self {
            ApiError::Encoding(_) => return,
            ApiError::Unauthenticated(AuthError::Missing) => Some("missing"),
            ApiError::Unauthenticated(AuthError::Invalid(_)) => Some("invalid"),
            ApiError::Unauthenticated(AuthError::Unavailable(_)) => Some("unavailable"),
            ApiError::Forbidden { .. } => Some("forbidden"),
            ApiError::Store { kind, .. } => {
                metrics.store_errors.get_or_create(&KindLabels { kind }).inc();
                None
            }
            ApiError::Bad(_)
            | ApiError::TooLarge { .. }
            | ApiError::TooLargeBecause(_)
            | ApiError::NotFound(_)
            | ApiError::Unreadable => None,
        };
        if let Some(reason) = reason {
            metrics.auth_failures.get_or_create(&ReasonLabels { reason }).inc();
        }
        metrics.responses.get_or_create(&StatusLabels { status: self.status().as_u16() }).inc();
    }

    fn message(self) -> String {
        match self {
            ApiError::Bad(BadRequest(message)) => message,
            ApiError::TooLarge { limit } => format!("request body larger than {limit} bytes"),
            ApiError::Unreadable => "could not read the request body".to_string(),
            ApiError::Unauthenticated(error) => error.to_string(),
            ApiError::Forbidden { error, .. } => error.to_string(),
            ApiError::Store { message, .. }
            | ApiError::Encoding(message)
            | ApiError::NotFound(message)
            | ApiError::TooLargeBecause(message) => message,
        }
    }
}

/// `{"error": message}` with `status`: every error body of the API.
pub fn error_response(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        // The challenge only where a credential is missing or refused: a 401 standing for 403
        // (nginx) is about rights, not credentials.
        let challenge = matches!(self, ApiError::Unauthenticated(AuthError::Missing | AuthError::Invalid(_)));
        let mut response = error_response(status, self.message());
        if challenge {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer realm=\"sluice\""));
        }
        response
    }
}
