//! Specification: hostile connections to a control node's peer port cost it next to
//! nothing. A real `opendsec control` process on 127.0.0.1 takes 200 connections that
//! hold still, open a protocol without TLS, announce frames of 60 MiB, send HTTP/2
//! garbage, or do all that inside mutual TLS with a real edge's certificate (root on an
//! edge host): its resident memory moves by less than 8 MiB, and it goes on deciding
//! writes meanwhile. (Before: a forwarding connection needed no key, and the leader
//! allocated whatever length a frame announced before reading it.)

mod support;

use serde_json::json;
use std::time::Duration;
use support::Cluster;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

const CONNECTIONS: usize = 200;
const MIB: i64 = 1 << 20;

fn resident_bytes(pid: u32) -> i64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: i64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/<pid>/status");
    kib * 1024
}

/// A protocol's opening as `opendsec_log::handshake` reads it: magic, then one frame of
/// (version count, versions, credentials), here with no credentials.
fn opening(magic: &[u8; 4]) -> Vec<u8> {
    let hello = [1u8, 0, 1];
    let mut out = magic.to_vec();
    out.extend_from_slice(&(hello.len() as u32).to_be_bytes());
    out.extend_from_slice(&hello);
    out
}

/// A held connection: plain TCP, or TLS as an edge.
enum Held {
    #[allow(dead_code)]
    Plain(TcpStream),
    #[allow(dead_code)]
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
}

async fn hostile(peer: &str, kind: usize, edge: &std::sync::Arc<opendsec_trust::Trust>) -> Option<Held> {
    let c = TcpStream::connect(peer).await.ok()?;
    let bytes = hostile_bytes(kind);
    if kind % 8 >= 4 {
        let control = opendsec_trust::Expect::Role(opendsec_trust::Role::Control);
        let mut tls = edge.connect(c, &control).await.ok()?;
        let _ = tls.write_all(&bytes).await;
        return Some(Held::Tls(Box::new(tls)));
    }
    let mut c = c;
    let _ = c.write_all(&bytes).await;
    Some(Held::Plain(c))
}

fn hostile_bytes(kind: usize) -> Vec<u8> {
    match kind % 4 {
        // Says nothing at all.
        0 => vec![],
        // Write forwarding (by a peer that is no control node), then a frame of 60 MiB announced and
        // a first MiB of it.
        1 => {
            let mut b = opening(b"ODFW");
            b.extend_from_slice(&((60 * MIB) as u32).to_be_bytes());
            b.extend(std::iter::repeat_n(0x55u8, MIB as usize));
            b
        }
        // Replication (by a peer that is no control node), a 60 MiB frame announced.
        2 => {
            let mut b = opening(b"ODRP");
            b.extend_from_slice(&((60 * MIB) as u32).to_be_bytes());
            b
        }
        // HTTP/2's preface, then garbage.
        _ => {
            let mut b = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
            b.extend(std::iter::repeat_n(0xffu8, 64 << 10));
            b
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_hostile_connections_barely_move_a_nodes_memory() {
    let cluster = Cluster::start(1).await;
    let node = &cluster.nodes[0];
    // A real edge's certificate, as root on an edge host holds one.
    let ca = opendsec_trust::Ca::load(&cluster.dir.path().join("pki")).unwrap();
    let edge = opendsec_trust::Identity::edge("e1");
    let issued = ca.issue(&edge).unwrap();
    let edge = std::sync::Arc::new(opendsec_trust::Trust::new(edge, ca.cert_pem(), &issued, None).unwrap());
    let pid = node.child.as_ref().unwrap().id();
    let write = |n: usize| {
        let c = &cluster;
        async move {
            let (s, v) = c
                .post(0, "/v1/projects", &c.token, json!({"name": format!("team-{n}")}))
                .await
                .unwrap();
            assert_eq!(s, 201, "{v}");
        }
    };
    // Warm up what a node allocates once (pools, caches) before measuring.
    for n in 0..20 {
        write(n).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = resident_bytes(pid);

    let mut held = Vec::new();
    for k in 0..CONNECTIONS {
        if let Some(c) = hostile(&node.peer, k, &edge).await {
            held.push(c);
        }
    }
    // The node goes on deciding writes while they are open.
    for n in 20..40 {
        write(n).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = resident_bytes(pid);
    let grown = after - before;
    assert!(
        grown < 8 * MIB,
        "{CONNECTIONS} hostile connections grew the node's memory by {:.1} MiB ({} -> {} MiB)",
        grown as f64 / MIB as f64,
        before / MIB,
        after / MIB
    );
    drop(held);
}
