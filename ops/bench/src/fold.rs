//! Replay speed, in process and pure: how fast `opendsec_projections::replay::fold`
//! turns encoded log batches into the views, with no IO at all.
//!
//! The batches are what a leader would log: each is decided by
//! `opendsec_commands::decide` and encoded from `batch_for`, on a state that was
//! bootstrapped and given one roomy edge. After a few sandboxes are created, every
//! further batch sets one sandbox's labels (one label whose value is 255 bytes of
//! `[a-z0-9]`, like the `opendsec` write targets), so the fold runs through decode,
//! check, apply and the audit record of each batch. The timed part is one `fold`
//! from an empty `State` over all batches; building them is not timed.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use opendsec_commands::{Caller, Command, Ctx, InFlight, batch_for, decide};
use opendsec_projections::replay::{Until, fold};
use opendsec_projections::schema::encode_batch;
use opendsec_projections::{Outcome, State, Usage};

use crate::load::make_payload;

/// Sandboxes the label batches cycle over.
pub const SANDBOXES: usize = 64;

/// Result of [`run`].
#[derive(Debug, Clone)]
pub struct FoldResult {
    /// Batches folded (each holds one event).
    pub batches: u64,
    /// Bytes of encoded batches folded.
    pub bytes: u64,
    pub build_time: Duration,
    pub fold_time: Duration,
}

/// 255 (or `len`) characters of `[a-z0-9]` derived from `seq`: what a label value accepts.
pub fn label_value(seq: u64, len: usize) -> String {
    const ALPHABET: &[u8; 36] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    make_payload(seq, len)
        .into_iter()
        .map(|b| ALPHABET[(b % 36) as usize] as char)
        .collect()
}

struct Builder {
    state: State,
    inflight: InFlight,
    log: Vec<(u64, Vec<u8>)>,
    seed: u64,
    now_ms: u64,
}

impl Builder {
    fn run(&mut self, caller: Caller, cmd: Command) -> Result<String, String> {
        self.seed += 1;
        self.now_ms += 1;
        let ctx = Ctx {
            time_ms: self.now_ms,
            seed: self.seed.wrapping_mul(0x2545_F491_4F6C_DD1D),
            request_id: format!("bench-{}", self.seed),
            caller,
        };
        let decided = decide(&self.state, &self.inflight, &cmd, &ctx);
        let batch = batch_for(&cmd, &ctx, &self.state, &decided)
            .ok_or_else(|| format!("{:?} was not logged: {decided:?}", cmd.action()))?;
        let decided = decided.map_err(|r| format!("{} refused: {r}", cmd.action()))?;
        let index = self.state.index + 1;
        let bytes = encode_batch(&batch);
        match self.state.apply_encoded(index, &bytes) {
            Outcome::Applied { .. } => {}
            o => return Err(format!("{} did not apply: {o:?}", cmd.action())),
        }
        self.log.push((index, bytes));
        Ok(decided.target)
    }
}

/// Builds `n` encoded batches (bootstrap, one edge, [`SANDBOXES`] sandboxes, then label
/// sets) and times one `fold` over all of them from an empty state.
pub fn run(n: usize) -> Result<FoldResult, String> {
    let t0 = Instant::now();
    let mut b = Builder {
        state: State::new(),
        inflight: InFlight::new(),
        log: Vec::with_capacity(n),
        seed: 0,
        now_ms: 1_700_000_000_000,
    };
    let admin = b.run(
        Caller::System,
        Command::Bootstrap {
            project_name: "root".into(),
            token_name: "admin".into(),
            secret_sha256: "ab".repeat(32),
        },
    )?;
    let root = b
        .state
        .root_project()
        .map(|p| p.id.clone())
        .ok_or("no root project after bootstrap")?;
    let tok = || Caller::Token(admin.clone());
    b.run(
        tok(),
        Command::RegisterEdge {
            edge: "bench-edge".into(),
            address: "127.0.0.1:1".into(),
            capacity: Usage {
                sandboxes: 1_000_000,
                cpu_millis: 1_000_000_000,
                memory_mb: 1_000_000_000,
                metadata_bytes: 0,
            },
            labels: BTreeMap::new(),
        },
    )?;
    let mut sandboxes = Vec::new();
    for _ in 0..SANDBOXES {
        sandboxes.push(b.run(
            tok(),
            Command::CreateSandbox {
                opts: Default::default(),
                project: root.clone(),
                image: "bench:latest".into(),
                cpu_millis: 100,
                memory_mb: 64,
                labels: BTreeMap::new(),
                timeout_seconds: None,
            },
        )?);
    }
    let mut seq = 0u64;
    while b.log.len() < n {
        let sandbox = sandboxes[seq as usize % sandboxes.len()].clone();
        let labels = BTreeMap::from([("b".to_string(), label_value(seq, 255))]);
        b.run(tok(), Command::SetSandboxLabels { sandbox, labels })?;
        seq += 1;
    }
    let build_time = t0.elapsed();
    let log = std::mem::take(&mut b.log);
    let expected = b.state.hash();
    drop(b);
    let bytes = log.iter().map(|(_, v)| v.len() as u64).sum();
    let last = log.last().map(|(i, _)| *i).unwrap_or(0);

    let t1 = Instant::now();
    let (state, folded) = fold(
        State::new(),
        log.iter().map(|(i, v)| (*i, v.as_slice())),
        Until::Index(last),
    );
    let fold_time = t1.elapsed();
    if state.hash() != expected {
        return Err("the fold did not reproduce the state the batches were decided on".into());
    }
    Ok(FoldResult {
        batches: folded,
        bytes,
        build_time,
        fold_time,
    })
}
