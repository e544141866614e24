//! The control node: the write path (decide on the leader against applied state plus
//! the in-flight overlay, append to the Raft log, answer once applied), follower
//! forwarding (`forward`), replay from checkpoints, and the peer port's services
//! (`Control` for bootstrap, `EdgeSlice` for edges, whose contract is `opendsec_edge_api`).
//! This is the IO shell around the pure `commands` and `projections` crates.

pub mod admission;
pub mod forward;
pub mod fsm;
pub mod node;
pub mod peer;
pub mod rates;
pub mod slice;
pub mod testing;

pub use node::{ClusterStatus, ControlConfig, ControlNode, EdgeHeartbeat, PullProgress, SubmitError, Submitted};
// What the control plane shares with edges lives in the contract crate; re-exported for
// the gateway and the server, which use them beside the rest of this crate.
pub use opendsec_edge_api::{SandboxTokenKind, edge_key, now_ms, sandbox_token, transfer_token};

use opendsec_projections::Right;
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;

/// Generated peer-port types and the `Control` service (the `EdgeSlice` service is
/// [`opendsec_edge_api::pb`]).
pub mod pb {
    tonic::include_proto!("opendsec.control.v1");
}

/// What a write is made with.
#[derive(Clone)]
pub enum Credential {
    /// A bearer token (`odsec_<id>.<secret>` or an E2B key); authenticated on whichever node decides.
    Bearer(String),
    /// The control plane itself (bootstrap, timeouts). Never accepted from outside.
    System,
}

impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::Bearer(_) => f.write_str("Bearer(<redacted>)"),
            Credential::System => f.write_str("System"),
        }
    }
}

/// An authenticated token.
#[derive(Clone)]
pub struct Principal {
    pub token_id: String,
    pub project: String,
    pub rights: BTreeSet<Right>,
    pub expires_at_ms: Option<u64>,
    /// The bearer it was authenticated from, to make writes with.
    pub bearer: String,
}

impl Principal {
    pub fn credential(&self) -> Credential {
        Credential::Bearer(self.bearer.clone())
    }
    pub fn has(&self, r: Right) -> bool {
        self.rights.contains(&r)
    }
}

impl std::fmt::Debug for Principal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Principal")
            .field("token_id", &self.token_id)
            .field("project", &self.project)
            .finish_non_exhaustive()
    }
}

/// A fresh token secret and its SHA-256 (hex). Only the hash is ever logged.
pub fn new_token_secret() -> (String, String) {
    let bytes: [u8; 24] = rand::random();
    let secret = hex::encode(bytes);
    let hash = hex::encode(Sha256::digest(secret.as_bytes()));
    (secret, hash)
}

/// The bearer string users hold.
pub fn format_token(id: &str, secret: &str) -> String {
    format!("odsec_{id}.{secret}")
}

/// A fresh secret for an E2B API key (96 bits, 24 hex) and its SHA-256 (hex).
pub fn new_e2b_secret() -> (String, String) {
    let bytes: [u8; 12] = rand::random();
    let secret = hex::encode(bytes);
    let hash = hex::encode(Sha256::digest(secret.as_bytes()));
    (secret, hash)
}

/// An E2B API key: `e2b_` + 40 hex, the token id (16 hex) then its secret (24 hex),
/// the form E2B's SDKs accept. It is an ordinary token of its project.
pub fn format_e2b_key(id: &str, secret: &str) -> String {
    format!("e2b_{id}{secret}")
}

/// Splits a bearer into (token id, secret), for both forms: `odsec_<id>.<secret>`
/// and `e2b_<16 hex id><24 hex secret>`.
pub fn split_bearer(bearer: &str) -> Option<(&str, &str)> {
    if let Some(rest) = bearer.strip_prefix("odsec_") {
        return rest.split_once('.');
    }
    let rest = bearer.strip_prefix("e2b_")?;
    (rest.len() == 40 && rest.bytes().all(|b| b.is_ascii_hexdigit())).then(|| rest.split_at(16))
}

/// Writes `content` to `path`, readable by the owner only (keys, tokens, certificates'
/// keys), whole or not at all (see [`opendsec_trust::write_private`]).
pub fn write_private(path: &std::path::Path, content: &str) -> Result<(), String> {
    opendsec_trust::write_private(path, content).map_err(|e| e.to_string())
}

/// A fresh cluster key.
pub fn new_cluster_key() -> String {
    hex::encode(rand::random::<[u8; 32]>())
}

/// Serves the node's peer port until `shutdown`: the log's protocols (replication; Raft
/// votes and snapshots over gRPC), write forwarding ([`forward`]), and the gRPC services
/// `Control` (bootstrap) and `EdgeSlice`. How connections are sorted between them, and
/// why that holds under TLS: `opendsec_log::peer_port`.
pub async fn serve_peer(
    node: ControlNode,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let extra = opendsec_log::grpc_server()
        .add_service(pb::control_server::ControlServer::new(peer::ControlService::new(
            node.clone(),
        )))
        .add_service(opendsec_edge_api::pb::edge_slice_server::EdgeSliceServer::new(
            slice::EdgeSliceService::new(node.clone()),
        ));
    let forwarding = node.clone();
    let side = opendsec_log::SideProtocol {
        magic: forward::PROTOCOL.magic,
        serve: std::sync::Arc::new(move |conn| forward::serve(forwarding.clone(), conn)),
    };
    opendsec_log::serve_peer_with(listener, node.log(), Some(extra), Some(side), shutdown).await
}

#[cfg(test)]
mod write_private_tests {
    use super::write_private;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_private_file_is_replaced_whole_readable_by_its_owner_only_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cluster.key");
        write_private(&path, "first").unwrap();
        write_private(&path, "second").unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "second");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["cluster.key".to_string()]);
        let err = write_private(&dir.path().join("missing/dir/key"), "x").unwrap_err();
        assert!(err.contains("missing/dir/key"), "{err}");
    }
}
