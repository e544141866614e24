//! Specification: two edges on one machine (two `opendsec edge` processes with their
//! own data directories and ports) share the sandboxes by power-of-k placement; the
//! gateway routes each sandbox's traffic to its own edge; a killed edge's sandboxes keep
//! running and answer again once it is back.

#[path = "support/up.rs"]
mod up;

use opendsec_sdk::{Client, ExecRequest};
use serde_json::{Value, json};
use std::process::Command;
use std::time::{Duration, Instant};
use up::{Procs, static_agent};

use opendsec_edge::testing::free_port;

async fn wait<T>(within: Duration, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "condition not reached within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn exec_echo(client: &Client, id: &str) -> Result<String, String> {
    let req = ExecRequest {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), "echo hi from $(hostname)".into()],
        envs: Default::default(),
        cwd: None,
        user: None,
    };
    let mut out = Vec::new();
    let code = client
        .exec(id, &req, |o| {
            if let opendsec_sdk::ExecOutput::Stdout(b) = o {
                out.extend(b)
            }
        })
        .await
        .map_err(|e| e.to_string())?;
    if code != 0 {
        return Err(format!("exit {code}"));
    }
    Ok(String::from_utf8_lossy(&out).to_string())
}

struct Setup {
    p: Procs,
    http: String,
    admin: String,
    client: Client,
    http_client: reqwest::Client,
    edge_args: Vec<(&'static str, Vec<String>, String)>,
}

/// A control node (`up --no-edge`) and two `opendsec edge` processes, e1 and e2.
async fn setup(e1_sandboxes: &str) -> Setup {
    let mut p = Procs::new(&["e1", "e2"]);
    let (http, peer) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    let data = p.dir.path().join("control");
    let data_s = data.to_string_lossy().to_string();
    p.spawn(
        "control",
        &[
            "up",
            "--no-edge",
            "--data-dir",
            &data_s,
            "--listen",
            &http,
            "--peer-listen",
            &peer,
        ],
    );
    let token_file = p.dir.path().join("admin.token");
    let out = Command::new(env!("CARGO_BIN_EXE_opendsec"))
        .args(["init", "--peer", &peer, "--data-dir", &data_s, "--token-file"])
        .arg(&token_file)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let admin = std::fs::read_to_string(&token_file).unwrap();
    let client = Client::new(&format!("http://{http}"), Some(admin.clone())).unwrap();

    // An edge token: edge:write in the root project.
    let http_client = reqwest::Client::new();
    let me: Value = http_client
        .get(format!("http://{http}/v1/whoami"))
        .bearer_auth(&admin)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let agent = static_agent().to_string_lossy().to_string();
    // A copy of the CA's certificate: each edge checks the control plane by it when it
    // joins (with a token of its own, which it joins with once), and gets its own key
    // then, never the cluster key.
    let ca = data.join("tls").join("ca.crt").to_string_lossy().to_string();
    let mut edge_args = vec![];
    for name in ["e1", "e2"] {
        let issued: Value = http_client
            .post(format!("http://{http}/v1/tokens"))
            .bearer_auth(&admin)
            .json(&json!({"project": me["project"], "name": format!("edge-{name}"), "rights": ["edge:write"]}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let edge_token = p.dir.path().join(format!("{name}.token"));
        std::fs::write(&edge_token, issued["token"].as_str().unwrap()).unwrap();
        let tok = edge_token.to_string_lossy().to_string();
        let dir = p.dir.path().join(name).to_string_lossy().to_string();
        let listen = format!("127.0.0.1:{}", free_port());
        let args: Vec<String> = [
            "edge",
            "--control",
            &peer,
            "--token-file",
            &tok,
            "--ca-cert",
            &ca,
            "--data-dir",
            &dir,
            "--edge-name",
            name,
            "--edge-listen",
            &listen,
            "--agent",
            &agent,
            "--disk-mb",
            "64",
            "--edge-sandboxes",
            if name == "e1" { e1_sandboxes } else { "20" },
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        p.spawn(name, &refs);
        edge_args.push((name, args, listen));
    }
    wait(Duration::from_secs(30), async || {
        let v: Value = http_client
            .get(format!("http://{http}/v1/edges"))
            .bearer_auth(&admin)
            .send()
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        // Joined (registered) and running (heartbeats): a joining edge is registered
        // before its proxy listens.
        let edges = v["edges"].as_array()?;
        (edges.len() == 2 && edges.iter().all(|e| !e["heartbeat"].is_null())).then_some(())
    })
    .await;

    Setup {
        p,
        http,
        admin,
        client,
        http_client,
        edge_args,
    }
}

/// What sandbox `id` prints for `echo hi from $(hostname)`, once it answers within 60 s;
/// otherwise the test fails with the last error and the sandbox as the API shows it.
async fn answer(s: &Setup, id: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match exec_echo(&s.client, id).await {
            Ok(out) => return out,
            Err(e) if Instant::now() >= deadline => {
                let shown = s
                    .http_client
                    .get(format!("http://{}/v1/sandboxes/{id}", s.http))
                    .bearer_auth(&s.admin)
                    .send()
                    .await
                    .map(|r| r.text());
                let shown = match shown {
                    Ok(t) => t.await.unwrap_or_default(),
                    Err(e) => e.to_string(),
                };
                panic!("sandbox {id} did not answer within 60 s: {e}\nthe API shows: {shown}");
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

async fn create(s: &Setup) -> (String, String) {
    let v: Value = s
        .http_client
        .post(format!("http://{}/v1/sandboxes", s.http))
        .bearer_auth(&s.admin)
        .json(&json!({"image": "busybox", "memory_mb": 64, "cpu_millis": 100}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    (
        v["sandbox"]["id"]
            .as_str()
            .unwrap_or_else(|| panic!("create: {v}"))
            .to_string(),
        v["sandbox"]["edge"].as_str().unwrap().to_string(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_edges_share_the_sandboxes_and_a_killed_edge_leaves_them_running() {
    let mut s = setup("20").await;
    let mut ids = vec![];
    for _ in 0..10 {
        ids.push(create(&s).await);
    }
    let on_e1 = ids.iter().filter(|(_, e)| e == "e1").count();
    assert!(
        on_e1 > 0 && on_e1 < 10,
        "power-of-k used both edges: {on_e1} of 10 on e1"
    );
    for (id, edge) in &ids {
        let out = answer(&s, id).await;
        assert_eq!(out, format!("hi from {id}\n"), "sandbox {id} on {edge}");
    }

    // kill -9 of e1: its sandboxes keep running; traffic resumes when it is back.
    s.p.kill9("e1");
    let (victim, _) = ids.iter().find(|(_, e)| e == "e1").unwrap().clone();
    assert!(
        exec_echo(&s.client, &victim).await.is_err(),
        "the edge is down: no route"
    );
    let (name, args, _) = &s.edge_args[0];
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    s.p.spawn(name, &refs);
    for (id, _) in ids.iter().filter(|(_, e)| e == "e1") {
        let out = answer(&s, id).await;
        assert_eq!(out, format!("hi from {id}\n"));
    }
    let is_sandbox = |n: &str| n.len() == 20 && n.bytes().all(|b| b.is_ascii_hexdigit());
    let dirs = std::fs::read_dir(s.p.dir.path().join("e1/sandboxes"))
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir() && is_sandbox(&e.file_name().to_string_lossy()))
        .count();
    assert_eq!(dirs, on_e1, "no duplicate after the restart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_that_refuses_a_sandbox_at_admission_sends_it_to_the_other_edge() {
    // e1 runs at most one sandbox; the control plane is told it has room for 50 (as after
    // an operator's mistake): the edge's own admission has the final word.
    let s = setup("1").await;
    let e1_addr = s.edge_args[0].2.clone();
    let r = s
        .http_client
        .post(format!("http://{}/v1/edges", s.http))
        .bearer_auth(&s.admin)
        .json(&json!({"edge": "e1", "address": e1_addr, "capacity": {"sandboxes": 50, "cpu_millis": 50000, "memory_mb": 50000},
                      "labels": {"opendsec.io/admission": "http"}}))
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    let mut ids = vec![];
    for _ in 0..8 {
        ids.push(create(&s).await);
    }
    let on_e1 = ids.iter().filter(|(_, e)| e == "e1").count();
    assert_eq!(on_e1, 1, "e1 admitted exactly one sandbox: {ids:?}");
    for (id, _) in &ids {
        let out = answer(&s, id).await;
        assert_eq!(out, format!("hi from {id}\n"), "every sandbox runs: none failed");
    }
}
