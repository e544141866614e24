//! CPU accounting, to tell a slow step that worked from one that waited: the CPU time a
//! process (all its threads) has used and the time its threads sat runnable on a run
//! queue (`/proc/<pid>/task/*/schedstat`), and the CPU time of this process's
//! waited-for children (`getrusage(RUSAGE_CHILDREN)`, for the raw tools run one at a
//! time). And the one file system that makes unpacking cost far more CPU than it should
//! ([`journalless_ext4`]), which the report warns about.

use std::time::Duration;

/// utime + stime of process `pid`, all threads.
pub(super) fn process_cpu(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at state (field 3).
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_nanos(ticks * 1_000_000_000 / hz)
}

/// Time the threads of `pid` (those alive now) spent runnable but waiting for a CPU.
pub(super) fn run_queue_wait(pid: i32) -> Duration {
    let ns: u64 = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().nth(1).and_then(|v| v.parse::<u64>().ok()))
        .sum();
    Duration::from_nanos(ns)
}

/// User + system CPU time of this process's children that have been waited for.
pub(super) fn children_cpu() -> Duration {
    // SAFETY: getrusage fills the struct we pass.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut u) };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(u.ru_utime) + tv(u.ru_stime)
}

/// The device of the file system holding `path`, if it is ext4 without a journal. There
/// the inode allocator passes over every inode deleted within
/// `vm.dirtytime_expire_seconds` (12 h by default) to find a free one, reading inode
/// tables as it goes: on a machine that has created and deleted many files lately
/// (builds, tests, this benchmark's own runs), creating an image's 20,000 files costs
/// many times the system CPU it costs on a fresh or journaled file system, and more
/// with every run. Every unpacker pays it alike, but the figures say more about the
/// file system's history than about the tools.
pub(super) fn journalless_ext4(path: &std::path::Path) -> Option<String> {
    let path = std::fs::canonicalize(path).ok()?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // The longest mount point that holds `path`: (mount point, fstype, source).
    let (_, fstype, source) = mountinfo
        .lines()
        .filter_map(|l| {
            let fields: Vec<&str> = l.split(' ').collect();
            let dash = fields.iter().position(|f| *f == "-")?;
            Some((
                fields.get(4)?.to_string(),
                fields.get(dash + 1)?.to_string(),
                fields.get(dash + 2)?.to_string(),
            ))
        })
        .filter(|(mount, _, _)| path.starts_with(mount))
        .max_by_key(|(mount, _, _)| mount.len())?;
    let device = std::path::Path::new(&source).file_name()?.to_string_lossy().to_string();
    let journal = std::fs::read_to_string(format!("/sys/fs/ext4/{device}/journal_task")).ok()?;
    (fstype == "ext4" && journal.trim() == "<none>").then_some(source)
}
