//! The E2B account on any image. E2B code runs as `user` (uid 1000, home /home/user,
//! passwordless sudo where the image has sudo); our images carry it, an arbitrary OCI
//! image (python:3.12-slim, alpine, ubuntu) does not. At boot, before anything of the
//! sandbox runs, PID 1 adds what is missing as E2B's template build does (`useradd -m
//! user` and a NOPASSWD sudoers entry), by appending to the account files itself (an
//! image need not have useradd or adduser). An account that exists is never changed;
//! only a missing home under /home is made for it.
//!
//! The image may be hostile. Every path is walked from the root with `openat` and
//! `O_NOFOLLOW` (a symlinked /etc, /etc/passwd, /home or /home/user is refused, never
//! followed), account files must be small regular files, ownership is set on the open
//! directory (`fchown`, never a path), and a failure (a read-only root, say) is only
//! reported: the agent goes on and serves whatever the image allows.

use std::ffi::CString;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// The account E2B's SDKs run commands as by default.
pub const USER: &str = "user";
/// Ids for a new account: E2B's 1000 when free, else the next free one up to Debian's
/// UID_MAX (the sandbox's user namespace maps 0..65535).
const FIRST_ID: u32 = 1000;
const LAST_ID: u32 = 59999;
/// Account files larger than this are not read (nor written to).
const MAX_FILE: u64 = 16 << 20;
/// Files of /etc/skel larger than this are not copied into a new home.
const MAX_SKEL_FILE: u64 = 1 << 20;
const SUDOERS_ENTRY: &str = "user ALL=(ALL:ALL) NOPASSWD: ALL\n";

/// What [`ensure_user`] did and what it could not do, one line each, for the log.
#[derive(Debug, Default)]
pub struct Report {
    pub done: Vec<String>,
    pub problems: Vec<String>,
}

impl Report {
    pub fn log(&self) {
        for line in &self.done {
            eprintln!("opendsec-agent: {line}");
        }
        for line in &self.problems {
            eprintln!("opendsec-agent: the account {USER:?}: {line}");
        }
    }
}

/// Gives the tree at `root` (`/` in a sandbox) the account `user` if it has none, and a
/// home if its `user` lacks one under /home.
pub fn ensure_user(root: &Path) -> Report {
    let mut report = Report::default();
    if let Err(problem) = ensure(root, &mut report) {
        report.problems.push(problem);
    }
    report
}

/// An account as /etc/passwd gives it.
struct Account {
    uid: u32,
    gid: u32,
    home: String,
}

fn ensure(root: &Path, report: &mut Report) -> Result<(), String> {
    let root_fd = open_root(root).map_err(|e| format!("opening {}: {e}", root.display()))?;
    let etc = dir_at(&root_fd, "etc", true).map_err(|e| format!("/etc: {e}"))?;
    let passwd = read_small(&etc, "passwd").map_err(|e| format!("/etc/passwd: {e}"))?;
    if let Some(line) = passwd.as_deref().and_then(|p| entry(p, USER)) {
        let Some(account) = parse_account(line) else {
            return Err(format!("its /etc/passwd line {line:?} is not understood: left alone"));
        };
        // The account is the image's: at most its missing home is made, as its own.
        if let Some(name) = home_name(&account.home) {
            let home = dir_at(&root_fd, "home", true).map_err(|e| format!("/home: {e}"))?;
            match make_dir(&home, name) {
                Ok(Some(dir)) => {
                    chown_dir(&dir, account.uid, account.gid, &account.home)?;
                    copy_skel(&etc, &dir, account.uid, account.gid, report);
                    report.done.push(format!("made the home {} of {USER:?}", account.home));
                }
                Ok(None) => {}
                Err(e) => return Err(format!("{}: {e}", account.home)),
            }
        }
        return Ok(());
    }
    create(root, &root_fd, &etc, passwd.as_deref(), report)
}

/// Adds `user` to an image without one: group, passwd, shadow, home, sudoers.
fn create(
    root: &Path,
    root_fd: &OwnedFd,
    etc: &OwnedFd,
    passwd: Option<&str>,
    report: &mut Report,
) -> Result<(), String> {
    let group = read_small(etc, "group").map_err(|e| format!("/etc/group: {e}"))?;
    let taken_uids = ids(passwd.unwrap_or(""));
    let uid = free_id(&taken_uids, FIRST_ID).ok_or("no free uid between 1000 and 59999")?;
    let shell = if root.join("bin/bash").exists() {
        "/bin/bash"
    } else {
        "/bin/sh"
    };

    // A group `user` the image has is the account's; else one of our own, gid = uid when free.
    let (gid, new_group) = match group.as_deref().and_then(|g| entry(g, USER)).map(parse_group_id) {
        Some(Some(gid)) => (gid, false),
        Some(None) => return Err("the image's group \"user\" has no numeric gid: left alone".into()),
        None => {
            let taken = ids(group.as_deref().unwrap_or(""));
            (
                free_id(&taken, uid)
                    .or_else(|| free_id(&taken, FIRST_ID))
                    .ok_or("no free gid")?,
                true,
            )
        }
    };
    if new_group {
        let mut add = String::new();
        if group.is_none() {
            add.push_str("root:x:0:\n");
        }
        add.push_str(&format!("{USER}:x:{gid}:\n"));
        append(etc, "group", group.as_deref(), &add).map_err(|e| format!("/etc/group: {e}"))?;
        append_if_present(etc, "gshadow", &format!("{USER}:!::\n"), report);
    }
    let mut add = String::new();
    if passwd.is_none() {
        add.push_str(&format!("root:x:0:0:root:/root:{shell}\n"));
    }
    add.push_str(&format!("{USER}:x:{uid}:{gid}::/home/{USER}:{shell}\n"));
    append(etc, "passwd", passwd, &add).map_err(|e| format!("/etc/passwd: {e}"))?;
    // `!`: no password (sessions come through the agent, not a login).
    let shadow = format!("{USER}:!:{}:0:99999:7:::\n", days_since_epoch());
    append_if_present(etc, "shadow", &shadow, report);
    report.done.push(format!(
        "added the account {USER:?} (uid {uid}, gid {gid}, shell {shell})"
    ));

    // The account stands; a home or sudoers entry that cannot be made is reported alone.
    if let Err(problem) = new_home(root_fd, etc, uid, gid, report) {
        report.problems.push(problem);
    }
    add_sudoers(root, etc, report)
}

/// /home/user for a new account: made, or the image's directory taken over (only the
/// directory itself, and never through a link).
fn new_home(root_fd: &OwnedFd, etc: &OwnedFd, uid: u32, gid: u32, report: &mut Report) -> Result<(), String> {
    let home = dir_at(root_fd, "home", true).map_err(|e| format!("/home: {e}"))?;
    let (dir, made) = match make_dir(&home, USER).map_err(|e| format!("/home/{USER}: {e}"))? {
        Some(dir) => (dir, true),
        None => (
            dir_at(&home, USER, false).map_err(|e| format!("/home/{USER}: {e}"))?,
            false,
        ),
    };
    chown_dir(&dir, uid, gid, "/home/user")?;
    if made {
        copy_skel(etc, &dir, uid, gid, report);
    }
    Ok(())
}

/// The NOPASSWD entry in /etc/sudoers.d/user, if the image has sudo and a sudoers.d
/// and no sudoers file names `user` yet.
fn add_sudoers(root: &Path, etc: &OwnedFd, report: &mut Report) -> Result<(), String> {
    if root.join("usr/bin/sudo").symlink_metadata().is_err() {
        return Ok(());
    }
    let dir = match dir_at(etc, "sudoers.d", false) {
        Ok(dir) => dir,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("/etc/sudoers.d: {e}")),
    };
    let mut named = read_small(etc, "sudoers")
        .ok()
        .flatten()
        .is_some_and(|s| names_user(&s));
    for name in list_dir(&dir).map_err(|e| format!("listing /etc/sudoers.d: {e}"))? {
        if named {
            break;
        }
        if let Ok(Some(text)) = read_small(&dir, &name) {
            named = names_user(&text);
        }
    }
    if named {
        return Ok(());
    }
    // sudo ignores a sudoers file that others can write or root does not own.
    create_file(&dir, USER, 0, 0, 0o440, SUDOERS_ENTRY.as_bytes())
        .map_err(|e| format!("writing /etc/sudoers.d/{USER}: {e}"))?;
    report
        .done
        .push(format!("gave {USER:?} passwordless sudo (/etc/sudoers.d/{USER})"));
    Ok(())
}

// ---- reading the account files ----------------------------------------------------

/// The line of `name` in a passwd- or group-style file.
fn entry<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    text.lines().find(|l| l.split(':').next() == Some(name))
}

fn parse_account(line: &str) -> Option<Account> {
    let f: Vec<&str> = line.split(':').collect();
    Some(Account {
        uid: f.get(2)?.parse().ok()?,
        gid: f.get(3)?.parse().ok()?,
        home: f.get(5)?.to_string(),
    })
}

fn parse_group_id(line: &str) -> Option<u32> {
    line.split(':').nth(2)?.parse().ok()
}

/// The ids (third field) a passwd- or group-style file uses.
fn ids(text: &str) -> Vec<u32> {
    text.lines().filter_map(|l| l.split(':').nth(2)?.parse().ok()).collect()
}

fn free_id(taken: &[u32], from: u32) -> Option<u32> {
    (from.max(FIRST_ID)..=LAST_ID).find(|id| !taken.contains(id))
}

/// The directory name of a home directly under /home (`/home/user` -> `user`); other
/// homes (`/nonexistent`, `/root`) are not ours to make.
fn home_name(home: &str) -> Option<&str> {
    let name = home.strip_prefix("/home/")?.trim_end_matches('/');
    (!name.is_empty() && !name.contains('/') && name != "." && name != "..").then_some(name)
}

/// Whether a sudoers text has a rule whose users include `user` (or the group `user`).
fn names_user(text: &str) -> bool {
    text.lines().map(str::trim).filter(|l| !l.starts_with('#')).any(|l| {
        l.split_whitespace()
            .next()
            .is_some_and(|users| users.split(',').any(|u| u == USER || u == "%user"))
    })
}

fn days_since_epoch() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() / 86_400)
}

// ---- files, without following links -----------------------------------------------

fn cstring(name: &str) -> io::Result<CString> {
    CString::new(name).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a NUL in a name"))
}

fn open_at(dir: &OwnedFd, name: &str, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    let c = cstring(name)?;
    // SAFETY: openat with a NUL-terminated name; the returned fd is ours.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_root(root: &Path) -> io::Result<OwnedFd> {
    File::open(root).and_then(|f| {
        if f.metadata()?.is_dir() {
            Ok(f.into())
        } else {
            Err(io::Error::from(io::ErrorKind::NotADirectory))
        }
    })
}

/// The directory `name` in `dir`, never through a link; made (0755) if missing and `make`.
fn dir_at(dir: &OwnedFd, name: &str, make: bool) -> io::Result<OwnedFd> {
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW;
    match open_at(dir, name, flags, 0) {
        Err(e) if make && e.kind() == io::ErrorKind::NotFound => {
            make_dir(dir, name)?;
            open_at(dir, name, flags, 0)
        }
        other => other,
    }
}

/// Makes directory `name` (0755, owned by root) in `dir`: `None` if something by that
/// name is there already.
fn make_dir(dir: &OwnedFd, name: &str) -> io::Result<Option<OwnedFd>> {
    let c = cstring(name)?;
    // SAFETY: mkdirat with a NUL-terminated name.
    if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) } != 0 {
        let e = io::Error::last_os_error();
        return if e.kind() == io::ErrorKind::AlreadyExists {
            Ok(None)
        } else {
            Err(e)
        };
    }
    let made = open_at(dir, name, libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW, 0)?;
    // SAFETY: fchmod on an fd we own (mkdirat's mode went through the umask).
    check(unsafe { libc::fchmod(made.as_raw_fd(), 0o755) })?;
    Ok(Some(made))
}

fn chown_dir(dir: &OwnedFd, uid: u32, gid: u32, what: &str) -> Result<(), String> {
    // SAFETY: fchown on an fd we own: the directory itself, whatever its path became.
    check(unsafe { libc::fchown(dir.as_raw_fd(), uid, gid) }).map_err(|e| format!("chown {what}: {e}"))
}

/// A regular file (opened without following a link and without blocking on a FIFO)
/// of at most `limit` bytes.
fn open_regular(dir: &OwnedFd, name: &str, flags: libc::c_int, limit: u64) -> io::Result<File> {
    let file = File::from(open_at(dir, name, flags | libc::O_NOFOLLOW | libc::O_NONBLOCK, 0)?);
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "not a regular file"));
    }
    if meta.len() > limit {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {limit} bytes"),
        ));
    }
    Ok(file)
}

/// The text of a small regular file in `dir`; `None` if there is none. A link there
/// is an error (ELOOP), not followed.
fn read_small(dir: &OwnedFd, name: &str) -> io::Result<Option<String>> {
    let mut file = match open_regular(dir, name, libc::O_RDONLY, MAX_FILE) {
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        other => other?,
    };
    let mut bytes = Vec::new();
    (&mut file).take(MAX_FILE).read_to_end(&mut bytes)?;
    Ok(Some(String::from_utf8_lossy(&bytes).into_owned()))
}

/// Appends `add` to file `name` in `dir` (creating it 0644 when `before` says it did
/// not exist), after a newline if its last line lacks one. One write: a reader sees the
/// file before or after, never a half line.
fn append(dir: &OwnedFd, name: &str, before: Option<&str>, add: &str) -> io::Result<()> {
    let mut text = String::new();
    if before.is_some_and(|b| !b.is_empty() && !b.ends_with('\n')) {
        text.push('\n');
    }
    text.push_str(add);
    match before {
        Some(_) => open_regular(dir, name, libc::O_WRONLY | libc::O_APPEND, MAX_FILE)?.write_all(text.as_bytes()),
        None => create_file(dir, name, 0, 0, 0o644, text.as_bytes()),
    }
}

/// Creates file `name` in `dir` (it must not exist, not even as a link) with an owner
/// and a mode that do not depend on the umask, and writes `contents`.
fn create_file(dir: &OwnedFd, name: &str, uid: u32, gid: u32, mode: libc::mode_t, contents: &[u8]) -> io::Result<()> {
    let fd = open_at(
        dir,
        name,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
        0o600,
    )?;
    // SAFETY: fchown and fchmod on an fd we own.
    check(unsafe { libc::fchown(fd.as_raw_fd(), uid, gid) })?;
    check(unsafe { libc::fchmod(fd.as_raw_fd(), mode) })?;
    File::from(fd).write_all(contents)
}

fn check(result: libc::c_int) -> io::Result<()> {
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Appends `add` to a shadow file the image has (one it lacks is not made: the image
/// keeps no passwords there). A problem is reported, not fatal: the account is in passwd.
fn append_if_present(etc: &OwnedFd, name: &str, add: &str, report: &mut Report) {
    let done = match read_small(etc, name) {
        Ok(Some(text)) => append(etc, name, Some(&text), add),
        Ok(None) => Ok(()),
        Err(e) => Err(e),
    };
    if let Err(e) = done {
        report.problems.push(format!("/etc/{name}: {e}"));
    }
}

/// Names in a directory (without `.` and `..`).
fn list_dir(dir: &OwnedFd) -> io::Result<Vec<String>> {
    let copy = dir.try_clone()?;
    // SAFETY: fdopendir takes ownership of the duplicate (closedir closes it).
    let stream = unsafe { libc::fdopendir(copy.as_raw_fd()) };
    if stream.is_null() {
        return Err(io::Error::last_os_error());
    }
    std::mem::forget(copy);
    let mut names = Vec::new();
    loop {
        // SAFETY: readdir on a live stream; the entry is read before the next call.
        let entry = unsafe { libc::readdir(stream) };
        if entry.is_null() {
            break;
        }
        // SAFETY: d_name is NUL-terminated.
        let name = unsafe { std::ffi::CStr::from_ptr((*entry).d_name.as_ptr()) };
        let name = std::ffi::OsStr::from_bytes(name.to_bytes());
        if name != "." && name != ".." {
            names.push(name.to_string_lossy().into_owned());
        }
    }
    // SAFETY: the stream is ours; this closes the duplicate fd.
    unsafe { libc::closedir(stream) };
    Ok(names)
}

/// Copies the top-level regular files of /etc/skel (`.bashrc`, `.profile`) into a home
/// just made, owned by its user, as `useradd -m` does. Best effort: a problem is reported.
fn copy_skel(etc: &OwnedFd, home: &OwnedFd, uid: u32, gid: u32, report: &mut Report) {
    let Ok(skel) = dir_at(etc, "skel", false) else {
        return;
    };
    let Ok(names) = list_dir(&skel) else {
        return;
    };
    for name in names {
        let copied = (|| -> io::Result<()> {
            let Ok(mut from) = open_regular(&skel, &name, libc::O_RDONLY, MAX_SKEL_FILE) else {
                return Ok(()); // a directory, a link or something large: not copied
            };
            let mut bytes = Vec::new();
            (&mut from).take(MAX_SKEL_FILE).read_to_end(&mut bytes)?;
            create_file(home, &name, uid, gid, 0o644, &bytes)
        })();
        if let Err(e) = copied {
            report.problems.push(format!("copying /etc/skel/{name}: {e}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::{MetadataExt, symlink};
    use std::path::PathBuf;

    const DEBIAN_PASSWD: &str =
        "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";
    const DEBIAN_GROUP: &str = "root:x:0:\nsudo:x:27:\nnogroup:x:65534:\n";

    fn require_root() {
        // SAFETY: geteuid has no preconditions.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "these tests give files to uid 1000 and more, which needs root: run them as root (./ops/test.sh does)"
        );
    }

    /// An image's root with `files` (path, contents; a path ending in `/` is a directory).
    fn image(files: &[(&str, &str)]) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        for (path, contents) in files {
            let p = root.path().join(path);
            if path.ends_with('/') {
                fs::create_dir_all(&p).unwrap();
            } else {
                fs::create_dir_all(p.parent().unwrap()).unwrap();
                fs::write(&p, contents).unwrap();
            }
        }
        root
    }

    fn debian_like(extra: &[(&str, &str)]) -> tempfile::TempDir {
        let mut files = vec![
            ("etc/passwd", DEBIAN_PASSWD),
            ("etc/group", DEBIAN_GROUP),
            ("etc/shadow", "root:*:19000:0:99999:7:::\n"),
            ("etc/gshadow", "root:*::\n"),
            ("etc/skel/.bashrc", "# bashrc\n"),
            ("bin/bash", ""),
            ("home/", ""),
        ];
        files.extend_from_slice(extra);
        image(&files)
    }

    fn read(root: &Path, path: &str) -> String {
        fs::read_to_string(root.join(path)).unwrap()
    }

    fn owner(path: &Path) -> (u32, u32, u32) {
        let m = fs::symlink_metadata(path).unwrap();
        (m.uid(), m.gid(), m.mode() & 0o7777)
    }

    /// Every file under `root` with its owner, mode and contents: what must not change.
    fn snapshot(root: &Path) -> Vec<(PathBuf, u32, u32, u32, Vec<u8>)> {
        let mut out = Vec::new();
        let mut todo = vec![root.to_path_buf()];
        while let Some(dir) = todo.pop() {
            let m = fs::symlink_metadata(&dir).unwrap();
            let contents = if m.is_file() {
                fs::read(&dir).unwrap()
            } else {
                Vec::new()
            };
            out.push((dir.clone(), m.uid(), m.gid(), m.mode(), contents));
            if m.is_dir() {
                todo.extend(fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()));
            }
        }
        out.sort();
        out
    }

    #[test]
    fn an_image_without_user_gets_it_as_useradd_would_make_it() {
        require_root();
        let root = debian_like(&[]);
        let report = ensure_user(root.path());
        assert!(report.problems.is_empty(), "{report:?}");
        let r = root.path();
        assert_eq!(
            read(r, "etc/passwd"),
            format!("{DEBIAN_PASSWD}user:x:1000:1000::/home/user:/bin/bash\n")
        );
        assert_eq!(read(r, "etc/group"), format!("{DEBIAN_GROUP}user:x:1000:\n"));
        assert!(read(r, "etc/shadow").lines().nth(1).unwrap().starts_with("user:!:"));
        assert_eq!(read(r, "etc/gshadow"), "root:*::\nuser:!::\n");
        assert_eq!(owner(&r.join("home/user")), (1000, 1000, 0o755));
        assert_eq!(owner(&r.join("home/user/.bashrc")), (1000, 1000, 0o644));
        assert_eq!(read(r, "home/user/.bashrc"), "# bashrc\n");
        assert_eq!(owner(&r.join("etc/passwd")).0, 0);
        // No sudo in the image: no sudoers entry.
        assert!(!r.join("etc/sudoers.d").exists());

        // Once there, it is left alone.
        let before = snapshot(r);
        let again = ensure_user(r);
        assert!(again.done.is_empty() && again.problems.is_empty(), "{again:?}");
        assert_eq!(snapshot(r), before);
    }

    #[test]
    fn uid_1000_taken_by_another_name_gives_the_next_free_ids_and_sh_without_bash() {
        require_root();
        // As ubuntu:24.04: `ubuntu` is 1000:1000; 1001 is a group only. No bash, and a
        // passwd whose last line has no newline.
        let root = image(&[
            (
                "etc/passwd",
                "root:x:0:0:root:/root:/bin/sh\nubuntu:x:1000:1000::/home/ubuntu:/bin/sh",
            ),
            ("etc/group", "root:x:0:\nubuntu:x:1000:\ndocker:x:1001:\n"),
            ("bin/sh", ""),
        ]);
        let report = ensure_user(root.path());
        assert!(report.problems.is_empty(), "{report:?}");
        let r = root.path();
        assert_eq!(
            read(r, "etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nubuntu:x:1000:1000::/home/ubuntu:/bin/sh\nuser:x:1001:1002::/home/user:/bin/sh\n"
        );
        assert_eq!(
            read(r, "etc/group"),
            "root:x:0:\nubuntu:x:1000:\ndocker:x:1001:\nuser:x:1002:\n"
        );
        assert_eq!(owner(&r.join("home/user")), (1001, 1002, 0o755));
        // No shadow files in the image: none made.
        assert!(!r.join("etc/shadow").exists() && !r.join("etc/gshadow").exists());
    }

    #[test]
    fn a_group_named_user_is_the_new_accounts_group() {
        require_root();
        let root = debian_like(&[("etc/group", "root:x:0:\nuser:x:2000:\n")]);
        ensure_user(root.path());
        assert!(read(root.path(), "etc/passwd").ends_with("user:x:1000:2000::/home/user:/bin/bash\n"));
        assert_eq!(read(root.path(), "etc/group"), "root:x:0:\nuser:x:2000:\n");
        assert_eq!(read(root.path(), "etc/gshadow"), "root:*::\n");
    }

    #[test]
    fn an_existing_user_is_never_changed_but_gets_its_missing_home() {
        require_root();
        let passwd = format!("{DEBIAN_PASSWD}user:x:1234:1300:E2B:/home/user:/bin/zsh\n");
        let root = debian_like(&[("etc/passwd", &passwd), ("usr/bin/sudo", ""), ("etc/sudoers.d/", "")]);
        let r = root.path();
        let report = ensure_user(r);
        assert!(report.problems.is_empty(), "{report:?}");
        assert_eq!(read(r, "etc/passwd"), passwd);
        assert_eq!(read(r, "etc/group"), DEBIAN_GROUP);
        assert_eq!(owner(&r.join("home/user")), (1234, 1300, 0o755));
        assert_eq!(owner(&r.join("home/user/.bashrc")).0, 1234);
        // Not given sudo: that would change the image's account.
        assert_eq!(fs::read_dir(r.join("etc/sudoers.d")).unwrap().count(), 0);

        // With its home there (root's, say), nothing at all changes.
        let root = debian_like(&[("etc/passwd", &passwd), ("home/user/", "")]);
        let before = snapshot(root.path());
        let report = ensure_user(root.path());
        assert!(report.done.is_empty() && report.problems.is_empty(), "{report:?}");
        assert_eq!(snapshot(root.path()), before);

        // A home elsewhere than /home is not ours to make.
        let passwd = format!("{DEBIAN_PASSWD}user:x:1000:1000::/nonexistent:/bin/sh\n");
        let root = debian_like(&[("etc/passwd", &passwd)]);
        let before = snapshot(root.path());
        ensure_user(root.path());
        assert_eq!(snapshot(root.path()), before);
    }

    #[test]
    fn with_sudo_and_sudoers_d_the_new_user_gets_passwordless_sudo_once() {
        require_root();
        let root = debian_like(&[("usr/bin/sudo", ""), ("etc/sudoers.d/README", "# comments only\n")]);
        let r = root.path();
        let report = ensure_user(r);
        assert!(report.problems.is_empty(), "{report:?}");
        assert_eq!(read(r, "etc/sudoers.d/user"), "user ALL=(ALL:ALL) NOPASSWD: ALL\n");
        assert_eq!(owner(&r.join("etc/sudoers.d/user")), (0, 0, 0o440));

        // Already named (here by the main sudoers file): no second entry.
        let root = debian_like(&[
            ("usr/bin/sudo", ""),
            ("etc/sudoers", "root ALL=(ALL) ALL\nuser,admin ALL=(ALL) ALL\n"),
            ("etc/sudoers.d/", ""),
        ]);
        ensure_user(root.path());
        assert!(!root.path().join("etc/sudoers.d/user").exists());
        // Named in a drop-in under another name: none either.
        let root = debian_like(&[
            ("usr/bin/sudo", ""),
            ("etc/sudoers.d/90-e2b", "%user ALL=(ALL) NOPASSWD: ALL\n"),
        ]);
        ensure_user(root.path());
        assert!(!root.path().join("etc/sudoers.d/user").exists());
        // sudo without sudoers.d, or sudoers.d without sudo: nothing.
        for extra in [("usr/bin/sudo", ""), ("etc/sudoers.d/", "")] {
            let root = debian_like(&[extra]);
            let report = ensure_user(root.path());
            assert!(report.problems.is_empty(), "{report:?}");
            assert!(!root.path().join("etc/sudoers.d/user").exists());
        }
    }

    #[test]
    fn an_image_without_account_files_gets_root_and_user() {
        require_root();
        let root = image(&[("bin/sh", "")]);
        let report = ensure_user(root.path());
        assert!(report.problems.is_empty(), "{report:?}");
        let r = root.path();
        assert_eq!(
            read(r, "etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"
        );
        assert_eq!(read(r, "etc/group"), "root:x:0:\nuser:x:1000:\n");
        assert_eq!(owner(&r.join("etc/passwd")), (0, 0, 0o644));
        assert_eq!(owner(&r.join("home")), (0, 0, 0o755));
        assert_eq!(owner(&r.join("home/user")), (1000, 1000, 0o755));
    }

    #[test]
    fn hostile_links_are_refused_never_followed() {
        require_root();
        let outside = image(&[
            ("passwd", DEBIAN_PASSWD),
            ("etc/passwd", DEBIAN_PASSWD),
            ("etc/group", DEBIAN_GROUP),
            ("dir/", ""),
            ("sudo-target", "untouched\n"),
        ]);
        let o = outside.path();
        let outside_before = snapshot(o);
        let check = |what: &str, root: &Path, want_problem: &str| {
            let report = ensure_user(root);
            assert!(
                report.problems.iter().any(|p| p.contains(want_problem)),
                "{what}: {report:?}"
            );
            assert_eq!(snapshot(o), outside_before, "{what}: a file outside the root changed");
        };

        // /etc/passwd, /etc or /etc/group a link elsewhere: no account is added anywhere.
        for (what, link, target) in [
            ("/etc/passwd", "etc/passwd", o.join("passwd")),
            ("/etc", "etc", o.join("etc")),
        ] {
            let root = image(&[("etc/", ""), ("etc/group", DEBIAN_GROUP)]);
            let _ = fs::remove_dir_all(root.path().join(link));
            let _ = fs::remove_file(root.path().join(link));
            symlink(&target, root.path().join(link)).unwrap();
            check(what, root.path(), what);
        }
        let root = debian_like(&[]);
        fs::remove_file(root.path().join("etc/group")).unwrap();
        symlink(o.join("etc/group"), root.path().join("etc/group")).unwrap();
        check("/etc/group", root.path(), "/etc/group");
        assert!(
            !read(root.path(), "etc/passwd").contains("user:"),
            "passwd written without its group"
        );

        // /etc/shadow a link: the account is added, the link's target left alone.
        let root = debian_like(&[]);
        fs::remove_file(root.path().join("etc/shadow")).unwrap();
        symlink(o.join("passwd"), root.path().join("etc/shadow")).unwrap();
        check("/etc/shadow", root.path(), "/etc/shadow");
        assert!(read(root.path(), "etc/passwd").contains("\nuser:x:1000:1000:"));

        // /home/user (or /home) a link to /etc or elsewhere: the account is added, the
        // link's target keeps its owner, and the sudoers entry still comes.
        for (link, target) in [
            ("home/user", o.join("dir")),
            ("home/user", PathBuf::from("../etc")),
            ("home", o.join("dir")),
        ] {
            let root = debian_like(&[("usr/bin/sudo", ""), ("etc/sudoers.d/", "")]);
            let _ = fs::remove_dir(root.path().join(link));
            symlink(&target, root.path().join(link)).unwrap();
            let etc_before = owner(&root.path().join("etc"));
            check(link, root.path(), &format!("/{link}"));
            assert!(read(root.path(), "etc/passwd").contains("\nuser:x:1000:1000:"));
            assert_eq!(owner(&root.path().join("etc")), etc_before);
            assert!(root.path().join("etc/sudoers.d/user").is_file(), "{link}");
        }

        // A sudoers.d that is a link, or a planted link at sudoers.d/user: not written through.
        let root = debian_like(&[("usr/bin/sudo", "")]);
        symlink(o.join("dir"), root.path().join("etc/sudoers.d")).unwrap();
        check("sudoers.d", root.path(), "/etc/sudoers.d");
        let root = debian_like(&[("usr/bin/sudo", ""), ("etc/sudoers.d/", "")]);
        symlink(o.join("sudo-target"), root.path().join("etc/sudoers.d/user")).unwrap();
        check("sudoers.d/user", root.path(), "/etc/sudoers.d/user");

        // A FIFO for /etc/passwd does not hang the agent.
        let root = debian_like(&[]);
        fs::remove_file(root.path().join("etc/passwd")).unwrap();
        let fifo = CString::new(root.path().join("etc/passwd").as_os_str().as_bytes()).unwrap();
        // SAFETY: mkfifo with a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        check("fifo", root.path(), "not a regular file");
    }

    #[test]
    fn a_read_only_root_is_reported_not_fatal() {
        require_root();
        let root = debian_like(&[]);
        let path = root.path().to_path_buf();
        let before = snapshot(&path);
        // A read-only bind of the image in a mount namespace of this thread only.
        let report = std::thread::spawn(move || {
            // SAFETY: unshare and mount on this thread's own new mount namespace.
            unsafe {
                assert_eq!(
                    libc::unshare(libc::CLONE_NEWNS),
                    0,
                    "unshare: {}",
                    io::Error::last_os_error()
                );
                let slash = CString::new("/").unwrap();
                let none = std::ptr::null();
                assert_eq!(
                    libc::mount(
                        none,
                        slash.as_ptr(),
                        none,
                        libc::MS_REC | libc::MS_PRIVATE,
                        std::ptr::null()
                    ),
                    0
                );
                let p = CString::new(path.as_os_str().as_bytes()).unwrap();
                assert_eq!(
                    libc::mount(p.as_ptr(), p.as_ptr(), none, libc::MS_BIND, std::ptr::null()),
                    0
                );
                let flags = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY;
                assert_eq!(libc::mount(none, p.as_ptr(), none, flags, std::ptr::null()), 0);
            }
            ensure_user(&path)
        })
        .join()
        .unwrap();
        assert!(report.done.is_empty(), "{report:?}");
        assert!(
            report.problems.iter().any(|p| p.contains("Read-only file system")),
            "{report:?}"
        );
        assert_eq!(snapshot(root.path()), before);
    }
}
