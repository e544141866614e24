//! The template's start command (`--start-file`): started once at boot as an
//! ordinary managed process (tag `start`, bounded output, in `process.List`),
//! and the readiness `/health` reports while it has a `ready_port` that has
//! not yet accepted a connection, or a `ready_cmd` (a template's `readyCmd`) that
//! has not yet exited 0. The ready command runs as a managed process too (tag
//! `ready`), so it gets every limit and profile a sandbox process gets.

use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::{START_TAG, StartCommand};
use crate::process::{End, Manager, Proc, ProcessConfig, StartRequest};
use crate::users;

/// How often the ready port is tried.
const PROBE_EVERY: Duration = Duration::from_millis(50);
/// The pause between two runs of a ready command.
const READY_CMD_EVERY: Duration = Duration::from_millis(200);

/// What `/health` says about the start command. Serializable: a restarted
/// server takes it over from the one before (see `chronus`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Readiness {
    /// No start command, or it is ready: `/health` is 204.
    Ready,
    /// The start command `pid` runs; `port` has not accepted a connection yet.
    Waiting { pid: u32, port: u16 },
    /// The start command `pid` runs; its ready command has not exited 0 yet.
    WaitingFor {
        pid: u32,
        ready_cmd: String,
        user: String,
        cwd: Option<String>,
    },
    /// It could not start, or ended before it was ready: `/health` is 503.
    Failed { message: String },
}

impl Readiness {
    /// `None` when healthy, else the 503's message.
    pub fn unhealthy(&self) -> Option<String> {
        match self {
            Readiness::Ready => None,
            Readiness::Waiting { port, .. } => Some(format!("starting: waiting for port {port}")),
            Readiness::WaitingFor { ready_cmd, .. } => Some(format!(
                "starting: waiting for its ready command ({ready_cmd}) to succeed"
            )),
            Readiness::Failed { message } => Some(message.clone()),
        }
    }
}

pub type Shared = Arc<Mutex<Readiness>>;

fn describe(end: &End) -> String {
    if end.exited {
        format!("exit code {}", end.exit_code)
    } else {
        format!("{} (exit code {})", end.status, end.exit_code)
    }
}

/// Changes the readiness, and tells the supervisor, which hands it to the
/// next server if this one dies.
fn set(state: &Shared, r: Readiness) {
    if let Some(link) = crate::chronus::link()
        && let Ok(v) = serde_json::to_value(&r)
    {
        link.save_state("readiness", v);
    }
    *state.lock().unwrap() = r;
}

fn fail(state: &Shared, message: String) {
    eprintln!("opendsec-agent: {message}");
    set(state, Readiness::Failed { message });
}

/// No start command: ready.
pub fn ready() -> Shared {
    Arc::new(Mutex::new(Readiness::Ready))
}

/// A restarted server takes the readiness over from the one before, and
/// follows the start command again if it was still getting ready.
pub fn resume(procs: &Arc<Manager>, saved: Option<serde_json::Value>) -> Shared {
    let r = saved
        .and_then(|v| serde_json::from_value(v).ok())
        .unwrap_or(Readiness::Ready);
    let state = Arc::new(Mutex::new(r.clone()));
    match r {
        Readiness::Waiting { pid, .. } | Readiness::WaitingFor { pid, .. } => match procs.find_pid(pid) {
            Some(p) => follow(procs, p, state.clone()),
            None => fail(
                &state,
                format!("start command (pid {pid}) ended while the agent restarted"),
            ),
        },
        Readiness::Ready | Readiness::Failed { .. } => {
            if let Some(p) = procs.find_tag(START_TAG) {
                follow(procs, p, state.clone());
            }
        }
    }
    state
}

/// Starts the start command (first boot only) and follows it. One that reads the
/// sandbox's variables on its stdin (`claim_stdin`) gets `claim_now` there at once, or
/// when None (a warm container), at the claim (see `claim.rs`).
pub fn boot(
    procs: &Arc<Manager>,
    cmd: StartCommand,
    default_user: &str,
    claim_now: Option<&crate::config::SandboxEnv>,
) -> Shared {
    let state: Shared = Arc::new(Mutex::new(Readiness::Ready));
    let user_name = cmd.user.clone().unwrap_or_else(|| default_user.to_string());
    let started = users::resolve(&user_name).and_then(|user| {
        procs.start(
            StartRequest {
                process: Some(ProcessConfig {
                    cmd: cmd.cmd.clone(),
                    args: cmd.args.clone(),
                    envs: cmd.envs.clone(),
                    cwd: cmd.cwd.clone(),
                }),
                pty: None,
                tag: Some(START_TAG.to_string()),
                stdin: Some(cmd.claim_stdin),
            },
            &user,
        )
    });
    match started {
        Err(e) => fail(
            &state,
            format!("start command '{}' could not start: {}", cmd.cmd, e.message),
        ),
        Ok(attached) => {
            let pid = attached.proc.pid;
            let attached_proc = attached.proc.clone();
            if let (true, Some(env)) = (cmd.claim_stdin, claim_now) {
                let (procs, env) = (procs.clone(), env.clone());
                tokio::spawn(async move { crate::claim::tell_start_command(&procs, &env).await });
            }
            // Nobody is attached: its output goes to the bounded backlog.
            attached.detach(None);
            if let Some(port) = cmd.ready_port {
                set(&state, Readiness::Waiting { pid, port });
            } else if let Some(ready_cmd) = cmd.ready_cmd.clone() {
                let waiting = Readiness::WaitingFor {
                    pid,
                    ready_cmd,
                    user: user_name,
                    cwd: cmd.cwd.clone(),
                };
                set(&state, waiting);
            }
            follow(procs, attached_proc, state.clone());
        }
    }
    state
}

/// Runs the ready command once, as a managed process (tag `ready`); whether it exited 0.
async fn ready_once(procs: &Arc<Manager>, ready_cmd: &str, user: &str, cwd: &Option<String>) -> bool {
    let Ok(user) = users::resolve(user) else {
        return false;
    };
    let req = StartRequest {
        process: Some(ProcessConfig {
            cmd: "/bin/bash".into(),
            args: vec!["-l".into(), "-c".into(), ready_cmd.to_string()],
            envs: Default::default(),
            cwd: cwd.clone(),
        }),
        pty: None,
        tag: Some(READY_TAG.to_string()),
        stdin: Some(false),
    };
    let Ok(attached) = procs.start(req, &user) else {
        return false;
    };
    let proc = attached.proc.clone();
    attached.detach(None);
    let end = proc.ended().await;
    end.exited && end.exit_code == 0
}

/// The tag of the ready command's runs in `process.List`.
pub const READY_TAG: &str = "ready";

/// Follows the start command: probes its ready port or runs its ready command (if
/// `state` waits for one) until it is ready, and notices an early end.
pub fn follow(procs: &Arc<Manager>, proc: Arc<Proc>, state: Shared) {
    let procs = procs.clone();
    tokio::spawn(async move {
        let pid = proc.pid;
        let (ready_port, ready_cmd) = match &*state.lock().unwrap() {
            Readiness::Waiting { port, .. } => (Some(*port), None),
            Readiness::WaitingFor {
                ready_cmd, user, cwd, ..
            } => (None, Some((ready_cmd.clone(), user.clone(), cwd.clone()))),
            _ => (None, None),
        };
        if let Some((ready_cmd, user, cwd)) = ready_cmd {
            let ready = async {
                while !ready_once(&procs, &ready_cmd, &user, &cwd).await {
                    tokio::time::sleep(READY_CMD_EVERY).await;
                }
            };
            tokio::select! {
                _ = ready => set(&state, Readiness::Ready),
                end = proc.ended() => {
                    return fail(&state, format!(
                        "start command (pid {pid}) ended with {} before its ready command succeeded",
                        describe(&end)
                    ));
                }
            }
        }
        if let Some(port) = ready_port {
            let ready = async {
                while tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
                    .await
                    .is_err()
                {
                    tokio::time::sleep(PROBE_EVERY).await;
                }
            };
            tokio::select! {
                _ = ready => set(&state, Readiness::Ready),
                end = proc.ended() => {
                    return fail(&state, format!(
                        "start command (pid {pid}) ended with {} before port {port} was ready",
                        describe(&end)
                    ));
                }
            }
        }
        let end = proc.ended().await;
        eprintln!(
            "opendsec-agent: start command (pid {pid}) ended with {}",
            describe(&end)
        );
    });
}
