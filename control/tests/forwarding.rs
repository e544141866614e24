//! Specification: a follower forwards writes to the leader over one framed protocol on
//! the peer port, opened with a versioned handshake. Each write is authenticated again
//! with its caller's token, replies find their writes whatever their order, a follower
//! offering only versions the leader does not speak is refused with a reason before any
//! write is sent, a connection from anyone but a control node of the cluster is closed on
//! before any frame is read, and a connection that breaks fails its writes and is replaced.

use opendsec_control::forward::{ForwardError, Forwarder, PROTOCOL};
use opendsec_control::pb::SubmitRequest;
use opendsec_control::peer::reply_to_result;
use opendsec_control::testing::single_node;
use opendsec_trust::Identity;
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
    let f = Forwarder::new(t.peer_addr.clone(), t.peer_trust(Identity::control(2)));
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
    let f = Forwarder::new(t.peer_addr.clone(), t.peer_trust(Identity::control(2)));
    let reply = f
        .submit(create_project("odsec_0123456789abcdef.forged", "x", &t.root_project))
        .await
        .expect("answered");
    assert!(reply.rejection_json.contains("unauthenticated"), "{reply:?}");
    assert_eq!(t.node.applied_index(), before, "nothing was logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_offering_only_an_unknown_version_is_refused_with_a_reason_and_nothing_is_sent() {
    let t = single_node().await;
    let before = t.node.applied_index();
    let f = Forwarder::offering(t.peer_addr.clone(), t.peer_trust(Identity::control(2)), &[9_999]);
    match f.submit(create_project(&t.admin_token, "x", &t.root_project)).await {
        Err(ForwardError::Refused(why)) => {
            assert!(why.contains("9999"), "{why}");
            assert!(why.contains(&format!("{:?}", PROTOCOL.versions)), "{why}");
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert!(f.is_closed());
    assert_eq!(t.node.applied_index(), before, "nothing was logged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_current_version_is_accepted_beside_unknown_newer_ones() {
    let t = single_node().await;
    let f = Forwarder::offering(t.peer_addr.clone(), t.peer_trust(Identity::control(2)), &[1, 9_999]);
    let reply = f
        .submit(create_project(&t.admin_token, "team", &t.root_project))
        .await
        .expect("forwarded");
    reply_to_result(reply).expect("decided");
    assert!(!f.is_closed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_the_leader_breaks_fails_its_waiting_writes_and_is_replaced() {
    // A leader that accepts the opening, takes the first write, then goes away.
    let leader = opendsec_trust::test_trust(Identity::control(1));
    let follower = opendsec_trust::test_trust(Identity::control(2));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (tcp, _) = l.accept().await.unwrap();
        let (mut conn, _) = leader.accept(tcp).await.unwrap();
        let hello = PROTOCOL.read_hello(&mut conn).await.unwrap();
        PROTOCOL
            .answer(&mut conn, &PROTOCOL.choose(&hello.versions))
            .await
            .unwrap();
        let mut first = Vec::new();
        let _ = opendsec_log::frames::read(&mut conn, &mut first).await;
    });
    let f = Forwarder::new(addr.clone(), follower);
    match tokio::time::timeout(
        std::time::Duration::from_secs(10),
        f.submit(create_project("t", "x", "p")),
    )
    .await
    .expect("failed in time")
    {
        Err(ForwardError::Failed(why)) => assert!(why.contains(&addr), "{why}"),
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(f.is_closed(), "a broken connection takes no more writes");
    assert!(f.submit(create_project("t", "y", "p")).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_leader_fails_the_write_and_closes_the_connection() {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    drop(l);
    let f = Forwarder::new(addr, opendsec_trust::test_trust(Identity::control(2)));
    match f.submit(create_project("t", "x", "p")).await {
        Err(ForwardError::Failed(why)) => assert!(why.contains("connecting"), "{why}"),
        other => panic!("expected a failure, got {other:?}"),
    }
    assert!(f.is_closed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarding_connection_from_outside_the_control_plane_is_closed_before_any_frame() {
    let t = single_node().await;
    let before = t.node.applied_index();
    for who in [Identity::edge("e1"), Identity::gateway(1), Identity::operator("init")] {
        let f = Forwarder::new(t.peer_addr.clone(), t.peer_trust(who.clone()));
        match f.submit(create_project(&t.admin_token, "x", &t.root_project)).await {
            Err(ForwardError::Failed(why)) => assert!(why.contains(&t.peer_addr), "{who}: {why}"),
            other => panic!("{who}: expected the connection closed, got {other:?}"),
        }
    }
    // A control node's certificate from another CA does not even complete TLS.
    let stranger = opendsec_trust::test_cluster(&[Identity::control(2)]).remove(0);
    let f = Forwarder::new(t.peer_addr.clone(), stranger);
    match f.submit(create_project(&t.admin_token, "x", &t.root_project)).await {
        Err(ForwardError::Failed(why)) => assert!(why.contains("TLS"), "{why}"),
        other => panic!("expected a TLS failure, got {other:?}"),
    }
    assert_eq!(t.node.applied_index(), before, "nothing was logged");
}
