//! A guest's two disks. The root disk of an image is an EROFS file system of the
//! image's merged layers (read-only by construction, no size to guess), one per list of
//! layer ids, cached as `<image store>/vmdisks/<image>-<key>.erofs`; a multi-layer image
//! is merged by a read-only overlay mounted in a private mount namespace of one thread,
//! so the mount never appears on the host. The writable disk of each VM is a sparse copy
//! of an empty ext4 template of its size (`vmdisks/empty-<MiB>M.ext4`), inode tables
//! initialised at mkfs time so the guest does not spend its (emulated) CPU on it.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use sha2::{Digest, Sha256};

use super::{VmError, io_err, lock_file, require_tool};
use crate::images::{Image, ImageStore};

/// Bumped when the way root disks are made changes.
const ROOT_DISK_VERSION: u32 = 1;

fn build_err(what: &str, message: impl Into<String>) -> VmError {
    VmError::Build {
        what: what.into(),
        message: message.into(),
    }
}

/// The cached EROFS root disk of `image`, built first if needed.
pub fn build_root_disk(store: &ImageStore, image: &Image, progress: &dyn Fn(&str)) -> Result<PathBuf, VmError> {
    let layers = store.layer_dirs(image)?;
    let mut digest = Sha256::new();
    digest.update(format!("erofs root disk v{ROOT_DISK_VERSION}\n"));
    for id in &image.layers {
        digest.update(format!("layer {id}\n"));
    }
    let key = &hex::encode(digest.finalize())[..16];
    let dir = store.root().join("vmdisks");
    fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let path = dir.join(format!("{}-{key}.erofs", image.file_stem()));
    if path.is_file() {
        return Ok(path);
    }
    let _lock = lock_file(&store.root().join("locks").join(format!("vmdisk-{key}.lock")))?;
    if path.is_file() {
        return Ok(path);
    }
    let mkfs = require_tool("mkfs.erofs", "erofs-utils")?;
    let tmp = dir.join(format!(".{key}.{}.tmp", std::process::id()));
    let _ = fs::remove_file(&tmp);
    progress(&format!("mkfs.erofs {} from {} layer(s)", path.display(), layers.len()));
    let result = if layers.len() == 1 {
        run_mkfs_erofs(&mkfs, &tmp, &layers[0])
    } else {
        let scratch = store
            .root()
            .join("tmp")
            .join(format!("vmdisk-{key}.{}", std::process::id()));
        let r = with_merged_layers(&layers, &scratch, |merged| run_mkfs_erofs(&mkfs, &tmp, merged));
        let _ = fs::remove_dir_all(&scratch);
        r
    };
    let result = result.and_then(|()| {
        fs::set_permissions(&tmp, std::os::unix::fs::PermissionsExt::from_mode(0o644))
            .map_err(io_err("chmod root disk"))?;
        fs::rename(&tmp, &path).map_err(io_err(format!("publishing {}", path.display())))
    });
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result.map(|()| path)
}

fn run_mkfs_erofs(mkfs: &Path, dest: &Path, source: &Path) -> Result<(), VmError> {
    let out = Command::new(mkfs)
        .arg("--quiet")
        .arg(dest)
        .arg(source)
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .map_err(io_err("running mkfs.erofs"))?;
    if !out.status.success() {
        return Err(build_err(
            "a root disk",
            format!(
                "mkfs.erofs {} {} failed ({}): {}",
                dest.display(),
                source.display(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        ));
    }
    Ok(())
}

/// Runs `f(merged)` on a thread whose private mount namespace has `layers` (bottom
/// first) mounted as one read-only overlay at `scratch/merged` (a single layer is
/// handed over as it is). What `f` mounts stays in that namespace too.
pub(crate) fn with_merged_layers<T: Send>(
    layers: &[PathBuf],
    scratch: &Path,
    f: impl FnOnce(&Path) -> Result<T, VmError> + Send,
) -> Result<T, VmError> {
    std::thread::scope(|s| {
        s.spawn(|| {
            let mount_err = |what: &str| {
                let what = what.to_string();
                move |e: nix::errno::Errno| VmError::io(what, io::Error::from(e))
            };
            // Only this thread (and what it spawns) gets the new namespace.
            unshare(CloneFlags::CLONE_NEWNS).map_err(mount_err("unshare(CLONE_NEWNS)"))?;
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .map_err(mount_err("making mounts private"))?;
            if let [only] = layers {
                return f(only);
            }
            let merged = scratch.join("merged");
            fs::create_dir_all(&merged).map_err(io_err(format!("creating {}", merged.display())))?;
            // overlayfs lists lower dirs top first; without an upper dir it is read-only.
            let lower: Vec<String> = layers
                .iter()
                .rev()
                .map(|p| p.to_string_lossy().replace(':', "\\:"))
                .collect();
            let options = format!("lowerdir={}", lower.join(":"));
            mount(
                Some("overlay"),
                &merged,
                Some("overlay"),
                MsFlags::MS_RDONLY,
                Some(options.as_str()),
            )
            .map_err(mount_err("mounting the image's layers"))?;
            let result = f(&merged);
            let _ = umount2(&merged, MntFlags::MNT_DETACH);
            result
        })
        .join()
        .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

/// Writes a fresh writable disk of `size_mb` MiB to `dest` (a sparse copy of a cached
/// empty ext4 template).
pub(crate) fn create_rw_disk(store: &ImageStore, size_mb: u64, dest: &Path) -> Result<(), VmError> {
    let template = rw_template(store, size_mb)?;
    sparse_copy(&template, dest)?;
    Ok(())
}

fn rw_template(store: &ImageStore, size_mb: u64) -> Result<PathBuf, VmError> {
    let dir = store.root().join("vmdisks");
    let path = dir.join(format!("empty-{size_mb}M.ext4"));
    if path.is_file() {
        return Ok(path);
    }
    fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let mkfs = require_tool("mkfs.ext4", "e2fsprogs")?;
    let tmp = dir.join(format!(".empty-{size_mb}M.{}.tmp", std::process::id()));
    let file = fs::File::create(&tmp).map_err(io_err(format!("creating {}", tmp.display())))?;
    file.set_len(size_mb << 20)
        .map_err(io_err(format!("sizing {}", tmp.display())))?;
    drop(file);
    let out = Command::new(mkfs)
        .args(["-q", "-F", "-m", "0", "-L", "opendsec-rw"])
        .args(["-E", "lazy_itable_init=0,lazy_journal_init=0"])
        .arg(&tmp)
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .map_err(io_err("running mkfs.ext4"))?;
    if !out.status.success() {
        let _ = fs::remove_file(&tmp);
        return Err(build_err(
            "the writable disk template",
            format!("mkfs.ext4 failed: {}", String::from_utf8_lossy(&out.stderr).trim()),
        ));
    }
    fs::rename(&tmp, &path).map_err(io_err(format!("publishing {}", path.display())))?;
    Ok(path)
}

/// `_IOW(0x94, 9, int)`: share `src`'s extents (XFS, btrfs; not ext4).
const FICLONE: libc::c_ulong = 0x4004_9409;

/// Copies `src` to `dst` (created or truncated): a reflink where the file system can
/// (constant time), else keeping holes: only the data extents are copied
/// (SEEK_DATA/SEEK_HOLE, then copy_file_range, which stays in the kernel). Returns the
/// number of bytes of data in the copy.
pub fn sparse_copy(src: &Path, dst: &Path) -> Result<u64, VmError> {
    let context = || format!("copying {} to {}", src.display(), dst.display());
    let input = fs::File::open(src).map_err(io_err(context()))?;
    let len = input.metadata().map_err(io_err(context()))?.len();
    let output = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(dst)
        .map_err(io_err(context()))?;
    let (ifd, ofd) = (input.as_raw_fd(), output.as_raw_fd());
    // SAFETY: FICLONE takes the source fd as its argument.
    if unsafe { libc::ioctl(ofd, FICLONE as _, ifd) } == 0 {
        return Ok(allocated_bytes(src));
    }
    output.set_len(len).map_err(io_err(context()))?;
    let mut copied = 0u64;
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: lseek on an fd we own.
        let data = unsafe { libc::lseek(ifd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let err = io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                break; // no data after pos
            }
            return Err(VmError::io(context(), err));
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(ifd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(VmError::io(context(), io::Error::last_os_error()));
        }
        let mut off_in = data;
        let mut off_out = data;
        while off_in < hole {
            // SAFETY: both fds are open; the offsets are ours.
            let n = unsafe { libc::copy_file_range(ifd, &mut off_in, ofd, &mut off_out, (hole - off_in) as usize, 0) };
            if n < 0 {
                let err = io::Error::last_os_error();
                if err.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(VmError::io(context(), err));
            }
            if n == 0 {
                break;
            }
            copied += n as u64;
        }
        pos = hole;
    }
    Ok(copied)
}

/// Bytes of `path` that are allocated on disk (its data, not its holes).
pub(crate) fn allocated_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_copy_keeps_holes_and_data() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        {
            use std::io::{Seek, SeekFrom, Write};
            let mut f = fs::File::create(&src).unwrap();
            f.set_len(64 << 20).unwrap();
            f.seek(SeekFrom::Start(10 << 20)).unwrap();
            f.write_all(&[7u8; 8192]).unwrap();
            f.seek(SeekFrom::Start(50 << 20)).unwrap();
            f.write_all(b"end").unwrap();
            f.sync_all().unwrap();
        }
        let dst = dir.path().join("dst");
        let copied = sparse_copy(&src, &dst).unwrap();
        assert!(copied < 1 << 20, "only the data extents are copied: {copied}");
        assert_eq!(fs::read(&src).unwrap(), fs::read(&dst).unwrap());
        assert!(allocated_bytes(&dst) < 1 << 20, "{}", allocated_bytes(&dst));
    }
}
