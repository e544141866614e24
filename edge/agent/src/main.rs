//! opendsec-agent: the in-sandbox agent. PID 1 in every sandbox; serves the
//! E2B envd protocol (Connect JSON over HTTP/1.1: `process.Process`,
//! `filesystem.Filesystem`, `/files`, `/health`) and a TCP tunnel into the
//! sandbox on one listening socket handed to it by the edge.
//!
//! `serve` runs the supervisor (PID 1, see `chronus`), which runs the same
//! binary as `server` (internal: `--listen-fd 3 --control-fd 4` plus the
//! flags below) and starts a new one, with every session, if it dies.
//!
//! Usage:
//!   opendsec-agent --envd-version      (prints the envd version it implements)
//!   opendsec-agent serve (--listen-fd N | --listen unix:/path | --listen tcp:127.0.0.1:PORT)
//!                        [--config-fd N | --access-token-file F --env-file F --start-file F
//!                         --workdir-file F --user-file F]
//!                        [--default-user NAME]
//!
//! A container's edge hands the configuration over a pipe (`--config-fd`, see
//! `config`); a VM's guest reads it from files.
//!
//! At boot, as PID 1 and before anything else, the supervisor gives an image without
//! E2B's account `user` one (`accounts`).

mod accounts;
mod apparmor;
mod chronus;
mod claim;
mod config;
mod entropy;
mod fdio;
mod files;
mod fs;
mod grow;
mod metadata;
mod process;
mod rekey;
mod server;
mod signature;
mod start;
mod tunnel;
mod users;

// The wire layer (Connect framing, protojson helpers, request messages) is the
// library's (`lib.rs`), so that the fuzz targets decode with the same code.
use opendsec_agent::{connect, json, requests};

use std::net::SocketAddr;
use std::os::fd::{FromRawFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};

/// The envd version the agent reports (as the sandbox's `envdVersion`). The
/// E2B SDK switches features on by it (`e2b/envd/versions.py`); 0.6.4 is
/// the lowest version that turns on every one of them, and the agent
/// implements each: recursive watch (0.1.4), the stdin flag (0.3.0), the
/// default user (0.4.0), CloseStdin (0.5.2), octet-stream uploads (0.5.7),
/// file metadata (0.6.2), entries in watch events (0.6.3) and
/// `allow_network_mounts` (0.6.4).
pub const ENVD_VERSION: &str = "0.6.4";

enum Listen {
    Fd(RawFd),
    Unix(PathBuf),
    Tcp(SocketAddr),
}

/// `serve` runs the supervisor (PID 1), which runs `server` as its child
/// (see `chronus`); `server` is internal to the agent.
#[derive(PartialEq)]
enum Role {
    Supervisor,
    Server,
}

struct Args {
    role: Role,
    listen: Listen,
    /// The server's end of the supervisor's socketpair.
    control_fd: Option<RawFd>,
    /// The flags the supervisor passes on to each server (all but --listen*).
    passthrough: Vec<String>,
    token_file: Option<PathBuf>,
    default_user: String,
    env_file: Option<PathBuf>,
    start_file: Option<PathBuf>,
    workdir_file: Option<PathBuf>,
    user_file: Option<PathBuf>,
    /// The pipe the configuration comes on (read by the supervisor only).
    config_fd: Option<RawFd>,
}

const USAGE: &str = "usage: opendsec-agent serve (--listen-fd N | --listen unix:/path | --listen tcp:ADDR:PORT) \
[--config-fd N | --access-token-file FILE --env-file FILE --start-file FILE --workdir-file FILE --user-file FILE] [--default-user NAME]";

fn die(msg: &str) -> ! {
    eprintln!("opendsec-agent: {msg}");
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut it = std::env::args().skip(1);
    let role = match it.next().as_deref() {
        Some("serve") => Role::Supervisor,
        Some("server") => Role::Server,
        Some("--envd-version") => {
            println!("{ENVD_VERSION}");
            std::process::exit(0)
        }
        Some("--version") => {
            println!("opendsec-agent {}", env!("CARGO_PKG_VERSION"));
            std::process::exit(0)
        }
        // A full VM's init grows its root to the disk (see `grow`).
        Some(cmd @ ("grow-partition" | "grow-fs")) => {
            let args: Vec<String> = it.collect();
            let done = match (cmd, args.as_slice()) {
                ("grow-partition", [part]) => grow::grow_partition(part),
                ("grow-fs", [mountpoint, part]) => grow::grow_fs(mountpoint, part),
                _ => die("usage: opendsec-agent grow-partition /dev/vdXN | grow-fs MOUNTPOINT /dev/vdXN"),
            };
            match done {
                Ok(what) => {
                    println!("opendsec-agent: {what}");
                    std::process::exit(0)
                }
                Err(e) => die(&e),
            }
        }
        _ => die(USAGE),
    };
    let mut listen = None;
    let mut control_fd = None;
    let mut passthrough = Vec::new();
    let mut token_file = None;
    let mut default_user = "user".to_string();
    let mut env_file = None;
    let mut start_file = None;
    let mut workdir_file = None;
    let mut user_file = None;
    let mut config_fd = None;
    while let Some(a) = it.next() {
        let (flag, inline) = match a.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f.to_string(), Some(v.to_string())),
            _ => (a.clone(), None),
        };
        let mut val = || {
            let v = inline
                .clone()
                .or_else(|| it.next())
                .unwrap_or_else(|| die(&format!("{flag} needs a value")));
            if !flag.starts_with("--listen") && flag != "--control-fd" && flag != "--config-fd" {
                passthrough.push(flag.clone());
                passthrough.push(v.clone());
            }
            v
        };
        match flag.as_str() {
            "--listen-fd" => {
                listen = Some(Listen::Fd(
                    val().parse().unwrap_or_else(|_| die("--listen-fd needs a number")),
                ))
            }
            "--listen" => {
                let v = val();
                listen = Some(if let Some(p) = v.strip_prefix("unix:") {
                    Listen::Unix(PathBuf::from(p))
                } else if let Some(a) = v.strip_prefix("tcp:") {
                    Listen::Tcp(a.parse().unwrap_or_else(|_| die("--listen tcp: needs IP:PORT")))
                } else {
                    die("--listen takes unix:/path or tcp:IP:PORT")
                });
            }
            "--control-fd" if role == Role::Server => {
                control_fd = Some(val().parse().unwrap_or_else(|_| die("--control-fd needs a number")))
            }
            "--access-token-file" => token_file = Some(PathBuf::from(val())),
            "--default-user" => default_user = val(),
            "--env-file" => env_file = Some(PathBuf::from(val())),
            "--start-file" => start_file = Some(PathBuf::from(val())),
            "--workdir-file" => workdir_file = Some(PathBuf::from(val())),
            "--user-file" => user_file = Some(PathBuf::from(val())),
            "--config-fd" if role == Role::Supervisor => {
                config_fd = Some(val().parse().unwrap_or_else(|_| die("--config-fd needs a number")))
            }
            _ => die(USAGE),
        }
    }
    Args {
        role,
        listen: listen.unwrap_or_else(|| die(USAGE)),
        control_fd,
        passthrough,
        token_file,
        default_user,
        env_file,
        start_file,
        workdir_file,
        user_file,
        config_fd,
    }
}

fn main() {
    let args = parse_args();
    // SAFETY: prctl with integer arguments.
    unsafe {
        // Same-uid sandbox processes may not ptrace the agent or open its
        // /proc/<pid>/fd, mem, environ.
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        // When not PID 1 (tests, some VMs), orphans still come to us to
        // reap: to the server, and when the server dies to the supervisor.
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    // A server is started through `/proc/self/exe` (see `chronus`), which would name
    // it `exe`: it takes the name it was given in argv[0], as `ps` shows the agent.
    if args.role == Role::Server
        && let Some(name) = std::env::args_os()
            .next()
            .and_then(|a| std::path::Path::new(&a).file_name().map(|n| n.to_os_string()))
        && let Ok(name) = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(name.as_os_str()))
    {
        // SAFETY: PR_SET_NAME reads a NUL-terminated string (truncated to 15 bytes).
        unsafe { libc::prctl(libc::PR_SET_NAME, name.as_ptr(), 0, 0, 0) };
    }
    cloexec_inherited_fds();
    // Both roles read the files: the supervisor so that a bad file stops
    // the sandbox at boot with a clear message, each server because it is
    // the one that uses them (and an upgrade may bring a new reading).
    let token = args.token_file.as_ref().map(|f| {
        let t = std::fs::read_to_string(f).unwrap_or_else(|e| die(&format!("reading {}: {e}", f.display())));
        let t = t.trim().to_string();
        if t.is_empty() {
            die("the access token file is empty");
        }
        t
    });
    let sandbox_env = match &args.env_file {
        Some(f) => config::load_env(f).unwrap_or_else(|e| die(&format!("--env-file: {e}"))),
        None => Default::default(),
    };
    let start_cmd = args
        .start_file
        .as_ref()
        .map(|f| config::load_start(f).unwrap_or_else(|e| die(&format!("--start-file: {e}"))));
    let workdir = args
        .workdir_file
        .as_ref()
        .map(|f| config::load_workdir(f).unwrap_or_else(|e| die(&format!("--workdir-file: {e}"))));
    let image_user = args
        .user_file
        .as_ref()
        .map(|f| config::load_user(f).unwrap_or_else(|e| die(&format!("--user-file: {e}"))));
    if args.role == Role::Supervisor {
        // Only as a sandbox's init: an agent started by hand or by tests on a host must
        // never edit the host's accounts. Before the configuration, so that a warm
        // container has it done before a sandbox takes it.
        if std::process::id() == 1 {
            accounts::ensure_user(std::path::Path::new("/")).log();
        }
        // The configuration from the edge becomes the first part of the state every server
        // takes over: read once, before any sandbox code runs, and never from a path.
        let state = match args.config_fd {
            Some(fd) => {
                let c = config::read_boot_config(fd).unwrap_or_else(|e| die(&e));
                config::apply_cpu_class(c.cpu_class).unwrap_or_else(|e| die(&e));
                serde_json::json!({
                    "access_token": c.access_token,
                    "boot": {
                        "env": c.env,
                        "start": c.start,
                        "apparmor_profile": c.apparmor_profile,
                        "workdir": c.workdir,
                        "user": c.user,
                        "warm": c.warm,
                    },
                })
            }
            None => serde_json::Value::Null,
        };
        let listen = bind(&args.listen).unwrap_or_else(|e| die(&format!("listen: {e}")));
        let mut server_args = vec!["--listen-fd".to_string(), chronus::SERVER_LISTEN_FD.to_string()];
        server_args.extend(["--control-fd".to_string(), chronus::SERVER_CONTROL_FD.to_string()]);
        server_args.extend(args.passthrough.iter().cloned());
        chronus::supervise(listen, server_args, state);
    }
    users::init();
    let handoff = args
        .control_fd
        .map(|fd| chronus::connect(fd).unwrap_or_else(|e| die(&format!("supervisor link: {e}"))));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(64)
        .enable_all()
        .build()
        .unwrap_or_else(|e| die(&format!("runtime: {e}")));
    rt.block_on(run(args, token, sandbox_env, start_cmd, (workdir, image_user), handoff));
}

/// The supervisor's listening socket, which every server inherits.
fn bind(listen: &Listen) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::OwnedFd;
    Ok(match listen {
        Listen::Fd(fd) => {
            fdio::set_cloexec(*fd)?;
            // SAFETY: the fd was handed to us to own.
            unsafe { OwnedFd::from_raw_fd(*fd) }
        }
        Listen::Unix(p) => {
            // Bound and listening under another name first, then renamed:
            // whoever waits for the path to appear never finds a socket
            // that is bound but not yet listening (connect: refused).
            let mut tmp = p.as_os_str().to_owned();
            tmp.push(format!(".{}.tmp", std::process::id()));
            let _ = std::fs::remove_file(&tmp);
            let l = std::os::unix::net::UnixListener::bind(&tmp)?;
            std::fs::rename(&tmp, p)?;
            l.into()
        }
        Listen::Tcp(a) => std::net::TcpListener::bind(a)?.into(),
    })
}

/// Nothing the agent inherited (the listening socket included) may reach
/// the processes it starts: mark every fd above stdio close-on-exec.
fn cloexec_inherited_fds() {
    const CLOSE_RANGE_CLOEXEC: libc::c_uint = 1 << 2;
    // SAFETY: close_range only changes fd flags here.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            3 as libc::c_uint,
            libc::c_uint::MAX,
            CLOSE_RANGE_CLOEXEC,
        )
    };
    if r == 0 {
        return;
    }
    // Kernels before 5.11: walk /proc/self/fd.
    if let Ok(rd) = std::fs::read_dir("/proc/self/fd") {
        let fds: Vec<RawFd> = rd
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        for fd in fds.into_iter().filter(|fd| *fd > 2) {
            let _ = fdio::set_cloexec(fd);
        }
    }
}

enum Listener {
    Unix(tokio::net::UnixListener),
    Tcp(tokio::net::TcpListener),
}

fn from_fd(fd: RawFd) -> std::io::Result<Listener> {
    fdio::set_cloexec(fd)?;
    let mut domain: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: out-pointers are valid for their sizes.
    if unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_DOMAIN,
            (&mut domain as *mut libc::c_int).cast(),
            &mut len,
        )
    } < 0
    {
        return Err(std::io::Error::last_os_error());
    }
    fdio::set_nonblocking(fd)?;
    // SAFETY: the fd was handed to us to own.
    Ok(if domain == libc::AF_UNIX {
        Listener::Unix(tokio::net::UnixListener::from_std(unsafe {
            std::os::unix::net::UnixListener::from_raw_fd(fd)
        })?)
    } else {
        Listener::Tcp(tokio::net::TcpListener::from_std(unsafe {
            std::net::TcpListener::from_raw_fd(fd)
        })?)
    })
}

/// The `boot` part of the supervisor's state (see `config::BootConfig`); a claim
/// rewrites it (see `claim.rs`).
#[derive(serde::Deserialize, serde::Serialize, Clone, Default)]
pub struct BootParts {
    env: config::SandboxEnv,
    start: Option<config::StartCommand>,
    #[serde(default)]
    apparmor_profile: Option<String>,
    #[serde(default)]
    workdir: Option<String>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    warm: bool,
}

async fn run(
    args: Args,
    token: Option<String>,
    sandbox_env: config::SandboxEnv,
    start_cmd: Option<config::StartCommand>,
    (workdir, image_user): (Option<String>, Option<String>),
    handoff: Option<chronus::Handoff>,
) {
    let listener = match &args.listen {
        Listen::Fd(fd) => from_fd(*fd),
        Listen::Unix(p) => {
            let _ = std::fs::remove_file(p);
            tokio::net::UnixListener::bind(p).map(Listener::Unix)
        }
        Listen::Tcp(a) => tokio::net::TcpListener::bind(a).await.map(Listener::Tcp),
    }
    .unwrap_or_else(|e| die(&format!("listen: {e}")));

    let mut saved = chronus::state_parts(handoff.as_ref().and_then(|h| h.state.as_ref()));
    // The edge's configuration, which the supervisor read from its pipe at boot.
    let boot = match saved.remove("boot") {
        Some(boot) => serde_json::from_value(boot).unwrap_or_else(|e| die(&format!("boot state: {e}"))),
        None => BootParts {
            env: sandbox_env,
            start: start_cmd,
            workdir,
            user: image_user,
            ..BootParts::default()
        },
    };
    let image_user = boot.user.clone();
    let default_user = config::default_user(
        image_user.as_deref(),
        &args.default_user,
        |u| users::lookup(u).is_some(),
        users::name_of_uid,
    );
    let on_exec = apparmor::OnExec::new(boot.apparmor_profile.as_deref());
    let procs = Arc::new(process::Manager::new(boot.env.clone(), on_exec).with_workdir(boot.workdir.clone()));
    tokio::spawn(procs.clone().reap_loop());
    // A token given by `rekey` to an earlier server outranks the file's, and so does the
    // one the first server read: it read the file at boot, before any sandbox code ran,
    // so a later server never takes a token that sandbox root planted at that path.
    let token = match saved.remove("access_token") {
        Some(serde_json::Value::String(t)) => Some(t),
        _ => {
            if let (Some(link), Some(t)) = (chronus::link(), &token) {
                link.save_state("access_token", serde_json::json!(t));
            }
            token
        }
    };
    let readiness = match handoff {
        // A restarted server: take over the sessions and the start
        // command's readiness; the start command runs already.
        Some(h) if h.generation > 1 => {
            procs.adopt(h.sessions);
            start::resume(&procs, saved.remove("readiness"))
        }
        _ => match boot.start.clone() {
            Some(c) => start::boot(&procs, c, &default_user, (!boot.warm).then_some(&boot.env)),
            None => start::ready(),
        },
    };
    if let Some(link) = chronus::link() {
        let p = procs.clone();
        tokio::spawn(link.exits(move |pid, st| p.adopted_exited(pid, st)));
    }
    let state = Arc::new(server::State {
        procs: procs.clone(),
        watchers: fs::Watchers::default(),
        token: rekey::AccessToken::new(token),
        claim: claim::Pending::new(boot),
        default_user,
        readiness,
    });

    // SIGTERM (and SIGINT): forward to the processes, give them a moment, exit.
    let p2 = procs.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
            return;
        };
        tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
        p2.signal_all(libc::SIGTERM);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !p2.pids().is_empty() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Let the end events reach attached clients.
        tokio::time::sleep(Duration::from_millis(200)).await;
        std::process::exit(0);
    });

    loop {
        match &listener {
            Listener::Unix(l) => match l.accept().await {
                Ok((s, _)) => serve(state.clone(), s),
                Err(e) => accept_error(e).await,
            },
            Listener::Tcp(l) => match l.accept().await {
                Ok((s, _)) => {
                    let _ = s.set_nodelay(true);
                    serve(state.clone(), s)
                }
                Err(e) => accept_error(e).await,
            },
        }
    }
}

async fn accept_error(e: std::io::Error) {
    eprintln!("opendsec-agent: accept: {e}");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

fn serve<S>(state: Arc<server::State>, s: S)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + std::os::fd::AsFd + Unpin + Send + 'static,
{
    let conn = Arc::new(server::ConnFd(s.as_fd().try_clone_to_owned().ok()));
    tokio::spawn(async move {
        let svc = hyper::service::service_fn(move |req| server::handle(state.clone(), conn.clone(), req));
        let _ = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .keep_alive(true)
            .serve_connection(TokioIo::new(s), svc)
            .with_upgrades()
            .await;
    });
}
