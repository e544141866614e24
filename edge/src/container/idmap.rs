//! User namespaces for containers: each sandbox's ids 0..65535 map to a host range of
//! its own, so root inside is an unprivileged uid outside, and one sandbox's `user` is
//! not another's (per-uid kernel limits, such as inotify instances, are per sandbox).
//!
//! Ranges are [`RANGE`] ids from [`FIRST_BASE`] on, one per sandbox, recorded in the
//! sandbox's `sandbox.json` (`id_base`): [`IdRanges`] is rebuilt from the records when the
//! edge starts, so a restart re-adopts every range and never hands one out twice.
//!
//! Layers stay shared and are never copied or chowned: the sandbox's overlay is mounted
//! over *idmapped* clones of its layers and of its disk's upper dir (`open_tree` +
//! `mount_setattr(MOUNT_ATTR_IDMAP)`), which show a file stored as uid N as `base + N`.
//! Everything on disk (layers, the upper dir, snapshots, forks, transfers) therefore
//! keeps the sandbox's own ids, whatever range the sandbox ran in. The overlay is mounted
//! by a thread whose file-system ids are the range's root, keeping its capabilities
//! (`SECBIT_NO_SETUID_FIXUP`): overlayfs creates upper files with its mounter's
//! credentials, which the idmapped upper must be able to map. The layers are named by
//! `/proc/self/fd/N`, so no host path shows in the sandbox's mountinfo.
//!
//! Idmapped mounts need Linux 5.12 (ext4, xfs, btrfs; tmpfs from 6.3) and overlayfs over
//! idmapped layers 5.19. [`probe`] checks at start that the host can do it on the
//! directories the edge uses; an edge that cannot isolate refuses to start (fail closed).

use std::collections::BTreeSet;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Mutex;

use super::ContainerError;

/// Ids per sandbox: 0..65535 inside, as on an ordinary Linux system.
pub const RANGE: u32 = 65_536;
/// The first range's base: above any id a host gives its own users and services.
pub const FIRST_BASE: u32 = 1 << 30;
/// Ranges available (up to 2^31 - 1, the largest id the kernel's maps take safely).
pub const SLOTS: u32 = ((1u64 << 31) - FIRST_BASE as u64) as u32 / RANGE - 1;

pub(super) const MOUNT_ATTR_RDONLY: u64 = 0x1;
pub(super) const MOUNT_ATTR_NOSUID: u64 = 0x2;
pub(super) const MOUNT_ATTR_NODEV: u64 = 0x4;
pub(super) const MOUNT_ATTR_NOEXEC: u64 = 0x8;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;
const OPEN_TREE_CLONE: libc::c_uint = 1;
const SECBIT_NO_SETUID_FIXUP: libc::c_ulong = 1 << 2;

#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// The id ranges of this edge's sandboxes.
#[derive(Default)]
pub struct IdRanges {
    used: Mutex<BTreeSet<u32>>,
}

impl IdRanges {
    /// The ranges of the sandboxes that exist (their records' bases).
    pub fn adopt(bases: impl IntoIterator<Item = u32>) -> Self {
        Self {
            used: Mutex::new(bases.into_iter().collect()),
        }
    }

    /// A free range's base, now taken.
    pub fn allocate(&self) -> Result<u32, ContainerError> {
        let mut used = self.used.lock().expect("id ranges lock");
        let slot = (0..SLOTS)
            .map(|k| FIRST_BASE + k * RANGE)
            .find(|b| !used.contains(b))
            .ok_or_else(|| ContainerError::Prerequisite(format!("all {SLOTS} id ranges are in use")))?;
        used.insert(slot);
        Ok(slot)
    }

    /// Gives range `base` back (its sandbox is gone).
    pub fn release(&self, base: u32) {
        self.used.lock().expect("id ranges lock").remove(&base);
    }
}

/// A user namespace that maps range `base` (needed only while its sandbox's mounts are
/// idmapped: drop it after).
pub fn user_namespace(base: u32) -> Result<OwnedFd, ContainerError> {
    new_userns(base).map_err(|e| ContainerError::io("making a user namespace", e))
}

/// A detached clone of the mount at `path` that shows ids as `userns` maps them.
pub fn idmapped(path: &Path, userns: &OwnedFd) -> Result<OwnedFd, ContainerError> {
    detached_clone(path, MOUNT_ATTR_IDMAP, Some(userns))
        .map_err(|e| ContainerError::io(format!("idmapping {}", path.display()), e))
}

/// A user namespace mapping 0..RANGE to `base`..: made by a child that unshares one and
/// waits while we write its maps and open it.
fn new_userns(base: u32) -> std::io::Result<OwnedFd> {
    let mut ready = [0 as libc::c_int; 2];
    let mut go = [0 as libc::c_int; 2];
    // SAFETY: plain pipe creation into arrays we own.
    if unsafe { libc::pipe2(ready.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above; the fds are wrapped right away so they close on every path.
    let (ready_r, ready_w) = unsafe { (OwnedFd::from_raw_fd(ready[0]), OwnedFd::from_raw_fd(ready[1])) };
    if unsafe { libc::pipe2(go.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: as above.
    let (go_r, go_w) = unsafe { (OwnedFd::from_raw_fd(go[0]), OwnedFd::from_raw_fd(go[1])) };
    // SAFETY: the child makes only async-signal-safe calls (unshare, write, read, _exit).
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        unsafe {
            // Only the parent's ends may stay open, or nobody sees the other side close.
            libc::close(go_w.as_raw_fd());
            libc::close(ready_r.as_raw_fd());
            let ok: u8 = if libc::unshare(libc::CLONE_NEWUSER) == 0 { 1 } else { 0 };
            libc::write(ready_w.as_raw_fd(), (&ok as *const u8).cast(), 1);
            let mut b = 0u8;
            libc::read(go_r.as_raw_fd(), (&mut b as *mut u8).cast(), 1);
            libc::_exit(0);
        }
    }
    drop(ready_w);
    drop(go_r);
    let result = (|| {
        let mut ok = [0u8; 1];
        let n = unsafe { libc::read(ready_r.as_raw_fd(), ok.as_mut_ptr().cast(), 1) };
        if n != 1 || ok[0] != 1 {
            return Err(std::io::Error::other("the child could not unshare a user namespace"));
        }
        let map = format!("0 {base} {RANGE}\n");
        std::fs::write(format!("/proc/{pid}/uid_map"), &map)?;
        std::fs::write(format!("/proc/{pid}/gid_map"), &map)?;
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/user"))?;
        Ok(OwnedFd::from(ns))
    })();
    // SAFETY: a one-byte write to the pipe we own: the child may go.
    unsafe { libc::write(go_w.as_raw_fd(), b"g".as_ptr().cast(), 1) };
    drop(go_w);
    let mut status = 0;
    // SAFETY: reaping the child we forked.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    result
}

/// A detached clone (`open_tree(OPEN_TREE_CLONE)`) of the mount at `path`, with mount
/// attributes `attr_set` (`MOUNT_ATTR_*`) and, for `MOUNT_ATTR_IDMAP`, the user namespace
/// whose mapping it shows. The one place the edge makes detached mounts (idmapped
/// layers here, lxcfs's read-only views in `lxcfs.rs`).
pub(super) fn detached_clone(path: &Path, attr_set: u64, userns: Option<&OwnedFd>) -> std::io::Result<OwnedFd> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(std::io::Error::other)?;
    // SAFETY: open_tree with a valid C path; returns a new fd or -1.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_open_tree,
            libc::AT_FDCWD,
            c.as_ptr(),
            OPEN_TREE_CLONE | libc::O_CLOEXEC as libc::c_uint,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd was just returned to us.
    let tree = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let attr = MountAttr {
        attr_set,
        attr_clr: 0,
        propagation: 0,
        userns_fd: userns.map_or(0, |u| u.as_raw_fd() as u64),
    };
    // SAFETY: mount_setattr on our detached tree with a struct of the kernel's layout.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            tree.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(tree)
}

/// Mounts overlayfs on `target` with `options` as range `base`'s root (see the module
/// doc), on a thread of its own so that the changed credentials die with it.
pub fn mount_overlay_as(target: &Path, options: &str, base: u32) -> Result<(), ContainerError> {
    let target_c = CString::new(target.as_os_str().as_bytes())
        .map_err(|_| ContainerError::Invalid(format!("{} has a NUL byte", target.display())))?;
    let options_c =
        CString::new(options).map_err(|_| ContainerError::Invalid("overlay options have a NUL byte".into()))?;
    let joined = std::thread::Builder::new()
        .name("overlay-mount".into())
        .spawn(move || -> std::io::Result<()> {
            // SAFETY: these change this thread's credentials only (the kernel keeps them
            // per thread and glibc's setfsuid/setfsgid are not broadcast); the thread ends
            // right after the mount.
            unsafe {
                if libc::prctl(libc::PR_SET_SECUREBITS, SECBIT_NO_SETUID_FIXUP, 0, 0, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::setfsgid(base);
                libc::setfsuid(base);
                if libc::setfsuid(u32::MAX) as u32 != base {
                    return Err(std::io::Error::other("could not take the range's file-system uid"));
                }
                let rc = libc::mount(
                    c"overlay".as_ptr(),
                    target_c.as_ptr(),
                    c"overlay".as_ptr(),
                    libc::MS_NODEV | libc::MS_NOSUID,
                    options_c.as_ptr().cast(),
                );
                if rc != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        })
        .map_err(|e| ContainerError::io("starting the overlay mount thread", e))?
        .join()
        .map_err(|_| ContainerError::Storage("the overlay mount thread panicked".into()))?;
    joined.map_err(|e| ContainerError::Storage(format!("mounting overlay on {}: {e}", target.display())))
}

/// The host-wide inotify limits, raised to the kernel's maximum. A user namespace charges
/// its users' inotify instances and watches to its owner in the parent namespace too (the
/// kernel's ucounts), and every sandbox's namespace is owned by host root: left at the
/// default (128 instances), one sandbox's `user` could take every instance of every
/// sandbox and of the host's root. The memory cgroup bounds what each sandbox allocates.
const INOTIFY_LIMITS: [&str; 2] = [
    "/proc/sys/fs/inotify/max_user_instances",
    "/proc/sys/fs/inotify/max_user_watches",
];

/// Raises the host's inotify limits (see [`INOTIFY_LIMITS`]); says what it changed.
pub fn raise_shared_limits() -> Result<(), ContainerError> {
    for path in INOTIFY_LIMITS {
        let now: i64 = std::fs::read_to_string(path)
            .map_err(|e| ContainerError::io(format!("reading {path}"), e))?
            .trim()
            .parse()
            .unwrap_or(0);
        if now < i32::MAX as i64 {
            std::fs::write(path, (i32::MAX).to_string()).map_err(|e| {
                ContainerError::Prerequisite(format!(
                    "cannot raise {path} from {now}: {e}; sandboxes in user namespaces share that limit with host root"
                ))
            })?;
            tracing::info!(%path, from = now, to = i32::MAX, "raised a host-wide inotify limit that user namespaces share");
        }
    }
    Ok(())
}

/// Whether this host can give containers user namespaces the way [`super::disk`] mounts
/// them: an overlay over an idmapped layer and an idmapped upper dir, in a scratch
/// directory under `root` (the sandboxes' file system), mounted and unmounted. Says what
/// failed otherwise.
pub fn probe(root: &Path) -> Result<(), String> {
    let scratch = root.join(format!(".idmap-probe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    let result = probe_in(&scratch);
    let rootfs = scratch.join("rootfs");
    if super::disk::is_mounted(&rootfs) {
        let _ = nix::mount::umount2(&rootfs, nix::mount::MntFlags::MNT_DETACH);
    }
    let _ = std::fs::remove_dir_all(&scratch);
    result.map_err(|e| {
        format!(
            "this host cannot give containers user namespaces with idmapped layers on {} ({e}); \
             that needs Linux 5.19+ with idmapped mounts on that file system (ext4, xfs, btrfs)",
            root.display()
        )
    })
}

fn probe_in(scratch: &Path) -> Result<(), String> {
    for d in ["lower", "disk/upper", "disk/work", "rootfs"] {
        std::fs::create_dir_all(scratch.join(d)).map_err(|e| format!("creating the scratch directory: {e}"))?;
    }
    // Mounted as a sandbox's root file system is (the storage's own layout and mount).
    let storage = super::disk::Storage::in_dir(scratch);
    storage
        .mount_overlay(&[scratch.join("lower")], Some(FIRST_BASE))
        .map_err(|e| e.to_string())?;
    // Mounted read-write (overlayfs falls back to read-only when its upper is unusable).
    let st = nix::sys::statvfs::statvfs(&storage.rootfs).map_err(|e| e.to_string())?;
    if st.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY) {
        return Err("the overlay came up read-only".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_handed_out_once_and_come_back() {
        let r = IdRanges::adopt([FIRST_BASE]);
        let a = r.allocate().unwrap();
        let b = r.allocate().unwrap();
        assert_eq!((a, b), (FIRST_BASE + RANGE, FIRST_BASE + 2 * RANGE));
        r.release(a);
        assert_eq!(r.allocate().unwrap(), a, "a released range is reused");
        assert!(FIRST_BASE as u64 + (SLOTS as u64 + 1) * RANGE as u64 <= 1 << 31);
    }
}
