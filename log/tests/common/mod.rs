//! Shared test harness: a hashing state machine and real nodes serving their peer port on loopback.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use opendsec_log::{LogConfig, LogNode, ProposeError, StateMachine};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// FNV-1a, folded over every applied (index, payload).
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100000001b3);
    }
    h
}

/// Appends every payload and keeps a running hash. `apply` answers with the number of
/// entries applied so far (8 bytes, big endian).
#[derive(Default)]
pub struct TestSm {
    pub entries: Vec<(u64, Vec<u8>)>,
    pub hash: u64,
}

impl StateMachine for TestSm {
    fn apply(&mut self, index: u64, payload: &[u8]) -> Vec<u8> {
        self.hash = fnv(fnv(self.hash, &index.to_be_bytes()), payload);
        self.entries.push((index, payload.to_vec()));
        (self.entries.len() as u64).to_be_bytes().to_vec()
    }

    fn snapshot(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.hash.to_be_bytes());
        out.extend_from_slice(&(self.entries.len() as u64).to_be_bytes());
        for (i, p) in &self.entries {
            out.extend_from_slice(&i.to_be_bytes());
            out.extend_from_slice(&(p.len() as u64).to_be_bytes());
            out.extend_from_slice(p);
        }
        out
    }

    fn restore(&mut self, s: &[u8]) -> Result<(), String> {
        fn u64_at(s: &[u8], pos: &mut usize) -> Result<u64, String> {
            let b = s.get(*pos..*pos + 8).ok_or("truncated snapshot")?;
            *pos += 8;
            Ok(u64::from_be_bytes(b.try_into().map_err(|_| "bad u64")?))
        }
        let mut pos = 0;
        let hash = u64_at(s, &mut pos)?;
        let n = u64_at(s, &mut pos)?;
        let mut entries = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let i = u64_at(s, &mut pos)?;
            let len = u64_at(s, &mut pos)? as usize;
            let p = s.get(pos..pos + len).ok_or("truncated payload")?.to_vec();
            pos += len;
            entries.push((i, p));
        }
        self.hash = hash;
        self.entries = entries;
        Ok(())
    }
}

/// A running node: the log handle plus its peer port.
pub struct TestNode {
    pub id: u64,
    pub addr: SocketAddr,
    pub node: LogNode<TestSm>,
    stop: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
}

pub async fn free_listener() -> TcpListener {
    TcpListener::bind("127.0.0.1:0").await.expect("bind loopback")
}

pub fn config(id: u64, dir: &Path, addr: SocketAddr) -> LogConfig {
    let trust = opendsec_trust::test_trust(opendsec_trust::Identity::control(id));
    let mut c = LogConfig::new(id, dir.join(format!("n{id}")), addr.to_string(), trust);
    c.election_timeout_ms = (300, 600);
    c.heartbeat_ms = 100;
    c
}

impl TestNode {
    /// Open the node and serve its peer port on `listener`.
    pub async fn start(cfg: LogConfig, listener: TcpListener) -> TestNode {
        if std::env::var_os("RUST_LOG").is_some() {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                .with_test_writer()
                .try_init();
        }
        TestNode::serve(cfg, listener).await
    }

    async fn serve(cfg: LogConfig, listener: TcpListener) -> TestNode {
        let addr = listener.local_addr().expect("local addr");
        let id = cfg.node_id;
        let node = LogNode::open(cfg, TestSm::default()).await.expect("open node");
        let (tx, rx) = oneshot::channel::<()>();
        let n2 = node.clone();
        let stopped = async {
            let _ = rx.await;
        };
        let server = tokio::spawn(async move {
            let _ = opendsec_log::serve_peer(listener, &n2, None, stopped).await;
        });
        TestNode {
            id,
            addr,
            node,
            stop: Some(tx),
            server: Some(server),
        }
    }

    /// Restart on the same address (the port was released by `stop`).
    pub async fn start_on(cfg: LogConfig, addr: SocketAddr) -> TestNode {
        let deadline = Instant::now() + Duration::from_secs(5);
        let listener = loop {
            match TcpListener::bind(addr).await {
                Ok(l) => break l,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("rebind {addr}: {e}"),
            }
        };
        TestNode::start(cfg, listener).await
    }

    /// Stop the server (closing peer connections) and the node; release the data dir.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.node.shutdown().await.expect("shutdown");
        if let Some(h) = self.server.take() {
            let abort = h.abort_handle();
            if tokio::time::timeout(Duration::from_secs(2), h).await.is_err() {
                abort.abort();
            }
        }
    }

    pub fn hash(&self) -> (usize, u64) {
        self.node.with_state(|s| (s.entries.len(), s.hash))
    }
}

pub async fn wait_until<F: FnMut() -> bool>(what: &str, timeout: Duration, mut f: F) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Wait until some node of `nodes` is leader; returns its position.
pub async fn wait_leader(nodes: &[&TestNode], timeout: Duration) -> usize {
    let deadline = Instant::now() + timeout;
    loop {
        for (i, n) in nodes.iter().enumerate() {
            if n.node.status().is_leader {
                return i;
            }
        }
        assert!(Instant::now() < deadline, "no leader elected within {timeout:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Propose through whichever node is leader, following redirects.
pub async fn propose(nodes: &[&TestNode], payload: Vec<u8>) -> opendsec_log::Applied {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut at = 0;
    loop {
        match nodes[at].node.propose(payload.clone()).await {
            Ok(a) => return a,
            Err(ProposeError::ForwardToLeader { leader_id: Some(l), .. }) => {
                at = nodes.iter().position(|n| n.id == l).unwrap_or((at + 1) % nodes.len());
            }
            Err(e) => {
                assert!(Instant::now() < deadline, "propose failed: {e}");
                at = (at + 1) % nodes.len();
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        if Instant::now() >= deadline {
            panic!("propose did not succeed in time");
        }
    }
}

pub fn members(nodes: &[&TestNode]) -> BTreeMap<u64, String> {
    nodes.iter().map(|n| (n.id, n.addr.to_string())).collect()
}

pub fn payload(i: u64) -> Vec<u8> {
    format!("event-{i:06}").into_bytes()
}
