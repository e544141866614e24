//! `opendsec-shim`: the small detached parent of one container.
//!
//! The edge forks+execs `opendsec-shim <dir>` with a status pipe on stdout and the
//! sandbox's extra fds at 3, 4, ...; the shim double-forks and calls setsid, so it is
//! reparented to init and is not in the edge's session; it marks itself a child
//! subreaper, runs `<runtime> run --detach` (create + start) with PID 1's stdout and
//! stderr on a pipe it drains into a size-capped log, reports "ok" or the error on the
//! status pipe, then waits for PID 1 (reparented to it when the runtime exits) and
//! writes `exit.json` with the exit code, signal and whether the OOM killer ended it.
//!
//! With `--create-only` it runs `<runtime> create` instead: PID 1 then waits for the
//! edge's `<runtime> start` (a warm container, see `super::warm`). The shim works in
//! its directory by relative paths (it `chdir`s there first), so the edge may rename
//! the directory while the shim runs.
//!
//! A hung runtime never leaves a shim behind: the shim gives the runtime's `create`/`run`
//! [`RUNTIME_TIMEOUT`] (a pidfd wait; the edge waits 60 s for the status), then kills it,
//! `delete --force`s the container and reports why.

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use crate::status_pipe::{exit_of, pidfd_open, report};

use super::{ContainerError, ExitInfo, SandboxRecord, cgroup, dup_above, read_pid, write_json_atomic};

const STATUS_TIMEOUT_MS: i32 = 60_000;
/// How long `<runtime> create|run` may take before the shim ends it: shorter than the
/// edge's wait for the status, so that the edge hears why.
const RUNTIME_TIMEOUT: Duration = Duration::from_secs(50);

/// The shim's flag for a container created but not started.
pub const CREATE_ONLY: &std::ffi::CStr = c"--create-only";

/// Starts the shim for the bundle in `dir` and waits until it reports that PID 1 runs.
pub(crate) fn spawn(
    shim: &Path,
    dir: &Path,
    id: &str,
    extra_fds: &[RawFd],
    create_only: bool,
) -> Result<(), ContainerError> {
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    let shim_err = |message: String| ContainerError::Shim { id: id.into(), message };

    // Everything the child needs is prepared before fork: after fork in a threaded
    // process only async-signal-safe calls are allowed.
    let min = 3 + extra_fds.len() as RawFd + 16;
    let extras = extra_fds
        .iter()
        .map(|&fd| dup_above(fd, min))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| ContainerError::io("duplicating extra fds", e))?;
    let devnull_low = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
        .map_err(|e| ContainerError::io("/dev/null", e))?;
    let devnull = dup_above(devnull_low.as_raw_fd(), min).map_err(|e| ContainerError::io("dup", e))?;
    let (status_r, status_w_low) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| ContainerError::io("pipe", e.into()))?;
    let status_w = dup_above(status_w_low.as_raw_fd(), min).map_err(|e| ContainerError::io("dup", e))?;
    drop(devnull_low);
    // Only the shim may hold the write end, or the read below never sees EOF.
    drop(status_w_low);
    let prog = CString::new(shim.as_os_str().as_bytes()).map_err(|_| shim_err("shim path has a NUL".into()))?;
    let arg_dir = CString::new(dir.as_os_str().as_bytes()).map_err(|_| shim_err("dir has a NUL".into()))?;
    let argv = [
        prog.as_ptr(),
        arg_dir.as_ptr(),
        if create_only {
            CREATE_ONLY.as_ptr()
        } else {
            std::ptr::null()
        },
        std::ptr::null(),
    ];
    let envp = [
        c"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".as_ptr(),
        std::ptr::null(),
    ];

    // SAFETY: the child only calls dup2, sigprocmask, execve and _exit.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(ContainerError::io("fork", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        unsafe {
            let empty: libc::sigset_t = std::mem::zeroed();
            libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
            if libc::dup2(devnull.as_raw_fd(), 0) < 0
                || libc::dup2(status_w.as_raw_fd(), 1) < 0
                || libc::dup2(devnull.as_raw_fd(), 2) < 0
            {
                libc::_exit(126);
            }
            for (i, fd) in extras.iter().enumerate() {
                if libc::dup2(fd.as_raw_fd(), 3 + i as RawFd) < 0 {
                    libc::_exit(126);
                }
            }
            // Nothing else of the edge leaks into the shim (and so into the container).
            libc::syscall(
                libc::SYS_close_range,
                3 + extras.len() as libc::c_uint,
                libc::c_uint::MAX,
                0,
            );
            libc::execve(prog.as_ptr(), argv.as_ptr(), envp.as_ptr());
            libc::_exit(127);
        }
    }
    drop(status_w);
    drop(extras);
    drop(devnull);
    // The first shim process exits as soon as it has forked the detached one.
    let mut wstatus = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut wstatus, 0) };
    if libc::WIFEXITED(wstatus) && libc::WEXITSTATUS(wstatus) == 127 {
        return Err(ContainerError::Prerequisite(format!(
            "cannot execute the shim {}",
            shim.display()
        )));
    }

    let mut reader = File::from(status_r);
    let mut message = String::new();
    // The runtime normally answers in tens of milliseconds; a hung one must not hang the edge.
    let mut pfd = libc::pollfd {
        fd: reader.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polling one fd we own.
    let ready = unsafe { libc::poll(&mut pfd, 1, STATUS_TIMEOUT_MS) };
    if ready == 0 {
        return Err(shim_err(format!(
            "no status from the shim within {} s (see {}/shim.log)",
            STATUS_TIMEOUT_MS / 1000,
            dir.display()
        )));
    }
    let _ = reader.read_to_string(&mut message);
    let message = message.trim();
    if message.starts_with("ok") {
        return Ok(());
    }
    let detail = if message.is_empty() {
        let log = fs::read_to_string(dir.join("shim.log")).unwrap_or_default();
        format!("the shim exited without a status; shim.log: {}", log.trim())
    } else {
        message.trim_start_matches("error ").to_string()
    };
    Err(shim_err(detail))
}

/// The shim's `main`: never returns.
pub fn main(dir: &Path, create_only: bool) -> ! {
    // stderr goes to a file in the sandbox dir.
    crate::status_pipe::detach(&dir.join("shim.log"));
    let bundle = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    // From here on the directory is "." (it may be renamed while the shim runs).
    if let Err(e) = std::env::set_current_dir(dir) {
        report(&format!("error cannot enter {}: {e}", dir.display()));
        std::process::exit(1);
    }
    let dir = Path::new(".");
    // Orphans of the runtime (PID 1 of the container) are reparented to us.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    let _ = fs::write(dir.join("shim.pid"), std::process::id().to_string());
    let code = match run(dir, &bundle, create_only) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("opendsec-shim: {e}");
            report(&format!("error {e}"));
            1
        }
    };
    std::process::exit(code)
}

fn run(dir: &Path, bundle: &Path, create_only: bool) -> Result<(), ContainerError> {
    let bytes = fs::read(dir.join("sandbox.json")).map_err(|e| ContainerError::io("reading sandbox.json", e))?;
    let record: SandboxRecord =
        serde_json::from_slice(&bytes).map_err(|e| ContainerError::Invalid(format!("sandbox.json: {e}")))?;
    let (out_r, out_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| ContainerError::io("pipe", e.into()))?;
    let out_w2 = out_w.try_clone().map_err(|e| ContainerError::io("dup", e))?;
    let preserve = record.extra_fds.to_string();
    use std::ffi::OsStr;
    // The runtime gets absolute paths: they are resolved before any rename can happen
    // (the edge renames a warm container's directory only after `create` has returned).
    let runtime_log = bundle.join("runtime.log");
    let pid_file = bundle.join("init.pid");
    let command = if create_only { "create" } else { "run" };
    let mut args: Vec<&OsStr> = vec![OsStr::new("--log"), runtime_log.as_os_str(), OsStr::new(command)];
    if !create_only {
        args.push(OsStr::new("--detach"));
    }
    args.extend([
        OsStr::new("--bundle"),
        bundle.as_os_str(),
        OsStr::new("--pid-file"),
        pid_file.as_os_str(),
    ]);
    if record.extra_fds > 0 {
        args.extend([OsStr::new("--preserve-fds"), OsStr::new(&preserve)]);
    }
    args.push(OsStr::new(record.runtime_id()));
    // The runtime flags go before the subcommand: `--log` is a global flag.
    let mut cmd = record.runtime.command(args);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(out_w))
        .stderr(Stdio::from(out_w2))
        .current_dir(bundle);
    let mut child = cmd
        .spawn()
        .map_err(|e| ContainerError::io(format!("running {}", record.runtime.binary.display()), e))?;
    // The command owns our copies of the pipe's write end: drop it, so that EOF on
    // `out_r` means every process of the container has closed its output.
    drop(cmd);
    let Some(status) = wait_within(&mut child, RUNTIME_TIMEOUT) else {
        // A runtime that hangs (its bundle removed under it, a wedged mount) must not
        // leave this shim and itself behind forever: end it and what it made.
        let _ = child.kill();
        let _ = child.wait();
        let _ = record
            .runtime
            .command(["delete", "--force", record.runtime_id()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        return Err(ContainerError::Runtime {
            runtime: record.runtime.name(),
            command: command.into(),
            message: format!(
                "did not finish within {} s and was killed; the container was deleted: {}",
                RUNTIME_TIMEOUT.as_secs(),
                tail(&runtime_log, 2000)
            ),
        });
    };
    if !status.success() {
        let mut message = tail(&runtime_log, 2000);
        let early = drain_nonblocking(&out_r);
        if !early.is_empty() {
            message.push_str(" | ");
            message.push_str(String::from_utf8_lossy(&early).trim());
        }
        if message.contains("hybrid mode") {
            message.push_str(" (crun needs the hybrid-cgroup workaround: see Runtime::unmount_unified)");
        }
        return Err(ContainerError::Runtime {
            runtime: record.runtime.name(),
            command: command.into(),
            message,
        });
    }
    let init_pid = read_pid(&pid_file).ok_or_else(|| ContainerError::Runtime {
        runtime: record.runtime.name(),
        command: command.into(),
        message: "no pid file".into(),
    })?;
    report(&format!("ok {init_pid}"));
    // PID 1 has its own copies of the extra fds (3, 4, ...); the shim needs none.
    for fd in 3..3 + record.extra_fds as RawFd {
        // SAFETY: these fds were handed to us for the container only.
        unsafe { libc::close(fd) };
    }

    // Output is copied on its own thread so that this one reaps the runtime's exited
    // helper processes (reparented to us, the subreaper) while the container runs.
    let (log_dir, cap) = (dir.to_path_buf(), record.log_cap_bytes);
    let pump = std::thread::spawn(move || pump_output(out_r, &log_dir, cap));
    let exit = wait_for(init_pid);
    // PID 1 is gone; give the pump a moment to copy what is left in the pipe.
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while !pump.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Inside its PID namespace nothing can SIGKILL init; from outside, the edge's stop
    // does (and says why itself) or the OOM killer does, which the cgroup counts. A
    // process killed earlier for memory does not make init's own end an OOM.
    let oom = exit.1 == Some(libc::SIGKILL) && cgroup::oom_kills(&record.cgroups_path).unwrap_or(0) > 0;
    let info = ExitInfo {
        exit_code: exit.0,
        signal: exit.1,
        oom_killed: oom,
    };
    write_json_atomic(&dir.join("exit.json"), &info)
}

/// The child's exit status, or `None` if it is still running after `limit`. Waits on a
/// pidfd, so the status is taken the moment the child ends.
fn wait_within(child: &mut std::process::Child, limit: Duration) -> Option<std::process::ExitStatus> {
    if let Some(pidfd) = pidfd_open(child.id() as i32) {
        let deadline = std::time::Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let mut pfd = libc::pollfd {
                fd: pidfd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // Rounded up: poll's milliseconds never end the wait before the limit.
            let ms = left.as_micros().div_ceil(1000).min(i32::MAX as u128) as i32;
            // SAFETY: polling one fd we own.
            let n = unsafe { libc::poll(&mut pfd, 1, ms) };
            if n > 0 {
                break;
            }
            if n == 0 {
                if left.is_zero() {
                    return None;
                }
                continue;
            }
            if std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                break;
            }
        }
    }
    // Ended (or no pidfd: wait without a limit, as before).
    child.wait().ok()
}

fn tail(path: &Path, max: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    // runc/crun log JSON lines or text; keep the end, where the error is.
    let start = text.len().saturating_sub(max);
    let start = (start..text.len())
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(text.len());
    text[start..].trim().replace('\n', " | ")
}

fn drain_nonblocking(fd: &OwnedFd) -> Vec<u8> {
    // SAFETY: setting O_NONBLOCK on our own fd.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        // SAFETY: reading into a buffer we own.
        let n = unsafe { libc::read(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 || out.len() > 8192 {
            break;
        }
        out.extend_from_slice(&buf[..n as usize]);
    }
    out
}

/// Copies PID 1's output into `output.log`, rotating to `output.log.1` at `cap` bytes,
/// so the log never holds more than twice the cap, however much the sandbox prints.
fn pump_output(fd: OwnedFd, dir: &Path, cap: u64) {
    let path = dir.join("output.log");
    let rotated: PathBuf = dir.join("output.log.1");
    let open = |p: &Path| OpenOptions::new().create(true).append(true).open(p);
    let mut reader = File::from(fd);
    let Ok(mut file) = open(&path) else { return };
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
            let _ = fs::rename(&path, &rotated);
            match open(&path) {
                Ok(f) => {
                    file = f;
                    size = 0;
                }
                Err(_) => return,
            }
        }
        // A chunk larger than the cap is cut to the cap (its tail is kept).
        let chunk = &buf[n.saturating_sub(cap as usize)..n];
        if file.write_all(chunk).is_ok() {
            size += chunk.len() as u64;
        }
    }
}

/// Waits for `pid` (our child, as subreaper) and returns (exit code, signal).
fn wait_for(pid: i32) -> (i32, Option<i32>) {
    loop {
        let mut status = 0;
        // SAFETY: waiting for any child; we reap other orphans on the way.
        let got = unsafe { libc::waitpid(-1, &mut status, 0) };
        if got == pid {
            return exit_of(status);
        }
        if got < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // Not our child (should not happen): poll until it is gone.
            while unsafe { libc::kill(pid, 0) } == 0 {
                std::thread::sleep(Duration::from_millis(50));
            }
            return (-1, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::Instant;

    #[test]
    fn a_runtime_that_ends_is_seen_at_once_and_one_that_hangs_is_given_up_at_the_limit() {
        // An ending process: its status, without waiting out the limit.
        let t = Instant::now();
        let mut quick = Command::new("sh").args(["-c", "exit 3"]).spawn().unwrap();
        let status = wait_within(&mut quick, Duration::from_secs(30)).expect("it ended");
        assert_eq!(status.code(), Some(3));
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // A hanging one: `None` once the limit has passed, and it still runs (to be killed).
        let t = Instant::now();
        let mut hung = Command::new("sleep").arg("30").spawn().unwrap();
        assert!(wait_within(&mut hung, Duration::from_millis(200)).is_none());
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(200) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        assert!(hung.try_wait().unwrap().is_none(), "still running");
        hung.kill().unwrap();
        hung.wait().unwrap();
    }
}
