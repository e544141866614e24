//! The server under test: [`UpGuard`] starts a real `opendsec up` (control plane,
//! gateway and embedded edge in one process) with its own ports and data directory,
//! bootstraps it, waits for the edge, and speaks REST to it. It may run inside a network
//! namespace of the caller's ([`UpNetns`]: started with `nsenter --net`, listening on
//! an address of that namespace the caller reaches). Dropping it (or
//! [`emergency_teardown`] from a signal handler) stops the server (SIGTERM, then
//! SIGKILL; PR_SET_PDEATHSIG besides), deletes every container the edge left through
//! the runtime, removes its sandboxes' network (`opendsec_edge::net::forget`),
//! detaches the mounts and removes the directory.

use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::host::{free_port, host_is_cgroup_hybrid, mounts_under, read_pid, runtime_cmd, umount_detach};
use crate::log_tail;

/// What an `opendsec up` is started with.
#[derive(Clone, Debug)]
pub struct UpConfig {
    /// The run's own directory (emptied first, removed on drop): `data/`, `up.log`, the token.
    pub dir: PathBuf,
    pub opendsec_bin: PathBuf,
    pub agent_bin: PathBuf,
    /// The image store (`--image-dir`); it may lie inside `dir`.
    pub image_dir: PathBuf,
    /// More `opendsec up` flags (after those of `OPENDSEC_BENCH_UP_ARGS`).
    pub extra_args: Vec<String>,
    /// The network namespace it runs in (`None`: the caller's, on 127.0.0.1).
    pub netns: Option<UpNetns>,
}

/// Where an `opendsec up` in a network namespace runs and listens.
#[derive(Clone, Debug)]
pub struct UpNetns {
    /// The namespace's name (under /run/netns).
    pub name: String,
    /// An address of that namespace the caller reaches: the API, the peer port and the
    /// edge's proxy listen on it.
    pub addr: Ipv4Addr,
}

/// A running `opendsec up`. Drop stops it and removes every sandbox, mount and file it left.
pub struct UpGuard {
    pub dir: PathBuf,
    pub data: PathBuf,
    pub http: String,
    pub peer: String,
    pub edge: String,
    pub log: PathBuf,
    child: Option<Child>,
    pub token: String,
    pub client: reqwest::Client,
    hybrid: bool,
    keep: bool,
    netns: Option<String>,
}

impl UpGuard {
    pub fn pid(&self) -> Option<i32> {
        self.child.as_ref().map(|c| c.id() as i32)
    }

    pub fn sandboxes_dir(&self) -> PathBuf {
        self.data.join("edge").join("sandboxes")
    }

    /// Sandbox directories the edge has (named by 20 hex digits).
    pub fn sandbox_dirs(&self) -> Vec<PathBuf> {
        std::fs::read_dir(self.sandboxes_dir())
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        let n = e.file_name().to_string_lossy().to_string();
                        n.len() == 20 && n.bytes().all(|b| b.is_ascii_hexdigit()) && e.path().is_dir()
                    })
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default()
    }

    pub async fn start(o: &UpConfig, max_sandboxes: u64) -> Result<UpGuard, String> {
        let dir = o.dir.clone();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {dir:?}: {e}"))?;
        // Ports free here are free in a fresh namespace too.
        let host = o.netns.as_ref().map(|n| n.addr).unwrap_or(Ipv4Addr::LOCALHOST);
        let mut up = UpGuard {
            data: dir.join("data"),
            log: dir.join("up.log"),
            http: format!("{host}:{}", free_port()?),
            peer: format!("{host}:{}", free_port()?),
            edge: format!("{host}:{}", free_port()?),
            dir,
            child: None,
            token: String::new(),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(120))
                .pool_max_idle_per_host(2048)
                .build()
                .map_err(|e| e.to_string())?,
            hybrid: host_is_cgroup_hybrid(),
            keep: std::env::var_os("OPENDSEC_BENCH_KEEP").is_some(),
            netns: o.netns.as_ref().map(|n| n.name.clone()),
        };
        let log = std::fs::File::create(&up.log).map_err(|e| e.to_string())?;
        // nsenter joins the namespace and execs `opendsec` (no fork): the child is it.
        let mut cmd = match &o.netns {
            None => Command::new(&o.opendsec_bin),
            Some(n) => {
                let mut c = Command::new("nsenter");
                c.arg(format!("--net=/run/netns/{}", n.name))
                    .arg("--")
                    .arg(&o.opendsec_bin);
                c
            }
        };
        cmd.arg("up")
            .arg("--data-dir")
            .arg(&up.data)
            .args([
                "--listen",
                &up.http,
                "--peer-listen",
                &up.peer,
                "--edge-listen",
                &up.edge,
            ])
            .arg("--agent")
            .arg(&o.agent_bin)
            .arg("--image-dir")
            .arg(&o.image_dir)
            .args(["--edge-sandboxes", &max_sandboxes.to_string(), "--disk-mb", "64"])
            // Declared capacity: memory_mb and cpu_millis are limits, not reservations;
            // 1,000 x 64 MB would exceed the host's 24 GiB on paper while using far less.
            .args(["--edge-memory-mb", &(max_sandboxes * 64 + 1024).to_string()])
            .args(["--edge-cpu-millis", &(max_sandboxes * 100 + 1000).to_string()])
            // Extra `opendsec up` flags for experiments (e.g. `--warm-disks 0`).
            .args(
                std::env::var("OPENDSEC_BENCH_UP_ARGS")
                    .unwrap_or_default()
                    .split_whitespace(),
            )
            .args(&o.extra_args)
            .env(
                "RUST_LOG",
                std::env::var("OPENDSEC_BENCH_RUST_LOG").unwrap_or_else(|_| "warn".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        up.child = Some(
            cmd.spawn()
                .map_err(|e| format!("spawn {}: {e}", o.opendsec_bin.display()))?,
        );
        if let Ok(mut g) = LIVE.lock() {
            *g = Some(up.teardown_info());
        }
        let token_file = up.dir.join("admin.token");
        let out = tokio::process::Command::new(&o.opendsec_bin)
            .args(["init", "--peer", &up.peer])
            .arg("--data-dir")
            .arg(&up.data)
            .arg("--token-file")
            .arg(&token_file)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| format!("opendsec init: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "opendsec init failed: {}; up.log: {}",
                String::from_utf8_lossy(&out.stderr).trim(),
                log_tail(&up.log, 10)
            ));
        }
        up.token = std::fs::read_to_string(&token_file)
            .map_err(|e| e.to_string())?
            .trim()
            .to_string();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(Ok(Some(st))) = up.child.as_mut().map(|c| c.try_wait()) {
                return Err(format!("opendsec up exited ({st}): {}", log_tail(&up.log, 10)));
            }
            if let Ok((200, v)) = up.send(reqwest::Method::GET, "/v1/edges", None).await
                && v["edges"].as_array().is_some_and(|e| !e.is_empty())
            {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "the embedded edge did not register within 60 s: {}",
                    log_tail(&up.log, 10)
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(up)
    }

    pub async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Result<(u16, Value), String> {
        let mut req = self
            .client
            .request(method, format!("http://{}{path}", self.http))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.map_err(|e| format!("{path}: {e}"))?;
        let st = r.status().as_u16();
        let text = r.text().await.map_err(|e| format!("{path}: {e}"))?;
        Ok((st, serde_json::from_str(&text).unwrap_or(Value::String(text))))
    }

    pub async fn create(&self, body: &Value) -> Result<String, String> {
        let (st, v) = self
            .send(reqwest::Method::POST, "/v1/sandboxes", Some(body.clone()))
            .await?;
        if st != 201 && st != 200 {
            return Err(format!(
                "create: HTTP {st}: {}",
                v.to_string().chars().take(300).collect::<String>()
            ));
        }
        v["sandbox"]["id"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| format!("no sandbox id in {v}"))
    }

    pub async fn state(&self, id: &str) -> Result<String, String> {
        let (st, v) = self
            .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await?;
        if st != 200 {
            return Err(format!("get {id}: HTTP {st}: {v}"));
        }
        Ok(v["state"].as_str().unwrap_or("?").to_string())
    }

    /// Polls `GET /v1/sandboxes/{id}` every `every` until its state is `want`.
    pub async fn wait_state(&self, id: &str, want: &str, every: Duration, within: Duration) -> Result<(), String> {
        let deadline = Instant::now() + within;
        loop {
            let s = self.state(id).await?;
            if s == want {
                return Ok(());
            }
            if matches!(s.as_str(), "failed" | "exited" | "killed") && want != s {
                return Err(format!("sandbox {id} is {s}, waiting for {want}"));
            }
            if Instant::now() > deadline {
                return Err(format!("sandbox {id} still {s} after {within:?}, waiting for {want}"));
            }
            tokio::time::sleep(every).await;
        }
    }

    pub async fn delete(&self, id: &str) -> Result<(), String> {
        let (st, v) = self
            .send(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
            .await?;
        if st >= 300 && st != 409 {
            return Err(format!("delete {id}: HTTP {st}: {v}"));
        }
        Ok(())
    }

    /// Waits until the edge has removed `id`'s directory (its mounts and container are gone).
    pub async fn wait_freed(&self, id: &str, within: Duration) -> Result<(), String> {
        let p = self.sandboxes_dir().join(id);
        let deadline = Instant::now() + within;
        while p.exists() {
            if Instant::now() > deadline {
                return Err(format!("the edge did not free sandbox {id} within {within:?}"));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(())
    }
}

/// What [`teardown`] needs; kept in a static too, so a SIGINT/SIGTERM handler can tear
/// down the server a dropped future would otherwise leave behind.
#[derive(Clone)]
struct Teardown {
    pid: Option<i32>,
    dir: PathBuf,
    data: PathBuf,
    hybrid: bool,
    keep: bool,
    netns: Option<String>,
}

static LIVE: Mutex<Option<Teardown>> = Mutex::new(None);

/// Stops `opendsec up` (SIGTERM, then SIGKILL after 10 s), deletes every container the
/// edge left through the runtime, kills their shims, detaches every mount under the
/// run's directory and removes it.
fn teardown(t: &Teardown, child: Option<&mut Child>) {
    if let Some(pid) = t.pid {
        // SAFETY: signals to our own child.
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(10);
        let alive = |c: &mut Option<&mut Child>| match c {
            Some(c) => matches!(c.try_wait(), Ok(None)),
            None => Path::new(&format!("/proc/{pid}")).exists(),
        };
        let mut child = child;
        while Instant::now() < deadline && alive(&mut child) {
            std::thread::sleep(Duration::from_millis(50));
        }
        unsafe { libc::kill(pid, libc::SIGKILL) };
        if let Some(c) = child {
            let _ = c.wait();
        }
    }
    let sandboxes = t.data.join("edge").join("sandboxes");
    for d in std::fs::read_dir(&sandboxes)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
    {
        // A claimed warm container keeps its runtime id (`runtime_id` in its record).
        let rec: Value = std::fs::read(d.join("sandbox.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        let name = d
            .file_name()
            .unwrap()
            .to_string_lossy()
            .trim_start_matches('.')
            .to_string();
        let id = rec["runtime_id"]
            .as_str()
            .or(rec["id"].as_str())
            .unwrap_or(&name)
            .to_string();
        for rt in ["crun", "runc"] {
            let root = t.data.join("edge").join("runtime").join(rt);
            if root.is_dir() {
                let _ = runtime_cmd(rt, &root, t.hybrid)
                    .args(["delete", "--force", &id])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
            }
        }
        if let Some(pid) = read_pid(&d.join("shim.pid")) {
            // SAFETY: a pid from the sandbox's own record.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        umount_detach(&d.join("rootfs"));
        umount_detach(&d.join("disk"));
    }
    forget_network(&t.data.join("edge"), t.netns.as_deref());
    for m in mounts_under(&t.dir).iter().rev() {
        umount_detach(Path::new(m));
    }
    if t.keep {
        eprintln!("kept {} (OPENDSEC_BENCH_KEEP)", t.dir.display());
    } else if mounts_under(&t.dir).is_empty() {
        let _ = std::fs::remove_dir_all(&t.dir);
    } else {
        eprintln!("WARNING: mounts left under {}; not removing it", t.dir.display());
    }
}

/// The hidden `opendsec-bench` subcommand that runs [`forget_network_here`] (this
/// executable runs it under `nsenter --net` for an edge in another namespace).
pub const FORGET_NETWORK_CMD: &str = "forget-network";

/// `opendsec_edge::net::forget` of the edge whose data directory is `edge_data`, in the
/// caller's network namespace.
pub fn forget_network_here(edge_data: &Path) {
    opendsec_edge::net::forget(edge_data, Path::new(opendsec_edge::net::DEFAULT_STATE_DIR));
}

/// Removes the sandboxes' network the stopped edge (data directory `edge_data`) left:
/// its table and the host ends of its veths live in the namespace it ran in, and are
/// removed from there; the sandboxes' namespaces, sysfs mounts and address claims are
/// host-wide. `forget` does its netlink and nftables work on the edge crate's one netns
/// worker thread, which stays in the namespace it started in whatever thread calls it:
/// a thread of ours entering the edge's namespace would not take it along. So an edge
/// in a namespace of its own is forgotten by a process started there (this executable's
/// [`FORGET_NETWORK_CMD`] under `nsenter --net`); if that fails, by this one, which
/// still removes the host-wide part (the rest goes with the namespace).
fn forget_network(edge_data: &Path, netns: Option<&str>) {
    let Some(ns) = netns else {
        return forget_network_here(edge_data);
    };
    let run = std::env::current_exe().and_then(|exe| {
        Command::new("nsenter")
            .arg(format!("--net=/run/netns/{ns}"))
            .arg("--")
            .arg(exe)
            .arg(FORGET_NETWORK_CMD)
            .arg(edge_data)
            .stdin(Stdio::null())
            .status()
    });
    match run {
        Ok(s) if s.success() => {}
        other => {
            eprintln!(
                "WARNING: forgetting the sandbox network in namespace {ns} failed ({other:?}): removing its host-wide part from here"
            );
            forget_network_here(edge_data);
        }
    }
}

/// For a signal handler: tears down the live `opendsec up`, if any.
pub fn emergency_teardown() {
    let t = LIVE.lock().ok().and_then(|mut g| g.take());
    if let Some(t) = t {
        eprintln!("interrupted: stopping opendsec up and removing its sandboxes");
        teardown(&t, None);
    }
}

impl UpGuard {
    fn teardown_info(&self) -> Teardown {
        Teardown {
            pid: self.pid(),
            dir: self.dir.clone(),
            data: self.data.clone(),
            hybrid: self.hybrid,
            keep: self.keep,
            netns: self.netns.clone(),
        }
    }
}

impl Drop for UpGuard {
    fn drop(&mut self) {
        let t = self.teardown_info();
        teardown(&t, self.child.as_mut());
        self.child = None;
        if let Ok(mut g) = LIVE.lock() {
            *g = None;
        }
    }
}
