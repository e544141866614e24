//! Time travel: the views as they were at a past log index or time, or what changed
//! between two points.

use axum::Json;
use axum::extract::{RawQuery, State};
use opendsec_projections::replay::Until;
use opendsec_projections::{Right, VIEW_NAMES, diff};
use opendsec_sdk::types::{self as api, Change, Replay};
use std::collections::BTreeMap;

use crate::AppState;
use crate::error::ApiError;
use crate::extract::{Authed, Params, parse_time_ms};

/// Rebuilds the view(s) at `to` (default: now), or with `diff_from` lists the
/// changes from that point to `to`. Replay shows the whole cluster, so it needs
/// audit:read on the root project.
#[utoipa::path(get, path = "/v1/replay", tag = "audit",
    params(
        ("to" = Option<String>, Query, description = "A log index, or an RFC 3339 time (default: the applied index)"),
        ("view" = Option<String>, Query, description = "sandboxes, placement, quota, iam or audit (default: all)"),
        ("diff_from" = Option<String>, Query, description = "A log index or RFC 3339 time: list changes since then instead"),
    ),
    responses((status = 200, body = Replay), (status = "4XX", body = api::ErrorBody)))]
pub async fn replay(State(st): State<AppState>, who: Authed, RawQuery(q): RawQuery) -> Result<Json<Replay>, ApiError> {
    let p = Params::parse(q.as_deref(), &["to", "view", "diff_from"])?;
    who.require(Right::AuditRead)?;
    if !st.node.read(|s| who.is_root(s)) {
        return Err(ApiError::forbidden(
            "replay shows the whole cluster: it needs a token of the root project with audit:read",
        ));
    }
    let applied = st.node.applied_index();
    let to = match p.one("to")? {
        Some(v) => point("to", v, applied)?,
        None => Until::Index(applied),
    };
    let from = p
        .one("diff_from")?
        .map(|v| point("diff_from", v, applied))
        .transpose()?;
    let views: Vec<&str> = match p.one("view")? {
        Some(v) if VIEW_NAMES.contains(&v) => vec![v],
        Some(v) => {
            return Err(ApiError::invalid(
                "view",
                format!("unknown view {v:?}; views are: {}", VIEW_NAMES.join(", ")),
            ));
        }
        None => VIEW_NAMES.to_vec(),
    };
    let after = st.node.replay(to).await?;
    let json_of = |s: &opendsec_projections::State, v: &str| s.view_json(v).unwrap_or(serde_json::Value::Null);
    let Some(from) = from else {
        let views = views
            .iter()
            .map(|v| (v.to_string(), json_of(&after, v)))
            .collect::<BTreeMap<_, _>>();
        return Ok(Json(Replay {
            index: after.index,
            time_ms: after.time_ms,
            from_index: None,
            views: Some(views),
            changes: None,
        }));
    };
    let before = st.node.replay(from).await?;
    let mut changes = Vec::new();
    for v in &views {
        for c in diff::diff(&json_of(&before, v), &json_of(&after, v)) {
            let path = if c.path == "/" {
                format!("/{v}")
            } else {
                format!("/{v}{}", c.path)
            };
            changes.push(Change {
                path,
                before: c.before,
                after: c.after,
            });
        }
    }
    Ok(Json(Replay {
        index: after.index,
        time_ms: after.time_ms,
        from_index: Some(before.index),
        views: None,
        changes: Some(changes),
    }))
}

/// A point of the log: an index (digits; at most the applied index) or an RFC 3339 time.
fn point(field: &str, v: &str, applied: u64) -> Result<Until, ApiError> {
    if v.bytes().all(|b| b.is_ascii_digit()) {
        let i: u64 = v
            .parse()
            .map_err(|_| ApiError::invalid(field, format!("{field} index {v} is too large")))?;
        if i > applied {
            return Err(ApiError::invalid(
                field,
                format!("{field} index {i} is past the last applied index {applied}"),
            ));
        }
        return Ok(Until::Index(i));
    }
    parse_time_ms(v).map(Until::Time).ok_or_else(|| {
        ApiError::invalid(
            field,
            format!("{field} must be a log index or an RFC 3339 time, not {v:?}"),
        )
    })
}
