//! `opendsecctl`: the command line over `opendsec_sdk::Client`. Tables for people
//! by default, `--output json` for scripts; errors say what to do next.
//! Exit codes: 0 done, 1 the call failed, 2 usage error (clap); `sandbox exec` and
//! `sandbox shell` exit with the remote process's exit code.

use clap::Parser;
use opendsec_sdk::types::*;
use opendsec_sdk::{ApiError, AuditFilter, Client, ExecRequest, ReplayRequest, SandboxFilter};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;

#[path = "opendsecctl/args.rs"]
mod args;
#[path = "opendsecctl/images.rs"]
mod images;
#[path = "opendsecctl/print.rs"]
mod print;
#[path = "opendsecctl/remote.rs"]
mod remote;

use args::*;
use print::*;

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
    // Like other command-line tools, end quietly when the reader of stdout goes away
    // (`opendsecctl sandbox list | head`) instead of panicking on the broken pipe.
    // SAFETY: restoring the default disposition of SIGPIPE before any thread starts.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
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
        (0, "not_started") => "`opendsecctl sandbox get <id>` shows its state and reason, `sandbox logs <id>` its output, \
             `edge list` the edges"
            .into(),
        (0, "local_file") => "check the path: the file is read on this machine, not on the server".into(),
        (400, _) if e.message.starts_with("the tarball was refused") => "the file must be a docker-archive (`docker save`, \
             `skopeo copy … docker-archive:FILE`) or an OCI layout (`skopeo copy … oci-archive:FILE`), gzipped or not"
            .into(),
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
        Cmd::Cluster(ClusterCmd::RotateCerts) => {
            let r = client.rotate_certificates().await?;
            let failed = r.nodes.iter().filter(|n| n.error.is_some()).count();
            out.show(&r, |r| {
                let rows = r
                    .nodes
                    .iter()
                    .map(|n| {
                        vec![
                            n.node_id.to_string(),
                            match (&n.error, n.not_after_ms) {
                                (Some(e), _) => format!("not rotated: {e}"),
                                (None, Some(ms)) => format!("rotated, valid until {}", fmt_time(ms)),
                                (None, None) => "rotated".into(),
                            },
                        ]
                    })
                    .collect();
                format!(
                    "{}\nedges: {}",
                    table(&["NODE", "CERTIFICATE"], rows).trim_end(),
                    r.edges
                )
            });
            if failed > 0 {
                eprintln!(
                    "error: {failed} node(s) were not rotated (see above): bring them up and run `opendsecctl cluster rotate-certs` again"
                );
                return Ok(1);
            }
        }
        Cmd::Cluster(ClusterCmd::Retention {
            ended_sandboxes,
            audit,
            audit_records,
        }) => {
            let r = if ended_sandboxes.is_none() && audit.is_none() && audit_records.is_none() {
                client.get_retention().await?
            } else {
                let want = Retention {
                    ended_sandboxes_seconds: ended_sandboxes,
                    audit_seconds: audit,
                    audit_records,
                };
                client.set_retention(&want).await?
            };
            out.show(&r, |r| {
                let secs = |v: Option<u64>| v.map_or("-".into(), |v| format!("{v}s"));
                table(
                    &["SETTING", "VALUE"],
                    vec![
                        vec!["ended sandboxes".into(), secs(r.ended_sandboxes_seconds)],
                        vec!["audit".into(), secs(r.audit_seconds)],
                        vec![
                            "audit records".into(),
                            r.audit_records.map_or("-".into(), |v| v.to_string()),
                        ],
                    ],
                )
            });
        }
        Cmd::Cluster(c) => {
            let status = match c {
                ClusterCmd::Status => client.cluster_status().await?,
                ClusterCmd::AddNode { id, addr } => client.add_member(id, &addr).await?,
                ClusterCmd::RemoveNode { id } => client.remove_member(id).await?,
                ClusterCmd::Retention { .. } | ClusterCmd::RotateCerts => unreachable!("matched above"),
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
            ProjectCmd::RateLimits(c) => {
                let (project, r) = match c {
                    RateLimitsCmd::Get { project } => {
                        let r = client.get_rate_limits(&project).await?;
                        (project, r)
                    }
                    RateLimitsCmd::Set {
                        project,
                        writes_per_second,
                        token_writes_per_second,
                    } => {
                        let rates = RateLimits {
                            writes_per_second,
                            token_writes_per_second,
                        };
                        let r = client.set_rate_limits(&project, &rates).await?;
                        (project, r)
                    }
                };
                out.show(&r, |r| {
                    let f = |v: Option<u64>| v.map_or("-".to_string(), |v| v.to_string());
                    format!(
                        "project {project}: writes a second (own / in force)\n  all tokens together: {} / {}\n  each token:          {} / {}",
                        f(r.own.writes_per_second),
                        f(r.effective.writes_per_second),
                        f(r.own.token_writes_per_second),
                        f(r.effective.token_writes_per_second)
                    )
                });
            }
            ProjectCmd::Network(ProjectNetworkCmd::Get { project }) => {
                let n = client.get_project_network(&project).await?;
                out.show(&n, |n| print::project_network(&project, n));
            }
            ProjectCmd::Network(ProjectNetworkCmd::Set {
                project,
                ceiling,
                default,
            }) => {
                let settings = ProjectNetwork {
                    ceiling,
                    default_network: default.given().then(|| default.policy()).transpose()?,
                };
                let n = client.set_project_network(&project, &settings).await?;
                out.show(&n, |n| print::project_network(&project, n));
            }
        },
        Cmd::Quota(c) => {
            let q = match c {
                QuotaCmd::Set {
                    project,
                    sandboxes,
                    cpu_millis,
                    memory_mb,
                    metadata_bytes,
                } => {
                    client
                        .set_quota(
                            &project,
                            &Limits {
                                sandboxes,
                                cpu_millis,
                                memory_mb,
                                metadata_bytes,
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
                        vec![
                            "metadata_bytes".into(),
                            lim(q.limits.metadata_bytes),
                            lim(q.effective.metadata_bytes),
                            q.usage.metadata_bytes.to_string(),
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
        Cmd::Image(c) => return images::run(&client, out, c).await,
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
                        metadata_bytes: 0,
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
            env,
            timeout_seconds,
            isolation,
            cpu_class,
            no_wait,
            wait_seconds,
            wait,
            no_auto_resume,
            auto_pause,
            auto_pause_filesystem,
            network,
        } => {
            let req = CreateSandbox {
                project,
                image,
                cpu_millis,
                memory_mb,
                labels: (!labels.is_empty()).then(|| labels.into_iter().collect()),
                env: (!env.is_empty()).then(|| env.into_iter().collect()),
                timeout_seconds,
                isolation: isolation.map(Isolation::from),
                cpu_class: cpu_class.map(CpuClass::from),
                auto_resume: no_auto_resume.then_some(false),
                auto_pause: (auto_pause || auto_pause_filesystem).then_some(true),
                auto_pause_filesystem: auto_pause_filesystem.then_some(true),
                network: network.given().then(|| network.policy()).transpose()?,
            };
            let mut written = client.create_sandbox(&req).await?;
            warn_from(client);
            if !no_wait {
                let seconds = wait.unwrap_or(wait_seconds);
                written.sandbox = wait_started(client, &written.sandbox.id, seconds).await?;
            }
            written
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
            out.show(&s, |s| {
                let mut text = table(&SANDBOX_HEADERS, vec![sandbox_row(s)]);
                if s.oom_kills > 0 {
                    let last = s
                        .last_oom_command
                        .as_deref()
                        .unwrap_or("a program the edge could not name");
                    text.push_str(&format!(
                        "\n{} process(es) ended by the OOM killer; the sandbox lives on (last: {last})",
                        s.oom_kills
                    ));
                }
                text
            });
            return Ok(0);
        }
        SandboxCmd::Logs { id, max_bytes } => {
            use std::io::Write;
            let bytes = client.sandbox_logs(&id, Some(max_bytes)).await?;
            let _ = std::io::stdout().write_all(&bytes);
            return Ok(0);
        }
        SandboxCmd::Metrics { id, since: Some(span) } => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let h = client
                .sandbox_metrics_history(&id, Some(now.saturating_sub(span)), None)
                .await?;
            out.show(&h, |h| {
                let mb = |b: u64| format!("{:.1}", b as f64 / (1 << 20) as f64);
                let rows = h
                    .points
                    .iter()
                    .map(|p| {
                        vec![
                            fmt_time(p.timestamp_ms),
                            p.cpu_count.to_string(),
                            format!("{:.1}", p.cpu_used_pct),
                            format!("{}/{}", mb(p.mem_used), mb(p.mem_total)),
                            mb(p.mem_cache),
                            format!("{}/{}", mb(p.disk_used), mb(p.disk_total)),
                        ]
                    })
                    .collect();
                table(&["TIME", "CPUS", "CPU %", "MEM (MB)", "CACHE (MB)", "DISK (MB)"], rows)
            });
            return Ok(0);
        }
        SandboxCmd::Metrics { id, since: None } => {
            let m = client.sandbox_metrics(&id).await?;
            out.show(&m, |m| {
                let mb = |b: u64| format!("{:.1}", b as f64 / (1 << 20) as f64);
                let runtime = match (&m.vmm, &m.accelerator) {
                    (Some(v), Some(a)) => format!("{v}, {a}"),
                    _ => "container".into(),
                };
                table(
                    &[
                        "CPUS",
                        "CPU %",
                        "MEM (MB)",
                        "CACHE (MB)",
                        "DISK (MB)",
                        "OOM KILLS",
                        "RUNS ON",
                    ],
                    vec![vec![
                        m.cpu_count.to_string(),
                        format!("{:.1}", m.cpu_used_pct),
                        format!("{}/{}", mb(m.mem_used), mb(m.mem_total)),
                        mb(m.mem_cache),
                        format!("{}/{}", mb(m.disk_used), mb(m.disk_total)),
                        m.oom_kills.to_string(),
                        runtime,
                    ]],
                ) + &network_lines(m.network.as_ref())
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
        SandboxCmd::Pack {
            id,
            name,
            scrub,
            no_wait,
            wait_seconds,
        } => return images::pack(client, out, &id, PackSandbox { name, scrub }, no_wait, wait_seconds).await,
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
        SandboxCmd::Pause { id, filesystem: false } => client.pause_sandbox(&id).await?,
        SandboxCmd::Pause { id, filesystem: true } => client.pause_sandbox_filesystem(&id).await?,
        SandboxCmd::Resume { id, cold: false } => client.resume_sandbox(&id).await?,
        SandboxCmd::Resume { id, cold: true } => client.resume_sandbox_cold(&id).await?,
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
        SandboxCmd::Network(SandboxNetworkCmd::Get { id }) => {
            let p = client.get_sandbox_network(&id).await?;
            out.show(&p, print::network);
            return Ok(0);
        }
        SandboxCmd::Network(SandboxNetworkCmd::Set { id, network }) => {
            let w = client.set_sandbox_network(&id, &network.policy()?).await?;
            warn_from(client);
            out.show(&w, |w| {
                format!(
                    "sandbox {id}: network set at index {}\n{}",
                    w.index,
                    print::network(&w.sandbox.network)
                )
            });
            return Ok(0);
        }
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

/// Polls a new sandbox until its edge has started it: `Ok` with it running, or an error
/// that says how it ended (or that it is still pending after `seconds`).
async fn wait_started(client: &Client, id: &str, seconds: u64) -> Result<Sandbox, ApiError> {
    use std::io::{IsTerminal, Write};
    let started = std::time::Instant::now();
    let tty = std::io::stderr().is_terminal();
    loop {
        let s = client.get_sandbox(id).await?;
        let waited = started.elapsed().as_secs_f64();
        if s.state != "pending" {
            if tty {
                eprint!("\r\x1b[K");
            }
            if s.live && s.state != "killed" {
                return Ok(s);
            }
            let why = s.reason.clone().unwrap_or_else(|| "no reason was reported".into());
            return Err(not_started(format!(
                "sandbox {id} did not start: it is {} ({why})",
                s.state
            )));
        }
        if waited >= seconds as f64 {
            return Err(not_started(format!(
                "sandbox {id} is still pending after {seconds} s: it may still start (opendsecctl sandbox get {id}); \
                 wait longer with --wait-seconds, or not at all with --no-wait"
            )));
        }
        if tty {
            eprint!("\r\x1b[Kwaiting for sandbox {id} to start ... {waited:.1} s");
            let _ = std::io::stderr().flush();
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// An error of waiting for a create: the call succeeded, the sandbox did not start.
fn not_started(message: String) -> ApiError {
    ApiError {
        status: 0,
        code: "not_started".into(),
        message,
        field: None,
    }
}

/// Says on stderr what the server warned of (e.g. a policy allowing egress that the
/// sandbox's edge does not give).
fn warn_from(client: &Client) {
    for w in client.take_warnings() {
        eprintln!("warning: {w}");
    }
}

/// A sandbox's traffic and the connections its policy last refused, for `sandbox metrics`.
fn network_lines(n: Option<&opendsec_sdk::types::NetworkMetrics>) -> String {
    let Some(n) = n else {
        return String::new();
    };
    let kb = |b: u64| format!("{:.1}", b as f64 / 1024.0);
    let mut s = format!(
        "\nnetwork: in {} KiB ({} packets), out {} KiB ({} packets), {} packets dropped by its policy\n",
        kb(n.in_bytes),
        n.in_packets,
        kb(n.out_bytes),
        n.out_packets,
        n.dropped_packets
    );
    if !n.recent_drops.is_empty() {
        s.push_str("refused lately (allow them with `opendsecctl sandbox network set`):\n");
        let rows = n
            .recent_drops
            .iter()
            .map(|d| {
                vec![
                    fmt_time(d.at_ms),
                    d.protocol.clone(),
                    d.destination.clone(),
                    d.port.map(|p| p.to_string()).unwrap_or_else(|| "-".into()),
                    d.rule.clone(),
                    d.packets.to_string(),
                ]
            })
            .collect();
        s.push_str(&table(
            &["TIME", "PROTO", "DESTINATION", "PORT", "RULE", "PACKETS"],
            rows,
        ));
    }
    s
}
