//! E2B's sandbox reads: get, list (v1 and v2, paged by a position) and metrics (the
//! current point, or the edge's history over a range).

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use opendsec_projections::{Right, Sandbox};
use serde_json::{Value, json};
use std::collections::BTreeMap;

use super::api::*;
use crate::AppState;

pub(super) async fn detail(State(st): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> R<Json<Value>> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxRead)?;
    let x = visible(&st, &who, &id)?;
    Ok(Json(detail_json(&st, &x)))
}

/// Query parameters as (name, value) pairs, percent-decoded.
pub(super) fn query_pairs(q: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(q.unwrap_or("").as_bytes())
        .into_owned()
        .collect()
}

pub(super) async fn list_v1(st: State<AppState>, headers: HeaderMap, q: RawQuery) -> R<Response> {
    list(st, headers, q, true).await
}

pub(super) async fn list_v2(st: State<AppState>, headers: HeaderMap, q: RawQuery) -> R<Response> {
    list(st, headers, q, false).await
}

/// Sandboxes of the caller's project subtree, newest first (`order=asc`: oldest first),
/// filtered by metadata (`metadata=k%3Dv%26k2%3Dv2`) and state (`state=running,paused`),
/// paginated with `limit` and `nextToken` (the next page's token comes in
/// `X-Next-Token`). A token names a position, (start time, id), not an index: a page
/// goes on after it even when the sandbox it names was killed in between.
pub(super) async fn list(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
    v1: bool,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxRead)?;
    let mut metadata = BTreeMap::new();
    let mut states: Vec<String> = Vec::new();
    let mut limit = LIST_LIMIT_DEFAULT;
    let mut after: Option<(u64, String)> = None;
    let (mut template, mut descending, mut started_after) = (None::<String>, true, None::<u64>);
    for (k, v) in query_pairs(q.as_deref()) {
        match k.as_str() {
            "metadata" | "query" => {
                // The SDK quotes each key and value before encoding the pairs, and the
                // whole again as a query value: one more decode than the query's own.
                for (mk, mv) in form_urlencoded::parse(v.as_bytes()) {
                    let once_more = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
                    metadata.insert(once_more(&mk), once_more(&mv));
                }
            }
            "template" => template = Some(v),
            "order" => match v.as_str() {
                "asc" => descending = false,
                "desc" => descending = true,
                other => return Err(E2bError::bad(format!("order {other:?} is not asc or desc"))),
            },
            "startedAfter" => {
                let t = time::OffsetDateTime::parse(&v, &time::format_description::well_known::Rfc3339)
                    .map_err(|e| E2bError::bad(format!("startedAfter {v:?} is not an RFC 3339 time: {e}")))?;
                started_after = Some(u64::try_from(t.unix_timestamp_nanos() / 1_000_000).unwrap_or(0));
            }
            "state" => {
                for s in v.split(',').map(str::trim).filter(|s| !s.is_empty()) {
                    if s != "running" && s != "paused" {
                        return Err(E2bError::bad(format!("state {s:?} is not running or paused")));
                    }
                    states.push(s.to_string());
                }
            }
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=LIST_LIMIT_MAX).contains(l))
                    .ok_or_else(|| E2bError::bad(format!("limit must be 1 to {LIST_LIMIT_MAX}")))?;
            }
            "nextToken" if v.is_empty() => {}
            "nextToken" => {
                after = Some(
                    parse_token(&v)
                        .ok_or_else(|| E2bError::bad(format!("nextToken {v:?} is not a token this API handed out")))?,
                )
            }
            _ => {}
        }
    }
    if v1 && states.is_empty() {
        states.push("running".into());
    }
    let (page, next) = st.node.read(|s| {
        let mut all: Vec<&Sandbox> = s
            .sandboxes
            .sandboxes
            .values()
            .filter(|x| x.is_live() && s.within(&x.project, &who.project))
            .filter(|x| states.is_empty() || states.iter().any(|w| w == e2b_state(x)))
            .filter(|x| metadata.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
            .filter(|x| template.as_ref().is_none_or(|t| *t == template_of(x) || *t == x.image))
            .filter(|x| started_after.is_none_or(|t| x.created_at_ms >= t))
            .collect();
        all.sort_by(|a, b| (a.created_at_ms, &a.id).cmp(&(b.created_at_ms, &b.id)));
        if descending {
            all.reverse();
        }
        // The first sandbox past the token's position in this order, whether or not the
        // sandbox the token names is still there.
        let start = match &after {
            Some((ms, id)) => all
                .iter()
                .position(|x| {
                    let here = (x.created_at_ms, x.id.as_str());
                    let mark = (*ms, id.as_str());
                    if descending { here < mark } else { here > mark }
                })
                .unwrap_or(all.len()),
            None => 0,
        };
        let rest = &all[start..];
        let page: Vec<Value> = rest.iter().take(limit).map(|x| detail_json(&st, x)).collect();
        let next = (rest.len() > limit).then(|| token_of(rest[limit - 1]));
        (page, next)
    });
    let mut resp = Json(Value::Array(page)).into_response();
    if let Some(n) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", n);
    }
    Ok(resp)
}

/// A page's position: the start time (ms) and id of its last sandbox.
pub(super) fn token_of(x: &Sandbox) -> String {
    format!("{}.{}", x.created_at_ms, x.id)
}

pub(super) fn parse_token(t: &str) -> Option<(u64, String)> {
    let (ms, id) = t.split_once('.')?;
    let ms = ms.parse::<u64>().ok()?;
    (!id.is_empty()).then(|| (ms, id.to_string()))
}

/// Without `start`/`end`: one sample of the sandbox's CPU, memory and disk, taken now by
/// its edge. With either (Unix seconds, both included): the points of its history kept
/// by the edge (one every 5 s while it runs, the last 8 h), oldest first; an empty list
/// when there are none.
pub(super) async fn metrics(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    RawQuery(q): RawQuery,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxRead)?;
    let (mut start, mut end) = (None::<u64>, None::<u64>);
    for (k, v) in query_pairs(q.as_deref()) {
        let slot = match k.as_str() {
            "start" => &mut start,
            "end" => &mut end,
            _ => continue,
        };
        *slot = Some(
            v.parse::<u64>()
                .map_err(|_| E2bError::bad(format!("{k} must be a Unix time in seconds, not {v:?}")))?,
        );
    }
    let x = visible(&st, &who, &id)?;
    if start.is_some() || end.is_some() {
        return metrics_history(&st, &x, start, end).await;
    }
    let address = st
        .node
        .read(|s| s.placement.edges.get(&x.edge).map(|e| e.address.clone()));
    let address = address.ok_or_else(|| {
        E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!("the edge of sandbox {id} is not registered"),
        )
    })?;
    let (status, body) = super::traffic::edge_get(&st, &address, &format!("/metrics/{id}")).await?;
    if status != 200 {
        return Err(E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!(
                "the edge could not sample sandbox {id}: {}",
                String::from_utf8_lossy(&body)
            ),
        ));
    }
    let m: Value = serde_json::from_slice(&body).map_err(|e| {
        E2bError::new(
            StatusCode::BAD_GATEWAY,
            format!("the edge's metrics are malformed: {e}"),
        )
    })?;
    let now = opendsec_control::now_ms();
    Ok(Json(json!([{
        "timestamp": rfc3339(now),
        "timestampUnix": now / 1000,
        "cpuCount": m["cpu_count"],
        "cpuUsedPct": m["cpu_used_pct"],
        "memUsed": m["mem_used"],
        "memTotal": m["mem_total"],
        "memCache": m["mem_cache"],
        "diskUsed": m["disk_used"],
        "diskTotal": m["disk_total"],
    }]))
    .into_response())
}

pub(super) async fn metrics_history(st: &AppState, x: &Sandbox, start: Option<u64>, end: Option<u64>) -> R<Response> {
    let id = &x.id;
    let start_ms = start.map_or(0, |s| s.saturating_mul(1000));
    let end_ms = end.map_or(u64::MAX, |e| e.saturating_mul(1000).saturating_add(999));
    if start_ms > end_ms {
        return Err(E2bError::bad("end is before start"));
    }
    let address = st
        .node
        .read(|s| s.placement.edges.get(&x.edge).map(|e| e.address.clone()))
        .ok_or_else(|| {
            E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!("the edge of sandbox {id} is not registered"),
            )
        })?;
    let path = format!("/metrics/{id}/history?start_ms={start_ms}&end_ms={end_ms}");
    let (status, body) = super::traffic::edge_get(st, &address, &path).await?;
    let points: Vec<opendsec_sdk::types::MetricsPoint> = match status {
        200 => serde_json::from_slice(&body).map_err(|e| {
            E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!("the edge's metrics history is malformed: {e}"),
            )
        })?,
        // The edge does not run it (yet, or any more: a paused microVM, a sandbox
        // being moved): no points.
        404 => Vec::new(),
        _ => {
            return Err(E2bError::new(
                StatusCode::BAD_GATEWAY,
                format!(
                    "the edge could not read the history of sandbox {id}: {}",
                    String::from_utf8_lossy(&body)
                ),
            ));
        }
    };
    let out: Vec<Value> = points
        .iter()
        .map(|p| {
            json!({
                "timestamp": rfc3339(p.timestamp_ms),
                "timestampUnix": p.timestamp_ms / 1000,
                "cpuCount": p.cpu_count,
                "cpuUsedPct": p.cpu_used_pct,
                "memUsed": p.mem_used,
                "memTotal": p.mem_total,
                "memCache": p.mem_cache,
                "diskUsed": p.disk_used,
                "diskTotal": p.disk_total,
            })
        })
        .collect();
    Ok(Json(Value::Array(out)).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_token_names_a_start_time_and_an_id() {
        assert_eq!(
            parse_token("1700000000123.sbx-a.b"),
            Some((1700000000123, "sbx-a.b".to_string()))
        );
        assert_eq!(parse_token("12"), None, "no id");
        assert_eq!(parse_token("12."), None, "an empty id");
        assert_eq!(parse_token("x.sbx"), None, "no time");
        assert_eq!(parse_token("-1.sbx"), None, "a negative time");
    }
}
