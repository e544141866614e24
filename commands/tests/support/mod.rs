//! A tiny control plane for specification tests: the applied `State`, the in-flight
//! overlay, a log of encoded batches, a clock and a seed counter.
//!
//! `run` is what a leader does with one request: decide, build the log entry with
//! `batch_for`, append it and apply it at the next index. `propose`/`commit` split
//! that in two, so several commands can be decided against the same (stale) state
//! before any of them is applied, with or without the overlay.
#![allow(dead_code)]

use opendsec_commands::{Caller, Command, Ctx, Decided, InFlight, Observation, Rejection, batch_for, decide};
use opendsec_projections::schema::{Batch, encode_batch};
use opendsec_projections::{AuditRecord, Limits, Outcome, Right, State, Usage};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;

/// The leader clock at the start of every world (2023-11-14, a fixed point).
pub const T0: u64 = 1_700_000_000_000;

/// Whether a proposal is decided against the applied state alone or state + overlay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlay {
    Used,
    Ignored,
}

/// A command that was decided and appended to the log.
#[derive(Clone, Debug)]
pub struct Ran {
    pub decided: Decided,
    pub outcome: Outcome,
    pub index: u64,
}

/// A decision taken but not yet applied.
#[derive(Debug)]
pub struct Proposal {
    pub decided: Result<Decided, Rejection>,
    pub batch: Option<Batch>,
    pub ticket: Option<u64>,
}

pub struct World {
    pub state: State,
    pub inflight: InFlight,
    pub now_ms: u64,
    pub seed: u64,
    /// Every entry appended, as (index, encoded batch).
    pub log: Vec<(u64, Vec<u8>)>,
    /// The root project (set by `bootstrap`).
    pub root: String,
}

impl Default for World {
    fn default() -> Self {
        World::new()
    }
}

/// Hex SHA-256 of some bytes: what a client sends instead of the secret.
pub fn secret_hash(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

pub fn limits(sandboxes: Option<u64>, cpu_millis: Option<u64>, memory_mb: Option<u64>) -> Limits {
    Limits {
        sandboxes,
        cpu_millis,
        memory_mb,
        metadata_bytes: None,
    }
}

/// Limits on the number of sandboxes only.
pub fn at_most(sandboxes: u64) -> Limits {
    limits(Some(sandboxes), None, None)
}

pub fn capacity(sandboxes: u64, cpu_millis: u64, memory_mb: u64) -> Usage {
    Usage {
        sandboxes,
        cpu_millis,
        memory_mb,
        metadata_bytes: 0,
    }
}

pub fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

/// A small sandbox (500 mCPU, 256 MB) of `base` in `project`.
pub fn create_in(project: &str) -> Command {
    create_of(project, "base")
}

/// A small sandbox (500 mCPU, 256 MB) of `image` in `project`.
pub fn create_of(project: &str, image: &str) -> Command {
    Command::CreateSandbox {
        opts: Default::default(),
        project: project.into(),
        image: image.into(),
        cpu_millis: 500,
        memory_mb: 256,
        labels: BTreeMap::new(),
        timeout_seconds: None,
    }
}

impl World {
    pub fn new() -> World {
        World {
            state: State::new(),
            inflight: InFlight::new(),
            now_ms: T0,
            seed: 0,
            log: Vec::new(),
            root: String::new(),
        }
    }

    /// A world with a root project, its admin token, and one roomy edge.
    pub fn with_admin_and_edge() -> (World, String) {
        let mut w = World::new();
        let admin = w.bootstrap();
        w.edge(&admin, "edge-a", capacity(100, 100_000, 100_000));
        (w, admin)
    }

    pub fn advance(&mut self, ms: u64) {
        self.now_ms += ms;
    }

    pub fn ctx(&mut self, caller: Caller) -> Ctx {
        self.seed += 1;
        Ctx {
            time_ms: self.now_ms,
            // Spread the counter so neighbouring seeds do not look alike.
            seed: self.seed.wrapping_mul(0x2545_F491_4F6C_DD1D),
            request_id: format!("req-{}", self.seed),
            caller,
        }
    }

    pub fn next_index(&self) -> u64 {
        self.state.index + 1
    }

    // ---- the leader's loop, in one step or two ----

    /// Decides `cmd` as `caller` now, and applies its log entry (if any) at once.
    pub fn run_as(&mut self, caller: Caller, cmd: Command) -> Result<Ran, Rejection> {
        let p = self.propose_as(caller, cmd, Overlay::Used);
        let decided = p.decided.clone();
        let applied = self.commit(p);
        match (decided, applied) {
            (Ok(decided), Some((index, outcome))) => Ok(Ran {
                decided,
                outcome,
                index,
            }),
            (Ok(_), None) => unreachable!("an accepted command always has a log entry"),
            (Err(r), _) => Err(r),
        }
    }

    pub fn run(&mut self, token: &str, cmd: Command) -> Result<Ran, Rejection> {
        self.run_as(Caller::Token(token.to_string()), cmd)
    }

    /// Decides now; the batch is built but not applied. With `Overlay::Used` the
    /// decision sees earlier proposals and reserves what it will take.
    pub fn propose_as(&mut self, caller: Caller, cmd: Command, overlay: Overlay) -> Proposal {
        let ctx = self.ctx(caller);
        let empty = InFlight::new();
        let view = if overlay == Overlay::Used {
            &self.inflight
        } else {
            &empty
        };
        let decided = decide(&self.state, view, &cmd, &ctx);
        let batch = batch_for(&cmd, &ctx, &self.state, &decided);
        let ticket = match (&batch, &decided, overlay) {
            (Some(_), Ok(d), Overlay::Used) => Some(self.inflight.reserve(&self.state, &d.events)),
            _ => None,
        };
        Proposal { decided, batch, ticket }
    }

    pub fn propose(&mut self, token: &str, cmd: Command, overlay: Overlay) -> Proposal {
        self.propose_as(Caller::Token(token.to_string()), cmd, overlay)
    }

    /// Appends the proposal's batch (if it has one) at the next index and applies it,
    /// through its log encoding, then releases its reservation.
    pub fn commit(&mut self, p: Proposal) -> Option<(u64, Outcome)> {
        let out = p.batch.map(|b| {
            let index = self.next_index();
            let bytes = encode_batch(&b);
            let outcome = self.state.apply_encoded(index, &bytes);
            self.log.push((index, bytes));
            (index, outcome)
        });
        if let Some(t) = p.ticket {
            self.inflight.release(t);
        }
        out
    }

    // ---- shorthands for the givens of a specification ----

    /// Initialises the cluster as the system; returns the admin token id.
    pub fn bootstrap(&mut self) -> String {
        let ran = self
            .run_as(
                Caller::System,
                Command::Bootstrap {
                    project_name: "root".into(),
                    token_name: "admin".into(),
                    secret_sha256: secret_hash("admin"),
                },
            )
            .expect("bootstrap is accepted");
        assert!(
            matches!(ran.outcome, Outcome::Applied { .. }),
            "bootstrap applies: {:?}",
            ran.outcome
        );
        self.root = ran.decided.project.clone();
        ran.decided.target
    }

    pub fn project(&mut self, token: &str, parent: &str, name: &str) -> String {
        let ran = self
            .run(
                token,
                Command::CreateProject {
                    name: name.into(),
                    parent: parent.into(),
                },
            )
            .unwrap_or_else(|r| panic!("project {name} under {parent}: {r:?}"));
        assert!(matches!(ran.outcome, Outcome::Applied { .. }), "{:?}", ran.outcome);
        ran.decided.target
    }

    pub fn set_quota(&mut self, token: &str, project: &str, l: Limits) {
        let ran = self
            .run(
                token,
                Command::SetQuota {
                    project: project.into(),
                    limits: l,
                },
            )
            .unwrap_or_else(|r| panic!("quota of {project}: {r:?}"));
        assert!(matches!(ran.outcome, Outcome::Applied { .. }), "{:?}", ran.outcome);
    }

    pub fn issue(&mut self, token: &str, project: &str, rights: &[Right], ttl_seconds: Option<u64>) -> String {
        self.try_issue(token, project, rights, ttl_seconds)
            .unwrap_or_else(|r| panic!("token in {project}: {r:?}"))
    }

    pub fn try_issue(
        &mut self,
        token: &str,
        project: &str,
        rights: &[Right],
        ttl_seconds: Option<u64>,
    ) -> Result<String, Rejection> {
        let name = format!("t{}", self.seed + 1);
        self.run(
            token,
            Command::IssueToken {
                project: project.into(),
                name: name.clone(),
                rights: rights.to_vec(),
                ttl_seconds,
                secret_sha256: secret_hash(&name),
            },
        )
        .map(|r| r.decided.target)
    }

    pub fn edge(&mut self, token: &str, name: &str, cap: Usage) -> u32 {
        self.edge_labelled(token, name, cap, BTreeMap::new())
    }

    pub fn edge_labelled(&mut self, token: &str, name: &str, cap: Usage, labels: BTreeMap<String, String>) -> u32 {
        let ran = self
            .run(
                token,
                Command::RegisterEdge {
                    edge: name.into(),
                    address: format!("{name}:7401"),
                    capacity: cap,
                    labels,
                },
            )
            .unwrap_or_else(|r| panic!("edge {name}: {r:?}"));
        assert!(matches!(ran.outcome, Outcome::Applied { .. }), "{:?}", ran.outcome);
        self.state.placement.edges[name].ordinal
    }

    /// Creates a small sandbox; returns its id.
    pub fn sandbox(&mut self, token: &str, project: &str) -> String {
        self.try_sandbox(token, project)
            .unwrap_or_else(|r| panic!("sandbox in {project}: {r:?}"))
    }

    pub fn try_sandbox(&mut self, token: &str, project: &str) -> Result<String, Rejection> {
        let ran = self.run(token, create_in(project))?;
        assert!(matches!(ran.outcome, Outcome::Applied { .. }), "{:?}", ran.outcome);
        Ok(ran.decided.target)
    }

    pub fn report(&mut self, token: &str, sandbox: &str, observation: Observation) -> Ran {
        self.run(
            token,
            Command::ReportSandbox {
                sandbox: sandbox.into(),
                observation,
            },
        )
        .expect("report accepted")
    }

    // ---- what the views say ----

    pub fn usage(&self, project: &str) -> Usage {
        self.state.quota.usage.get(project).copied().unwrap_or_default()
    }

    pub fn last_audit(&self) -> &AuditRecord {
        self.state.audit.records.last().expect("an audit record")
    }

    /// Folds this world's log into a fresh state.
    pub fn replayed(&self) -> State {
        let mut s = State::new();
        for (i, b) in &self.log {
            s.apply_encoded(*i, b);
        }
        s
    }
}
