//! What every handler takes from a request, with failures already turned into
//! [`ApiError`]s: the authenticated caller (after waiting for the client's
//! `X-Opendsec-Min-Index`), the request id, a strict JSON body, query parameters
//! and path segments.

use axum::body::Bytes;
use axum::extract::{FromRef, FromRequest, FromRequestParts, Path, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use opendsec_control::Principal;
use opendsec_projections::{Right, State};
use serde::de::DeserializeOwned;
use std::time::Duration;
use tracing::Instrument;

use crate::error::ApiError;
use crate::{AppState, MIN_INDEX_HEADER, REQUEST_ID_HEADER};

/// How long a read waits for this node to apply the index the client asks for.
pub const MIN_INDEX_WAIT: Duration = Duration::from_secs(5);

/// The caller, authenticated by its bearer token.
pub struct Authed(pub Principal);

impl Authed {
    pub fn require(&self, right: Right) -> Result<(), ApiError> {
        if self.0.rights.contains(&right) {
            Ok(())
        } else {
            Err(ApiError::forbidden(format!(
                "this token lacks the right {}",
                right.as_str()
            )))
        }
    }

    /// Whether `project` lies in the caller's project subtree.
    pub fn sees(&self, state: &State, project: &str) -> bool {
        state.within(project, &self.0.project)
    }

    /// Whether the caller's project is the root (it then sees the whole cluster).
    pub fn is_root(&self, state: &State) -> bool {
        state.root_project().is_some_and(|p| p.id == self.0.project)
    }

    pub fn credential(&self) -> opendsec_control::Credential {
        self.0.credential()
    }
}

impl<S> FromRequestParts<S> for Authed
where
    AppState: FromRef<S>,
    S: Send + Sync,
{
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Authed, ApiError> {
        let app = AppState::from_ref(state);
        // Wait first: a token issued through another node authenticates only once
        // this node has applied its issue.
        if let Some(v) = parts.headers.get(MIN_INDEX_HEADER) {
            let index: u64 = v.to_str().ok().and_then(|s| s.trim().parse().ok()).ok_or_else(|| {
                ApiError::invalid(
                    MIN_INDEX_HEADER,
                    format!("{MIN_INDEX_HEADER} must be a log index (an unsigned integer)"),
                )
            })?;
            if app.node.applied_index() < index {
                app.node.wait_applied(index, MIN_INDEX_WAIT).await.map_err(|_| {
                    ApiError::unavailable(format!(
                        "this node has not applied log index {index} within {} s; retry, or ask another node",
                        MIN_INDEX_WAIT.as_secs()
                    ))
                })?;
            }
        }
        let value = parts.headers.get(header::AUTHORIZATION).ok_or_else(|| {
            ApiError::unauthenticated("missing bearer token: send `Authorization: Bearer odsec_<id>.<secret>`")
        })?;
        let token = value
            .to_str()
            .ok()
            .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
            .map(str::trim)
            .ok_or_else(|| ApiError::unauthenticated("the Authorization header must be `Bearer <token>`"))?;
        let principal = match app.node.authenticate(token) {
            Ok(p) => p,
            // Issued through another node a moment ago, perhaps, and not applied here
            // yet: catch up with the leader (which answers only for a token it accepts)
            // and look again; otherwise the token is unknown indeed.
            Err(unknown)
                if unknown.message == opendsec_control::node::UNKNOWN_TOKEN
                    && !app.node.log().leadership().is_leader =>
            {
                app.node
                    .catch_up_for(token)
                    .await
                    .map_err(|_| ApiError::from(unknown.clone()))?;
                app.node.authenticate(token).map_err(ApiError::from)?
            }
            Err(r) => return Err(ApiError::from(r)),
        };
        // A lagging or partitioned node never serves authority the leader has revoked.
        app.node.confirm_current(token).await.map_err(ApiError::from)?;
        tracing::Span::current().record("principal", principal.token_id.as_str());
        Ok(Authed(principal))
    }
}

/// This request's id: the client's `X-Request-Id` when usable, else a fresh UUID.
#[derive(Clone, Debug)]
pub struct RequestId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for RequestId {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<RequestId, ApiError> {
        parts
            .extensions
            .get::<RequestId>()
            .cloned()
            .ok_or_else(|| ApiError::internal("request id middleware is missing"))
    }
}

fn usable_request_id(v: &HeaderValue) -> Option<String> {
    let s = v.to_str().ok()?;
    let ok = !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic());
    ok.then(|| s.to_string())
}

/// Middleware: assigns the request id, opens the request's span, echoes the id.
pub async fn request_context(mut req: Request, next: Next) -> Response {
    let id = req
        .headers()
        .get(REQUEST_ID_HEADER)
        .and_then(usable_request_id)
        .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
    req.extensions_mut().insert(RequestId(id.clone()));
    // The path and method only: never a header, so never a token.
    let span = tracing::info_span!("request", method = %req.method(), path = %req.uri().path(), request_id = %id, principal = tracing::field::Empty);
    let started = std::time::Instant::now();
    let mut resp = next.run(req).instrument(span.clone()).await;
    span.in_scope(|| {
        tracing::info!(
            status = resp.status().as_u16(),
            ms = started.elapsed().as_millis() as u64,
            "served"
        )
    });
    if let Ok(v) = HeaderValue::from_str(&id) {
        resp.headers_mut().insert(REQUEST_ID_HEADER, v);
    }
    resp
}

/// A JSON request body, decoded strictly: UTF-8, one JSON value, the declared
/// fields only; an error names the field at fault.
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<JsonBody<T>, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "payload_too_large",
                    format!("the body is over the limit of {} bytes", crate::MAX_BODY_BYTES),
                )
            } else {
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid",
                    format!("the body could not be read: {e}"),
                )
            }
        })?;
        decode_json(&bytes).map(JsonBody)
    }
}

/// Like [`JsonBody`], for an optional body: none (or only white space) is `T::default()`.
pub struct OptionalJsonBody<T>(pub T);

impl<T: DeserializeOwned + Default, S: Send + Sync> FromRequest<S> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<OptionalJsonBody<T>, ApiError> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|e| ApiError::invalid("body", format!("the body could not be read: {e}")))?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(OptionalJsonBody(T::default()));
        }
        decode_json(&bytes).map(OptionalJsonBody)
    }
}

/// Decodes a JSON body; public so the rules can be tested without HTTP.
pub fn decode_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        let mut err = ApiError::invalid(
            "body",
            format!("the body is not valid UTF-8 (bad byte at offset {})", e.valid_up_to()),
        );
        err.body.field = None;
        err
    })?;
    if text.trim().is_empty() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            "the body is empty; send a JSON object",
        ));
    }
    // Every request body is an object; serde would otherwise accept an array positionally.
    if !text.trim_start().starts_with('{') {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            "the body must be a JSON object",
        ));
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let msg = inner.to_string();
        // serde reports a missing or unknown field at the enclosing object; name the field itself.
        let named = between(&msg, "missing field `", "`").or_else(|| between(&msg, "unknown field `", "`"));
        let field = match (path.as_str(), named) {
            (".", Some(n)) => Some(n.to_string()),
            (p, Some(n)) if !p.ends_with(n) => Some(format!("{p}.{n}")),
            (".", None) => None,
            (p, _) => Some(p.to_string()),
        };
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("the body is not valid JSON: {msg}")
        } else {
            match &field {
                Some(f) => format!("{f}: {msg}"),
                None => format!("the body does not match the expected shape: {msg}"),
            }
        };
        let mut err = ApiError::new(StatusCode::BAD_REQUEST, "invalid", message);
        err.body.field = field;
        err
    })?;
    de.end().map_err(|e| {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid",
            format!("the body is not valid JSON: trailing data ({e})"),
        )
    })?;
    Ok(value)
}

fn between<'a>(s: &'a str, start: &str, end: &str) -> Option<&'a str> {
    let rest = &s[s.find(start)? + start.len()..];
    Some(&rest[..rest.find(end)?])
}

/// A path segment, with a JSON 400 when it does not decode.
pub struct PathParam<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for PathParam<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<PathParam<T>, ApiError> {
        Path::<T>::from_request_parts(parts, state)
            .await
            .map(|Path(v)| PathParam(v))
            .map_err(|e| ApiError::invalid("path", format!("bad path parameter: {}", e.body_text())))
    }
}

/// Query parameters, checked against the names a handler accepts.
pub struct Params {
    pairs: Vec<(String, String)>,
}

impl Params {
    pub fn parse(query: Option<&str>, allowed: &[&str]) -> Result<Params, ApiError> {
        let mut pairs = Vec::new();
        for (k, v) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            // The decoder replaces invalid UTF-8 with U+FFFD: refuse instead of guessing.
            if k.contains('\u{FFFD}') || v.contains('\u{FFFD}') {
                return Err(ApiError::invalid(
                    &k,
                    format!("query parameter {k:?} is not valid UTF-8"),
                ));
            }
            if !allowed.contains(&k.as_ref()) {
                return Err(ApiError::invalid(
                    &k,
                    format!(
                        "unknown query parameter {k:?}; this endpoint takes: {}",
                        allowed.join(", ")
                    ),
                ));
            }
            pairs.push((k.into_owned(), v.into_owned()));
        }
        Ok(Params { pairs })
    }

    /// The parameter's value; an empty value counts as absent.
    pub fn one(&self, name: &str) -> Result<Option<&str>, ApiError> {
        let mut it = self.pairs.iter().filter(|(k, _)| k == name).map(|(_, v)| v.as_str());
        let first = it.next();
        if it.next().is_some() {
            return Err(ApiError::invalid(
                name,
                format!("query parameter {name} is given more than once"),
            ));
        }
        Ok(first.filter(|v| !v.is_empty()))
    }

    pub fn all(&self, name: &str) -> impl Iterator<Item = &str> {
        self.pairs
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn u64(&self, name: &str) -> Result<Option<u64>, ApiError> {
        self.one(name)?
            .map(|v| {
                v.parse()
                    .map_err(|_| ApiError::invalid(name, format!("{name} must be an unsigned integer, not {v:?}")))
            })
            .transpose()
    }

    /// A point in time: milliseconds since the epoch, or RFC 3339.
    pub fn time_ms(&self, name: &str) -> Result<Option<u64>, ApiError> {
        self.one(name)?
            .map(|v| {
                parse_time_ms(v).ok_or_else(|| {
                    ApiError::invalid(
                        name,
                        format!("{name} must be milliseconds since the epoch or an RFC 3339 time, not {v:?}"),
                    )
                })
            })
            .transpose()
    }
}

pub fn parse_time_ms(v: &str) -> Option<u64> {
    if v.bytes().all(|b| b.is_ascii_digit()) {
        return v.parse().ok();
    }
    let t = time::OffsetDateTime::parse(v, &time::format_description::well_known::Rfc3339).ok()?;
    u64::try_from(t.unix_timestamp_nanos() / 1_000_000).ok()
}

/// The most items a list answers at once, and its default page.
pub const MAX_PAGE: usize = 1000;

/// A page of a list: at most `limit` items (1 to [`MAX_PAGE`], default [`MAX_PAGE`]) after
/// `page_token`, the `next_page_token` of the page before (the last item's id: lists go
/// in id order, so a page is stable while items come and go).
pub struct PageQuery {
    pub limit: usize,
    pub after: Option<String>,
}

impl PageQuery {
    pub fn parse(params: &Params) -> Result<PageQuery, ApiError> {
        let limit = match params.one("limit")? {
            None => MAX_PAGE,
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=MAX_PAGE).contains(n))
                .ok_or_else(|| ApiError::invalid("limit", format!("limit must be a number from 1 to {MAX_PAGE}")))?,
        };
        Ok(PageQuery {
            limit,
            after: params.one("page_token")?.map(str::to_string),
        })
    }

    /// The page of `items` (in ascending key order) and the token of the next, if any.
    pub fn take<T>(&self, items: impl Iterator<Item = (String, T)>) -> (Vec<T>, Option<String>) {
        let mut out = Vec::new();
        let mut last = None;
        let mut items = items
            .filter(|(k, _)| self.after.as_deref().is_none_or(|a| k.as_str() > a))
            .peekable();
        while out.len() < self.limit {
            match items.next() {
                Some((k, v)) => {
                    last = Some(k);
                    out.push(v);
                }
                None => break,
            }
        }
        let next = items.peek().is_some().then_some(last).flatten();
        (out, next)
    }
}
