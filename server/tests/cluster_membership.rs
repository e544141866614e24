//! Specification: members are added and removed through the REST API (what
//! `opendsecctl cluster add-node|remove-node` calls); a new member catches up and
//! holds the same views; a removed member no longer counts.

mod support;

use serde_json::json;
use std::time::Duration;
use support::Cluster;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_is_added_catches_up_and_another_is_removed() {
    let mut cluster = Cluster::start(3).await;
    cluster.register_edge("edge-a", 100).await;
    for _ in 0..20 {
        let (s, v) = cluster
            .post(0, "/v1/sandboxes", &cluster.token, json!({"image": "busybox"}))
            .await
            .unwrap();
        assert_eq!(s, 201, "{v}");
    }
    let fourth = cluster.spawn_extra(4).await;
    let leader = cluster.leader().await.expect("a leader");
    let addr = cluster.nodes[fourth].peer.clone();
    let (s, v) = cluster
        .post(
            leader,
            "/v1/cluster/members",
            &cluster.token,
            json!({"id": 4, "addr": addr}),
        )
        .await
        .unwrap();
    assert!(s < 300, "add member: {s} {v}");
    let statuses = cluster.wait_converged(Duration::from_secs(20)).await;
    assert_eq!(statuses.len(), 4);
    assert_eq!(statuses[fourth]["voters"], json!([1, 2, 3, 4]));

    // Remove node 3 (not the leader, so the request is served where it lands).
    let victim = (0..3).find(|&i| i != leader).unwrap();
    let id = cluster.nodes[victim].id;
    let r = cluster
        .http
        .delete(cluster.nodes[leader].url(&format!("/v1/cluster/members/{id}")))
        .bearer_auth(&cluster.token)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "remove member: {}", r.status());
    let (_, status) = cluster.get(leader, "/v1/cluster", &cluster.token).await.unwrap();
    let voters: Vec<u64> = status["voters"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert!(
        !voters.contains(&id) && voters.contains(&4),
        "voters after removal: {voters:?}"
    );

    // Both changes are in the audit view, with who asked and the result.
    for (action, node) in [("cluster.add_member", 4), ("cluster.remove_member", id)] {
        let (s, page) = cluster
            .get(leader, &format!("/v1/audit?action={action}"), &cluster.token)
            .await
            .unwrap();
        assert_eq!(s, 200, "{page}");
        let records = page["records"].as_array().unwrap();
        assert_eq!(records.len(), 1, "{page}");
        assert_eq!(records[0]["target"], format!("node:{node}"));
        assert_eq!(records[0]["result"], "ok");
        assert!(records[0]["principal"].as_str().unwrap().starts_with("token:"));
    }

    // Writes still commit with the new membership.
    let (s, v) = cluster
        .post(leader, "/v1/sandboxes", &cluster.token, json!({"image": "busybox"}))
        .await
        .unwrap();
    assert_eq!(s, 201, "{v}");
}
