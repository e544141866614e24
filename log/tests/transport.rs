//! Specification: nodes replicate over one protocol on the peer port, inside mutual TLS,
//! opened with a versioned handshake. A peer offering only versions this node does not
//! speak is refused with a reason naming the versions spoken here; the current version is
//! accepted; and a peer that is not a control node of this cluster (no TLS, another CA's
//! certificate, an edge's certificate) learns nothing, not even the versions.

mod common;

use common::*;
use opendsec_log::handshake::HandshakeError;
use opendsec_log::replication::PROTOCOL;
use opendsec_trust::{Expect, Identity, Role, Trust};
use std::sync::Arc;
use std::time::Duration;

async fn one_node() -> (TestNode, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let l = free_listener().await;
    let cfg = config(1, dir.path(), l.local_addr().expect("addr"));
    (TestNode::start(cfg, l).await, dir)
}

/// Offers `versions` as `who` (over TLS with its certificate).
async fn offer(node: &TestNode, versions: &[u16], who: Arc<Trust>) -> Result<u16, HandshakeError> {
    let tcp = tokio::net::TcpStream::connect(node.addr).await.expect("connect");
    let open = async {
        let mut conn = who
            .connect(tcp, &Expect::Role(Role::Control))
            .await
            .map_err(|source| HandshakeError::Io {
                protocol: "tls",
                source,
            })?;
        PROTOCOL.offer(&mut conn, versions, &[]).await
    };
    tokio::time::timeout(Duration::from_secs(5), open)
        .await
        .expect("answered or closed")
}

fn control(id: u64) -> Arc<Trust> {
    opendsec_trust::test_trust(Identity::control(id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_offering_only_an_unknown_version_is_refused_with_the_versions_this_node_speaks() {
    let (node, _dir) = one_node().await;
    match offer(&node, &[9_999], control(2)).await {
        Err(HandshakeError::Refused { offered, reason, .. }) => {
            assert_eq!(offered, vec![9_999]);
            assert!(reason.contains(&format!("{:?}", PROTOCOL.versions)), "{reason}");
            assert!(reason.contains("9999"), "{reason}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_current_version_is_accepted_and_the_newest_common_one_chosen() {
    let (node, _dir) = one_node().await;
    let newest = *PROTOCOL.versions.last().expect("a version");
    assert_eq!(
        offer(&node, PROTOCOL.versions, control(2)).await.expect("accepted"),
        newest
    );
    assert_eq!(
        offer(&node, &[newest, 9_999], control(3)).await.expect("accepted"),
        newest
    );
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_is_not_a_control_node_of_this_cluster_is_closed_on_unanswered_whatever_it_offers() {
    let (node, _dir) = one_node().await;
    let strangers = [
        ("an edge", opendsec_trust::test_trust(Identity::edge("e1"))),
        ("a gateway", opendsec_trust::test_trust(Identity::gateway(1))),
        (
            "a control node of another CA",
            opendsec_trust::test_cluster(&[Identity::control(2)]).remove(0),
        ),
    ];
    for (who, trust) in strangers {
        for versions in [PROTOCOL.versions, &[9_999][..]] {
            match offer(&node, versions, trust.clone()).await {
                Err(HandshakeError::Io { .. }) => {}
                other => panic!("{who} offering {versions:?}: expected no answer, got {other:?}"),
            }
        }
    }
    // Without TLS at all: the handshake bytes are not even read as a protocol's.
    let mut tcp = tokio::net::TcpStream::connect(node.addr).await.expect("connect");
    let plain = tokio::time::timeout(
        Duration::from_secs(10),
        PROTOCOL.offer(&mut tcp, PROTOCOL.versions, &[]),
    )
    .await
    .expect("closed within the sorting deadline");
    assert!(
        matches!(plain, Err(HandshakeError::Io { .. } | HandshakeError::NotSpoken { .. })),
        "{plain:?}"
    );
    node.stop().await;
}
