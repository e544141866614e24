//! A writable root for building one layer on top of others: an overlay of the lower
//! layers with a fresh upper dir (which becomes the new layer), plus /proc, a minimal
//! /dev, a read-only /sys and the host's resolv.conf. With no lower layers the root is
//! the layer itself, bound in place (`base` finishes debootstrap's tree this way). Everything is mounted in a
//! private mount namespace owned by one thread, so whatever happens (an error, a panic,
//! the process killed) the mounts end with that namespace and never appear on the host;
//! on the normal path they are also unmounted explicitly before the thread returns.

use std::fs;
use std::io;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::sync::mpsc;

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};

use super::{BuildProgress, ImageError, io_err};

/// Device nodes a package script may need; bound one by one from the host (never the
/// host's whole /dev).
const DEVICES: &[&str] = &["null", "zero", "full", "random", "urandom", "tty"];

/// Runs `build(root, progress)` with `root` an overlay of `lower` (bottom first) and
/// `upper` (or, when `lower` is empty, a bind mount of `upper` itself), on a thread of
/// its own; its progress reports reach `progress` on the
/// calling thread. `scratch` holds the overlay's work and mount-point dirs; it is
/// removed afterwards. Commands `build` spawns inherit the private namespace (run them
/// with `chroot root ...`).
pub(super) fn with_build_root<T, F>(
    lower: &[PathBuf],
    upper: &Path,
    scratch: &Path,
    progress: &dyn Fn(&BuildProgress),
    build: F,
) -> Result<T, ImageError>
where
    T: Send,
    F: FnOnce(&Path, &dyn Fn(&BuildProgress)) -> Result<T, ImageError> + Send,
{
    let (tx, rx) = mpsc::channel::<BuildProgress>();
    let result = std::thread::scope(|s| {
        let builder = s.spawn(move || {
            let report = move |p: &BuildProgress| {
                let _ = tx.send(p.clone());
            };
            in_private_namespace(lower, upper, scratch, |root| build(root, &report))
        });
        // Ends when the builder thread drops its sender, i.e. when it is done.
        for p in rx {
            progress(&p);
        }
        builder.join().unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    });
    let _ = super::remove_tree(scratch);
    result
}

fn mount_err(what: String) -> impl FnOnce(nix::errno::Errno) -> ImageError {
    move |errno| ImageError::Io {
        context: what,
        source: io::Error::from(errno),
    }
}

/// Mount points made so far, unmounted (last first) when dropped: on success, on an
/// error and while unwinding from a panic.
struct Mounts(Vec<PathBuf>);

impl Mounts {
    fn add(
        &mut self,
        source: Option<&Path>,
        target: &Path,
        fstype: Option<&str>,
        flags: MsFlags,
        data: Option<&str>,
    ) -> Result<(), ImageError> {
        mount(source, target, fstype, flags, data).map_err(mount_err(format!("mounting {}", target.display())))?;
        self.0.push(target.to_path_buf());
        Ok(())
    }

    /// Makes an existing bind mount read-only (a bind ignores MS_RDONLY on creation).
    fn read_only(&self, target: &Path) -> Result<(), ImageError> {
        mount(
            None::<&str>,
            target,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .map_err(mount_err(format!("making {} read-only", target.display())))
    }
}

impl Drop for Mounts {
    fn drop(&mut self) {
        for target in self.0.drain(..).rev() {
            let _ = umount2(&target, MntFlags::MNT_DETACH);
        }
    }
}

fn in_private_namespace<T, F>(lower: &[PathBuf], upper: &Path, scratch: &Path, build: F) -> Result<T, ImageError>
where
    F: FnOnce(&Path) -> Result<T, ImageError>,
{
    // Per thread: unshare(CLONE_NEWNS) gives only this thread (and the processes it
    // spawns) the new namespace; the rest of the process keeps the host's.
    unshare(CloneFlags::CLONE_NEWNS).map_err(mount_err("unshare(CLONE_NEWNS)".into()))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(mount_err("making / private in the build namespace".into()))?;

    let work = scratch.join("work");
    let root = scratch.join("root");
    for dir in [&work, &root] {
        fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    }
    let mut mounts = Mounts(Vec::new());
    if lower.is_empty() {
        // A bottom layer is its own root: the build writes into it directly, and the
        // mounts below cover its /proc, /dev and /sys only in this namespace.
        mounts.add(Some(upper), &root, None, MsFlags::MS_BIND, None)?;
    } else {
        let mut lowerdir = Vec::with_capacity(lower.len());
        // overlayfs lists lower dirs top first.
        for dir in lower.iter().rev() {
            let s = dir.to_str().filter(|s| !s.contains([':', ',']));
            lowerdir.push(s.ok_or_else(|| ImageError::Io {
                context: format!("layer path {}", dir.display()),
                source: io::Error::new(io::ErrorKind::InvalidInput, "not UTF-8 or has ':' or ','"),
            })?);
        }
        // No redirects, metacopy or index: the upper dir must be a plain layer that any
        // later overlay can stack (whiteouts and opaque dirs only).
        let options = format!(
            "lowerdir={},upperdir={},workdir={},redirect_dir=off,metacopy=off,index=off",
            lowerdir.join(":"),
            upper.display(),
            work.display()
        );
        mounts.add(
            Some(Path::new("overlay")),
            &root,
            Some("overlay"),
            MsFlags::empty(),
            Some(&options),
        )?;
    }

    mounts.add(
        Some(Path::new("proc")),
        &root.join("proc"),
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
    mounts.add(
        Some(Path::new("sysfs")),
        &root.join("sys"),
        Some("sysfs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None,
    )?;
    let dev = root.join("dev");
    mounts.add(
        Some(Path::new("tmpfs")),
        &dev,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("mode=755,size=1m"),
    )?;
    for name in DEVICES {
        let host = Path::new("/dev").join(name);
        if !host.exists() {
            continue;
        }
        let node = dev.join(name);
        fs::write(&node, b"").map_err(io_err(format!("creating {}", node.display())))?;
        mounts.add(Some(&host), &node, None, MsFlags::MS_BIND, None)?;
    }
    for (link, target) in [
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        symlink(target, dev.join(link)).map_err(io_err(format!("linking /dev/{link}")))?;
    }
    let shm = dev.join("shm");
    fs::create_dir(&shm).map_err(io_err("creating /dev/shm"))?;
    fs::set_permissions(&shm, fs::Permissions::from_mode(0o1777)).map_err(io_err("chmod /dev/shm"))?;

    // The host's resolver for apt, bound over the image's file so the layer keeps its own.
    let resolv = root.join("etc/resolv.conf");
    let created_resolv = match resolv.symlink_metadata() {
        Ok(meta) if meta.is_file() => false,
        Ok(_) => {
            return Err(ImageError::Io {
                context: format!("{} in the lower layers", "/etc/resolv.conf"),
                source: io::Error::new(io::ErrorKind::InvalidData, "not a regular file"),
            });
        }
        Err(_) => {
            fs::write(&resolv, b"").map_err(io_err("creating /etc/resolv.conf"))?;
            true
        }
    };
    mounts.add(
        Some(Path::new("/etc/resolv.conf")),
        &resolv,
        None,
        MsFlags::MS_BIND,
        None,
    )?;
    mounts.read_only(&resolv)?;

    let result = build(&root);
    // Everything but the root mount goes first; then the placeholder resolv.conf (if the
    // image had none) is removed through it, leaving no trace in the layer.
    let overlay = mounts.0.remove(0);
    drop(mounts);
    if created_resolv {
        let _ = fs::remove_file(&resolv);
    }
    // The device nodes and links lived on the tmpfs, now gone: the upper dir keeps
    // only what the build itself wrote. An error of the build wins over one here.
    let unmounted = umount2(&overlay, MntFlags::empty())
        .or_else(|_| umount2(&overlay, MntFlags::MNT_DETACH))
        .map_err(mount_err(format!("unmounting {}", overlay.display())));
    let value = result?;
    unmounted?;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileTypeExt;

    fn lower_layer(dir: &Path, with_resolv: bool) -> PathBuf {
        let layer = dir.join("lower");
        for sub in ["proc", "sys", "dev", "etc", "tmp"] {
            fs::create_dir_all(layer.join(sub)).unwrap();
        }
        if with_resolv {
            fs::write(layer.join("etc/resolv.conf"), "nameserver 192.0.2.1\n").unwrap();
        }
        layer
    }

    fn mounted_anywhere(path: &Path, table: &str) -> bool {
        fs::read_to_string(table).unwrap().contains(path.to_str().unwrap())
    }

    fn require_root() {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(unsafe { libc::geteuid() }, 0, "mounting needs root");
    }

    #[test]
    fn the_build_root_is_private_and_leaves_only_what_the_build_wrote() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        for with_resolv in [true, false] {
            let lower = lower_layer(&tmp.path().join(format!("{with_resolv}")), with_resolv);
            let upper = tmp.path().join(format!("upper-{with_resolv}"));
            let scratch = tmp.path().join(format!("scratch-{with_resolv}"));
            fs::create_dir(&upper).unwrap();
            let seen = with_build_root(&[lower], &upper, &scratch, &|_| {}, |root, _| {
                // The host (the process's main thread) does not see the mounts.
                assert!(!mounted_anywhere(&scratch, "/proc/self/mountinfo"));
                assert!(mounted_anywhere(&scratch, "/proc/thread-self/mountinfo"));
                assert!(root.join("proc/self/status").is_file());
                let null = fs::metadata(root.join("dev/null")).unwrap();
                assert!(null.file_type().is_char_device());
                assert!(fs::write(root.join("sys/kernel/x"), "").is_err(), "sys is writable");
                assert_eq!(
                    fs::read(root.join("etc/resolv.conf")).unwrap(),
                    fs::read("/etc/resolv.conf").unwrap()
                );
                fs::write(root.join("etc/built"), "yes").unwrap();
                Ok(root.to_path_buf())
            })
            .unwrap();
            assert!(!mounted_anywhere(&seen, "/proc/self/mountinfo"));
            assert!(!scratch.exists(), "scratch left behind");
            let mut left: Vec<String> = walk(&upper);
            left.sort();
            assert_eq!(left, ["etc", "etc/built"], "with resolv.conf: {with_resolv}");
        }
    }

    #[test]
    fn with_no_lower_layer_the_build_writes_into_the_layer_itself() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        // A bottom layer as debootstrap leaves it, without a resolv.conf of its own.
        let layer = lower_layer(tmp.path(), false);
        fs::write(layer.join("etc/os-release"), "ID=debian\n").unwrap();
        let scratch = tmp.path().join("scratch");
        with_build_root(&[], &layer, &scratch, &|_| {}, |root, _| {
            assert!(!mounted_anywhere(&layer, "/proc/self/mountinfo"));
            assert!(root.join("proc/self/status").is_file());
            assert_eq!(fs::read_to_string(root.join("etc/os-release")).unwrap(), "ID=debian\n");
            assert_eq!(
                fs::read(root.join("etc/resolv.conf")).unwrap(),
                fs::read("/etc/resolv.conf").unwrap()
            );
            fs::write(root.join("etc/built"), "yes").unwrap();
            Ok(())
        })
        .unwrap();
        assert!(!mounted_anywhere(&scratch, "/proc/self/mountinfo"));
        assert!(!scratch.exists(), "scratch left behind");
        let mut left = walk(&layer);
        left.sort();
        assert_eq!(
            left,
            ["dev", "etc", "etc/built", "etc/os-release", "proc", "sys", "tmp"],
            "the placeholder resolv.conf or a mount's contents stayed"
        );
    }

    fn walk(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for entry in fs::read_dir(dir).unwrap().filter_map(Result::ok) {
            let path = entry.path();
            out.push(path.file_name().unwrap().to_string_lossy().into_owned());
            if path.is_dir() {
                for sub in walk(&path) {
                    out.push(format!("{}/{sub}", path.file_name().unwrap().to_string_lossy()));
                }
            }
        }
        out
    }

    #[test]
    fn mounts_end_when_the_build_fails_or_panics() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let lower = lower_layer(tmp.path(), true);
        let (upper, scratch) = (tmp.path().join("upper"), tmp.path().join("scratch"));
        fs::create_dir(&upper).unwrap();
        let failed = with_build_root(
            std::slice::from_ref(&lower),
            &upper,
            &scratch,
            &|_| {},
            |_, _| -> Result<(), ImageError> { Err(ImageError::NotFound("the build's own error".into())) },
        );
        assert!(
            matches!(&failed, Err(ImageError::NotFound(m)) if m == "the build's own error"),
            "{failed:?}"
        );
        assert!(!mounted_anywhere(&scratch, "/proc/self/mountinfo"));
        assert!(!scratch.exists());

        let panicked = std::panic::catch_unwind(|| {
            with_build_root(
                std::slice::from_ref(&lower),
                &upper,
                &scratch,
                &|_| {},
                |_, _| -> Result<(), ImageError> { panic!("a bug in a builder") },
            )
        });
        assert!(panicked.is_err());
        assert!(!mounted_anywhere(&scratch, "/proc/self/mountinfo"));
    }

    #[test]
    fn progress_from_the_build_thread_reaches_the_caller_in_order() {
        require_root();
        let tmp = tempfile::tempdir().unwrap();
        let lower = lower_layer(tmp.path(), true);
        let upper = tmp.path().join("upper");
        fs::create_dir(&upper).unwrap();
        let caller = std::thread::current().id();
        let seen = std::cell::RefCell::new(Vec::new());
        with_build_root(
            &[lower],
            &upper,
            &tmp.path().join("scratch"),
            &|p| {
                assert_eq!(std::thread::current().id(), caller);
                seen.borrow_mut().push(p.message.clone());
            },
            |_, progress| {
                for m in ["one", "two", "three"] {
                    progress(&BuildProgress::new(super::super::BuildPhase::Install, m));
                }
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(*seen.borrow(), ["one", "two", "three"]);
    }
}
