//! `opendsec-vm-shim`: the small detached parent of one QEMU process.
//!
//! The driver writes `launch.json` ([`Launch`]) and runs `opendsec-vm-shim <launch.json>`
//! with a status pipe on stdout. The shim forks, calls setsid and forks again, so it is
//! neither the edge's child nor in its session (a killed or restarted edge leaves VMs
//! running); it starts QEMU inside the VM's network namespace under the VM's uid, with
//! no inherited fds beyond stdio and with PDEATHSIG (QEMU never outlives its shim, so
//! nothing runs without someone draining its console); reports `ok <pid>`; copies the
//! guest console (QEMU's stdout and stderr) into `console.log`, rotated at a cap so a
//! guest printing forever cannot fill the disk; and writes `exit.json` when QEMU ends.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::status_pipe::report;

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
    let tun = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?;
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
        return Err(std::io::Error::other(format!(
            "tap name {name:?} is too long"
        )));
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
        .env(
            "PATH",
            "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        )
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            VmError::Prerequisite(format!("cannot run the VM shim {}: {e}", shim.display()))
        })?;
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
    let (out_r, out_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| VmError::io("pipe", e.into()))?;
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
    let tap_fd = tap
        .as_ref()
        .map(|f| f.as_raw_fd().to_string())
        .unwrap_or_default();
    let argv: Vec<String> = launch
        .argv
        .iter()
        .map(|a| a.replace(TAP_FD_PLACEHOLDER, &tap_fd))
        .collect();
    let (uid, gid, groups) = (launch.uid, launch.gid, launch.groups.clone());
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
    let child = command
        .spawn()
        .map_err(io_err(format!("starting {program}")))?;
    drop(command);
    drop(tap);
    let pid = child.id() as i32;
    fs::write(&launch.pid_file, pid.to_string()).map_err(io_err("writing the pid file"))?;
    report(&format!("ok {pid}"));
    let (log, cap) = (launch.console_log.clone(), launch.console_cap_bytes);
    let pump = std::thread::spawn(move || pump_output(out_r, &log, cap));
    let (exit_code, signal) = wait_for(pid);
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

/// Waits for our child `pid`; returns (exit code, signal).
fn wait_for(pid: i32) -> (i32, Option<i32>) {
    loop {
        let mut status = 0;
        // SAFETY: waiting for our own child.
        let got = unsafe { libc::waitpid(pid, &mut status, 0) };
        if got == pid {
            if libc::WIFSIGNALED(status) {
                let sig = libc::WTERMSIG(status);
                return (128 + sig, Some(sig));
            }
            return (libc::WEXITSTATUS(status), None);
        }
        if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return (-1, None);
        }
    }
}
