//! Specification: the cluster's certificates rotate without downtime. Three real
//! `opendsec control` processes on 127.0.0.1, each presenting its own certificate (a
//! control node's, from the cluster's CA) on its peer port; `POST
//! /v1/cluster/certificates/rotate` (what `opendsecctl cluster rotate-certs` calls) gives
//! every member a fresh key and certificate, asked through any node; writes through
//! every node go on, forwarded over connections that present the new ones. Only
//! cluster:admin in the root project may ask. The edge embedded in `opendsec up` renews
//! its own from its process's CA when it hears of the rotation, as joined edges ask theirs
//! of their control node (`slice_api.rs`).

mod support;
#[path = "support/up.rs"]
mod up;

use opendsec_trust::{Expect, Identity, Role, Trust};
use serde_json::json;
use std::sync::Arc;
use support::Cluster;

/// The certificate (DER) node `peer` presents, as an operator tool sees it.
async fn presented(peer: &str, me: &Arc<Trust>) -> (Vec<u8>, Option<Identity>) {
    let tcp = tokio::net::TcpStream::connect(peer).await.unwrap();
    let tls = me.connect(tcp, &Expect::Role(Role::Control)).await.unwrap();
    let der = tls.get_ref().1.peer_certificates().unwrap()[0].to_vec();
    let id = Identity::of_certificate(&der);
    (der, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_members_certificate_rotates_on_command_and_writes_go_on() {
    let c = Cluster::start(3).await;
    let ca = opendsec_trust::Ca::load(&c.dir.path().join("pki")).unwrap();
    let op = Identity::operator("test");
    let me = Arc::new(Trust::new(op.clone(), ca.cert_pem(), &ca.issue(&op).unwrap(), None).unwrap());
    let mut before = Vec::new();
    for (i, n) in c.nodes.iter().enumerate() {
        let (der, id) = presented(&n.peer, &me).await;
        assert_eq!(id, Some(Identity::control(i as u64 + 1)));
        before.push(der);
    }

    // A token without cluster:admin is refused; nothing rotates.
    let (s, v) = c
        .post(
            0,
            "/v1/tokens",
            &c.token,
            json!({"name": "reader", "rights": ["sandbox:read"]}),
        )
        .await
        .unwrap();
    assert_eq!(s, 201, "{v}");
    let reader = v["token"].as_str().unwrap().to_string();
    let (s, v) = c
        .post(0, "/v1/cluster/certificates/rotate", &reader, json!({}))
        .await
        .unwrap();
    assert_eq!(s, 403, "{v}");
    assert_eq!(presented(&c.nodes[0].peer, &me).await.0, before[0]);

    // Asked through node 2, every member rotates.
    let (s, v) = c
        .post(1, "/v1/cluster/certificates/rotate", &c.token, json!({}))
        .await
        .unwrap();
    assert_eq!(s, 200, "{v}");
    let nodes = v["nodes"].as_array().unwrap();
    assert_eq!(nodes.len(), 3, "{v}");
    assert!(
        nodes
            .iter()
            .all(|n| n["error"].is_null() && n["not_after_ms"].as_u64().is_some()),
        "{v}"
    );
    for (i, n) in c.nodes.iter().enumerate() {
        let (der, id) = presented(&n.peer, &me).await;
        assert_ne!(der, before[i], "node {} presents a new certificate", i + 1);
        assert_eq!(id, Some(Identity::control(i as u64 + 1)), "under the same identity");
    }

    // Writes through every node go on (followers forward to the leader).
    for i in 0..3 {
        let (s, v) = c
            .post(
                i,
                "/v1/projects",
                &c.token,
                json!({"name": format!("after-rotation-{i}")}),
            )
            .await
            .unwrap();
        assert_eq!(s, 201, "through node {}: {v}", i + 1);
    }
}

/// The certificate the embedded edge's proxy presents, as a gateway sees it.
async fn edge_presents(up: &up::Up, me: &Arc<Trust>) -> Vec<u8> {
    let tcp = tokio::net::TcpStream::connect(&up.edge).await.unwrap();
    let tls = me
        .connect(tcp, &Expect::Exactly(Identity::edge(up::EMBEDDED_EDGE)))
        .await
        .unwrap();
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_edge_embedded_in_opendsec_up_renews_its_certificate_after_a_rotation() {
    use std::time::{Duration, Instant};
    let up = up::Up::start(None).await;
    up.ensure_image("busybox", Duration::from_secs(600)).await;
    let ca = opendsec_trust::Ca::load(&up.data_dir().join("tls")).unwrap();
    let gw = Identity::gateway(98);
    let me = Arc::new(Trust::new(gw.clone(), ca.cert_pem(), &ca.issue(&gw).unwrap(), None).unwrap());
    let before = edge_presents(&up, &me).await;

    let (s, v) = up
        .send(
            reqwest::Method::POST,
            "/v1/cluster/certificates/rotate",
            Some(json!({})),
        )
        .await;
    assert_eq!(s, 200, "{v}");
    // It hears of the rotation with its next heartbeat's reply.
    let deadline = Instant::now() + Duration::from_secs(30);
    let after = loop {
        let now = edge_presents(&up, &me).await;
        if now != before {
            break now;
        }
        assert!(
            Instant::now() < deadline,
            "the embedded edge still presents its old certificate 30 s after the rotation"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        Identity::of_certificate(&after),
        Some(Identity::edge(up::EMBEDDED_EDGE)),
        "under the same identity"
    );

    // The gateway reaches it as before: a sandbox is made and answers through it.
    let (s, v) = up
        .send(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": "busybox", "memory_mb": 64})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandbox"]["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match up.exec(&id, "echo", &["after rotation"]).await {
            Ok((out, 0)) => {
                assert_eq!(out, "after rotation\n");
                break;
            }
            other => assert!(Instant::now() < deadline, "exec after the rotation: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}
