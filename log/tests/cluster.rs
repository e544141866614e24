//! Three nodes over real gRPC on loopback: replication, leader failover, catch-up after restart.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_nodes_failover_and_catch_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let l = free_listener().await;
        let addr = l.local_addr().expect("addr");
        nodes.push(TestNode::start(config(id, dir.path(), addr), l).await);
    }
    let refs: Vec<&TestNode> = nodes.iter().collect();
    nodes[0].node.initialize(members(&refs)).await.expect("initialize");
    wait_leader(&refs, Duration::from_secs(5)).await;

    let mut last = 0;
    for i in 0..200u64 {
        last = propose(&refs, payload(i)).await.index;
    }
    for n in &nodes {
        n.node
            .wait_applied(last, Duration::from_secs(10))
            .await
            .expect("replicated");
    }
    let h0 = nodes[0].hash();
    assert_eq!(h0.0, 200);
    assert!(nodes.iter().all(|n| n.hash() == h0), "all states equal");
    // Every node sees the same membership with addresses.
    assert_eq!(nodes[2].node.status().membership.len(), 3);

    // Kill the leader.
    let li = wait_leader(&refs, Duration::from_secs(5)).await;
    drop(refs);
    let old = nodes.remove(li);
    let (old_id, old_addr) = (old.id, old.addr);
    let t = Instant::now();
    old.stop().await;
    let refs: Vec<&TestNode> = nodes.iter().collect();
    let new_leader = wait_leader(&refs, Duration::from_secs(3)).await;
    let elected = t.elapsed();
    eprintln!("new leader elected {elected:?} after the old one stopped");
    assert!(elected < Duration::from_secs(3));
    assert_ne!(nodes[new_leader].id, old_id);

    for i in 200..300u64 {
        last = propose(&refs, payload(i)).await.index;
    }
    drop(refs);

    // The old node comes back on the same address and catches up.
    let back = TestNode::start_on(config(old_id, dir.path(), old_addr), old_addr).await;
    nodes.push(back);
    let t = Instant::now();
    for n in &nodes {
        n.node
            .wait_applied(last, Duration::from_secs(10))
            .await
            .expect("caught up");
    }
    eprintln!("restarted node caught up in {:?}", t.elapsed());
    let h = nodes[0].hash();
    assert_eq!(h.0, 300);
    assert!(nodes.iter().all(|n| n.hash() == h), "all three states equal");
    for n in nodes {
        n.stop().await;
    }
}
