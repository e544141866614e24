//! Specification: replay checkpoints live as long as the history they serve. With an
//! archive retention, the log's history begins after the entries it let go; every
//! `checkpoint_prune_every` a node drops the checkpoints older than the one a replay of
//! its oldest retained entry starts from, so its checkpoint file does not grow forever.
//! A real single node (Raft, redb), in process.

use opendsec_commands::Command;
use opendsec_control::Credential;
use opendsec_control::testing::{TestNode, single_node_with};
use opendsec_projections::replay::Until;
use std::time::{Duration, Instant};

/// One write per number: a project `p<n>`.
async fn write_projects(t: &TestNode, numbers: std::ops::Range<u32>) {
    for i in numbers {
        let create = Command::CreateProject {
            name: format!("p{i}"),
            parent: t.root_project.clone(),
        };
        t.node
            .submit(Credential::Bearer(t.admin_token.clone()), format!("p{i}"), create)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_older_than_the_retained_history_are_dropped_and_the_rest_still_serve() {
    let t = single_node_with(|c| {
        c.checkpoint_every = 5;
        c.snapshot_every = 20;
        c.keep_after_snapshot = 0;
        c.archive_retention = Some(0);
        c.checkpoint_prune_every = Duration::from_millis(100);
    })
    .await;
    // 100 writes: 20 checkpoints, the 1st and the 17th with their whole requests window
    // (the others hold what changed since the one before, and need it).
    write_projects(&t, 0..100).await;
    t.node.log().trigger_snapshot().await.unwrap();
    let first = t.node.log().first_available_index().unwrap();
    assert!(first > 90, "history was let go (first available {first})");

    // The state at index 5 was a checkpoint; nothing of the log before `first` is left,
    // so once the checkpoint goes, that moment is no longer there to travel to.
    let deadline = Instant::now() + Duration::from_secs(20);
    let refused = loop {
        match t.node.replay(Until::Index(5)).await {
            Err(e) => break e.to_string(),
            Ok(s) => assert_eq!(s.index, 5, "answered from its checkpoint until pruned"),
        }
        assert!(Instant::now() < deadline, "the checkpoint at 5 was never pruned");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(refused.contains("no longer retained"), "{refused}");

    // The checkpoint a replay of the retained history starts from stays, and every
    // later one: that moment and, after more writes, the newest state both replay.
    let start = (first - 1) / 5 * 5;
    assert_eq!(t.node.replay(Until::Index(start)).await.unwrap().index, start);
    write_projects(&t, 100..112).await;
    let applied = t.node.applied_index();
    let now = t.node.replay(Until::Index(applied)).await.unwrap();
    assert_eq!(now.to_bytes(), t.node.read(|s| s.to_bytes()));
}
