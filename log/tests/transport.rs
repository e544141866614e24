//! Specification: nodes replicate over plain connections on the peer port, and still
//! replicate to and from a node that only speaks the Raft gRPC service (an older
//! version): a leader finds that out when it opens the connection and uses gRPC.

mod common;

use common::*;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_a_grpc_only_node_replicates_both_ways() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut nodes = Vec::new();
    for id in 1..=3u64 {
        let l = free_listener().await;
        let cfg = config(id, dir.path(), l.local_addr().expect("addr"));
        // Node 3 speaks gRPC only.
        nodes.push(if id == 3 {
            TestNode::start_grpc_only(cfg, l).await
        } else {
            TestNode::start(cfg, l).await
        });
    }
    let refs: Vec<&TestNode> = nodes.iter().collect();
    nodes[0].node.initialize(members(&refs)).await.expect("initialize");
    wait_leader(&refs, Duration::from_secs(5)).await;
    for i in 0..100u64 {
        propose(&refs, payload(i)).await;
    }

    // Node 3 takes the lead (and reaches the others as any node does): its log is whole.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !nodes[2].node.status().is_leader {
        assert!(Instant::now() < deadline, "node 3 did not win an election");
        let _ = nodes[2].node.raft().trigger().elect(false).await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let mut last = 0;
    for i in 100..150u64 {
        last = nodes[2].node.propose(payload(i)).await.expect("node 3 leads").index;
    }
    for n in &nodes {
        n.node
            .wait_applied(last, Duration::from_secs(10))
            .await
            .expect("every node applies");
    }
    let h = nodes[2].hash();
    assert_eq!(h.0, 150);
    assert!(nodes.iter().all(|n| n.hash() == h), "all three states equal");
    drop(refs);
    for n in nodes {
        n.stop().await;
    }
}
