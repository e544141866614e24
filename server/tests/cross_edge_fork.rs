//! Specification: a fork copy placed on another edge than its source pulls the source's
//! state from the source's edge (edge to edge, authenticated, streamed, digest-checked)
//! and continues from it: a microVM's copy from its memory, a container's copy from its
//! file system. The source runs on. A pull without the right credential is refused, and a
//! copy whose source edge is down fails, saying so.
//!
//! Real processes on 127.0.0.1: a control node (`opendsec up --no-edge`) and two `opendsec
//! edge` processes with their own data directories, sharing the machine's image store;
//! real QEMU microVMs (TCG here) and crun containers. Figures are printed as
//! `figure: <name> = <value>` (`--nocapture`).
//!
//! Run: `cargo test -p opendsec --test cross_edge_fork -- --test-threads=1 --nocapture`

#[path = "support/up.rs"]
mod up;

use opendsec_edge::testing::COUNTER;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use up::{Procs, free_port, send_json, static_agent};

fn figure(name: &str, value: impl std::fmt::Display) {
    eprintln!("figure: {name} = {value}");
}

/// A control node and the edges e1 and e2, each its own process.
struct Cluster {
    procs: Procs,
    http: String,
    admin: String,
    key: String,
    client: reqwest::Client,
    /// Per edge: its arguments and proxy address.
    edges: Vec<(String, Vec<String>, String)>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // The processes stop and the edges are cleaned up when `procs` drops, next.
        if std::thread::panicking() {
            for (name, _, _) in &self.edges {
                eprintln!("--- {name} (last lines) ---\n{}", self.log_tail(name, 40));
            }
        }
    }
}

impl Cluster {
    fn log(&self, name: &str) -> String {
        std::fs::read_to_string(self.procs.dir.path().join(format!("{name}.log"))).unwrap_or_default()
    }

    fn log_tail(&self, name: &str, lines: usize) -> String {
        let text = self.log(name);
        let kept: Vec<&str> = text.lines().filter(|l| !l.contains("building image")).collect();
        kept[kept.len().saturating_sub(lines)..].join("\n")
    }

    /// Starts a control node; edges are started with [`Cluster::start_edge`].
    async fn start() -> Cluster {
        let procs = Procs::new(&["e1", "e2"]);
        let (http, peer) = (
            format!("127.0.0.1:{}", free_port()),
            format!("127.0.0.1:{}", free_port()),
        );
        let data = procs.dir.path().join("control");
        let data_s = data.to_string_lossy().to_string();
        let mut c = Cluster {
            procs,
            http: http.clone(),
            admin: String::new(),
            key: String::new(),
            client: reqwest::Client::new(),
            edges: vec![],
        };
        let args: Vec<String> = [
            "up",
            "--no-edge",
            "--data-dir",
            &data_s,
            "--listen",
            &http,
            "--peer-listen",
            &peer,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        c.procs.spawn("control", &args);
        let token_file = c.procs.dir.path().join("admin.token");
        let out = Command::new(env!("CARGO_BIN_EXE_opendsec"))
            .args(["init", "--peer", &peer, "--data-dir", &data_s, "--token-file"])
            .arg(&token_file)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        c.admin = std::fs::read_to_string(&token_file).unwrap().trim().to_string();
        c.key = std::fs::read_to_string(data.join("cluster.key"))
            .unwrap()
            .trim()
            .to_string();
        // Each edge joins with a token of its own (edge:write in the root project) and a
        // copy of the CA's certificate; it gets its own key then, never the cluster key.
        let (_, me) = c.send(reqwest::Method::GET, "/v1/whoami", None).await;
        let agent = static_agent().to_string_lossy().to_string();
        let ca = data.join("tls").join("ca.crt").to_string_lossy().to_string();
        for name in ["e1", "e2"] {
            let (s, issued) = c
                .send(
                    reqwest::Method::POST,
                    "/v1/tokens",
                    Some(json!({"project": me["project"], "name": format!("edge-{name}"), "rights": ["edge:write"]})),
                )
                .await;
            assert!(s < 300, "{s} {issued}");
            let token_file = c.procs.dir.path().join(format!("{name}.token"));
            std::fs::write(&token_file, issued["token"].as_str().unwrap()).unwrap();
            let edge_dir = c.procs.dir.path().join(name).to_string_lossy().to_string();
            let listen = format!("127.0.0.1:{}", free_port());
            let args: Vec<String> = [
                "edge",
                "--control",
                &peer,
                "--token-file",
                &token_file.to_string_lossy(),
                "--ca-cert",
                &ca,
                "--data-dir",
                &edge_dir,
                "--edge-name",
                name,
                "--edge-listen",
                &listen,
                "--agent",
                &agent,
                "--disk-mb",
                "256",
                "--edge-sandboxes",
                "20",
                "--microvm",
                "on",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect();
            c.edges.push((name.to_string(), args, listen));
        }
        c
    }

    /// Starts edge `name` and waits until it is registered and its microVMs are ready.
    async fn start_edge(&mut self, name: &str) {
        let (_, args, _) = self.edges.iter().find(|(n, _, _)| n == name).unwrap().clone();
        self.procs.spawn(name, &args);
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let (_, v) = self.send(reqwest::Method::GET, "/v1/edges", None).await;
            let registered = v["edges"].as_array().is_some_and(|es| {
                es.iter()
                    .any(|e| e["id"] == name || e["edge"] == name || e["name"] == name)
            });
            let log = self.log(name);
            if registered && log.contains("microVMs ready") {
                return;
            }
            assert!(
                !log.contains("cannot run microVMs"),
                "edge {name} cannot run microVMs:\n{}",
                self.log_tail(name, 10)
            );
            assert!(
                Instant::now() < deadline,
                "edge {name} was not ready within 600 s:\n{}",
                self.log_tail(name, 10)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn edge_addr(&self, name: &str) -> String {
        self.edges.iter().find(|(n, _, _)| n == name).unwrap().2.clone()
    }

    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        send_json(
            self.client
                .request(method, format!("http://{}{path}", self.http))
                .bearer_auth(&self.admin)
                .timeout(Duration::from_secs(60)),
            body,
        )
        .await
    }

    async fn create(&self, body: Value) -> String {
        let (s, v) = self
            .send(reqwest::Method::POST, "/v1/sandboxes", Some(body.clone()))
            .await;
        assert_eq!(s, 201, "create {body}: {v}");
        v["sandbox"]["id"].as_str().unwrap().to_string()
    }

    /// Forks `id` with `body`; returns the copies as the API shows them.
    async fn fork(&self, id: &str, body: Value) -> Vec<Value> {
        let (s, v) = self
            .send(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/fork"), Some(body))
            .await;
        assert_eq!(s, 201, "fork: {v}");
        v["sandboxes"].as_array().unwrap().clone()
    }

    async fn state(&self, id: &str) -> Value {
        self.send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await
            .1
    }

    async fn wait_state(&self, id: &str, want: &str, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let v = self.state(id).await;
            if v["state"] == want {
                return v;
            }
            if want != "failed" && matches!(v["state"].as_str(), Some("failed" | "exited" | "killed")) {
                panic!("sandbox {id} ended instead of being {want}: {v}");
            }
            assert!(
                Instant::now() < deadline,
                "sandbox {id} was not {want} within {within:?}: {v}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn exec(&self, id: &str, cmd: &str, args: &[&str]) -> String {
        let body = serde_json::to_vec(&json!({"process": {"cmd": cmd, "args": args}})).unwrap();
        let r = self
            .client
            .post(format!(
                "http://{}/v1/sandboxes/{id}/agent/process.Process/Start",
                self.http
            ))
            .bearer_auth(&self.admin)
            .header("x-opendsec-user", "root")
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1")
            .body(up::connect_frame(&body))
            .send()
            .await
            .unwrap();
        let (out, code) = up::read_process_stream(r)
            .await
            .unwrap_or_else(|e| panic!("exec {cmd} {args:?} in {id}: {e}"));
        assert_eq!(code, 0, "{cmd} {args:?} in {id} exited {code}: {out}");
        out
    }

    /// (files, bytes on the wire, milliseconds) of the pulls edge `name` logged.
    fn pulls(&self, name: &str) -> Vec<(u64, u64, u64)> {
        let field = |l: &str, k: &str| {
            l.split(&format!("{k}="))
                .nth(1)
                .and_then(|v| v.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        self.log(name)
            .lines()
            .filter(|l| l.contains("pulled a transfer"))
            .map(|l| (field(l, "files"), field(l, "wire_bytes"), field(l, "took_ms")))
            .collect()
    }
}

async fn count(c: &Cluster, id: &str) -> u64 {
    let out = c
        .exec(id, "bash", &["-c", "exec 3<>/dev/tcp/127.0.0.1/7777 && cat <&3"])
        .await;
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("the counter of {id} said {out:?}"))
}

/// The command line of the QEMU running sandbox `id` (started as `-name opendsec-<id>`).
fn qemu_cmdline(id: &str) -> Option<String> {
    let needle = format!("-name\0opendsec-{id}\0");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        e.file_name().to_str()?.parse::<i32>().ok()?;
        let cmdline = String::from_utf8_lossy(&std::fs::read(e.path().join("cmdline")).ok()?).into_owned();
        cmdline.contains(&needle).then_some(cmdline)
    })
}

/// Files (not directories) under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                stack.push(e.path());
            } else {
                out.push(e.path());
            }
        }
    }
    out
}

/// Waits until no transferred file is left on either edge (the source's prepared copy,
/// the destination's pulled one).
async fn transfers_cleaned(c: &Cluster) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left: Vec<PathBuf> = ["e1/transfers", "e2/imports"]
            .iter()
            .flat_map(|d| files_under(&c.procs.dir.path().join(d)))
            .collect();
        if left.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "transferred files were not removed: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_microvm_forked_to_another_edge_continues_from_its_memory_and_transfers_need_their_own_credential() {
    let mut c = Cluster::start().await;
    c.start_edge("e1").await;
    // The source goes to e1, the only edge yet; e2 starts while it boots.
    let src = c
        .create(json!({"image": "base", "isolation": "microvm", "memory_mb": 256, "timeout_seconds": 900}))
        .await;
    c.start_edge("e2").await;
    let v = c.wait_state(&src, "running", Duration::from_secs(180)).await;
    assert_eq!(v["edge"], "e1");
    c.exec(&src, "setsid", &["-f", "python3", "-c", COUNTER]).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while !c
        .exec(
            &src,
            "bash",
            &[
                "-c",
                "(exec 3<>/dev/tcp/127.0.0.1/7777) 2>/dev/null && echo up || echo down",
            ],
        )
        .await
        .contains("up")
    {
        assert!(Instant::now() < deadline, "the counter never listened");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(count(&c, &src).await, 2);

    // Two copies on e2: it pulls the source's memory, device state and disk from e1 once.
    let t = Instant::now();
    let copies = c.fork(&src, json!({"count": 2, "edge": "e2"})).await;
    let ids: Vec<String> = copies.iter().map(|x| x["id"].as_str().unwrap().to_string()).collect();
    for x in &copies {
        assert_eq!(
            (x["edge"].as_str(), x["source_edge"].as_str(), x["fork_of"].as_str()),
            (Some("e2"), Some("e1"), Some(src.as_str())),
            "{x}"
        );
    }
    for id in &ids {
        c.wait_state(id, "running", Duration::from_secs(240)).await;
    }
    let took = t.elapsed();
    // Each copy continues from the source's memory, then goes its own way; so does the source.
    for id in &ids {
        assert_eq!(
            count(&c, id).await,
            3,
            "copy {id} on e2 starts from the source's memory"
        );
    }
    assert_eq!(count(&c, &ids[0]).await, 4);
    assert_eq!(count(&c, &ids[0]).await, 5);
    assert_eq!(count(&c, &ids[1]).await, 4);
    assert_eq!(count(&c, &src).await, 3, "the source runs on from where it was");
    // Each copy is a QEMU of e2's (its directory under e2's data), the source one of e1's.
    for (id, edge) in [(&ids[0], "e2"), (&ids[1], "e2"), (&src, "e1")] {
        let cmdline = qemu_cmdline(id).unwrap_or_else(|| panic!("no QEMU runs {id}"));
        assert!(
            cmdline.contains(&*c.procs.dir.path().join(edge).join("vms").to_string_lossy()),
            "{id} runs under {edge}: {cmdline}"
        );
    }
    let pulls = c.pulls("e2");
    assert_eq!(pulls.len(), 1, "one pull for both copies: {pulls:?}");
    let (files, wire, pull_ms) = pulls[0];
    figure(
        "microVM fork x2 to another edge (REST) to both copies running",
        format!("{} ms", took.as_millis()),
    );
    figure(
        "microVM fork transfer e1 -> e2",
        format!("{files} files, {} MiB on the wire in {pull_ms} ms", wire >> 20),
    );
    assert!(wire > 1 << 20, "the memory travelled: {wire} bytes");
    transfers_cleaned(&c).await;

    // The transfer server takes only the credential of one transfer for one edge.
    let transfer = c.state(&ids[0]).await["source_edge"].clone();
    assert_eq!(transfer, "e1");
    let id = format!("fork-{}", ids[0]);
    // Without TLS (or with a certificate of no component of the cluster), the proxy
    // reads not a byte of HTTP.
    let plain = c
        .client
        .get(format!("http://{}/transfer/{id}/manifest", c.edge_addr("e1")))
        .send()
        .await;
    assert!(plain.is_err(), "a plain-HTTP request reached the proxy: {plain:?}");
    // Inside TLS as a component (a gateway's certificate), the transfer's own credential
    // is still needed.
    let door = up::edge_door(
        &c.procs.dir.path().join("control").join("tls"),
        &c.edge_addr("e1"),
        "e1",
    )
    .await;
    let url = format!("http://{door}/transfer/{id}/manifest");
    let status = |r: reqwest::Response| r.status().as_u16();
    let r = c.client.get(&url).send().await.unwrap();
    assert_eq!(status(r), 401, "no credential");
    let e1_key = opendsec_control::edge_key(&c.key, "e1");
    let r = c
        .client
        .get(&url)
        .header("x-opendsec-edge-key", &e1_key)
        .send()
        .await
        .unwrap();
    assert_eq!(status(r), 401, "the edge key is not a transfer credential");
    // What root on e2 could mint with e2's own key opens nothing on e1: only the control
    // plane, which derives e1's key, issues e2 the token of a transfer of its own.
    let minted_by_e2 = opendsec_control::transfer_token(&opendsec_control::edge_key(&c.key, "e2"), &id, "e2");
    let r = c
        .client
        .get(&url)
        .header("x-opendsec-edge", "e2")
        .header("x-opendsec-transfer-token", minted_by_e2)
        .send()
        .await
        .unwrap();
    assert_eq!(status(r), 403, "a token keyed with another edge's key");
    let r = c
        .client
        .get(&url)
        .header("x-opendsec-edge", "e2")
        .header("x-opendsec-transfer-token", "0".repeat(64))
        .send()
        .await
        .unwrap();
    assert_eq!(status(r), 403, "a wrong token");
    let other = opendsec_control::transfer_token(&e1_key, "fork-someone-else", "e2");
    let r = c
        .client
        .get(&url)
        .header("x-opendsec-edge", "e2")
        .header("x-opendsec-transfer-token", other)
        .send()
        .await
        .unwrap();
    assert_eq!(status(r), 403, "another transfer's token");
    let for_e3 = opendsec_control::transfer_token(&e1_key, &id, "e3");
    let r = c
        .client
        .get(&url)
        .header("x-opendsec-edge", "e3")
        .header("x-opendsec-transfer-token", for_e3)
        .send()
        .await
        .unwrap();
    let code = status(r);
    assert!(code == 403 || code == 404, "an edge the state was not sent to: {code}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_forked_to_another_edge_carries_its_files_and_a_copy_whose_source_edge_is_down_fails_saying_so() {
    let mut c = Cluster::start().await;
    c.start_edge("e1").await;
    let src = c
        .create(json!({"image": "busybox", "memory_mb": 64, "cpu_millis": 100, "timeout_seconds": 900}))
        .await;
    c.start_edge("e2").await;
    assert_eq!(
        c.wait_state(&src, "running", Duration::from_secs(60)).await["edge"],
        "e1"
    );
    // What it wrote, and an image file it deleted (a whiteout in its upper dir).
    c.exec(
        &src,
        "sh",
        &[
            "-c",
            "mkdir -p /root/work && echo written-on-e1 > /root/work/state && rm /etc/group",
        ],
    )
    .await;

    let t = Instant::now();
    let copies = c.fork(&src, json!({"count": 2, "edge": "e2"})).await;
    let ids: Vec<String> = copies.iter().map(|x| x["id"].as_str().unwrap().to_string()).collect();
    for id in &ids {
        let v = c.wait_state(id, "running", Duration::from_secs(60)).await;
        assert_eq!(
            (v["edge"].as_str(), v["source_edge"].as_str()),
            (Some("e2"), Some("e1"))
        );
    }
    figure(
        "container fork x2 to another edge (REST) to both copies running",
        format!("{} ms", t.elapsed().as_millis()),
    );
    for id in &ids {
        assert_eq!(
            c.exec(id, "cat", &["/root/work/state"]).await,
            "written-on-e1\n",
            "copy {id} has the source's files"
        );
        assert_eq!(
            c.exec(id, "sh", &["-c", "test -e /etc/group && echo present || echo deleted"])
                .await,
            "deleted\n",
            "and its deletions"
        );
        assert_eq!(c.exec(id, "hostname", &[]).await.trim(), id);
    }
    // Each goes its own way; the source runs on, unchanged.
    c.exec(&ids[0], "sh", &["-c", "echo changed-in-copy > /root/work/state"])
        .await;
    assert_eq!(c.exec(&ids[1], "cat", &["/root/work/state"]).await, "written-on-e1\n");
    assert_eq!(c.exec(&src, "cat", &["/root/work/state"]).await, "written-on-e1\n");
    let pulls = c.pulls("e2");
    assert_eq!(pulls.len(), 1, "{pulls:?}");
    figure(
        "container fork transfer e1 -> e2",
        format!(
            "{} files, {} bytes on the wire in {} ms",
            pulls[0].0, pulls[0].1, pulls[0].2
        ),
    );
    transfers_cleaned(&c).await;

    // The source's edge is down: the copy cannot get its state and fails, saying why.
    c.procs.kill9("e1");
    let t = Instant::now();
    let copies = c.fork(&src, json!({"count": 1, "edge": "e2"})).await;
    let lost = copies[0]["id"].as_str().unwrap().to_string();
    let v = c.wait_state(&lost, "failed", Duration::from_secs(90)).await;
    let reason = v["reason"].as_str().unwrap_or_default().to_string();
    eprintln!(
        "a copy whose source edge is down: {reason} (after {} ms)",
        t.elapsed().as_millis()
    );
    assert!(
        reason.contains("source edge e1") && reason.contains("unreachable"),
        "{v}"
    );
    assert!(
        files_under(&c.procs.dir.path().join("e2/imports")).is_empty(),
        "nothing is left of the failed pull"
    );
}
