//! chronus: sessions that survive a restart of the agent's server.
//!
//! The agent runs as two processes of the same binary. PID 1 is the
//! supervisor (`opendsec-agent serve`): small, blocking, no async runtime. It
//! owns the listening socket, a duplicate of every session's stdio/PTY fds,
//! and the exit statuses of sessions whose server died; it runs the server
//! (`opendsec-agent server`) as its child. The server does all the work
//! (HTTP, processes, files). When the server dies (crash, `kill -9`, or
//! SIGHUP to the supervisor, which restarts it), the supervisor starts a
//! new one and hands it the listening socket (fd 3) and, over a
//! SOCK_SEQPACKET socketpair (fd 4), every live session: its metadata, its
//! fds (SCM_RIGHTS) and its exit status if it ended meanwhile. Output
//! produced while no server runs waits in the pipe or PTY (bounded by the
//! kernel buffer, raised to 256 KiB for pipes; the writer blocks when full).
//!
//! The protocol is one JSON message per packet, fds attached:
//! server -> supervisor: `register {pid, meta}` + fds, `close_stdin {pid}`,
//! `forget {pid}`, `state {state}` (kept for the next server: an object of
//! named parts, the start command's `readiness` and a re-keyed `access_token`,
//! which the supervisor never reads);
//! supervisor -> server: `session {pid, meta, status?}` + fds, then
//! `ready {generation, state}`, then `exited {pid, status}` as adopted
//! processes end.

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

/// The fd a server finds its listening socket on.
pub const SERVER_LISTEN_FD: RawFd = 3;
/// The fd a server finds its end of the supervisor's socketpair on.
pub const SERVER_CONTROL_FD: RawFd = 4;
/// Largest message (session metadata: a command line and its envs).
const MAX_PACKET: usize = 1 << 20;
/// Most fds one message carries (stdout, stderr, stdin; or a PTY).
const MAX_FDS: usize = 4;

// ---- packets with fds ---------------------------------------------------------

pub fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: fds has room for two descriptors.
    if unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    } < 0
    {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: socketpair returned two fresh descriptors.
    let pair = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    for fd in [&pair.0, &pair.1] {
        let size: libc::c_int = MAX_PACKET as libc::c_int * 2;
        for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
            // SAFETY: a c_int option value.
            unsafe {
                libc::setsockopt(
                    fd.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    (&size as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
        }
    }
    Ok(pair)
}

/// Sends one packet with its fds (the receiver gets duplicates).
pub fn send(sock: RawFd, msg: &Value, fds: &[RawFd]) -> io::Result<()> {
    let data = serde_json::to_vec(msg).map_err(io::Error::other)?;
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: plain arithmetic on the fd count.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) };
    let mut cbuf = vec![0u8; space as usize];
    // SAFETY: zeroed msghdr is valid; pointers below outlive the call.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    if !fds.is_empty() {
        mh.msg_control = cbuf.as_mut_ptr().cast();
        mh.msg_controllen = cbuf.len() as _;
        // SAFETY: the control buffer has CMSG_SPACE for these fds.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast(), fds.len());
        }
    }
    loop {
        // SAFETY: mh describes live buffers.
        let n = unsafe { libc::sendmsg(sock, &mh, libc::MSG_NOSIGNAL) };
        if n >= 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Receives one packet: None at the end of the connection.
pub fn recv(sock: RawFd, nonblocking: bool) -> io::Result<Option<(Value, Vec<OwnedFd>)>> {
    let mut data = vec![0u8; MAX_PACKET];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // SAFETY: plain arithmetic.
    let space = unsafe { libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) };
    let mut cbuf = vec![0u8; space as usize];
    // SAFETY: zeroed msghdr is valid; pointers below outlive the call.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf.as_mut_ptr().cast();
    mh.msg_controllen = cbuf.len() as _;
    let flags = libc::MSG_CMSG_CLOEXEC | if nonblocking { libc::MSG_DONTWAIT } else { 0 };
    let n = loop {
        // SAFETY: mh describes live buffers.
        let n = unsafe { libc::recvmsg(sock, &mut mh, flags) };
        if n >= 0 {
            break n as usize;
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            return Err(e);
        }
    };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p: *const RawFd = libc::CMSG_DATA(c).cast();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(p.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&mh, c);
        }
    }
    if n == 0 && fds.is_empty() {
        return Ok(None);
    }
    if mh.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "packet too large"));
    }
    let v = serde_json::from_slice(&data[..n]).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok(Some((v, fds)))
}

// ---- what a session is --------------------------------------------------------

/// What each fd of a session is, in the order they travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FdRole {
    Stdout,
    Stderr,
    Stdin,
    Pty,
}

/// A session as the server describes it to the supervisor, which keeps it
/// as it is and gives it back to the next server.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SessionMeta {
    pub tag: Option<String>,
    pub config: crate::process::ProcessConfig,
    pub fds: Vec<FdRole>,
}

/// A session handed to a new server.
pub struct Adopted {
    pub pid: u32,
    pub meta: SessionMeta,
    pub fds: Vec<(FdRole, OwnedFd)>,
    /// The wait status, if it ended while no server ran.
    pub status: Option<i32>,
}

// ---- the server's end -----------------------------------------------------------

/// The server's link to its supervisor.
pub struct Link {
    sock: OwnedFd,
    /// Sends are whole packets; the lock keeps them from interleaving with
    /// nothing else (packets are atomic) but orders register before forget.
    send_lock: std::sync::Mutex<()>,
    /// The state the supervisor keeps for the next server, part by part.
    state: std::sync::Mutex<serde_json::Map<String, Value>>,
}

static LINK: OnceLock<Link> = OnceLock::new();

/// The supervisor's link, when this server runs under one.
pub fn link() -> Option<&'static Link> {
    LINK.get()
}

/// The named parts of a handed-over state. A server from before the state had
/// parts saved the start command's readiness as the whole state (a SIGHUP
/// upgrade hands that over): it becomes the `readiness` part.
pub fn state_parts(state: Option<&Value>) -> serde_json::Map<String, Value> {
    match state {
        Some(Value::Object(o)) if o.contains_key("state") => {
            serde_json::Map::from_iter([("readiness".to_string(), Value::Object(o.clone()))])
        }
        Some(Value::Object(o)) => o.clone(),
        _ => serde_json::Map::new(),
    }
}

/// What the supervisor handed over at the server's start.
pub struct Handoff {
    pub generation: u64,
    pub sessions: Vec<Adopted>,
    pub state: Option<Value>,
}

/// Reads the handoff from the supervisor (blocking, before the runtime
/// starts) and installs the link.
pub fn connect(fd: RawFd) -> io::Result<Handoff> {
    crate::fdio::set_cloexec(fd)?;
    // SAFETY: the supervisor handed this fd to us to own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut sessions = Vec::new();
    let handoff = loop {
        let Some((msg, fds)) = recv(sock.as_raw_fd(), false)? else {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the supervisor closed the link during the handoff",
            ));
        };
        match msg["op"].as_str() {
            Some("session") => {
                let meta: SessionMeta = serde_json::from_value(msg["meta"].clone())
                    .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                let pid = msg["pid"].as_u64().unwrap_or(0) as u32;
                if meta.fds.len() != fds.len() || pid == 0 {
                    continue;
                }
                sessions.push(Adopted {
                    pid,
                    fds: meta.fds.iter().copied().zip(fds).collect(),
                    meta,
                    status: msg["status"].as_i64().map(|s| s as i32),
                });
            }
            Some("ready") => {
                break Handoff {
                    generation: msg["generation"].as_u64().unwrap_or(1),
                    sessions,
                    state: Some(msg["state"].clone()).filter(|s| !s.is_null()),
                };
            }
            _ => {}
        }
    };
    let _ = LINK.set(Link {
        sock,
        send_lock: std::sync::Mutex::new(()),
        state: std::sync::Mutex::new(state_parts(handoff.state.as_ref())),
    });
    Ok(handoff)
}

impl Link {
    fn send(&self, msg: Value, fds: &[RawFd]) {
        let _g = self.send_lock.lock().unwrap();
        if let Err(e) = send(self.sock.as_raw_fd(), &msg, fds) {
            eprintln!("opendsec-agent: telling the supervisor {}: {e}", msg["op"]);
        }
    }

    /// A new session: the supervisor keeps duplicates of its fds.
    pub fn register(&self, pid: u32, meta: &SessionMeta, fds: &[RawFd]) {
        self.send(json!({"op": "register", "pid": pid, "meta": meta}), fds);
    }

    /// The session's stdin was closed: the supervisor drops its duplicate
    /// too, or the process would never see the end of its input.
    pub fn close_stdin(&self, pid: u32) {
        self.send(json!({"op": "close_stdin", "pid": pid}), &[]);
    }

    /// The server reaped its own child: the supervisor keeps the status
    /// until the end has been handled (`forget`).
    pub fn exited(&self, pid: u32, status: i32) {
        self.send(json!({"op": "exited", "pid": pid, "status": status}), &[]);
    }

    /// The session ended and its end was handled: nothing to keep.
    pub fn forget(&self, pid: u32) {
        self.send(json!({"op": "forget", "pid": pid}), &[]);
    }

    /// One part of the state the next server takes over (`readiness`,
    /// `access_token`); the other parts are kept as they are.
    pub fn save_state(&self, part: &str, value: Value) {
        let mut parts = self.state.lock().unwrap();
        parts.insert(part.to_string(), value);
        self.send(json!({"op": "state", "state": Value::Object(parts.clone())}), &[]);
    }

    /// Exit statuses of adopted processes, as the supervisor reaps them.
    pub async fn exits(&'static self, mut on_exit: impl FnMut(u32, i32)) {
        let Ok(dup) = self.sock.try_clone() else {
            return;
        };
        // SAFETY: the AsyncFd owns the duplicate for the rest of its life.
        let Ok(afd) = (unsafe { tokio::io::unix::AsyncFd::register_with_interest(dup, tokio::io::Interest::READABLE) })
        else {
            return;
        };
        loop {
            let Ok(mut g) = afd.readable().await else {
                return;
            };
            match recv(afd.get_ref().as_raw_fd(), true) {
                Ok(Some((msg, _))) => {
                    if msg["op"] == "exited"
                        && let (Some(pid), Some(st)) = (msg["pid"].as_u64(), msg["status"].as_i64())
                    {
                        on_exit(pid as u32, st as i32);
                    }
                }
                Ok(None) => {
                    // The supervisor is gone: as PID 1, that ends the sandbox.
                    eprintln!("opendsec-agent: the supervisor closed the link");
                    std::process::exit(1);
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => g.clear_ready(),
                Err(e) => eprintln!("opendsec-agent: link to the supervisor: {e}"),
            }
        }
    }
}

// ---- the supervisor ------------------------------------------------------------------

struct Session {
    meta: Value,
    roles: Vec<FdRole>,
    fds: Vec<OwnedFd>,
    status: Option<i32>,
}

struct Server {
    pid: i32,
    /// None once the server closed its end (it is dying).
    control: Option<OwnedFd>,
    started: Instant,
}

struct Supervisor {
    args: Vec<String>,
    listen: OwnedFd,
    sessions: BTreeMap<u32, Session>,
    state: Value,
    server: Option<Server>,
    generation: u64,
    /// When to start the next server (after a crash loop, not at once).
    respawn_at: Option<Instant>,
    backoff: Duration,
    stopping: Option<Instant>,
}

fn log(msg: &str) {
    eprintln!("opendsec-agent[supervisor]: {msg}");
}

/// Duplicates `fd` to a number at or above 10, close-on-exec (so that
/// moving it to 3 or 4 in a child never overwrites the other one).
fn dup_high(fd: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: fcntl on a valid fd.
    let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 10) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(n) })
}

impl Supervisor {
    fn spawn_server(&mut self) {
        use std::os::unix::process::CommandExt;
        let (mine, theirs) = match socketpair() {
            Ok(p) => p,
            Err(e) => return self.retry_later(&format!("socketpair: {e}")),
        };
        let (listen, control) = match (dup_high(self.listen.as_raw_fd()), dup_high(theirs.as_raw_fd())) {
            (Ok(l), Ok(c)) => (l, c),
            (Err(e), _) | (_, Err(e)) => return self.retry_later(&format!("dup: {e}")),
        };
        drop(theirs);
        let (l, c) = (listen.as_raw_fd(), control.as_raw_fd());
        // Always the image this supervisor runs, through the kernel's link to it
        // (`/proc/self/exe` names the mapped file, not a path looked up again): sandbox
        // root can rename the agent's directory and plant a program at its path, but
        // never make the supervisor start it as the agent with the agent's socket.
        let spawn = || {
            let mut cmd = std::process::Command::new("/proc/self/exe");
            // Named as the supervisor was started, for `ps`.
            if let Some(name) = std::env::args_os().next() {
                cmd.arg0(name);
            }
            cmd.arg("server").args(&self.args);
            // SAFETY: dup2 and sigprocmask are async-signal-safe; the
            // sources are open.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::dup2(l, SERVER_LISTEN_FD) < 0 || libc::dup2(c, SERVER_CONTROL_FD) < 0 {
                        return Err(io::Error::last_os_error());
                    }
                    // The supervisor takes its signals through a signalfd with
                    // them blocked; the server (and every process it starts)
                    // must not inherit that mask.
                    let mut set: libc::sigset_t = std::mem::zeroed();
                    libc::sigemptyset(&mut set);
                    libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
                    Ok(())
                });
            }
            cmd.spawn()
        };
        let child = spawn();
        drop((listen, control));
        let child = match child {
            Ok(c) => c,
            Err(e) => return self.retry_later(&format!("starting the server: {e}")),
        };
        self.generation += 1;
        let pid = child.id() as i32;
        drop(child); // reaped by the SIGCHLD loop
        // Hand over every session, then the state.
        let sock = mine.as_raw_fd();
        let mut ok = true;
        for (pid, s) in &self.sessions {
            let mut msg = json!({"op": "session", "pid": pid, "meta": s.meta});
            if let Some(st) = s.status {
                msg["status"] = json!(st);
            }
            // The roles of the fds still held (stdin may have been closed).
            msg["meta"]["fds"] = json!(s.roles);
            let fds: Vec<RawFd> = s.fds.iter().map(|f| f.as_raw_fd()).collect();
            if let Err(e) = send(sock, &msg, &fds) {
                log(&format!("handing session {pid} over: {e}"));
                ok = false;
                break;
            }
        }
        let ready = json!({"op": "ready", "generation": self.generation, "state": self.state});
        if ok && let Err(e) = send(sock, &ready, &[]) {
            log(&format!("handing over: {e}"));
        }
        // Sessions whose end the new server now knows are its business.
        self.server = Some(Server {
            pid,
            control: Some(mine),
            started: Instant::now(),
        });
    }

    fn retry_later(&mut self, why: &str) {
        log(why);
        self.respawn_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(Duration::from_secs(2));
    }

    fn on_message(&mut self, msg: Value, fds: Vec<OwnedFd>) {
        let pid = msg["pid"].as_u64().unwrap_or(0) as u32;
        match msg["op"].as_str() {
            Some("register") => {
                let roles: Vec<FdRole> = serde_json::from_value(msg["meta"]["fds"].clone()).unwrap_or_default();
                if roles.len() != fds.len() || pid == 0 {
                    return log(&format!("session {pid}: fds do not match their roles"));
                }
                self.sessions.insert(
                    pid,
                    Session {
                        meta: msg["meta"].clone(),
                        roles,
                        fds,
                        status: None,
                    },
                );
            }
            Some("close_stdin") => {
                if let Some(s) = self.sessions.get_mut(&pid)
                    && let Some(i) = s.roles.iter().position(|r| *r == FdRole::Stdin)
                {
                    s.roles.remove(i);
                    s.fds.remove(i);
                }
            }
            Some("exited") => {
                // The server reaped its own child: if the server dies before
                // it has delivered the end, the next one still knows it.
                if let Some(s) = self.sessions.get_mut(&pid) {
                    s.status = msg["status"].as_i64().map(|v| v as i32);
                }
            }
            Some("forget") => {
                self.sessions.remove(&pid);
            }
            Some("state") => self.state = msg["state"].clone(),
            _ => {}
        }
    }

    fn reap(&mut self) {
        loop {
            let mut st = 0;
            // SAFETY: waitpid with a valid status pointer.
            let pid = unsafe { libc::waitpid(-1, &mut st, libc::WNOHANG) };
            if pid <= 0 {
                return;
            }
            if self.server.as_ref().is_some_and(|s| s.pid == pid) {
                let Some(server) = self.server.take() else {
                    continue;
                };
                // What it said before it died still counts (a session it
                // registered just before a kill -9 must be handed over).
                if let Some(c) = &server.control {
                    self.drain(c.as_raw_fd());
                }
                if self.stopping.is_some() {
                    continue;
                }
                log(&format!(
                    "the server (pid {pid}) ended with wait status {st}; starting a new one"
                ));
                if server.started.elapsed() > Duration::from_secs(2) {
                    self.backoff = Duration::from_millis(20);
                }
                self.respawn_at = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(Duration::from_secs(2));
                continue;
            }
            if let Some(s) = self.sessions.get_mut(&(pid as u32)) {
                // An adopted process: its server is not its parent.
                s.status = Some(st);
                if let Some(control) = self.server.as_ref().and_then(|s| s.control.as_ref()) {
                    let msg = json!({"op": "exited", "pid": pid, "status": st});
                    if let Err(e) = send(control.as_raw_fd(), &msg, &[]) {
                        log(&format!("telling the server that {pid} ended: {e}"));
                    }
                }
            }
        }
    }

    /// Handles every message waiting on the server's socket. False when the
    /// server has closed it.
    fn drain(&mut self, fd: RawFd) -> bool {
        loop {
            match recv(fd, true) {
                Ok(Some((msg, fds))) => self.on_message(msg, fds),
                Ok(None) => return false,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return true,
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    log(&format!("a bad message from the server: {e}"));
                }
                Err(e) => {
                    log(&format!("reading from the server: {e}"));
                    return false;
                }
            }
        }
    }

    fn stop(&mut self) {
        if self.stopping.is_some() {
            return;
        }
        self.stopping = Some(Instant::now());
        // The server forwards SIGTERM to every process and lets their end
        // events reach clients; without one, do it here.
        match &self.server {
            Some(s) => {
                // SAFETY: kill has no memory preconditions.
                unsafe { libc::kill(s.pid, libc::SIGTERM) };
            }
            None => {
                for pid in self.sessions.keys() {
                    // SAFETY: as above.
                    unsafe { libc::kill(*pid as i32, libc::SIGTERM) };
                }
            }
        }
    }
}

/// Runs the supervisor: never returns.
/// `state`: the state the first server takes over (the edge's configuration, or null).
pub fn supervise(listen: OwnedFd, args: Vec<String>, state: Value) -> ! {
    // SAFETY: signal-set manipulation on a local set.
    let sfd = unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for s in [libc::SIGCHLD, libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, s);
        }
        libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK)
    };
    if sfd < 0 {
        log(&format!("signalfd: {}", io::Error::last_os_error()));
        std::process::exit(1);
    }
    let mut sup = Supervisor {
        args,
        listen,
        sessions: BTreeMap::new(),
        state,
        server: None,
        generation: 0,
        respawn_at: None,
        backoff: Duration::from_millis(20),
        stopping: None,
    };
    sup.spawn_server();
    loop {
        if let Some(t) = sup.stopping {
            let live = sup.sessions.values().any(|s| s.status.is_none());
            if t.elapsed() > Duration::from_secs(7) || (sup.server.is_none() && !live) {
                std::process::exit(0);
            }
        } else if sup.server.is_none() && sup.respawn_at.is_some_and(|t| Instant::now() >= t) {
            sup.respawn_at = None;
            sup.spawn_server();
        }
        let mut pfds = vec![libc::pollfd {
            fd: sfd,
            events: libc::POLLIN,
            revents: 0,
        }];
        if let Some(c) = sup.server.as_ref().and_then(|s| s.control.as_ref()) {
            pfds.push(libc::pollfd {
                fd: c.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            });
        }
        let timeout = match (sup.stopping, sup.respawn_at) {
            (Some(_), _) => 100,
            (None, Some(t)) => t.saturating_duration_since(Instant::now()).as_millis() as i32 + 1,
            (None, None) => -1,
        };
        // SAFETY: pfds is a live array of pollfds.
        let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout) };
        if n < 0 {
            continue;
        }
        if pfds[0].revents & libc::POLLIN != 0 {
            let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
            // SAFETY: reading whole siginfo records into a matching struct.
            while unsafe {
                libc::read(
                    sfd,
                    (&mut info as *mut libc::signalfd_siginfo).cast(),
                    std::mem::size_of::<libc::signalfd_siginfo>(),
                )
            } > 0
            {
                match info.ssi_signo as i32 {
                    libc::SIGTERM | libc::SIGINT => sup.stop(),
                    libc::SIGHUP => {
                        if let Some(s) = &sup.server {
                            log("SIGHUP: restarting the server");
                            // SAFETY: kill has no memory preconditions.
                            unsafe { libc::kill(s.pid, libc::SIGKILL) };
                        }
                    }
                    _ => {}
                }
            }
            sup.reap();
        }
        let still_open = sup
            .server
            .as_ref()
            .and_then(|s| s.control.as_ref())
            .is_some_and(|c| pfds.len() > 1 && c.as_raw_fd() == pfds[1].fd);
        if still_open && pfds[1].revents != 0 && !sup.drain(pfds[1].fd) {
            // The server closed its end: it is dying; SIGCHLD follows.
            if let Some(s) = &mut sup.server {
                s.control = None;
            }
        }
    }
}
