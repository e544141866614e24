//! Users of the sandbox, read from its own /etc/passwd and /etc/group (the
//! agent runs in the sandbox's root file system; no NSS, which a static
//! binary could not load anyway), and running file operations with a user's
//! permissions.

use std::path::{Path, PathBuf};

use crate::connect::{Code, RpcError};

#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: PathBuf,
    /// Supplementary groups (including the primary one).
    pub groups: Vec<u32>,
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

/// The name of the account with uid `uid` in /etc/passwd (the first, if several).
pub fn name_of_uid(uid: u32) -> Option<String> {
    read("/etc/passwd").lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.len() >= 6 && f[2].parse() == Ok(uid)).then(|| f[0].to_string())
    })
}

/// Looks a user up by name in /etc/passwd, with its groups from /etc/group.
pub fn lookup(name: &str) -> Option<User> {
    let passwd = read("/etc/passwd");
    let line = passwd.lines().find(|l| l.split(':').next() == Some(name))?;
    let f: Vec<&str> = line.split(':').collect();
    if f.len() < 6 {
        return None;
    }
    let uid = f[2].parse().ok()?;
    let gid = f[3].parse().ok()?;
    let home = if f[5].is_empty() {
        PathBuf::from("/")
    } else {
        PathBuf::from(f[5])
    };
    let mut groups = vec![gid];
    for l in read("/etc/group").lines() {
        let g: Vec<&str> = l.split(':').collect();
        if g.len() >= 4
            && g[3].split(',').any(|m| m == name)
            && let Ok(id) = g[2].parse::<u32>()
            && !groups.contains(&id)
        {
            groups.push(id);
        }
    }
    Some(User {
        name: name.to_string(),
        uid,
        gid,
        home,
        groups,
    })
}

/// Name of a uid or gid (for EntryInfo owner and group), else the number.
pub struct Names {
    users: Vec<(u32, String)>,
    groups: Vec<(u32, String)>,
}

impl Names {
    pub fn load() -> Names {
        let parse = |s: String| -> Vec<(u32, String)> {
            s.lines()
                .filter_map(|l| {
                    let f: Vec<&str> = l.split(':').collect();
                    Some((f.get(2)?.parse().ok()?, f[0].to_string()))
                })
                .collect()
        };
        Names {
            users: parse(read("/etc/passwd")),
            groups: parse(read("/etc/group")),
        }
    }
    pub fn user(&self, id: u32) -> String {
        self.users
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, n)| n.clone())
            .unwrap_or_else(|| id.to_string())
    }
    pub fn group(&self, id: u32) -> String {
        self.groups
            .iter()
            .find(|(i, _)| *i == id)
            .map(|(_, n)| n.clone())
            .unwrap_or_else(|| id.to_string())
    }
}

/// The user named by `Authorization: Basic base64("<name>:")`, if any.
pub fn name_from_basic_auth(header: Option<&str>) -> Result<Option<String>, RpcError> {
    use base64::Engine;
    let Some(h) = header else { return Ok(None) };
    let Some(rest) = h.strip_prefix("Basic ").or_else(|| h.strip_prefix("basic ")) else {
        return Ok(None);
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(rest.trim())
        .map_err(|_| RpcError::new(Code::Unauthenticated, "malformed Basic authorization"))?;
    let s =
        String::from_utf8(raw).map_err(|_| RpcError::new(Code::Unauthenticated, "malformed Basic authorization"))?;
    let name = s.split(':').next().unwrap_or("").to_string();
    Ok(if name.is_empty() { None } else { Some(name) })
}

pub fn resolve(name: &str) -> Result<User, RpcError> {
    lookup(name).ok_or_else(|| RpcError::new(Code::Unauthenticated, format!("invalid user: '{name}'")))
}

/// Resolves a request path: relative paths (and `~`) are taken from the
/// user's home directory.
pub fn resolve_path(user: &User, p: &str) -> Result<PathBuf, RpcError> {
    if p.is_empty() {
        return Err(RpcError::invalid("path is empty"));
    }
    let pb = if p == "~" {
        user.home.clone()
    } else if let Some(rest) = p.strip_prefix("~/") {
        user.home.join(rest)
    } else if Path::new(p).is_absolute() {
        PathBuf::from(p)
    } else {
        user.home.join(p)
    };
    Ok(normalize(&pb))
}

/// Lexical normalisation (`.` and `..`), without touching the file system.
pub fn normalize(p: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
            _ => {}
        }
    }
    out
}

/// The agent's own supplementary groups, restored after each switch.
static ROOT_GROUPS: std::sync::OnceLock<Vec<libc::gid_t>> = std::sync::OnceLock::new();

pub fn init() {
    let mut v = vec![0 as libc::gid_t; 256];
    // SAFETY: the buffer holds 256 entries.
    let n = unsafe { libc::getgroups(v.len() as i32, v.as_mut_ptr()) };
    v.truncate(n.max(0) as usize);
    let _ = ROOT_GROUPS.set(v);
}

fn thread_setgroups(g: &[libc::gid_t]) -> i32 {
    // The raw system call changes this thread's credentials only (glibc's
    // setgroups() would broadcast the change to every thread).
    // SAFETY: pointer and length describe a live slice.
    unsafe { libc::syscall(libc::SYS_setgroups, g.len() as libc::size_t, g.as_ptr()) as i32 }
}

/// Filesystem credentials of this thread, switched for the guard's life.
struct FsCreds;

impl Drop for FsCreds {
    fn drop(&mut self) {
        // SAFETY: plain system calls on this thread's credentials.
        unsafe {
            libc::setfsuid(0);
            libc::setfsgid(0);
        }
        thread_setgroups(ROOT_GROUPS.get().map(|v| v.as_slice()).unwrap_or(&[]));
    }
}

/// Runs `f` on this thread with `user`'s file-system permissions (fsuid,
/// fsgid and supplementary groups). Changing fsuid away from 0 drops the
/// file capabilities (DAC override and friends) of this thread, so the
/// kernel checks permissions exactly as for that user. Files created are
/// owned by the user. `f` must not block on other tasks: call it from a
/// blocking thread, or keep it short.
pub fn as_user<R>(user: &User, f: impl FnOnce() -> R) -> R {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    if euid != 0 || user.uid == euid {
        return f();
    }
    let groups: Vec<libc::gid_t> = user.groups.clone();
    let _guard = FsCreds;
    thread_setgroups(&groups);
    // SAFETY: plain system calls on this thread's credentials.
    unsafe {
        libc::setfsgid(user.gid);
        libc::setfsuid(user.uid);
    }
    f()
}

/// As `as_user`, on a blocking thread.
pub async fn blocking_as<R: Send + 'static>(
    user: &User,
    f: impl FnOnce() -> Result<R, RpcError> + Send + 'static,
) -> Result<R, RpcError> {
    let user = user.clone();
    tokio::task::spawn_blocking(move || as_user(&user, f))
        .await
        .map_err(|e| RpcError::internal(format!("worker failed: {e}")))?
}
