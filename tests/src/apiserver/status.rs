//! Failures as Kubernetes `Status` objects, with the codes, reasons and messages of the real API
//! server.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Kind;
use super::store::Key;

/// A failed request, answered as a `Status`.
#[derive(Debug, Clone)]
pub(super) struct ApiError {
    pub(super) code: StatusCode,
    pub(super) reason: &'static str,
    pub(super) message: String,
    /// `details`: the resource (`pods`, `pods/binding`) and the object's name.
    details: Option<(String, String)>,
}

impl ApiError {
    pub(super) fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { code, reason, message: message.into(), details: None }
    }

    fn with_details(mut self, resource: &str, name: &str) -> ApiError {
        self.details = Some((resource.to_owned(), name.to_owned()));
        self
    }

    /// 400, for a request that cannot be understood.
    pub(super) fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", message)
    }

    /// 404 for an object.
    pub(super) fn not_found(key: &Key) -> ApiError {
        let resource = key.kind.plural();
        ApiError::new(StatusCode::NOT_FOUND, "NotFound", format!("{resource} \"{}\" not found", key.name))
            .with_details(resource, &key.name)
    }

    /// 403 for an object, as the Node authorizer answers a node reading a pod it has no edge
    /// to (yet).
    pub(super) fn forbidden(key: &Key) -> ApiError {
        let resource = key.kind.plural();
        let message =
            format!("{resource} \"{}\" is forbidden: no relationship found between node and this object", key.name);
        ApiError::new(StatusCode::FORBIDDEN, "Forbidden", message).with_details(resource, &key.name)
    }

    /// 404 for a path the server does not serve.
    pub(super) fn no_route() -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "NotFound", "the server could not find the requested resource")
    }

    /// 405.
    pub(super) fn method_not_allowed() -> ApiError {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource",
        )
    }

    /// 409 on create.
    pub(super) fn already_exists(kind: Kind, name: &str) -> ApiError {
        let resource = kind.plural();
        ApiError::new(StatusCode::CONFLICT, "AlreadyExists", format!("{resource} \"{name}\" already exists"))
            .with_details(resource, name)
    }

    /// 409 on a write that lost a race or breaks a rule of the resource.
    pub(super) fn conflict(resource: &str, name: &str, why: &str) -> ApiError {
        ApiError::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!("Operation cannot be fulfilled on {resource} \"{name}\": {why}"),
        )
        .with_details(resource, name)
    }

    /// 409 for a stale resourceVersion.
    pub(super) fn modified(key: &Key) -> ApiError {
        ApiError::conflict(
            key.kind.plural(),
            &key.name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 409 for a failed delete or binding precondition.
    pub(super) fn precondition(key: &Key, what: &str, wanted: &str, actual: &str) -> ApiError {
        ApiError::new(
            StatusCode::CONFLICT,
            "Conflict",
            format!("Precondition failed: {what} in precondition: {wanted}, {what} in object meta: {actual}"),
        )
        .with_details(key.kind.plural(), &key.name)
    }

    /// 422, for an object that breaks validation.
    pub(super) fn invalid(kind: &str, name: &str, message: &str) -> ApiError {
        ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", format!("{kind} \"{name}\" is invalid: {message}"))
    }

    /// 410, when a watch asks for events the history no longer holds.
    pub(super) fn expired(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::GONE, "Expired", message)
    }

    /// 415.
    pub(super) fn unsupported_media_type(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::UNSUPPORTED_MEDIA_TYPE, "UnsupportedMediaType", message)
    }

    /// 500.
    pub(super) fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "InternalError", message)
    }

    /// 503, during a simulated outage.
    pub(super) fn unavailable() -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the API server stand-in is unavailable (a simulated outage)",
        )
    }

    /// The Status for any HTTP error code (for responses not built here, such as axum's).
    pub(super) fn from_code(code: StatusCode, message: &str) -> ApiError {
        let reason = match code.as_u16() {
            400 => "BadRequest",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "NotFound",
            405 => "MethodNotAllowed",
            406 => "NotAcceptable",
            409 => "Conflict",
            410 => "Expired",
            413 => "RequestEntityTooLarge",
            415 => "UnsupportedMediaType",
            422 => "Invalid",
            429 => "TooManyRequests",
            503 => "ServiceUnavailable",
            504 => "Timeout",
            _ => "InternalError",
        };
        let message = if message.trim().is_empty() {
            code.canonical_reason().unwrap_or("the request failed").to_owned()
        } else {
            message.trim().to_owned()
        };
        ApiError::new(code, reason, message)
    }

    /// The `Status` object.
    pub(super) fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code.as_u16(),
        });
        if let (Some((resource, name)), Some(map)) = (&self.details, status.as_object_mut()) {
            map.insert("details".into(), json!({"name": name, "kind": resource}));
        }
        status
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({} {})", self.message, self.code.as_u16(), self.reason)
    }
}

impl std::error::Error for ApiError {}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        json_response(self.code, &self.to_status())
    }
}

/// A JSON response.
pub(super) fn json_response(code: StatusCode, body: &Value) -> Response {
    let mut response = (code, body.to_string()).into_response();
    response.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The `Status` a successful binding answers with.
pub(super) fn success(code: StatusCode) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": code.as_u16()})
}
