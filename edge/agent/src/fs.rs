//! filesystem.Filesystem: stat, list, make, move, remove and inotify watches,
//! all with the requesting user's permissions.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use crate::connect::{Code, RpcError};
use crate::fdio::Fd;
use crate::users::{self, Names, User, as_user};

// The request messages live in the library (`requests.rs`), where the fuzz targets
// decode them too.
pub use crate::requests::{MoveRequest, PathRequest, WatchRequest, WatcherIdRequest};

// ---- EntryInfo ----------------------------------------------------------------

/// RFC 3339 UTC time with nanoseconds, as protojson writes a Timestamp.
pub fn rfc3339(secs: i64, nanos: i64) -> String {
    let days = secs.div_euclid(86400);
    let rem = secs.rem_euclid(86400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719468;
    let era = z.div_euclid(146097);
    let doe = z - era * 146097;
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let (hh, mm, ss) = (rem / 3600, rem % 3600 / 60, rem % 60);
    if nanos > 0 {
        format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}.{nanos:09}Z")
    } else {
        format!("{y:04}-{m:02}-{d:02}T{hh:02}:{mm:02}:{ss:02}Z")
    }
}

fn perm_string(mode: u32, type_char: char) -> String {
    let mut s = String::with_capacity(10);
    s.push(type_char);
    let bits = ['r', 'w', 'x'];
    for i in (0..9).rev() {
        s.push(if mode & (1 << i) != 0 { bits[(8 - i) % 3] } else { '-' });
    }
    s
}

fn file_type(ft: std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        "FILE_TYPE_DIRECTORY"
    } else {
        "FILE_TYPE_FILE"
    }
}

/// EntryInfo of a path (not following a final symlink for the link fields;
/// `type` is the link target's type, with `isSymlink` set, as newer envd).
pub fn entry_info(path: &Path, names: &Names) -> std::io::Result<Value> {
    let lm = std::fs::symlink_metadata(path)?;
    let is_link = lm.file_type().is_symlink();
    let (ty, tc) = if is_link {
        match std::fs::metadata(path) {
            Ok(m) => (file_type(m.file_type()), 'L'),
            Err(_) => ("FILE_TYPE_FILE", 'L'),
        }
    } else if lm.is_dir() {
        ("FILE_TYPE_DIRECTORY", 'd')
    } else {
        ("FILE_TYPE_FILE", '-')
    };
    let mode = lm.mode() & 0o777;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "/".into());
    let mut v = json!({
        "name": name,
        "type": ty,
        "path": path.to_string_lossy(),
        "size": lm.size().to_string(),
        "mode": mode,
        "permissions": perm_string(mode, tc),
        "owner": names.user(lm.uid()),
        "group": names.group(lm.gid()),
        "modifiedTime": rfc3339(lm.mtime(), lm.mtime_nsec()),
    });
    if let Some(m) = crate::metadata::read(path) {
        v["metadata"] = json!(m);
    }
    if is_link {
        v["isSymlink"] = json!(true);
        let target = std::fs::canonicalize(path)
            .or_else(|_| std::fs::read_link(path).map(|t| path.parent().unwrap_or(Path::new("/")).join(t)))
            .unwrap_or_default();
        v["symlinkTarget"] = json!(target.to_string_lossy());
    }
    Ok(v)
}

// ---- unary operations ---------------------------------------------------------------

pub async fn stat(user: &User, req: PathRequest) -> Result<Value, RpcError> {
    let path = users::resolve_path(user, &req.path)?;
    users::blocking_as(user, move || {
        let e = entry_info(&path, &Names::load()).map_err(|e| RpcError::io(e, &path.display().to_string()))?;
        Ok(json!({ "entry": e }))
    })
    .await
}

pub async fn make_dir(user: &User, req: PathRequest) -> Result<Value, RpcError> {
    let path = users::resolve_path(user, &req.path)?;
    users::blocking_as(user, move || {
        let p = path.display().to_string();
        match std::fs::symlink_metadata(&path) {
            Ok(m) if m.is_dir() => {
                return Err(RpcError::new(
                    Code::AlreadyExists,
                    format!("directory {p} already exists"),
                ));
            }
            Ok(_) => {
                return Err(RpcError::new(
                    Code::AlreadyExists,
                    format!("path {p} already exists and is not a directory"),
                ));
            }
            Err(_) => {}
        }
        std::fs::create_dir_all(&path).map_err(|e| RpcError::io(e, &p))?;
        let e = entry_info(&path, &Names::load()).map_err(|e| RpcError::io(e, &p))?;
        Ok(json!({ "entry": e }))
    })
    .await
}

pub async fn rename(user: &User, req: MoveRequest) -> Result<Value, RpcError> {
    let src = users::resolve_path(user, &req.source)?;
    let dst = users::resolve_path(user, &req.destination)?;
    users::blocking_as(user, move || {
        std::fs::symlink_metadata(&src).map_err(|e| RpcError::io(e, &src.display().to_string()))?;
        if let Some(parent) = dst.parent() {
            std::fs::create_dir_all(parent).map_err(|e| RpcError::io(e, &parent.display().to_string()))?;
        }
        std::fs::rename(&src, &dst)
            .map_err(|e| RpcError::io(e, &format!("moving {} to {}", src.display(), dst.display())))?;
        let e = entry_info(&dst, &Names::load()).map_err(|e| RpcError::io(e, &dst.display().to_string()))?;
        Ok(json!({ "entry": e }))
    })
    .await
}

pub async fn remove(user: &User, req: PathRequest) -> Result<Value, RpcError> {
    let path = users::resolve_path(user, &req.path)?;
    users::blocking_as(user, move || {
        let p = path.display().to_string();
        let m = std::fs::symlink_metadata(&path).map_err(|e| RpcError::io(e, &p))?;
        if m.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        }
        .map_err(|e| RpcError::io(e, &p))?;
        Ok(json!({}))
    })
    .await
}

pub async fn list_dir(user: &User, req: PathRequest) -> Result<Value, RpcError> {
    let path = users::resolve_path(user, &req.path)?;
    let depth = req.depth.max(1);
    users::blocking_as(user, move || {
        let p = path.display().to_string();
        let m = std::fs::metadata(&path).map_err(|e| RpcError::io(e, &p))?;
        if !m.is_dir() {
            return Err(RpcError::invalid(format!("path {p} is not a directory")));
        }
        let names = Names::load();
        let mut out = Vec::new();
        walk(&path, depth, &names, &mut out).map_err(|e| RpcError::io(e, &p))?;
        Ok(json!({ "entries": out }))
    })
    .await
}

fn walk(dir: &Path, depth: u32, names: &Names, out: &mut Vec<Value>) -> std::io::Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)?.filter_map(|e| e.ok()).collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let p = e.path();
        let Ok(info) = entry_info(&p, names) else {
            continue;
        };
        out.push(info);
        let is_real_dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if depth > 1 && is_real_dir {
            // An unreadable subdirectory is listed but not descended into.
            let _ = walk(&p, depth - 1, names, out);
        }
    }
    Ok(())
}

// ---- watching ---------------------------------------------------------------------

const WATCH_MASK: u32 = libc::IN_CREATE
    | libc::IN_MODIFY
    | libc::IN_DELETE
    | libc::IN_DELETE_SELF
    | libc::IN_MOVED_FROM
    | libc::IN_MOVED_TO
    | libc::IN_MOVE_SELF
    | libc::IN_ATTRIB;

/// Events kept for a polled watcher between two GetWatcherEvents calls.
const WATCHER_BACKLOG: usize = 10_000;

pub struct Watch {
    fd: Fd,
    root: PathBuf,
    recursive: bool,
    include_entry: bool,
    user: User,
    /// Watch descriptor -> directory relative to the root.
    wds: HashMap<i32, PathBuf>,
}

impl Watch {
    /// Creates the inotify instance and its watches (as the user, so only
    /// directories the user may read are watched).
    pub fn new(user: &User, req: &WatchRequest) -> Result<Watch, RpcError> {
        let root = users::resolve_path(user, &req.path)?;
        let p = root.display().to_string();
        let m = as_user(user, || std::fs::metadata(&root)).map_err(|e| RpcError::io(e, &p))?;
        if !m.is_dir() {
            return Err(RpcError::invalid(format!("path {p} is not a directory")));
        }
        if !req.allow_network_mounts
            && let Some(kind) = as_user(user, || network_fs(&root))
        {
            return Err(RpcError::invalid(format!(
                "path {p} is on a network file system ({kind}), where watch events may not \
                 be delivered; set allow_network_mounts to watch it anyway"
            )));
        }
        // SAFETY: plain system call.
        let raw = unsafe { libc::inotify_init1(libc::IN_NONBLOCK | libc::IN_CLOEXEC) };
        if raw < 0 {
            return Err(RpcError::io(std::io::Error::last_os_error(), "inotify"));
        }
        // SAFETY: inotify_init1 returned a fresh descriptor.
        let fd = Fd::new(unsafe { OwnedFd::from_raw_fd(raw) }).map_err(|e| RpcError::io(e, "inotify"))?;
        let mut w = Watch {
            fd,
            root: root.clone(),
            recursive: req.recursive,
            include_entry: req.include_entry,
            user: user.clone(),
            wds: HashMap::new(),
        };
        let u = user.clone();
        as_user(&u, || w.add_tree(&root, PathBuf::new(), true)).map_err(|e| RpcError::io(e, &p))?;
        Ok(w)
    }

    /// Runs with the user's credentials (caller's duty).
    fn add_tree(&mut self, abs: &Path, rel: PathBuf, top: bool) -> std::io::Result<()> {
        let c = std::ffi::CString::new(abs.as_os_str().as_bytes()).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        // SAFETY: valid C string.
        let wd = unsafe { libc::inotify_add_watch(self.fd.raw(), c.as_ptr(), WATCH_MASK | libc::IN_ONLYDIR) };
        if wd < 0 {
            let e = std::io::Error::last_os_error();
            return if top { Err(e) } else { Ok(()) };
        }
        self.wds.insert(wd, rel.clone());
        if self.recursive
            && let Ok(rd) = std::fs::read_dir(abs)
        {
            for e in rd.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    let _ = self.add_tree(&e.path(), rel.join(e.file_name()), false);
                }
            }
        }
        Ok(())
    }

    /// Waits for the next batch of events, as FilesystemEvent JSON values.
    pub async fn next(&mut self) -> Result<Vec<Value>, RpcError> {
        let mut buf = vec![0u8; 64 * 1024];
        let n = self
            .fd
            .read(&mut buf)
            .await
            .map_err(|e| RpcError::io(e, "reading inotify"))?;
        let mut out = Vec::new();
        let mut off = 0;
        let hdr = std::mem::size_of::<libc::inotify_event>();
        while off + hdr <= n {
            // SAFETY: the kernel wrote whole events; read_unaligned copes with alignment.
            let ev: libc::inotify_event = unsafe { std::ptr::read_unaligned(buf[off..].as_ptr().cast()) };
            let name_bytes = &buf[off + hdr..(off + hdr + ev.len as usize).min(n)];
            let name_end = name_bytes.iter().position(|&b| b == 0).unwrap_or(name_bytes.len());
            let name = std::ffi::OsStr::from_bytes(&name_bytes[..name_end]).to_owned();
            off += hdr + ev.len as usize;

            if ev.mask & libc::IN_IGNORED != 0 {
                self.wds.remove(&ev.wd);
                continue;
            }
            let Some(dir_rel) = self.wds.get(&ev.wd).cloned() else {
                continue;
            };
            let rel = if name.is_empty() {
                dir_rel.clone()
            } else {
                dir_rel.join(&name)
            };
            let is_dir = ev.mask & libc::IN_ISDIR != 0;
            // A new directory is watched from now on; what was created in it
            // before its watch existed is reported as created too.
            let mut found = Vec::new();
            if self.recursive && is_dir && ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                let abs = self.root.join(&rel);
                let u = self.user.clone();
                let _ = as_user(&u, || {
                    self.add_tree(&abs, rel.clone(), false)?;
                    list_tree(&abs, &rel, &mut found);
                    Ok::<_, std::io::Error>(())
                });
            }
            let ty = if ev.mask & (libc::IN_CREATE | libc::IN_MOVED_TO) != 0 {
                "EVENT_TYPE_CREATE"
            } else if ev.mask & libc::IN_MODIFY != 0 {
                "EVENT_TYPE_WRITE"
            } else if ev.mask & (libc::IN_DELETE | libc::IN_DELETE_SELF) != 0 {
                "EVENT_TYPE_REMOVE"
            } else if ev.mask & (libc::IN_MOVED_FROM | libc::IN_MOVE_SELF) != 0 {
                "EVENT_TYPE_RENAME"
            } else if ev.mask & libc::IN_ATTRIB != 0 {
                "EVENT_TYPE_CHMOD"
            } else {
                continue;
            };
            if name.is_empty()
                && ev.mask & (libc::IN_DELETE_SELF | libc::IN_MOVE_SELF) != 0
                && !dir_rel.as_os_str().is_empty()
            {
                // A subdirectory's own removal is also reported by its parent.
                continue;
            }
            for (rel, ty) in std::iter::once((rel, ty)).chain(found.into_iter().map(|r| (r, "EVENT_TYPE_CREATE"))) {
                let mut v = json!({"name": rel.to_string_lossy(), "type": ty});
                if self.include_entry && ty != "EVENT_TYPE_REMOVE" && ty != "EVENT_TYPE_RENAME" {
                    let abs = self.root.join(&rel);
                    let u = self.user.clone();
                    if let Ok(e) = as_user(&u, || entry_info(&abs, &Names::load())) {
                        v["entry"] = e;
                    }
                }
                out.push(v);
            }
        }
        Ok(out)
    }
}

/// Every entry below `abs` (named relative to the watch's root), depth first.
fn list_tree(abs: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
    let Ok(rd) = std::fs::read_dir(abs) else {
        return;
    };
    let mut entries: Vec<_> = rd.flatten().collect();
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let r = rel.join(e.file_name());
        out.push(r.clone());
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            list_tree(&e.path(), &r, out);
        }
    }
}

/// The kind of network file system `path` is on, if it is on one.
fn network_fs(path: &Path) -> Option<&'static str> {
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statfs fills the struct it is given.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } < 0 {
        return None;
    }
    network_fs_kind(st.f_type as i64)
}

/// Network file systems by their statfs magic number.
fn network_fs_kind(magic: i64) -> Option<&'static str> {
    match magic {
        0x6969 => Some("nfs"),
        0x517b => Some("smb"),
        0xff534d42 => Some("cifs"),
        0xfe534d42 => Some("smb2"),
        0x65735546 => Some("fuse"),
        0x564c => Some("ncp"),
        0x73757245 => Some("coda"),
        0x6b414653 => Some("afs"),
        0x01021997 => Some("9p"),
        0x47504653 => Some("gpfs"),
        0x00c36400 => Some("ceph"),
        _ => None,
    }
}

/// Watchers polled with GetWatcherEvents (the sync SDK's watch_dir).
#[derive(Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Arc<Polled>>>,
    next: std::sync::atomic::AtomicU64,
}

pub struct Polled {
    events: Mutex<VecDeque<Value>>,
    error: Mutex<Option<RpcError>>,
    task: tokio::task::JoinHandle<()>,
    owner: u32,
}

impl Watchers {
    pub fn create(&self, user: &User, req: WatchRequest) -> Result<Value, RpcError> {
        let mut w = Watch::new(user, &req)?;
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let id = format!("w{n}-{nanos:08x}");
        let polled = Arc::new_cyclic(|weak: &std::sync::Weak<Polled>| {
            let weak = weak.clone();
            let task = tokio::spawn(async move {
                loop {
                    let r = w.next().await;
                    let Some(p) = weak.upgrade() else { return };
                    match r {
                        Ok(evs) => {
                            let mut q = p.events.lock().unwrap();
                            for e in evs {
                                if q.len() >= WATCHER_BACKLOG {
                                    q.pop_front();
                                }
                                q.push_back(e);
                            }
                        }
                        Err(e) => {
                            *p.error.lock().unwrap() = Some(e);
                            return;
                        }
                    }
                }
            });
            Polled {
                events: Mutex::new(VecDeque::new()),
                error: Mutex::new(None),
                task,
                owner: user.uid,
            }
        });
        self.map.lock().unwrap().insert(id.clone(), polled);
        Ok(json!({ "watcherId": id }))
    }

    fn get(&self, user: &User, id: &str) -> Result<Arc<Polled>, RpcError> {
        let p = self.map.lock().unwrap().get(id).cloned();
        match p {
            Some(p) if p.owner == user.uid || user.uid == 0 => Ok(p),
            _ => Err(RpcError::not_found(format!("watcher {id} not found"))),
        }
    }

    pub fn events(&self, user: &User, req: WatcherIdRequest) -> Result<Value, RpcError> {
        let p = self.get(user, &req.watcher_id)?;
        if let Some(e) = p.error.lock().unwrap().clone() {
            return Err(e);
        }
        let evs: Vec<Value> = p.events.lock().unwrap().drain(..).collect();
        Ok(json!({ "events": evs }))
    }

    pub fn remove(&self, user: &User, req: WatcherIdRequest) -> Result<Value, RpcError> {
        let p = self.get(user, &req.watcher_id)?;
        p.task.abort();
        self.map.lock().unwrap().remove(&req.watcher_id);
        Ok(json!({}))
    }
}

#[cfg(test)]
mod tests {
    use super::network_fs_kind;

    #[test]
    fn network_file_systems_are_told_from_local_ones() {
        assert_eq!(network_fs_kind(0x6969), Some("nfs"));
        assert_eq!(network_fs_kind(0xff534d42), Some("cifs"));
        assert_eq!(network_fs_kind(0x65735546), Some("fuse"));
        // ext4, tmpfs, overlayfs, xfs, btrfs: local.
        for local in [0xef53, 0x01021994, 0x794c7630, 0x58465342, 0x9123683e] {
            assert_eq!(network_fs_kind(local), None, "{local:#x}");
        }
    }
}
