//! The gateway's one error type: every failure becomes `{"code","message","field"?}`
//! with the status its kind calls for.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use opendsec_commands::{Rejection, RejectionKind};
use opendsec_control::SubmitError;
use opendsec_sdk::types::ErrorBody;

use crate::INDEX_HEADER;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub body: ErrorBody,
    /// Set when a refused write was still logged (a denial lands in the audit view).
    pub index: Option<u64>,
    /// A rate-limited write: when to retry (`Retry-After`, in whole seconds).
    pub retry_after_ms: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            body: ErrorBody {
                code: code.into(),
                message: message.into(),
                field: None,
            },
            index: None,
            retry_after_ms: None,
        }
    }

    /// A 400 naming the field at fault.
    pub fn invalid(field: &str, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::BAD_REQUEST, "invalid", message);
        e.body.field = Some(field.to_string());
        e
    }

    pub fn not_found(field: &str, message: impl Into<String>) -> ApiError {
        let mut e = ApiError::new(StatusCode::NOT_FOUND, "not_found", message);
        e.body.field = Some(field.to_string());
        e
    }

    pub fn forbidden(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", message)
    }

    pub fn unauthenticated(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthenticated", message)
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", message)
    }
}

pub fn status_of(kind: RejectionKind) -> StatusCode {
    match kind {
        RejectionKind::Invalid => StatusCode::BAD_REQUEST,
        RejectionKind::NotFound => StatusCode::NOT_FOUND,
        RejectionKind::Unauthenticated => StatusCode::UNAUTHORIZED,
        RejectionKind::Forbidden => StatusCode::FORBIDDEN,
        RejectionKind::Conflict => StatusCode::CONFLICT,
        RejectionKind::QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
        RejectionKind::NoCapacity => StatusCode::SERVICE_UNAVAILABLE,
        RejectionKind::RateLimited => StatusCode::TOO_MANY_REQUESTS,
    }
}

impl From<Rejection> for ApiError {
    fn from(r: Rejection) -> ApiError {
        ApiError {
            status: status_of(r.kind),
            body: ErrorBody {
                code: r.kind.code().into(),
                message: r.message,
                field: r.field,
            },
            index: None,
            retry_after_ms: r.retry_after_ms,
        }
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> ApiError {
        match e {
            SubmitError::Rejected { rejection, index } => ApiError {
                index,
                ..ApiError::from(rejection)
            },
            SubmitError::Unavailable(m) => ApiError::unavailable(m),
            SubmitError::Internal(m) => ApiError::internal(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        if self.status.is_server_error() {
            tracing::warn!(status = %self.status, code = %self.body.code, message = %self.body.message, "request failed");
        }
        let mut resp = (self.status, Json(self.body)).into_response();
        if let Some(i) = self.index {
            resp.headers_mut().insert(INDEX_HEADER, HeaderValue::from(i));
        }
        if let Some(ms) = self.retry_after_ms {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(ms.div_ceil(1000).max(1)));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
