//! `opendsecctl`: the command line over `opendsec_sdk::Client`. Tables for people
//! by default, `--output json` for scripts; errors say what to do next.
//! Exit codes: 0 done, 1 the call failed, 2 usage error (clap); `sandbox exec` and
//! `sandbox shell` exit with the remote process's exit code.

use clap::{Args, Parser, Subcommand, ValueEnum};
use opendsec_sdk::types::*;
use opendsec_sdk::{ApiError, AuditFilter, Client, DEFAULT_URL, ExecRequest, ReplayRequest, SandboxFilter};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

#[path = "opendsecctl/remote.rs"]
mod remote;

#[derive(Parser)]
#[command(
    name = "opendsecctl",
    version,
    about = "Manage an OpenDsec cluster: projects, quotas, tokens, sandboxes, edges, audit and time travel"
)]
struct Cli {
    /// The API's base URL.
    #[arg(long, global = true, env = "OPENDSEC_URL", default_value = DEFAULT_URL)]
    url: String,
    /// Bearer token (odsec_...). Else read from OPENDSEC_TOKEN_FILE or ~/.config/opendsec/token.
    #[arg(long, global = true, env = "OPENDSEC_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// Aligned tables for people, or the API's JSON for scripts.
    #[arg(long, short, global = true, value_enum, default_value_t = Output::Table)]
    output: Output,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
enum Cmd {
    /// Raft cluster status and membership.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Nested projects: create, list, get, delete.
    #[command(subcommand)]
    Project(ProjectCmd),
    /// A project's limits, effective limits and usage.
    #[command(subcommand)]
    Quota(QuotaCmd),
    /// Issue, list and revoke tokens.
    #[command(subcommand)]
    Token(TokenCmd),
    /// Shows the calling token: its project and rights.
    Whoami,
    /// Create, inspect and steer sandboxes.
    #[command(subcommand)]
    Sandbox(SandboxCmd),
    /// Snapshots of sandboxes (`sandbox snapshot` takes one): list, get, delete.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// Every sandbox labelled task=<name> at once: pause, resume.
    #[command(subcommand)]
    Task(TaskCmd),
    /// The machines that run sandboxes.
    #[command(subcommand)]
    Edge(EdgeCmd),
    /// Who did what, when, to what, with what result.
    Audit(AuditArgs),
    /// Rebuilds views as they were at a past index or time, or diffs two points.
    Replay(ReplayArgs),
    /// E2B compatibility: run code written for the E2B SDK against this cluster.
    #[command(subcommand)]
    E2b(E2bCmd),
}

#[derive(Subcommand)]
enum E2bCmd {
    /// Issues an E2B API key for the current project (sandbox:read, sandbox:write) and
    /// prints the three `export` lines the E2B SDK needs.
    Env {
        /// The key's name.
        #[arg(long, default_value = "e2b")]
        name: String,
        /// Lifetime of the key (default: no expiry of its own).
        #[arg(long)]
        ttl_seconds: Option<u64>,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Leader, term, indexes, members and the state hash of the node answering.
    Status,
    /// Adds a control node (it catches up as a learner, then votes).
    AddNode {
        #[arg(long)]
        id: u64,
        /// host:port of its peer (Raft) port.
        #[arg(long)]
        addr: String,
    },
    /// Removes a control node from the cluster.
    RemoveNode {
        #[arg(long)]
        id: u64,
    },
}

#[derive(Subcommand)]
enum ProjectCmd {
    /// Creates a project under --parent.
    Create {
        name: String,
        /// Parent project id (default: the token's project).
        #[arg(long)]
        parent: Option<String>,
    },
    /// Projects in the token's subtree.
    List,
    Get {
        id: String,
    },
    /// Deletes an empty project (no children, no live sandboxes).
    Delete {
        id: String,
    },
}

#[derive(Subcommand)]
enum QuotaCmd {
    /// Sets a project's limits; a resource left out is unlimited.
    Set {
        project: String,
        #[arg(long)]
        sandboxes: Option<u64>,
        #[arg(long)]
        cpu_millis: Option<u64>,
        #[arg(long)]
        memory_mb: Option<u64>,
    },
    /// Own limits, effective limits and usage.
    Get { project: String },
}

#[derive(Subcommand)]
enum TokenCmd {
    /// Issues a token; its secret is printed once.
    Issue {
        #[arg(long)]
        name: String,
        /// Project id (default: the token's project).
        #[arg(long)]
        project: Option<String>,
        /// Comma-separated, e.g. sandbox:read,sandbox:write.
        #[arg(long, value_delimiter = ',', required = true)]
        rights: Vec<String>,
        #[arg(long)]
        ttl_seconds: Option<u64>,
        /// `opendsec` (odsec_…) or `e2b` (an E2B API key, e2b_…).
        #[arg(long, default_value = "opendsec")]
        format: String,
    },
    /// Tokens of the subtree (never their secrets).
    List {
        #[arg(long)]
        project: Option<String>,
    },
    /// Revokes a token at once.
    Revoke {
        id: String,
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Subcommand)]
enum SandboxCmd {
    /// Creates a sandbox, placed on an edge with room.
    Create {
        #[arg(long)]
        image: String,
        #[arg(long)]
        project: Option<String>,
        /// Default 1000.
        #[arg(long)]
        cpu_millis: Option<u64>,
        /// Default 512.
        #[arg(long)]
        memory_mb: Option<u64>,
        /// key=value; repeat for several.
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        #[arg(long)]
        timeout_seconds: Option<u64>,
        /// container (the default), microvm (a QEMU microVM: its pause, snapshots and
        /// forks carry its memory) or vm (a full VM: a q35 PC booting the image as a
        /// whole disk; memory carried as a microVM's).
        #[arg(long, value_enum)]
        isolation: Option<IsolationArg>,
    },
    /// Live sandboxes (or those in --state).
    List {
        #[arg(long)]
        project: Option<String>,
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// pending, running, pausing, paused, resuming, killed, failed or exited.
        #[arg(long)]
        state: Option<String>,
    },
    Get {
        id: String,
    },
    /// Kills it; its quota is given back.
    Kill {
        id: String,
    },
    /// The end of the sandbox's console: its PID 1 output (the agent's log, a template's
    /// start command).
    Logs {
        id: String,
        /// At most this many of the last bytes.
        #[arg(long, default_value_t = 65536)]
        max_bytes: u64,
    },
    /// One sample of its CPU, memory and disk, taken now by its edge; for a VM also its
    /// VMM and the accelerator its guest runs under.
    Metrics {
        id: String,
    },
    Pause {
        id: String,
    },
    Resume {
        id: String,
    },
    /// Takes a snapshot (a container's file system; a microVM's memory, device state and
    /// disk) and waits until its edge has taken it. Start sandboxes from it with
    /// `sandbox create --image <snapshot id>`.
    Snapshot {
        id: String,
        #[arg(long)]
        name: Option<String>,
        /// Return as soon as it is logged (pending), without waiting for the edge.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the edge at most.
        #[arg(long, default_value_t = 300)]
        wait_seconds: u64,
    },
    /// Clones a live sandbox --count times (on its edge while it has room, else on others,
    /// which pull its state from its edge).
    Fork {
        id: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Place every copy on this edge.
        #[arg(long)]
        edge: Option<String>,
    },
    /// Sets the lifetime from now; 0 removes it.
    SetTimeout {
        id: String,
        seconds: u64,
    },
    /// Replaces every label.
    SetLabels {
        id: String,
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// Runs a command in the sandbox, streaming its output; exits with its exit code.
    ///
    /// The first word is the program, the rest its arguments; there is no shell
    /// unless you ask for one: `opendsecctl sandbox exec ID -- sh -c 'ls | wc -l'`.
    Exec {
        id: String,
        /// The user in the sandbox (default: the sandbox's default user).
        #[arg(long)]
        user: Option<String>,
        /// KEY=VALUE; repeat for several.
        #[arg(long = "env", value_parser = parse_label)]
        envs: Vec<(String, String)>,
        /// Working directory (default: the user's home).
        #[arg(long)]
        cwd: Option<String>,
        /// The program and its arguments (after `--`).
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "CMD"
        )]
        command: Vec<String>,
    },
    /// An interactive shell on a terminal in the sandbox (exits with the shell's code).
    Shell {
        id: String,
        #[arg(long)]
        user: Option<String>,
        /// The program to run.
        #[arg(long, default_value = "/bin/bash")]
        cmd: String,
    },
    /// Copies a file into or out of a sandbox: one side is ID:PATH, the other a local
    /// path (`-` for stdin/stdout).
    Cp {
        src: String,
        dst: String,
        #[arg(long)]
        user: Option<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum IsolationArg {
    Container,
    Microvm,
    Vm,
}

impl From<IsolationArg> for Isolation {
    fn from(i: IsolationArg) -> Isolation {
        match i {
            IsolationArg::Container => Isolation::Container,
            IsolationArg::Microvm => Isolation::Microvm,
            IsolationArg::Vm => Isolation::Vm,
        }
    }
}

#[derive(Subcommand)]
enum SnapshotCmd {
    /// Snapshots in your project subtree.
    List {
        /// Only those of this sandbox.
        #[arg(long)]
        sandbox: Option<String>,
    },
    Get {
        id: String,
    },
    /// Deletes it (sandboxes started from it run on).
    Delete {
        id: String,
    },
}

#[derive(Subcommand)]
enum TaskCmd {
    /// Pauses every running sandbox labelled task=<TASK> (containers freeze, microVMs
    /// snapshot and end their VMM), in one logged call.
    Pause { task: String },
    /// Resumes every paused sandbox labelled task=<TASK>.
    Resume { task: String },
}

#[derive(Subcommand)]
enum EdgeCmd {
    /// Edges with capacity, assignment and last heartbeat.
    List,
    /// Registers an edge (or updates its address, capacity and labels).
    Register {
        #[arg(long)]
        edge: String,
        #[arg(long)]
        address: String,
        #[arg(long)]
        sandboxes: u64,
        #[arg(long)]
        cpu_millis: u64,
        #[arg(long)]
        memory_mb: u64,
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// Stops placing sandboxes on an edge.
    Deregister { id: String },
}

#[derive(Args)]
struct AuditArgs {
    /// token:<id> or a token id.
    #[arg(long)]
    principal: Option<String>,
    #[arg(long)]
    project: Option<String>,
    /// e.g. sandbox.create
    #[arg(long)]
    action: Option<String>,
    #[arg(long)]
    target: Option<String>,
    /// RFC 3339 or ms since the epoch.
    #[arg(long)]
    since: Option<String>,
    #[arg(long)]
    until: Option<String>,
    /// Records per page (default 100, at most 1000).
    #[arg(long)]
    limit: Option<u64>,
    /// Start after this log index (the `next` of a previous page).
    #[arg(long)]
    after: Option<u64>,
    /// Follow the pages to the end.
    #[arg(long)]
    all: bool,
}

#[derive(Args)]
struct ReplayArgs {
    /// A log index or an RFC 3339 time.
    #[arg(long)]
    to: String,
    /// sandboxes, placement, quota, iam or audit (default: all).
    #[arg(long)]
    view: Option<String>,
    /// List the changes from this index or time to --to.
    #[arg(long)]
    diff_from: Option<String>,
}

fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not key=value"))
}

/// The token from the flag/env, else OPENDSEC_TOKEN_FILE, else ~/.config/opendsec/token.
fn find_token(flag: Option<String>) -> Option<String> {
    if let Some(t) = flag.filter(|t| !t.trim().is_empty()) {
        return Some(t.trim().to_string());
    }
    let path = std::env::var_os("OPENDSEC_TOKEN_FILE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config/opendsec/token")))?;
    let t = std::fs::read_to_string(path).ok()?;
    Some(t.trim().to_string()).filter(|t| !t.is_empty())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let url = cli.url.clone();
    match rt.block_on(run(cli)) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            let (message, hint) = match servers_remedy(&e) {
                Some((what, how)) => (what.to_string(), how.to_string()),
                None => (e.message.clone(), hint(&e, &url)),
            };
            eprintln!("error: {message}");
            if let Some(f) = &e.field {
                eprintln!("  field: {f}");
            }
            eprintln!("hint: {hint}");
            ExitCode::from(1)
        }
    }
}

/// When no edge runs the isolation asked for, the server knows the cause and the next
/// step better than a generic hint: its message is "<what is missing>: <what to do>".
fn servers_remedy(e: &ApiError) -> Option<(&str, &str)> {
    let names_isolation = e.status == 503 && e.code == "no_capacity" && e.field.as_deref() == Some("isolation");
    names_isolation.then(|| e.message.split_once(": ")).flatten()
}

fn hint(e: &ApiError, url: &str) -> String {
    match (e.status, e.code.as_str()) {
        (0, "invalid_url") => "pass --url (or OPENDSEC_URL) as http://host:port".into(),
        (0, "decode") => "the server answered something this client does not understand; are client and server the same version?".into(),
        (0, _) => format!("is the server running at {url}? set --url or OPENDSEC_URL; `opendsec up` starts one"),
        (401, _) => "check OPENDSEC_TOKEN (or --token, OPENDSEC_TOKEN_FILE, ~/.config/opendsec/token); `opendsec init` prints an admin token".into(),
        (403, _) => "the token lacks the right or the project is outside its scope; `opendsecctl whoami` shows its project and rights".into(),
        (404, _) => "check the id; the `list` subcommands show what exists".into(),
        (409, _) => "the current state does not allow this; `get` the object to see its state".into(),
        (413, _) => "the request is over 1 MiB; send less at once".into(),
        (429, _) => "the project's quota is used up: `opendsecctl quota get <project>`; kill sandboxes or ask a parent project's admin to raise it".into(),
        (503, "no_capacity") => "no edge has room: `opendsecctl edge list` shows capacity; register an edge or free some".into(),
        (503, _) => "the control plane has no leader or this node lags; retry shortly, and see `opendsecctl cluster status`".into(),
        (400, _) => match &e.field {
            Some(f) => format!("fix `{f}` and retry; `--help` lists the options"),
            None => "fix the request and retry; `--help` lists the options".into(),
        },
        (s, _) if s >= 500 => "a server error: its log has details under the request id".into(),
        _ => "see `opendsecctl --help`".into(),
    }
}

async fn run(cli: Cli) -> Result<u8, ApiError> {
    let client = Client::new(&cli.url, find_token(cli.token))?;
    let out = Printer(cli.output);
    match cli.command {
        Cmd::E2b(E2bCmd::Env { name, ttl_seconds }) => {
            let rights = vec!["sandbox:read".to_string(), "sandbox:write".to_string()];
            let t = client
                .issue_token(&IssueToken {
                    project: None,
                    name,
                    rights,
                    ttl_seconds,
                    format: Some("e2b".into()),
                })
                .await?;
            let base = cli.url.trim_end_matches('/');
            out.show(&t, |t| {
                format!(
                    "export E2B_API_KEY={}\nexport E2B_API_URL={base}\nexport E2B_SANDBOX_URL={base}\n# E2B key {} of project {}; its secret is shown only now.",
                    t.token, t.id, t.project
                )
            });
        }
        Cmd::Cluster(c) => {
            let status = match c {
                ClusterCmd::Status => client.cluster_status().await?,
                ClusterCmd::AddNode { id, addr } => client.add_member(id, &addr).await?,
                ClusterCmd::RemoveNode { id } => client.remove_member(id).await?,
            };
            out.show(&status, |s| {
                let mut rows = vec![
                    vec!["node".into(), s.node_id.to_string()],
                    vec!["leader".into(), s.leader_id.map_or("none".into(), |l| l.to_string())],
                    vec!["term".into(), s.term.to_string()],
                    vec!["last log index".into(), s.last_log_index.to_string()],
                    vec!["applied index".into(), s.applied_index.to_string()],
                    vec!["first available".into(), s.first_available_index.to_string()],
                    vec!["state hash".into(), s.state_hash.clone()],
                ];
                for (id, addr) in &s.members {
                    let role = if s.voters.contains(id) { "voter" } else { "learner" };
                    rows.push(vec![format!("member {id}"), format!("{addr} ({role})")]);
                }
                table(&["FIELD", "VALUE"], rows)
            });
        }
        Cmd::Project(c) => match c {
            ProjectCmd::Create { name, parent } => {
                let w = client.create_project(&name, parent.as_deref()).await?;
                out.show(&w, |w| {
                    format!(
                        "created project {} ({}) at index {}",
                        w.project.id, w.project.name, w.index
                    )
                });
            }
            ProjectCmd::List => {
                let l = client.list_projects().await?;
                out.show(&l, |l| {
                    table(
                        &["ID", "NAME", "PARENT", "CREATED"],
                        l.projects.iter().map(project_row).collect(),
                    )
                });
            }
            ProjectCmd::Get { id } => {
                let p = client.get_project(&id).await?;
                out.show(&p, |p| {
                    table(&["ID", "NAME", "PARENT", "CREATED"], vec![project_row(p)])
                });
            }
            ProjectCmd::Delete { id } => {
                let d = client.delete_project(&id).await?;
                out.show(&d, |d| format!("deleted project {id} at index {}", d.index));
            }
        },
        Cmd::Quota(c) => {
            let q = match c {
                QuotaCmd::Set {
                    project,
                    sandboxes,
                    cpu_millis,
                    memory_mb,
                } => {
                    client
                        .set_quota(
                            &project,
                            &Limits {
                                sandboxes,
                                cpu_millis,
                                memory_mb,
                            },
                        )
                        .await?
                }
                QuotaCmd::Get { project } => client.get_quota(&project).await?,
            };
            out.show(&q, |q| {
                let lim = |v: Option<u64>| v.map_or("unlimited".into(), |v| v.to_string());
                table(
                    &["RESOURCE", "LIMIT", "EFFECTIVE", "USED"],
                    vec![
                        vec![
                            "sandboxes".into(),
                            lim(q.limits.sandboxes),
                            lim(q.effective.sandboxes),
                            q.usage.sandboxes.to_string(),
                        ],
                        vec![
                            "cpu_millis".into(),
                            lim(q.limits.cpu_millis),
                            lim(q.effective.cpu_millis),
                            q.usage.cpu_millis.to_string(),
                        ],
                        vec![
                            "memory_mb".into(),
                            lim(q.limits.memory_mb),
                            lim(q.effective.memory_mb),
                            q.usage.memory_mb.to_string(),
                        ],
                    ],
                )
            });
        }
        Cmd::Token(c) => match c {
            TokenCmd::Issue {
                name,
                project,
                rights,
                ttl_seconds,
                format,
            } => {
                let t = client
                    .issue_token(&IssueToken {
                        project,
                        name,
                        rights,
                        ttl_seconds,
                        format: Some(format),
                    })
                    .await?;
                out.show(&t, |t| {
                    format!(
                        "issued token {} in project {} (expires {})\n\n  {}\n\nThis secret is shown only now: store it (e.g. in OPENDSEC_TOKEN).",
                        t.id,
                        t.project,
                        t.expires_at_ms.map_or("never".into(), fmt_time),
                        t.token
                    )
                });
            }
            TokenCmd::List { project } => {
                let l = client.list_tokens(project.as_deref()).await?;
                out.show(&l, |l| {
                    let rows = l
                        .tokens
                        .iter()
                        .map(|t| {
                            let state = match &t.revoked {
                                Some(r) => format!("revoked: {}", r.reason),
                                None => "active".into(),
                            };
                            vec![
                                t.id.clone(),
                                t.name.clone(),
                                t.project.clone(),
                                t.rights.join(","),
                                t.expires_at_ms.map_or("never".into(), fmt_time),
                                state,
                            ]
                        })
                        .collect();
                    table(&["ID", "NAME", "PROJECT", "RIGHTS", "EXPIRES", "STATE"], rows)
                });
            }
            TokenCmd::Revoke { id, reason } => {
                let d = client.revoke_token(&id, reason.as_deref()).await?;
                out.show(&d, |d| format!("revoked token {id} at index {}", d.index));
            }
        },
        Cmd::Whoami => {
            let w = client.whoami().await?;
            out.show(&w, |w| {
                table(
                    &["FIELD", "VALUE"],
                    vec![
                        vec!["token".into(), w.token_id.clone()],
                        vec!["project".into(), format!("{} ({})", w.project, w.project_name)],
                        vec!["rights".into(), w.rights.join(",")],
                        vec!["expires".into(), w.expires_at_ms.map_or("never".into(), fmt_time)],
                    ],
                )
            });
        }
        Cmd::Sandbox(c) => return sandbox(&client, out, c).await,
        Cmd::Snapshot(c) => return snapshot(&client, out, c).await,
        Cmd::Task(c) => return task(&client, out, c).await,
        Cmd::Edge(c) => match c {
            EdgeCmd::List => {
                let l = client.list_edges().await?;
                out.show(&l, |l| table(&EDGE_HEADERS, l.edges.iter().map(edge_row).collect()));
            }
            EdgeCmd::Register {
                edge,
                address,
                sandboxes,
                cpu_millis,
                memory_mb,
                labels,
            } => {
                let req = RegisterEdge {
                    edge,
                    address,
                    capacity: Resources {
                        sandboxes,
                        cpu_millis,
                        memory_mb,
                    },
                    labels: labels.into_iter().collect(),
                };
                let w = client.register_edge(&req).await?;
                out.show(&w, |w| table(&EDGE_HEADERS, vec![edge_row(&w.edge)]));
            }
            EdgeCmd::Deregister { id } => {
                let w = client.deregister_edge(&id).await?;
                out.show(&w, |w| format!("deregistered edge {} at index {}", w.edge.id, w.index));
            }
        },
        Cmd::Audit(a) => {
            let mut f = AuditFilter {
                principal: a.principal,
                project: a.project,
                action: a.action,
                target: a.target,
                since: a.since,
                until: a.until,
                after: a.after,
                limit: a.limit,
            };
            let mut page = client.audit(&f).await?;
            if a.all {
                while let Some(next) = page.next {
                    f.after = Some(next);
                    let more = client.audit(&f).await?;
                    page.records.extend(more.records);
                    page.next = more.next;
                }
            }
            out.show(&page, |p| {
                let rows = p
                    .records
                    .iter()
                    .map(|r| {
                        let result = match (&r.code, &r.message) {
                            (Some(c), _) => format!("{} ({c})", r.result),
                            (None, Some(m)) => format!("{}: {m}", r.result),
                            _ => r.result.clone(),
                        };
                        vec![
                            r.index.to_string(),
                            fmt_time(r.time_ms),
                            r.principal.clone(),
                            r.action.clone(),
                            r.project.clone(),
                            r.target.clone(),
                            result,
                        ]
                    })
                    .collect();
                let mut s = table(
                    &["INDEX", "TIME", "PRINCIPAL", "ACTION", "PROJECT", "TARGET", "RESULT"],
                    rows,
                );
                if let Some(n) = p.next {
                    s.push_str(&format!("\nmore: --after {n} (or --all)"));
                }
                s
            });
        }
        Cmd::Replay(r) => {
            let rep = client
                .replay(&ReplayRequest {
                    to: Some(r.to),
                    view: r.view,
                    diff_from: r.diff_from,
                })
                .await?;
            out.show(&rep, |rep| match (&rep.changes, &rep.views) {
                (Some(changes), _) => {
                    let rows = changes
                        .iter()
                        .map(|c| vec![c.path.clone(), compact(&c.before), compact(&c.after)])
                        .collect();
                    format!(
                        "changes from index {} to index {} ({}):\n{}",
                        rep.from_index.unwrap_or(0),
                        rep.index,
                        fmt_time(rep.time_ms),
                        table(&["PATH", "BEFORE", "AFTER"], rows)
                    )
                }
                (None, Some(views)) => format!(
                    "views at index {} ({}):\n{}",
                    rep.index,
                    fmt_time(rep.time_ms),
                    serde_json::to_string_pretty(views).unwrap_or_default()
                ),
                (None, None) => format!("index {}: nothing to show", rep.index),
            });
        }
    }
    Ok(0)
}

async fn sandbox(client: &Client, out: Printer, c: SandboxCmd) -> Result<u8, ApiError> {
    let written = match c {
        SandboxCmd::Create {
            image,
            project,
            cpu_millis,
            memory_mb,
            labels,
            timeout_seconds,
            isolation,
        } => {
            let req = CreateSandbox {
                project,
                image,
                cpu_millis,
                memory_mb,
                labels: (!labels.is_empty()).then(|| labels.into_iter().collect()),
                timeout_seconds,
                isolation: isolation.map(Isolation::from),
                auto_resume: None,
            };
            client.create_sandbox(&req).await?
        }
        SandboxCmd::List { project, labels, state } => {
            let l = client
                .list_sandboxes(&SandboxFilter {
                    project,
                    labels: labels.into_iter().collect(),
                    state,
                })
                .await?;
            out.show(&l, |l| {
                table(&SANDBOX_HEADERS, l.sandboxes.iter().map(sandbox_row).collect())
            });
            return Ok(0);
        }
        SandboxCmd::Get { id } => {
            let s = client.get_sandbox(&id).await?;
            out.show(&s, |s| table(&SANDBOX_HEADERS, vec![sandbox_row(s)]));
            return Ok(0);
        }
        SandboxCmd::Logs { id, max_bytes } => {
            use std::io::Write;
            let bytes = client.sandbox_logs(&id, Some(max_bytes)).await?;
            let _ = std::io::stdout().write_all(&bytes);
            return Ok(0);
        }
        SandboxCmd::Metrics { id } => {
            let m = client.sandbox_metrics(&id).await?;
            out.show(&m, |m| {
                let mb = |b: u64| format!("{:.1}", b as f64 / (1 << 20) as f64);
                let runtime = match (&m.vmm, &m.accelerator) {
                    (Some(v), Some(a)) => format!("{v}, {a}"),
                    _ => "container".into(),
                };
                table(
                    &["CPUS", "CPU %", "MEM (MB)", "CACHE (MB)", "DISK (MB)", "RUNS ON"],
                    vec![vec![
                        m.cpu_count.to_string(),
                        format!("{:.1}", m.cpu_used_pct),
                        format!("{}/{}", mb(m.mem_used), mb(m.mem_total)),
                        mb(m.mem_cache),
                        format!("{}/{}", mb(m.disk_used), mb(m.disk_total)),
                        runtime,
                    ]],
                )
            });
            return Ok(0);
        }
        SandboxCmd::Fork { id, count, edge } => {
            let f = client.fork_sandbox_to(&id, count, edge.as_deref()).await?;
            out.show(&f, |f| {
                format!(
                    "forked {id} at index {}:\n{}",
                    f.index,
                    table(&SANDBOX_HEADERS, f.sandboxes.iter().map(sandbox_row).collect())
                )
            });
            return Ok(0);
        }
        SandboxCmd::Snapshot {
            id,
            name,
            no_wait,
            wait_seconds,
        } => {
            let w = client.create_snapshot(&id, name.as_deref()).await?;
            let mut snap = w.snapshot;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(wait_seconds);
            while !no_wait && snap.state == "pending" && std::time::Instant::now() < deadline {
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
                snap = client.get_snapshot(&snap.id).await?;
            }
            out.show(&snap, |x| table(&SNAPSHOT_HEADERS, vec![snapshot_row(x)]));
            return Ok(if snap.state == "failed" { 1 } else { 0 });
        }
        SandboxCmd::Kill { id } => client.kill_sandbox(&id).await?,
        SandboxCmd::Pause { id } => client.pause_sandbox(&id).await?,
        SandboxCmd::Resume { id } => client.resume_sandbox(&id).await?,
        SandboxCmd::SetTimeout { id, seconds } => client.set_sandbox_timeout(&id, seconds).await?,
        SandboxCmd::Exec {
            id,
            user,
            envs,
            cwd,
            command,
        } => {
            let mut words = command.into_iter();
            let cmd = words.next().expect("clap requires a command");
            let req = ExecRequest {
                cmd,
                args: words.collect(),
                envs: envs.into_iter().collect(),
                cwd,
                user,
            };
            return remote::exec(client, &id, &req).await;
        }
        SandboxCmd::Shell { id, user, cmd } => return remote::shell(client, &id, user, cmd).await,
        SandboxCmd::Cp { src, dst, user } => return remote::copy(client, out, &src, &dst, user.as_deref()).await,
        SandboxCmd::SetLabels { id, labels } => {
            client
                .set_sandbox_labels(&id, labels.into_iter().collect::<BTreeMap<_, _>>())
                .await?
        }
    };
    out.show(&written, |w| table(&SANDBOX_HEADERS, vec![sandbox_row(&w.sandbox)]));
    Ok(0)
}

async fn snapshot(client: &Client, out: Printer, c: SnapshotCmd) -> Result<u8, ApiError> {
    match c {
        SnapshotCmd::List { sandbox } => {
            let l = client.list_snapshots(sandbox.as_deref()).await?;
            out.show(&l, |l| {
                table(&SNAPSHOT_HEADERS, l.snapshots.iter().map(snapshot_row).collect())
            });
        }
        SnapshotCmd::Get { id } => {
            let x = client.get_snapshot(&id).await?;
            out.show(&x, |x| table(&SNAPSHOT_HEADERS, vec![snapshot_row(x)]));
        }
        SnapshotCmd::Delete { id } => {
            let d = client.delete_snapshot(&id).await?;
            out.show(&d, |d| format!("snapshot {id} deleted at index {}", d.index));
        }
    }
    Ok(0)
}

async fn task(client: &Client, out: Printer, c: TaskCmd) -> Result<u8, ApiError> {
    let (verb, w) = match c {
        TaskCmd::Pause { task } => ("pausing", client.pause_task(&task).await?),
        TaskCmd::Resume { task } => ("resuming", client.resume_task(&task).await?),
    };
    out.show(&w, |w| {
        format!(
            "task {}: {verb} {} of {} sandboxes (index {}):\n{}",
            w.task,
            w.changed.len(),
            w.sandboxes.len(),
            w.index,
            table(&SANDBOX_HEADERS, w.sandboxes.iter().map(sandbox_row).collect())
        )
    });
    Ok(0)
}

const SNAPSHOT_HEADERS: [&str; 7] = ["ID", "STATE", "SANDBOX", "ISOLATION", "NAME", "SIZE", "CREATED"];

fn snapshot_row(x: &Snapshot) -> Vec<String> {
    let state = match &x.reason {
        Some(r) if x.state == "failed" => format!("failed: {r}"),
        _ => x.state.clone(),
    };
    vec![
        x.id.clone(),
        state,
        x.sandbox.clone(),
        x.isolation.as_str().into(),
        if x.name.is_empty() { "-".into() } else { x.name.clone() },
        format!("{} MB", x.size_bytes >> 20),
        fmt_time(x.created_at_ms),
    ]
}

const SANDBOX_HEADERS: [&str; 9] = [
    "ID",
    "STATE",
    "ISOLATION",
    "PROJECT",
    "EDGE",
    "IMAGE",
    "CPU/MEM",
    "LABELS",
    "EXPIRES",
];

fn sandbox_row(s: &Sandbox) -> Vec<String> {
    vec![
        s.id.clone(),
        s.state.clone(),
        match &s.runtime {
            // How a VM runs: e.g. `microvm (qemu, tcg)`.
            Some(r) => format!("{} ({}, {})", s.isolation.as_str(), r.vmm, r.accelerator),
            None => s.isolation.as_str().into(),
        },
        s.project.clone(),
        s.edge.clone(),
        s.image.clone(),
        format!("{}m/{}MB", s.cpu_millis, s.memory_mb),
        labels(&s.labels),
        s.expires_at_ms.map_or("never".into(), fmt_time),
    ]
}

const EDGE_HEADERS: [&str; 7] = [
    "ID",
    "ADDRESS",
    "SANDBOXES",
    "CPU (m)",
    "MEMORY (MB)",
    "HEARTBEAT",
    "STATE",
];

fn edge_row(e: &Edge) -> Vec<String> {
    vec![
        e.id.clone(),
        e.address.clone(),
        format!("{}/{}", e.assigned.sandboxes, e.capacity.sandboxes),
        format!("{}/{}", e.assigned.cpu_millis, e.capacity.cpu_millis),
        format!("{}/{}", e.assigned.memory_mb, e.capacity.memory_mb),
        e.heartbeat.as_ref().map_or("none".into(), |h| fmt_time(h.at_ms)),
        if e.deregistered {
            "deregistered".into()
        } else {
            "registered".into()
        },
    ]
}

fn project_row(p: &Project) -> Vec<String> {
    vec![
        p.id.clone(),
        p.name.clone(),
        p.parent.clone().unwrap_or_else(|| "-".into()),
        fmt_time(p.created_at_ms),
    ]
}

fn labels(l: &BTreeMap<String, String>) -> String {
    if l.is_empty() {
        return "-".into();
    }
    l.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

fn compact(v: &Option<serde_json::Value>) -> String {
    let s = v.as_ref().map_or("-".into(), |v| v.to_string());
    if s.chars().count() > 60 {
        format!("{}...", s.chars().take(57).collect::<String>())
    } else {
        s
    }
}

fn fmt_time(ms: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000);
    let fmt = time::macros::format_description!("[year]-[month]-[day] [hour]:[minute]:[second]Z");
    t.ok()
        .and_then(|t| t.format(&fmt).ok())
        .unwrap_or_else(|| ms.to_string())
}

/// Aligned columns, two spaces apart.
fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let s: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        s.join("  ").trim_end().to_string()
    };
    let mut out = vec![line(headers.to_vec())];
    out.extend(rows.iter().map(|r| line(r.iter().map(String::as_str).collect())));
    out.join("\n")
}

#[derive(Clone, Copy)]
struct Printer(Output);

impl Printer {
    fn show<T: Serialize>(&self, v: &T, human: impl FnOnce(&T) -> String) {
        match self.0 {
            Output::Json => println!("{}", serde_json::to_string_pretty(v).expect("API types serialise")),
            Output::Table => println!("{}", human(v)),
        }
    }
}
