//! The client and `opendsecctl` against a real node and the real gateway on a
//! loopback port.

use opendsec_control::testing::{TestNode, single_node};
use opendsec_sdk::types::*;
use opendsec_sdk::{AuditFilter, Client, ReplayRequest, SandboxFilter};
use std::collections::BTreeMap;

struct Server {
    url: String,
    t: TestNode,
}

async fn serve() -> Server {
    let t = single_node().await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = opendsec_gateway::router(t.node.clone());
    tokio::spawn(async move { axum_serve(listener, app).await });
    Server { url, t }
}

async fn axum_serve(listener: tokio::net::TcpListener, app: axum::Router) {
    axum::serve(listener, app).await.unwrap();
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn ctl(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_opendsecctl"));
    cmd.args(args)
        .env_remove("OPENDSEC_URL")
        .env_remove("OPENDSEC_TOKEN")
        .env_remove("OPENDSEC_TOKEN_FILE")
        .env("HOME", "/nonexistent");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().await.unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_covers_the_api_and_reads_its_writes() {
    let s = serve().await;
    let c = Client::new(&s.url, s.t.admin_token.clone()).unwrap();
    assert_eq!(c.health().await.unwrap().status, "ok");
    assert!(c.openapi().await.unwrap()["paths"]["/v1/sandboxes"].is_object());
    let me = c.whoami().await.unwrap();
    assert_eq!(me.project, s.t.root_project);

    let p = c.create_project("team", None).await.unwrap();
    assert_eq!(c.seen_index(), p.index, "the client remembers the index of its write");
    assert_eq!(c.get_project(&p.project.id).await.unwrap().name, "team");
    assert_eq!(c.list_projects().await.unwrap().projects.len(), 2);
    let q = c
        .set_quota(
            &p.project.id,
            &Limits {
                sandboxes: Some(5),
                cpu_millis: None,
                memory_mb: None,
                metadata_bytes: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(q.limits.sandboxes, Some(5));
    assert_eq!(c.get_quota(&p.project.id).await.unwrap().effective.sandboxes, Some(5));

    let edge = RegisterEdge {
        edge: "edge-a".into(),
        address: "127.0.0.1:7500".into(),
        capacity: Resources {
            sandboxes: 10,
            cpu_millis: 10000,
            memory_mb: 10000,
            metadata_bytes: 0,
        },
        labels: BTreeMap::new(),
    };
    c.register_edge(&edge).await.unwrap();
    assert_eq!(c.list_edges().await.unwrap().edges.len(), 1);

    let t = c
        .issue_token(&IssueToken {
            project: Some(p.project.id.clone()),
            name: "worker".into(),
            rights: vec!["sandbox:read".into(), "sandbox:write".into()],
            ttl_seconds: None,
            format: None,
        })
        .await
        .unwrap();
    let worker = Client::new(&s.url, t.token.clone()).unwrap();
    worker.observe_index(c.seen_index());
    let sb = worker
        .create_sandbox(&CreateSandbox {
            image: "busybox".into(),
            labels: Some([("job".into(), "x".into())].into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(sb.sandbox.project, p.project.id, "defaults to the token's project");
    let listed = worker
        .list_sandboxes(&SandboxFilter {
            labels: [("job".into(), "x".into())].into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(listed.sandboxes.len(), 1);
    worker.pause_sandbox(&sb.sandbox.id).await.unwrap();
    worker.resume_sandbox(&sb.sandbox.id).await.unwrap();
    worker.set_sandbox_timeout(&sb.sandbox.id, 60).await.unwrap();
    worker
        .set_sandbox_labels(&sb.sandbox.id, BTreeMap::new())
        .await
        .unwrap();
    let forked = worker.fork_sandbox(&sb.sandbox.id, 2).await.unwrap();
    assert_eq!(forked.sandboxes.len(), 2);
    let killed = worker.kill_sandbox(&sb.sandbox.id).await.unwrap();
    assert_eq!(killed.sandbox.state, "killed");
    assert!(!worker.get_sandbox(&sb.sandbox.id).await.unwrap().live);

    // errors carry status, code, message and field
    let e = worker.create_project("nope", None).await.unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (403, "forbidden"));
    let e = c.create_project("Bad Name", None).await.unwrap_err();
    assert_eq!(
        (e.status, e.code.as_str(), e.field.as_deref()),
        (400, "invalid", Some("name"))
    );
    let e = c.get_sandbox("missing").await.unwrap_err();
    assert_eq!(e.status, 404);

    // audit shows the worker's denied write; replay rebuilds the past
    let page = c
        .audit(&AuditFilter {
            principal: Some(t.id.clone()),
            action: Some("project.create".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(page.records.len(), 1);
    assert_eq!(page.records[0].result, "denied");
    let r = c
        .replay(&ReplayRequest {
            to: Some(p.index.to_string()),
            view: Some("iam".into()),
            diff_from: None,
        })
        .await
        .unwrap();
    assert_eq!(r.index, p.index);
    assert!(c.cluster_status().await.unwrap().members.contains_key(&1));

    c.revoke_token(&t.id, Some("done")).await.unwrap();
    assert_eq!(worker.whoami().await.unwrap_err().status, 401);
    assert!(
        c.list_tokens(None)
            .await
            .unwrap()
            .tokens
            .iter()
            .any(|x| x.id == t.id && x.revoked.is_some())
    );
    let gone = c.deregister_edge("edge-a").await.unwrap();
    assert!(gone.edge.deregistered);

    let unreachable = Client::new("http://127.0.0.1:1", None)
        .unwrap()
        .whoami()
        .await
        .unwrap_err();
    assert_eq!((unreachable.status, unreachable.code.as_str()), (0, "unreachable"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opendsecctl_prints_tables_json_and_helpful_errors() {
    let s = serve().await;
    let env = [
        ("OPENDSEC_URL", s.url.as_str()),
        ("OPENDSEC_TOKEN", s.t.admin_token.as_str()),
    ];

    let r = ctl(&["whoami"], &env).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.starts_with("FIELD") && r.stdout.contains(&s.t.root_project),
        "{}",
        r.stdout
    );

    let r = ctl(
        &[
            "edge",
            "register",
            "--edge",
            "edge-a",
            "--address",
            "127.0.0.1:7500",
            "--sandboxes",
            "4",
            "--cpu-millis",
            "8000",
            "--memory-mb",
            "8192",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = ctl(
        &[
            "--output",
            "json",
            "sandbox",
            "create",
            "--no-wait",
            "--image",
            "busybox",
            "--label",
            "job=a",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let created: SandboxWritten = serde_json::from_str(&r.stdout).unwrap();
    let r = ctl(&["sandbox", "list", "--label", "job=a"], &env).await;
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.len(), 2, "{}", r.stdout);
    assert!(lines[0].starts_with("ID") && lines[1].starts_with(&created.sandbox.id));
    // columns line up: STATE starts at the same offset in header and row
    assert_eq!(lines[0].find("STATE"), lines[1].find("pending"));

    let r = ctl(
        &[
            "token",
            "issue",
            "--name",
            "ci",
            "--rights",
            "sandbox:read,sandbox:write",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("odsec_") && r.stdout.contains("shown only now"));

    let r = ctl(&["audit", "--action", "sandbox.create", "--all"], &env).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains(&created.sandbox.id));
    let r = ctl(
        &["replay", "--to", "1", "--diff-from", "1", "--view", "sandboxes"],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = ctl(&["cluster", "status"], &env).await;
    assert!(r.code == 0 && r.stdout.contains("state hash"), "{}", r.stderr);

    // the token can come from a file
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("token");
    std::fs::write(&file, format!("{}\n", s.t.admin_token)).unwrap();
    let r = ctl(
        &["whoami"],
        &[
            ("OPENDSEC_URL", &s.url),
            ("OPENDSEC_TOKEN_FILE", file.to_str().unwrap()),
        ],
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);

    // failures: exit 1 with a message and a hint
    let r = ctl(&["whoami"], &[("OPENDSEC_URL", &s.url)]).await;
    assert_eq!(r.code, 1);
    assert!(r.stderr.starts_with("error: missing bearer token"), "{}", r.stderr);
    assert!(
        r.stderr.contains("hint: check OPENDSEC_TOKEN") && r.stderr.contains("opendsec init"),
        "{}",
        r.stderr
    );
    let r = ctl(
        &["quota", "set", &s.t.root_project, "--cpu-millis", "99999999999999"],
        &env,
    )
    .await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("field: limits.cpu_millis") && r.stderr.contains("hint: fix `limits.cpu_millis`"),
        "{}",
        r.stderr
    );
    let r = ctl(&["sandbox", "get", "nope"], &env).await;
    assert!(r.code == 1 && r.stderr.contains("does not exist"), "{}", r.stderr);
    let r = ctl(
        &["whoami"],
        &[("OPENDSEC_URL", "http://127.0.0.1:1"), ("OPENDSEC_TOKEN", "x")],
    )
    .await;
    assert!(
        r.code == 1 && r.stderr.contains("is the server running"),
        "{}",
        r.stderr
    );
    // usage errors: exit 2
    let r = ctl(&["sandbox", "create"], &env).await;
    assert_eq!(r.code, 2, "{}", r.stderr);
    let r = ctl(&["sandbox", "create", "--image", "x", "--label", "novalue"], &env).await;
    assert_eq!(r.code, 2, "{}", r.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opendsecctl_says_how_to_get_microvms_when_no_edge_runs_them() {
    let s = serve().await;
    let env = [
        ("OPENDSEC_URL", s.url.as_str()),
        ("OPENDSEC_TOKEN", s.t.admin_token.as_str()),
    ];
    let c = Client::new(&s.url, s.t.admin_token.clone()).unwrap();
    let plain = RegisterEdge {
        edge: "plain".into(),
        address: "127.0.0.1:7500".into(),
        capacity: Resources {
            sandboxes: 10,
            cpu_millis: 10000,
            memory_mb: 10000,
            metadata_bytes: 0,
        },
        labels: BTreeMap::new(),
    };
    c.register_edge(&plain).await.unwrap();
    let r = ctl(
        &["sandbox", "create", "--image", "base", "--isolation", "microvm"],
        &env,
    )
    .await;
    assert_eq!(r.code, 1, "{}", r.stderr);
    assert!(
        r.stderr
            .starts_with("error: no registered edge runs microVMs\n  field: isolation\n"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("hint: an edge offers them when QEMU is installed on its machine"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("no edge has room"), "{}", r.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opendsecctl_creates_microvms_takes_snapshots_and_pauses_tasks() {
    let s = serve().await;
    let env = [
        ("OPENDSEC_URL", s.url.as_str()),
        ("OPENDSEC_TOKEN", s.t.admin_token.as_str()),
    ];
    let c = Client::new(&s.url, s.t.admin_token.clone()).unwrap();
    let labels = BTreeMap::from([
        ("opendsec.io/microvm".to_string(), "qemu".to_string()),
        ("opendsec.io/fullvm".to_string(), "q35".to_string()),
    ]);
    let edge = RegisterEdge {
        edge: "vm".into(),
        address: "127.0.0.1:7500".into(),
        capacity: Resources {
            sandboxes: 10,
            cpu_millis: 10000,
            memory_mb: 10000,
            metadata_bytes: 0,
        },
        labels,
    };
    c.register_edge(&edge).await.unwrap();

    let r = ctl(
        &[
            "--output",
            "json",
            "sandbox",
            "create",
            "--no-wait",
            "--image",
            "base",
            "--isolation",
            "microvm",
            "--memory-mb",
            "256",
            "--label",
            "task=t1",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let created: SandboxWritten = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(created.sandbox.isolation, Isolation::Microvm);
    let id = created.sandbox.id.clone();
    let r = ctl(&["sandbox", "create", "--image", "base", "--isolation", "gvisor"], &env).await;
    assert_eq!(r.code, 2, "not an isolation: {}", r.stderr);
    // A full VM: the isolation the edge labelled opendsec.io/fullvm runs.
    let r = ctl(
        &[
            "--output",
            "json",
            "sandbox",
            "create",
            "--no-wait",
            "--image",
            "base",
            "--isolation",
            "vm",
            "--memory-mb",
            "256",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let full: SandboxWritten = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(
        (full.sandbox.isolation, full.sandbox.edge.as_str()),
        (Isolation::Vm, "vm")
    );
    let r = ctl(&["sandbox", "list"], &env).await;
    assert!(
        r.stdout.lines().next().unwrap().contains("ISOLATION") && r.stdout.contains("microvm"),
        "{}",
        r.stdout
    );

    // A snapshot of a sandbox that has not run is refused; once it runs it is logged
    // (pending here: no real edge takes it).
    let r = ctl(&["sandbox", "snapshot", &id, "--no-wait"], &env).await;
    assert!(r.code == 1 && r.stderr.contains("not running yet"), "{}", r.stderr);
    opendsec_control::testing::report_ready(&s.t.node, &id).await;
    let r = ctl(
        &[
            "--output",
            "json",
            "sandbox",
            "snapshot",
            &id,
            "--name",
            "warm",
            "--no-wait",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let snap: Snapshot = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(
        (snap.state.as_str(), snap.isolation, snap.name.as_str()),
        ("pending", Isolation::Microvm, "warm")
    );
    let r = ctl(&["snapshot", "list", "--sandbox", &id], &env).await;
    assert!(
        r.code == 0 && r.stdout.contains(&snap.id) && r.stdout.contains("microvm"),
        "{}",
        r.stdout
    );

    let r = ctl(&["task", "pause", "t1"], &env).await;
    assert!(
        r.code == 0 && r.stdout.starts_with("task t1: pausing 1 of 1 sandboxes") && r.stdout.contains("pausing"),
        "{}{}",
        r.stdout,
        r.stderr
    );
    let r = ctl(&["task", "resume", "t1"], &env).await;
    assert!(
        r.code == 0 && r.stdout.starts_with("task t1: resuming 1 of 1 sandboxes"),
        "{}{}",
        r.stdout,
        r.stderr
    );
    let r = ctl(&["task", "pause", "nobody"], &env).await;
    assert!(r.code == 1 && r.stderr.contains("field: task"), "{}", r.stderr);
    let r = ctl(&["snapshot", "delete", &snap.id], &env).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_policy_is_set_shown_and_bounded_through_the_client_and_opendsecctl() {
    let s = serve().await;
    let env = [
        ("OPENDSEC_URL", s.url.as_str()),
        ("OPENDSEC_TOKEN", s.t.admin_token.as_str()),
    ];
    let c = Client::new(&s.url, s.t.admin_token.clone()).unwrap();
    c.register_edge(&RegisterEdge {
        edge: "edge-a".into(),
        address: "127.0.0.1:7500".into(),
        capacity: Resources {
            sandboxes: 10,
            cpu_millis: 10000,
            memory_mb: 10000,
            metadata_bytes: 0,
        },
        labels: BTreeMap::new(),
    })
    .await
    .unwrap();
    let team = c.create_project("team", None).await.unwrap().project.id;

    // A project says nothing: the public internet is its ceiling, deny its default.
    let r = ctl(&["project", "network", "get", &team], &env).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("egress ceiling public") && r.stdout.contains("egress: none"),
        "{}",
        r.stdout
    );
    let r = ctl(
        &[
            "--output",
            "json",
            "sandbox",
            "create",
            "--no-wait",
            "--image",
            "busybox",
            "--project",
            &team,
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let plain: SandboxWritten = serde_json::from_str(&r.stdout).unwrap();
    assert!(plain.sandbox.network.is_deny(), "{:?}", plain.sandbox.network);

    // Its owner sets a default; sandboxes that name none get it.
    let r = ctl(
        &[
            "project",
            "network",
            "set",
            &team,
            "--ceiling",
            "public",
            "--allow-out",
            "pkgs.example.com",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("allow out: pkgs.example.com"), "{}", r.stdout);
    let defaulted = c
        .create_sandbox(&CreateSandbox {
            project: Some(team.clone()),
            image: "busybox".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        defaulted.sandbox.network.allow_out,
        vec![serde_json::json!("pkgs.example.com")]
    );

    // A sandbox names its own; a rule object, a port and the internet.
    let r = ctl(
        &[
            "--output",
            "json",
            "sandbox",
            "create",
            "--no-wait",
            "--image",
            "busybox",
            "--project",
            &team,
            "--internet",
            "--allow-out",
            "*.cdn.example.com:443",
            "--allow-out",
            r#"{"to": "11.0.0.0/8", "ports": [22, "8000-8100"], "protocol": "tcp"}"#,
            "--deny-out",
            "11.22.0.0/16",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let own: SandboxWritten = serde_json::from_str(&r.stdout).unwrap();
    // Its edge (registered by the test, without the egress label) gives no link out, and
    // the server says so.
    assert!(
        r.stderr.contains("warning: this sandbox has no network egress"),
        "{}",
        r.stderr
    );
    let id = own.sandbox.id.clone();
    assert_eq!(
        serde_json::to_value(&own.sandbox.network).unwrap(),
        serde_json::json!({
            "allow_internet_access": true,
            "allow_out": ["*.cdn.example.com:443", {"to": "11.0.0.0/8", "ports": [22, "8000-8100"], "protocol": "tcp"}],
            "deny_out": ["11.22.0.0/16"],
            "dns_servers": [],
        })
    );

    // Bad input: a 400 naming the rule; beyond the ceiling: a 403 naming it.
    let r = ctl(
        &[
            "sandbox",
            "create",
            "--no-wait",
            "--image",
            "busybox",
            "--allow-out",
            "not a host",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 1);
    assert!(r.stderr.contains("field: network.allow_out[0]"), "{}", r.stderr);
    let r = ctl(
        &[
            "sandbox",
            "create",
            "--no-wait",
            "--image",
            "busybox",
            "--project",
            &team,
            "--allow-out",
            "10.0.0.0/8",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 1);
    assert!(
        r.stderr.contains("field: network.allow_out[0]") && r.stderr.contains("ceiling"),
        "{}",
        r.stderr
    );
    let e = c
        .set_sandbox_network(
            &id,
            &NetworkPolicy {
                allow_out: vec![serde_json::json!("a.example.com"), serde_json::json!("10.0.0.0/8")],
                ..Default::default()
            },
        )
        .await
        .unwrap_err();
    assert_eq!((e.status, e.field.as_deref()), (403, Some("allow_out[1]")), "{e:?}");

    // While it runs, its policy is replaced whole; with no rule it reaches nothing.
    let r = ctl(
        &["sandbox", "network", "set", &id, "--allow-out", "pkgs.example.com:443"],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("internet:  no") && r.stdout.contains("pkgs.example.com:443"),
        "{}",
        r.stdout
    );
    let got = c.get_sandbox_network(&id).await.unwrap();
    assert_eq!(got.allow_out, vec![serde_json::json!("pkgs.example.com:443")]);
    // Through an upstream proxy: its password from the environment, never shown back,
    // and never taken from the command line (nor echoed when it is there).
    let mut with_pw = env.to_vec();
    with_pw.push(("OPENDSEC_EGRESS_PROXY_PASSWORD", "hunter2"));
    let r = ctl(
        &[
            "sandbox",
            "network",
            "set",
            &id,
            "--allow-out",
            "pkgs.example.com",
            "--egress-proxy",
            "socks5://u@proxy.example.com:1080",
        ],
        &with_pw,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("via proxy: socks5://proxy.example.com:1080 as u") && !r.stdout.contains("hunter2"),
        "{}",
        r.stdout
    );
    let got = c.get_sandbox_network(&id).await.unwrap();
    assert_eq!(
        got.egress_proxy,
        Some(serde_json::json!({"address": "socks5://proxy.example.com:1080", "username": "u"}))
    );
    let r = ctl(
        &[
            "sandbox",
            "network",
            "set",
            &id,
            "--egress-proxy",
            "socks5://u:hunter2@proxy.example.com:1080",
        ],
        &env,
    )
    .await;
    assert!(
        r.code != 0 && r.stderr.contains("OPENDSEC_EGRESS_PROXY_PASSWORD"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("hunter2"), "{}", r.stderr);
    let r = ctl(
        &["sandbox", "network", "set", &id, "--egress-proxy", "127.0.0.1:1080"],
        &env,
    )
    .await;
    assert!(r.stderr.contains("field: egress_proxy.address"), "{}", r.stderr);

    let r = ctl(&["sandbox", "network", "set", &id], &env).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let r = ctl(&["sandbox", "network", "get", &id], &env).await;
    assert!(r.stdout.contains("egress: none"), "{}", r.stdout);

    // A project's ceiling is bounded by its parent's; an unknown ceiling names the field.
    let r = ctl(&["project", "network", "set", &team, "--ceiling", "everything"], &env).await;
    assert!(r.code == 1 && r.stderr.contains("field: ceiling"), "{}", r.stderr);
    c.set_project_network(
        &s.t.root_project,
        &ProjectNetwork {
            ceiling: "none".into(),
            default_network: None,
        },
    )
    .await
    .unwrap();
    let e = c
        .set_project_network(
            &team,
            &ProjectNetwork {
                ceiling: "public".into(),
                default_network: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!((e.status, e.field.as_deref()), (403, Some("ceiling")), "{e:?}");
    assert_eq!(c.get_project_network(&team).await.unwrap().ceiling, "none");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_projects_write_rates_are_enforced_with_429_and_retry_after_and_refused_writes_are_not_logged() {
    let s = serve().await;
    let env = [
        ("OPENDSEC_URL", s.url.as_str()),
        ("OPENDSEC_TOKEN", s.t.admin_token.as_str()),
    ];
    let c = Client::new(&s.url, s.t.admin_token.clone()).unwrap();
    let team = c.create_project("team", None).await.unwrap().project.id;

    // Bad input names the field; a rate is never above the parent's.
    let e = c
        .set_rate_limits(
            &team,
            &RateLimits {
                writes_per_second: Some(0),
                token_writes_per_second: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        (e.status, e.field.as_deref()),
        (400, Some("writes_per_second")),
        "{e:?}"
    );
    let r = ctl(
        &[
            "project",
            "rate-limits",
            "set",
            &team,
            "--writes-per-second",
            "10",
            "--token-writes-per-second",
            "4",
        ],
        &env,
    )
    .await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(
        r.stdout.contains("all tokens together: 10 / 10") && r.stdout.contains("each token:          4 / 4"),
        "{}",
        r.stdout
    );
    let sub = c.create_project("sub", Some(&team)).await.unwrap().project.id;
    let e = c
        .set_rate_limits(
            &sub,
            &RateLimits {
                writes_per_second: Some(20),
                token_writes_per_second: None,
            },
        )
        .await
        .unwrap_err();
    assert_eq!(
        (e.status, e.field.as_deref()),
        (400, Some("writes_per_second")),
        "{e:?}"
    );
    assert_eq!(
        c.get_rate_limits(&sub).await.unwrap().effective,
        RateLimits {
            writes_per_second: Some(10),
            token_writes_per_second: Some(4)
        },
        "a sub-project is bounded by its parent's rates"
    );

    let token = |name: &'static str| {
        let (c, team) = (&c, &team);
        async move {
            c.issue_token(&IssueToken {
                project: Some(team.clone()),
                name: name.into(),
                rights: vec!["project:write".into(), "quota:write".into()],
                ttl_seconds: None,
                format: None,
            })
            .await
            .unwrap()
            .token
        }
    };
    let (a, b, d, own) = (token("a").await, token("b").await, token("d").await, token("own").await);
    // A token may not set its own project's rates (a denied write, logged: it counts).
    let e = Client::new(&s.url, own.clone())
        .unwrap()
        .set_rate_limits(&team, &RateLimits::default())
        .await
        .unwrap_err();
    assert_eq!(e.status, 403, "{e:?}");

    let http = reqwest::Client::new();
    let write = |bearer: String, name: String| {
        let (http, url, team) = (http.clone(), format!("{}/v1/projects", s.url), team.clone());
        async move {
            let r = http
                .post(url)
                .bearer_auth(bearer)
                .json(&serde_json::json!({"name": name, "parent": team}))
                .send()
                .await
                .unwrap();
            let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
            let status = r.status().as_u16();
            let body: serde_json::Value = r.json().await.unwrap();
            (status, retry, body)
        }
    };
    // Writes until the first 429 (at most 30): how many got through, and that answer.
    let until_refused = |bearer: String, tag: &'static str| {
        let write = &write;
        async move {
            for ok in 0..30 {
                let (st, retry, body) = write(bearer.clone(), format!("{tag}{ok}")).await;
                if st == 429 {
                    return (ok, retry, body);
                }
                assert_eq!(st, 201, "{body}");
            }
            panic!("30 writes of {tag} went through");
        }
    };
    // Each token: a second's burst of 4 (a fifth may refill meanwhile), then 429 with
    // Retry-After, naming the token.
    let mut accepted = 0;
    let (ok, retry, body) = until_refused(a.clone(), "a").await;
    accepted += ok;
    assert!((4..=5).contains(&ok), "{ok} writes before the token's 429");
    assert_eq!(
        (body["code"].as_str(), retry.as_deref()),
        (Some("rate_limited"), Some("1")),
        "{body}"
    );
    assert!(body["message"].as_str().unwrap().starts_with("token "), "{body}");
    // The project's 10 a second hold for all its tokens together: `own` wrote 1 and `a`
    // 4 or 5, so `b` gets 4 or 5 at most before the project's 429.
    let (ok, _, body) = until_refused(b.clone(), "b").await;
    accepted += ok;
    assert!(ok <= 5, "{ok}");
    let refused_by_project = body["message"]
        .as_str()
        .unwrap()
        .starts_with(&format!("project {team}"));
    if !refused_by_project {
        let (ok, _, body) = until_refused(d.clone(), "d").await;
        accepted += ok;
        assert!(ok <= 2, "{ok}");
        assert!(
            body["message"]
                .as_str()
                .unwrap()
                .starts_with(&format!("project {team}")),
            "{body}"
        );
    }
    assert!(body["message"].as_str().unwrap().contains("rate-limits"), "{body}");

    // Refused writes are not logged; the root's admin is not limited by team's rates.
    let page = c
        .audit(&AuditFilter {
            action: Some("project.create".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        page.records.len(),
        2 + accepted,
        "only accepted writes are in the audit (team, sub, and those that got through)"
    );
    for n in 0..15 {
        c.create_project(&format!("root-{n}"), None).await.unwrap();
    }
    // After the wait, the token writes again.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    assert_eq!(write(a.clone(), "a-later".into()).await.0, 201);
}

/// Bounded growth through the API: an ended sandbox keeps no environment and leaves the
/// live views after the retention; the environment and labels of live ones count against
/// a project's `metadata_bytes` quota; a cluster admin sets the retention with
/// `opendsecctl cluster retention`. A tenant looping create/kill with a large
/// environment grows nothing but the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_sandboxes_leave_the_views_and_live_ones_metadata_counts_against_quota() {
    let s = serve().await;
    let env = [
        ("OPENDSEC_URL", s.url.as_str()),
        ("OPENDSEC_TOKEN", s.t.admin_token.as_str()),
    ];
    let c = Client::new(&s.url, s.t.admin_token.clone()).unwrap();

    // The defaults: an hour, 30 days, 200 000 records.
    let r = ctl(&["cluster", "retention"], &env).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    for want in [
        "ended sandboxes  3600s",
        "audit            2592000s",
        "audit records    200000",
    ] {
        assert!(r.stdout.contains(want), "{want:?} not in\n{}", r.stdout);
    }
    // Bad values name their field, and say what to do.
    let r = ctl(&["cluster", "retention", "--audit", "1m"], &env).await;
    assert_ne!(r.code, 0);
    assert!(r.stderr.contains("audit_seconds"), "{}", r.stderr);
    let e = c
        .set_retention(&Retention {
            audit_records: Some(3),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!((e.status, e.field.as_deref()), (400, Some("audit_records")), "{e:?}");
    let r = ctl(&["cluster", "retention", "--ended-sandboxes", "0"], &env).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    assert!(r.stdout.contains("ended sandboxes  0s"), "{}", r.stdout);
    let now = c.get_retention().await.unwrap();
    assert_eq!(
        (now.ended_sandboxes_seconds, now.audit_seconds),
        (Some(0), Some(2_592_000)),
        "a setting left out keeps its value"
    );

    let team = c.create_project("team", None).await.unwrap().project.id;
    c.register_edge(&RegisterEdge {
        edge: "edge-a".into(),
        address: "127.0.0.1:7500".into(),
        capacity: Resources {
            sandboxes: 10,
            cpu_millis: 100_000,
            memory_mb: 100_000,
            metadata_bytes: 0,
        },
        labels: BTreeMap::new(),
    })
    .await
    .unwrap();
    let r = ctl(&["quota", "set", &team, "--metadata-bytes", "300000"], &env).await;
    assert_eq!(r.code, 0, "{}", r.stderr);
    let big = "x".repeat(200_000);
    let create = |value: &str| CreateSandbox {
        project: Some(team.clone()),
        image: "busybox".into(),
        memory_mb: Some(64),
        cpu_millis: Some(100),
        env: Some([("BIG".to_string(), value.to_string())].into()),
        ..Default::default()
    };
    let first = c.create_sandbox(&create(&big)).await.unwrap().sandbox.id;
    let q = c.get_quota(&team).await.unwrap();
    assert_eq!(q.usage.metadata_bytes, 200_003);
    assert_eq!(q.limits.metadata_bytes, Some(300_000));
    // A second would hold 400 006 bytes: over the quota, which the error names.
    let e = c.create_sandbox(&create(&big)).await.unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (429, "quota_exceeded"), "{e:?}");
    assert!(e.message.contains("metadata_bytes"), "{e:?}");
    let r = ctl(&["quota", "get", &team], &env).await;
    assert!(r.stdout.contains("metadata_bytes"), "{}", r.stdout);
    c.kill_sandbox(&first).await.unwrap();
    assert_eq!(
        c.get_quota(&team).await.unwrap().usage.metadata_bytes,
        0,
        "an ended one holds nothing"
    );

    // A tenant loops create/kill with 200 KB of environment: 8 MB written in all.
    let before = s.t.node.read(|st| st.to_bytes().len());
    let mut ended = vec![first];
    for _ in 0..40 {
        let id = c.create_sandbox(&create(&big)).await.unwrap().sandbox.id;
        c.kill_sandbox(&id).await.unwrap();
        ended.push(id);
    }
    // The next write after a second of log time sweeps them all out of the live views.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    c.create_project("later", None).await.unwrap();
    for id in &ended {
        let e = c.get_sandbox(id).await.unwrap_err();
        assert_eq!(e.status, 404, "{id}: {e:?}");
    }
    let after = s.t.node.read(|st| st.to_bytes().len());
    assert!(
        after < before + 200_000,
        "the state grew from {before} to {after} bytes: it keeps what ended"
    );
    // The audit view still says who created and killed each.
    let audit = c
        .audit(&AuditFilter {
            target: Some(ended[5].clone()),
            ..Default::default()
        })
        .await
        .unwrap();
    let actions: Vec<_> = audit.records.iter().map(|r| r.action.as_str()).collect();
    assert_eq!(actions, ["sandbox.create", "sandbox.kill"]);
}
