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
    Ok(Decided::one(
        "",
        edge,
        Event::EdgeDeregistered(pb::EdgeDeregistered { id: edge.to_string() }),
    ))
}
