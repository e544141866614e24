//! What a container sandbox sees of itself: lxcfs's views of `/proc` and `/sys`, bound
//! read-only over the container's own, so that `free`, `top`, `uptime` and `sysconf`
//! report the sandbox's memory limit, CPUs, load average and uptime (as a VM would),
//! not the host's.
//!
//! lxcfs (Debian's `lxcfs` package) is a FUSE file system whose files answer for the
//! process that reads them: it finds the reader's cgroups (memory limit and usage, CFS
//! quota with `--enable-cfs`, cpuset) and PID namespace (its init's start time is the
//! uptime; `--enable-loadavg` keeps a load average per cgroup). Its answers depend only
//! on the reader, so **one lxcfs serves every edge of a machine**: it is mounted at
//! [`DEFAULT_DIR`]`/mount` (`ContainerConfig::lxcfs`), and the first edge that finds no
//! live lxcfs there starts one (under a file lock, so that edges and tests starting
//! together start one). It runs detached, in a session of its own, like the shims:
//! sandboxes outlive the edge, and so must their views; a restarted edge re-uses the
//! running lxcfs. Nothing stops it.
//!
//! If lxcfs dies, its mount stays behind, dead, and reading a view fails (ENOTCONN). The
//! edge checks the mount (a `statfs` and a `stat`) before each create and each observation
//! of its sandboxes (every 500 ms); over a dead mount it starts a new lxcfs. Whenever the
//! mount is a new one (this edge or another started it), and when the edge starts, each
//! running sandbox whose views are dead gets the new views bound over them
//! ([`Lxcfs::rebind`], from inside its mount namespace): views come back within a second.
//! lxcfs is a required package: an edge without it (or without FUSE) refuses to start,
//! as one without user namespaces does, unless the operator turns the views off
//! (`opendsec edge --no-lxcfs-views`, `ContainerConfig::lxcfs = None`).
//!
//! lxcfs cannot answer the `sysinfo` system call: busybox's `free` and `uptime` read it
//! and show the host's memory (procps's `free`, `top` and `uptime`, in every Debian
//! image, read the files). And a view copied with `sendfile` (busybox's `cat`) within
//! 0.5 s of another reader's may be cut at the size FUSE cached from that read (lxcfs
//! 5.0 sets that timeout and no flag changes it); a `read` is never cut.
//!
//! `nproc`, and everything that sizes itself from the CPUs it may run on (OpenBLAS,
//! Go, `make -j$(nproc)`), reads the affinity mask, not a file: lxcfs cannot change it.
//! That is why each sandbox also gets a cpuset of its own (see [`super::cpus`]).

use std::ffi::CString;
use std::fs::{self, OpenOptions};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::ContainerError;

/// Where the edges of a machine keep their lxcfs (its mount is `mount/` inside).
pub const DEFAULT_DIR: &str = "/var/lib/opendsec/lxcfs";

/// The files bound from lxcfs into every container, at the same path inside.
/// `/sys/devices/system/cpu/online` is what glibc's `sysconf(_SC_NPROCESSORS_ONLN)`
/// (Python's `os.cpu_count()`, `getconf`) reads.
pub const VIEWS: &[&str] = &[
    "/proc/cpuinfo",
    "/proc/diskstats",
    "/proc/loadavg",
    "/proc/meminfo",
    "/proc/stat",
    "/proc/swaps",
    "/proc/uptime",
    "/sys/devices/system/cpu/online",
];

/// The flags lxcfs runs with: CPU views from the CFS quota, a load average per cgroup,
/// pidfds to follow readers' init processes.
const FLAGS: &[&str] = &["--foreground", "--enable-cfs", "--enable-loadavg", "--enable-pidfd"];

const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;
const START_TIMEOUT: Duration = Duration::from_secs(10);

/// How [`Lxcfs::ensure`] found lxcfs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// The live lxcfs this [`Lxcfs`] saw last, or (at its first call) a live one.
    Running,
    /// None was (at the first call): this call started it.
    Started,
    /// Another lxcfs than the one seen last, or a dead mount, which this call detached
    /// and replaced: running sandboxes may have dead views ([`Lxcfs::rebind`]).
    Restarted,
}

/// The machine's lxcfs, as an edge uses it.
pub struct Lxcfs {
    dir: PathBuf,
    /// One check-and-start at a time in this process (the file lock serialises processes).
    lock: Mutex<()>,
    /// The device number of the mount seen last (0: none yet): each lxcfs mount has its own.
    seen: AtomicU64,
}

impl Lxcfs {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            lock: Mutex::new(()),
            seen: AtomicU64::new(0),
        }
    }

    /// The directory lxcfs is mounted on.
    pub fn mount_dir(&self) -> PathBuf {
        self.dir.join("mount")
    }

    /// The host file that serves `view` (one of [`VIEWS`]).
    pub fn source(&self, view: &str) -> PathBuf {
        self.mount_dir().join(view.trim_start_matches('/'))
    }

    /// The pid of the running lxcfs, from its pid file.
    pub fn pid(&self) -> Option<i32> {
        super::read_pid(&self.dir.join("lxcfs.pid"))
    }

    /// Whether a live lxcfs is mounted (one `statfs`: a dead FUSE mount answers ENOTCONN).
    pub fn alive(&self) -> bool {
        matches!(mount_state(&self.mount_dir()), MountState::Live(_))
    }

    /// `found`, or `Restarted` when mount `dev` is not the one seen last.
    fn note(&self, dev: u64, found: Found) -> Found {
        let before = self.seen.swap(dev, Ordering::SeqCst);
        if before != 0 && before != dev {
            Found::Restarted
        } else {
            found
        }
    }

    /// Makes sure a live lxcfs serves the views: the running one, or one started now
    /// (over a dead mount, which is detached first).
    pub fn ensure(&self) -> Result<Found, ContainerError> {
        if let MountState::Live(dev) = mount_state(&self.mount_dir()) {
            return Ok(self.note(dev, Found::Running));
        }
        let _guard = self.lock.lock().expect("lxcfs lock");
        fs::create_dir_all(&self.dir).map_err(|e| ContainerError::io(format!("creating {}", self.dir.display()), e))?;
        let lock_path = self.dir.join("lock");
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| ContainerError::io(format!("opening {}", lock_path.display()), e))?;
        // SAFETY: flock on a file we own; released when it is closed.
        if unsafe { libc::flock(lock_file.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(ContainerError::io("locking lxcfs", io::Error::last_os_error()));
        }
        let mount = self.mount_dir();
        let found = match mount_state(&mount) {
            MountState::Live(dev) => return Ok(self.note(dev, Found::Running)),
            MountState::Dead => {
                tracing::warn!(dir = %mount.display(), "lxcfs died: its mount is detached and a new lxcfs started");
                // SAFETY: umount2 of a path we name; MNT_DETACH works on a dead FUSE mount.
                let path = CString::new(mount.as_os_str().as_encoded_bytes()).expect("no NUL in a path");
                if unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) } != 0 {
                    return Err(ContainerError::io(
                        format!("detaching the dead lxcfs mount {}", mount.display()),
                        io::Error::last_os_error(),
                    ));
                }
                Found::Restarted
            }
            MountState::None => Found::Started,
        };
        let dev = self.start()?;
        Ok(self.note(dev, found))
    }

    /// Whether the views of the container whose PID 1 is `pid` are dead (their lxcfs is
    /// gone): read through its root, from here.
    pub fn dead_in(pid: i32) -> bool {
        let meminfo = format!("/proc/{pid}/root/proc/meminfo");
        matches!(
            nix::sys::statfs::statfs(meminfo.as_str()),
            Err(nix::errno::Errno::ENOTCONN)
        )
    }

    /// Binds the live views over those of the container whose PID 1 is `pid` (dead ones,
    /// after lxcfs was restarted): clones of the view files are made here, then attached
    /// from inside the container's mount namespace, read-only, in place of the old binds.
    pub fn rebind(&self, pid: i32) -> io::Result<()> {
        let mut trees = Vec::new();
        for view in VIEWS {
            trees.push((CString::new(*view).expect("no NUL"), view_clone(&self.source(view))?));
        }
        let ns = fs::File::open(format!("/proc/{pid}/ns/mnt"))?;
        std::thread::Builder::new()
            .name("lxcfs-rebind".into())
            .spawn(move || {
                // SAFETY: this thread leaves the fs context it shares with the process,
                // then joins the container's mount namespace; nothing else of the edge moves.
                unsafe {
                    if libc::unshare(libc::CLONE_FS) != 0 || libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNS) != 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                for (target, tree) in trees {
                    // SAFETY: umount2 and move_mount with valid C strings and our own fd.
                    unsafe {
                        // The dead bind goes (EINVAL: nothing was mounted there).
                        if libc::umount2(target.as_ptr(), libc::MNT_DETACH) != 0
                            && io::Error::last_os_error().raw_os_error() != Some(libc::EINVAL)
                        {
                            return Err(io::Error::last_os_error());
                        }
                        if libc::syscall(
                            libc::SYS_move_mount,
                            tree.as_raw_fd(),
                            c"".as_ptr(),
                            libc::AT_FDCWD,
                            target.as_ptr(),
                            MOVE_MOUNT_F_EMPTY_PATH,
                        ) != 0
                        {
                            return Err(io::Error::last_os_error());
                        }
                    }
                }
                Ok(())
            })?
            .join()
            .unwrap_or_else(|_| Err(io::Error::other("the lxcfs-rebind thread panicked")))
    }

    /// Starts lxcfs and returns the device number of its mount.
    fn start(&self) -> Result<u64, ContainerError> {
        let binary = super::runtime::find_binary("lxcfs").ok_or_else(|| {
            ContainerError::Prerequisite(
                "lxcfs is not installed: install the lxcfs package (apt-get install lxcfs). It gives each \
                 sandbox views of its own memory, CPUs, load and uptime in /proc; to let sandboxes see the \
                 host's instead, start the edge with --no-lxcfs-views"
                    .into(),
            )
        })?;
        let mount = self.mount_dir();
        fs::create_dir_all(&mount).map_err(|e| ContainerError::io(format!("creating {}", mount.display()), e))?;
        // Containers' root is an unprivileged id on the host: the runtime binds the views
        // from here as that id, which must be able to walk the path.
        for d in [&self.dir, &mount] {
            fs::set_permissions(d, fs::Permissions::from_mode(0o755))
                .map_err(|e| ContainerError::io(format!("chmod {}", d.display()), e))?;
        }
        let log_path = self.dir.join("lxcfs.log");
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|e| ContainerError::io(format!("opening {}", log_path.display()), e))?;
        let log2 = log.try_clone().map_err(|e| ContainerError::io("dup", e))?;
        let log_start = log.metadata().map(|m| m.len()).unwrap_or(0);
        let mut cmd = Command::new(&binary);
        cmd.args(FLAGS)
            .arg("--pidfile")
            .arg(self.dir.join("lxcfs.pid"))
            .arg(&mount)
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(log2))
            .current_dir("/");
        // SAFETY: only raw syscalls (async-signal-safe) between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                // Detached like the shims: a session of its own, and a grandchild of the
                // edge (the middle process exits at once), so no edge ever has to reap it
                // and it outlives the edge.
                if libc::setsid() < 0 {
                    return Err(io::Error::last_os_error());
                }
                match libc::fork() {
                    -1 => return Err(io::Error::last_os_error()),
                    0 => {}
                    _ => libc::_exit(0),
                }
                // Every sandbox's views hang on it: the OOM killer takes it last.
                let fd = libc::open(c"/proc/self/oom_score_adj".as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd >= 0 {
                    libc::write(fd, b"-1000".as_ptr().cast(), 5);
                    libc::close(fd);
                }
                Ok(())
            });
        }
        let mut middle = cmd
            .spawn()
            .map_err(|e| ContainerError::io(format!("starting {}", binary.display()), e))?;
        let _ = middle.wait();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if let MountState::Live(dev) = mount_state(&mount) {
                return Ok(dev);
            }
            if Instant::now() >= deadline {
                let text = fs::read(&log_path).unwrap_or_default();
                let tail = String::from_utf8_lossy(&text[(log_start as usize).min(text.len())..])
                    .trim()
                    .replace('\n', " | ");
                return Err(ContainerError::Prerequisite(format!(
                    "lxcfs did not mount {} within {} s (FUSE needs /dev/fuse; to let sandboxes see the \
                     host's /proc instead, start the edge with --no-lxcfs-views): {tail}",
                    mount.display(),
                    START_TIMEOUT.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

const MOVE_MOUNT_F_EMPTY_PATH: libc::c_uint = 0x4;

/// A detached, read-only (nosuid, nodev, noexec) clone of the mount of file `path`.
fn view_clone(path: &Path) -> io::Result<OwnedFd> {
    use super::idmap::{MOUNT_ATTR_NODEV, MOUNT_ATTR_NOEXEC, MOUNT_ATTR_NOSUID, MOUNT_ATTR_RDONLY, detached_clone};
    detached_clone(
        path,
        MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | MOUNT_ATTR_NOEXEC,
        None,
    )
}

enum MountState {
    /// A FUSE file system answers there; its device number.
    Live(u64),
    /// Something is mounted there whose server is gone.
    Dead,
    None,
}

fn mount_state(dir: &Path) -> MountState {
    match nix::sys::statfs::statfs(dir) {
        Ok(s) if s.filesystem_type().0 == FUSE_SUPER_MAGIC => match fs::metadata(dir) {
            Ok(m) => MountState::Live(std::os::unix::fs::MetadataExt::dev(&m)),
            Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => MountState::Dead,
            Err(_) => MountState::None,
        },
        Ok(_) => MountState::None,
        Err(nix::errno::Errno::ENOTCONN) => MountState::Dead,
        Err(_) => MountState::None,
    }
}
