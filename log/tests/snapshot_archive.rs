//! Snapshots, purge into the archive, snapshot install on a new learner, archive retention.

mod common;

use std::time::Duration;

use common::*;
use opendsec_log::LogError;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_keeps_history_and_learner_installs_snapshot() {
    let dir = tempfile::tempdir().expect("tempdir");
    let l = free_listener().await;
    let addr = l.local_addr().expect("addr");
    let mut cfg = config(1, dir.path(), addr);
    cfg.snapshot_every = 100;
    cfg.keep_after_snapshot = 0;
    let n1 = TestNode::start(cfg.clone(), l).await;
    n1.node.initialize(members(&[&n1])).await.expect("initialize");
    wait_leader(&[&n1], Duration::from_secs(5)).await;

    let mut last = 0;
    for i in 0..1000u64 {
        last = n1.node.propose(payload(i)).await.expect("propose").index;
    }
    n1.node.trigger_snapshot().await.expect("snapshot");
    // The purge goes on after openraft was told it is done (the writer moves entries
    // to the archive in chunks, between appends): it completes.
    wait_until("log purged into the archive", Duration::from_secs(10), || {
        n1.node
            .storage_counts()
            .map(|(live, archived)| live < 100 && archived >= 900)
            .unwrap_or(false)
    })
    .await;

    // The whole history is still readable, in order.
    let all = n1.node.read_entries(1, last).expect("read_entries");
    assert_eq!(all.len(), 1000);
    for (k, (idx, p)) in all.iter().enumerate() {
        assert_eq!(p, &payload(k as u64));
        if k > 0 {
            assert!(*idx > all[k - 1].0);
        }
    }
    assert_eq!(n1.node.first_available_index().expect("first"), 1);
    // A sub-range.
    let mid = n1.node.read_entries(all[10].0, all[19].0).expect("range");
    assert_eq!(mid.len(), 10);
    assert_eq!(mid[0].1, payload(10));

    // A brand-new learner catches up through a snapshot install.
    let l2 = free_listener().await;
    let addr2 = l2.local_addr().expect("addr");
    let n2 = TestNode::start(config(2, dir.path(), addr2), l2).await;
    n1.node.add_learner(2, addr2.to_string()).await.expect("add learner");
    n2.node
        .wait_applied(last, Duration::from_secs(10))
        .await
        .expect("learner caught up");
    assert_eq!(n2.hash(), n1.hash());
    assert_eq!(n2.hash().0, 1000);
    // openraft records the installed snapshot (and purges below it) right after the state
    // machine was restored: poll.
    wait_until("learner snapshot recorded", Duration::from_secs(5), || {
        let st = n2.node.status();
        st.snapshot_index.is_some() && st.first_available_index > 1
    })
    .await;
    let first2 = n2.node.status().first_available_index;
    assert!(matches!(
        n2.node.read_entries(1, last),
        Err(LogError::NotAvailable { .. })
    ));

    // New writes reach the learner, and its subscribers.
    let mut sub = n2.node.subscribe();
    let a = n1.node.propose(payload(1000)).await.expect("propose");
    let ev = tokio::time::timeout(Duration::from_secs(5), sub.recv())
        .await
        .expect("event in time")
        .expect("event");
    assert_eq!(ev.index, a.index);
    n2.node
        .wait_applied(a.index, Duration::from_secs(5))
        .await
        .expect("applied");
    let tail = n2.node.read_entries(first2, a.index).expect("learner history");
    assert_eq!(tail.last().map(|e| e.1.clone()), Some(payload(1000)));

    // Restart of the purged leader: snapshot + re-applied tail give the same state.
    let before = n1.hash();
    n1.stop().await;
    let n1 = TestNode::start_on(cfg, addr).await;
    n1.node
        .wait_applied(a.index, Duration::from_secs(10))
        .await
        .expect("restored");
    assert_eq!(n1.hash(), before);
    assert_eq!(
        n1.node.read_entries(1, a.index).expect("history after restart").len(),
        1001
    );
    n2.stop().await;
    n1.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn archive_retention_keeps_newest_entries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let l = free_listener().await;
    let addr = l.local_addr().expect("addr");
    let mut cfg = config(1, dir.path(), addr);
    cfg.snapshot_every = 50;
    cfg.keep_after_snapshot = 0;
    cfg.archive_retention = Some(100);
    let n = TestNode::start(cfg, l).await;
    n.node.initialize(members(&[&n])).await.expect("initialize");
    wait_leader(&[&n], Duration::from_secs(5)).await;
    let mut indexes = Vec::new();
    for i in 0..500u64 {
        indexes.push(n.node.propose(payload(i)).await.expect("propose").index);
    }
    let last = *indexes.last().expect("some");
    // A snapshot asked for while an automatic one (every 50 entries) is being built is
    // dropped: ask until one covers the last entry.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while n.node.status().snapshot_index < Some(last) {
        assert!(std::time::Instant::now() < deadline, "no snapshot covered index {last}");
        n.node.trigger_snapshot().await.expect("snapshot");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_until("log purged", Duration::from_secs(10), || {
        n.node.storage_counts().map(|(live, _)| live == 0).unwrap_or(false)
    })
    .await;
    let (_, archived) = n.node.storage_counts().expect("counts");
    assert_eq!(archived, 100, "only the newest 100 archived entries remain");
    let first = n.node.first_available_index().expect("first");
    assert_eq!(
        first,
        indexes[399] + 1,
        "history starts right after the newest dropped entry"
    );
    let kept = n.node.read_entries(first, last).expect("kept history");
    assert_eq!(kept.len(), 100);
    assert_eq!(kept[0], (indexes[400], payload(400)));
    assert!(
        matches!(n.node.read_entries(1, last), Err(LogError::NotAvailable { first_available, .. }) if first_available == first)
    );
    n.stop().await;
}
