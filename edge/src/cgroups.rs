//! Cgroups the edge makes and limits itself, on cgroup v1, v2 and hybrid hosts: where each
//! controller is mounted, making a cgroup in every hierarchy that holds a controller it
//! needs, its limits (CPU quota, memory, IO weight), its counters, and its removal.
//!
//! Who uses it: the VM driver puts each VMM process in a cgroup of its own
//! (`vm/driver/cgroup.rs`); the container backend sets a warm container's new limits
//! through it (`container::cgroup::set_memory_cpu`; runc and crun make containers'
//! cgroups themselves). Reading a container's counters by its runtime's cgroups path
//! stays in `container::cgroup`.
//!
//! Where a controller is: each one is looked up on its own, a v1 mount that holds it
//! (`/sys/fs/cgroup/cpu`, or `cpu,cpuacct` where they share a hierarchy) first, else the
//! cgroup2 mount when its root offers it (`cgroup.controllers`). A pure v2 host thus puts
//! everything in `/sys/fs/cgroup/<path>`; a v1 host each controller in its own hierarchy;
//! a hybrid host (v1 controllers plus a cgroup2 mount at `/sys/fs/cgroup/unified`, as on
//! this project's development machines, whose cgroup2 holds only hugetlb) the v1 ones. On
//! v2 a new cgroup's controllers are enabled in `cgroup.subtree_control` of every
//! ancestor; a v1 controller needs nothing more than the directory.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// What a cgroup made here may limit or count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Controller {
    /// CPU quota (v1 `cpu`, v2 `cpu`).
    Cpu,
    /// CPU time used (v1 `cpuacct`; v2 `cpu.stat`, present in every cgroup).
    CpuAcct,
    Memory,
    /// IO weight (v1 `blkio`, v2 `io`).
    Io,
}

impl Controller {
    fn v1_name(self) -> &'static str {
        match self {
            Controller::Cpu => "cpu",
            Controller::CpuAcct => "cpuacct",
            Controller::Memory => "memory",
            Controller::Io => "blkio",
        }
    }

    /// The v2 controller to enable; `None`: its files are in every cgroup.
    fn v2_name(self) -> Option<&'static str> {
        match self {
            Controller::Cpu => Some("cpu"),
            Controller::CpuAcct => None,
            Controller::Memory => Some("memory"),
            Controller::Io => Some("io"),
        }
    }
}

/// The two kinds of hierarchy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// Where the host mounts its cgroup controllers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Layout {
    /// v1 hierarchies: mount point, and its mount options (the controllers among them).
    v1: Vec<(PathBuf, Vec<String>)>,
    /// The cgroup2 mount, and the controllers its root offers.
    v2: Option<(PathBuf, Vec<String>)>,
}

impl Layout {
    /// This host's, from `/proc/self/mounts`.
    pub fn host() -> Layout {
        Self::from_mounts(&fs::read_to_string("/proc/self/mounts").unwrap_or_default())
    }

    /// From the text of `/proc/mounts`; a cgroup2 mount's controllers are read from its
    /// root's `cgroup.controllers`. The first mount of each kind wins.
    pub fn from_mounts(mounts: &str) -> Layout {
        let mut layout = Layout::default();
        for line in mounts.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 4 {
                continue;
            }
            let point = PathBuf::from(f[1]);
            match f[2] {
                "cgroup" => {
                    let options = f[3].split(',').map(str::to_string).collect();
                    if !layout.v1.iter().any(|(p, _)| *p == point) {
                        layout.v1.push((point, options));
                    }
                }
                "cgroup2" if layout.v2.is_none() => {
                    let offered = fs::read_to_string(point.join("cgroup.controllers")).unwrap_or_default();
                    layout.v2 = Some((point, offered.split_whitespace().map(str::to_string).collect()));
                }
                _ => {}
            }
        }
        layout
    }

    /// The hierarchy that holds `c`: its mount point and kind; `None` when the host has
    /// no such controller.
    pub fn place(&self, c: Controller) -> Option<(&Path, Version)> {
        if let Some((point, _)) = self.v1.iter().find(|(_, opts)| opts.iter().any(|o| o == c.v1_name())) {
            return Some((point, Version::V1));
        }
        let (point, offered) = self.v2.as_ref()?;
        match c.v2_name() {
            Some(name) if !offered.iter().any(|o| o == name) => None,
            _ => Some((point, Version::V2)),
        }
    }
}

/// One cgroup, at the same relative path in every hierarchy that holds one of the
/// controllers it was made for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cgroup {
    path: String,
    /// Each hierarchy's directory of this cgroup, with the hierarchy's mount point, its
    /// kind and the controllers wanted from it.
    dirs: Vec<Place>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Place {
    dir: PathBuf,
    mount: PathBuf,
    version: Version,
    controllers: Vec<Controller>,
}

/// How long a removal waits for the last processes of a cgroup to be gone from it.
const REMOVE_PATIENCE: Duration = Duration::from_secs(2);

impl Cgroup {
    /// The cgroup `path` (relative to each hierarchy's root, e.g. `odvm-1a2b3c/vm-1`) for
    /// `controllers`; those the host lacks are left out (see [`Cgroup::lacks`]). Nothing
    /// is made until [`Cgroup::create`].
    pub fn new(layout: &Layout, path: &str, controllers: &[Controller]) -> Cgroup {
        let path = path.trim_matches('/').to_string();
        let mut dirs: Vec<Place> = Vec::new();
        for &c in controllers {
            let Some((mount, version)) = layout.place(c) else {
                continue;
            };
            match dirs.iter_mut().find(|p| p.mount == mount) {
                Some(place) => place.controllers.push(c),
                None => dirs.push(Place {
                    dir: mount.join(&path),
                    mount: mount.to_path_buf(),
                    version,
                    controllers: vec![c],
                }),
            }
        }
        Cgroup { path, dirs }
    }

    /// The controllers of `wanted` that the host has nowhere.
    pub fn lacks(layout: &Layout, wanted: &[Controller]) -> Vec<Controller> {
        wanted.iter().copied().filter(|c| layout.place(*c).is_none()).collect()
    }

    /// The relative path, as `/proc/<pid>/cgroup` shows it (with a leading `/`).
    pub fn path(&self) -> String {
        format!("/{}", self.path)
    }

    /// Its directory in each hierarchy: a process joins the cgroup by writing to
    /// `cgroup.procs` in every one of them.
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.dirs.iter().map(|p| p.dir.clone()).collect()
    }

    fn place(&self, c: Controller) -> Option<&Place> {
        self.dirs.iter().find(|p| p.controllers.contains(&c))
    }

    fn require(&self, c: Controller) -> io::Result<&Place> {
        self.place(c).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("no {} cgroup controller on this host", c.v1_name()),
            )
        })
    }

    /// Whether it exists in any hierarchy.
    pub fn exists(&self) -> bool {
        self.dirs.iter().any(|p| p.dir.is_dir())
    }

    /// Makes the cgroup in every hierarchy (an existing one is kept); on v2 its
    /// controllers are enabled on the way down from the root.
    pub fn create(&self) -> io::Result<()> {
        for place in &self.dirs {
            let v2_names: Vec<&str> = match place.version {
                Version::V1 => Vec::new(),
                Version::V2 => place.controllers.iter().filter_map(|c| c.v2_name()).collect(),
            };
            let mut ancestor = place.mount.clone();
            for part in Path::new(&self.path).parent().into_iter().flat_map(|p| p.components()) {
                enable(&ancestor, &v2_names)?;
                ancestor.push(part);
                mkdir(&ancestor)?;
            }
            enable(&ancestor, &v2_names)?;
            mkdir(&place.dir)?;
        }
        Ok(())
    }

    /// The CPU quota per `period_us`, in microseconds (`None`: no quota).
    pub fn set_cpu_quota(&self, quota_us: Option<u64>, period_us: u64) -> io::Result<()> {
        let place = self.require(Controller::Cpu)?;
        match place.version {
            Version::V1 => {
                write(&place.dir, "cpu.cfs_period_us", &period_us.to_string())?;
                let quota = quota_us.map_or_else(|| "-1".to_string(), |q| q.to_string());
                write(&place.dir, "cpu.cfs_quota_us", &quota)
            }
            Version::V2 => {
                let quota = quota_us.map_or_else(|| "max".to_string(), |q| q.to_string());
                write(&place.dir, "cpu.max", &format!("{quota} {period_us}"))
            }
        }
    }

    /// The CPU weight against sibling cgroups: v1 `cpu.shares` (2..262144, 1024 the
    /// kernel's default) or v2 `cpu.weight` (1..10000, 100 the default), given as shares
    /// and converted as runc does.
    pub fn set_cpu_shares(&self, shares: u64) -> io::Result<()> {
        let place = self.require(Controller::Cpu)?;
        match place.version {
            Version::V1 => write(&place.dir, "cpu.shares", &shares.clamp(2, 262_144).to_string()),
            Version::V2 => {
                let shares = shares.clamp(2, 262_144);
                let weight = 1 + ((shares - 2) * 9999) / 262_142;
                write(&place.dir, "cpu.weight", &weight.to_string())
            }
        }
    }

    /// The CPU quota as the kernel holds it: (quota, period) in microseconds.
    pub fn cpu_quota(&self) -> Option<(Option<u64>, u64)> {
        let place = self.place(Controller::Cpu)?;
        match place.version {
            Version::V1 => {
                let quota: i64 = read(&place.dir, "cpu.cfs_quota_us")?.parse().ok()?;
                let period = read(&place.dir, "cpu.cfs_period_us")?.parse().ok()?;
                Some(((quota >= 0).then_some(quota as u64), period))
            }
            Version::V2 => {
                let text = read(&place.dir, "cpu.max")?;
                let (quota, period) = text.split_once(' ')?;
                Some((quota.parse().ok(), period.parse().ok()?))
            }
        }
    }

    /// The memory limit, and no swap beyond it where the host can limit swap
    /// (`no_swap`). v1 keeps memory <= memory+swap at every step.
    pub fn set_memory_limit(&self, bytes: u64, no_swap: bool) -> io::Result<()> {
        let place = self.require(Controller::Memory)?;
        let value = bytes.to_string();
        match place.version {
            Version::V1 => {
                let memsw = place.dir.join("memory.memsw.limit_in_bytes");
                if !(no_swap && memsw.exists()) {
                    return write(&place.dir, "memory.limit_in_bytes", &value);
                }
                let current = read(&place.dir, "memory.limit_in_bytes")
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0);
                // Raise memory+swap first, lower memory first.
                if bytes > current {
                    write(&place.dir, "memory.memsw.limit_in_bytes", &value)?;
                    write(&place.dir, "memory.limit_in_bytes", &value)
                } else {
                    write(&place.dir, "memory.limit_in_bytes", &value)?;
                    write(&place.dir, "memory.memsw.limit_in_bytes", &value)
                }
            }
            Version::V2 => {
                write(&place.dir, "memory.max", &value)?;
                if no_swap && place.dir.join("memory.swap.max").exists() {
                    write(&place.dir, "memory.swap.max", "0")?;
                }
                Ok(())
            }
        }
    }

    /// The memory limit as the kernel holds it (`u64::MAX`: none).
    pub fn memory_limit(&self) -> Option<u64> {
        let place = self.place(Controller::Memory)?;
        let text = match place.version {
            Version::V1 => read(&place.dir, "memory.limit_in_bytes")?,
            Version::V2 => read(&place.dir, "memory.max")?,
        };
        if text == "max" {
            Some(u64::MAX)
        } else {
            text.parse().ok()
        }
    }

    /// Memory in use (page cache included), in bytes.
    pub fn memory_usage(&self) -> Option<u64> {
        let place = self.place(Controller::Memory)?;
        match place.version {
            Version::V1 => read(&place.dir, "memory.usage_in_bytes")?.parse().ok(),
            Version::V2 => read(&place.dir, "memory.current")?.parse().ok(),
        }
    }

    /// The most memory it ever used, where the kernel keeps that (v1; v2 `memory.peak`
    /// since Linux 5.19).
    pub fn memory_peak(&self) -> Option<u64> {
        let place = self.place(Controller::Memory)?;
        match place.version {
            Version::V1 => read(&place.dir, "memory.max_usage_in_bytes")?.parse().ok(),
            Version::V2 => read(&place.dir, "memory.peak")?.parse().ok(),
        }
    }

    /// How many processes the OOM killer ended in it (v1 `memory.oom_control`, v2
    /// `memory.events`).
    pub fn oom_kills(&self) -> Option<u64> {
        let place = self.place(Controller::Memory)?;
        let file = match place.version {
            Version::V1 => "memory.oom_control",
            Version::V2 => "memory.events",
        };
        keyed(&read(&place.dir, file)?, "oom_kill")
    }

    /// The IO weight (1-1000). Returns whether the host took one: v1 needs a weight file
    /// (`blkio.bfq.weight` with BFQ, `blkio.weight` with CFQ), v2 `io.weight` or
    /// `io.bfq.weight`. A weight only acts on devices whose scheduler honours it.
    pub fn set_io_weight(&self, weight: u16) -> io::Result<bool> {
        let Some(place) = self.place(Controller::Io) else {
            return Ok(false);
        };
        let files: &[&str] = match place.version {
            Version::V1 => &["blkio.bfq.weight", "blkio.weight"],
            Version::V2 => &["io.weight", "io.bfq.weight"],
        };
        match files.iter().find(|f| place.dir.join(f).exists()) {
            Some(file) => write(&place.dir, file, &weight.to_string()).map(|()| true),
            None => Ok(false),
        }
    }

    /// The IO weight as the kernel holds it, if the host has one.
    pub fn io_weight(&self) -> Option<u16> {
        let place = self.place(Controller::Io)?;
        let files: &[&str] = match place.version {
            Version::V1 => &["blkio.bfq.weight", "blkio.weight"],
            Version::V2 => &["io.weight", "io.bfq.weight"],
        };
        let text = files.iter().find_map(|f| read(&place.dir, f))?;
        // v2 says `default 100`; v1 just the number.
        text.split_whitespace().last()?.parse().ok()
    }

    /// CPU time its processes used, in microseconds.
    pub fn cpu_usage_usec(&self) -> Option<u64> {
        let place = self.place(Controller::CpuAcct)?;
        match place.version {
            Version::V1 => read(&place.dir, "cpuacct.usage")?
                .parse::<u64>()
                .ok()
                .map(|ns| ns / 1000),
            Version::V2 => keyed(&read(&place.dir, "cpu.stat")?, "usage_usec"),
        }
    }

    /// How often the CPU quota held it back (periods throttled).
    pub fn cpu_throttled_periods(&self) -> Option<u64> {
        let place = self.place(Controller::Cpu)?;
        keyed(&read(&place.dir, "cpu.stat")?, "nr_throttled")
    }

    /// The processes in it, in any of its hierarchies.
    pub fn procs(&self) -> Vec<i32> {
        let mut pids: Vec<i32> = self
            .dirs
            .iter()
            .filter_map(|p| fs::read_to_string(p.dir.join("cgroup.procs")).ok())
            .flat_map(|t| t.lines().filter_map(|l| l.trim().parse().ok()).collect::<Vec<_>>())
            .collect();
        pids.sort_unstable();
        pids.dedup();
        pids
    }

    /// Removes it from every hierarchy (rmdir: a cgroup's files go with it). Absent is
    /// fine; one whose processes are still leaving is waited for a moment.
    pub fn remove(&self) -> io::Result<()> {
        for place in &self.dirs {
            let deadline = Instant::now() + REMOVE_PATIENCE;
            loop {
                match fs::remove_dir(&place.dir) {
                    Ok(()) => break,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => break,
                    Err(e) if e.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    Err(e) => {
                        return Err(io::Error::new(
                            e.kind(),
                            format!("removing the cgroup {}: {e}", place.dir.display()),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// The children of this cgroup (names), in any hierarchy.
    pub fn children(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .dirs
            .iter()
            .filter_map(|p| fs::read_dir(&p.dir).ok())
            .flat_map(|entries| {
                entries
                    .filter_map(Result::ok)
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
            })
            .collect();
        names.sort();
        names.dedup();
        names
    }

    /// The cgroup `name` under this one, for the same controllers.
    pub fn child(&self, name: &str) -> Cgroup {
        Cgroup {
            path: format!("{}/{name}", self.path),
            dirs: self
                .dirs
                .iter()
                .map(|p| Place {
                    dir: p.dir.join(name),
                    ..p.clone()
                })
                .collect(),
        }
    }
}

fn mkdir(dir: &Path) -> io::Result<()> {
    match fs::create_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io::Error::new(
            e.kind(),
            format!("creating the cgroup {}: {e}", dir.display()),
        )),
    }
}

/// Enables `names` for the children of the v2 cgroup `dir` (those already on are left).
fn enable(dir: &Path, names: &[&str]) -> io::Result<()> {
    if names.is_empty() {
        return Ok(());
    }
    let on = read(dir, "cgroup.subtree_control").unwrap_or_default();
    for name in names {
        if !on.split_whitespace().any(|c| c == *name) {
            write(dir, "cgroup.subtree_control", &format!("+{name}"))?;
        }
    }
    Ok(())
}

fn write(dir: &Path, file: &str, value: &str) -> io::Result<()> {
    let path = dir.join(file);
    fs::write(&path, value)
        .map_err(|e| io::Error::new(e.kind(), format!("writing {value:?} to {}: {e}", path.display())))
}

fn read(dir: &Path, file: &str) -> Option<String> {
    fs::read_to_string(dir.join(file)).ok().map(|s| s.trim().to_string())
}

/// The number after `key` in a `key value` per line file.
fn keyed(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut words = l.split_whitespace();
        (words.next() == Some(key)).then(|| words.next()?.parse().ok())?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: [Controller; 4] = [Controller::Cpu, Controller::CpuAcct, Controller::Memory, Controller::Io];

    /// A fake cgroup file system under `root`: the directories a kernel would make, and
    /// the files each cgroup would hold, as plain files.
    fn fake_v1(root: &Path, cpu_dir: &str) -> String {
        let mut mounts = String::new();
        for (dir, opts) in [
            (cpu_dir, if cpu_dir == "cpu,cpuacct" { "cpu,cpuacct" } else { "cpu" }),
            ("cpuacct", "cpuacct"),
            ("memory", "memory"),
            ("blkio", "blkio"),
            ("systemd", "name=systemd"),
        ] {
            if cpu_dir == "cpu,cpuacct" && dir == "cpuacct" {
                continue;
            }
            fs::create_dir_all(root.join(dir)).unwrap();
            mounts.push_str(&format!(
                "cgroup {} cgroup rw,nosuid,{opts} 0 0\n",
                root.join(dir).display()
            ));
        }
        mounts
    }

    #[test]
    fn a_hybrid_host_puts_each_controller_in_its_v1_hierarchy_and_leaves_the_unified_mount_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        let mut mounts = fake_v1(root, "cpu");
        fs::create_dir_all(root.join("unified")).unwrap();
        fs::write(root.join("unified/cgroup.controllers"), "hugetlb\n").unwrap();
        mounts.push_str(&format!("cgroup2 {} cgroup2 rw 0 0\n", root.join("unified").display()));
        let layout = Layout::from_mounts(&mounts);
        let cg = Cgroup::new(&layout, "/odvm-abc/vm-1", &ALL);
        assert_eq!(
            cg.dirs(),
            ["cpu", "cpuacct", "memory", "blkio"].map(|c| root.join(c).join("odvm-abc/vm-1"))
        );
        assert_eq!(cg.path(), "/odvm-abc/vm-1");
        cg.create().unwrap();
        assert!(!root.join("unified/odvm-abc").exists());
        assert!(!root.join("systemd/odvm-abc").exists());

        let cpu = root.join("cpu/odvm-abc/vm-1");
        cg.set_cpu_quota(Some(10_000), 100_000).unwrap();
        assert_eq!(fs::read_to_string(cpu.join("cpu.cfs_quota_us")).unwrap(), "10000");
        assert_eq!(fs::read_to_string(cpu.join("cpu.cfs_period_us")).unwrap(), "100000");
        assert_eq!(cg.cpu_quota(), Some((Some(10_000), 100_000)));
        cg.set_cpu_quota(None, 100_000).unwrap();
        assert_eq!(cg.cpu_quota(), Some((None, 100_000)));

        // memory+swap only where the kernel accounts swap; raised first, lowered last.
        let mem = root.join("memory/odvm-abc/vm-1");
        cg.set_memory_limit(300 << 20, true).unwrap();
        assert_eq!(cg.memory_limit(), Some(300 << 20));
        assert!(!mem.join("memory.memsw.limit_in_bytes").exists());
        fs::write(mem.join("memory.memsw.limit_in_bytes"), "9223372036854771712").unwrap();
        cg.set_memory_limit(200 << 20, true).unwrap();
        assert_eq!(
            fs::read_to_string(mem.join("memory.memsw.limit_in_bytes")).unwrap(),
            (200u64 << 20).to_string()
        );

        // No weight file (no BFQ/CFQ): no weight, and no error.
        assert!(!cg.set_io_weight(100).unwrap());
        fs::write(root.join("blkio/odvm-abc/vm-1/blkio.bfq.weight"), "100").unwrap();
        assert!(cg.set_io_weight(200).unwrap());
        assert_eq!(cg.io_weight(), Some(200));

        fs::write(
            mem.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n",
        )
        .unwrap();
        assert_eq!(cg.oom_kills(), Some(1));
        fs::write(root.join("cpuacct/odvm-abc/vm-1/cpuacct.usage"), "2500000\n").unwrap();
        assert_eq!(cg.cpu_usage_usec(), Some(2500));
    }

    #[test]
    fn cpu_and_cpuacct_sharing_one_v1_hierarchy_make_one_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let layout = Layout::from_mounts(&fake_v1(tmp.path(), "cpu,cpuacct"));
        let cg = Cgroup::new(&layout, "p/vm", &ALL);
        assert_eq!(
            cg.dirs(),
            ["cpu,cpuacct", "memory", "blkio"].map(|c| tmp.path().join(c).join("p/vm"))
        );
    }

    #[test]
    fn a_pure_v2_host_makes_one_directory_and_enables_the_controllers_on_the_way_down() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        fs::write(root.join("cgroup.controllers"), "cpuset cpu io memory hugetlb pids\n").unwrap();
        fs::write(root.join("cgroup.subtree_control"), "memory pids\n").unwrap();
        let layout = Layout::from_mounts(&format!("cgroup2 {} cgroup2 rw,nsdelegate 0 0\n", root.display()));
        let cg = Cgroup::new(&layout, "odvm-abc/vm-1", &ALL);
        assert_eq!(cg.dirs(), vec![root.join("odvm-abc/vm-1")]);
        cg.create().unwrap();
        // A plain file keeps only the last write: the kernel's file would hold them all.
        assert_eq!(fs::read_to_string(root.join("cgroup.subtree_control")).unwrap(), "+io");
        assert_eq!(
            fs::read_to_string(root.join("odvm-abc/cgroup.subtree_control")).unwrap(),
            "+io"
        );
        let dir = root.join("odvm-abc/vm-1");
        cg.set_cpu_quota(Some(10_000), 100_000).unwrap();
        assert_eq!(fs::read_to_string(dir.join("cpu.max")).unwrap(), "10000 100000");
        assert_eq!(cg.cpu_quota(), Some((Some(10_000), 100_000)));
        cg.set_cpu_quota(None, 100_000).unwrap();
        assert_eq!(cg.cpu_quota(), Some((None, 100_000)));
        fs::write(dir.join("memory.swap.max"), "max").unwrap();
        cg.set_memory_limit(300 << 20, true).unwrap();
        assert_eq!(cg.memory_limit(), Some(300 << 20));
        assert_eq!(fs::read_to_string(dir.join("memory.swap.max")).unwrap(), "0");
        fs::write(dir.join("io.weight"), "default 100\n").unwrap();
        assert!(cg.set_io_weight(100).unwrap());
        assert_eq!(cg.io_weight(), Some(100));
        fs::write(dir.join("memory.events"), "low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n").unwrap();
        assert_eq!(cg.oom_kills(), Some(1));
        fs::write(dir.join("cpu.stat"), "usage_usec 1234\nuser_usec 1000\n").unwrap();
        assert_eq!(cg.cpu_usage_usec(), Some(1234));
        assert_eq!(cg.child("x").dirs(), vec![dir.join("x")]);
    }

    #[test]
    fn a_host_without_a_controller_says_which_it_lacks() {
        let tmp = tempfile::tempdir().unwrap();
        fs::write(tmp.path().join("cgroup.controllers"), "pids\n").unwrap();
        let layout = Layout::from_mounts(&format!("cgroup2 {} cgroup2 rw 0 0\n", tmp.path().display()));
        assert_eq!(
            Cgroup::lacks(&layout, &ALL),
            vec![Controller::Cpu, Controller::Memory, Controller::Io]
        );
        let cg = Cgroup::new(&layout, "a/b", &[Controller::Cpu]);
        assert!(cg.set_cpu_quota(Some(1000), 100_000).is_err());
        assert!(Layout::from_mounts("").place(Controller::Memory).is_none());
    }

    #[test]
    fn removing_a_cgroup_that_is_gone_is_fine() {
        let tmp = tempfile::tempdir().unwrap();
        let layout = Layout::from_mounts(&fake_v1(tmp.path(), "cpu"));
        let cg = Cgroup::new(&layout, "p/vm", &ALL);
        cg.remove().unwrap();
        cg.create().unwrap();
        assert!(cg.exists());
        assert_eq!(cg.procs(), Vec::<i32>::new());
        // A real cgroup's files vanish with rmdir; the fake's are plain files.
        cg.remove().unwrap();
        assert!(!cg.exists());
    }
}
