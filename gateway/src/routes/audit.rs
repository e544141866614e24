//! Audit queries: who did what, when, to what, with what result, a page at a time.

use axum::Json;
use axum::extract::{RawQuery, State};
use opendsec_projections::{AuditQuery, Right};
use opendsec_sdk::types::{self as api, AuditPage};

use crate::AppState;
use crate::convert;
use crate::error::ApiError;
use crate::extract::{Authed, Params};

pub const DEFAULT_LIMIT: usize = 100;
pub const MAX_LIMIT: usize = 1000;

/// Audit records in log order. A caller below the root project sees only records
/// of its subtree. Needs audit:read.
#[utoipa::path(get, path = "/v1/audit", tag = "audit",
    params(
        ("principal" = Option<String>, Query, description = "`token:<id>` (or just the token id)"),
        ("project" = Option<String>, Query, description = "Exactly this project"),
        ("action" = Option<String>, Query, description = "e.g. sandbox.create"),
        ("target" = Option<String>, Query),
        ("since" = Option<String>, Query, description = "RFC 3339 or ms since the epoch, inclusive"),
        ("until" = Option<String>, Query, description = "RFC 3339 or ms since the epoch, inclusive"),
        ("after" = Option<u64>, Query, description = "Cursor: the `next` of the previous page"),
        ("limit" = Option<u64>, Query, description = "Records per page: default 100, at most 1000"),
    ),
    responses((status = 200, body = AuditPage), (status = "4XX", body = api::ErrorBody)))]
pub async fn query(
    State(st): State<AppState>,
    who: Authed,
    RawQuery(q): RawQuery,
) -> Result<Json<AuditPage>, ApiError> {
    let p = Params::parse(
        q.as_deref(),
        &[
            "principal",
            "project",
            "action",
            "target",
            "since",
            "until",
            "after",
            "limit",
        ],
    )?;
    who.require(Right::AuditRead)?;
    let limit = match p.u64("limit")? {
        None => DEFAULT_LIMIT,
        Some(l) if l >= 1 && l <= MAX_LIMIT as u64 => l as usize,
        Some(l) => {
            return Err(ApiError::invalid(
                "limit",
                format!("limit must be 1 to {MAX_LIMIT}, not {l}"),
            ));
        }
    };
    let q = AuditQuery {
        principal: p.one("principal")?.map(|v| {
            if v.contains(':') {
                v.to_string()
            } else {
                format!("token:{v}")
            }
        }),
        project: p.one("project")?.map(str::to_string),
        action: p.one("action")?.map(str::to_string),
        target: p.one("target")?.map(str::to_string),
        since_ms: p.time_ms("since")?,
        until_ms: p.time_ms("until")?,
        after_index: p.u64("after")?,
        limit,
    };
    let page = st.node.read(|s| {
        if who.is_root(s) {
            let (records, next) = s.audit.query(&q);
            return AuditPage {
                records: records.into_iter().map(convert::audit_record).collect(),
                next,
            };
        }
        // Below the root: the same query over the records of the caller's subtree.
        let mine = opendsec_projections::AuditView {
            records: s
                .audit
                .records
                .iter()
                .filter(|r| !r.project.is_empty() && who.sees(s, &r.project))
                .cloned()
                .collect(),
            swept_before: s.audit.swept_before,
        };
        let (records, next) = mine.query(&q);
        AuditPage {
            records: records.into_iter().map(convert::audit_record).collect(),
            next,
        }
    });
    Ok(Json(page))
}
