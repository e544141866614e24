//! Processes started on behalf of clients: spawning as a user (pipes or a
//! PTY), fanning output out to attached clients with backpressure, a
//! bounded backlog while nobody is attached, and reaping (the agent is PID 1
//! or a child subreaper, so it reaps every zombie, not only its own).

use std::collections::{HashMap, VecDeque};
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use crate::chronus::{FdRole, SessionMeta};
use crate::connect::{Code, RpcError};
use crate::fdio::{self, Fd};
use crate::users::{self, User};

// The request messages live in the library (`requests.rs`), where the fuzz targets
// decode them too.
pub use crate::requests::{
    Input, ProcessConfig, PtySize, Selector, SelectorRequest, SendInputRequest, SendSignalRequest, StartRequest,
    StreamInputRequest, UpdateRequest, parse_signal,
};

/// Output kept for a process while no client is attached; oldest dropped.
pub const BACKLOG_LIMIT: usize = 1 << 20;
/// Capacity of a process's output pipes: what waits there while no server
/// reads (64 KiB by default; more needs no privilege up to the system's
/// pipe-max-size, and counts against the per-user pipe page budget).
const PIPE_SIZE: libc::c_int = 256 * 1024;
/// Size of one read from a process's pipe or PTY.
const CHUNK: usize = 32 * 1024;
/// Events queued per attached client before the process's reader waits.
const SUB_CAPACITY: usize = 16;
/// After a process exits, how long its output fds may stay silent (held
/// open by a background grandchild) before the end event is sent anyway.
const DRAIN_IDLE: Duration = Duration::from_millis(300);
/// How long the output and end of a process that ended with no client
/// attached wait for one to connect.
const UNCLAIMED_FOR: Duration = Duration::from_secs(60);
/// At most this many such processes are kept (the oldest goes first).
const UNCLAIMED_MAX: usize = 64;
/// The wait status reported when the real one was lost (its server died
/// between reaping the process and telling the supervisor).
const UNKNOWN_STATUS: i32 = 0xff00;

pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

// ---- events -----------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Stdout,
    Stderr,
    Pty,
}

#[derive(Debug, Clone)]
pub struct End {
    pub exit_code: i32,
    pub exited: bool,
    pub status: String,
    pub error: Option<String>,
}

#[derive(Debug, Clone)]
pub enum Ev {
    Start(u32),
    Data(Kind, Bytes),
    End(End),
}

impl Ev {
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let ev = match self {
            Ev::Start(pid) => json!({"start": {"pid": pid}}),
            Ev::Data(k, b) => {
                let key = match k {
                    Kind::Stdout => "stdout",
                    Kind::Stderr => "stderr",
                    Kind::Pty => "pty",
                };
                json!({"data": {key: crate::json::b64(b)}})
            }
            Ev::End(e) => {
                let mut end = json!({"exitCode": e.exit_code, "exited": e.exited, "status": e.status});
                if let Some(err) = &e.error {
                    end["error"] = json!(err);
                }
                json!({"end": end})
            }
        };
        json!({ "event": ev })
    }

    fn size(&self) -> usize {
        match self {
            Ev::Data(_, b) => b.len(),
            _ => 64,
        }
    }
}

pub fn keepalive_json() -> serde_json::Value {
    serde_json::json!({"event": {"keepalive": {}}})
}

fn end_from_wait_status(st: i32) -> End {
    if libc::WIFEXITED(st) {
        let c = libc::WEXITSTATUS(st);
        End {
            exit_code: c,
            exited: true,
            status: format!("exit status {c}"),
            error: None,
        }
    } else if libc::WIFSIGNALED(st) {
        let s = libc::WTERMSIG(st);
        let name = match s {
            libc::SIGHUP => "hangup".to_string(),
            libc::SIGINT => "interrupt".to_string(),
            libc::SIGQUIT => "quit".to_string(),
            libc::SIGKILL => "killed".to_string(),
            libc::SIGPIPE => "broken pipe".to_string(),
            libc::SIGTERM => "terminated".to_string(),
            libc::SIGSEGV => "segmentation fault".to_string(),
            libc::SIGABRT => "aborted".to_string(),
            n => format!("signal {n}"),
        };
        End {
            exit_code: -1,
            exited: false,
            status: format!("signal: {name}"),
            error: None,
        }
    } else {
        End {
            exit_code: -1,
            exited: false,
            status: format!("wait status {st}"),
            error: None,
        }
    }
}

// ---- processes ----------------------------------------------------------------

struct Out {
    subs: Vec<mpsc::Sender<Ev>>,
    backlog: VecDeque<Ev>,
    backlog_bytes: usize,
    ended: bool,
}

pub struct Proc {
    pub pid: u32,
    pub tag: Option<String>,
    pub config: ProcessConfig,
    stdin: tokio::sync::Mutex<Option<Arc<Fd>>>,
    pty: Option<Arc<Fd>>,
    pty_write: tokio::sync::Mutex<()>,
    out: Mutex<Out>,
    /// How it ended, once it has (for the agent's own watchers, such as the
    /// start command's readiness; clients get the end event).
    end: tokio::sync::watch::Sender<Option<End>>,
}

impl Proc {
    async fn deliver(&self, ev: Ev) {
        let subs = {
            let mut o = self.out.lock().unwrap();
            if o.subs.is_empty() {
                o.backlog_bytes += ev.size();
                o.backlog.push_back(ev);
                while o.backlog_bytes > BACKLOG_LIMIT {
                    match o.backlog.pop_front() {
                        Some(old) => o.backlog_bytes -= old.size(),
                        None => break,
                    }
                }
                return;
            }
            o.subs.clone()
        };
        let mut dead = false;
        for s in &subs {
            // Backpressure: wait for every attached client to take it.
            if s.send(ev.clone()).await.is_err() {
                dead = true;
            }
        }
        if dead {
            self.out.lock().unwrap().subs.retain(|s| !s.is_closed());
        }
    }

    pub async fn write_stdin(&self, data: &[u8]) -> Result<(), RpcError> {
        let fd = self.stdin.lock().await.clone();
        let Some(fd) = fd else {
            return Err(RpcError::new(
                Code::FailedPrecondition,
                "stdin is not open for this process",
            ));
        };
        fd.write_all(data).await.map_err(|e| RpcError::io(e, "writing stdin"))
    }

    pub async fn write_pty(&self, data: &[u8]) -> Result<(), RpcError> {
        let Some(fd) = &self.pty else {
            return Err(RpcError::new(Code::FailedPrecondition, "process has no PTY"));
        };
        let _g = self.pty_write.lock().await;
        fd.write_all(data).await.map_err(|e| RpcError::io(e, "writing pty"))
    }

    pub async fn close_stdin(&self) {
        if self.stdin.lock().await.take().is_some()
            && let Some(link) = crate::chronus::link()
        {
            link.close_stdin(self.pid);
        }
    }

    pub fn resize(&self, size: &PtySize) -> Result<(), RpcError> {
        let Some(fd) = &self.pty else {
            return Err(RpcError::new(Code::FailedPrecondition, "process has no PTY"));
        };
        let ws = winsize(size);
        // SAFETY: TIOCSWINSZ reads a winsize struct.
        if unsafe { libc::ioctl(fd.raw(), libc::TIOCSWINSZ, &ws) } < 0 {
            return Err(RpcError::io(std::io::Error::last_os_error(), "resizing pty"));
        }
        Ok(())
    }

    /// Resolves when the process has ended (and its output has been drained).
    pub async fn ended(&self) -> End {
        let mut rx = self.end.subscribe();
        loop {
            if let Some(e) = rx.borrow_and_update().clone() {
                return e;
            }
            // The sender lives in this Proc, so it outlives `rx`'s wait.
            let _ = rx.changed().await;
        }
    }

    pub fn info_json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({"config": self.config, "pid": self.pid});
        if let Some(t) = &self.tag {
            v["tag"] = serde_json::json!(t);
        }
        v
    }
}

fn winsize(s: &PtySize) -> libc::winsize {
    let clamp = |v: u32, d: u16| {
        if v == 0 { d } else { v.min(u16::MAX as u32) as u16 }
    };
    libc::winsize {
        ws_row: clamp(s.rows, 24),
        ws_col: clamp(s.cols, 80),
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

struct Activity {
    last: AtomicU64,
    in_flight: AtomicUsize,
    epoch: Instant,
}

impl Activity {
    fn touch(&self) {
        self.last
            .store(self.epoch.elapsed().as_millis() as u64, Ordering::Relaxed);
    }
    fn idle(&self) -> Duration {
        let now = self.epoch.elapsed().as_millis() as u64;
        Duration::from_millis(now.saturating_sub(self.last.load(Ordering::Relaxed)))
    }
}

/// A client attached to a process: events to send first, then live ones.
pub struct Attached {
    pub proc: Arc<Proc>,
    pub first: Vec<Ev>,
    pub rx: mpsc::Receiver<Ev>,
}

impl Attached {
    /// The client went away: output it had not received (`unsent`, then
    /// what is queued for it) goes back to the front of the process's
    /// backlog for the next client to attach.
    pub fn detach(mut self, unsent: Option<Ev>) {
        self.rx.close();
        let mut pending: Vec<Ev> = unsent.into_iter().collect();
        while let Ok(ev) = self.rx.try_recv() {
            pending.push(ev);
        }
        let mut o = self.proc.out.lock().unwrap();
        o.subs.retain(|s| !s.is_closed());
        if o.ended {
            return;
        }
        for ev in pending.into_iter().rev() {
            if let Ev::Data(..) = ev {
                if o.backlog_bytes + ev.size() > BACKLOG_LIMIT {
                    break;
                }
                o.backlog_bytes += ev.size();
                o.backlog.push_front(ev);
            }
        }
    }
}

/// An ended process nobody has seen end: it, its end, and when it ended.
type Unclaimed = (Arc<Proc>, (End, Instant));

pub struct Manager {
    table: Mutex<HashMap<u32, Arc<Proc>>>,
    /// The sandbox's own variables (`--env-file`, or the claim's: see `claim.rs`), given
    /// to every process.
    sandbox_env: std::sync::RwLock<crate::config::SandboxEnv>,
    /// The AppArmor profile stacked on every process started (see `apparmor.rs`).
    on_exec: Option<crate::apparmor::OnExec>,
    /// Where a process that names no directory starts (the image's WorkingDir), if it
    /// exists; else the user's home.
    workdir: Option<std::path::PathBuf>,
    /// Exit-status waiters by pid. Its lock is also the spawn lock: a child
    /// is registered before the reaper can collect it, and the reaper never
    /// reaps a child std's spawn() still has to wait for (failed exec).
    waiters: Mutex<HashMap<i32, oneshot::Sender<i32>>>,
    /// Processes that ended while no client was attached, with their end,
    /// kept for a while for the client that reconnects.
    unclaimed: Mutex<HashMap<u32, Unclaimed>>,
}

impl Manager {
    /// Processes that name no directory start in `workdir` (an absolute path) when it is
    /// a directory the user can enter.
    pub fn with_workdir(mut self, workdir: Option<String>) -> Manager {
        self.workdir = workdir.filter(|w| w.starts_with('/')).map(std::path::PathBuf::from);
        self
    }

    pub fn new(sandbox_env: crate::config::SandboxEnv, on_exec: Option<crate::apparmor::OnExec>) -> Manager {
        Manager {
            table: Mutex::new(HashMap::new()),
            sandbox_env: std::sync::RwLock::new(sandbox_env),
            on_exec,
            workdir: None,
            waiters: Mutex::new(HashMap::new()),
            unclaimed: Mutex::new(HashMap::new()),
        }
    }

    /// Replaces the sandbox's variables for the processes started from now on.
    pub fn set_env(&self, env: crate::config::SandboxEnv) {
        *self.sandbox_env.write().unwrap() = env;
    }

    /// Collects every exited child (ours or re-parented orphans).
    pub fn reap(&self) {
        let mut w = self.waiters.lock().unwrap();
        loop {
            let mut st = 0;
            // SAFETY: waitpid with a valid status pointer.
            let pid = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if let Some(tx) = w.remove(&pid) {
                if let Some(link) = crate::chronus::link() {
                    link.exited(pid as u32, st);
                }
                let _ = tx.send(st);
            }
        }
    }

    /// An adopted process (the supervisor's child, not ours) ended.
    pub fn adopted_exited(&self, pid: u32, status: i32) {
        if let Some(tx) = self.waiters.lock().unwrap().remove(&(pid as i32)) {
            let _ = tx.send(status);
        }
    }

    pub async fn reap_loop(self: Arc<Self>) {
        use tokio::signal::unix::{SignalKind, signal};
        let mut sig = signal(SignalKind::child()).ok();
        loop {
            self.reap();
            match &mut sig {
                Some(s) => {
                    tokio::select! {
                        _ = s.recv() => {}
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
                None => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    pub fn find(&self, sel: Option<&Selector>) -> Result<Arc<Proc>, RpcError> {
        let sel = sel.ok_or_else(|| RpcError::invalid("process selector is required"))?;
        let t = self.table.lock().unwrap();
        if let Some(pid) = sel.pid {
            return t
                .get(&pid)
                .cloned()
                .ok_or_else(|| RpcError::not_found(format!("process with pid {pid} not found")));
        }
        if let Some(tag) = &sel.tag {
            return t
                .values()
                .find(|p| p.tag.as_deref() == Some(tag))
                .cloned()
                .ok_or_else(|| RpcError::not_found(format!("process with tag {tag} not found")));
        }
        Err(RpcError::invalid("process selector needs a pid or a tag"))
    }

    pub fn find_pid(&self, pid: u32) -> Option<Arc<Proc>> {
        self.table.lock().unwrap().get(&pid).cloned()
    }

    pub fn find_tag(&self, tag: &str) -> Option<Arc<Proc>> {
        let t = self.table.lock().unwrap();
        t.values().find(|p| p.tag.as_deref() == Some(tag)).cloned()
    }

    pub fn list(&self) -> Vec<serde_json::Value> {
        let t = self.table.lock().unwrap();
        let mut v: Vec<_> = t.values().collect();
        v.sort_by_key(|p| p.pid);
        v.into_iter().map(|p| p.info_json()).collect()
    }

    pub fn pids(&self) -> Vec<u32> {
        self.table.lock().unwrap().keys().copied().collect()
    }

    /// Attaches a client to a running process: its start event, the backlog,
    /// then live output and the end event.
    pub fn attach(&self, sel: Option<&Selector>) -> Result<Attached, RpcError> {
        let p = match self.find(sel) {
            Ok(p) => p,
            Err(e) => return self.claim(sel).ok_or(e),
        };
        let mut o = p.out.lock().unwrap();
        if o.ended {
            drop(o);
            return self
                .claim(sel)
                .ok_or_else(|| RpcError::not_found(format!("process with pid {} not found", p.pid)));
        }
        let (tx, rx) = mpsc::channel(SUB_CAPACITY);
        let mut first = vec![Ev::Start(p.pid)];
        first.extend(o.backlog.drain(..));
        o.backlog_bytes = 0;
        o.subs.push(tx);
        drop(o);
        Ok(Attached { proc: p, first, rx })
    }

    /// A process that ended with nobody attached: its start, the output it
    /// left and its end, once, for the first client that asks.
    fn claim(&self, sel: Option<&Selector>) -> Option<Attached> {
        let sel = sel?;
        let (p, end) = {
            let mut u = self.unclaimed.lock().unwrap();
            let pid = match (sel.pid, &sel.tag) {
                (Some(pid), _) => pid,
                (None, Some(tag)) => u.values().find(|(p, _)| p.tag.as_deref() == Some(tag))?.0.pid,
                (None, None) => return None,
            };
            let (p, (end, _)) = u.remove(&pid)?;
            (p, end)
        };
        let mut first = vec![Ev::Start(p.pid)];
        {
            let mut o = p.out.lock().unwrap();
            first.extend(o.backlog.drain(..));
            o.backlog_bytes = 0;
        }
        first.push(Ev::End(end));
        // No live events follow: the sender is dropped at once.
        let (_, rx) = mpsc::channel(1);
        Some(Attached { proc: p, first, rx })
    }

    /// Starts a process as `user`; the returned receiver is already attached
    /// (it sees all output), and the first event is `Ev::Start`.
    pub fn start(self: &Arc<Self>, req: StartRequest, user: &User) -> Result<Attached, RpcError> {
        let cfg = req
            .process
            .ok_or_else(|| RpcError::invalid("process config is required"))?;
        if cfg.cmd.is_empty() {
            return Err(RpcError::invalid("process cmd is empty"));
        }
        let cwd = match cfg.cwd.as_deref().filter(|c| !c.is_empty()) {
            Some(c) => users::resolve_path(user, c)?,
            None => match &self.workdir {
                Some(w) if users::as_user(user, || std::fs::metadata(w).map(|m| m.is_dir())).unwrap_or(false) => {
                    w.clone()
                }
                _ => user.home.clone(),
            },
        };
        let cwd_ok = users::as_user(user, || std::fs::metadata(&cwd).map(|m| m.is_dir()));
        let cwd = match cwd_ok {
            Ok(true) => cwd,
            _ if cfg.cwd.as_deref().is_none_or(|c| c.is_empty()) => std::path::PathBuf::from("/"),
            Ok(false) => {
                return Err(RpcError::invalid(format!("cwd '{}' is not a directory", cwd.display())));
            }
            Err(e) => return Err(RpcError::io(e, &format!("cwd '{}'", cwd.display()))),
        };

        // E2B's SDKs run every command as `/bin/bash -l -c ...`; an image without bash
        // (alpine, busybox, distroless-ish) runs it with its POSIX shell, which takes the
        // same `-l -c` arguments.
        let program = if cfg.cmd == "/bin/bash"
            && !std::path::Path::new("/bin/bash").exists()
            && std::path::Path::new("/bin/sh").exists()
        {
            "/bin/sh"
        } else {
            cfg.cmd.as_str()
        };
        let mut cmd = Command::new(program);
        cmd.args(&cfg.args);
        cmd.env_clear();
        cmd.env("PATH", DEFAULT_PATH);
        cmd.env("HOME", &user.home);
        cmd.env("USER", &user.name);
        cmd.env("LOGNAME", &user.name);
        for (k, v) in self.sandbox_env.read().unwrap().iter().chain(&cfg.envs) {
            cmd.env(k, v);
        }

        let use_pty = req.pty.is_some();
        let use_stdin = req.stdin.unwrap_or(true);
        let switch = unsafe { libc::geteuid() } == 0 && user.uid != 0;
        let (uid, gid) = (user.uid, user.gid);
        let groups: Vec<libc::gid_t> = user.groups.clone();
        let cwd_c = CString::new(cwd.as_os_str().as_bytes()).map_err(|_| RpcError::invalid("cwd has a NUL byte"))?;
        let on_exec = self.on_exec.clone();
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe system calls on pre-allocated data.
        unsafe {
            cmd.pre_exec(move || {
                // A sandbox process starts with no signal blocked, whatever
                // the agent's own threads block.
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
                // Out of memory, the kernel must pick a sandbox process, never the agent
                // (PID 1, whose death ends the sandbox): raise the child's OOM score.
                // Raising needs no privilege; failing to is harmless.
                let fd = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    libc::write(fd, b"500".as_ptr().cast(), 3);
                    libc::close(fd);
                }
                // The sandbox's AppArmor profile, stacked at the exec below; while the
                // agent's profile still allows it (as root, before the user switch).
                if let Some(on_exec) = &on_exec {
                    on_exec.apply()?;
                }
                if use_pty {
                    if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::setpgid(0, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if switch
                    && (libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) < 0
                        || libc::setgid(gid) < 0
                        || libc::setuid(uid) < 0)
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::chdir(cwd_c.as_ptr()) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }

        let io_err = |e| RpcError::io(e, "setting up process io");
        let mut waiters = self.waiters.lock().unwrap();
        let mut readers: Vec<(OwnedFd, Kind)> = Vec::new();
        let mut stdin_w = None;
        let mut master = None;
        if use_pty {
            let size = req.pty.as_ref().and_then(|p| p.size.clone()).unwrap_or_default();
            let ws = winsize(&size);
            let (mut m, mut s) = (0, 0);
            // SAFETY: out-pointers are valid; winsize is read only.
            if unsafe { libc::openpty(&mut m, &mut s, std::ptr::null_mut(), std::ptr::null(), &ws) } < 0 {
                return Err(io_err(std::io::Error::last_os_error()));
            }
            // SAFETY: openpty returned two fresh descriptors.
            let (m, s) = unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
            fdio::set_cloexec(m.as_raw_fd()).map_err(io_err)?;
            fdio::set_cloexec(s.as_raw_fd()).map_err(io_err)?;
            cmd.stdin(Stdio::from(s.try_clone().map_err(io_err)?));
            cmd.stdout(Stdio::from(s.try_clone().map_err(io_err)?));
            cmd.stderr(Stdio::from(s));
            master = Some(m);
        } else {
            let (or, ow) = fdio::pipe().map_err(io_err)?;
            let (er, ew) = fdio::pipe().map_err(io_err)?;
            cmd.stdout(Stdio::from(ow));
            cmd.stderr(Stdio::from(ew));
            readers.push((or, Kind::Stdout));
            readers.push((er, Kind::Stderr));
            if use_stdin {
                let (ir, iw) = fdio::pipe().map_err(io_err)?;
                cmd.stdin(Stdio::from(ir));
                stdin_w = Some(iw);
            } else {
                cmd.stdin(Stdio::null());
            }
        }
        let child = cmd.spawn().map_err(|e| {
            let what = match &self.on_exec {
                Some(o) => format!("starting '{}' under the AppArmor profile {}", cfg.cmd, o.profile()),
                None => format!("starting '{}'", cfg.cmd),
            };
            RpcError::io(e, &what)
        })?;
        let pid = child.id();
        drop(child); // never waited on through std: the reaper collects it
        drop(cmd); // closes the child's ends of the pipes / the PTY slave
        let (exit_tx, exit_rx) = oneshot::channel();
        waiters.insert(pid as i32, exit_tx);
        drop(waiters);

        let mut fds: Vec<(FdRole, OwnedFd)> = Vec::new();
        if let Some(m) = master {
            fds.push((FdRole::Pty, m));
        }
        for (fd, kind) in readers {
            // Room for output while no server reads it (chronus restarts
            // one within milliseconds); the kernel's default where refused.
            // SAFETY: fcntl on a pipe we own.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETPIPE_SZ, PIPE_SIZE) };
            fds.push((
                if kind == Kind::Stdout {
                    FdRole::Stdout
                } else {
                    FdRole::Stderr
                },
                fd,
            ));
        }
        if let Some(w) = stdin_w {
            fds.push((FdRole::Stdin, w));
        }
        let config = ProcessConfig {
            cwd: Some(cwd.display().to_string()),
            ..cfg
        };
        if let Some(link) = crate::chronus::link() {
            let meta = SessionMeta {
                tag: req.tag.clone(),
                config: config.clone(),
                fds: fds.iter().map(|(r, _)| *r).collect(),
            };
            let raw: Vec<_> = fds.iter().map(|(_, f)| f.as_raw_fd()).collect();
            link.register(pid, &meta, &raw);
        }
        let (proc, rx) = self.track(pid, req.tag, config, fds, exit_rx, true)?;
        Ok(Attached {
            proc,
            first: vec![Ev::Start(pid)],
            rx: rx.expect("tracked with a client attached"),
        })
    }

    /// Takes over the sessions a previous server left (chronus): their
    /// output goes to their backlogs until a client connects.
    pub fn adopt(self: &Arc<Self>, sessions: Vec<crate::chronus::Adopted>) {
        for s in sessions {
            let (exit_tx, exit_rx) = oneshot::channel();
            match s.status {
                Some(st) => {
                    let _ = exit_tx.send(st);
                }
                // SAFETY: kill with signal 0 only checks that the pid exists.
                None if unsafe { libc::kill(s.pid as i32, 0) } < 0 => {
                    // Ended and reaped by the server that died, before it
                    // could tell the supervisor: the status is lost.
                    let _ = exit_tx.send(UNKNOWN_STATUS);
                }
                None => {
                    self.waiters.lock().unwrap().insert(s.pid as i32, exit_tx);
                }
            }
            let pid = s.pid;
            if let Err(e) = self.track(pid, s.meta.tag, s.meta.config, s.fds, exit_rx, false) {
                eprintln!("opendsec-agent: taking over process {pid}: {e}");
            }
        }
    }

    /// Follows a started or adopted process: its fds, its output and its end.
    fn track(
        self: &Arc<Self>,
        pid: u32,
        tag: Option<String>,
        config: ProcessConfig,
        fds: Vec<(FdRole, OwnedFd)>,
        exit_rx: oneshot::Receiver<i32>,
        attach: bool,
    ) -> Result<(Arc<Proc>, Option<mpsc::Receiver<Ev>>), RpcError> {
        let io_err = |e| RpcError::io(e, "setting up process io");
        let mut pty = None;
        let mut stdin = None;
        let mut readers: Vec<(Arc<Fd>, Kind)> = Vec::new();
        for (role, fd) in fds {
            let fd = Arc::new(Fd::new(fd).map_err(io_err)?);
            match role {
                FdRole::Pty => {
                    pty = Some(fd.clone());
                    readers.push((fd, Kind::Pty));
                }
                FdRole::Stdout => readers.push((fd, Kind::Stdout)),
                FdRole::Stderr => readers.push((fd, Kind::Stderr)),
                FdRole::Stdin => stdin = Some(fd),
            }
        }
        let (subs, rx) = if attach {
            let (tx, rx) = mpsc::channel(SUB_CAPACITY);
            (vec![tx], Some(rx))
        } else {
            (Vec::new(), None)
        };
        let proc = Arc::new(Proc {
            pid,
            tag,
            config,
            stdin: tokio::sync::Mutex::new(stdin),
            pty,
            pty_write: tokio::sync::Mutex::new(()),
            out: Mutex::new(Out {
                subs,
                backlog: VecDeque::new(),
                backlog_bytes: 0,
                ended: false,
            }),
            end: tokio::sync::watch::Sender::new(None),
        });
        self.table.lock().unwrap().insert(pid, proc.clone());

        let act = Arc::new(Activity {
            last: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            epoch: Instant::now(),
        });
        let mut handles = Vec::new();
        for (fd, kind) in readers {
            let (p, a) = (proc.clone(), act.clone());
            handles.push(tokio::spawn(async move {
                let mut buf = vec![0u8; CHUNK];
                loop {
                    let n = match fd.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => n,
                    };
                    a.in_flight.fetch_add(1, Ordering::Relaxed);
                    a.touch();
                    p.deliver(Ev::Data(kind, Bytes::copy_from_slice(&buf[..n]))).await;
                    a.touch();
                    a.in_flight.fetch_sub(1, Ordering::Relaxed);
                }
            }));
        }
        let mgr = self.clone();
        let p = proc.clone();
        tokio::spawn(async move {
            let st = exit_rx.await.unwrap_or(UNKNOWN_STATUS);
            act.touch();
            loop {
                if handles.iter().all(|h| h.is_finished()) {
                    break;
                }
                if act.in_flight.load(Ordering::Relaxed) == 0 && act.idle() > DRAIN_IDLE {
                    for h in &handles {
                        h.abort();
                    }
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            mgr.finish(&p, end_from_wait_status(st)).await;
        });
        Ok((proc, rx))
    }

    async fn finish(self: &Arc<Self>, proc: &Arc<Proc>, end: End) {
        let subs = {
            let mut o = proc.out.lock().unwrap();
            o.ended = true;
            if o.subs.is_empty() {
                // Nobody saw it end (its client's connection broke, or the
                // server restarted): the next Connect gets its output and end.
                let mut u = self.unclaimed.lock().unwrap();
                if u.len() >= UNCLAIMED_MAX
                    && let Some(oldest) = u.iter().min_by_key(|(_, (_, e))| e.1).map(|(k, _)| *k)
                {
                    u.remove(&oldest);
                }
                u.insert(proc.pid, (proc.clone(), (end.clone(), Instant::now())));
            } else {
                o.backlog.clear();
                o.backlog_bytes = 0;
            }
            std::mem::take(&mut o.subs)
        };
        self.table.lock().unwrap().remove(&proc.pid);
        proc.stdin.lock().await.take();
        proc.end.send_replace(Some(end.clone()));
        if let Some(link) = crate::chronus::link() {
            link.forget(proc.pid);
        }
        if subs.is_empty() {
            let (mgr, p) = (self.clone(), proc.clone());
            tokio::spawn(async move {
                tokio::time::sleep(UNCLAIMED_FOR).await;
                let mut u = mgr.unclaimed.lock().unwrap();
                if u.get(&p.pid).is_some_and(|(q, _)| Arc::ptr_eq(q, &p)) {
                    u.remove(&p.pid);
                }
            });
        }
        for s in subs {
            let _ = tokio::time::timeout(Duration::from_secs(60), s.send(Ev::End(end.clone()))).await;
        }
    }

    pub fn signal(&self, sel: Option<&Selector>, sig: &serde_json::Value) -> Result<(), RpcError> {
        let p = self.find(sel)?;
        let signo = parse_signal(sig)?;
        // SAFETY: kill has no memory preconditions.
        if unsafe { libc::kill(p.pid as i32, signo) } < 0 {
            return Err(RpcError::io(std::io::Error::last_os_error(), "sending signal"));
        }
        Ok(())
    }

    pub fn signal_all(&self, signo: i32) {
        for pid in self.pids() {
            // SAFETY: kill has no memory preconditions.
            unsafe { libc::kill(pid as i32, signo) };
        }
    }
}
