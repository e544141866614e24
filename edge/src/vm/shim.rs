//! `opendsec-vm-shim`: the small detached parent of one QEMU process.
//!
//! The driver writes `launch.json` ([`Launch`]) and runs `opendsec-vm-shim <launch.json>`
//! with a status pipe on stdout. The shim forks, calls setsid and forks again, so it is
//! neither the edge's child nor in its session (a killed or restarted edge leaves VMs
//! running); it starts QEMU inside the VM's network namespace and cgroup under the VM's
//! uid, with no inherited fds beyond stdio and with PDEATHSIG (QEMU never outlives its shim, so
//! nothing runs without someone draining its console); reports `ok <pid>`; copies the
//! guest console (QEMU's stdout and stderr) into `console.log`, rotated at a cap so a
//! guest printing forever cannot fill the disk; and writes `exit.json` when QEMU ends.
//!
//! A VMM that changes its own uid (Firecracker's jailer drops to the VM's uid before it
//! execs Firecracker) loses PDEATHSIG with that change, so for it ([`Launch::keeper`])
//! the shim starts a *keeper* first: a child of the shim that is PID 1 of a new PID
//! namespace, stays root and keeps PDEATHSIG=SIGKILL, and starts the VMM as its own
//! child. When the shim dies, the kernel kills the keeper, and with the init of a PID
//! namespace every process in it: the VMM cannot outlive its shim either.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::status_pipe::{exit_of, report};

use serde::{Deserialize, Serialize};

use super::{VmError, io_err, write_json_atomic};

/// How the shim starts QEMU.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Launch {
    /// argv[0] is the QEMU binary.
    pub argv: Vec<String>,
    /// The uid, gid and supplementary groups QEMU runs as (uid 0: stay root).
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    /// The network namespace QEMU runs in.
    pub netns: Option<PathBuf>,
    /// A tap device (in that namespace) the shim opens for QEMU; its fd number replaces
    /// [`TAP_FD_PLACEHOLDER`] in `argv`. QEMU itself never opens `/dev/net/tun`.
    pub tap: Option<String>,
    pub workdir: PathBuf,
    pub console_log: PathBuf,
    pub console_cap_bytes: u64,
    pub pid_file: PathBuf,
    pub exit_file: PathBuf,
    /// Start the VMM under a keeper in a PID namespace of its own (see the module doc):
    /// for a VMM that drops privileges itself.
    #[serde(default)]
    pub keeper: bool,
    /// The directories of the cgroup the VMM runs in (one per hierarchy): it joins them
    /// before it drops privileges and before it execs, so all of its life is inside.
    #[serde(default)]
    pub cgroups: Vec<PathBuf>,
}

/// How QEMU ended, as the shim saw it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitInfo {
    /// The QEMU process this is about (each run of a VM has its own).
    pub pid: i32,
    /// The exit code, or 128 + signal.
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub ended_unix_ms: u64,
}

const STATUS_TIMEOUT: Duration = Duration::from_secs(30);

/// Stands for the tap's fd number in [`Launch::argv`].
pub const TAP_FD_PLACEHOLDER: &str = "@TAP_FD@";

/// `_IOW('T', 202, int)`.
const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
const IFF_TAP: libc::c_short = 0x0002;
const IFF_NO_PI: libc::c_short = 0x1000;
const IFF_VNET_HDR: libc::c_short = 0x4000;

/// Attaches to tap `name` of the current network namespace; the fd is inherited by
/// the next exec (not close-on-exec).
fn open_tap(name: &str) -> std::io::Result<OwnedFd> {
    let tun = OpenOptions::new().read(true).write(true).open("/dev/net/tun")?;
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let mut req = IfReq {
        name: [0; 16],
        flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR,
        _pad: [0; 22],
    };
    if name.len() >= req.name.len() {
        return Err(std::io::Error::other(format!("tap name {name:?} is too long")));
    }
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads a struct ifreq, which IfReq lays out.
    if unsafe { libc::ioctl(tun.as_raw_fd(), TUNSETIFF as _, &mut req) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let fd = OwnedFd::from(tun);
    // SAFETY: clearing FD_CLOEXEC on an fd we own.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// Runs the shim for `launch_file` and returns QEMU's pid once it has started.
pub(crate) fn spawn(shim: &Path, launch_file: &Path) -> Result<i32, VmError> {
    let mut child = Command::new(shim)
        .arg(launch_file)
        .env_clear()
        .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| VmError::Prerequisite(format!("cannot run the VM shim {}: {e}", shim.display())))?;
    let mut stdout = child.stdout.take().expect("piped");
    // The first shim process exits as soon as it has forked the detached one.
    let _ = child.wait();
    let mut pfd = libc::pollfd {
        fd: stdout.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polling one fd we own.
    let ready = unsafe { libc::poll(&mut pfd, 1, STATUS_TIMEOUT.as_millis() as i32) };
    let mut message = String::new();
    if ready > 0 {
        let _ = (&mut stdout).take(4096).read_to_string(&mut message);
    }
    let message = message.trim();
    if let Some(pid) = message.strip_prefix("ok ") {
        return pid
            .parse()
            .map_err(|_| VmError::Prerequisite(format!("the VM shim said {message:?}")));
    }
    let detail = if message.is_empty() {
        "the VM shim exited without a status".to_string()
    } else {
        message.trim_start_matches("error ").to_string()
    };
    Err(VmError::Prerequisite(format!("starting QEMU: {detail}")))
}

/// The shim's `main`: never returns.
pub fn main(launch_file: &Path) -> ! {
    let launch: Launch = match fs::read(launch_file)
        .map_err(|e| e.to_string())
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
    {
        Ok(l) => l,
        Err(e) => {
            report(&format!("error reading {}: {e}", launch_file.display()));
            std::process::exit(1)
        }
    };
    // stderr goes to a file beside the console.
    crate::status_pipe::detach(&launch.workdir.join("shim.log"));
    match run(&launch) {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("opendsec-vm-shim: {e}");
            report(&format!("error {e}"));
            std::process::exit(1)
        }
    }
}

fn run(launch: &Launch) -> Result<(), VmError> {
    let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| VmError::io("pipe", e.into()))?;
    let out_w2 = out_w.try_clone().map_err(io_err("dup"))?;
    // The whole shim (one thread so far) moves into the VM's namespace: the tap is
    // found there, and QEMU, started from here, lives there.
    if let Some(path) = &launch.netns {
        let ns = File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
        // SAFETY: setns on an fd we own, in a single-threaded process.
        if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(VmError::io(
                format!("entering {}", path.display()),
                std::io::Error::last_os_error(),
            ));
        }
    }
    let tap = match &launch.tap {
        Some(name) => Some(open_tap(name).map_err(io_err(format!("opening tap {name}")))?),
        None => None,
    };
    let tap_fd = tap.as_ref().map(|f| f.as_raw_fd().to_string()).unwrap_or_default();
    let argv: Vec<String> = launch
        .argv
        .iter()
        .map(|a| a.replace(TAP_FD_PLACEHOLDER, &tap_fd))
        .collect();
    let (uid, gid, groups) = (launch.uid, launch.gid, launch.groups.clone());
    // Opened here, written in the child: "0" moves the writer itself (v1 and v2 alike).
    let cgroup_procs = launch
        .cgroups
        .iter()
        .map(|dir| {
            let procs = dir.join("cgroup.procs");
            OpenOptions::new()
                .write(true)
                .open(&procs)
                .map(OwnedFd::from)
                .map_err(io_err(format!("opening {}", procs.display())))
        })
        .collect::<Result<Vec<OwnedFd>, VmError>>()?;
    let join_fds: Vec<i32> = cgroup_procs.iter().map(|fd| fd.as_raw_fd()).collect();
    let (program, args) = argv
        .split_first()
        .ok_or_else(|| VmError::Invalid("empty argv".into()))?;
    let mut command = Command::new(program);
    command
        .args(args)
        .current_dir(&launch.workdir)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::from(out_w))
        .stderr(Stdio::from(out_w2));
    // SAFETY: only async-signal-safe syscalls between fork and exec.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Into the VM's cgroup while still root (the files are root's).
            for &fd in &join_fds {
                if libc::write(fd, c"0".as_ptr().cast(), 1) != 1 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            if uid != 0 {
                if libc::setgroups(groups.len(), groups.as_ptr()) != 0
                    || libc::setresgid(gid, gid, gid) != 0
                    || libc::setresuid(uid, uid, uid) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                // PDEATHSIG is cleared by a uid change: set it again.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let kept = if launch.keeper {
        spawn_kept(&mut command, program)?
    } else {
        let child = command.spawn().map_err(io_err(format!("starting {program}")))?;
        Kept {
            vmm: child.id() as i32,
            keeper: None,
        }
    };
    drop(command);
    drop(tap);
    drop(cgroup_procs);
    let pid = kept.vmm;
    fs::write(&launch.pid_file, pid.to_string()).map_err(io_err("writing the pid file"))?;
    report(&format!("ok {pid}"));
    let (log, cap) = (launch.console_log.clone(), launch.console_cap_bytes);
    let pump = std::thread::spawn(move || pump_output(out_r, &log, cap));
    let (exit_code, signal) = kept.wait();
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !pump.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let ended_unix_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0);
    write_json_atomic(
        &launch.exit_file,
        &ExitInfo {
            pid,
            exit_code,
            signal,
            ended_unix_ms,
        },
    )
}

/// Copies QEMU's output into `path`, rotating to `path.1` at `cap` bytes.
fn pump_output(fd: OwnedFd, path: &Path, cap: u64) {
    let rotated = path.with_extension("log.1");
    let open = |p: &Path| OpenOptions::new().create(true).append(true).open(p);
    let mut reader = File::from(fd);
    let Ok(mut file) = open(path) else { return };
    let mut size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        };
        if size + n as u64 > cap.max(1) {
            let _ = fs::rename(path, &rotated);
            match open(path) {
                Ok(f) => {
                    file = f;
                    size = 0;
                }
                Err(_) => return,
            }
        }
        let chunk = &buf[n.saturating_sub(cap as usize)..n];
        if file.write_all(chunk).is_ok() {
            size += chunk.len() as u64;
        }
    }
}

/// The VMM the shim started, and the keeper between them if there is one.
struct Kept {
    /// The VMM's pid (as this shim's PID namespace sees it).
    vmm: i32,
    /// The keeper's pid, and the pipe on which it reports.
    keeper: Option<(i32, File)>,
}

impl Kept {
    /// Waits until the VMM has ended; returns its (exit code, signal).
    fn wait(self) -> (i32, Option<i32>) {
        let Some((keeper, mut reports)) = self.keeper else {
            return wait_for(self.vmm);
        };
        let ended = wait_for(keeper);
        // The keeper's last words are how the VMM ended; without them (the keeper was
        // killed), its own end is all there is.
        let mut rest = String::new();
        let _ = reports.read_to_string(&mut rest);
        rest.lines()
            .find_map(|l| {
                let mut w = l.strip_prefix("exit ")?.split(' ');
                let code = w.next()?.parse().ok()?;
                let signal = w.next()?.parse().ok().filter(|s: &i32| *s > 0);
                Some((code, signal))
            })
            .unwrap_or(ended)
    }
}

/// Starts `command` under a keeper (see the module doc) and returns once the command
/// has started, or why it could not. The shim must still be single-threaded.
fn spawn_kept(command: &mut Command, program: &str) -> Result<Kept, VmError> {
    let pipe = || nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| VmError::io("pipe", e.into()));
    let (reports_r, reports_w) = pipe()?;
    // Held open by this shim alone: the keeper sees it closed once the shim is gone.
    let (life_r, life_w) = pipe()?;
    // SAFETY: clone without a new stack is fork (into a new PID namespace); this process
    // has one thread, so the child may run ordinary code.
    let pid = unsafe {
        libc::syscall(
            libc::SYS_clone,
            (libc::CLONE_NEWPID | libc::SIGCHLD) as libc::c_ulong,
            0usize,
            0usize,
            0usize,
            0usize,
        )
    };
    if pid < 0 {
        return Err(VmError::io(
            "starting the keeper (clone into a new PID namespace)",
            std::io::Error::last_os_error(),
        ));
    }
    if pid == 0 {
        drop(reports_r);
        drop(life_w);
        keeper_main(command, program, life_r, reports_w)
    }
    let keeper = pid as i32;
    drop(reports_w);
    drop(life_r);
    // The write end lives as long as this shim: leaked on purpose (close-on-exec).
    std::mem::forget(life_w);
    let mut reports = File::from(reports_r);
    let mut first = Vec::new();
    let mut byte = [0u8; 1];
    while reports.read(&mut byte).map(|n| n == 1).unwrap_or(false) && byte[0] != b'\n' {
        first.push(byte[0]);
    }
    let first = String::from_utf8_lossy(&first).into_owned();
    if first != "ok" {
        let _ = wait_for(keeper);
        let why = first
            .strip_prefix("error ")
            .unwrap_or("the keeper ended without a word");
        return Err(VmError::io(
            format!("starting {program} under the keeper"),
            std::io::Error::other(why.to_string()),
        ));
    }
    // The keeper's only child is the VMM.
    let vmm = children_of(keeper).into_iter().next().ok_or_else(|| {
        VmError::io(
            format!("finding {program} under the keeper {keeper}"),
            std::io::Error::other("it has no child"),
        )
    })?;
    Ok(Kept {
        vmm,
        keeper: Some((keeper, reports)),
    })
}

/// The keeper: PID 1 of its namespace. Never returns.
fn keeper_main(command: &mut Command, program: &str, life: OwnedFd, reports: OwnedFd) -> ! {
    let mut reports = File::from(reports);
    // Fd 1 is still the edge's status pipe, which the shim alone answers and closes.
    if let Ok(null) = OpenOptions::new().write(true).open("/dev/null") {
        // SAFETY: dup2 onto fd 1.
        unsafe { libc::dup2(null.as_raw_fd(), 1) };
    }
    // SAFETY: plain syscalls on this process and an fd it owns.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
            let _ = writeln!(reports, "error PR_SET_PDEATHSIG: {}", std::io::Error::last_os_error());
            libc::_exit(1);
        }
        // The shim may have died before PDEATHSIG was set: then no writer is left.
        let mut pfd = libc::pollfd {
            fd: life.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        if libc::poll(&mut pfd, 1, 0) != 0 {
            libc::_exit(1);
        }
    }
    let child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = writeln!(reports, "error starting {program}: {e}");
            // SAFETY: ending this process.
            unsafe { libc::_exit(1) }
        }
    };
    let vmm = child.id() as i32;
    // Drop our copies of the console pipe: the shim sees its end when the VMM's ends.
    command.stdout(Stdio::null()).stderr(Stdio::null());
    let _ = writeln!(reports, "ok");
    // As PID 1, reap whatever ends in the namespace; the VMM's end is the keeper's.
    loop {
        let mut status = 0;
        // SAFETY: waiting for our own children.
        let got = unsafe { libc::waitpid(-1, &mut status, 0) };
        if got == vmm {
            let (code, signal) = exit_of(status);
            let _ = writeln!(reports, "exit {code} {}", signal.unwrap_or(0));
            break;
        }
        if got < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            break;
        }
    }
    // SAFETY: ending this process (and with it the namespace).
    unsafe { libc::_exit(0) }
}

/// The pids whose parent is `pid`.
fn children_of(pid: i32) -> Vec<i32> {
    let mut found = Vec::new();
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(n) = entry.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(stat) = fs::read_to_string(format!("/proc/{n}/stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<i32>().ok());
        if ppid == Some(pid) {
            found.push(n);
        }
    }
    found
}

/// Waits for our child `pid`; returns (exit code, signal).
fn wait_for(pid: i32) -> (i32, Option<i32>) {
    loop {
        let mut status = 0;
        // SAFETY: waiting for our own child.
        let got = unsafe { libc::waitpid(pid, &mut status, 0) };
        if got == pid {
            return exit_of(status);
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return (-1, None);
        }
    }
}
