//! Specification: a token's authority is served only by a node that knows it is current.
//! Three real control nodes on 127.0.0.1. A token revoked through the leader is refused
//! by every node once the revocation is acknowledged (a node past its lease asks the
//! leader, which refuses the token); a node cut off from the leader and the other
//! follower stops serving within its lease (500 ms) instead of answering from a state
//! that may be stale, and serves again once it can confirm.

mod support;

use serde_json::{Value, json};
use std::time::{Duration, Instant};
use support::Cluster;

/// A little more than a node's lease (`opendsec_control::node::CURRENT_LEASE`).
const PAST_LEASE: Duration = Duration::from_millis(700);

async fn get(c: &Cluster, i: usize, token: &str) -> (u16, Value) {
    c.get(i, "/v1/whoami", token).await.expect("the node answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_revoked_token_is_refused_on_every_node_and_a_cut_off_node_serves_no_authority() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.leader().await.expect("a leader");
    let followers: Vec<usize> = (0..3).filter(|i| *i != leader).collect();

    // A token issued through the leader works on a follower (once it has the issue).
    let (s, issued) = cluster
        .post(
            leader,
            "/v1/tokens",
            &cluster.token,
            json!({"name": "worker", "rights": ["sandbox:read"]}),
        )
        .await
        .unwrap();
    assert_eq!(s, 201, "{issued}");
    let worker = issued["token"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&cluster, followers[0], &worker).await.0 != 200 {
        assert!(Instant::now() < deadline, "the follower never accepted the new token");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Revoked through the leader: refused on every node as soon as the revoke returns.
    tokio::time::sleep(PAST_LEASE).await;
    let id = issued["id"].as_str().unwrap();
    let r = cluster
        .http
        .delete(cluster.nodes[leader].url(&format!("/v1/tokens/{id}")))
        .bearer_auth(&cluster.token)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    for i in 0..3 {
        let (s, v) = get(&cluster, i, &worker).await;
        assert_eq!(s, 401, "node {i} still served the revoked token: {v}");
    }

    // Cut one follower off (the others stop answering): within its lease it stops serving
    // any token's authority, saying why, instead of answering from what it last applied.
    let cut = followers[0];
    for i in [leader, followers[1]] {
        cluster.nodes[i].stop();
    }
    tokio::time::sleep(PAST_LEASE).await;
    let started = Instant::now();
    let (s, v) = get(&cluster, cut, &cluster.token).await;
    assert_eq!(s, 503, "a cut-off node served authority it cannot confirm: {v}");
    assert!(
        v["message"]
            .as_str()
            .unwrap_or_default()
            .contains("cannot confirm it is current"),
        "{v}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the refusal took {:?}",
        started.elapsed()
    );

    // Joined again: it confirms and serves.
    for i in [leader, followers[1]] {
        cluster.nodes[i].cont();
    }
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (s, v) = get(&cluster, cut, &cluster.token).await;
        if s == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the node did not serve again: {s} {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_token_issued_through_one_node_is_honoured_at_once_by_every_node() {
    let cluster = Cluster::start(3).await;
    let leader = cluster.leader().await.expect("a leader");
    for round in 0..10 {
        let (s, issued) = cluster
            .post(
                leader,
                "/v1/tokens",
                &cluster.token,
                json!({"name": format!("fresh-{round}"), "rights": ["sandbox:read"]}),
            )
            .await
            .expect("issued");
        assert_eq!(s, 201, "{issued}");
        let token = issued["token"].as_str().unwrap().to_string();
        // No wait, no index header: a follower that has not applied the issue yet
        // catches up with the leader before it calls the token unknown.
        for i in (0..3).filter(|i| *i != leader) {
            let (s, v) = get(&cluster, i, &token).await;
            assert_eq!(s, 200, "node {} right after the issue: {v}", i + 1);
        }
    }
    // A token no node issued stays unknown everywhere.
    for i in 0..3 {
        let (s, v) = get(&cluster, i, "odsec_0123456789abcdef.0123456789abcdef0123456789abcdef").await;
        assert_eq!(s, 401, "{v}");
        assert!(v["message"].as_str().unwrap_or("").contains("unknown"), "{v}");
    }
}
