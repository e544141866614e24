//! Specification of the edge slice API, driven by the edge's own client against a
//! real control node (Raft + redb + gRPC on loopback): register, watch from any index,
//! resume after a disconnect, get a snapshot first when history was compacted away,
//! report observations, and send heartbeats that are never logged.

use opendsec_commands::{Command, Observation};
use opendsec_control::Credential;
use opendsec_control::testing::{TestNode, single_node, single_node_with};
use opendsec_edge::slice::{SliceClient, SliceFollower};
use opendsec_edge_api::pb::{Capacity, HeartbeatRequest, SliceEntry, slice_message::Body};
use opendsec_projections::{Event, Observed};
use opendsec_trust::Identity;
use std::collections::BTreeMap;
use std::time::Duration;

/// The slice client of edge `edge` (its certificate from the node's CA) with `token`.
fn client(t: &TestNode, token: &str, edge: &str) -> SliceClient {
    SliceClient::connect(&t.peer_addr, token, t.peer_trust(Identity::edge(edge))).unwrap()
}

fn capacity() -> Capacity {
    Capacity {
        sandboxes: 100,
        cpu_millis: 100_000,
        memory_mb: 100_000,
    }
}

async fn create_sandbox(t: &TestNode) -> String {
    let cmd = Command::CreateSandbox {
        opts: Default::default(),
        project: t.root_project.clone(),
        image: "busybox".into(),
        cpu_millis: 100,
        memory_mb: 64,
        labels: BTreeMap::new(),
        timeout_seconds: None,
    };
    as_admin(t, cmd).await.decided.target
}

/// Submits `cmd` with the admin's token.
async fn as_admin(t: &TestNode, cmd: Command) -> opendsec_control::node::Submitted {
    t.node
        .submit(
            Credential::Bearer(t.admin_token.clone()),
            uuid::Uuid::new_v4().to_string(),
            cmd,
        )
        .await
        .expect("the admin's write")
}

/// A token of the root project with `rights` (edge:write alone is what `opendsec edge` gets).
async fn token_with(t: &TestNode, name: &str, rights: Vec<opendsec_projections::Right>) -> String {
    let (secret, hash) = opendsec_control::new_token_secret();
    let cmd = Command::IssueToken {
        project: t.root_project.clone(),
        name: name.into(),
        rights,
        ttl_seconds: None,
        secret_sha256: hash,
    };
    opendsec_control::format_token(&as_admin(t, cmd).await.decided.target, &secret)
}

async fn next_entry(f: &mut SliceFollower) -> SliceEntry {
    loop {
        let m = tokio::time::timeout(Duration::from_secs(10), f.next())
            .await
            .expect("a slice message within 10 s");
        if let Some(Body::Entry(e)) = m.body {
            return e;
        }
    }
}

fn created_id(e: &SliceEntry) -> Option<(String, String)> {
    e.events.iter().find_map(|env| match Event::from_envelope(env) {
        Ok(Event::SandboxCreated(c)) => Some((c.id, c.edge)),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_registers_watches_its_slice_and_reports() {
    let t = single_node().await;
    let mut client = client(&t, &t.admin_token, "edge-1");
    let (ordinal, _) = client
        .register("edge-1", "127.0.0.1:9", capacity(), BTreeMap::new())
        .await
        .unwrap();
    assert_eq!(ordinal, 0);

    let id = create_sandbox(&t).await;
    assert!(id.ends_with("0000"), "sandbox id {id} names edge ordinal 0");

    let mut follower = SliceFollower::new(client.clone(), "edge-1", 1);
    let first = next_entry(&mut follower).await;
    assert_eq!(first.events[0].r#type, "EdgeRegistered");
    let created = next_entry(&mut follower).await;
    assert_eq!(created_id(&created), Some((id.clone(), "edge-1".to_string())));

    // The edge's observation becomes an event in its own slice and changes the view.
    client.report(&id, &Observation::Ready, "ready-1").await.unwrap();
    let ready = next_entry(&mut follower).await;
    assert_eq!(ready.events[0].r#type, "SandboxReady");
    assert_eq!(t.node.read(|s| s.sandboxes.sandboxes[&id].observed), Observed::Ready);

    // Heartbeats are soft state: held in memory, never logged.
    let before = t.node.applied_index();
    client
        .heartbeat(HeartbeatRequest {
            edge: "edge-1".into(),
            running_sandboxes: 1,
            cpu_millis_used: 5,
            memory_mb_used: 7,
            pulls: vec![],
        })
        .await
        .unwrap();
    assert_eq!(t.node.applied_index(), before);
    let hb = t.node.edge_heartbeats();
    assert_eq!((hb.len(), hb[0].memory_mb_used), (1, 7));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_resumes_after_a_disconnect_without_loss_or_repeat() {
    let t = single_node().await;
    let mut client = client(&t, &t.admin_token, "edge-1");
    client
        .register("edge-1", "127.0.0.1:9", capacity(), BTreeMap::new())
        .await
        .unwrap();
    let mut follower = SliceFollower::new(client.clone(), "edge-1", 1);
    let a = create_sandbox(&t).await;
    next_entry(&mut follower).await; // EdgeRegistered
    let first = next_entry(&mut follower).await;
    assert_eq!(created_id(&first).map(|c| c.0), Some(a));

    follower.disconnect();
    let b = create_sandbox(&t).await;
    let c = create_sandbox(&t).await;
    let mut ids = vec![];
    let mut indexes = vec![first.index];
    for _ in 0..2 {
        let e = next_entry(&mut follower).await;
        indexes.push(e.index);
        ids.extend(created_id(&e).map(|c| c.0));
    }
    assert_eq!(
        ids,
        vec![b, c],
        "after resuming, exactly the entries written meanwhile arrive, once"
    );
    assert!(indexes.windows(2).all(|w| w[0] < w[1]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_of_other_edges_are_not_in_the_slice() {
    let t = single_node().await;
    let mut client = client(&t, &t.admin_token, "edge-1");
    let one = Capacity {
        sandboxes: 1,
        cpu_millis: 1000,
        memory_mb: 1000,
    };
    client
        .register("edge-1", "127.0.0.1:9", one, BTreeMap::new())
        .await
        .unwrap();
    self::client(&t, &t.admin_token, "edge-2")
        .register("edge-2", "127.0.0.1:10", one, BTreeMap::new())
        .await
        .unwrap();
    let x = create_sandbox(&t).await;
    let y = create_sandbox(&t).await;
    let edge_of = |id: &str| t.node.read(|s| s.sandboxes.sandboxes[id].edge.clone());
    assert_ne!(edge_of(&x), edge_of(&y), "each edge had room for one");

    let mut f = SliceFollower::new(client.clone(), "edge-1", 1);
    let mut created = vec![];
    // Read until the follower has caught up with everything applied so far.
    while f.next_index() <= t.node.applied_index() {
        let m = tokio::time::timeout(Duration::from_secs(10), f.next()).await.unwrap();
        if let Some(Body::Entry(e)) = m.body {
            created.extend(created_id(&e));
        }
    }
    assert_eq!(created.len(), 1, "only edge-1's sandbox: {created:?}");
    assert_eq!(created[0].1, "edge-1");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_behind_compaction_gets_a_snapshot_of_its_slice_first() {
    let t = single_node_with(|c| {
        c.snapshot_every = 20;
        c.keep_after_snapshot = 0;
        c.archive_retention = Some(0);
    })
    .await;
    let mut client = client(&t, &t.admin_token, "edge-1");
    client
        .register("edge-1", "127.0.0.1:9", capacity(), BTreeMap::new())
        .await
        .unwrap();
    let mut ids = vec![];
    for _ in 0..30 {
        ids.push(create_sandbox(&t).await);
    }
    let kill = Command::KillSandbox {
        sandbox: ids[0].clone(),
    };
    t.node
        .submit(Credential::Bearer(t.admin_token.clone()), "kill".into(), kill)
        .await
        .unwrap();
    t.node.log().trigger_snapshot().await.unwrap();
    let first = t.node.log().first_available_index().unwrap();
    assert!(first > 1, "history was compacted away (first available {first})");

    let mut stream = client.watch("edge-1", 1).await.unwrap();
    let m = stream.message().await.unwrap().unwrap();
    let Some(Body::Snapshot(snap)) = m.body else {
        panic!("expected a snapshot first, got {m:?}")
    };
    assert_eq!(
        snap.sandboxes.len(),
        29,
        "the live sandboxes of the slice (one was killed)"
    );
    assert!(snap.index + 1 >= first);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slice_api_needs_an_edge_token() {
    let t = single_node().await;
    let mut nobody = client(&t, "odsec_0000000000000000.nope", "edge-1");
    let err = nobody.watch("edge-1", 1).await.expect_err("refused");
    assert!(err.to_string().contains("unknown"), "{err}");

    // A token without edge:write cannot register, watch or report.
    let reader = token_with(&t, "reader", vec![opendsec_projections::Right::SandboxRead]).await;
    let mut c = client(&t, &reader, "edge-1");
    let err = c
        .register("edge-1", "127.0.0.1:9", capacity(), BTreeMap::new())
        .await
        .expect_err("refused");
    assert!(err.to_string().contains("edge:write"), "{err}");
}

async fn edge_token(t: &TestNode, name: &str) -> String {
    token_with(t, name, vec![opendsec_projections::Right::EdgeWrite]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_token_acts_for_its_own_edge_only() {
    let t = single_node().await;
    let (token_a, token_b) = (edge_token(&t, "edge-a").await, edge_token(&t, "edge-b").await);
    let mut a = client(&t, &token_a, "edge-a");
    // B's token with edge A's certificate (as if B had stolen it): the token decides.
    let mut b = client(&t, &token_b, "edge-a");
    let mut b_own = client(&t, &token_b, "edge-b");
    a.register("edge-a", "127.0.0.1:9", capacity(), BTreeMap::new())
        .await
        .unwrap();
    let id = create_sandbox(&t).await; // placed on edge-a, the only edge
    b_own
        .register("edge-b", "127.0.0.1:10", capacity(), BTreeMap::new())
        .await
        .unwrap();
    let denied = |e: opendsec_edge::slice::SliceError| {
        let m = e.to_string();
        assert!(m.contains("registered by another token"), "{m}");
    };

    // B's token cannot read A's slice (tenants' env rides in it), spoof A's heartbeats,
    // report A's sandbox ended, or take A's name to another address.
    denied(b.watch("edge-a", 1).await.expect_err("watching another edge's slice"));
    denied(
        b.heartbeat(HeartbeatRequest {
            edge: "edge-a".into(),
            ..Default::default()
        })
        .await
        .expect_err("a heartbeat for another edge"),
    );
    denied(
        b.report(
            &id,
            &Observation::Exited {
                exit_code: 1,
                oom_killed: false,
                reason: "forged".into(),
            },
            "forged",
        )
        .await
        .expect_err("a report on another edge's sandbox"),
    );
    denied(
        b.register("edge-a", "127.0.0.1:11", capacity(), BTreeMap::new())
            .await
            .expect_err("registering another edge's name"),
    );
    // Nor get a transfer's token in A's name; and B's own name opens only transfers its
    // own live sandboxes start from (it has none): the holding edge's key stays unknown.
    denied(
        b.transfer_token("edge-a", &format!("fork-{id}"))
            .await
            .expect_err("a transfer token for another edge"),
    );
    let m = b_own
        .transfer_token("edge-b", &format!("fork-{id}"))
        .await
        .expect_err("a transfer no sandbox of edge-b starts from")
        .to_string();
    assert!(m.contains("no live sandbox of edge edge-b starts from"), "{m}");
    let (observed, address) = t.node.read(|s| {
        (
            s.sandboxes.sandboxes[&id].observed,
            s.placement.edges["edge-a"].address.clone(),
        )
    });
    assert_eq!(
        (observed, address.as_str()),
        (Observed::Pending, "127.0.0.1:9"),
        "nothing changed"
    );
    // Each denied write is in the audit as denied, with the token that asked.
    let denied_reports = t.node.read(|s| {
        s.audit
            .records
            .iter()
            .filter(|r| {
                r.action == "sandbox.report" && matches!(r.result, opendsec_projections::AuditResult::Denied { .. })
            })
            .count()
    });
    assert_eq!(denied_reports, 1);

    // A's own token does all of it.
    let mut watch = a.watch("edge-a", 1).await.unwrap();
    assert!(watch.message().await.unwrap().is_some());
    a.heartbeat(HeartbeatRequest {
        edge: "edge-a".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    a.report(&id, &Observation::Ready, "ready").await.unwrap();
    a.register("edge-a", "127.0.0.1:12", capacity(), BTreeMap::new())
        .await
        .unwrap();

    // An operator (project:write) may update A's registration; A keeps its token.
    let cmd = Command::RegisterEdge {
        edge: "edge-a".into(),
        address: "127.0.0.1:12".into(),
        capacity: opendsec_projections::Usage {
            sandboxes: 5,
            cpu_millis: 5000,
            memory_mb: 5000,
            metadata_bytes: 0,
        },
        labels: BTreeMap::new(),
    };
    as_admin(&t, cmd).await;
    a.heartbeat(HeartbeatRequest {
        edge: "edge-a".into(),
        ..Default::default()
    })
    .await
    .unwrap();
    denied(b.watch("edge-a", 1).await.expect_err("still not B's"));

    // And B's own certificate acts for B only, whatever the token says.
    for (what, e) in [
        ("watch", b_own.watch("edge-a", 1).await.err()),
        (
            "register",
            b_own
                .register("edge-a", "127.0.0.1:11", capacity(), BTreeMap::new())
                .await
                .err(),
        ),
    ] {
        let m = e.unwrap_or_else(|| panic!("{what} refused")).to_string();
        assert!(
            m.contains("edge edge-b's certificate does not act for edge edge-a"),
            "{what}: {m}"
        );
    }

    // Once an operator deregisters A, another token may take its name.
    let cmd = Command::DeregisterEdge { edge: "edge-a".into() };
    as_admin(&t, cmd).await;
    b.register("edge-a", "127.0.0.1:13", capacity(), BTreeMap::new())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slice_api_serves_edges_by_their_certificates_only() {
    let t = single_node().await;
    for who in [Identity::control(2), Identity::gateway(1), Identity::operator("init")] {
        let mut c = SliceClient::connect(&t.peer_addr, &t.admin_token, t.peer_trust(who.clone())).unwrap();
        let m = c
            .register("edge-1", "127.0.0.1:9", capacity(), BTreeMap::new())
            .await
            .expect_err("refused")
            .to_string();
        assert!(m.contains("serves edges by their certificates"), "{who}: {m}");
    }
    // Another CA's edge certificate does not get through TLS.
    let stranger = opendsec_trust::test_cluster(&[Identity::edge("edge-1")]).remove(0);
    let mut c = SliceClient::connect(&t.peer_addr, &t.admin_token, stranger).unwrap();
    assert!(c.watch("edge-1", 1).await.is_err());
    assert!(t.node.read(|s| s.placement.edges.is_empty()), "nothing registered");
}

fn registration(edge: &str) -> opendsec_edge_api::pb::RegisterRequest {
    opendsec_edge_api::pb::RegisterRequest {
        edge: edge.into(),
        address: "127.0.0.1:9".into(),
        capacity: Some(capacity()),
        labels: BTreeMap::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_edge_joins_once_with_its_token_and_gets_its_certificate_and_key() {
    let t = single_node().await;
    let ca = t.node.trust().ca_pem().to_string();
    let token = edge_token(&t, "join-e7").await;
    let dir = tempfile::tempdir().unwrap();
    let join = |dir: std::path::PathBuf, edge: &'static str, token: String, ca: Option<String>| {
        let peer = t.peer_addr.clone();
        async move {
            opendsec_edge::identity::load_or_join(&dir, edge, &peer, &token, ca.as_deref(), registration(edge)).await
        }
    };

    // Without the CA an edge cannot check whom it joins: it says what to give it.
    let err = join(dir.path().into(), "e7", token.clone(), None).await.unwrap_err();
    assert!(err.to_string().contains("--ca-cert"), "{err}");

    let (trust, key) = join(dir.path().into(), "e7", token.clone(), Some(ca.clone()))
        .await
        .expect("joined");
    assert_eq!(trust.identity(), &Identity::edge("e7"));
    assert_eq!(
        key,
        t.node.edge_key("e7"),
        "the edge's own key, derived where the cluster key is"
    );
    let owner = t
        .node
        .read(|s| s.placement.edges.get("e7").and_then(|e| e.token.clone()));
    assert!(owner.is_some_and(|o| token.contains(&o)), "registered by its token");
    // Its files are its own, and a restart reads them (no second join).
    use std::os::unix::fs::PermissionsExt;
    for f in ["tls/edge.pem", "tls/ca.crt", "edge.key"] {
        let mode = std::fs::metadata(dir.path().join(f)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{f}");
    }
    let (again, _) = join(dir.path().into(), "e7", token.clone(), None)
        .await
        .expect("from its files");
    assert_eq!(again.identity(), &Identity::edge("e7"));
    // With it, the edge's slice opens.
    let mut c = SliceClient::connect(&t.peer_addr, &token, again).unwrap();
    assert!(c.watch("e7", 1).await.is_ok());

    // The token worked once: not again for this edge, nor for another.
    let other = tempfile::tempdir().unwrap();
    for edge in ["e7", "e8"] {
        let err = join(other.path().into(), edge, token.clone(), Some(ca.clone()))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("joined edge e7 already"), "{edge}: {err}");
    }
    // A joined name is not another token's to join.
    let thief = edge_token(&t, "thief").await;
    let err = join(other.path().into(), "e7", thief, Some(ca.clone()))
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("has joined already"), "{err}");
    // Nor does a token without edge:write, or a server of another CA, get anywhere.
    let reader = token_with(&t, "reader", vec![opendsec_projections::Right::SandboxRead]).await;
    let err = join(other.path().into(), "e9", reader, Some(ca.clone()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("edge:write"), "{err}");
    let foreign = opendsec_trust::test_cluster(&[Identity::control(9)]).remove(0);
    let fresh = edge_token(&t, "fresh").await;
    let err = join(other.path().into(), "e9", fresh, Some(foreign.ca_pem().into()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("joining the cluster"), "{err}");
    assert!(t.node.read(|s| !s.placement.edges.contains_key("e9")));
    assert!(
        !other.path().join("tls/edge.pem").exists(),
        "nothing saved by a failed join"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_joined_edge_renews_its_certificate_with_the_one_it_holds() {
    let t = single_node().await;
    let token = edge_token(&t, "e5").await;
    let dir = tempfile::tempdir().unwrap();
    let ca = t.node.trust().ca_pem().to_string();
    let (trust, _) =
        opendsec_edge::identity::load_or_join(dir.path(), "e5", &t.peer_addr, &token, Some(&ca), registration("e5"))
            .await
            .unwrap();
    let before = std::fs::read_to_string(dir.path().join("tls/edge.pem")).unwrap();
    opendsec_edge::identity::renew(&trust, dir.path(), &t.peer_addr, &token)
        .await
        .expect("renewed");
    let after = std::fs::read_to_string(dir.path().join("tls/edge.pem")).unwrap();
    assert_ne!(before, after, "a new key and certificate, saved");
    let mut c = SliceClient::connect(&t.peer_addr, &token, trust.clone()).unwrap();
    assert!(c.watch("e5", 1).await.is_ok(), "the renewed certificate is presented");
    // Another edge's certificate cannot renew e5's.
    let other = t.peer_trust(Identity::edge("e6"));
    let err = opendsec_edge::identity::renew(&other, dir.path(), &t.peer_addr, &token)
        .await
        .unwrap_err()
        .to_string();
    assert!(err.contains("not registered by this token"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_rotation_a_joined_edge_hears_of_it_and_renews() {
    let t = single_node().await;
    let token = edge_token(&t, "e4").await;
    let dir = tempfile::tempdir().unwrap();
    let ca = t.node.trust().ca_pem().to_string();
    let (trust, _) =
        opendsec_edge::identity::load_or_join(dir.path(), "e4", &t.peer_addr, &token, Some(&ca), registration("e4"))
            .await
            .unwrap();
    let mut c = SliceClient::connect(&t.peer_addr, &token, trust.clone()).unwrap();
    let hb = || HeartbeatRequest {
        edge: "e4".into(),
        ..Default::default()
    };
    let rotated = c.heartbeat(hb()).await.unwrap();
    assert!(!opendsec_edge::identity::must_renew(&trust, rotated), "no rotation yet");

    // Certificates issued in the second before are older than the rotation.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    t.node.rotate_certificates_here().expect("rotated");
    let rotated = c.heartbeat(hb()).await.unwrap();
    assert!(rotated > 0);
    assert!(
        opendsec_edge::identity::must_renew(&trust, rotated),
        "the edge's certificate predates it"
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    opendsec_edge::identity::renew(&trust, dir.path(), &t.peer_addr, &token)
        .await
        .unwrap();
    assert!(
        !opendsec_edge::identity::must_renew(&trust, rotated),
        "renewed after it"
    );
    // The node's new certificate is what new connections see, and the edge still gets in.
    let mut again = SliceClient::connect(&t.peer_addr, &token, trust.clone()).unwrap();
    assert!(again.watch("e4", 1).await.is_ok());
}
