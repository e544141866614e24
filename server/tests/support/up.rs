//! A real `opendsec up` (control node, gateway and embedded edge in one process) for
//! tests that drive it from outside, as a user would: temp data directory, free ports,
//! the static agent, `opendsec init` for the admin token. Optionally with a domain and
//! its TLS port. Drop stops it and removes every container and mount it left.

#![allow(dead_code)]

use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The name of `opendsec up`'s embedded edge (its `--edge-name` default).
pub const EMBEDDED_EDGE: &str = "edge-1";

/// The static agent the edge puts in every sandbox (`OPENDSEC_TEST_AGENT`, as
/// `./ops/test.sh` sets it).
pub fn static_agent() -> PathBuf {
    let p = std::env::var_os("OPENDSEC_TEST_AGENT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/agent-static/opendsec-agent"));
    assert!(
        p.is_file(),
        "the static agent {} is missing: run ./ops/test.sh (or edge/agent/build-static.sh {})",
        p.display(),
        p.display()
    );
    p
}

pub use opendsec_edge::testing::free_port;

/// Host-name routing over TLS: `--domain` and `--tls-listen`.
pub struct Tls {
    pub domain: String,
    pub listen: String,
}

pub struct Up {
    pub dir: tempfile::TempDir,
    pub http: String,
    pub peer: String,
    pub edge: String,
    pub tls: Option<Tls>,
    child: Option<Child>,
    /// The admin token `opendsec init` printed (root project, every right).
    pub token: String,
    pub client: reqwest::Client,
    /// The edge's disk size per sandbox (`--disk-mb`).
    disk_mb: u64,
    /// The edge's OCI runtime (`--runtime`: auto, crun or runc).
    runtime: String,
    /// The network namespace it runs in (a test's own internet), with its upstream DNS.
    netns: Option<(String, String)>,
    /// Environment `opendsec up` gets beyond the test's own.
    env: Vec<(String, String)>,
}

impl Drop for Up {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            // The temp dir goes away with the test: show what the server said first.
            eprintln!("--- opendsec up (last lines) ---\n{}", self.log_tail(60));
        }
        // Leave no container or VM behind.
        cleanup_edge(&self.data_dir().join("edge"));
    }
}

/// The runtime's id of the container in sandbox directory `dir`: a claimed warm
/// container keeps the id it was made with (`runtime_id` in its record).
pub fn runtime_id(dir: &Path) -> String {
    let rec: Value = std::fs::read(dir.join("sandbox.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().trim_start_matches('.').to_string())
        .unwrap_or_default();
    rec["runtime_id"]
        .as_str()
        .or(rec["id"].as_str())
        .unwrap_or(&name)
        .to_string()
}

/// Removes what an edge with data directory `root` left running: its containers and
/// their mounts, its VMs' QEMU processes (not the edge's children) and their network
/// namespaces, and its sandboxes' network.
pub fn cleanup_edge(root: &Path) {
    for e in std::fs::read_dir(root.join("sandboxes"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let id = runtime_id(&e.path());
        for rt in ["crun", "runc"] {
            let _ = Command::new(rt)
                .arg("--root")
                .arg(root.join("runtime").join(rt))
                .args(["delete", "--force", &id])
                .output();
        }
        let _ = Command::new("umount").arg("-l").arg(e.path().join("rootfs")).output();
        let _ = Command::new("umount").arg("-l").arg(e.path().join("disk")).output();
    }
    for e in std::fs::read_dir(root.join("vms").join("vms"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let dir = e.path();
        if let Some(pid) = std::fs::read_to_string(dir.join("qemu.pid"))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&*dir.to_string_lossy()) {
                // A QEMU this edge started: its command line names the VM's directory.
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
            }
        }
        let netns = std::fs::read(dir.join("vm.json"))
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
            .and_then(|v| v["netns"].as_str().map(str::to_string));
        if let Some(n) = netns {
            let _ = Command::new("ip").args(["netns", "delete", &n]).output();
        }
    }
    // The sandboxes' network: table, namespaces, veths, address claims.
    opendsec_edge::net::forget(root, Path::new(opendsec_edge::net::DEFAULT_STATE_DIR));
}

/// Named `opendsec` processes of one test, in one temporary directory: each logs to
/// `<name>.log` there (appended to, so a restarted process's log follows the first
/// one's). Dropping it kills every process still running, then cleans up the edges
/// named at [`Procs::new`] (their directories are `<name>`), then removes the directory.
pub struct Procs {
    pub dir: tempfile::TempDir,
    children: Vec<(String, Child)>,
    edges: Vec<String>,
}

impl Procs {
    pub fn new(edges: &[&str]) -> Procs {
        Procs {
            dir: tempfile::tempdir().unwrap(),
            children: vec![],
            edges: edges.iter().map(|e| e.to_string()).collect(),
        }
    }

    /// Starts `opendsec args` as `name`.
    pub fn spawn<S: AsRef<std::ffi::OsStr>>(&mut self, name: &str, args: &[S]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{name}.log")))
            .unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_opendsec"))
            .args(args)
            .env("RUST_LOG", "info,openraft=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        self.children.push((name.to_string(), child));
    }

    /// SIGKILL of process `name`: nothing of its shutdown runs.
    pub fn kill9(&mut self, name: &str) {
        if let Some(i) = self.children.iter().position(|(n, _)| n == name) {
            let (_, mut c) = self.children.remove(i);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for (_, c) in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        if std::thread::panicking() {
            // The temp dir goes away with the test: show what each process said first.
            let mut logs: Vec<_> = std::fs::read_dir(self.dir.path())
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "log"))
                .collect();
            logs.sort();
            for log in logs {
                eprintln!("--- {} (last lines) ---\n{}", log.display(), log_tail(&log, 60));
            }
        }
        for edge in &self.edges {
            cleanup_edge(&self.dir.path().join(edge));
        }
    }
}

/// The last `lines` lines of the log at `path`, without request lines and image build
/// progress (they drown what went wrong).
pub fn log_tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains(" served ") && !l.contains("building image"))
        .collect();
    kept[kept.len().saturating_sub(lines)..].join("\n")
}

/// Sends `req` with `body` as JSON when there is one: (status, the JSON answer or its
/// text); a request that got no answer is status 0 with the error.
pub async fn send_json(mut req: reqwest::RequestBuilder, body: Option<Value>) -> (u16, Value) {
    if let Some(b) = body {
        req = req.json(&b);
    }
    match req.send().await {
        Ok(r) => {
            let s = r.status().as_u16();
            let text = r.text().await.unwrap_or_default();
            (s, serde_json::from_str(&text).unwrap_or(Value::String(text)))
        }
        Err(e) => (0, Value::String(e.to_string())),
    }
}

impl Up {
    /// Starts `opendsec up` with the default image store (`/var/lib/opendsec/images`, where
    /// images are built once per machine), initialises it and waits for its edge.
    pub async fn start(domain: Option<&str>) -> Up {
        Self::start_with_disk(domain, 256).await
    }

    /// As [`Up::start`], with containers run by `runtime` (crun or runc).
    pub async fn start_on(runtime: &str) -> Up {
        Self::start_with(None, 256, runtime).await
    }

    /// As [`Up::start`], with `disk_mb` of writable disk per sandbox.
    pub async fn start_with_disk(domain: Option<&str>, disk_mb: u64) -> Up {
        Self::start_with(domain, disk_mb, "auto").await
    }

    /// As [`Up::start`], in network namespace `netns` (the edge namespace of a test's
    /// own internet, see `internet.rs`): its API, peer port and edge proxy on `addr` (the
    /// namespace's address the test reaches), its DNS proxy asking `upstream_dns`.
    pub async fn start_in_netns(netns: &str, addr: std::net::Ipv4Addr, upstream_dns: &str) -> Up {
        Self::start_in_netns_env(netns, addr, upstream_dns, &[]).await
    }

    /// [`Up::start_in_netns`], `opendsec up` started with `env` set (its flags' variables).
    pub async fn start_in_netns_env(
        netns: &str,
        addr: std::net::Ipv4Addr,
        upstream_dns: &str,
        env: &[(&str, &str)],
    ) -> Up {
        let netns = (netns.to_string(), upstream_dns.to_string());
        let env = env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Self::start_opts(None, 256, "auto", Some(netns), env, |p| format!("{addr}:{p}")).await
    }

    async fn start_with(domain: Option<&str>, disk_mb: u64, runtime: &str) -> Up {
        Self::start_opts(domain, disk_mb, runtime, None, Vec::new(), |p| format!("127.0.0.1:{p}")).await
    }

    async fn start_opts(
        domain: Option<&str>,
        disk_mb: u64,
        runtime: &str,
        netns: Option<(String, String)>,
        env: Vec<(String, String)>,
        at: impl Fn(u16) -> String,
    ) -> Up {
        let dir = tempfile::tempdir().unwrap();
        let mut up = Up {
            http: at(free_port()),
            peer: at(free_port()),
            edge: at(free_port()),
            tls: domain.map(|d| Tls {
                domain: d.to_string(),
                listen: format!("127.0.0.1:{}", free_port()),
            }),
            dir,
            child: None,
            token: String::new(),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(60))
                .build()
                .unwrap(),
            disk_mb,
            runtime: runtime.to_string(),
            netns,
            env,
        };
        up.spawn();

        let token_file = up.dir.path().join("token");
        let out = Command::new(env!("CARGO_BIN_EXE_opendsec"))
            .args(["init", "--peer", &up.peer, "--data-dir"])
            .arg(up.data_dir())
            .arg("--token-file")
            .arg(&token_file)
            .output()
            .unwrap();
        if !out.status.success() {
            up.exited_or_panic();
            panic!("opendsec init failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        up.token = std::fs::read_to_string(token_file).unwrap().trim().to_string();

        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            up.exited_or_panic();
            let (s, v) = up.send(reqwest::Method::GET, "/v1/edges", None).await;
            if s == 200 && v["edges"].as_array().is_some_and(|e| !e.is_empty()) {
                break;
            }
            // A missing prerequisite (the shim, a runtime) stops the edge, not the server.
            let log = std::fs::read_to_string(up.log_path()).unwrap_or_default();
            assert!(
                !log.contains("embedded edge stopped"),
                "the embedded edge stopped:\n{}",
                up.log_tail(10)
            );
            assert!(
                Instant::now() < deadline,
                "the embedded edge did not register within 60 s: {s} {v}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if up.tls.is_some() {
            let ca = up.ca_cert();
            let deadline = Instant::now() + Duration::from_secs(30);
            while !ca.is_file() {
                up.exited_or_panic();
                assert!(
                    Instant::now() < deadline,
                    "opendsec up --domain wrote no CA certificate at {}",
                    ca.display()
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        up
    }

    fn spawn(&mut self) {
        // Appended to: a restarted server's log follows the first one's.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .unwrap();
        let mut cmd = match &self.netns {
            None => Command::new(env!("CARGO_BIN_EXE_opendsec")),
            Some((ns, _)) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{ns}"))
                    .arg("--")
                    .arg(env!("CARGO_BIN_EXE_opendsec"));
                c
            }
        };
        cmd.args(["up", "--data-dir"])
            .arg(self.data_dir())
            .args([
                "--listen",
                &self.http,
                "--peer-listen",
                &self.peer,
                "--edge-listen",
                &self.edge,
            ])
            .arg("--agent")
            .arg(static_agent())
            // 256 MB of writable disk per sandbox by default: room for the tests, small
            // enough that filling it (the oversized-upload test) takes a moment.
            .args(["--edge-sandboxes", "40", "--disk-mb", &self.disk_mb.to_string()])
            .args(["--runtime", &self.runtime])
            .env("RUST_LOG", "info,openraft=warn")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(tls) = &self.tls {
            cmd.args(["--domain", &tls.domain, "--tls-listen", &tls.listen]);
        }
        if let Some((_, dns)) = &self.netns {
            cmd.args(["--upstream-dns", dns]);
        }
        self.child = Some(cmd.spawn().expect("start opendsec up"));
    }

    /// SIGKILL of the whole `opendsec up` (control node, gateway and edge): no shutdown
    /// path runs. Sandboxes, not its children, live on.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts `opendsec up` again on the same data directory and waits until its edge
    /// has registered again (its proxy then serves).
    pub async fn restart(&mut self) {
        self.spawn();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.exited_or_panic();
            let (s, _) = self.send(reqwest::Method::GET, "/v1/edges", None).await;
            if s == 200 && std::net::TcpStream::connect(&self.edge).is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "opendsec up did not come back within 60 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A plain-HTTP door to the embedded edge's proxy (see [`edge_door`]).
    pub async fn edge_door(&self) -> String {
        edge_door(&self.data_dir().join("tls"), &self.edge, EMBEDDED_EDGE).await
    }

    /// The embedded edge's own key (what the gateway authenticates to it with, and what
    /// its sandboxes' tokens derive from): derived from the cluster key and its name.
    pub fn edge_key(&self) -> String {
        opendsec_control::edge_key(&self.cluster_key(), EMBEDDED_EDGE)
    }

    /// The cluster key (only control nodes hold it).
    pub fn cluster_key(&self) -> String {
        std::fs::read_to_string(self.data_dir().join("cluster.key"))
            .unwrap()
            .trim()
            .to_string()
    }

    /// Runs `cmd args` in the sandbox through the gateway's agent route
    /// (`/v1/sandboxes/{id}/agent/process.Process/Start`); returns (stdout, exit code).
    pub async fn exec(&self, id: &str, cmd: &str, args: &[&str]) -> Result<(String, i64), String> {
        rest_exec(&self.client, &self.http, &self.token, id, cmd, args).await
    }

    /// The pid of the `opendsec up` process (0 when it is not running).
    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(Child::id).unwrap_or(0)
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("up.log")
    }

    /// The cluster CA's certificate, which `opendsec up --domain` writes for users to trust.
    pub fn ca_cert(&self) -> PathBuf {
        self.data_dir().join("tls").join("ca.crt")
    }

    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log_path(), lines)
    }

    /// Panics with the server's last words if it has exited.
    pub fn exited_or_panic(&mut self) {
        if let Some(Ok(Some(status))) = self.child.as_mut().map(|c| c.try_wait()) {
            self.child = None;
            panic!("opendsec up exited ({status}):\n{}", self.log_tail(30));
        }
    }

    /// A request to the native API as the admin; the body is JSON when there is one.
    pub async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> (u16, Value) {
        send_json(
            self.client
                .request(method, format!("http://{}{path}", self.http))
                .bearer_auth(&self.token),
            body,
        )
        .await
    }

    /// Issues an E2B API key (`e2b_` + 40 hex digits) for the admin's project, the way a
    /// user gets one: `POST /v1/tokens` with `format: "e2b"`.
    pub async fn issue_e2b_key(&self) -> String {
        let body = json!({"name": "e2b", "rights": ["sandbox:read", "sandbox:write"], "format": "e2b"});
        let (s, v) = self.send(reqwest::Method::POST, "/v1/tokens", Some(body)).await;
        assert!(s == 200 || s == 201, "POST /v1/tokens with format e2b: {s} {v}");
        let key = v["token"].as_str().unwrap_or_default().to_string();
        let hex = key.strip_prefix("e2b_").unwrap_or_default();
        assert!(
            hex.len() == 40 && hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)),
            "an E2B API key is e2b_ + 40 lowercase hex digits, got {v}"
        );
        key
    }

    /// Waits until snapshot `snap` is ready (panics if it failed or took longer than
    /// `within`) and returns its view.
    pub async fn wait_snapshot_ready(&self, snap: &str, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            let (_, x) = self
                .send(reqwest::Method::GET, &format!("/v1/snapshots/{snap}"), None)
                .await;
            match x["state"].as_str() {
                Some("ready") => return x,
                Some("failed") => panic!("the snapshot failed: {x}"),
                _ => assert!(
                    Instant::now() < deadline,
                    "the snapshot was not taken within {within:?}: {x}"
                ),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Makes sure `image` exists in the image store, building it if this machine never
    /// did, by running one sandbox of it through the native API. A first build (a
    /// debootstrap, or the code interpreter's packages) takes minutes: it happens here,
    /// with a clear failure, rather than inside an SDK call's timeout.
    pub async fn ensure_image(&self, image: &str, within: Duration) {
        let started = Instant::now();
        let (s, v) = self
            .send(reqwest::Method::POST, "/v1/sandboxes", Some(json!({"image": image})))
            .await;
        assert_eq!(s, 201, "creating a `{image}` sandbox through /v1: {v}");
        let id = v["sandbox"]["id"].as_str().expect("sandbox id").to_string();
        loop {
            let (_, v) = self
                .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
                .await;
            match v["state"].as_str() {
                Some("running") => break,
                Some(state @ ("failed" | "exited" | "killed")) => {
                    panic!("the `{image}` image is not available: its sandbox is {state}: {v}")
                }
                _ => {}
            }
            assert!(
                started.elapsed() < within,
                "a `{image}` sandbox was not running within {within:?} (image build?): {v}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if started.elapsed() > Duration::from_secs(10) {
            eprintln!("image `{image}` ready after {:?}", started.elapsed());
        }
        let _ = self
            .send(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await;
    }
}

/// Runs `f` on every line of `path` and writes back those it keeps, in place (so that
/// a bind-mounted /etc/hosts stays the same file).
pub fn retain_lines(path: &Path, keep: impl Fn(&str) -> bool) {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let kept: String = text.lines().filter(|l| keep(l)).map(|l| format!("{l}\n")).collect();
    if kept != text {
        std::fs::write(path, kept).unwrap_or_else(|e| panic!("rewrite {}: {e}", path.display()));
    }
}

/// One Connect envelope holding `msg`.
pub fn connect_frame(msg: &[u8]) -> Vec<u8> {
    let mut frame = vec![0u8];
    frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    frame.extend_from_slice(msg);
    frame
}

/// Runs `cmd args` in sandbox `id` through the gateway at `http` (its REST agent route,
/// `/v1/sandboxes/{id}/agent/process.Process/Start`) with `token`, as a user does;
/// returns (stdout, exit code).
pub async fn rest_exec(
    client: &reqwest::Client,
    http: &str,
    token: &str,
    id: &str,
    cmd: &str,
    args: &[&str],
) -> Result<(String, i64), String> {
    let body = serde_json::to_vec(&json!({"process": {"cmd": cmd, "args": args}})).unwrap();
    let r = client
        .post(format!("http://{http}/v1/sandboxes/{id}/agent/process.Process/Start"))
        .bearer_auth(token)
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .body(connect_frame(&body))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    read_process_stream(r).await
}

/// A plain-HTTP door on loopback to edge `edge`'s proxy at `edge_addr`, for tests that
/// talk to the proxy straight, as the gateway does: each connection is relayed over
/// mutual TLS with a gateway certificate from the cluster CA in `pki` (the edge's proxy
/// serves the cluster's components only). Lives as long as the test's runtime.
pub async fn edge_door(pki: &std::path::Path, edge_addr: &str, edge: &str) -> String {
    use opendsec_trust::{Expect, Identity, Trust};
    let ca = opendsec_trust::Ca::load(pki).expect("the cluster's CA");
    let id = Identity::gateway(99);
    let issued = ca.issue(&id).expect("a gateway certificate");
    let trust = std::sync::Arc::new(Trust::new(id, ca.cert_pem(), &issued, None).expect("a gateway's trust"));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let door = listener.local_addr().unwrap().to_string();
    let (to, expect) = (edge_addr.to_string(), Expect::Exactly(Identity::edge(edge)));
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            let (trust, to, expect) = (trust.clone(), to.clone(), expect.clone());
            tokio::spawn(async move {
                // An edge that is restarting is waited for (up to 30 s), as a caller
                // retrying refused connections would.
                let deadline = Instant::now() + Duration::from_secs(30);
                let mut tls = loop {
                    let tried = async {
                        let tcp = tokio::net::TcpStream::connect(&to).await?;
                        let _ = tcp.set_nodelay(true);
                        trust.connect(tcp, &expect).await
                    };
                    match tried.await {
                        Ok(tls) => break tls,
                        Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(100)).await,
                        Err(_) => return,
                    }
                };
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut tls).await;
            });
        }
    });
    door
}

/// Folds a `process.Process/Start` response into (stdout, exit code); an error status or
/// a stream that ends without the process's end is an `Err`.
/// Runs `script` with `/bin/sh -c` in sandbox `id` straight through the edge's proxy at
/// `edge` (as the gateway does: the edge's key and the sandbox's own agent token), as
/// `user` (E2B's `Authorization: Basic <user:>`) or the sandbox's default user. Retries
/// while the edge refuses connections (it may be restarting); a stream cut short (the
/// sandbox died under it) is an error.
pub async fn edge_exec(
    client: &reqwest::Client,
    edge: &str,
    key: &str,
    id: &str,
    script: &str,
    user: Option<&str>,
) -> Result<(String, i64), String> {
    use base64::Engine;
    let body = serde_json::to_vec(&json!({"process": {"cmd": "/bin/sh", "args": ["-c", script]}})).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let r = loop {
        let mut request = client.post(format!("http://{edge}/sandboxes/{id}/process.Process/Start"));
        if let Some(user) = user {
            let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
            request = request.header("authorization", format!("Basic {basic}"));
        }
        let sent = request
            .header("x-opendsec-edge-key", key)
            .header(
                "x-access-token",
                opendsec_control::sandbox_token(key, opendsec_control::SandboxTokenKind::Agent, id),
            )
            .header("content-type", "application/connect+json")
            .header("connect-protocol-version", "1")
            .body(connect_frame(&body))
            .send()
            .await;
        match sent {
            Ok(r) => break r,
            Err(e) if e.is_connect() && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => return Err(e.to_string()),
        }
    };
    read_process_stream(r).await
}

pub async fn read_process_stream(r: reqwest::Response) -> Result<(String, i64), String> {
    use base64::Engine;
    let status = r.status().as_u16();
    let bytes = r.bytes().await.map_err(|e| e.to_string())?;
    if status != 200 {
        return Err(format!("status {status}: {}", String::from_utf8_lossy(&bytes)));
    }
    let (mut out, mut code, mut i) = (String::new(), None, 0);
    while i + 5 <= bytes.len() {
        let n = u32::from_be_bytes(bytes[i + 1..i + 5].try_into().unwrap()) as usize;
        let m: Value = serde_json::from_slice(&bytes[i + 5..i + 5 + n]).map_err(|e| e.to_string())?;
        i += 5 + n;
        if let Some(d) = m["event"]["data"]["stdout"].as_str() {
            out.push_str(&String::from_utf8_lossy(
                &base64::engine::general_purpose::STANDARD.decode(d).unwrap(),
            ));
        }
        if m["event"]["end"].is_object() {
            // proto3 JSON leaves out a zero exit code.
            code = Some(m["event"]["end"]["exitCode"].as_i64().unwrap_or(0));
        }
        if let Some(e) = m.get("error") {
            return Err(format!("the stream ended with {e}"));
        }
    }
    code.map(|c| (out, c))
        .ok_or_else(|| "the process stream closed without an end".to_string())
}
