//! Credentials derived from keys, so none of them is stored or sent ahead; a change here
//! is a change of the wire contract (hence the `v1` in each purpose).
//!
//! Only control nodes hold the cluster key. Each edge holds its own key, [`edge_key`] of
//! its name, which the control nodes derive too: with it, the edge checks what the
//! gateway and the control plane send it, the tokens of its own sandboxes and the
//! transfers it serves. Root on one edge host thus opens that edge's sandboxes, not the
//! cluster's, and cannot mint credentials another edge accepts.

use hmac::Mac;
use sha2::Sha256;

/// What a per-sandbox access token opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SandboxTokenKind {
    /// The agent (E2B `envdAccessToken`, sent as `X-Access-Token`).
    Agent,
    /// The sandbox's other ports (E2B `trafficAccessToken`).
    Traffic,
}

fn keyed(cluster_key: &str) -> hmac::Hmac<Sha256> {
    hmac::Hmac::<Sha256>::new_from_slice(cluster_key.as_bytes()).expect("HMAC takes any key length")
}

/// Edge `edge`'s own key: HMAC-SHA256 under the cluster key of its name. Control nodes
/// derive it for each edge; the edge is given it (`opendsec edge-key`) instead of the
/// cluster key.
pub fn edge_key(cluster_key: &str, edge: &str) -> String {
    let mut mac = keyed(cluster_key);
    mac.update(format!("opendsec edge key v1\0{edge}").as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// The access token of one sandbox: HMAC-SHA256 under its edge's key ([`edge_key`]), so
/// every control node and the sandbox's edge derive the same token without storing it.
pub fn sandbox_token(cluster_key: &str, kind: SandboxTokenKind, sandbox: &str) -> String {
    let mut mac = keyed(cluster_key);
    let purpose = match kind {
        SandboxTokenKind::Agent => "agent",
        SandboxTokenKind::Traffic => "traffic",
    };
    mac.update(format!("opendsec sandbox token v1\0{purpose}\0{sandbox}").as_bytes());
    hex::encode(&mac.finalize().into_bytes()[..20])
}

/// The credential an edge presents to pull transfer `transfer` (a snapshot, or a fork's
/// source state) from the edge that holds it: HMAC-SHA256 under the holding edge's key
/// of the transfer and the pulling edge's name, so it opens that one transfer for that
/// one edge. The holder checks it with its own key; the puller cannot derive it and asks
/// the control plane for it (`EdgeSlice.TransferToken`, only for a transfer of its own).
pub fn transfer_token(cluster_key: &str, transfer: &str, destination_edge: &str) -> String {
    let mut mac = keyed(cluster_key);
    mac.update(format!("opendsec transfer token v1\0{transfer}\0{destination_edge}").as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

/// The signature of a template file upload URL (E2B's SDK uploads a build's files to
/// the URL it is given, with no other credential): HMAC-SHA256 under the cluster key of
/// the template, the files' hash and the URL's expiry (Unix seconds), so any gateway
/// node checks it and it opens one upload, until it expires.
pub fn upload_signature(cluster_key: &str, template: &str, hash: &str, expires: u64) -> String {
    let mut mac = keyed(cluster_key);
    mac.update(format!("opendsec template upload v1\0{template}\0{hash}\0{expires}").as_bytes());
    hex::encode(mac.finalize().into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Fixed values: a token derived differently by a node of another version would lock
    // the gateway out of sandboxes, or an edge out of its transfers.
    #[test]
    fn tokens_are_stable_across_versions() {
        assert_eq!(
            sandbox_token("key", SandboxTokenKind::Agent, "sb1"),
            "d47935bb9afa6fb48bb0b27fc66b93a6ab150851"
        );
        assert_eq!(
            transfer_token("key", "t1", "e2"),
            "6e25db7d29381de8142eb2bbd759dc15b3fe329029abe7bb38e7f93fd3ec5d99"
        );
        assert_eq!(
            edge_key("key", "e1"),
            "843d6e2b6150dbbbdf0cce79cf3c07aa2a58ad2f783efa63f83b6450c666df84"
        );
    }

    #[test]
    fn each_token_opens_one_thing_only() {
        let agent = sandbox_token("key", SandboxTokenKind::Agent, "sb1");
        assert_ne!(agent, sandbox_token("key", SandboxTokenKind::Traffic, "sb1"));
        assert_ne!(agent, sandbox_token("key", SandboxTokenKind::Agent, "sb2"));
        assert_ne!(agent, sandbox_token("other", SandboxTokenKind::Agent, "sb1"));
        assert_ne!(edge_key("key", "e1"), edge_key("key", "e2"));
        assert_ne!(edge_key("key", "e1"), edge_key("other", "e1"));
        let t = transfer_token("key", "t1", "e2");
        assert_ne!(t, transfer_token("key", "t1", "e3"));
        assert_ne!(t, transfer_token("key", "t2", "e2"));
    }
}
