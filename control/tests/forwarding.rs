//! Specification: a follower forwards writes to the leader over a plain framed
//! connection on the peer port. Each write is authenticated again with its caller's
//! token, replies find their writes whatever their order, and a leader that does not
//! speak the protocol is found out before any write is sent, so the write can go by gRPC.

use opendsec_control::forward::{ForwardError, RawForwarder};
use opendsec_control::pb::SubmitRequest;
use opendsec_control::peer::reply_to_result;
use opendsec_control::testing::single_node;
use serde_json::json;

fn create_project(bearer: &str, name: &str, parent: &str) -> SubmitRequest {
    SubmitRequest {
        bearer: bearer.into(),
        request_id: format!("create-{name}"),
        command_json: json!({"command": "create_project", "name": name, "parent": parent}).to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_forwarded_on_a_plain_connection_are_decided_by_the_leader_each_with_its_own_reply() {
    let t = single_node().await;
    let f = RawForwarder::new(t.peer_addr.clone());
    let calls: Vec<_> = (0..40)
        .map(|n| {
            let (f, req) = (
                f.clone(),
                create_project(&t.admin_token, &format!("team-{n}"), &t.root_project),
            );
            tokio::spawn(async move { f.submit(req).await })
        })
        .collect();
    let mut indexes = Vec::new();
    for (n, call) in calls.into_iter().enumerate() {
        let reply = call.await.unwrap().expect("forwarded");
        let submitted = reply_to_result(reply).expect("decided");
        assert!(
            submitted
                .decided
                .events
                .iter()
                .any(|e| format!("{e:?}").contains(&format!("team-{n}"))),
            "write {n} got another write's reply"
        );
        indexes.push(submitted.index);
    }
    indexes.sort();
    indexes.dedup();
    assert_eq!(indexes.len(), 40, "each write has an index of its own");
    assert!(!f.is_closed(), "the connection stays open for the next writes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_token_is_refused_by_the_leader_and_nothing_is_logged() {
    let t = single_node().await;
    let before = t.node.applied_index();
    let f = RawForwarder::new(t.peer_addr.clone());
    let reply = f
        .submit(create_project("odsec_0123456789abcdef.forged", "x", &t.root_project))
        .await
        .expect("answered");
    assert!(reply.rejection_json.contains("unauthenticated"), "{reply:?}");
    assert_eq!(t.node.applied_index(), before, "nothing was logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_without_the_protocol_is_found_out_before_a_write_is_sent() {
    // A gRPC-only server, as an older node's peer port: it takes the magic for a bad
    // HTTP/2 preface.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let dir = tempfile::tempdir().unwrap();
    let log = opendsec_log::LogNode::open(
        opendsec_log::LogConfig::new(1, dir.path(), addr.clone()),
        opendsec_control::fsm::Fsm::new(1000, None, None),
    )
    .await
    .unwrap();
    let served = log.clone();
    tokio::spawn(async move { opendsec_log::serve_peer(l, &served, None, std::future::pending()).await });
    let f = RawForwarder::new(addr);
    let err = f
        .submit(create_project("t", "x", "p"))
        .await
        .expect_err("not spoken there");
    assert_eq!(err, ForwardError::Unsupported);
    assert!(f.is_unsupported() && f.is_closed());
    assert_eq!(
        f.submit(create_project("t", "y", "p")).await.expect_err("still not"),
        ForwardError::Unsupported
    );
    log.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_leader_fails_the_write_and_closes_the_connection() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let f = RawForwarder::new(addr);
    match f.submit(create_project("t", "x", "p")).await {
        Err(ForwardError::Failed(why)) => assert!(why.contains("connecting"), "{why}"),
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(f.is_closed() && !f.is_unsupported());
}
