//! Cluster membership: control nodes added to or removed from the Raft cluster. The
//! decision only logs the request; the control plane carries out the change.

use super::Decided;
use super::scope::Scope;
use crate::validate;
use crate::{Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::{Event, Right};

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
