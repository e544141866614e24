//! Property: whatever commands arrive, in whatever interleaving of stale decisions,
//! (a) the log they produce folds to byte-identical state on every replica,
//! (b) quota usage is exactly the sum of live sandboxes below each project and never
//!     exceeds any ancestor's limit (nothing lost, nothing double-counted),
//! (c) every batch in the log yields exactly one audit record.

mod support;

use opendsec_commands::{Command, Observation};
use opendsec_projections::{Limits, Right, State, Usage};
use proptest::prelude::*;
use std::collections::BTreeMap;
use support::*;

/// A command with its references left abstract: indexes are resolved, modulo the
/// length, against the projects, tokens, sandboxes and edges that exist when it runs.
#[derive(Clone, Debug)]
enum Op {
    Create {
        caller: usize,
        project: usize,
        cpu: u64,
        mem: u64,
    },
    Fork {
        caller: usize,
        sandbox: usize,
        count: u32,
    },
    Kill {
        caller: usize,
        sandbox: usize,
    },
    Report {
        sandbox: usize,
        what: u8,
    },
    Quota {
        caller: usize,
        project: usize,
        sandboxes: Option<u64>,
        cpu: Option<u64>,
    },
    Issue {
        caller: usize,
        project: usize,
        rights: u8,
        ttl: Option<u64>,
    },
    Revoke {
        caller: usize,
        token: usize,
    },
    RegisterEdge {
        edge: usize,
        slots: u64,
    },
    DeregisterEdge {
        edge: usize,
    },
    Advance {
        ms: u64,
    },
}

#[derive(Clone, Debug)]
enum Step {
    /// Decided and applied before the next step.
    Alone(Op),
    /// All decided against the same applied state, then applied in order.
    Together { ops: Vec<Op>, overlay: bool },
}

fn caller() -> impl Strategy<Value = usize> {
    prop_oneof![3 => Just(0usize), 1 => 0..8usize]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (caller(), 0..4usize, prop_oneof![Just(0u64), Just(250), Just(500), Just(1_000)], prop_oneof![Just(128u64), Just(512)])
            .prop_map(|(caller, project, cpu, mem)| Op::Create { caller, project, cpu, mem }),
        1 => (caller(), any::<usize>(), 0..4u32).prop_map(|(caller, sandbox, count)| Op::Fork { caller, sandbox, count }),
        3 => (caller(), any::<usize>()).prop_map(|(caller, sandbox)| Op::Kill { caller, sandbox }),
        3 => (any::<usize>(), 0..4u8).prop_map(|(sandbox, what)| Op::Report { sandbox, what }),
        3 => (caller(), 0..4usize, proptest::option::weighted(0.9, 0..8u64), proptest::option::of(prop_oneof![Just(1_000u64), Just(2_000), Just(4_000)]))
            .prop_map(|(caller, project, sandboxes, cpu)| Op::Quota { caller, project, sandboxes, cpu }),
        2 => (caller(), 0..4usize, any::<u8>(), proptest::option::of(1..120u64))
            .prop_map(|(caller, project, rights, ttl)| Op::Issue { caller, project, rights, ttl }),
        1 => (caller(), 0..8usize).prop_map(|(caller, token)| Op::Revoke { caller, token }),
        1 => (0..4usize, 1..6u64).prop_map(|(edge, slots)| Op::RegisterEdge { edge, slots }),
        1 => (0..4usize).prop_map(|edge| Op::DeregisterEdge { edge }),
        1 => (1..60_000u64).prop_map(|ms| Op::Advance { ms }),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        3 => op().prop_map(Step::Alone),
        2 => (prop::collection::vec(op(), 2..5), any::<bool>()).prop_map(|(ops, overlay)| Step::Together { ops, overlay }),
        // A burst of creates racing for the same quota and edges.
        1 => (0..4usize, 2..5usize, any::<bool>()).prop_map(|(project, n, overlay)| Step::Together {
            ops: vec![Op::Create { caller: 0, project, cpu: 500, mem: 128 }; n],
            overlay,
        }),
    ]
}

struct Sim {
    w: World,
    /// root, a (under root), b (under a), c (under root).
    projects: Vec<String>,
    /// The admin first, then every token issued.
    tokens: Vec<String>,
}

fn pick<T: Clone>(xs: &[T], i: usize) -> Option<T> {
    (!xs.is_empty()).then(|| xs[i % xs.len()].clone())
}

impl Sim {
    fn new() -> Sim {
        let mut w = World::new();
        let admin = w.bootstrap();
        let root = w.root.clone();
        let a = w.project(&admin, &root, "a");
        let b = w.project(&admin, &a, "b");
        let c = w.project(&admin, &root, "c");
        w.set_quota(&admin, &root, at_most(12));
        w.edge(&admin, "e0", capacity(4, 100_000, 100_000));
        Sim {
            w,
            projects: vec![root, a, b, c],
            tokens: vec![admin],
        }
    }

    fn sandbox(&self, i: usize) -> String {
        let ids: Vec<&String> = self.w.state.sandboxes.sandboxes.keys().collect();
        pick(&ids, i).cloned().unwrap_or_else(|| "00000000000000000000".into())
    }

    /// Turns an op into (caller token, command); `None` for a clock step.
    fn command(&mut self, op: &Op) -> Option<(String, Command)> {
        let token = |c: &usize| pick(&self.tokens, *c).unwrap();
        let admin = self.tokens[0].clone();
        Some(match op {
            Op::Create {
                caller,
                project,
                cpu,
                mem,
            } => (
                token(caller),
                Command::CreateSandbox {
                    opts: Default::default(),
                    project: self.projects[*project].clone(),
                    image: "img".into(),
                    cpu_millis: *cpu,
                    memory_mb: *mem,
                    labels: BTreeMap::new(),
                    timeout_seconds: None,
                },
            ),
            Op::Fork { caller, sandbox, count } => (
                token(caller),
                Command::ForkSandbox {
                    sandbox: self.sandbox(*sandbox),
                    count: *count,
                    edge: None,
                },
            ),
            Op::Kill { caller, sandbox } => (
                token(caller),
                Command::KillSandbox {
                    sandbox: self.sandbox(*sandbox),
                },
            ),
            Op::Report { sandbox, what } => {
                let observation = match what {
                    0 => Observation::Ready,
                    1 => Observation::Exited {
                        exit_code: 0,
                        oom_killed: false,
                        reason: String::new(),
                    },
                    2 => Observation::Failed {
                        reason: "crashed".into(),
                    },
                    _ => Observation::Exited {
                        exit_code: 137,
                        oom_killed: true,
                        reason: "oom".into(),
                    },
                };
                (
                    admin,
                    Command::ReportSandbox {
                        sandbox: self.sandbox(*sandbox),
                        observation,
                    },
                )
            }
            Op::Quota {
                caller,
                project,
                sandboxes,
                cpu,
            } => (
                token(caller),
                Command::SetQuota {
                    project: self.projects[*project].clone(),
                    limits: Limits {
                        sandboxes: *sandboxes,
                        cpu_millis: *cpu,
                        memory_mb: None,
                        metadata_bytes: None,
                    },
                },
            ),
            Op::Issue {
                caller,
                project,
                rights,
                ttl,
            } => {
                let rights = Right::ALL
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| rights & (1 << i) != 0)
                    .map(|(_, r)| *r)
                    .collect();
                let name = format!("t{}", self.w.seed);
                (
                    token(caller),
                    Command::IssueToken {
                        project: self.projects[*project].clone(),
                        name: name.clone(),
                        rights,
                        ttl_seconds: *ttl,
                        secret_sha256: secret_hash(&name),
                    },
                )
            }
            Op::Revoke { caller, token: t } => (
                token(caller),
                Command::RevokeToken {
                    token: token(t),
                    reason: "rotated".into(),
                },
            ),
            Op::RegisterEdge { edge, slots } => (
                admin,
                Command::RegisterEdge {
                    edge: format!("e{edge}"),
                    address: format!("e{edge}:7401"),
                    capacity: capacity(*slots, 100_000, 100_000),
                    labels: BTreeMap::new(),
                },
            ),
            Op::DeregisterEdge { edge } => (
                admin,
                Command::DeregisterEdge {
                    edge: format!("e{edge}"),
                },
            ),
            Op::Advance { ms } => {
                self.w.advance(*ms);
                return None;
            }
        })
    }

    /// Remembers tokens once their issue has been applied.
    fn learn(&mut self, decided: &Result<opendsec_commands::Decided, opendsec_commands::Rejection>) {
        if let Ok(d) = decided
            && d.events
                .iter()
                .any(|e| matches!(e, opendsec_projections::Event::TokenIssued(_)))
            && self.w.state.iam.tokens.contains_key(&d.target)
        {
            self.tokens.push(d.target.clone());
        }
    }

    fn run_step(&mut self, step: &Step) -> Result<(), TestCaseError> {
        let (ops, overlay): (Vec<Op>, Overlay) = match step {
            Step::Alone(op) => (vec![op.clone()], Overlay::Used),
            Step::Together { ops, overlay } => (ops.clone(), if *overlay { Overlay::Used } else { Overlay::Ignored }),
        };
        let mut proposals = Vec::new();
        for op in &ops {
            if let Some((token, cmd)) = self.command(op) {
                proposals.push(self.w.propose(&token, cmd, overlay));
            }
        }
        for p in proposals {
            let decided = p.decided.clone();
            let logged = self.w.commit(p).is_some();
            self.learn(&decided);
            if logged {
                check_invariants(&self.w)?;
            }
        }
        prop_assert!(self.w.inflight.is_empty(), "every reservation was released");
        Ok(())
    }
}

fn check_invariants(w: &World) -> Result<(), TestCaseError> {
    let s = &w.state;
    // (c) one audit record per batch, at the batch's index.
    prop_assert_eq!(s.audit.records.len(), w.log.len());
    prop_assert_eq!(s.audit.records.last().map(|r| r.index), w.log.last().map(|(i, _)| *i));

    // (b) usage is the sum of live sandboxes below each project, within every limit.
    let live: Vec<_> = s.sandboxes.sandboxes.values().filter(|x| x.is_live()).collect();
    for p in s.iam.projects.keys() {
        let mut sum = Usage::default();
        for x in live.iter().filter(|x| s.within(&x.project, p)) {
            sum.add(&x.usage());
        }
        let usage = s.quota.usage.get(p).copied().unwrap_or_default();
        prop_assert_eq!(usage, sum, "usage of project {}", p);
        for a in s.ancestry(p) {
            if let Some(l) = s.quota.limits.get(&a.id) {
                let over = l.exceeded_by(&usage);
                prop_assert!(
                    over.is_none(),
                    "project {} is over the limit of {}: {:?}",
                    p,
                    a.id,
                    over
                );
            }
        }
    }
    for (id, e) in &s.placement.edges {
        let mut sum = Usage::default();
        for x in live.iter().filter(|x| &x.edge == id) {
            sum.add(&x.usage());
        }
        prop_assert_eq!(e.assigned, sum, "assigned to edge {}", id);
    }
    Ok(())
}

fn fold(log: &[(u64, Vec<u8>)]) -> State {
    let mut s = State::new();
    for (i, b) in log {
        s.apply_encoded(*i, b);
    }
    s
}

fn simulate(steps: &[Step]) -> Result<Sim, TestCaseError> {
    let mut sim = Sim::new();
    check_invariants(&sim.w)?;
    for step in steps {
        sim.run_step(step)?;
    }
    Ok(sim)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn any_interleaving_keeps_quota_exact_and_replicas_identical(steps in prop::collection::vec(step(), 1..60)) {
        let sim = simulate(&steps)?;

        // (a) two fresh replicas folding the same log agree byte for byte, with the leader too.
        let (r1, r2) = (fold(&sim.w.log), fold(&sim.w.log));
        prop_assert_eq!(r1.to_bytes(), r2.to_bytes());
        prop_assert_eq!(r1.hash(), r2.hash());
        prop_assert!(r1.to_bytes() == sim.w.state.to_bytes(), "a replica differs from the leader's state");

        // The same commands with the same clock and seeds make the same log.
        let again = simulate(&steps)?;
        prop_assert!(again.w.log == sim.w.log, "deciding is deterministic");
    }
}
