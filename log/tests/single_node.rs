//! One node: 1,000 ordered proposals, concurrent proposals, restart from disk.

mod common;

use std::time::{Duration, Instant};

use common::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_propose_restart_continue() {
    let dir = tempfile::tempdir().expect("tempdir");
    let listener = free_listener().await;
    let addr = listener.local_addr().expect("addr");
    let n = TestNode::start(config(1, dir.path(), addr), listener).await;
    n.node.initialize(members(&[&n])).await.expect("initialize");
    n.node
        .initialize(members(&[&n]))
        .await
        .expect("initialize is idempotent");
    wait_leader(&[&n], Duration::from_secs(5)).await;

    let t = Instant::now();
    let mut last_index = 0;
    for i in 0..1000u64 {
        let a = n.node.propose(payload(i)).await.expect("propose");
        assert!(a.index > last_index, "indexes increase");
        last_index = a.index;
        assert_eq!(a.response, (i + 1).to_be_bytes().to_vec(), "responses in order");
    }
    eprintln!("1000 sequential proposals: {:?}", t.elapsed());

    // Concurrent proposals share durable commits; all are applied exactly once.
    let t = Instant::now();
    let futs: Vec<_> = (1000..1200u64)
        .map(|i| {
            let node = n.node.clone();
            tokio::spawn(async move { node.propose(payload(i)).await })
        })
        .collect();
    for f in futs {
        let a = f.await.expect("join").expect("propose");
        last_index = last_index.max(a.index);
    }
    eprintln!("200 concurrent proposals: {:?}", t.elapsed());

    let (count, hash) = n.hash();
    assert_eq!(count, 1200);
    let entries = n.node.read_entries(1, last_index).expect("read_entries");
    assert_eq!(entries.len(), 1200);
    assert_eq!(&entries[0].1, &payload(0));
    let st = n.node.status();
    assert_eq!(st.last_applied, Some(last_index));
    assert_eq!(st.leader_id, Some(1));

    // Subscribers see applied entries.
    let mut sub = n.node.subscribe();
    let a = n.node.propose(payload(5000)).await.expect("propose");
    let ev = sub.recv().await.expect("event");
    assert_eq!(ev.index, a.index);
    assert_eq!(&*ev.payload, &payload(5000)[..]);
    let (count, hash) = {
        let _ = (count, hash);
        n.hash()
    };
    let last_index = a.index;

    n.stop().await;

    // Restart from the same directory: the same state, then more writes.
    let n = TestNode::start_on(config(1, dir.path(), addr), addr).await;
    n.node
        .wait_applied(last_index, Duration::from_secs(10))
        .await
        .expect("restored");
    assert_eq!(
        n.hash(),
        (count, hash),
        "restored state equals the state before restart"
    );
    wait_leader(&[&n], Duration::from_secs(5)).await;
    let a = n.node.propose(payload(6000)).await.expect("propose after restart");
    assert!(a.index > last_index);
    assert_eq!(a.response, ((count + 1) as u64).to_be_bytes().to_vec());
    n.stop().await;
}
