//! Benchmark targets: how each is set up and torn down, and the list the `log`
//! benchmark runs. Adding a target = one [`TargetSpec::new`] line in [`log_targets`].

use std::any::Any;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use crate::load::{BoxFuture, WriteTarget};
use crate::{etcd, opendsec, redb_raw};

/// What a target's setup gets from the command line.
#[derive(Debug, Clone)]
pub struct SetupCtx {
    /// Bench data dir (same disk as the system under test); targets make temp dirs in it.
    pub data_dir: PathBuf,
    pub payload_len: usize,
    /// `etcd` executable.
    pub etcd_bin: String,
    /// Free-form `--opt key=value` pairs (e.g. a server URL for an HTTP target).
    pub opts: BTreeMap<String, String>,
}

/// Replays everything written so far; returns how many events it read and applied.
pub trait ReplaySource: Send + Sync + 'static {
    fn name(&self) -> String;
    fn replay(&self) -> BoxFuture<'_, Result<u64, String>>;
    /// What the figure means, given what `replay` returned (printed beside it).
    fn note(&self, _events: u64) -> Option<String> {
        None
    }
}

/// A set-up target. Dropping it tears the target down (stops processes, deletes data).
pub struct Session {
    pub target: Arc<dyn WriteTarget>,
    /// Optional replay measurement run after the load runs (events/s).
    pub replay: Option<Arc<dyn ReplaySource>>,
    /// Anything whose `Drop` tears the target down; dropped after `target`.
    pub guard: Option<Box<dyn Any + Send>>,
    /// How a write is made, printed under the table.
    pub note: Option<String>,
}

impl Session {
    pub fn new(target: Arc<dyn WriteTarget>) -> Self {
        Session {
            target,
            replay: None,
            guard: None,
            note: None,
        }
    }
    pub fn with_replay(mut self, r: Arc<dyn ReplaySource>) -> Self {
        self.replay = Some(r);
        self
    }
    pub fn with_note(mut self, n: impl Into<String>) -> Self {
        self.note = Some(n.into());
        self
    }
    pub fn with_guard(mut self, g: impl Any + Send) -> Self {
        self.guard = Some(Box::new(g));
        self
    }
}

pub type SetupFn = Arc<dyn Fn(SetupCtx) -> BoxFuture<'static, Result<Session, String>> + Send + Sync>;

/// One row family of the result table.
#[derive(Clone)]
pub struct TargetSpec {
    /// Shown in the `target` column, e.g. `"etcd"`, `"opendsec 3-node"`.
    pub name: String,
    /// Shown in the `members` column.
    pub members: usize,
    /// `"redb"`, `"etcd"`, `"etcd-tls"`, `"opendsec"`: used by `--skip-etcd` and the goals
    /// section (whose etcd is the plain one, as the goal says).
    pub family: &'static str,
    pub setup: SetupFn,
}

impl TargetSpec {
    pub fn new<F>(name: &str, members: usize, family: &'static str, setup: F) -> Self
    where
        F: Fn(SetupCtx) -> BoxFuture<'static, Result<Session, String>> + Send + Sync + 'static,
    {
        TargetSpec {
            name: name.to_string(),
            members,
            family,
            setup: Arc::new(setup),
        }
    }
}

/// Targets of `opendsec-bench log`, in run order.
pub fn log_targets() -> Vec<TargetSpec> {
    vec![
        TargetSpec::new("redb raw", 1, "redb", |ctx| Box::pin(redb_raw::setup(ctx))),
        TargetSpec::new("etcd", 1, "etcd", |ctx| Box::pin(etcd::setup(ctx, 1, false))),
        TargetSpec::new("etcd", 3, "etcd", |ctx| Box::pin(etcd::setup(ctx, 3, false))),
        TargetSpec::new("etcd peer mTLS", 3, "etcd-tls", |ctx| {
            Box::pin(etcd::setup(ctx, 3, true))
        }),
        TargetSpec::new("opendsec 1-node", 1, "opendsec", |ctx| {
            Box::pin(opendsec::setup(ctx, 1))
        }),
        TargetSpec::new("opendsec 3-node", 3, "opendsec", |ctx| {
            Box::pin(opendsec::setup(ctx, 3))
        }),
    ]
}
