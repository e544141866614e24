//! Tokens: issued with rights the issuer holds, in its subtree, never outliving it;
//! revoked once.

use super::Decided;
use super::scope::{Scope, hex32, not_found};
use crate::validate::{self, LIMITS};
use crate::{Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::{Event, Right};
use std::collections::BTreeSet;

/// `IssueToken`.
pub(super) fn issue(
    s: &Scope,
    project: &str,
    name: &str,
    rights: &[Right],
    ttl_seconds: Option<u64>,
    secret_sha256: &str,
) -> Result<Decided, Rejection> {
    let who = &s.who;
    validate::name("name", name)?;
    let hash = hex32("secret_sha256", secret_sha256)?;
    if let Some(t) = ttl_seconds {
        validate::amount("ttl_seconds", t, LIMITS.timeout_seconds)?;
    }
    s.project_in_scope("project", project)?;
    who.require(Right::TokenWrite)?;
    if let Some(r) = rights.iter().find(|r| !who.rights.contains(r)) {
        return Err(Rejection::field(
            K::Forbidden,
            "rights",
            format!("the caller cannot grant {}: it does not hold it", r.as_str()),
        ));
    }
    let mut expires = s.expiry(ttl_seconds);
    // A delegated token never outlives its issuer.
    if let Some(mine) = who.expires_at_ms
        && (expires == 0 || expires > mine)
    {
        expires = mine;
    }
    let id = format!("{:016x}", s.rng().next_u64());
    let rights: BTreeSet<Right> = rights.iter().copied().collect();
    Ok(Decided::one(
        project,
        &id,
        Event::TokenIssued(pb::TokenIssued {
            id: id.clone(),
            project: project.to_string(),
            name: name.to_string(),
            rights: rights.iter().map(|r| r.as_str().to_string()).collect(),
            secret_sha256: hash,
            expires_at_ms: expires,
            issued_by: who.token.clone().unwrap_or_default(),
        }),
    ))
}

/// `RevokeToken`.
pub(super) fn revoke(s: &Scope, token: &str, reason: &str) -> Result<Decided, Rejection> {
    validate::id("token", token)?;
    validate::text("reason", reason, LIMITS.reason_len)?;
    let t = s
        .state
        .iam
        .tokens
        .get(token)
        .ok_or_else(|| not_found("token", "token", token))?;
    s.who.require(Right::TokenWrite)?;
    if !s.state.within(&t.project, &s.who.project) {
        return Err(Rejection::field(
            K::Forbidden,
            "token",
            format!("token {token} is outside the caller's project"),
        ));
    }
    if t.revoked.is_some() || s.inflight.token_being_revoked(token) {
        return Err(Rejection::field(
            K::Conflict,
            "token",
            format!("token {token} is already revoked"),
        ));
    }
    Ok(Decided::one(
        &t.project,
        token,
        Event::TokenRevoked(pb::TokenRevoked {
            id: token.to_string(),
            reason: reason.to_string(),
        }),
    ))
}
