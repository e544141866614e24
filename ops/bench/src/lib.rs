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

pub mod etcd;
pub mod fold;
pub mod load;
pub mod opendsec;
pub mod redb_raw;
pub mod report;
pub mod sandboxes;
pub mod targets;

pub use load::{BoxFuture, LoadReport, WriteTarget, run_load};
pub use targets::{Session, SetupCtx, TargetSpec};

/// The last `n` lines of a child process's log file, for error messages.
pub(crate) fn log_tail(path: &std::path::Path, n: usize) -> String {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
