//! Test harness: starts the real agent binary on a Unix socket in a temp dir
//! and talks Connect JSON to it with a small hyper client.
#![allow(dead_code)]

use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use bytes::{Buf, Bytes, BytesMut};
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

pub type ReqBody = BoxBody<Bytes, std::convert::Infallible>;

pub const TEST_USER: &str = "odagent-test";

pub fn is_root() -> bool {
    unsafe { libc::geteuid() == 0 }
}

/// The test user, created once. Tests of per-user behaviour need root and `useradd`
/// (Debian's `passwd`, which `./ops/test.sh` installs): without them such a test fails
/// and says so, it never passes unchecked.
pub fn test_user() -> &'static str {
    static CREATED: std::sync::OnceLock<Result<(), String>> = std::sync::OnceLock::new();
    let created = CREATED.get_or_init(|| {
        if !is_root() {
            return Err(
                "this test switches to another user, so it needs root: run it as root (./ops/test.sh does)".into(),
            );
        }
        let exists = std::fs::read_to_string("/etc/passwd")
            .map(|p| p.lines().any(|l| l.starts_with(&format!("{TEST_USER}:"))))
            .unwrap_or(false);
        if !exists {
            let out = Command::new("useradd")
                .args(["-m", "-d", &format!("/home/{TEST_USER}"), "-s", "/bin/sh", TEST_USER])
                .stdin(Stdio::null())
                .output()
                .map_err(|e| format!("cannot run useradd ({e}): apt-get install passwd (./ops/test.sh installs it)"))?;
            if !out.status.success() {
                return Err(format!(
                    "useradd {TEST_USER} failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        let home = format!("/home/{TEST_USER}");
        std::fs::create_dir_all(&home).map_err(|e| format!("cannot create {home}: {e}"))?;
        let chown = Command::new("chown")
            .args([&format!("{TEST_USER}:"), &home])
            .status()
            .map_err(|e| format!("cannot run chown: {e}"))?;
        if !chown.success() {
            return Err(format!("chown {TEST_USER}: {home} failed ({chown})"));
        }
        Ok(())
    });
    if let Err(why) = created {
        panic!("the test user {TEST_USER} is not available: {why}");
    }
    TEST_USER
}

pub fn basic(user: &str) -> String {
    format!(
        "Basic {}",
        base64::engine::general_purpose::STANDARD.encode(format!("{user}:"))
    )
}

pub fn b64(s: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

pub fn unb64(s: &str) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(s).unwrap()
}

/// `opendsec-agent serve` with root as the default user (the host has no
/// `user`), without a listen address.
pub fn agent_command() -> Command {
    agent_command_of(Path::new(env!("CARGO_BIN_EXE_opendsec-agent")))
}

/// As [`agent_command`], running the agent binary at `exe`.
pub fn agent_command_of(exe: &Path) -> Command {
    let mut cmd = Command::new(exe);
    cmd.args(["serve", "--default-user", "root"]);
    cmd
}

pub struct Agent {
    pub child: Child,
    pub dir: tempfile::TempDir,
    pub sock: PathBuf,
    pub token: Option<String>,
    /// Headers added to every request (the access token, a user).
    pub user: Option<String>,
}

impl Drop for Agent {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- agent stderr ---\n{}", self.stderr());
        }
        // Already reaped (a test waited for it): its pid may belong to
        // another process by now.
        if let Ok(Some(_)) = self.child.try_wait() {
            return;
        }
        // SIGTERM first: the agent forwards it to its processes and exits.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    pub async fn start() -> Agent {
        Self::start_with(None).await
    }

    pub async fn start_with(token: Option<&str>) -> Agent {
        Self::start_args(token, &[]).await
    }

    /// Starts the agent with `extra` arguments after the usual ones; `{dir}`
    /// in an argument stands for the agent's temporary directory.
    pub async fn start_args(token: Option<&str>, extra: &[&str]) -> Agent {
        let dir = tempfile::tempdir().unwrap();
        Self::start_in(dir, token, extra, |_| {}).await
    }

    /// As `start_args`, in a directory prepared beforehand (config files).
    pub async fn start_in(
        dir: tempfile::TempDir,
        token: Option<&str>,
        extra: &[&str],
        prepare: impl FnOnce(&Path),
    ) -> Agent {
        Self::start_command(agent_command(), dir, token, extra, prepare).await
    }

    /// As `start_in`, with the command to start (see [`agent_command_of`]).
    pub async fn start_command(
        mut cmd: Command,
        dir: tempfile::TempDir,
        token: Option<&str>,
        extra: &[&str],
        prepare: impl FnOnce(&Path),
    ) -> Agent {
        prepare(dir.path());
        let sock = dir.path().join("agent.sock");
        cmd.arg("--listen").arg(format!("unix:{}", sock.display()));
        if let Some(t) = token {
            let f = dir.path().join("token");
            std::fs::write(&f, t).unwrap();
            cmd.arg("--access-token-file").arg(&f);
        }
        let d = dir.path().display().to_string();
        cmd.args(extra.iter().map(|a| a.replace("{dir}", &d)));
        // The agent's log, for tests that check what it says.
        let log = std::fs::File::create(dir.path().join("agent.stderr")).unwrap();
        cmd.stderr(log);
        let child = cmd.spawn().expect("agent binary starts");
        let agent = Agent {
            child,
            dir,
            sock,
            token: token.map(String::from),
            user: None,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            // Up means answering: 204, or 503 while a start command gets ready.
            if agent.sock.exists()
                && let Ok(r) = agent.raw("GET", "/health", &[], Bytes::new()).await
            {
                assert!(r.0 == 204 || r.0 == 503, "health: {}", r.0);
                break;
            }
            assert!(Instant::now() < deadline, "agent did not come up");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        agent
    }

    /// What the agent has written to stderr so far.
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.stderr")).unwrap_or_default()
    }

    pub fn path(&self, p: &str) -> String {
        self.dir.path().join(p).display().to_string()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub async fn send(
        &self,
        method: &str,
        uri: &str,
        headers: &[(&str, String)],
        body: ReqBody,
    ) -> hyper::Result<Response<Incoming>> {
        let stream = match tokio::net::UnixStream::connect(&self.sock).await {
            Ok(s) => s,
            Err(e) => panic!(
                "connect to agent socket: {e}; supervisor: {:?}; socket file: {:?}",
                std::fs::read_to_string(format!("/proc/{}/stat", self.pid())),
                std::fs::symlink_metadata(&self.sock).map(|m| m.file_type()),
            ),
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let mut b = Request::builder().method(method).uri(uri).header("host", "localhost");
        if let Some(t) = &self.token {
            b = b.header("x-access-token", t);
        }
        if let Some(u) = &self.user {
            b = b.header("authorization", basic(u));
        }
        for (k, v) in headers {
            b = b.header(*k, v);
        }
        sender.send_request(b.body(body).unwrap()).await
    }

    pub async fn raw(
        &self,
        method: &str,
        uri: &str,
        headers: &[(&str, String)],
        body: Bytes,
    ) -> hyper::Result<(u16, hyper::HeaderMap, Bytes)> {
        let r = self.send(method, uri, headers, Full::new(body).boxed()).await?;
        let status = r.status().as_u16();
        let h = r.headers().clone();
        let b = r.into_body().collect().await?.to_bytes();
        Ok((status, h, b))
    }

    /// A unary Connect call: (HTTP status, JSON body).
    pub async fn unary(&self, path: &str, msg: Value) -> (u16, Value) {
        let (s, _, b) = self
            .raw(
                "POST",
                path,
                &[
                    ("content-type", "application/json".into()),
                    ("connect-protocol-version", "1".into()),
                ],
                Bytes::from(msg.to_string()),
            )
            .await
            .unwrap();
        let v = if b.is_empty() {
            json!({})
        } else {
            serde_json::from_slice(&b).unwrap_or_else(|_| json!({"raw": String::from_utf8_lossy(&b)}))
        };
        (s, v)
    }

    /// A server-streaming Connect call.
    pub async fn stream(&self, path: &str, msg: Value, headers: &[(&str, String)]) -> Stream {
        let mut h = vec![
            ("content-type", "application/connect+json".to_string()),
            ("connect-protocol-version", "1".into()),
        ];
        h.extend(headers.iter().cloned());
        let r = self
            .send("POST", path, &h, Full::new(envelope(0, &msg)).boxed())
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200, "stream status");
        Stream::new(r.into_body())
    }

    /// The pid of the agent's current server (the supervisor's child that
    /// runs `opendsec-agent server`), once there is one.
    pub async fn server_pid(&self) -> u32 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(pid) = self.try_server_pid() {
                return pid;
            }
            assert!(Instant::now() < deadline, "no server process");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn try_server_pid(&self) -> Option<u32> {
        let sup = self.pid();
        for e in std::fs::read_dir("/proc").ok()?.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // pid (comm) state ppid ...: comm may hold spaces, so split after ')'.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if ppid != Some(sup) {
                continue;
            }
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if cmdline.split(|b| *b == 0).nth(1) == Some(&b"server"[..]) {
                return Some(pid);
            }
        }
        None
    }

    pub async fn rss_kib(&self) -> u64 {
        let server = self.server_pid().await;
        let s = std::fs::read_to_string(format!("/proc/{server}/status")).unwrap();
        s.lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap()
            .parse()
            .unwrap()
    }
}

pub fn envelope(flags: u8, msg: &Value) -> Bytes {
    let j = msg.to_string().into_bytes();
    let mut b = Vec::with_capacity(5 + j.len());
    b.push(flags);
    b.extend_from_slice(&(j.len() as u32).to_be_bytes());
    b.extend_from_slice(&j);
    Bytes::from(b)
}

pub struct Stream {
    body: Incoming,
    buf: BytesMut,
}

pub enum Frame {
    Msg(Value),
    End(Value),
}

impl Stream {
    pub fn new(body: Incoming) -> Stream {
        Stream {
            body,
            buf: BytesMut::new(),
        }
    }

    /// Next envelope, within 10 s.
    pub async fn next(&mut self) -> Option<Frame> {
        tokio::time::timeout(Duration::from_secs(10), self.next_inner())
            .await
            .expect("stream frame within 10 s")
    }

    async fn next_inner(&mut self) -> Option<Frame> {
        loop {
            if self.buf.len() >= 5 {
                let len = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]) as usize;
                if self.buf.len() >= 5 + len {
                    let flags = self.buf[0];
                    self.buf.advance(5);
                    let m = self.buf.split_to(len);
                    let v: Value = serde_json::from_slice(&m).unwrap();
                    return Some(if flags & 2 != 0 { Frame::End(v) } else { Frame::Msg(v) });
                }
            }
            match self.body.frame().await {
                None => return None,
                Some(Err(e)) => panic!("stream error: {e}"),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }

    /// Next process event (skipping keepalives unless `keep`), or the end frame.
    pub async fn event(&mut self) -> Value {
        loop {
            match self.next().await {
                Some(Frame::Msg(v)) => {
                    if v["event"].get("keepalive").is_some() {
                        continue;
                    }
                    return v["event"].clone();
                }
                Some(Frame::End(v)) => return json!({"_endStream": v}),
                None => return json!({"_eof": true}),
            }
        }
    }

    /// Reads a process's events to its end: (stdout, stderr, pty, end event).
    pub async fn collect(&mut self) -> (String, String, String, Value) {
        let (mut out, mut err, mut pty) = (Vec::new(), Vec::new(), Vec::new());
        loop {
            let e = self.event().await;
            if let Some(d) = e.get("data") {
                if let Some(s) = d["stdout"].as_str() {
                    out.extend(unb64(s));
                }
                if let Some(s) = d["stderr"].as_str() {
                    err.extend(unb64(s));
                }
                if let Some(s) = d["pty"].as_str() {
                    pty.extend(unb64(s));
                }
            } else if let Some(end) = e.get("end") {
                let end = end.clone();
                match self.next().await {
                    Some(Frame::End(v)) => assert_eq!(v, json!({}), "clean end of stream"),
                    other => panic!(
                        "expected end of stream, got {:?}",
                        other.map(|f| match f {
                            Frame::Msg(v) | Frame::End(v) => v,
                        })
                    ),
                }
                return (
                    String::from_utf8_lossy(&out).into(),
                    String::from_utf8_lossy(&err).into(),
                    String::from_utf8_lossy(&pty).into(),
                    end,
                );
            } else if e.get("_endStream").is_some() || e.get("_eof").is_some() {
                panic!("stream ended without an end event: {e}");
            }
        }
    }
}

pub fn start_msg(cmd: &str, args: &[&str]) -> Value {
    json!({"process": {"cmd": cmd, "args": args}, "stdin": false})
}

pub fn sh(script: &str) -> Value {
    start_msg("/bin/sh", &["-c", script])
}

pub fn exists(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

/// A loopback port nothing listens on (bound, then released).
#[allow(dead_code)] // not every test crate that shares this module needs it
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The agent, configured with `config` through a pipe, as an edge starts it.
pub async fn agent_configured(config: serde_json::Value) -> Agent {
    let mut fds = [0; 2];
    // Close-on-exec both: no other child may hold the write end (the agent reads to its end).
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    std::fs::File::from(write)
        .write_all(&serde_json::to_vec(&config).unwrap())
        .unwrap();
    let fd = read.as_raw_fd();
    let mut cmd = agent_command();
    // SAFETY: fcntl is async-signal-safe; the agent alone inherits the read end.
    unsafe {
        cmd.pre_exec(move || {
            if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let dir = tempfile::tempdir().unwrap();
    let mut a = Agent::start_command(cmd, dir, None, &["--config-fd", &fd.to_string()], |_| {}).await;
    drop(read);
    a.token = config["access_token"].as_str().map(String::from);
    a
}

/// Kills the server with SIGKILL and waits until a new one answers.
pub async fn kill_server(a: &Agent) -> u32 {
    let old = a.server_pid().await;
    unsafe { libc::kill(old as i32, libc::SIGKILL) };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let new = a.server_pid().await;
        if new != old
            && let Ok((204, _, _)) = a.raw("GET", "/health", &[], bytes::Bytes::new()).await
        {
            return new;
        }
        assert!(Instant::now() < deadline, "no new server");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
