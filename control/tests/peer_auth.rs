//! Specification: the peer port knows its peers by their certificates (mutual TLS under
//! the cluster's CA). Raft and replication are spoken with control nodes only;
//! bootstrapping is for control nodes and operator tools on control hosts; a connection
//! without TLS, or with another CA's certificate, never reaches a protocol; forwarded
//! writes are authenticated again with the caller's own bearer token. The cluster key
//! never crosses the network.

use std::sync::Arc;

use opendsec_control::forward::Forwarder;
use opendsec_control::pb::control_client::ControlClient;
use opendsec_control::pb::{BootstrapRequest, SubmitRequest};
use opendsec_control::testing::{TestNode, single_node};
use opendsec_log::pb::RaftMessage;
use opendsec_log::pb::raft_service_client::RaftServiceClient;
use opendsec_trust::{Expect, Identity, Role, Trust};
use tonic::transport::{Channel, Endpoint};

/// A gRPC channel to the node's peer port as `who`.
fn channel(t: &TestNode, who: Arc<Trust>) -> Channel {
    Endpoint::from_shared(format!("http://{}", t.peer_addr))
        .unwrap()
        .connect_with_connector_lazy(opendsec_trust::tls_connector(who, Expect::Role(Role::Control)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_rpcs_from_anyone_but_a_control_node_are_refused() {
    let t = single_node().await;
    for who in [Identity::edge("e1"), Identity::gateway(1), Identity::operator("init")] {
        let mut raft = RaftServiceClient::new(channel(&t, t.peer_trust(who.clone())));
        let err = raft
            .vote(RaftMessage { payload: vec![1, 2, 3] })
            .await
            .expect_err("a vote from outside the control plane is refused");
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{who}: {err}");
        let err = raft
            .pre_vote(RaftMessage { payload: vec![1, 2, 3] })
            .await
            .expect_err("a pre-vote from outside the control plane is refused");
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{who}: {err}");
        let err = raft
            .append_one(RaftMessage { payload: vec![1, 2, 3] })
            .await
            .expect_err("a heartbeat from outside the control plane is refused");
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{who}: {err}");
    }
    // Another cluster's control node does not get through TLS.
    let stranger = opendsec_trust::test_cluster(&[Identity::control(2)]).remove(0);
    let err = RaftServiceClient::new(channel(&t, stranger))
        .vote(RaftMessage { payload: vec![1, 2, 3] })
        .await
        .expect_err("refused");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    // Plain HTTP/2 without TLS neither.
    let plain = Endpoint::from_shared(format!("http://{}", t.peer_addr))
        .unwrap()
        .connect_lazy();
    let err = RaftServiceClient::new(plain)
        .vote(RaftMessage { payload: vec![1, 2, 3] })
        .await
        .expect_err("refused");
    assert!(
        matches!(
            err.code(),
            // However hyper reports a connection closed on it: before or after it wrote
            // the request.
            tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal | tonic::Code::Cancelled
        ),
        "{err}"
    );
    assert_eq!(t.node.cluster_status().term, 1, "nothing disturbed the node's term");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_is_for_control_hosts_and_forwarded_writes_need_a_valid_token() {
    let t = single_node().await;
    let bootstrap = || BootstrapRequest {
        project_name: "x".into(),
        token_name: "y".into(),
        secret_sha256: "0".repeat(64),
        request_id: "r".into(),
    };
    for who in [Identity::edge("e1"), Identity::gateway(1)] {
        let err = ControlClient::new(channel(&t, t.peer_trust(who.clone())))
            .bootstrap(bootstrap())
            .await
            .expect_err("refused");
        assert_eq!(err.code(), tonic::Code::PermissionDenied, "{who}: {err}");
        assert!(err.message().contains("control hosts"), "{err}");
    }
    // An operator tool gets through to the decision: this cluster is bootstrapped already.
    let reply = ControlClient::new(channel(&t, t.peer_trust(Identity::operator("init"))))
        .bootstrap(bootstrap())
        .await
        .expect("answered")
        .into_inner();
    assert!(reply.rejection_json.contains("conflict"), "{reply:?}");

    let before = t.node.applied_index();
    let reply = Forwarder::new(t.peer_addr.clone(), t.peer_trust(Identity::control(2)))
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
async fn replication_connections_from_anyone_but_a_control_node_are_closed_unanswered() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let protocol = opendsec_log::replication::PROTOCOL;
    let t = single_node().await;
    // The opening (see `opendsec_log::handshake`): every version spoken, no credentials;
    // then an append request a peer would send, which must never reach Raft.
    let mut opening = vec![protocol.versions.len() as u8];
    for v in protocol.versions {
        opening.extend_from_slice(&v.to_be_bytes());
    }
    let mut hello = protocol.magic.to_vec();
    opendsec_log::frames::put(&mut hello, &opening);
    opendsec_log::frames::put(&mut hello, &[0u8; 64]);
    for who in [Identity::edge("e1"), Identity::gateway(1), Identity::operator("init")] {
        let tcp = tokio::net::TcpStream::connect(&t.peer_addr).await.unwrap();
        let mut conn = t
            .peer_trust(who.clone())
            .connect(tcp, &Expect::Role(Role::Control))
            .await
            .unwrap();
        conn.write_all(&hello).await.unwrap();
        let mut answer = Vec::new();
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), conn.read_to_end(&mut answer))
            .await
            .expect("closed");
        assert!(read.is_err() || answer.is_empty(), "{who} was answered {answer:?}");
    }
    // Without TLS, the same bytes are not read as a protocol's.
    let mut tcp = tokio::net::TcpStream::connect(&t.peer_addr).await.unwrap();
    tcp.write_all(&hello).await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), tcp.read_to_end(&mut answer))
        .await
        .expect("closed");
    assert!(
        read.is_err() || !answer.starts_with(&protocol.magic),
        "answered {answer:?}"
    );
    assert_eq!(t.node.cluster_status().term, 1, "nothing disturbed the node's term");
}
