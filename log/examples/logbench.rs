//! Micro-benchmark of the log alone (no HTTP, no decide): `LogNode::propose` on the leader
//! of an in-process 1- or 3-node cluster over loopback gRPC, closed loop, with the storage
//! counters of every node. Used to find where the time goes in append/commit/replicate/apply;
//! the end-to-end figures come from `ops/bench.sh log`.
//!
//! ```text
//! cargo run --release -p opendsec-log --example logbench -- [nodes] [c1,c2,..] [ops] [payload]
//! ```

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use opendsec_log::store::IoStats;
use opendsec_log::{LogConfig, LogNode, StateMachine};

#[derive(Default)]
struct Sm {
    n: u64,
    h: u64,
}

impl StateMachine for Sm {
    fn apply(&mut self, index: u64, payload: &[u8]) -> Vec<u8> {
        self.n += 1;
        for b in payload {
            self.h = (self.h ^ *b as u64).wrapping_mul(0x100000001b3);
        }
        index.to_be_bytes().to_vec()
    }
    fn snapshot(&self) -> Vec<u8> {
        [self.n.to_be_bytes(), self.h.to_be_bytes()].concat()
    }
    fn restore(&mut self, s: &[u8]) -> Result<(), String> {
        if s.len() != 16 {
            return Err("bad snapshot".into());
        }
        self.n = u64::from_be_bytes(s[..8].try_into().unwrap());
        self.h = u64::from_be_bytes(s[8..].try_into().unwrap());
        Ok(())
    }
}

fn pct(v: &[Duration], q: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    let r = (q * v.len() as f64).ceil() as usize;
    v[r.clamp(1, v.len()) - 1]
}

fn delta(a: &IoStats, b: &IoStats) -> IoStats {
    IoStats {
        appends: b.appends - a.appends,
        appended_entries: b.appended_entries - a.appended_entries,
        append_us: b.append_us - a.append_us,
        inline_appends: b.inline_appends - a.inline_appends,
        durable_commits: b.durable_commits - a.durable_commits,
        durable_commit_us: b.durable_commit_us - a.durable_commit_us,
        journal_syncs: b.journal_syncs - a.journal_syncs,
        journal_sync_us: b.journal_sync_us - a.journal_sync_us,
        save_committed: b.save_committed - a.save_committed,
        save_committed_us: b.save_committed_us - a.save_committed_us,
        log_reads: b.log_reads - a.log_reads,
        log_read_us: b.log_read_us - a.log_read_us,
        log_reads_db: b.log_reads_db - a.log_reads_db,
    }
}

fn per(total: u64, n: u64) -> String {
    total.checked_div(n).map_or_else(|| "-".into(), |v| v.to_string())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let nodes: u64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(3);
    let concs: Vec<usize> = args
        .get(2)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 16, 256]);
    let ops: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(5000);
    let payload_len: usize = args.get(4).and_then(|s| s.parse().ok()).unwrap_or(256);
    let base = std::env::var("LOGBENCH_DIR").unwrap_or_else(|_| "/tmp".into());
    std::fs::create_dir_all(&base).unwrap();
    let dir = tempfile::tempdir_in(&base).unwrap();

    let mut handles = Vec::new();
    let mut members = BTreeMap::new();
    let mut listeners = Vec::new();
    for id in 1..=nodes {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        members.insert(id, l.local_addr().unwrap().to_string());
        listeners.push(l);
    }
    for (i, l) in listeners.into_iter().enumerate() {
        let id = i as u64 + 1;
        let trust = opendsec_trust::test_trust(opendsec_trust::Identity::control(id));
        let cfg = LogConfig::new(id, dir.path().join(format!("n{id}")), members[&id].clone(), trust);
        let node = LogNode::open(cfg, Sm::default()).await.unwrap();
        let n2 = node.clone();
        tokio::spawn(async move {
            let _ = opendsec_log::serve_peer(l, &n2, None, std::future::pending()).await;
        });
        handles.push(node);
    }
    handles[0].initialize(members.clone()).await.unwrap();
    let leader = loop {
        if let Some(l) = handles.iter().find(|n| n.status().is_leader) {
            break l.clone();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!(
        "{nodes} node(s), leader {}, payload {payload_len} B, data in {}",
        leader.node_id(),
        dir.path().display()
    );

    for &c in &concs {
        // Warm-up.
        let warm = c.max(50);
        run(&leader, c, warm, payload_len).await;
        let before: Vec<IoStats> = handles.iter().map(|n| n.io_stats()).collect();
        let wb0 = write_bytes();
        let (el, mut lat) = run(&leader, c, ops, payload_len).await;
        let after: Vec<IoStats> = handles.iter().map(|n| n.io_stats()).collect();
        let wb = write_bytes().saturating_sub(wb0);
        lat.sort_unstable();
        println!(
            "c={c:<4} {:>8.0} ops/s  p50 {:>9.1?}  p99 {:>9.1?}  disk writes {:.1} KiB per op (all nodes)",
            lat.len() as f64 / el.as_secs_f64(),
            pct(&lat, 0.5),
            pct(&lat, 0.99),
            wb as f64 / 1024.0 / ops as f64
        );
        for (i, (a, b)) in before.iter().zip(&after).enumerate() {
            let d = delta(a, b);
            println!(
                "   node{}: appends {} ({} entries, {} us each in core, {} inline), durable txns {} ({} us each), \
                 journal syncs {} ({} us each, {:.1} entries/sync), save_committed {} ({} us each), reads {} ({} us each, {} from redb)",
                i + 1,
                d.appends,
                d.appended_entries,
                per(d.append_us, d.appends),
                d.inline_appends,
                d.durable_commits,
                per(d.durable_commit_us, d.durable_commits),
                d.journal_syncs,
                per(d.journal_sync_us, d.journal_syncs),
                d.appended_entries as f64 / (d.durable_commits + d.journal_syncs).max(1) as f64,
                d.save_committed,
                per(d.save_committed_us, d.save_committed),
                d.log_reads,
                per(d.log_read_us, d.log_reads),
                d.log_reads_db,
            );
        }
    }
    for n in &handles {
        let _ = n.shutdown().await;
    }
}

/// Bytes this process caused to be written to storage so far (`/proc/self/io`).
fn write_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/io")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("write_bytes: ").and_then(|v| v.trim().parse().ok()))
        })
        .unwrap_or(0)
}

async fn run(leader: &LogNode<Sm>, c: usize, ops: usize, payload_len: usize) -> (Duration, Vec<Duration>) {
    let next = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..c {
        let (leader, next) = (leader.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            loop {
                let s = next.fetch_add(1, Ordering::Relaxed);
                if s >= ops as u64 {
                    break;
                }
                let p: Vec<u8> = (0..payload_len).map(|i| (s as usize + i) as u8).collect();
                let t = Instant::now();
                leader.propose(p).await.expect("propose");
                lat.push(t.elapsed());
            }
            lat
        }));
    }
    let mut lat = Vec::new();
    for t in tasks {
        lat.extend(t.await.unwrap());
    }
    (t0.elapsed(), lat)
}
