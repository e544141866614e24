//! Specification: nodes replicate over one protocol on the peer port, opened with a
//! versioned handshake. A peer offering only versions this node does not speak is refused
//! with a reason naming the versions spoken here; the current version is accepted; and a
//! peer without the cluster key learns nothing, not even the versions.

mod common;

use common::*;
use opendsec_log::handshake::HandshakeError;
use opendsec_log::replication::PROTOCOL;
use std::time::Duration;

async fn one_node(cluster_key: &str) -> (TestNode, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let l = free_listener().await;
    let mut cfg = config(1, dir.path(), l.local_addr().expect("addr"));
    cfg.cluster_key = cluster_key.into();
    (TestNode::start(cfg, l).await, dir)
}

async fn offer(node: &TestNode, versions: &[u16], key: &str) -> Result<u16, HandshakeError> {
    let mut conn = tokio::net::TcpStream::connect(node.addr).await.expect("connect");
    tokio::time::timeout(
        Duration::from_secs(5),
        PROTOCOL.offer(&mut conn, versions, key.as_bytes()),
    )
    .await
    .expect("answered or closed")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_offering_only_an_unknown_version_is_refused_with_the_versions_this_node_speaks() {
    let (node, _dir) = one_node("key").await;
    match offer(&node, &[9_999], "key").await {
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
    let (node, _dir) = one_node("key").await;
    let newest = *PROTOCOL.versions.last().expect("a version");
    assert_eq!(offer(&node, PROTOCOL.versions, "key").await.expect("accepted"), newest);
    assert_eq!(offer(&node, &[newest, 9_999], "key").await.expect("accepted"), newest);
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_without_the_cluster_key_is_closed_on_unanswered_whatever_it_offers() {
    let (node, _dir) = one_node("key").await;
    for (versions, key) in [
        (PROTOCOL.versions, "not-the-key"),
        (&[9_999][..], ""),
        (PROTOCOL.versions, ""),
    ] {
        match offer(&node, versions, key).await {
            Err(HandshakeError::Io { .. }) => {}
            other => panic!("offering {versions:?} with key {key:?}: expected no answer, got {other:?}"),
        }
    }
    node.stop().await;
}
