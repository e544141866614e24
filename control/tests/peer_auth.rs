//! Specification: the peer port refuses whoever lacks the cluster's credentials.
//! Raft RPCs and replication connections need the cluster key, bootstrapping needs the
//! cluster key, forwarded writes are authenticated again with the caller's own bearer
//! token.

use opendsec_control::forward::Forwarder;
use opendsec_control::pb::control_client::ControlClient;
use opendsec_control::pb::{BootstrapRequest, SubmitRequest};
use opendsec_control::testing::single_node;
use opendsec_log::pb::RaftMessage;
use opendsec_log::pb::raft_service_client::RaftServiceClient;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_rpcs_without_the_cluster_key_are_refused() {
    let t = single_node().await;
    let mut raft = RaftServiceClient::connect(format!("http://{}", t.peer_addr))
        .await
        .unwrap();
    for key in ["", "not-the-key"] {
        let err = raft
            .vote(RaftMessage {
                payload: vec![1, 2, 3],
                cluster_key: key.into(),
            })
            .await
            .expect_err("a vote without the key is refused");
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
        let err = raft
            .pre_vote(RaftMessage {
                payload: vec![1, 2, 3],
                cluster_key: key.into(),
            })
            .await
            .expect_err("a pre-vote without the key is refused");
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{err}");
    }
    assert_eq!(t.node.cluster_status().term, 1, "nothing disturbed the node's term");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_needs_the_cluster_key_and_forwarded_writes_need_a_valid_token() {
    let t = single_node().await;
    let mut control = ControlClient::connect(format!("http://{}", t.peer_addr)).await.unwrap();
    let err = control
        .bootstrap(BootstrapRequest {
            cluster_key: "guess".into(),
            project_name: "x".into(),
            token_name: "y".into(),
            secret_sha256: "0".repeat(64),
            request_id: "r".into(),
        })
        .await
        .expect_err("wrong key");
    assert_eq!(err.code(), tonic::Code::PermissionDenied);

    let before = t.node.applied_index();
    let reply = Forwarder::new(t.peer_addr.clone(), &t.node.config().cluster_key)
        .submit(SubmitRequest {
            bearer: "odsec_0123456789abcdef.forged".into(),
            request_id: "r".into(),
            command_json: r#"{"command":"kill_sandbox","sandbox":"00000000000000000000"}"#.into(),
        })
        .await
        .expect("answered");
    assert!(reply.rejection_json.contains("unauthenticated"), "{reply:?}");
    assert_eq!(t.node.applied_index(), before, "nothing was logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_connections_without_the_cluster_key_are_closed_unanswered() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let protocol = opendsec_log::replication::PROTOCOL;
    let t = single_node().await;
    for key in ["", "not-the-key"] {
        let mut conn = tokio::net::TcpStream::connect(&t.peer_addr).await.unwrap();
        // The opening (see `opendsec_log::handshake`): every version spoken, then the key.
        let mut opening = vec![protocol.versions.len() as u8];
        for v in protocol.versions {
            opening.extend_from_slice(&v.to_be_bytes());
        }
        opening.extend_from_slice(key.as_bytes());
        let mut hello = protocol.magic.to_vec();
        opendsec_log::frames::put(&mut hello, &opening);
        // Then an append request a peer would send, which must never reach Raft.
        opendsec_log::frames::put(&mut hello, &[0u8; 64]);
        conn.write_all(&hello).await.unwrap();
        let mut answer = Vec::new();
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), conn.read_to_end(&mut answer))
            .await
            .expect("closed");
        assert!(read.is_err() || answer.is_empty(), "answered {answer:?}");
    }
    assert_eq!(t.node.cluster_status().term, 1, "nothing disturbed the node's term");
}
