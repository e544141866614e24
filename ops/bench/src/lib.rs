//! OpenDsec benchmark harness.
//!
//! * [`load`]: the [`WriteTarget`] trait and the closed-loop load generator [`run_load`].
//! * [`targets`]: [`TargetSpec`] (how a target is set up and torn down) and the list
//!   of targets the `log` benchmark runs ([`targets::log_targets`]); adding a target is
//!   one entry in that list.
//! * [`redb_raw`]: baseline (a): one durable redb write transaction per op.
//! * [`etcd`]: baseline (b): an etcd cluster on loopback driven through its v3 HTTP/JSON gateway.
//! * [`opendsec`]: the system under test: 1 or 3 `opendsec control` processes driven
//!   through the REST API (one label write = one replicated log append).
//! * [`fold`]: replay speed in process: `replay::fold` over encoded batches, no IO.
//! * [`report`]: the result table and the goals section.
//! * [`sandboxes`]: `opendsec-bench sandboxes`: container sandboxes through a real
//!   `opendsec up` beside raw `crun run`, pause/resume, concurrent-create bursts.
//! * [`images`]: `opendsec-bench images`: a ~500 MB OCI image through a real
//!   `opendsec up` (cold pull and create, warm create, disk of many sandboxes) beside
//!   `skopeo copy` + `umoci unpack` + `crun run`.
//! * [`network`]: `opendsec-bench network`: container sandboxes' network through a real
//!   `opendsec up` in namespaces of its own (policy update to enforcement, iperf3 beside
//!   a raw veth path, DNS proxy beside a direct query, create with and without it).

pub mod etcd;
pub mod fold;
pub mod images;
pub mod load;
pub mod network;
pub mod opendsec;
pub mod redb_raw;
pub mod report;
pub mod sandboxes;
pub mod targets;

pub use load::{BoxFuture, LoadReport, WriteTarget, run_load};
pub use targets::{Session, SetupCtx, TargetSpec};

/// The threads each member of a `members`-member cluster gets on this host: its share
/// of the CPUs (at least one), as if each member had a machine of its own. OpenDsec
/// nodes get it as `--worker-threads`, etcd members as `GOMAXPROCS`; a lone member gets
/// every CPU (both systems' default).
pub fn member_threads(members: usize) -> usize {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    (cores / members.max(1)).max(1)
}

/// The last `n` lines of a child process's log file, for error messages.
pub(crate) fn log_tail(path: &std::path::Path, n: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
