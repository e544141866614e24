//! `opendsec-bench sandboxes`: container sandboxes through the REST API of a real
//! `opendsec up` (control plane, gateway and embedded edge in one process), beside the
//! raw OCI runtime.
//!
//! 1. Create to first exec output: `POST /v1/sandboxes`, then at once (retrying while
//!    the gateway answers 409/502/503) `POST /v1/sandboxes/{id}/agent/process.Process/Start`
//!    of `/bin/sh -c 'echo hi'` (Connect streaming JSON); the clock stops at the first
//!    stdout bytes. Then `DELETE` and wait until the edge has removed the sandbox's
//!    directory, so runs do not overlap. Beside it: `crun run` and `runc run` of the
//!    bundle the edge wrote (its `config.json`, with the process set to the same
//!    command), on an overlay of the same image layer prepared beforehand (no disk
//!    image, no mount timed), from spawn to the first stdout byte.
//! 2. Pause and resume: `POST .../pause`, then poll `GET` until `paused`; `POST
//!    .../resume`, until `running`.
//! 3. Bursts: N concurrent creates (N tokio tasks), then wait until every one is
//!    running or has failed: total time, failures, peak memory of the `opendsec up`
//!    process (VmHWM after resetting it through `/proc/<pid>/clear_refs`), and the
//!    summed RSS of the shims and agents. Then delete them all and wait until the edge
//!    has freed them.
//!
//! Everything it starts is torn down by [`UpGuard`] and [`RawBundle`] on drop (also on
//! error): the server gets SIGTERM then SIGKILL (and PR_SET_PDEATHSIG), every sandbox
//! the edge left is deleted through the runtime, its mounts are detached, and the data
//! directory is removed.

use crate::log_tail;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::load::percentile;
use crate::report::fmt_dur;

/// Goal: p50 create-to-first-output within this many times raw `crun run`.
pub const CREATE_VS_CRUN: f64 = 3.0;

#[derive(Clone, Debug)]
pub struct Options {
    pub runs: usize,
    pub pause_runs: usize,
    pub bursts: Vec<usize>,
    pub image: String,
    pub data_dir: PathBuf,
    pub opendsec_bin: PathBuf,
    pub agent_bin: PathBuf,
    pub image_dir: PathBuf,
    pub burst_timeout: Duration,
    pub skip_runc: bool,
}

// ---------------------------------------------------------------------------------
// Small helpers

fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// Standard base64 (with or without padding).
pub fn b64decode(s: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            b'=' => break,
            _ => return None,
        };
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    Some(out)
}

/// `VmRSS` / `VmHWM` of a process, in KiB.
fn proc_status_kb(pid: i32, field: &str) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn mem_available_mb() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? / 1024)
}

fn read_pid(p: &Path) -> Option<i32> {
    std::fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn mib(kb: u64) -> String {
    format!("{:.1} MiB", kb as f64 / 1024.0)
}

/// The host mixes cgroup v1 with a cgroup2 mount at /sys/fs/cgroup/unified (crun 1.8
/// refuses that unless run in a private mount namespace without it).
fn host_is_cgroup_hybrid() -> bool {
    const CGROUP2_MAGIC: i64 = 0x6367_7270;
    let magic = |p: &str| -> Option<i64> {
        let c = std::ffi::CString::new(p).ok()?;
        let mut st: libc::statfs = unsafe { std::mem::zeroed() };
        // SAFETY: statfs fills the struct we own.
        (unsafe { libc::statfs(c.as_ptr(), &mut st) } == 0).then_some(st.f_type as i64)
    };
    magic("/sys/fs/cgroup") != Some(CGROUP2_MAGIC) && magic("/sys/fs/cgroup/unified") == Some(CGROUP2_MAGIC)
}

/// `rt --root ROOT args...`; for crun on a hybrid host, in a private mount namespace
/// without /sys/fs/cgroup/unified (as `opendsec_edge::container::Runtime::command`).
fn runtime_cmd(rt: &str, root: &Path, hybrid: bool) -> Command {
    let mut cmd = Command::new(rt);
    cmd.arg("--root").arg(root);
    if rt == "crun" && hybrid {
        // SAFETY: only raw syscalls between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::unshare(libc::CLONE_NEWNS) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::mount(
                    c"none".as_ptr(),
                    c"/".as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::umount2(c"/sys/fs/cgroup/unified".as_ptr(), libc::MNT_DETACH) != 0 {
                    let err = std::io::Error::last_os_error();
                    if err.raw_os_error() != Some(libc::EINVAL) {
                        return Err(err);
                    }
                }
                Ok(())
            });
        }
    }
    cmd
}

fn umount_detach(p: &Path) {
    if let Ok(c) = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()) {
        // SAFETY: plain syscall on a path we own.
        unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
    }
}

fn is_mounted(p: &Path) -> bool {
    let want = p.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4).map(|m| m.replace("\\040", " ")) == Some(want.clone()))
}

/// Mount points under `dir` in this mount namespace.
pub fn mounts_under(dir: &Path) -> Vec<String> {
    let prefix = dir.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| m.starts_with(&prefix))
        .collect()
}

// ---------------------------------------------------------------------------------
// The server under test

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

    pub async fn start(o: &Options, max_sandboxes: u64) -> Result<UpGuard, String> {
        std::fs::create_dir_all(&o.data_dir).map_err(|e| format!("create {:?}: {e}", o.data_dir))?;
        let dir = o.data_dir.join(format!("sandboxes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {dir:?}: {e}"))?;
        let mut up = UpGuard {
            data: dir.join("data"),
            log: dir.join("up.log"),
            http: format!("127.0.0.1:{}", free_port()?),
            peer: format!("127.0.0.1:{}", free_port()?),
            edge: format!("127.0.0.1:{}", free_port()?),
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
        };
        let log = std::fs::File::create(&up.log).map_err(|e| e.to_string())?;
        let mut cmd = Command::new(&o.opendsec_bin);
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

    /// Runs `sh -c cmd` through the gateway's agent route as soon as the sandbox takes it;
    /// returns the instant the first stdout bytes arrived and all of stdout.
    pub async fn exec_first_output(&self, id: &str, cmd: &str, within: Duration) -> Result<(Instant, String), String> {
        let body = serde_json::to_vec(&json!({"process": {"cmd": "/bin/sh", "args": ["-c", cmd]}})).unwrap();
        let mut frame = vec![0u8];
        frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
        frame.extend_from_slice(&body);
        let url = format!("http://{}/v1/sandboxes/{id}/agent/process.Process/Start", self.http);
        let deadline = Instant::now() + within;
        let mut last = String::new();
        let mut resp = loop {
            if Instant::now() > deadline {
                return Err(format!(
                    "exec in {id}: not accepted within {within:?}; last answer: {last}"
                ));
            }
            let r = self
                .client
                .post(&url)
                .bearer_auth(&self.token)
                .header("content-type", "application/connect+json")
                .header("connect-protocol-version", "1")
                .body(frame.clone())
                .send()
                .await;
            match r {
                Ok(r) if r.status().is_success() => break r,
                Ok(r) => {
                    let st = r.status().as_u16();
                    last = format!(
                        "HTTP {st}: {}",
                        r.text().await.unwrap_or_default().chars().take(200).collect::<String>()
                    );
                    if st == 409 {
                        // 409 = ended: retry only while it has not really failed.
                        let s = self.state(id).await.unwrap_or_default();
                        if matches!(s.as_str(), "failed" | "exited" | "killed") {
                            return Err(format!("exec in {id}: sandbox {s} ({last})"));
                        }
                    } else if st != 502 && st != 503 {
                        return Err(format!("exec in {id}: {last}"));
                    }
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        let mut buf: Vec<u8> = Vec::new();
        let mut first: Option<Instant> = None;
        let mut out = Vec::new();
        loop {
            let chunk = match tokio::time::timeout_at(tokio::time::Instant::from_std(deadline), resp.chunk()).await {
                Ok(Ok(Some(c))) => c,
                Ok(Ok(None)) => break,
                Ok(Err(e)) => return Err(format!("exec in {id}: stream cut: {e}")),
                Err(_) => return Err(format!("exec in {id}: no end of stream within {within:?}")),
            };
            buf.extend_from_slice(&chunk);
            while buf.len() >= 5 {
                let n = u32::from_be_bytes(buf[1..5].try_into().unwrap()) as usize;
                if buf.len() < 5 + n {
                    break;
                }
                let flags = buf[0];
                let m: Value = serde_json::from_slice(&buf[5..5 + n]).unwrap_or(Value::Null);
                buf.drain(..5 + n);
                if flags & 2 != 0 {
                    if let Some(e) = m.get("error") {
                        return Err(format!("exec in {id}: {e}"));
                    }
                    continue;
                }
                if let Some(d) = m["event"]["data"]["stdout"].as_str() {
                    first.get_or_insert_with(Instant::now);
                    out.extend(b64decode(d).unwrap_or_default());
                }
            }
        }
        let first = first.ok_or_else(|| format!("exec in {id}: no stdout"))?;
        Ok((first, String::from_utf8_lossy(&out).to_string()))
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

// ---------------------------------------------------------------------------------
// Raw OCI runtime baseline

/// A bundle for a raw `crun run`/`runc run`: the edge's config.json, rootfs = overlay
/// of the image layers (upper/work on the bench data dir's disk). Drop unmounts and
/// removes it, and deletes the container if it is still there.
struct RawBundle {
    dir: PathBuf,
    rootfs: PathBuf,
    rt: &'static str,
    root: PathBuf,
    id: String,
    hybrid: bool,
}

impl RawBundle {
    fn prepare(
        base: &Path,
        rt: &'static str,
        i: usize,
        layers: &[PathBuf],
        config: &Value,
        hybrid: bool,
    ) -> Result<RawBundle, String> {
        let dir = base.join(format!("{rt}-{i}"));
        let id = format!("bench-{}-{rt}-{i}", std::process::id());
        let b = RawBundle {
            rootfs: dir.join("rootfs"),
            root: base.join(format!("state-{rt}")),
            dir,
            rt,
            id,
            hybrid,
        };
        for d in [
            b.rootfs.clone(),
            b.dir.join("upper"),
            b.dir.join("work"),
            b.root.clone(),
        ] {
            std::fs::create_dir_all(&d).map_err(|e| format!("create {d:?}: {e}"))?;
        }
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(b.dir.join("upper"), std::fs::Permissions::from_mode(0o755));
        let lower = layers
            .iter()
            .rev()
            .map(|p| p.to_string_lossy().to_string())
            .collect::<Vec<_>>()
            .join(":");
        let opts = format!(
            "lowerdir={lower},upperdir={},workdir={}",
            b.dir.join("upper").display(),
            b.dir.join("work").display()
        );
        let c = |s: &str| std::ffi::CString::new(s).unwrap();
        let (src, target, fstype, data) = (c("overlay"), c(&b.rootfs.to_string_lossy()), c("overlay"), c(&opts));
        // SAFETY: valid C strings for the duration of the call.
        if unsafe {
            libc::mount(
                src.as_ptr(),
                target.as_ptr(),
                fstype.as_ptr(),
                0,
                data.as_ptr() as *const libc::c_void,
            )
        } != 0
        {
            return Err(format!(
                "mount overlay on {:?}: {}",
                b.rootfs,
                std::io::Error::last_os_error()
            ));
        }
        let mut cfg = config.clone();
        cfg["root"] = json!({"path": "rootfs", "readonly": false});
        cfg["process"]["args"] = json!(["/bin/sh", "-c", "echo hi"]);
        cfg["process"]["terminal"] = json!(false);
        cfg["linux"]["cgroupsPath"] = json!(format!("/opendsec-bench/{}", b.id));
        // The agent's per-sandbox configuration went with the sandbox the bundle was
        // captured from; `echo hi` needs none of it.
        if let Some(mounts) = cfg["mounts"].as_array_mut() {
            mounts.retain(|m| m["destination"] != "/.opendsec/config");
        }
        if let Some(o) = cfg.as_object_mut() {
            o.remove("annotations");
        }
        std::fs::write(b.dir.join("config.json"), serde_json::to_vec(&cfg).unwrap()).map_err(|e| e.to_string())?;
        Ok(b)
    }

    /// Spawn `rt run` and time it to the first stdout byte; then wait for it to finish.
    fn run(&self) -> Result<Duration, String> {
        let mut cmd = runtime_cmd(self.rt, &self.root, self.hybrid);
        cmd.args(["run", "--bundle"])
            .arg(&self.dir)
            .arg(&self.id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let t0 = Instant::now();
        let mut child = cmd.spawn().map_err(|e| format!("spawn {}: {e}", self.rt))?;
        let mut stdout = child.stdout.take().unwrap();
        let mut byte = [0u8; 64];
        let n = stdout.read(&mut byte).map_err(|e| e.to_string())?;
        let el = t0.elapsed();
        let mut rest = Vec::new();
        let _ = stdout.read_to_end(&mut rest);
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        let st = child.wait().map_err(|e| e.to_string())?;
        if n == 0 || !st.success() {
            return Err(format!(
                "{} run: {st}, stdout {:?}, stderr {}",
                self.rt,
                String::from_utf8_lossy(&byte[..n]),
                err.trim()
            ));
        }
        Ok(el)
    }
}

impl Drop for RawBundle {
    fn drop(&mut self) {
        let _ = runtime_cmd(self.rt, &self.root, self.hybrid)
            .args(["delete", "--force", &self.id])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        umount_detach(&self.rootfs);
        if !is_mounted(&self.rootfs) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

fn image_layers(image_dir: &Path, image: &str) -> Result<Vec<PathBuf>, String> {
    let p = image_dir.join("images").join(format!("{image}.json"));
    let v: Value = serde_json::from_slice(&std::fs::read(&p).map_err(|e| format!("read {p:?}: {e}"))?)
        .map_err(|e| format!("{p:?}: {e}"))?;
    let layers: Vec<PathBuf> = v["layers"]
        .as_array()
        .ok_or_else(|| format!("{p:?}: no layers"))?
        .iter()
        .filter_map(|l| l.as_str())
        .map(|l| image_dir.join("layers").join(l))
        .collect();
    if layers.is_empty() || layers.iter().any(|l| !l.is_dir()) {
        return Err(format!("{p:?}: missing layer directories"));
    }
    Ok(layers)
}

fn raw_runs(
    rt: &'static str,
    base: &Path,
    layers: &[PathBuf],
    config: &Value,
    runs: usize,
) -> Result<Vec<Duration>, String> {
    let hybrid = host_is_cgroup_hybrid();
    let mut v = Vec::new();
    // One warm-up (page cache, binary), not counted.
    for i in 0..=runs {
        let b = RawBundle::prepare(base, rt, i, layers, config, hybrid)?;
        let d = b.run()?;
        if i > 0 {
            v.push(d);
        }
    }
    v.sort_unstable();
    Ok(v)
}

// ---------------------------------------------------------------------------------
// Memory watch during bursts

#[derive(Default, Debug, Clone)]
pub struct MemPeak {
    /// Max VmRSS seen by polling, KiB.
    pub up_rss_kb: u64,
    /// VmHWM at the end (reset before the burst), KiB.
    pub up_hwm_kb: u64,
    /// Largest summed RSS of shims + agents (PID 1 of each sandbox), KiB, and how many
    /// sandboxes that sum covered.
    pub sandboxes_rss_kb: u64,
    pub sandboxes_at_peak: usize,
    pub min_mem_available_mb: u64,
}

fn sandboxes_rss(dirs: &[PathBuf]) -> (u64, usize) {
    let mut sum = 0;
    let mut n = 0;
    for d in dirs {
        let mut any = false;
        for f in ["shim.pid", "init.pid"] {
            if let Some(pid) = read_pid(&d.join(f))
                && let Some(kb) = proc_status_kb(pid, "VmRSS:")
            {
                sum += kb;
                any = true;
            }
        }
        n += any as usize;
    }
    (sum, n)
}

// ---------------------------------------------------------------------------------
// The benchmark

pub struct Results {
    pub lines: Vec<String>,
    pub failed: bool,
}

fn pline(out: &mut Vec<String>, s: String) {
    eprintln!("   {s}");
    out.push(s);
}

pub async fn run(o: Options) -> Results {
    let mut lines = Vec::new();
    let mut failed = false;
    let max_burst = o.bursts.iter().copied().max().unwrap_or(0);
    let capacity = (max_burst + 16) as u64;
    eprintln!(
        "== starting opendsec up (edge capacity {capacity} sandboxes, 64 MB disks) under {}",
        o.data_dir.display()
    );
    let up = match UpGuard::start(&o, capacity).await {
        Ok(u) => Arc::new(u),
        Err(e) => {
            lines.push(format!("FAILED: {e}"));
            return Results { lines, failed: true };
        }
    };
    let body = json!({"image": o.image, "memory_mb": 64, "cpu_millis": 100});

    // 1. create -> first output, and the raw runtime beside it.
    eprintln!(
        "== create to first exec output through the REST API, {} runs (+1 warm-up)",
        o.runs
    );
    let mut api: Vec<Duration> = Vec::new();
    let mut config: Option<Value> = None;
    let mut errors = Vec::new();
    for i in 0..=o.runs {
        let t0 = Instant::now();
        let id = match up.create(&body).await {
            Ok(id) => id,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        match up.exec_first_output(&id, "echo hi", Duration::from_secs(60)).await {
            Ok((first, out)) => {
                let d = first - t0;
                if out != "hi\n" {
                    errors.push(format!("run {i}: stdout {out:?}, expected \"hi\\n\""));
                } else if i > 0 {
                    api.push(d);
                }
            }
            Err(e) => errors.push(format!("run {i}: {e}")),
        }
        if config.is_none()
            && let Ok(b) = std::fs::read(up.sandboxes_dir().join(&id).join("config.json"))
        {
            config = serde_json::from_slice(&b).ok();
        }
        if let Err(e) = up.delete(&id).await {
            errors.push(e);
        }
        if let Err(e) = up.wait_freed(&id, Duration::from_secs(60)).await {
            errors.push(e);
        }
        if errors.len() > 5 {
            break;
        }
    }
    api.sort_unstable();
    let api_p50 = percentile(&api, 0.5);
    pline(
        &mut lines,
        format!(
            "REST create -> first output (POST /v1/sandboxes, exec `echo hi` via agent route): p50 {}, p90 {}, min {}, max {} (n={}, errors {})",
            fmt_dur(api_p50),
            fmt_dur(percentile(&api, 0.9)),
            fmt_dur(api.first().copied().unwrap_or_default()),
            fmt_dur(api.last().copied().unwrap_or_default()),
            api.len(),
            errors.len()
        ),
    );
    for e in errors.iter().take(3) {
        pline(&mut lines, format!("  error: {e}"));
    }
    failed |= !errors.is_empty() || api.is_empty();

    let layers = image_layers(&o.image_dir, &o.image);
    let raw_base = up.dir.join("raw");
    let mut crun_p50 = None;
    match (&config, &layers) {
        (Some(cfg), Ok(layers)) => {
            let rts: &[&'static str] = if o.skip_runc { &["crun"] } else { &["crun", "runc"] };
            for &rt in rts {
                eprintln!(
                    "== raw `{rt} run` of the edge's bundle (overlay of the {} layer, no disk image), {} runs (+1 warm-up)",
                    o.image, o.runs
                );
                let (base, layers, cfg, runs) = (raw_base.clone(), layers.clone(), cfg.clone(), o.runs);
                match tokio::task::spawn_blocking(move || raw_runs(rt, &base, &layers, &cfg, runs)).await {
                    Ok(Ok(v)) => {
                        let p50 = percentile(&v, 0.5);
                        if rt == "crun" {
                            crun_p50 = Some(p50);
                        }
                        pline(
                            &mut lines,
                            format!(
                                "raw `{rt} run` spawn -> first stdout byte{}: p50 {}, p90 {}, min {}, max {} (n={})",
                                if rt == "crun" && host_is_cgroup_hybrid() {
                                    " (in `unshare -m` without /sys/fs/cgroup/unified)"
                                } else {
                                    ""
                                },
                                fmt_dur(p50),
                                fmt_dur(percentile(&v, 0.9)),
                                fmt_dur(v.first().copied().unwrap_or_default()),
                                fmt_dur(v.last().copied().unwrap_or_default()),
                                v.len()
                            ),
                        );
                    }
                    Ok(Err(e)) => {
                        pline(&mut lines, format!("raw `{rt} run`: FAILED: {e}"));
                        failed = true;
                    }
                    Err(e) => {
                        pline(&mut lines, format!("raw `{rt} run`: panicked: {e}"));
                        failed = true;
                    }
                }
            }
        }
        (None, _) => {
            pline(
                &mut lines,
                "raw crun/runc: n/a (no sandbox config.json was captured)".into(),
            );
            failed = true;
        }
        (_, Err(e)) => {
            pline(&mut lines, format!("raw crun/runc: n/a ({e})"));
            failed = true;
        }
    }
    let _ = std::fs::remove_dir_all(&raw_base);
    // The runtimes remove each container's cgroup but not the (empty) parent.
    for c in std::fs::read_dir("/sys/fs/cgroup").into_iter().flatten().flatten() {
        let _ = std::fs::remove_dir(c.path().join("opendsec-bench"));
    }
    match crun_p50 {
        Some(c) if !api.is_empty() => {
            let ratio = api_p50.as_secs_f64() / c.as_secs_f64().max(1e-9);
            pline(
                &mut lines,
                format!(
                    "{}  create->first output p50 {} = {ratio:.2}x raw crun run p50 {} (goal <= {CREATE_VS_CRUN}x)",
                    if ratio <= CREATE_VS_CRUN { "PASS" } else { "MISS" },
                    fmt_dur(api_p50),
                    fmt_dur(c)
                ),
            );
        }
        _ => pline(
            &mut lines,
            "n/a   create->first output vs raw crun (not both measured)".into(),
        ),
    }

    // 2. pause / resume.
    eprintln!("== pause and resume through the API, {} rounds", o.pause_runs);
    match pause_resume(&up, &body, o.pause_runs).await {
        Ok((p, r)) => {
            pline(
                &mut lines,
                format!(
                    "pause (POST .../pause until GET says paused): p50 {}, p90 {}; resume (until running): p50 {}, p90 {} (n={}, GET polled every 5 ms)",
                    fmt_dur(percentile(&p, 0.5)),
                    fmt_dur(percentile(&p, 0.9)),
                    fmt_dur(percentile(&r, 0.5)),
                    fmt_dur(percentile(&r, 0.9)),
                    p.len()
                ),
            );
        }
        Err(e) => {
            pline(&mut lines, format!("pause/resume: FAILED: {e}"));
            failed = true;
        }
    }

    // 3. bursts.
    let mut largest_ok = None;
    for &n in &o.bursts {
        eprintln!("== burst of {n} concurrent creates");
        match burst(&up, &o, &body, n).await {
            Ok(b) => {
                let f = b.http_errors + b.failed + b.not_settled;
                pline(
                    &mut lines,
                    format!(
                        "burst {n}: all settled in {:.1} s ({} running; failures {f} = {} HTTP errors + {} failed + {} not running after {} s); \
                         create requests answered in {:.1} s; \
                         `opendsec up` peak RSS {} (VmHWM; polled VmRSS max {}), shims+agents summed RSS at peak {} over {} sandboxes; \
                         host MemAvailable min {} MB; delete all + freed in {:.1} s{}",
                        b.settled.as_secs_f64(),
                        b.running,
                        b.http_errors,
                        b.failed,
                        b.not_settled,
                        o.burst_timeout.as_secs(),
                        b.accepted.as_secs_f64(),
                        mib(b.mem.up_hwm_kb),
                        mib(b.mem.up_rss_kb),
                        mib(b.mem.sandboxes_rss_kb),
                        b.mem.sandboxes_at_peak,
                        b.mem.min_mem_available_mb,
                        b.freed.as_secs_f64(),
                        if b.left_over > 0 {
                            format!(", {} NOT freed", b.left_over)
                        } else {
                            String::new()
                        }
                    ),
                );
                for e in b.first_errors.iter().take(3) {
                    pline(&mut lines, format!("  burst {n} error: {e}"));
                }
                if f == 0 {
                    largest_ok = Some(n);
                } else {
                    failed = true;
                }
                if b.left_over > 0 {
                    failed = true;
                    pline(
                        &mut lines,
                        format!(
                            "burst {n}: {} sandboxes not freed within 300 s; larger bursts skipped",
                            b.left_over
                        ),
                    );
                    break;
                }
                if b.not_settled > 0 {
                    pline(
                        &mut lines,
                        format!(
                            "burst {n} did not settle within {} s; larger bursts skipped (they cannot settle either)",
                            o.burst_timeout.as_secs()
                        ),
                    );
                    break;
                }
            }
            Err(e) => {
                pline(&mut lines, format!("burst {n}: FAILED: {e}"));
                failed = true;
                break;
            }
        }
    }
    pline(
        &mut lines,
        match largest_ok {
            Some(n) => format!("largest burst with 0 failures: {n}"),
            None => "no burst ran with 0 failures".into(),
        },
    );
    let up_log = up.log.clone();
    let warnings = std::fs::read_to_string(&up_log)
        .map(|s| s.lines().filter(|l| l.contains("WARN") || l.contains("ERROR")).count())
        .unwrap_or(0);
    if warnings > 0 {
        eprintln!(
            "(`opendsec up` logged {warnings} warnings/errors; last lines:\n{})",
            log_tail(&up_log, 5)
        );
    }
    // Graceful: remove whatever is left through the API first.
    if let Ok((200, v)) = up.send(reqwest::Method::GET, "/v1/sandboxes", None).await {
        for s in v["sandboxes"].as_array().into_iter().flatten() {
            if let Some(id) = s["id"].as_str() {
                let _ = up.delete(id).await;
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while !up.sandbox_dirs().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    drop(up);
    Results { lines, failed }
}

async fn pause_resume(up: &UpGuard, body: &Value, rounds: usize) -> Result<(Vec<Duration>, Vec<Duration>), String> {
    let id = up.create(body).await?;
    let r = async {
        up.wait_state(&id, "running", Duration::from_millis(20), Duration::from_secs(60))
            .await?;
        let (mut p, mut r) = (Vec::new(), Vec::new());
        let poll = Duration::from_millis(5);
        for _ in 0..rounds {
            let t0 = Instant::now();
            let (st, v) = up
                .send(
                    reqwest::Method::POST,
                    &format!("/v1/sandboxes/{id}/pause"),
                    Some(json!({})),
                )
                .await?;
            if st >= 300 {
                return Err(format!("pause: HTTP {st}: {v}"));
            }
            up.wait_state(&id, "paused", poll, Duration::from_secs(30)).await?;
            p.push(t0.elapsed());
            let t0 = Instant::now();
            let (st, v) = up
                .send(
                    reqwest::Method::POST,
                    &format!("/v1/sandboxes/{id}/resume"),
                    Some(json!({})),
                )
                .await?;
            if st >= 300 {
                return Err(format!("resume: HTTP {st}: {v}"));
            }
            up.wait_state(&id, "running", poll, Duration::from_secs(30)).await?;
            r.push(t0.elapsed());
        }
        // It still runs commands after all that.
        let (_, out) = up.exec_first_output(&id, "echo hi", Duration::from_secs(30)).await?;
        if out != "hi\n" {
            return Err(format!("exec after pause/resume printed {out:?}"));
        }
        p.sort_unstable();
        r.sort_unstable();
        Ok((p, r))
    }
    .await;
    let _ = up.delete(&id).await;
    let _ = up.wait_freed(&id, Duration::from_secs(60)).await;
    r
}

struct Burst {
    accepted: Duration,
    settled: Duration,
    running: usize,
    http_errors: usize,
    failed: usize,
    not_settled: usize,
    first_errors: Vec<String>,
    mem: MemPeak,
    freed: Duration,
    left_over: usize,
}

async fn count_state(up: &UpGuard, label: &str, state: &str) -> Result<Vec<String>, String> {
    let (st, v) = up
        .send(
            reqwest::Method::GET,
            &format!("/v1/sandboxes?label=burst%3D{label}&state={state}"),
            None,
        )
        .await?;
    if st != 200 {
        return Err(format!("list: HTTP {st}: {v}"));
    }
    Ok(v["sandboxes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["id"].as_str().map(str::to_string))
        .collect())
}

async fn burst(up: &Arc<UpGuard>, o: &Options, body: &Value, n: usize) -> Result<Burst, String> {
    let pid = up.pid().ok_or("opendsec up is not running")?;
    // Reset the peak RSS (VmHWM) of `opendsec up`.
    let _ = std::fs::write(format!("/proc/{pid}/clear_refs"), "5");
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(Mutex::new(MemPeak {
        min_mem_available_mb: u64::MAX,
        ..Default::default()
    }));
    let up_rss = Arc::new(AtomicU64::new(0));
    let watcher = {
        let (stop, peak, up_rss) = (stop.clone(), peak.clone(), up_rss.clone());
        let sdir = up.sandboxes_dir();
        std::thread::spawn(move || {
            let mut last_scan = Instant::now() - Duration::from_secs(10);
            while !stop.load(Ordering::Relaxed) {
                let rss = proc_status_kb(pid, "VmRSS:").unwrap_or(0);
                up_rss.fetch_max(rss, Ordering::Relaxed);
                let mut p = peak.lock().unwrap();
                p.up_rss_kb = p.up_rss_kb.max(rss);
                if let Some(a) = mem_available_mb() {
                    p.min_mem_available_mb = p.min_mem_available_mb.min(a);
                }
                drop(p);
                if last_scan.elapsed() > Duration::from_secs(1) {
                    last_scan = Instant::now();
                    let dirs: Vec<PathBuf> = std::fs::read_dir(&sdir)
                        .into_iter()
                        .flatten()
                        .flatten()
                        .map(|e| e.path())
                        .collect();
                    let (sum, k) = sandboxes_rss(&dirs);
                    let mut p = peak.lock().unwrap();
                    if sum > p.sandboxes_rss_kb {
                        p.sandboxes_rss_kb = sum;
                        p.sandboxes_at_peak = k;
                    }
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let label = format!("{n}-{}", std::process::id());
    let mut b = body.clone();
    b["labels"] = json!({"burst": label});
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for _ in 0..n {
        let (up, b) = (up.clone(), b.clone());
        tasks.push(tokio::spawn(async move { up.create(&b).await }));
    }
    let mut ids = Vec::new();
    let mut first_errors = Vec::new();
    let mut http_errors = 0;
    for t in tasks {
        match t.await {
            Ok(Ok(id)) => ids.push(id),
            Ok(Err(e)) => {
                http_errors += 1;
                if first_errors.len() < 3 {
                    first_errors.push(e);
                }
            }
            Err(e) => {
                http_errors += 1;
                first_errors.push(format!("task: {e}"));
            }
        }
    }
    let accepted = t0.elapsed();
    let deadline = t0 + o.burst_timeout;
    let (mut running, mut failed);
    let mut last_print = Instant::now();
    loop {
        running = count_state(up, &label, "running").await?.len();
        let f = count_state(up, &label, "failed").await?;
        failed = f.len() + count_state(up, &label, "exited").await?.len();
        if running + failed >= ids.len() || Instant::now() > deadline {
            if failed > 0
                && let Ok((200, v)) = up
                    .send(
                        reqwest::Method::GET,
                        &format!("/v1/sandboxes/{}", f.first().cloned().unwrap_or_default()),
                        None,
                    )
                    .await
            {
                first_errors.push(format!(
                    "failed sandbox: {}",
                    v.to_string().chars().take(400).collect::<String>()
                ));
            }
            break;
        }
        if last_print.elapsed() > Duration::from_secs(15) {
            last_print = Instant::now();
            eprintln!(
                "   ... {:.0} s: {running} running, {failed} failed of {}",
                t0.elapsed().as_secs_f64(),
                ids.len()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let settled = t0.elapsed();
    let not_settled = ids.len() - running - failed;
    stop.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    // One more scan with everything up (the watcher scans once a second).
    let (sum, k) = sandboxes_rss(&up.sandbox_dirs());
    let mut mem = peak.lock().unwrap().clone();
    if sum > mem.sandboxes_rss_kb {
        mem.sandboxes_rss_kb = sum;
        mem.sandboxes_at_peak = k;
    }
    mem.up_hwm_kb = proc_status_kb(pid, "VmHWM:").unwrap_or(0);
    eprintln!(
        "   settled in {:.1} s: {running} running, {failed} failed, {not_settled} not settled; deleting all",
        settled.as_secs_f64()
    );

    // Delete all (64 requests in flight), then wait until the edge has freed them.
    let t1 = Instant::now();
    let sem = Arc::new(tokio::sync::Semaphore::new(64));
    let mut tasks = Vec::new();
    for id in ids.clone() {
        let (up, sem) = (up.clone(), sem.clone());
        tasks.push(tokio::spawn(async move {
            let _p = sem.acquire().await;
            up.delete(&id).await
        }));
    }
    for t in tasks {
        if let Ok(Err(e)) = t.await {
            first_errors.push(e);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut left_over;
    loop {
        left_over = ids.iter().filter(|id| up.sandboxes_dir().join(id).exists()).count();
        if left_over == 0 || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(Burst {
        accepted,
        settled,
        running,
        http_errors,
        failed,
        not_settled,
        first_errors,
        mem,
        freed: t1.elapsed(),
        left_over,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_decodes() {
        assert_eq!(b64decode("aGkK").unwrap(), b"hi\n");
        assert_eq!(b64decode("aGk=").unwrap(), b"hi");
        assert_eq!(b64decode("").unwrap(), b"");
    }
}
