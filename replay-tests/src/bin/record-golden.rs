//! Records the golden log of the current schema version from a real control node.
//!
//! Run once per schema version and commit the output; never re-record an old version
//! (its log is the frozen evidence of what that version wrote):
//!
//! ```sh
//! cargo run -p opendsec-replay-tests --bin record-golden            # refuses to overwrite
//! cargo run -p opendsec-replay-tests --bin record-golden -- --force # current version only
//! cargo run -p opendsec-replay-tests --bin record-golden -- --scenario sandbox-options-and-snapshots
//! ```
//!
//! Scenarios: `control-plane-tour` (projects, quotas, tokens, placement, the sandbox
//! lifecycle) and `sandbox-options-and-snapshots` (environment, auto-pause and
//! auto-resume, network settings, file-system snapshots, forks that keep their options).
//!
//! The recording itself is not deterministic (wall-clock times, random seeds and ids),
//! but the log records them, so replaying it always yields the same views.

use opendsec_commands::{Command, Observation};
use opendsec_control::testing::single_node_with;
use opendsec_control::{ControlNode, Credential, SubmitError, Submitted, format_token, new_token_secret};
use opendsec_projections::schema::{CURRENT_SCHEMA_VERSION, encode_batch};
use opendsec_projections::{Event, Limits, Right, Usage};
use opendsec_replay_tests::{golden_dir, replay, write_expected, write_golden_log};
use std::collections::BTreeMap;

const SCENARIOS: [&str; 2] = ["control-plane-tour", "sandbox-options-and-snapshots"];

/// Submits commands with sequential request ids and checks each outcome.
struct Driver {
    node: ControlNode,
    n: u32,
}

impl Driver {
    fn next_id(&mut self) -> String {
        self.n += 1;
        format!("golden-{:03}", self.n)
    }

    async fn ok(&mut self, token: &str, cmd: Command) -> Submitted {
        let id = self.next_id();
        let what = format!("{cmd:?}");
        match self
            .node
            .submit(Credential::Bearer(token.to_string()), id.clone(), cmd)
            .await
        {
            Ok(s) => s,
            Err(e) => panic!("{id} {what}: expected success, got {e}"),
        }
    }

    /// A refusal that must be logged (so it shows in the audit view); returns its code.
    async fn denied(&mut self, token: &str, cmd: Command) -> &'static str {
        let id = self.next_id();
        let what = format!("{cmd:?}");
        match self
            .node
            .submit(Credential::Bearer(token.to_string()), id.clone(), cmd)
            .await
        {
            Err(SubmitError::Rejected {
                rejection,
                index: Some(_),
            }) => rejection.kind.code(),
            other => panic!("{id} {what}: expected a logged refusal, got {other:?}"),
        }
    }

    async fn project(&mut self, token: &str, name: &str, parent: &str) -> String {
        self.ok(
            token,
            Command::CreateProject {
                name: name.into(),
                parent: parent.into(),
            },
        )
        .await
        .decided
        .target
    }

    async fn quota(&mut self, token: &str, project: &str, sandboxes: u64, cpu_millis: u64, memory_mb: u64) {
        let limits = Limits {
            sandboxes: Some(sandboxes),
            cpu_millis: Some(cpu_millis),
            memory_mb: Some(memory_mb),
            metadata_bytes: None,
        };
        self.ok(
            token,
            Command::SetQuota {
                project: project.into(),
                limits,
            },
        )
        .await;
    }

    /// Issues a token; returns (token id, bearer string).
    async fn token(
        &mut self,
        issuer: &str,
        project: &str,
        name: &str,
        rights: &[Right],
        ttl_seconds: Option<u64>,
    ) -> (String, String) {
        let (secret, hash) = new_token_secret();
        let cmd = Command::IssueToken {
            project: project.into(),
            name: name.into(),
            rights: rights.to_vec(),
            ttl_seconds,
            secret_sha256: hash,
        };
        let id = self.ok(issuer, cmd).await.decided.target;
        let bearer = format_token(&id, &secret);
        (id, bearer)
    }

    async fn sandbox(
        &mut self,
        token: &str,
        project: &str,
        image: &str,
        cpu_millis: u64,
        memory_mb: u64,
        labels: &[(&str, &str)],
    ) -> String {
        let cmd = Command::CreateSandbox {
            opts: Default::default(),
            project: project.into(),
            image: image.into(),
            cpu_millis,
            memory_mb,
            labels: labels_of(labels),
            timeout_seconds: None,
        };
        self.ok(token, cmd).await.decided.target
    }

    async fn report(&mut self, edge_token: &str, sandbox: &str, observation: Observation) {
        self.ok(
            edge_token,
            Command::ReportSandbox {
                sandbox: sandbox.into(),
                observation,
            },
        )
        .await;
    }
}

fn labels_of(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let force = args.iter().any(|a| a == "--force");
    let scenario = args
        .iter()
        .position(|a| a == "--scenario")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
        .unwrap_or(SCENARIOS[0]);
    if !SCENARIOS.contains(&scenario) {
        eprintln!("unknown scenario {scenario:?}; scenarios are: {}", SCENARIOS.join(", "));
        std::process::exit(2);
    }
    let dir = golden_dir().join(format!("v{CURRENT_SCHEMA_VERSION}"));
    let log_path = dir.join(format!("{scenario}.log"));
    let expected_dir = dir.join(format!("{scenario}.expected"));
    if log_path.exists() && !force {
        eprintln!(
            "{} exists: golden logs are frozen once committed (pass --force to re-record the current version)",
            log_path.display()
        );
        std::process::exit(2);
    }

    let t = single_node_with(|_| {}).await;
    let admin = t.admin_token.clone();
    let root = t.root_project.clone();
    let mut d = Driver {
        node: t.node.clone(),
        n: 0,
    };
    if scenario == "sandbox-options-and-snapshots" {
        options_and_snapshots(&mut d, &admin, &root).await;
    } else {
        control_plane_tour(&mut d, &admin, &root).await;
    }

    // Read the real log back.
    let node = &t.node;
    let applied = node.applied_index();
    // The log serves entries up to what Raft reports applied, which can trail the state
    // machine by a moment: wait until the last one is readable.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while node
        .log()
        .read_entries(applied, applied)
        .map(|e| e.is_empty())
        .unwrap_or(true)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "entry {applied} never became readable"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let batches = node.read_batches(1, applied).expect("read the log");
    let raw = node.log().read_entries(1, applied).expect("read the raw log");
    assert_eq!(batches.len(), raw.len());
    for ((i, b), (j, bytes)) in batches.iter().zip(&raw) {
        assert_eq!(i, j);
        assert_eq!(
            &encode_batch(b),
            bytes,
            "entry {i}: re-encoding the decoded batch must give the logged bytes"
        );
    }
    let entries: Vec<(u64, Vec<u8>)> = batches.iter().map(|(i, b)| (*i, encode_batch(b))).collect();

    // The replay must agree with the node that applied the log.
    let state = replay(&entries);
    let node_hash = node.read(|s| s.hash());
    if state.hash() != node_hash {
        let differing: Vec<&str> = opendsec_projections::state::VIEW_NAMES
            .iter()
            .copied()
            .filter(|v| node.read(|s| s.view_json(v)) != state.view_json(v))
            .collect();
        let bytes = node.read(|s| s.to_bytes());
        let at = bytes
            .iter()
            .zip(state.to_bytes())
            .position(|(a, b)| *a != b)
            .unwrap_or(0);
        panic!(
            "replaying the log must give the node's own state; views that differ: {differing:?}; state bytes first differ at {at}: node {:?} / replay {:?}",
            String::from_utf8_lossy(&bytes[at.saturating_sub(80)..(at + 80).min(bytes.len())]),
            String::from_utf8_lossy(&state.to_bytes()[at.saturating_sub(80)..(at + 80).min(state.to_bytes().len())])
        );
    }

    std::fs::create_dir_all(&dir).expect("create the golden directory");
    write_golden_log(&log_path, &entries).expect("write the golden log");
    if expected_dir.exists() {
        std::fs::remove_dir_all(&expected_dir).expect("clear the old expected views");
    }
    write_expected(&expected_dir, &state).expect("write the expected views");

    let denials = state
        .audit
        .records
        .iter()
        .filter(|r| !matches!(r.result, opendsec_projections::AuditResult::Ok))
        .count();
    println!(
        "recorded {} entries (last index {applied}, {} commands, {} sandboxes, {denials} refusals) to {}",
        entries.len(),
        d.n,
        state.sandboxes.sandboxes.len(),
        log_path.display()
    );
    println!("state hash {}", state.hash());
    t.shutdown().await;
}

async fn control_plane_tour(d: &mut Driver, admin: &str, root: &str) {
    let (admin, root) = (admin.to_string(), root.to_string());
    // Two edges (the admin token is the root's and holds edge:write).
    for (edge, sandboxes, cpu, mem, zone) in [("edge-a", 24, 48_000, 98_304, "a"), ("edge-b", 16, 32_000, 65_536, "b")]
    {
        let cmd = Command::RegisterEdge {
            edge: edge.into(),
            address: format!("10.0.0.{}:7500", if zone == "a" { 11 } else { 12 }),
            capacity: Usage {
                sandboxes,
                cpu_millis: cpu,
                memory_mb: mem,
                metadata_bytes: 0,
            },
            labels: labels_of(&[("zone", zone)]),
        };
        d.ok(&admin, cmd).await;
    }

    // Nested projects and their quotas.
    let team_a = d.project(&admin, "team-a", &root).await;
    let team_b = d.project(&admin, "team-b", &root).await;
    let research = d.project(&admin, "research", &team_a).await;
    d.quota(&admin, &root, 40, 64_000, 131_072).await;
    d.quota(&admin, &team_a, 20, 32_000, 65_536).await;
    d.quota(&admin, &research, 4, 8_000, 16_384).await;
    d.quota(&admin, &team_b, 8, 16_000, 32_768).await;
    // A parent's limit below its child's: refused (conflict), logged.
    let code = d
        .denied(
            &admin,
            Command::SetQuota {
                project: team_a.clone(),
                limits: Limits {
                    sandboxes: Some(2),
                    cpu_millis: Some(32_000),
                    memory_mb: Some(65_536),
                    metadata_bytes: None,
                },
            },
        )
        .await;
    assert_eq!(code, "conflict");

    // Tokens with limited rights.
    let (_, dev) = d
        .token(
            &admin,
            &team_a,
            "team-a-dev",
            &[Right::SandboxWrite, Right::SandboxRead, Right::TokenWrite],
            None,
        )
        .await;
    let (_, ci) = d
        .token(
            &admin,
            &team_b,
            "team-b-ci",
            &[Right::SandboxWrite, Right::SandboxRead],
            Some(86_400),
        )
        .await;
    let (bot_id, bot) = d
        .token(
            &dev,
            &research,
            "research-bot",
            &[Right::SandboxWrite, Right::SandboxRead],
            Some(3_600),
        )
        .await;
    // A grant of a right the issuer does not hold: denied, logged.
    let (_, hash) = new_token_secret();
    let grant = Command::IssueToken {
        project: research.clone(),
        name: "sneaky".into(),
        rights: vec![Right::QuotaWrite],
        ttl_seconds: None,
        secret_sha256: hash,
    };
    assert_eq!(d.denied(&dev, grant).await, "forbidden");

    // Sandboxes across the projects.
    let images = [
        "python:3.12-slim",
        "node:22-alpine",
        "rust:1.95",
        "ubuntu:24.04",
        "python:3.12-slim",
        "golang:1.24",
    ];
    let mut a = Vec::new();
    for (i, image) in images.iter().enumerate() {
        let run = format!("run-{i}");
        a.push(
            d.sandbox(&dev, &team_a, image, 1_000, 2_048, &[("team", "a"), ("run", &run)])
                .await,
        );
    }
    let mut r = Vec::new();
    for i in 0..3 {
        let exp = format!("exp-{i}");
        r.push(
            d.sandbox(
                &bot,
                &research,
                "pytorch:2.5-cuda",
                1_500,
                3_072,
                &[("experiment", &exp)],
            )
            .await,
        );
    }
    r.push(d.sandbox(&admin, &research, "jupyter:latest", 1_000, 2_048, &[]).await);
    let mut b = Vec::new();
    for i in 0..6 {
        let job = format!("job-{i}");
        b.push(
            d.sandbox(
                &ci,
                &team_b,
                "node:22-alpine",
                500,
                1_024,
                &[("ci", "true"), ("job", &job)],
            )
            .await,
        );
    }
    let mut x = Vec::new();
    for image in ["debian:12", "alpine:3.21", "busybox:1.37"] {
        x.push(d.sandbox(&admin, &root, image, 2_000, 4_096, &[("owner", "ops")]).await);
    }
    // Research holds 4 of 4 sandboxes: one more is over quota, logged.
    let over = Command::CreateSandbox {
        opts: Default::default(),
        project: research.clone(),
        image: "pytorch:2.5-cuda".into(),
        cpu_millis: 1_000,
        memory_mb: 2_048,
        labels: BTreeMap::new(),
        timeout_seconds: Some(600),
    };
    assert_eq!(d.denied(&bot, over).await, "quota_exceeded");
    // CI's token reaching outside its project: forbidden, logged.
    let outside = Command::CreateSandbox {
        opts: Default::default(),
        project: team_a.clone(),
        image: "node:22-alpine".into(),
        cpu_millis: 500,
        memory_mb: 1_024,
        labels: BTreeMap::new(),
        timeout_seconds: None,
    };
    assert_eq!(d.denied(&ci, outside).await, "forbidden");

    // The edges report most sandboxes ready; one fails to start.
    let failed = x[2].clone();
    for id in a.iter().chain(&r).chain(&b).chain(&x).filter(|id| **id != failed) {
        d.report(&admin, id, Observation::Ready).await;
    }
    d.report(
        &admin,
        &failed,
        Observation::Failed {
            reason: "image pull failed: manifest unknown".into(),
        },
    )
    .await;

    // Pause / resume.
    d.ok(
        &dev,
        Command::PauseSandbox {
            sandbox: a[0].clone(),
            filesystem: false,
        },
    )
    .await;
    d.report(&admin, &a[0], Observation::Paused).await;
    d.ok(
        &dev,
        Command::ResumeSandbox {
            sandbox: a[0].clone(),
            cold: false,
        },
    )
    .await;
    d.report(&admin, &a[0], Observation::Resumed).await;
    d.ok(
        &ci,
        Command::PauseSandbox {
            sandbox: b[1].clone(),
            filesystem: false,
        },
    )
    .await;
    d.report(&admin, &b[1], Observation::Paused).await;

    // Fork a running sandbox three ways; the children come up.
    let fork = d
        .ok(
            &dev,
            Command::ForkSandbox {
                sandbox: a[1].clone(),
                count: 3,
                edge: None,
            },
        )
        .await;
    let children: Vec<String> = fork
        .decided
        .events
        .iter()
        .find_map(|e| match e {
            Event::SandboxForkRequested(f) => Some(f.children.clone()),
            _ => None,
        })
        .expect("a fork names its children");
    assert_eq!(children.len(), 3);
    for c in &children {
        d.report(&admin, c, Observation::Ready).await;
    }

    // Labels and timeouts.
    d.ok(
        &dev,
        Command::SetSandboxLabels {
            sandbox: a[3].clone(),
            labels: labels_of(&[("owner", "alice"), ("experiment", "e42")]),
        },
    )
    .await;
    d.ok(
        &ci,
        Command::SetSandboxLabels {
            sandbox: b[0].clone(),
            labels: labels_of(&[("ci", "true"), ("job", "job-0"), ("retry", "1")]),
        },
    )
    .await;
    d.ok(
        &ci,
        Command::SetSandboxTimeout {
            sandbox: b[0].clone(),
            timeout_seconds: 600,
        },
    )
    .await;
    d.ok(
        &dev,
        Command::SetSandboxTimeout {
            sandbox: children[0].clone(),
            timeout_seconds: 3_600,
        },
    )
    .await;
    d.ok(
        &dev,
        Command::SetSandboxTimeout {
            sandbox: children[0].clone(),
            timeout_seconds: 0,
        },
    )
    .await;

    // Kills and exits, one of them out of memory.
    d.ok(&dev, Command::KillSandbox { sandbox: a[2].clone() }).await;
    d.report(
        &admin,
        &a[2],
        Observation::Exited {
            exit_code: 143,
            oom_killed: false,
            reason: "killed".into(),
        },
    )
    .await;
    d.ok(
        &admin,
        Command::KillSandbox {
            sandbox: children[2].clone(),
        },
    )
    .await;
    d.report(
        &admin,
        &r[0],
        Observation::Exited {
            exit_code: 137,
            oom_killed: true,
            reason: "out of memory".into(),
        },
    )
    .await;
    d.report(
        &admin,
        &b[3],
        Observation::Exited {
            exit_code: 0,
            oom_killed: false,
            reason: String::new(),
        },
    )
    .await;
    d.report(
        &admin,
        &b[4],
        Observation::Exited {
            exit_code: 1,
            oom_killed: false,
            reason: "tests failed".into(),
        },
    )
    .await;
    // Pausing a sandbox that has ended: conflict, logged.
    assert_eq!(
        d.denied(
            &dev,
            Command::PauseSandbox {
                sandbox: a[2].clone(),
                filesystem: false
            }
        )
        .await,
        "conflict"
    );
    // Research has room again after the OOM: one more.
    r.push(
        d.sandbox(
            &bot,
            &research,
            "pytorch:2.5-cuda",
            1_500,
            3_072,
            &[("experiment", "exp-0"), ("retry", "1")],
        )
        .await,
    );

    // Revoke a token; a scratch project comes and goes.
    d.ok(
        &admin,
        Command::RevokeToken {
            token: bot_id,
            reason: "rotated after the experiment".into(),
        },
    )
    .await;
    let scratch = d.project(&admin, "scratch", &team_b).await;
    d.ok(&admin, Command::DeleteProject { project: scratch }).await;
    // A raised quota for team-b.
    d.quota(&admin, &team_b, 10, 16_000, 32_768).await;
}

/// E2B's create options, file-system snapshots and what forks keep.
async fn options_and_snapshots(d: &mut Driver, admin: &str, root: &str) {
    use opendsec_commands::{SandboxOptions, SnapshotResult};
    let (admin, root) = (admin.to_string(), root.to_string());
    for (edge, zone) in [("edge-a", "a"), ("edge-b", "b")] {
        let cmd = Command::RegisterEdge {
            edge: edge.into(),
            address: format!("10.0.1.{}:7402", if zone == "a" { 11 } else { 12 }),
            capacity: Usage {
                sandboxes: 32,
                cpu_millis: 512_000,
                memory_mb: 65_536,
                metadata_bytes: 0,
            },
            labels: labels_of(&[("zone", zone)]),
        };
        d.ok(&admin, cmd).await;
    }
    let agents = d.project(&admin, "agents", &root).await;
    d.quota(&admin, &agents, 16, 64_000, 16_384).await;
    let (_, key) = d
        .token(&admin, &agents, "e2b", &[Right::SandboxWrite, Right::SandboxRead], None)
        .await;
    let create = |image: &str,
                  env: &[(&str, &str)],
                  auto_pause: bool,
                  auto_resume: bool,
                  network: Option<&str>,
                  timeout: Option<u64>| Command::CreateSandbox {
        project: agents.clone(),
        image: image.into(),
        cpu_millis: 1_000,
        memory_mb: 512,
        labels: labels_of(&[("sdk", "e2b")]),
        timeout_seconds: timeout,
        opts: SandboxOptions {
            env: labels_of(env),
            auto_pause,
            auto_pause_filesystem: false,
            auto_resume,
            network: network.map(str::to_string),
            idempotency_key: None,
            isolation: None,
            cpu_class: None,
        },
    };
    // A sandbox with an environment (its values never show in views), auto-pause, auto-resume.
    let main = d
        .ok(
            &key,
            create(
                "base",
                &[("OPENAI_API_KEY", "sk-golden-not-a-secret"), ("MODE", "eval")],
                true,
                true,
                None,
                Some(300),
            ),
        )
        .await
        .decided
        .target;
    d.report(&admin, &main, Observation::Ready).await;
    // Network settings: recorded (no egress exists yet).
    d.ok(
        &key,
        Command::SetSandboxNetwork {
            sandbox: main.clone(),
            network: r#"{"allowPublicTraffic":false,"denyOut":["10.0.0.0/8"]}"#.into(),
        },
    )
    .await;
    // A bad environment name is refused before the log (not in it); a bad network too.
    let bad = create("base", &[("1NOPE", "x")], false, false, None, None);
    assert!(
        d.node
            .submit(Credential::Bearer(key.clone()), "golden-bad-env".into(), bad)
            .await
            .is_err()
    );
    // A snapshot of its files, taken by its edge; a sandbox started from it lands there.
    let snap = d
        .ok(
            &key,
            Command::CreateSnapshot {
                sandbox: main.clone(),
                name: "after-setup".into(),
            },
        )
        .await
        .decided
        .target;
    d.ok(
        &admin,
        Command::ReportSnapshot {
            snapshot: snap.clone(),
            result: SnapshotResult::Ready { size_bytes: 1_048_576 },
        },
    )
    .await;
    let from_snap = d
        .ok(
            &key,
            create(
                &snap,
                &[("MODE", "replay")],
                false,
                false,
                Some(r#"{"allowPublicTraffic":true}"#),
                Some(600),
            ),
        )
        .await
        .decided
        .target;
    d.report(&admin, &from_snap, Observation::Ready).await;
    // A second snapshot stacked on the first; the first cannot go while the second lies on it.
    let snap2 = d
        .ok(
            &key,
            Command::CreateSnapshot {
                sandbox: from_snap.clone(),
                name: String::new(),
            },
        )
        .await
        .decided
        .target;
    d.ok(
        &admin,
        Command::ReportSnapshot {
            snapshot: snap2.clone(),
            result: SnapshotResult::Ready { size_bytes: 65_536 },
        },
    )
    .await;
    assert_eq!(
        d.denied(&key, Command::DeleteSnapshot { snapshot: snap.clone() }).await,
        "conflict"
    );
    // A snapshot whose sandbox ended first fails.
    let doomed = d
        .ok(&key, create("base", &[], false, false, None, None))
        .await
        .decided
        .target;
    d.report(&admin, &doomed, Observation::Ready).await;
    let lost = d
        .ok(
            &key,
            Command::CreateSnapshot {
                sandbox: doomed.clone(),
                name: "too-late".into(),
            },
        )
        .await
        .decided
        .target;
    d.ok(
        &key,
        Command::KillSandbox {
            sandbox: doomed.clone(),
        },
    )
    .await;
    d.report(
        &admin,
        &doomed,
        Observation::Exited {
            exit_code: 137,
            oom_killed: false,
            reason: "user".into(),
        },
    )
    .await;
    d.ok(
        &admin,
        Command::ReportSnapshot {
            snapshot: lost,
            result: SnapshotResult::Failed {
                reason: format!("sandbox {doomed} ended before its snapshot was taken"),
            },
        },
    )
    .await;
    // Forks keep the environment and options, on the source's edge.
    let fork = d
        .ok(
            &key,
            Command::ForkSandbox {
                sandbox: main.clone(),
                count: 2,
                edge: None,
            },
        )
        .await;
    for e in &fork.decided.events {
        if let Event::SandboxCreated(c) = e {
            d.report(&admin, &c.id, Observation::Ready).await;
        }
    }
    // The edge finds the main sandbox past its timeout: it pauses instead of dying.
    d.report(&admin, &main, Observation::TimedOut).await;
    d.report(&admin, &main, Observation::Paused).await;
    // Auto-resume (the gateway on a request to it) and a new timeout.
    d.ok(
        &key,
        Command::ResumeSandbox {
            sandbox: main.clone(),
            cold: false,
        },
    )
    .await;
    d.report(&admin, &main, Observation::Resumed).await;
    d.ok(
        &key,
        Command::SetSandboxTimeout {
            sandbox: main.clone(),
            timeout_seconds: 120,
        },
    )
    .await;
    // Snapshots go, newest first.
    d.ok(&key, Command::DeleteSnapshot { snapshot: snap2 }).await;
    d.ok(&key, Command::DeleteSnapshot { snapshot: snap }).await;
}
