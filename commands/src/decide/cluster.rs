//! Cluster membership: control nodes added to or removed from the Raft cluster (the
//! decision only logs the request; the control plane carries out the change); and the
//! retention of ended sandboxes and audit records in the live views.

use super::Decided;
use super::scope::Scope;
use crate::validate;
use crate::{Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::{Event, Retention, Right};

/// `AddClusterMember`.
pub(super) fn add_member(s: &Scope, node_id: u64, address: &str) -> Result<Decided, Rejection> {
    if node_id == 0 {
        return Err(Rejection::field(K::Invalid, "node_id", "node ids start at 1"));
    }
    validate::text("address", address, 255)?;
    if address.is_empty() || !address.contains(':') || address.chars().any(char::is_whitespace) {
        return Err(Rejection::field(K::Invalid, "address", "address must be host:port"));
    }
    s.who.require(Right::ClusterAdmin)?;
    s.require_root()?;
    Ok(membership_change(node_id, address, "add"))
}

/// `RemoveClusterMember`.
pub(super) fn remove_member(s: &Scope, node_id: u64) -> Result<Decided, Rejection> {
    s.who.require(Right::ClusterAdmin)?;
    s.require_root()?;
    Ok(membership_change(node_id, "", "remove"))
}

/// `SetRetention`: what is left out keeps its value.
pub(super) fn set_retention(
    s: &Scope,
    ended_sandboxes_seconds: Option<u64>,
    audit_seconds: Option<u64>,
    audit_records: Option<u64>,
) -> Result<Decided, Rejection> {
    s.who.require(Right::ClusterAdmin)?;
    s.require_root()?;
    let now = s.state.retention.to_event();
    let ev = pb::RetentionSet {
        ended_sandboxes_seconds: ended_sandboxes_seconds.unwrap_or(now.ended_sandboxes_seconds),
        audit_seconds: audit_seconds.unwrap_or(now.audit_seconds),
        audit_records: audit_records.unwrap_or(now.audit_records),
    };
    if let Some((field, why)) = Retention::invalid(&ev) {
        return Err(Rejection::field(K::Invalid, field, format!("{field} must be {why}")));
    }
    Ok(Decided::one("", "retention", Event::RetentionSet(ev)))
}

fn membership_change(node_id: u64, address: &str, change: &str) -> Decided {
    let ev = pb::ClusterMembershipChangeRequested {
        node_id,
        address: address.to_string(),
        change: change.into(),
    };
    Decided::one(
        "",
        &format!("node:{node_id}"),
        Event::ClusterMembershipChangeRequested(ev),
    )
}
