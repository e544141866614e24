//! Edges: registered (or updated) and deregistered by the root project's principals;
//! a new edge takes the next of 65,536 ordinals, which sandbox ids carry.

use super::Decided;
use super::scope::{Scope, not_found};
use crate::validate::{self, LIMITS};
use crate::{Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::state::usage_to_pb;
use opendsec_projections::{Event, Right, Usage};
use std::collections::BTreeMap;

/// `RegisterEdge`.
pub(super) fn register(
    s: &Scope,
    edge: &str,
    address: &str,
    capacity: &Usage,
    labels: &BTreeMap<String, String>,
) -> Result<Decided, Rejection> {
    validate::name("edge", edge)?;
    validate::text("address", address, 255)?;
    if address.is_empty() {
        return Err(Rejection::field(K::Invalid, "address", "address must be host:port"));
    }
    validate::labels("labels", labels)?;
    validate::amount("capacity.sandboxes", capacity.sandboxes, LIMITS.sandboxes)?;
    validate::amount("capacity.cpu_millis", capacity.cpu_millis, LIMITS.cpu_millis)?;
    validate::amount("capacity.memory_mb", capacity.memory_mb, LIMITS.memory_mb)?;
    s.who.require(Right::EdgeWrite)?;
    s.require_root()?;
    // A live edge is registered again only by its own token or by an operator (with
    // project:write: an update that leaves it its token); a deregistered one may be taken
    // by another token.
    let live_owner = s
        .state
        .placement
        .edges
        .get(edge)
        .filter(|e| !e.deregistered)
        .map(|e| e.token.clone());
    if live_owner.is_some() && !s.who.rights.contains(&Right::ProjectWrite) {
        s.acts_for_edge("edge", edge).map_err(|r| {
            Rejection::field(
                r.kind,
                "edge",
                format!(
                    "{}; to move the name to another token, deregister it first (`opendsecctl edge deregister {edge}`)",
                    r.message
                ),
            )
        })?;
    }
    let ordinal = match s.state.placement.edges.get(edge) {
        Some(e) => e.ordinal,
        None if s.inflight.is_new_edge(edge) => {
            return Err(Rejection::field(
                K::Conflict,
                "edge",
                format!("edge {edge} is being registered"),
            ));
        }
        None => s.state.placement.next_ordinal + s.inflight.new_edge_count(),
    };
    if ordinal > 0xffff {
        return Err(Rejection::new(
            K::NoCapacity,
            "the cluster has used all 65,536 edge ordinals",
        ));
    }
    Ok(Decided::one(
        "",
        edge,
        Event::EdgeRegistered(pb::EdgeRegistered {
            id: edge.to_string(),
            ordinal,
            address: address.to_string(),
            capacity: Some(usage_to_pb(capacity)),
            labels: labels.clone(),
            token: live_owner.flatten().or_else(|| s.who.token.clone()).unwrap_or_default(),
        }),
    ))
}

/// `DeregisterEdge`.
pub(super) fn deregister(s: &Scope, edge: &str) -> Result<Decided, Rejection> {
    validate::id("edge", edge)?;
    if !s.state.placement.edges.contains_key(edge) {
        return Err(not_found("edge", "edge", edge));
    }
    s.who.require(Right::EdgeWrite)?;
    s.require_root()?;
    // An operator (with project:write) takes any edge out; an edge's token only its own.
    if !s.who.rights.contains(&Right::ProjectWrite) {
        s.acts_for_edge("edge", edge)?;
    }
    Ok(Decided::one(
        "",
        edge,
        Event::EdgeDeregistered(pb::EdgeDeregistered { id: edge.to_string() }),
    ))
}
