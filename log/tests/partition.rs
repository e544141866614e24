//! A follower cut off from the leader (its connections stall, nothing is closed) does not
//! hold writes back; when the link heals it catches up. Exercises the pipelined replication
//! stream's timeout on unanswered requests.

mod common;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use common::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A TCP proxy in front of a node: while paused it stops moving bytes in both directions
/// (like a network partition: nothing is lost or reset, it just does not arrive).
struct Proxy {
    addr: SocketAddr,
    paused: watch::Sender<bool>,
}

impl Proxy {
    async fn start(target: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let (paused, rx) = watch::channel(false);
        tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                let Ok(outbound) = TcpStream::connect(target).await else {
                    continue;
                };
                let _ = inbound.set_nodelay(true);
                let _ = outbound.set_nodelay(true);
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::spawn(pump(ri, wo, rx.clone()));
                tokio::spawn(pump(ro, wi, rx.clone()));
            }
        });
        Proxy { addr, paused }
    }

    fn pause(&self, on: bool) {
        self.paused.send_replace(on);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut paused: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if paused.wait_for(|p| !*p).await.is_err() {
            return;
        }
        let n = tokio::select! {
            r = from.read(&mut buf) => match r { Ok(0) | Err(_) => return, Ok(n) => n },
            // Stop reading as soon as the link is cut.
            _ = paused.wait_for(|p| *p) => continue,
        };
        if paused.wait_for(|p| !*p).await.is_err() || to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_follower_does_not_stall_writes_and_catches_up() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut listeners = Vec::new();
    let mut proxies = Vec::new();
    let mut members = BTreeMap::new();
    for id in 1..=3u64 {
        let l = free_listener().await;
        let p = Proxy::start(l.local_addr().expect("addr")).await;
        // Every peer reaches node `id` through its proxy.
        members.insert(id, p.addr.to_string());
        listeners.push(l);
        proxies.push(p);
    }
    let mut nodes = Vec::new();
    for (i, l) in listeners.into_iter().enumerate() {
        let id = i as u64 + 1;
        let mut cfg = config(id, dir.path(), proxies[i].addr);
        cfg.advertise_addr = members[&id].clone();
        nodes.push(TestNode::start(cfg, l).await);
    }
    let refs: Vec<&TestNode> = nodes.iter().collect();
    nodes[0].node.initialize(members.clone()).await.expect("initialize");
    let leader = wait_leader(&refs, Duration::from_secs(5)).await;
    let mut last = 0;
    for i in 0..50u64 {
        last = propose(&refs, payload(i)).await.index;
    }

    // Cut one follower off.
    let cut = (leader + 1) % 3;
    proxies[cut].pause(true);
    let t = Instant::now();
    for i in 50..150u64 {
        let started = Instant::now();
        last = nodes[leader]
            .node
            .propose(payload(i))
            .await
            .expect("the majority still commits")
            .index;
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "a write took {:?}",
            started.elapsed()
        );
    }
    eprintln!("100 writes with a follower cut off: {:?}", t.elapsed());
    let other = 3 - leader - cut;
    nodes[other]
        .node
        .wait_applied(last, Duration::from_secs(5))
        .await
        .expect("the other follower follows");
    assert!(
        nodes[cut].node.status().last_applied.unwrap_or(0) < last,
        "the cut-off follower got nothing"
    );
    // Longer than the replication stream's timeout on an unanswered request (1 s).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        nodes[leader].node.status().leader_id,
        Some(nodes[leader].id),
        "leadership kept"
    );

    // Heal: the follower catches up and every state is the same.
    proxies[cut].pause(false);
    let t = Instant::now();
    nodes[cut]
        .node
        .wait_applied(last, Duration::from_secs(15))
        .await
        .expect("caught up after the partition");
    eprintln!("caught up {:?} after the partition healed", t.elapsed());
    let h = nodes[leader].hash();
    assert_eq!(h.0, 150);
    assert!(nodes.iter().all(|n| n.hash() == h), "all three states equal");
    drop(refs);
    for n in nodes {
        n.stop().await;
    }
}
