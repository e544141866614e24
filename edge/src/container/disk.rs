//! A sandbox's storage: a sparse ext4 image of fixed size, loop-mounted, holds the
//! overlay upper and work dirs, so whatever a sandbox writes is bounded by that size
//! (never by the host's free space); the root file system is overlayfs of the image
//! layers (read-only lower dirs, shared by all sandboxes, never copied) + that upper.
//!
//! Warm disks ([`Pool`], `opendsec edge --warm-disks N`, default 4): disks of the edge's
//! default size are made, loop-attached and mounted ahead of need in
//! `<sandboxes>/.warm-*`, and a create renames one into its sandbox directory, so it only
//! mounts its overlay (a fresh ext4 mount is the slow part of storage on a busy host).
//!
//! **Architecture Invariant:** a warm disk is either in the pool or being made by its one
//! filler thread; an edge that stops tears its warm disks down, and one that starts tears
//! down any a killed edge left.

use std::fs::{self, File, OpenOptions};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use nix::mount::{MntFlags, MsFlags, mount, umount2};

use super::ContainerError;
use super::idmap;

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LO_FLAGS_AUTOCLEAR: u32 = 4;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// Paths of a sandbox's storage inside its directory.
pub struct Storage {
    pub image: PathBuf,
    pub disk_mount: PathBuf,
    pub rootfs: PathBuf,
}

impl Storage {
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            image: dir.join("disk.img"),
            disk_mount: dir.join("disk"),
            rootfs: dir.join("rootfs"),
        }
    }

    /// Creates the disk, mounts it and the overlay; with `disk_ready`, the disk is
    /// already there and mounted (a warm disk from the [`Pool`]) and only the overlay is
    /// mounted. On error, undoes what it did.
    /// With `id_base` (the sandbox's id range), the overlay is mounted over idmapped
    /// layers for the sandbox's user namespace (see `idmap.rs`).
    pub fn setup(
        &self,
        size_bytes: u64,
        lower_bottom_first: &[PathBuf],
        disk_ready: bool,
        id_base: Option<u32>,
    ) -> Result<(), ContainerError> {
        let result = (|| {
            if !disk_ready {
                self.prepare_disk(size_bytes)?;
            }
            self.mount_overlay(lower_bottom_first, id_base)
        })();
        if result.is_err() {
            let _ = self.teardown();
        }
        result
    }

    /// The disk image, loop-mounted, with the overlay's upper and work dirs on it.
    fn prepare_disk(&self, size_bytes: u64) -> Result<(), ContainerError> {
        copy_sparse(
            &template(size_bytes, self.image.parent().and_then(Path::parent))?,
            &self.image,
        )?;
        for dir in [&self.disk_mount, &self.rootfs] {
            fs::create_dir_all(dir).map_err(|e| ContainerError::io(format!("creating {}", dir.display()), e))?;
        }
        let (loop_dev, loop_fd) = attach_loop(&self.image, 0, 0)?;
        let mounted = mount(
            Some(loop_dev.as_path()),
            &self.disk_mount,
            Some("ext4"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some("noinit_itable"),
        );
        // The mount holds the device now; closing our fd lets autoclear detach it at umount.
        drop(loop_fd);
        mounted.map_err(|e| {
            ContainerError::Storage(format!(
                "mounting {} on {}: {e}",
                loop_dev.display(),
                self.disk_mount.display()
            ))
        })?;
        let upper = self.disk_mount.join("upper");
        let work = self.disk_mount.join("work");
        for dir in [&upper, &work] {
            fs::create_dir(dir).map_err(|e| ContainerError::io(format!("creating {}", dir.display()), e))?;
        }
        // The overlay root takes the upper dir's mode: the usual 0755.
        use std::os::unix::fs::PermissionsExt;
        let _ = fs::set_permissions(&upper, fs::Permissions::from_mode(0o755));
        Ok(())
    }

    /// The root file system: the image's layers under the disk's upper dir. Layers and
    /// the disk are named by fds (`/proc/self/fd/N`), so no host path shows in the
    /// sandbox's mountinfo; with `id_base` they are idmapped clones (see `idmap.rs`).
    pub(super) fn mount_overlay(&self, lower: &[PathBuf], id_base: Option<u32>) -> Result<(), ContainerError> {
        if lower.is_empty() {
            return Err(ContainerError::Invalid("an image needs at least one layer".into()));
        }
        // One user namespace for all of this mount's idmapped clones, dropped after it.
        let userns = id_base.map(idmap::user_namespace).transpose()?;
        let open = |p: &Path| -> Result<OwnedFd, ContainerError> {
            match &userns {
                Some(userns) => idmap::idmapped(p, userns),
                None => fs::File::open(p)
                    .map(OwnedFd::from)
                    .map_err(|e| ContainerError::io(format!("opening {}", p.display()), e)),
            }
        };
        // overlayfs lists lower dirs top first.
        let lowers = lower.iter().rev().map(|p| open(p)).collect::<Result<Vec<_>, _>>()?;
        let disk = open(&self.disk_mount)?;
        let lowerdir = lowers
            .iter()
            .map(|fd| format!("/proc/self/fd/{}", fd.as_raw_fd()))
            .collect::<Vec<_>>()
            .join(":");
        let d = disk.as_raw_fd();
        let options = format!("lowerdir={lowerdir},upperdir=/proc/self/fd/{d}/upper,workdir=/proc/self/fd/{d}/work");
        match id_base {
            Some(base) => idmap::mount_overlay_as(&self.rootfs, &options, base),
            None => mount(
                Some("overlay"),
                &self.rootfs,
                Some("overlay"),
                MsFlags::MS_NODEV | MsFlags::MS_NOSUID,
                Some(options.as_str()),
            )
            .map_err(|e| ContainerError::Storage(format!("mounting overlay on {}: {e}", self.rootfs.display()))),
        }
        // The overlay holds its layers now; our fds (and the detached clones) can go.
    }

    /// Unmounts the overlay and the disk (the loop device detaches itself). Idempotent.
    pub fn teardown(&self) -> Result<(), ContainerError> {
        unmount(&self.rootfs)?;
        unmount(&self.disk_mount)?;
        Ok(())
    }
}

/// Warm disks: storage of one size made ahead of need (image copied, loop-attached,
/// mounted, upper and work dirs made), so that a create only mounts its overlay. Mounting
/// a fresh ext4 is the slow part of a sandbox's storage (10-80 ms on a busy host), and it
/// does not depend on the sandbox. Each warm disk is a directory
/// `<sandboxes root>/.warm-<n>/` laid out as a sandbox directory's storage; a create
/// renames it to the sandbox's directory (a mount point moves with its parent).
///
/// Invariant: a warm disk is either listed in `ready` or being made by the one filler
/// thread; one that is neither (left by a killed edge) is torn down when a pool starts
/// ([`Pool::new`]) and by [`Pool::drain`].
pub struct Pool {
    root: PathBuf,
    size: u64,
    target: usize,
    ready: std::sync::Mutex<Vec<PathBuf>>,
    filling: std::sync::atomic::AtomicBool,
    closed: std::sync::atomic::AtomicBool,
}

/// The name prefix of warm disk directories in the sandboxes root.
pub const WARM_PREFIX: &str = ".warm-";

impl Pool {
    /// A pool keeping `target` warm disks of `size` bytes under `root`; any warm disks a
    /// previous edge left are torn down first. Filling starts in the background.
    pub fn new(root: &Path, size: u64, target: usize) -> std::sync::Arc<Self> {
        tear_down_warm(root);
        let pool = std::sync::Arc::new(Self {
            root: root.to_path_buf(),
            size,
            target,
            ready: std::sync::Mutex::new(Vec::new()),
            filling: std::sync::atomic::AtomicBool::new(false),
            closed: std::sync::atomic::AtomicBool::new(false),
        });
        pool.refill();
        pool
    }

    /// A warm disk of `size` bytes, if one is ready; the pool refills behind it.
    pub fn take(self: &std::sync::Arc<Self>, size: u64) -> Option<PathBuf> {
        if size != self.size {
            return None;
        }
        let taken = self.ready.lock().expect("pool lock").pop();
        self.refill();
        taken
    }

    /// How many warm disks are ready now.
    pub fn ready(&self) -> usize {
        self.ready.lock().expect("pool lock").len()
    }

    /// Starts the filler thread unless it runs or the pool is full or closed.
    fn refill(self: &std::sync::Arc<Self>) {
        use std::sync::atomic::Ordering;
        if self.closed.load(Ordering::SeqCst) || self.ready() >= self.target {
            return;
        }
        if self.filling.swap(true, Ordering::SeqCst) {
            return;
        }
        let pool = self.clone();
        let spawned = std::thread::Builder::new().name("warm-disks".into()).spawn(move || {
            // Making disks ahead must not slow the creates it serves: this thread
            // runs at the lowest CPU priority and in the idle I/O class.
            lower_priority();
            loop {
                if pool.closed.load(Ordering::SeqCst) || pool.ready() >= pool.target {
                    break;
                }
                // Unique in the process: a later pool (a restarted backend) never reuses a
                // name an earlier one left behind.
                static DISKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let n = DISKS.fetch_add(1, Ordering::SeqCst);
                let dir = pool.root.join(format!("{WARM_PREFIX}{}-{n}", std::process::id()));
                match make_warm(&dir, pool.size) {
                    Ok(()) => {
                        let mut ready = pool.ready.lock().expect("pool lock");
                        if pool.closed.load(Ordering::SeqCst) {
                            drop(ready);
                            discard_warm(&dir);
                            break;
                        }
                        ready.push(dir);
                    }
                    Err(e) => {
                        // Creates make their own disks meanwhile; no retry loop.
                        tracing::warn!(error = %e, "cannot make a warm disk");
                        break;
                    }
                }
            }
            pool.filling.store(false, Ordering::SeqCst);
        });
        if spawned.is_err() {
            self.filling.store(false, Ordering::SeqCst);
        }
    }

    /// Stops filling and tears down every warm disk (an edge that stops leaves none).
    pub fn drain(&self) {
        use std::sync::atomic::Ordering;
        self.closed.store(true, Ordering::SeqCst);
        // The filler finishes the disk it is making and discards it (closed).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.filling.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let ready: Vec<PathBuf> = std::mem::take(&mut *self.ready.lock().expect("pool lock"));
        for dir in ready {
            discard_warm(&dir);
        }
    }
}

/// The calling thread at nice 19 and in the idle I/O class (best effort: a host that
/// refuses either keeps the default).
pub(crate) fn lower_priority() {
    const IOPRIO_WHO_PROCESS: libc::c_int = 1;
    const IOPRIO_CLASS_IDLE: libc::c_int = 3;
    const IOPRIO_CLASS_SHIFT: libc::c_int = 13;
    // SAFETY: gettid, setpriority and ioprio_set on this thread only.
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 19);
        libc::syscall(
            libc::SYS_ioprio_set,
            IOPRIO_WHO_PROCESS,
            tid as libc::c_int,
            IOPRIO_CLASS_IDLE << IOPRIO_CLASS_SHIFT,
        );
    }
}

fn make_warm(dir: &Path, size: u64) -> Result<(), ContainerError> {
    fs::create_dir(dir).map_err(|e| ContainerError::io(format!("creating {}", dir.display()), e))?;
    let storage = Storage::in_dir(dir);
    let made = storage.prepare_disk(size);
    if made.is_err() {
        discard_warm(dir);
    }
    made
}

fn discard_warm(dir: &Path) {
    let _ = Storage::in_dir(dir).teardown();
    let _ = fs::remove_dir_all(dir);
}

/// Tears down the warm disks found under `root` (left by an edge that did not stop).
fn tear_down_warm(root: &Path) {
    for entry in fs::read_dir(root).into_iter().flatten().flatten() {
        if entry.file_name().to_string_lossy().starts_with(WARM_PREFIX) {
            discard_warm(&entry.path());
        }
    }
}

/// Renames directory `from` to `to` unless `to` exists (then `AlreadyExists`).
pub fn rename_noreplace(from: &Path, to: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes()).map_err(std::io::Error::other);
    let (from, to) = (c(from)?, c(to)?);
    // SAFETY: two valid C strings; renameat2 does not keep them.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// An empty ext4 image of `size` bytes, made once per size under
/// `<sandboxes root>/.templates/` and copied (sparsely) for each sandbox: copying ~1 MB
/// of metadata is faster than running mkfs each time. Copies share the file system
/// UUID, which ext4 does not mind.
fn template(size: u64, sandboxes_root: Option<&Path>) -> Result<PathBuf, ContainerError> {
    let dir = sandboxes_root.unwrap_or(Path::new("/var/tmp")).join(".templates");
    let path = dir.join(format!("ext4-{size}.img"));
    if path.exists() {
        return Ok(path);
    }
    fs::create_dir_all(&dir).map_err(|e| ContainerError::io(format!("creating {}", dir.display()), e))?;
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("ext4-{size}.img.tmp{}-{seq}", std::process::id()));
    let file = File::create(&tmp).map_err(|e| ContainerError::io("creating a disk template", e))?;
    file.set_len(size)
        .map_err(|e| ContainerError::io("sizing a disk template", e))?;
    drop(file);
    // No journal: the disk is scratch space that dies with the sandbox. Lazy inode
    // tables plus `noinit_itable` at mount keep the sparse file small (no zeroing).
    let out = Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-m",
            "0",
            "-O",
            "^has_journal",
            "-E",
            "nodiscard,lazy_itable_init=1",
        ])
        .arg(&tmp)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .output()
        .map_err(|e| {
            ContainerError::Prerequisite(format!("cannot run mkfs.ext4 (install the e2fsprogs package): {e}"))
        })?;
    if !out.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(ContainerError::Storage(format!(
            "mkfs.ext4 failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    fs::rename(&tmp, &path).map_err(|e| ContainerError::io("publishing a disk template", e))?;
    Ok(path)
}

/// Copies `from` to a new file `to`, only the data extents (holes stay holes).
fn copy_sparse(from: &Path, to: &Path) -> Result<(), ContainerError> {
    use std::os::unix::fs::OpenOptionsExt;
    let src = File::open(from).map_err(|e| ContainerError::io("opening the disk template", e))?;
    let dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(to)
        .map_err(|e| ContainerError::io("creating disk.img", e))?;
    let len = src
        .metadata()
        .map_err(|e| ContainerError::io("stat template", e))?
        .len();
    dst.set_len(len).map_err(|e| ContainerError::io("sizing disk.img", e))?;
    let (sfd, dfd) = (src.as_raw_fd(), dst.as_raw_fd());
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: lseek on our own fds.
        let data = unsafe { libc::lseek(sfd, pos, libc::SEEK_DATA) };
        if data < 0 {
            break; // ENXIO: only a hole remains
        }
        let hole = unsafe { libc::lseek(sfd, data, libc::SEEK_HOLE) };
        let hole = if hole < 0 { len as i64 } else { hole };
        let (mut off_in, mut off_out) = (data, data);
        let mut left = (hole - data) as usize;
        while left > 0 {
            // SAFETY: copying between our own fds with kernel-maintained offsets.
            let n = unsafe { libc::copy_file_range(sfd, &mut off_in, dfd, &mut off_out, left, 0) };
            if n <= 0 {
                return Err(ContainerError::io(
                    "copying the disk template",
                    std::io::Error::last_os_error(),
                ));
            }
            left -= n as usize;
        }
        pos = hole;
    }
    Ok(())
}

/// Whether `path` is a mount point in this mount namespace.
pub fn is_mounted(path: &Path) -> bool {
    let Ok(text) = fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    text.lines()
        .any(|line| line.split(' ').nth(4).is_some_and(|mp| unescape_mountinfo(mp) == want))
}

fn unescape_mountinfo(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

fn unmount(path: &Path) -> Result<(), ContainerError> {
    for attempt in 0..20 {
        if !is_mounted(path) {
            return Ok(());
        }
        match umount2(path, MntFlags::empty()) {
            Ok(()) => continue,
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => return Ok(()),
            Err(nix::errno::Errno::EBUSY) if attempt < 19 => std::thread::sleep(Duration::from_millis(25)),
            Err(nix::errno::Errno::EBUSY) => {
                // Something (a dying container's namespace) still holds it: detach lazily;
                // the kernel frees it when the last user goes.
                umount2(path, MntFlags::MNT_DETACH)
                    .map_err(|e| ContainerError::Storage(format!("unmounting {}: {e}", path.display())))?;
                return Ok(());
            }
            Err(e) => {
                return Err(ContainerError::Storage(format!("unmounting {}: {e}", path.display())));
            }
        }
    }
    Ok(())
}

/// Attaches `image` to a free loop device with autoclear; returns the device and an
/// open fd that keeps it attached until the caller mounts it. `offset` and `size_limit`
/// (0: to the end) select a part of the file, such as a partition of a whole disk.
pub(crate) fn attach_loop(image: &Path, offset: u64, size_limit: u64) -> Result<(PathBuf, File), ContainerError> {
    let backing = OpenOptions::new()
        .read(true)
        .write(true)
        .open(image)
        .map_err(|e| ContainerError::io("opening disk.img", e))?;
    let control = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/loop-control")
        .map_err(|e| ContainerError::Prerequisite(format!("no loop devices (/dev/loop-control): {e}")))?;
    for _ in 0..64 {
        // SAFETY: ioctl without arguments on the loop control device.
        let n = unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE as _) };
        if n < 0 {
            return Err(ContainerError::io("LOOP_CTL_GET_FREE", std::io::Error::last_os_error()));
        }
        let dev = PathBuf::from(format!("/dev/loop{n}"));
        let dev_file = match OpenOptions::new().read(true).write(true).open(&dev) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(ContainerError::io(format!("opening {}", dev.display()), e)),
        };
        // SAFETY: an all-zero loop_config is valid; we set the fields we need.
        let mut config: LoopConfig = unsafe { std::mem::zeroed() };
        config.fd = backing.as_raw_fd() as u32;
        config.info.lo_flags = LO_FLAGS_AUTOCLEAR;
        config.info.lo_offset = offset;
        config.info.lo_sizelimit = size_limit;
        let name = image.to_string_lossy();
        let len = name.len().min(63);
        config.info.lo_file_name[..len].copy_from_slice(&name.as_bytes()[..len]);
        // SAFETY: config is a valid loop_config for the duration of the call.
        let rc = unsafe { libc::ioctl(dev_file.as_raw_fd(), LOOP_CONFIGURE as _, &config as *const LoopConfig) };
        if rc == 0 {
            return Ok((dev, dev_file));
        }
        let err = std::io::Error::last_os_error();
        // Another process took this device between GET_FREE and CONFIGURE: try again.
        if err.raw_os_error() == Some(libc::EBUSY) {
            continue;
        }
        return Err(ContainerError::io(format!("LOOP_CONFIGURE {}", dev.display()), err));
    }
    Err(ContainerError::Storage("no free loop device after 64 attempts".into()))
}
