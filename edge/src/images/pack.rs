//! Layers made on this machine from a directory tree in overlayfs's form (a sandbox's
//! writable layer, or a snapshot's copy of one): written as an OCI layer tar, then stored
//! like any pulled layer, under its diff_id (`layers/sha256-<hex>`).
//!
//! [`write_layer`] walks the tree without following symlinks, each directory's entries in
//! byte order and a directory before what it holds, and writes a tar that depends only on
//! the tree: numeric owners as on disk (a sandbox's own ids), modes without setuid and
//! setgid bits, whole-second mtimes, `user.*` and `security.*` xattrs but
//! `security.capability` (PAX records); overlay whiteouts (character devices 0:0) become
//! `.wh.<name>`, opaque directories (`trusted.overlay.opaque=y`) `.wh..wh..opq`, and a
//! file's further hard links links to its first path. Sockets and devices are left out (a
//! layer holds none). What the caller's `skip` says is left out with all it holds; a
//! whiteout never is: it hides, it reveals nothing.
//!
//! Privileges are dropped in the tar itself, not after unpacking: the diff_id then names
//! exactly what is stored.
//!
//! [`ImageStore::add_layer`] unpacks the tar with the unpacker pulled layers go through
//! (`unpack.rs`: so a packed layer obeys the same rules), checks its diff_id, and publishes
//! it under the layer's lock, as `layers.rs` does for pulls; a layer already there is kept.

use std::collections::HashMap;
use std::ffi::{CString, OsStr};
use std::fs::{self, File};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::layers::{TmpPath, layer_id, sync_file_system};
use super::{ImageError, ImageStore, io_err, unpack};

/// What [`write_layer`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerTar {
    /// `sha256:<hex>` of the tar.
    pub diff_id: String,
    /// Entries written (whiteouts and opaque marks included).
    pub entries: u64,
    /// Paths left out: the caller's `skip` (counted once per skipped subtree), sockets and
    /// devices.
    pub left_out: u64,
}

/// A private directory in the store's `tmp/` (`pack.<pid>.<random>.<host>`), removed with
/// everything in it when dropped; a process that died leaves it to the next pull.
pub struct ScratchDir(TmpPath);

impl ScratchDir {
    pub fn path(&self) -> &Path {
        self.0.path()
    }
}

impl ImageStore {
    /// A new private scratch directory for making layers (see [`ScratchDir`]).
    pub fn scratch_dir(&self) -> Result<ScratchDir, ImageError> {
        let tmp = TmpPath::new(self, "pack");
        fs::create_dir(tmp.path()).map_err(io_err(format!("creating {}", tmp.path().display())))?;
        Ok(ScratchDir(tmp))
    }

    /// Stores the layer tar at `tar`, whose diff_id [`write_layer`] gave as `diff_id`, as
    /// `layers/sha256-<hex>` (unless it is there already) and returns its id.
    pub fn add_layer(&self, tar: &Path, diff_id: &str) -> Result<String, ImageError> {
        let id = layer_id(diff_id);
        if !id.starts_with("sha256-") {
            return Err(ImageError::BadLayer {
                layer: diff_id.to_string(),
                reason: "a diff_id is sha256:<hex>".into(),
            });
        }
        if self.layer_path(&id).is_dir() {
            return Ok(id);
        }
        let _lock = self.lock_layer(&id)?;
        if self.layer_path(&id).is_dir() {
            return Ok(id); // published meanwhile by another edge sharing the store
        }
        let staging = self.scratch_dir()?;
        let file = File::open(tar).map_err(io_err(format!("opening {}", tar.display())))?;
        let unpacked = unpack::unpack_layer(
            BufReader::with_capacity(256 << 10, file),
            &staging.path().join(&id),
            &id,
            unpack::Limits::for_image(0),
        )?;
        if unpacked.diff_id != diff_id {
            return Err(ImageError::DigestMismatch {
                what: format!("the packed layer {}", tar.display()),
                expected: diff_id.to_string(),
                actual: unpacked.diff_id,
            });
        }
        sync_file_system(staging.path())?;
        match fs::rename(staging.path().join(&id), self.layer_path(&id)) {
            Ok(()) => Ok(id),
            // Published by an edge whose lock we could not see: the same contents.
            Err(e) if matches!(e.raw_os_error(), Some(libc::EEXIST | libc::ENOTEMPTY)) => Ok(id),
            Err(e) => Err(io_err(format!("publishing layer {id}"))(e)),
        }
    }
}

/// Writes the tree `dir` as an OCI layer tar into the new file `out` (see the module doc).
/// `skip` gets each path relative to `dir` (`root/.cache`) and says whether to leave it
/// out, with all it holds.
pub fn write_layer(dir: &Path, out: &Path, skip: &dyn Fn(&Path) -> bool) -> Result<LayerTar, ImageError> {
    write_tree(dir, out, skip, false)
}

/// Writes a layer of the store (`layers/<id>`) as an OCI layer tar into the new file
/// `out`, as [`write_layer`] does but keeping setuid and setgid bits as stored (a pulled
/// image's `sudo` stays one when the image is pushed: `push.rs`).
pub fn write_stored_layer(dir: &Path, out: &Path) -> Result<LayerTar, ImageError> {
    write_tree(dir, out, &|_| false, true)
}

fn write_tree(dir: &Path, out: &Path, skip: &dyn Fn(&Path) -> bool, keep_setuid: bool) -> Result<LayerTar, ImageError> {
    let file = File::options()
        .write(true)
        .create_new(true)
        .open(out)
        .map_err(io_err(format!("creating {}", out.display())))?;
    let mut w = Writer {
        tar: tar::Builder::new(Hashing {
            inner: BufWriter::with_capacity(256 << 10, file),
            hash: Sha256::new(),
        }),
        dir,
        skip,
        keep_setuid,
        links: HashMap::new(),
        entries: 0,
        left_out: 0,
    };
    w.directory(Path::new(""))?;
    w.tar.finish().map_err(io_err(format!("writing {}", out.display())))?;
    let (entries, left_out) = (w.entries, w.left_out);
    let mut hashing = w
        .tar
        .into_inner()
        .map_err(io_err(format!("writing {}", out.display())))?;
    hashing.flush().map_err(io_err(format!("writing {}", out.display())))?;
    let file = hashing
        .inner
        .into_inner()
        .map_err(|e| io_err(format!("writing {}", out.display()))(e.into_error()))?;
    file.sync_all().map_err(io_err(format!("syncing {}", out.display())))?;
    Ok(LayerTar {
        diff_id: format!("sha256:{}", hex::encode(hashing.hash.finalize())),
        entries,
        left_out,
    })
}

/// A writer that hashes what passes.
struct Hashing<W> {
    inner: W,
    hash: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

struct Writer<'a, W: Write> {
    tar: tar::Builder<Hashing<W>>,
    dir: &'a Path,
    skip: &'a dyn Fn(&Path) -> bool,
    /// Whether setuid and setgid bits are written (a stored layer's) or dropped (a pack's).
    keep_setuid: bool,
    /// (device, inode) of files with several links -> the path first written.
    links: HashMap<(u64, u64), PathBuf>,
    entries: u64,
    left_out: u64,
}

/// What an entry's xattrs say, as a layer carries them.
#[derive(Default)]
struct Xattrs {
    /// `SCHILY.xattr.<name>` records.
    kept: Vec<(String, Vec<u8>)>,
    opaque: bool,
}

impl<W: Write> Writer<'_, W> {
    fn failed(&self, rel: &Path, what: &str) -> impl FnOnce(io::Error) -> ImageError {
        io_err(format!("packing {}: {what} {}", self.dir.display(), rel.display()))
    }

    fn refuse(&self, rel: &Path, reason: impl Into<String>) -> ImageError {
        ImageError::UnsafeEntry {
            layer: self.dir.display().to_string(),
            entry: rel.display().to_string(),
            reason: reason.into(),
        }
    }

    /// Directory `rel` (relative to the tree; "" for its root, which has no entry) and
    /// everything below it.
    fn directory(&mut self, rel: &Path) -> Result<(), ImageError> {
        let path = self.dir.join(rel);
        let mut names: Vec<_> = fs::read_dir(&path)
            .map_err(self.failed(rel, "listing"))?
            .map(|e| e.map(|e| e.file_name()))
            .collect::<Result<_, _>>()
            .map_err(self.failed(rel, "listing"))?;
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        for name in names {
            self.entry(&rel.join(&name), &name)?;
        }
        Ok(())
    }

    fn entry(&mut self, rel: &Path, name: &OsStr) -> Result<(), ImageError> {
        let path = self.dir.join(rel);
        let meta = fs::symlink_metadata(&path).map_err(self.failed(rel, "reading"))?;
        let kind = meta.file_type();
        // A deletion of a lower file: never left out.
        if kind.is_char_device() && meta.rdev() == 0 {
            let mut wh = name.as_bytes().to_vec();
            wh.splice(0..0, b".wh.".iter().copied());
            let at = rel.with_file_name(OsStr::from_bytes(&wh));
            return self.append_marker(&at);
        }
        if (self.skip)(rel) {
            self.left_out += 1;
            return Ok(());
        }
        if kind.is_socket() || kind.is_char_device() || kind.is_block_device() {
            self.left_out += 1;
            return Ok(());
        }
        if name.as_bytes().starts_with(b".wh.") {
            return Err(self.refuse(
                rel,
                "a name starting with .wh. cannot be packed (OCI layers spell deletions so): rename it or scrub it",
            ));
        }
        let xattrs = self.xattrs(rel, &path)?;
        let mut header = tar::Header::new_gnu();
        header.set_uid(meta.uid().into());
        header.set_gid(meta.gid().into());
        let privileged = if self.keep_setuid { 0 } else { 0o6000 };
        header.set_mode(meta.mode() & 0o7777 & !privileged);
        header.set_mtime(meta.mtime().max(0) as u64);
        header.set_size(0);
        if !xattrs.kept.is_empty() {
            let records = xattrs.kept.iter().map(|(k, v)| (k.as_str(), v.as_slice()));
            self.tar
                .append_pax_extensions(records)
                .map_err(self.failed(rel, "writing"))?;
        }
        self.entries += 1;
        if kind.is_dir() {
            header.set_entry_type(tar::EntryType::Directory);
            self.tar
                .append_data(&mut header, rel, io::empty())
                .map_err(self.failed(rel, "writing"))?;
            if xattrs.opaque {
                self.append_marker(&rel.join(".wh..wh..opq"))?;
            }
            return self.directory(rel);
        }
        if kind.is_symlink() {
            let target = fs::read_link(&path).map_err(self.failed(rel, "reading the link"))?;
            header.set_entry_type(tar::EntryType::Symlink);
            return self
                .tar
                .append_link(&mut header, rel, target)
                .map_err(self.failed(rel, "writing"));
        }
        if meta.nlink() > 1 {
            let key = (meta.dev(), meta.ino());
            if let Some(first) = self.links.get(&key) {
                header.set_entry_type(tar::EntryType::Link);
                let first = first.clone();
                return self
                    .tar
                    .append_link(&mut header, rel, first)
                    .map_err(self.failed(rel, "writing"));
            }
            self.links.insert(key, rel.to_path_buf());
        }
        if kind.is_fifo() {
            header.set_entry_type(tar::EntryType::Fifo);
            return self
                .tar
                .append_data(&mut header, rel, io::empty())
                .map_err(self.failed(rel, "writing"));
        }
        // A regular file.
        let file = File::options()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(self.failed(rel, "opening"))?;
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(meta.len());
        let data = Exactly {
            inner: file.take(meta.len()),
            left: meta.len(),
        };
        self.tar
            .append_data(&mut header, rel, data)
            .map_err(self.failed(rel, "writing"))
    }

    /// An empty file whose name is the mark: a whiteout (`.wh.<name>`) or an opaque
    /// directory's `.wh..wh..opq`. Its owner, mode and time are zeros (they mean nothing).
    fn append_marker(&mut self, rel: &Path) -> Result<(), ImageError> {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_mode(0);
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(0);
        header.set_size(0);
        self.entries += 1;
        self.tar
            .append_data(&mut header, rel, io::empty())
            .map_err(self.failed(rel, "writing"))
    }

    /// The xattrs of `path` a layer keeps, sorted by name, and whether it is an opaque
    /// directory. Overlay's marks that change what a path means elsewhere (a renamed
    /// directory's redirect, a metadata-only copy) cannot be packed.
    fn xattrs(&self, rel: &Path, path: &Path) -> Result<Xattrs, ImageError> {
        let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| self.refuse(rel, "a NUL byte in its path"))?;
        let mut out = Xattrs::default();
        let names = list_xattrs(&c).map_err(self.failed(rel, "listing the xattrs of"))?;
        for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
            match name {
                b"trusted.overlay.opaque" => {
                    out.opaque = get_xattr(&c, name).map_err(self.failed(rel, "reading an xattr of"))? == b"y";
                }
                b"trusted.overlay.redirect" | b"trusted.overlay.metacopy" => {
                    return Err(self.refuse(
                        rel,
                        format!(
                            "overlayfs marked it {} (a renamed directory, or a copy of metadata only), \
                             which a pack cannot express",
                            String::from_utf8_lossy(name)
                        ),
                    ));
                }
                n if n == b"security.capability" => {}
                n if n.starts_with(b"user.") || n.starts_with(b"security.") => {
                    let Ok(key) = std::str::from_utf8(n) else { continue };
                    let value = get_xattr(&c, n).map_err(self.failed(rel, "reading an xattr of"))?;
                    out.kept.push((format!("SCHILY.xattr.{key}"), value));
                }
                _ => {} // overlay's bookkeeping (origin, impure, ...), ACLs
            }
        }
        out.kept.sort();
        Ok(out)
    }
}

/// Reads exactly `left` bytes: a file that shrank while it was read would otherwise leave
/// the tar short of what its header says.
struct Exactly<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exactly<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && self.left > 0 && !buf.is_empty() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the file shrank while it was packed",
            ));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

fn list_xattrs(path: &CString) -> io::Result<Vec<u8>> {
    loop {
        // SAFETY: llistxattr asking for the size only.
        let size = unsafe { libc::llistxattr(path.as_ptr(), std::ptr::null_mut(), 0) };
        if size < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOTSUP) => Ok(vec![]),
                _ => Err(e),
            };
        }
        let mut buf = vec![0u8; size as usize];
        // SAFETY: the buffer has the length given.
        let n = unsafe { libc::llistxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) {
            return Err(e); // ERANGE: it grew meanwhile; ask again
        }
    }
}

fn get_xattr(path: &CString, name: &[u8]) -> io::Result<Vec<u8>> {
    let name = CString::new(name).map_err(|_| io::Error::other("an xattr name with a NUL byte"))?;
    loop {
        // SAFETY: lgetxattr asking for the size only.
        let size = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
        if size < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; size as usize];
        // SAFETY: the buffer has the length given.
        let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if n >= 0 {
            buf.truncate(n as usize);
            return Ok(buf);
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) {
            return Err(e);
        }
    }
}
