//! The admin API's error answer: `{"error": "..."}` with a status code.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

/// A JSON error: `{"error": "..."}` with a status code.
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
}

impl ApiError {
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
        }
    }

    pub(crate) fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

impl From<postbox_core::Error> for ApiError {
    fn from(e: postbox_core::Error) -> Self {
        // Bad input (a NUL byte in an event id, …) is the caller's error:
        // 400, no ERROR log.
        if e.is_usage() {
            tracing::debug!(error = %e, "admin API: bad request");
            return ApiError::bad_request(e.to_string());
        }
        // The schema lacks what the request reads (not migrated, or an
        // optional index such as the aggregate search's): the operator's
        // to fix, the database is fine.
        if let postbox_core::Error::Schema(_) = e {
            tracing::warn!(error = %e, "admin API: schema");
            return ApiError::new(StatusCode::CONFLICT, e.to_string());
        }
        tracing::error!(error = %e, "admin API: store call failed");
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut res = (
            self.status,
            Json(serde_json::json!({ "error": self.message })),
        )
            .into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            res.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer realm=\"postbox\""),
            );
        }
        res
    }
}

/// A handler's answer.
pub(crate) type ApiResult<T> = Result<T, ApiError>;
