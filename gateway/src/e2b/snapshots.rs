//! E2B snapshots (its templates made from a running sandbox): take one, list them,
//! delete one. Each is an OpenDsec snapshot of the project, taken by the sandbox's edge.

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Path, RawQuery, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use opendsec_commands::Command;
use opendsec_projections::{Right, SnapshotState};
use serde_json::{Value, json};
use std::time::{Duration, Instant};

use super::api::{
    ACTION_WAIT, E2bError, LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX, R, caller, created, no_content, query_pairs, require,
    submit, visible,
};
use super::body::{body_object, opt_str};
use crate::AppState;

pub(super) async fn snapshot(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Bytes,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    let m = body_object(&body)?;
    let name = opt_str(&m, "name")?.unwrap_or("").to_string();
    visible(&st, &who, &id)?;
    let s = submit(
        &st,
        &who,
        &headers,
        Command::CreateSnapshot {
            sandbox: id,
            name: name.clone(),
        },
    )
    .await?;
    let snap = s.decided.target.clone();
    let deadline = Instant::now() + ACTION_WAIT;
    loop {
        let state = st
            .node
            .read(|s| s.snapshots.snapshots.get(&snap).map(|x| (x.state, x.reason.clone())));
        match state {
            Some((SnapshotState::Ready, _)) => break,
            Some((SnapshotState::Failed, why)) => {
                return Err(E2bError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("snapshot failed: {}", why.unwrap_or_default()),
                ));
            }
            None => {
                return Err(E2bError::new(
                    StatusCode::NOT_FOUND,
                    format!("snapshot {snap} was deleted"),
                ));
            }
            Some((SnapshotState::Pending, _)) if Instant::now() >= deadline => {
                return Err(E2bError::new(
                    StatusCode::GATEWAY_TIMEOUT,
                    format!("snapshot {snap} was not taken within {} s", ACTION_WAIT.as_secs()),
                ));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
    let names: Vec<String> = if name.is_empty() { vec![] } else { vec![name] };
    Ok(created(json!({ "snapshotID": snap, "names": names })))
}

pub(super) async fn list_snapshots(
    State(st): State<AppState>,
    headers: HeaderMap,
    RawQuery(q): RawQuery,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    require(&who, Right::SandboxRead)?;
    let (mut sandbox, mut name, mut limit, mut after) = (None, None, LIST_LIMIT_DEFAULT, None);
    for (k, v) in query_pairs(q.as_deref()) {
        match k.as_str() {
            "sandboxID" => sandbox = Some(v),
            "name" => name = Some(v),
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=LIST_LIMIT_MAX).contains(l))
                    .ok_or_else(|| E2bError::bad(format!("limit must be 1 to {LIST_LIMIT_MAX}")))?
            }
            "nextToken" => after = Some(v),
            _ => {}
        }
    }
    let (page, next) = st.node.read(|s| {
        let all: Vec<_> = s
            .snapshots
            .snapshots
            .values()
            .filter(|x| x.state == SnapshotState::Ready && s.within(&x.project, &who.project))
            .filter(|x| sandbox.as_ref().is_none_or(|w| &x.sandbox == w))
            .filter(|x| name.as_ref().is_none_or(|w| &x.name == w))
            .collect();
        let start = after.as_ref().map(|t| all.iter().position(|x| &x.id == t).map(|i| i + 1).unwrap_or(all.len())).unwrap_or(0);
        let rest = &all[start..];
        let page: Vec<Value> = rest
            .iter()
            .take(limit)
            .map(|x| json!({ "snapshotID": x.id, "names": if x.name.is_empty() { vec![] } else { vec![x.name.clone()] } }))
            .collect();
        let next = (rest.len() > limit).then(|| rest[limit - 1].id.clone());
        (page, next)
    });
    let mut resp = Json(Value::Array(page)).into_response();
    if let Some(n) = next.and_then(|n| HeaderValue::from_str(&n).ok()) {
        resp.headers_mut().insert("x-next-token", n);
    }
    Ok(resp)
}

pub(super) async fn delete_snapshot(
    State(st): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> R<Response> {
    let who = caller(&st, &headers).await?;
    if super::templates::is_template(&st, &who, &id) {
        return super::templates::delete_template(&st, &who, &headers, &id).await;
    }
    let known = st.node.read(|s| {
        s.snapshots
            .snapshots
            .get(&id)
            .is_some_and(|x| s.within(&x.project, &who.project))
    });
    if !known {
        return Err(E2bError::new(
            StatusCode::NOT_FOUND,
            format!(
                "template or snapshot {id} not found (images cannot be deleted through the E2B API: opendsecctl image rm)"
            ),
        ));
    }
    submit(&st, &who, &headers, Command::DeleteSnapshot { snapshot: id }).await?;
    Ok(no_content())
}
