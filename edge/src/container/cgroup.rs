//! What the host's cgroups offer (v1, v2 or hybrid) and where a sandbox's counters live.
//! The runtime writes the limits; we only read OOM counters and decide which optional
//! limits the host can take (a limit the kernel lacks would make the runtime fail). What
//! the edge writes itself (a warm container's new limits, each VMM's cgroup) is in
//! `crate::cgroups`.

use std::fs;
use std::path::{Path, PathBuf};

const ROOT: &str = "/sys/fs/cgroup";

/// `/sys/fs/cgroup` is a pure cgroup v2 mount.
pub fn is_unified() -> bool {
    nix::sys::statfs::statfs(ROOT)
        .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        .unwrap_or(false)
}

/// Whether the host can set an IO weight (v1 blkio needs CFQ/BFQ; v2 needs the io
/// controller with a weight file).
pub fn io_weight_supported() -> bool {
    if is_unified() {
        let controllers = fs::read_to_string(Path::new(ROOT).join("cgroup.controllers")).unwrap_or_default();
        // runc writes io.weight (or io.bfq.weight); both live in child groups only, so
        // the controller being available is the best we can check here.
        controllers.split_whitespace().any(|c| c == "io")
    } else {
        let blkio = Path::new(ROOT).join("blkio");
        blkio.join("blkio.weight").exists() || blkio.join("blkio.bfq.weight").exists()
    }
}

/// Whether sandboxes can get cpusets (v1: the cpuset hierarchy; v2: the cpuset controller).
pub fn cpuset_supported() -> bool {
    if is_unified() {
        let controllers = fs::read_to_string(Path::new(ROOT).join("cgroup.controllers")).unwrap_or_default();
        controllers.split_whitespace().any(|c| c == "cpuset")
    } else {
        Path::new(ROOT).join("cpuset/cpuset.cpus").exists()
    }
}

/// Whether memory+swap can be limited (v1 needs swap accounting; v2 always can).
pub fn swap_limit_supported() -> bool {
    is_unified() || Path::new(ROOT).join("memory/memory.memsw.limit_in_bytes").exists()
}

/// The number of OOM kills in the sandbox's memory cgroup, if it can be read.
/// `cgroups_path` is the absolute path given to the runtime (e.g. `/opendsec/<id>`).
pub fn oom_kills(cgroups_path: &str) -> Option<u64> {
    let rel = cgroups_path.trim_start_matches('/');
    let candidates: [(PathBuf, &str); 2] = [
        (
            Path::new(ROOT).join("memory").join(rel).join("memory.oom_control"),
            "oom_kill",
        ),
        (Path::new(ROOT).join(rel).join("memory.events"), "oom_kill"),
    ];
    for (path, key) in candidates {
        if let Ok(text) = fs::read_to_string(&path) {
            for line in text.lines() {
                let mut parts = line.split_whitespace();
                if parts.next() == Some(key) {
                    return parts.next().and_then(|v| v.parse().ok());
                }
            }
        }
    }
    None
}

/// Whether the sandbox's cgroup is frozen (paused): v1 `freezer.state`, v2 `cgroup.freeze`.
pub fn is_frozen(cgroups_path: &str) -> bool {
    let rel = cgroups_path.trim_start_matches('/');
    let v1 = Path::new(ROOT).join("freezer").join(rel).join("freezer.state");
    if let Ok(state) = fs::read_to_string(&v1) {
        return state.trim() != "THAWED";
    }
    let v2 = Path::new(ROOT).join(rel).join("cgroup.freeze");
    fs::read_to_string(v2).map(|v| v.trim() == "1").unwrap_or(false)
}

/// A sandbox's resource counters, read from its cgroup.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// CPU time used since it started, in microseconds.
    pub cpu_usec: u64,
    /// Memory in use (page cache included), in bytes.
    pub memory_bytes: u64,
    /// Of which page cache (file-backed), in bytes.
    pub cache_bytes: u64,
}

fn read_u64(p: &Path) -> Option<u64> {
    fs::read_to_string(p).ok()?.trim().parse().ok()
}

fn stat_field(p: &Path, key: &str) -> Option<u64> {
    let text = fs::read_to_string(p).ok()?;
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        (it.next() == Some(key))
            .then(|| it.next().and_then(|v| v.parse().ok()))
            .flatten()
    })
}

/// The sandbox's CPU and memory counters (v1 or v2), if its cgroup exists.
pub fn usage(cgroups_path: &str) -> Option<Usage> {
    let rel = cgroups_path.trim_start_matches('/');
    let root = Path::new(ROOT);
    let v2 = root.join(rel);
    if v2.join("memory.current").exists() {
        return Some(Usage {
            cpu_usec: stat_field(&v2.join("cpu.stat"), "usage_usec").unwrap_or(0),
            memory_bytes: read_u64(&v2.join("memory.current")).unwrap_or(0),
            cache_bytes: stat_field(&v2.join("memory.stat"), "file").unwrap_or(0),
        });
    }
    let mem = root.join("memory").join(rel);
    let memory_bytes = read_u64(&mem.join("memory.usage_in_bytes"))?;
    let cpu_ns = read_u64(&root.join("cpuacct").join(rel).join("cpuacct.usage"))
        .or_else(|| read_u64(&root.join("cpu,cpuacct").join(rel).join("cpuacct.usage")))
        .unwrap_or(0);
    Some(Usage {
        cpu_usec: cpu_ns / 1000,
        memory_bytes,
        cache_bytes: stat_field(&mem.join("memory.stat"), "cache").unwrap_or(0),
    })
}

/// Asks the kernel to reclaim a (frozen) sandbox's memory: cgroup v2's `memory.reclaim`
/// (Linux 5.19+). Returns the bytes it freed, or None where the host cannot (v1, older
/// kernels): then a paused sandbox keeps its memory until it resumes or dies.
pub fn reclaim(cgroups_path: &str) -> Option<u64> {
    let dir = Path::new(ROOT).join(cgroups_path.trim_start_matches('/'));
    let file = dir.join("memory.reclaim");
    if !file.exists() {
        return None;
    }
    let before = read_u64(&dir.join("memory.current"))?;
    // Reclaim may stop short of the request (EAGAIN); whatever it freed counts.
    let _ = fs::write(&file, before.to_string());
    let after = read_u64(&dir.join("memory.current")).unwrap_or(before);
    Some(before.saturating_sub(after))
}

/// Sets a created container's memory limit (with no swap beyond it where the host can
/// limit swap) and CPU quota, as the runtime does from the bundle: for a warm container
/// claimed by a sandbox whose limits differ from those it was made with. v1 or v2; the
/// writing is `crate::cgroups`' (shared with the VM driver).
pub fn set_memory_cpu(
    cgroups_path: &str,
    memory_bytes: u64,
    cpu_quota_us: u64,
    cpu_period_us: u64,
    cpu_shares: u64,
    swap_limit: bool,
) -> std::io::Result<()> {
    use crate::cgroups::{Cgroup, Controller, Layout};
    let cgroup = Cgroup::new(&Layout::host(), cgroups_path, &[Controller::Memory, Controller::Cpu]);
    cgroup.set_memory_limit(memory_bytes, swap_limit)?;
    cgroup.set_cpu_quota(Some(cpu_quota_us), cpu_period_us)?;
    cgroup.set_cpu_shares(cpu_shares)
}

/// Sets a created container's cpuset (`0-1,3`), as the runtime does from the bundle: for
/// a warm container claimed by a sandbox of another number of CPUs. v1 or v2.
pub fn set_cpus(cgroups_path: &str, cpus: &str) -> std::io::Result<()> {
    let rel = cgroups_path.trim_start_matches('/');
    let root = Path::new(ROOT);
    let file = [root.join(rel), root.join("cpuset").join(rel)]
        .into_iter()
        .map(|d| d.join("cpuset.cpus"))
        .find(|f| f.exists())
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::NotFound, "no cpuset cgroup"))?;
    fs::write(file, cpus)
}
