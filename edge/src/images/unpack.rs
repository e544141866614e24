//! Unpacks one OCI layer (a tar stream) into a fresh directory that overlayfs can use as
//! a lower dir, hashing the stream for its diff_id on the way. Our own unpacker over the
//! `tar` crate's entries, because the tar stream comes from anyone:
//!
//! - Every path is walked from the layer's root with `openat(O_NOFOLLOW|O_DIRECTORY)`, one
//!   component at a time, so nothing is ever written through a symlink (or outside the
//!   layer): an entry whose parent is a symlink (`a -> /etc`, then `a/passwd`) is refused,
//!   as are `..` components and hard links to anything but an earlier file of the same
//!   layer. A leading `/` is dropped, as Docker does (`/etc/x` is the layer's `etc/x`).
//! - OCI whiteouts become overlayfs's: `.wh.<name>` a character device 0:0 at `<name>`,
//!   `.wh..wh..opq` the `trusted.overlay.opaque=y` xattr on its directory. A layer that
//!   whites out a path it also holds (or something below it), and malformed `.wh.` names
//!   (other `.wh..wh.` kinds, `.wh.` alone, a `.wh.` directory), are refused.
//! - Device files are refused (the only devices in a layer are the whiteouts we make;
//!   sandboxes mount their overlay nodev anyway); FIFOs are kept.
//! - Modes (setuid bits included: the overlay is nosuid, and a user namespace maps the
//!   owners), numeric owners as the tar has them (the sandbox's idmapped mounts map
//!   them), mtimes and `user.*`/`security.*` xattrs are kept, except
//!   `security.capability`, which is dropped; `trusted.*` (overlayfs's own marks) and
//!   `system.*` from an image are dropped.
//! - Limits: bytes of the tar stream and of file contents written (holes of sparse files
//!   count), entries, and path length ([`Limits`]).

use std::collections::HashSet;
use std::ffi::{CString, OsStr};
use std::fs::{self, File};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, openat};
use nix::sys::stat::{
    FchmodatFlags, Mode, SFlag, UtimensatFlags, fchmod, fchmodat, fstatat, futimens, mkdirat, mknodat, utimensat,
};
use nix::sys::time::TimeSpec;
use nix::unistd::{Gid, Uid, UnlinkatFlags, fchown, fchownat, linkat, symlinkat, unlinkat};
use sha2::{Digest, Sha256};

use super::ImageError;

/// Bytes one layer may unpack to (its tar stream, and separately the file contents it
/// writes, sparse holes included).
pub(super) const MAX_LAYER_BYTES: u64 = 64 << 30;
/// Bytes one image's layers may unpack to together.
pub(super) const MAX_IMAGE_BYTES: u64 = 64 << 30;
/// Entries in one layer (a full distribution image has about 30,000).
pub(super) const MAX_LAYER_ENTRIES: u64 = 2_000_000;
/// Bytes of one entry's path (Linux's PATH_MAX).
const MAX_PATH_BYTES: usize = 4096;
/// Bytes copied at a time into a layer's file.
const COPY_BUFFER: usize = 256 << 10;

/// What one layer may unpack to.
#[derive(Clone, Copy, Debug)]
pub(super) struct Limits {
    pub(super) bytes: u64,
    pub(super) entries: u64,
}

impl Limits {
    /// The limits of a layer of an image whose earlier layers unpacked to `image_bytes`.
    pub(super) fn for_image(image_bytes: u64) -> Self {
        Self {
            bytes: MAX_LAYER_BYTES.min(MAX_IMAGE_BYTES.saturating_sub(image_bytes)),
            entries: MAX_LAYER_ENTRIES,
        }
    }
}

/// What unpacking a layer gave.
#[derive(Debug)]
pub(super) struct Unpacked {
    /// `sha256:<hex>` of the uncompressed tar stream.
    pub(super) diff_id: String,
    /// File contents written.
    pub(super) bytes: u64,
}

/// The blob's contents, uncompressed: gzip and zstd are recognised by their magic
/// numbers (as Docker does, whatever the media type says), anything else is read as tar.
pub(super) fn decompress(file: File) -> io::Result<Box<dyn Read>> {
    let mut reader = BufReader::with_capacity(256 << 10, file);
    let head = reader.fill_buf()?;
    Ok(if head.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::MultiGzDecoder::new(reader))
    } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(zstd::stream::read::Decoder::with_buffer(reader)?)
    } else {
        Box::new(reader)
    })
}

/// Unpacks the tar stream `reader` into the new directory `dest` (created here, mode 0755,
/// owned by root). `layer` names the layer in errors.
pub(super) fn unpack_layer(
    reader: impl Read,
    dest: &Path,
    layer: &str,
    limits: Limits,
) -> Result<Unpacked, ImageError> {
    let io_error = |what: String| {
        move |e: io::Error| ImageError::Io {
            context: what,
            source: e,
        }
    };
    fs::create_dir(dest).map_err(io_error(format!("creating {}", dest.display())))?;
    let root: OwnedFd = File::open(dest)
        .map_err(io_error(format!("opening {}", dest.display())))?
        .into();
    fchmod(&root, Mode::from_bits_truncate(0o755))
        .map_err(|e| io_error(format!("chmod {}", dest.display()))(e.into()))?;
    let mut hashing = Hashing {
        inner: reader,
        hash: Sha256::new(),
        bytes: 0,
        limit: limits.bytes,
    };
    let mut unpacker = Unpacker {
        root,
        layer,
        limits,
        written: 0,
        entries: 0,
        present: HashSet::new(),
        linkable: HashSet::new(),
        whiteouts: HashSet::new(),
        dir_times: Vec::new(),
        cached_dir: None,
        buffer: Vec::new(),
    };
    let over_limit = |hashing: &Hashing<_>| ImageError::BadLayer {
        layer: layer.to_string(),
        reason: format!(
            "its tar stream passes the limit of {} bytes (at {})",
            limits.bytes, hashing.bytes
        ),
    };
    let result = {
        let mut archive = tar::Archive::new(&mut hashing);
        unpacker.all_entries(&mut archive)
    };
    if hashing.bytes > hashing.limit {
        return Err(over_limit(&hashing));
    }
    result?;
    // The end-of-archive blocks and any padding after them are part of the diff_id.
    if let Err(e) = io::copy(&mut hashing, &mut io::sink()) {
        return Err(if hashing.bytes > hashing.limit {
            over_limit(&hashing)
        } else {
            unpacker.stream_error(e)
        });
    }
    unpacker.set_dir_times();
    Ok(Unpacked {
        diff_id: format!("sha256:{}", hex::encode(hashing.hash.finalize())),
        bytes: unpacker.written,
    })
}

/// A reader that hashes and counts what passes, failing past `limit` bytes.
struct Hashing<R> {
    inner: R,
    hash: Sha256,
    bytes: u64,
    limit: u64,
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes += n as u64;
        if self.bytes > self.limit {
            return Err(io::Error::other("the layer passes its size limit"));
        }
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

/// An entry's metadata, as it is applied.
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
    xattrs: Vec<(CString, Vec<u8>)>,
}

struct Unpacker<'a> {
    /// The layer's root directory.
    root: OwnedFd,
    layer: &'a str,
    limits: Limits,
    /// File content bytes written so far.
    written: u64,
    entries: u64,
    /// Every path of this layer (entries and the parents made for them).
    present: HashSet<PathBuf>,
    /// Non-directories this layer made: what a hard link may name.
    linkable: HashSet<PathBuf>,
    /// Paths this layer whites out: nothing else of it may be there.
    whiteouts: HashSet<PathBuf>,
    /// Directory mtimes, set once everything inside them is written.
    dir_times: Vec<(PathBuf, i64)>,
    /// The last parent directory walked to (tar streams list a directory's files together).
    cached_dir: Option<(PathBuf, OwnedFd)>,
    /// Reused to copy file contents.
    buffer: Vec<u8>,
}

impl Unpacker<'_> {
    fn refuse(&self, entry: &[u8], reason: impl Into<String>) -> ImageError {
        ImageError::UnsafeEntry {
            layer: self.layer.to_string(),
            entry: String::from_utf8_lossy(entry).into_owned(),
            reason: reason.into(),
        }
    }

    fn failed(&self, entry: &[u8], what: &str, e: impl Into<io::Error>) -> ImageError {
        ImageError::Io {
            context: format!("layer {}: {what} {:?}", self.layer, String::from_utf8_lossy(entry)),
            source: e.into(),
        }
    }

    fn stream_error(&self, e: io::Error) -> ImageError {
        ImageError::BadLayer {
            layer: self.layer.to_string(),
            reason: format!("its tar stream is malformed: {e}"),
        }
    }

    fn all_entries<R: Read>(&mut self, archive: &mut tar::Archive<R>) -> Result<(), ImageError> {
        for entry in archive.entries().map_err(|e| self.stream_error(e))? {
            let mut entry = entry.map_err(|e| self.stream_error(e))?;
            self.entries += 1;
            if self.entries > self.limits.entries {
                return Err(ImageError::BadLayer {
                    layer: self.layer.to_string(),
                    reason: format!("it has more than {} entries", self.limits.entries),
                });
            }
            self.entry(&mut entry)?;
        }
        Ok(())
    }

    fn entry<R: Read>(&mut self, entry: &mut tar::Entry<'_, R>) -> Result<(), ImageError> {
        let kind = entry.header().entry_type();
        if kind.is_pax_global_extensions() {
            return Ok(());
        }
        let raw = entry.path_bytes().into_owned();
        let path = normalize(&raw).map_err(|reason| self.refuse(&raw, reason))?;
        let Some(name) = path.file_name().map(OsStr::as_bytes) else {
            // The layer's root itself (`./`): it keeps the attributes we gave it.
            return match kind.is_dir() {
                true => Ok(()),
                false => Err(self.refuse(&raw, "names the layer's root as a non-directory")),
            };
        };
        let parent = path.parent().unwrap_or(Path::new("")).to_path_buf();
        if parent.iter().any(|c| c.as_bytes().starts_with(b".wh.")) {
            return Err(self.refuse(&raw, "a whiteout name used as a directory"));
        }
        if name == b".wh..wh..opq" {
            return self.opaque(&raw, &parent);
        }
        if name.starts_with(b".wh..wh.") {
            return Err(self.refuse(&raw, "an unknown whiteout kind (only .wh..wh..opq is defined)"));
        }
        if let Some(target) = name.strip_prefix(b".wh.") {
            if matches!(target, b"" | b"." | b"..") {
                return Err(self.refuse(&raw, "a malformed whiteout name"));
            }
            if kind.is_dir() {
                return Err(self.refuse(&raw, "a whiteout that is a directory"));
            }
            return self.whiteout(&raw, &parent, OsStr::from_bytes(target));
        }
        if path.ancestors().any(|a| self.whiteouts.contains(a)) {
            return Err(self.refuse(&raw, "this layer also whites it out (or a directory above it)"));
        }
        let meta = self.meta(&raw, entry)?;
        use tar::EntryType as T;
        match kind {
            T::Regular | T::Continuous | T::GNUSparse => self.file(&raw, &path, entry, &meta),
            T::Directory => self.directory(&raw, &path, &meta),
            T::Symlink => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .ok_or_else(|| self.refuse(&raw, "a symlink without a target"))?;
                self.symlink(&raw, &path, &target, &meta)
            }
            T::Link => {
                let target = entry
                    .link_name_bytes()
                    .map(|t| t.into_owned())
                    .ok_or_else(|| self.refuse(&raw, "a hard link without a target"))?;
                self.hard_link(&raw, &path, &target)
            }
            T::Fifo => self.fifo(&raw, &path, &meta),
            T::Char | T::Block => Err(self.refuse(
                &raw,
                "a device file (image layers may not carry devices; whiteouts are .wh. files)",
            )),
            other => Err(self.refuse(&raw, format!("an unsupported tar entry type {other:?}"))),
        }
    }

    fn meta<R: Read>(&self, raw: &[u8], entry: &mut tar::Entry<'_, R>) -> Result<Meta, ImageError> {
        let header = entry.header();
        let bad = |what: &str, e: io::Error| self.refuse(raw, format!("unreadable {what}: {e}"));
        let mode = header.mode().map_err(|e| bad("mode", e))? & 0o7777;
        let id = |v: u64, what: &str| {
            u32::try_from(v).map_err(|_| self.refuse(raw, format!("{what} {v} is not a 32-bit id")))
        };
        let uid = id(header.uid().map_err(|e| bad("uid", e))?, "uid")?;
        let gid = id(header.gid().map_err(|e| bad("gid", e))?, "gid")?;
        let mut mtime = i64::try_from(header.mtime().map_err(|e| bad("mtime", e))?).unwrap_or(i64::MAX);
        let mut xattrs = Vec::new();
        if let Some(pax) = entry.pax_extensions().map_err(|e| bad("pax header", e))? {
            for ext in pax {
                let ext = ext.map_err(|e| bad("pax header", e))?;
                let key = ext.key_bytes();
                if key == b"mtime" {
                    // Seconds, with an optional fraction (`1700000000.123`).
                    let value = String::from_utf8_lossy(ext.value_bytes()).into_owned();
                    let whole = value.split('.').next().unwrap_or("");
                    if let Ok(t) = whole.parse::<i64>() {
                        mtime = t;
                    }
                } else if let Some(name) = key.strip_prefix(b"SCHILY.xattr.")
                    && keep_xattr(name)
                    && let Ok(name) = CString::new(name)
                {
                    xattrs.push((name, ext.value_bytes().to_vec()));
                }
            }
        }
        Ok(Meta {
            mode,
            uid,
            gid,
            mtime,
            xattrs,
        })
    }

    /// The directory `dir` (relative to the root) opened, walked without following
    /// symlinks; missing directories are made (mode 0755, root) when `create`.
    fn open_dir(&mut self, raw: &[u8], dir: &Path, create: bool) -> Result<OwnedFd, ImageError> {
        if let Some((cached, fd)) = &self.cached_dir
            && cached == dir
        {
            return fd.try_clone().map_err(|e| self.failed(raw, "opening the parent of", e));
        }
        let mut fd = self.root.try_clone().map_err(|e| self.failed(raw, "opening", e))?;
        let mut walked = PathBuf::new();
        for component in dir.iter() {
            walked.push(component);
            let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
            fd = match openat(&fd, component, flags, Mode::empty()) {
                Ok(next) => next,
                Err(Errno::ENOENT) if create => {
                    mkdirat(&fd, component, Mode::from_bits_truncate(0o755))
                        .map_err(|e| self.failed(raw, "making the parents of", e))?;
                    let next = openat(&fd, component, flags, Mode::empty())
                        .map_err(|e| self.failed(raw, "making the parents of", e))?;
                    // Whatever the umask.
                    fchmod(&next, Mode::from_bits_truncate(0o755))
                        .map_err(|e| self.failed(raw, "making the parents of", e))?;
                    self.present.insert(walked.clone());
                    next
                }
                Err(Errno::ELOOP | Errno::ENOTDIR) => {
                    let symlink = fstatat(&fd, component, AtFlags::AT_SYMLINK_NOFOLLOW)
                        .is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK);
                    let what = match symlink {
                        true => "the symlink",
                        false => "the non-directory",
                    };
                    return Err(self.refuse(raw, format!("it would be written through {what} {}", walked.display())));
                }
                Err(Errno::ENOENT) => {
                    return Err(self.refuse(raw, format!("{} is not in this layer", walked.display())));
                }
                Err(e) => return Err(self.failed(raw, "walking to", e)),
            };
        }
        let copy = fd.try_clone().map_err(|e| self.failed(raw, "opening", e))?;
        self.cached_dir = Some((dir.to_path_buf(), copy));
        Ok(fd)
    }

    /// The parent of `path`, opened, with whatever was at `path` removed, unless both it
    /// and the new entry are directories (then the directory is kept and `true` returned).
    fn prepare(&mut self, raw: &[u8], path: &Path, new_is_dir: bool) -> Result<(OwnedFd, bool), ImageError> {
        let parent = self.open_dir(raw, path.parent().unwrap_or(Path::new("")), true)?;
        let name = path.file_name().expect("entries have names");
        let existing = match fstatat(&parent, name, AtFlags::AT_SYMLINK_NOFOLLOW) {
            Ok(st) => SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT,
            Err(Errno::ENOENT) => return Ok((parent, false)),
            Err(e) => return Err(self.failed(raw, "checking", e)),
        };
        if existing == SFlag::S_IFDIR && new_is_dir {
            return Ok((parent, true));
        }
        // A later entry replaces an earlier one (tar semantics).
        self.cached_dir = None;
        self.linkable.remove(path);
        if existing == SFlag::S_IFDIR {
            // remove_dir_all does not follow symlinks; the fd's magic link is the parent.
            let at = PathBuf::from(format!("/proc/self/fd/{}", parent.as_raw_fd())).join(name);
            fs::remove_dir_all(&at).map_err(|e| self.failed(raw, "replacing", e))?;
        } else {
            unlinkat(&parent, name, UnlinkatFlags::NoRemoveDir).map_err(|e| self.failed(raw, "replacing", e))?;
        }
        Ok((parent, false))
    }

    fn file<R: Read>(&mut self, raw: &[u8], path: &Path, entry: &mut R, meta: &Meta) -> Result<(), ImageError> {
        let (parent, _) = self.prepare(raw, path, false)?;
        let name = path.file_name().expect("entries have names");
        let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = openat(&parent, name, flags, Mode::from_bits_truncate(0o600))
            .map_err(|e| self.failed(raw, "creating", e))?;
        let mut file = File::from(fd);
        // Read errors are the tar stream's (or its limit's), write errors the disk's.
        let mut buffer = std::mem::take(&mut self.buffer);
        buffer.resize(COPY_BUFFER, 0);
        let copied = loop {
            let n = match entry.read(&mut buffer) {
                Ok(0) => break Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => break Err(self.stream_error(e)),
            };
            self.written += n as u64;
            if self.written > self.limits.bytes {
                break Err(ImageError::BadLayer {
                    layer: self.layer.to_string(),
                    reason: format!("its files pass the limit of {} bytes", self.limits.bytes),
                });
            }
            if let Err(e) = file.write_all(&buffer[..n]) {
                break Err(self.failed(raw, "writing", e));
            }
        };
        self.buffer = buffer;
        copied?;
        let fd = OwnedFd::from(file);
        self.apply(raw, &fd, meta)?;
        self.present.insert(path.to_path_buf());
        self.linkable.insert(path.to_path_buf());
        Ok(())
    }

    fn directory(&mut self, raw: &[u8], path: &Path, meta: &Meta) -> Result<(), ImageError> {
        let (parent, exists) = self.prepare(raw, path, true)?;
        let name = path.file_name().expect("entries have names");
        if !exists {
            mkdirat(&parent, name, Mode::from_bits_truncate(0o700)).map_err(|e| self.failed(raw, "creating", e))?;
        }
        let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
        let fd = openat(&parent, name, flags, Mode::empty()).map_err(|e| self.failed(raw, "opening", e))?;
        self.apply(raw, &fd, meta)?;
        self.present.insert(path.to_path_buf());
        self.dir_times.push((path.to_path_buf(), meta.mtime));
        Ok(())
    }

    fn symlink(&mut self, raw: &[u8], path: &Path, target: &[u8], meta: &Meta) -> Result<(), ImageError> {
        let (parent, _) = self.prepare(raw, path, false)?;
        let name = path.file_name().expect("entries have names");
        symlinkat(OsStr::from_bytes(target), &parent, name).map_err(|e| self.failed(raw, "creating", e))?;
        self.owner_and_time_at(raw, &parent, name, meta)?;
        self.present.insert(path.to_path_buf());
        self.linkable.insert(path.to_path_buf());
        Ok(())
    }

    fn hard_link(&mut self, raw: &[u8], path: &Path, target: &[u8]) -> Result<(), ImageError> {
        let target =
            normalize(target).map_err(|reason| self.refuse(raw, format!("a hard link whose target has {reason}")))?;
        if !self.linkable.contains(&target) {
            return Err(self.refuse(
                raw,
                format!(
                    "a hard link to {}, which is not an earlier file of this layer",
                    target.display()
                ),
            ));
        }
        if target == path {
            return Ok(());
        }
        let target_dir = self.open_dir(raw, target.parent().unwrap_or(Path::new("")), false)?;
        let target_name = target.file_name().expect("linkable paths have names");
        let (parent, _) = self.prepare(raw, path, false)?;
        let name = path.file_name().expect("entries have names");
        // Without AT_SYMLINK_FOLLOW: a link to a symlink is a link to the symlink itself.
        linkat(&target_dir, target_name, &parent, name, AtFlags::empty())
            .map_err(|e| self.failed(raw, "linking", e))?;
        self.present.insert(path.to_path_buf());
        self.linkable.insert(path.to_path_buf());
        Ok(())
    }

    fn fifo(&mut self, raw: &[u8], path: &Path, meta: &Meta) -> Result<(), ImageError> {
        let (parent, _) = self.prepare(raw, path, false)?;
        let name = path.file_name().expect("entries have names");
        mknodat(&parent, name, SFlag::S_IFIFO, Mode::from_bits_truncate(0o600), 0)
            .map_err(|e| self.failed(raw, "creating", e))?;
        fchownat(
            &parent,
            name,
            Some(Uid::from_raw(meta.uid)),
            Some(Gid::from_raw(meta.gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.failed(raw, "chown", e))?;
        // The FIFO we just made (this directory is private to us): no symlink to follow.
        fchmodat(
            &parent,
            name,
            Mode::from_bits_truncate(meta.mode),
            FchmodatFlags::FollowSymlink,
        )
        .map_err(|e| self.failed(raw, "chmod", e))?;
        self.owner_and_time_at(raw, &parent, name, meta)?;
        self.present.insert(path.to_path_buf());
        self.linkable.insert(path.to_path_buf());
        Ok(())
    }

    /// `.wh.<target>` in `dir`: a 0:0 character device at `dir/target`.
    fn whiteout(&mut self, raw: &[u8], dir: &Path, target: &OsStr) -> Result<(), ImageError> {
        let path = dir.join(target);
        if self.present.contains(&path) {
            return Err(self.refuse(
                raw,
                format!("it whites out {}, which this layer also holds", path.display()),
            ));
        }
        if !self.whiteouts.insert(path) {
            return Ok(()); // the same whiteout twice
        }
        let parent = self.open_dir(raw, dir, true)?;
        mknodat(
            &parent,
            target,
            SFlag::S_IFCHR,
            Mode::empty(),
            nix::sys::stat::makedev(0, 0),
        )
        .map_err(|e| self.failed(raw, "making the overlay whiteout for", e))?;
        Ok(())
    }

    /// `.wh..wh..opq` in `dir`: hide the lower layers' contents of `dir`.
    fn opaque(&mut self, raw: &[u8], dir: &Path) -> Result<(), ImageError> {
        if dir.ancestors().any(|a| self.whiteouts.contains(a)) {
            return Err(self.refuse(raw, "this layer also whites out its directory"));
        }
        let fd = self.open_dir(raw, dir, true)?;
        set_xattr(&fd, c"trusted.overlay.opaque", b"y")
            .map_err(|e| self.failed(raw, "marking opaque the directory of", e))
    }

    /// Owner, then mode (a chown clears setuid bits), xattrs and mtime of an open file or
    /// directory (a directory's mtime is set at the end).
    fn apply(&self, raw: &[u8], fd: &OwnedFd, meta: &Meta) -> Result<(), ImageError> {
        fchown(fd, Some(Uid::from_raw(meta.uid)), Some(Gid::from_raw(meta.gid)))
            .map_err(|e| self.failed(raw, "chown", e))?;
        fchmod(fd, Mode::from_bits_truncate(meta.mode)).map_err(|e| self.failed(raw, "chmod", e))?;
        for (name, value) in &meta.xattrs {
            if let Err(e) = set_xattr(fd, name, value) {
                let unsupported = matches!(e.raw_os_error(), Some(libc::EOPNOTSUPP));
                // security.* xattrs (SELinux labels, IMA) depend on the host: best effort.
                if !unsupported && !name.as_bytes().starts_with(b"security.") {
                    return Err(self.failed(raw, &format!("setting xattr {name:?} of"), e));
                }
            }
        }
        let time = TimeSpec::new(meta.mtime, 0);
        futimens(fd, &time, &time).map_err(|e| self.failed(raw, "setting the mtime of", e))
    }

    fn owner_and_time_at(&self, raw: &[u8], parent: &OwnedFd, name: &OsStr, meta: &Meta) -> Result<(), ImageError> {
        fchownat(
            parent,
            name,
            Some(Uid::from_raw(meta.uid)),
            Some(Gid::from_raw(meta.gid)),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.failed(raw, "chown", e))?;
        let time = TimeSpec::new(meta.mtime, 0);
        utimensat(parent, name, &time, &time, UtimensatFlags::NoFollowSymlink)
            .map_err(|e| self.failed(raw, "setting the mtime of", e))
    }

    /// Directory mtimes, now that nothing more is written inside them (best effort: a
    /// directory replaced later in the stream is skipped).
    fn set_dir_times(&mut self) {
        let times = std::mem::take(&mut self.dir_times);
        for (path, mtime) in times.iter().rev() {
            if let Ok(fd) = self.open_dir(b"", path, false) {
                let time = TimeSpec::new(*mtime, 0);
                let _ = futimens(&fd, &time, &time);
            }
        }
    }
}

/// An entry's path relative to the layer root: empty and `.` components dropped, a
/// leading `/` too (as Docker does); `..` refused.
fn normalize(raw: &[u8]) -> Result<PathBuf, String> {
    if raw.len() > MAX_PATH_BYTES {
        return Err(format!("a path longer than {MAX_PATH_BYTES} bytes"));
    }
    let mut path = PathBuf::new();
    for component in raw.split(|b| *b == b'/') {
        match component {
            b"" | b"." => {}
            b".." => return Err("a `..` component".into()),
            c => path.push(OsStr::from_bytes(c)),
        }
    }
    Ok(path)
}

/// Which of an image's xattrs a layer keeps: `user.*` and `security.*` but file
/// capabilities; never `trusted.*` (overlayfs's own marks come only from whiteouts) or
/// `system.*`.
fn keep_xattr(name: &[u8]) -> bool {
    name.starts_with(b"user.") || (name.starts_with(b"security.") && name != b"security.capability")
}

fn set_xattr(fd: &OwnedFd, name: &std::ffi::CStr, value: &[u8]) -> io::Result<()> {
    // SAFETY: fsetxattr on an fd we own, with a C string and a buffer of the given length.
    let rc = unsafe { libc::fsetxattr(fd.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests;
