//! The contract between the control plane (and the gateway) and an edge: what crosses
//! that boundary and nothing else, so an edge builds without the control plane (and its
//! Raft log). Both sides depend on this crate; neither redefines what it holds.
//!
//! - [`pb`]: the `EdgeSlice` gRPC service (register, watch a slice, report, heartbeat)
//!   and its messages; [`convert`] maps its enums onto the projections' types, refusing
//!   values this binary does not know.
//! - [`slice`]: what an edge's slice of the log is, as a pure function of the views.
//! - [`admission`]: `POST /admit` on an edge's proxy.
//! - [`headers`]: every HTTP header name the gateway, the control plane and edges share.
//! - [`tokens`]: the credentials derived from the cluster key (sandbox access tokens,
//!   transfer tokens), which both sides derive without storing or sending them.

pub mod admission;
pub mod convert;
pub mod headers;
pub mod slice;
pub mod tokens;

pub use convert::UnknownEnum;
pub use tokens::{SandboxTokenKind, edge_key, sandbox_token, transfer_token};

/// Generated `EdgeSlice` types and service (package `opendsec.edge.v1`).
pub mod pb {
    tonic::include_proto!("opendsec.edge.v1");
}

/// Wall-clock milliseconds since the Unix epoch (the IO shells' clock; the pure crates
/// are given time, never read it).
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
