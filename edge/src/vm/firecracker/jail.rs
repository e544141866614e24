//! One jailed Firecracker process: the jailer's command line, its chroot
//! (`<chroot base>/firecracker/<id>/root`, where every file the VM uses is hard-linked
//! before the process starts) and its cgroup (`<parent>/<id>` of the cpuset controller;
//! v1 or v2, as the host mounts them). The jailer makes the chroot, the cgroup and the
//! device nodes, joins the network namespace, drops to the VM's uid and gid and execs
//! Firecracker with its default seccomp filter; removing what it made is ours.

use std::fs;
use std::path::{Path, PathBuf};

use super::super::{VmError, io_err};

/// Which cgroup hierarchy the jailer puts the process in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// v2 when `/sys/fs/cgroup` is the unified hierarchy itself; v1 otherwise (also on
/// hybrid hosts, whose cpuset controller is a v1 hierarchy).
pub fn cgroup_version() -> CgroupVersion {
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        CgroupVersion::V2
    } else {
        CgroupVersion::V1
    }
}

/// Where the cpuset controller is mounted, read from `/proc/mounts`.
fn cpuset_mount(version: CgroupVersion) -> Result<PathBuf, VmError> {
    let mounts = fs::read_to_string("/proc/mounts").map_err(io_err("reading /proc/mounts"))?;
    mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4).then(|| (f[1], f[2], f[3]))
        })
        .find(|(point, fstype, opts)| match version {
            CgroupVersion::V1 => *fstype == "cgroup" && opts.split(',').any(|o| o == "cpuset"),
            CgroupVersion::V2 => *fstype == "cgroup2" && *point == "/sys/fs/cgroup",
        })
        .map(|(point, _, _)| PathBuf::from(point))
        .ok_or_else(|| {
            VmError::Prerequisite(format!(
                "no cgroup {} cpuset controller in /proc/mounts: the jailer needs one",
                match version {
                    CgroupVersion::V1 => "v1",
                    CgroupVersion::V2 => "v2",
                }
            ))
        })
}

/// Everything the jailer needs to start one Firecracker process.
#[derive(Clone, Debug)]
pub struct JailSpec {
    /// The VM's id (letters, digits, '-'; at most 64): names the chroot and the cgroup.
    pub id: String,
    pub jailer: PathBuf,
    pub firecracker: PathBuf,
    pub chroot_base: PathBuf,
    pub uid: u32,
    pub gid: u32,
    /// `/run/netns/<name>`: the process joins it before it drops privileges.
    pub netns: Option<PathBuf>,
    /// The cgroup the VM's cgroup is made under (relative, one per driver).
    pub parent_cgroup: String,
    pub cgroup: CgroupVersion,
}

/// The API socket, as the jailed process sees it.
pub const API_SOCKET: &str = "/api.sock";

impl JailSpec {
    /// `<chroot base>/<exec file name>/<id>`: removed whole at cleanup.
    pub fn dir(&self) -> PathBuf {
        let exec = self
            .firecracker
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "firecracker".into());
        self.chroot_base.join(exec).join(&self.id)
    }

    /// The chroot: `/` of the jailed process.
    pub fn root(&self) -> PathBuf {
        self.dir().join("root")
    }

    /// The host path of a path inside the chroot.
    pub fn host_path(&self, inside: &str) -> PathBuf {
        self.root().join(inside.trim_start_matches('/'))
    }

    pub fn api_socket(&self) -> PathBuf {
        self.host_path(API_SOCKET)
    }

    /// The cpuset cgroup the jailer makes for the process.
    pub fn cgroup_dir(&self) -> Result<PathBuf, VmError> {
        Ok(cpuset_mount(self.cgroup)?.join(&self.parent_cgroup).join(&self.id))
    }

    /// The jailer's argv (argv[0] is the jailer). The cgroup gets every CPU and memory
    /// node of the controller's root, written explicitly: a new v1 cpuset is empty.
    pub fn argv(&self) -> Result<Vec<String>, VmError> {
        let mount = cpuset_mount(self.cgroup)?;
        let read = |names: &[&str]| -> Result<String, VmError> {
            names
                .iter()
                .find_map(|n| fs::read_to_string(mount.join(n)).ok())
                .map(|s| s.trim().to_string())
                .filter(|s| !s.is_empty())
                .ok_or_else(|| {
                    VmError::Prerequisite(format!("cannot read {} under {}", names.join(" or "), mount.display()))
                })
        };
        let cpus = read(&["cpuset.cpus.effective", "cpuset.cpus"])?;
        let mems = read(&["cpuset.mems.effective", "cpuset.mems"])?;
        let mut argv: Vec<String> = vec![
            self.jailer.to_string_lossy().into(),
            "--id".into(),
            self.id.clone(),
            "--exec-file".into(),
            self.firecracker.to_string_lossy().into(),
            "--uid".into(),
            self.uid.to_string(),
            "--gid".into(),
            self.gid.to_string(),
            "--chroot-base-dir".into(),
            self.chroot_base.to_string_lossy().into(),
            "--cgroup-version".into(),
            match self.cgroup {
                CgroupVersion::V1 => "1".into(),
                CgroupVersion::V2 => "2".into(),
            },
            "--parent-cgroup".into(),
            self.parent_cgroup.clone(),
            "--cgroup".into(),
            format!("cpuset.mems={mems}"),
            "--cgroup".into(),
            format!("cpuset.cpus={cpus}"),
        ];
        if let Some(netns) = &self.netns {
            argv.extend(["--netns".into(), netns.to_string_lossy().into()]);
        }
        // No --daemonize: the VM shim is the detached parent and keeps the console.
        argv.extend(["--".into(), "--api-sock".into(), API_SOCKET.into()]);
        Ok(argv)
    }

    /// Removes a previous jail of this id (a crashed run) and makes an empty chroot.
    pub fn prepare(&self) -> Result<(), VmError> {
        self.cleanup()?;
        let root = self.root();
        fs::create_dir_all(&root).map_err(io_err(format!("creating {}", root.display())))?;
        Ok(())
    }

    /// Hard-links `src` into the chroot as `inside` (the same inode: owner and mode are
    /// the source's). Across file systems the file is copied (sparse) instead.
    pub fn link(&self, src: &Path, inside: &str) -> Result<PathBuf, VmError> {
        let dest = self.host_path(inside);
        match fs::hard_link(src, &dest) {
            Ok(()) => Ok(dest),
            Err(e) if e.raw_os_error() == Some(libc::EXDEV) => {
                super::super::sparse_copy(src, &dest)?;
                Ok(dest)
            }
            Err(e) => Err(VmError::io(
                format!("linking {} into {}", src.display(), dest.display()),
                e,
            )),
        }
    }

    /// Removes the chroot and the cgroup (the process must have ended: a cgroup with a
    /// task cannot be removed). Absent pieces are fine.
    pub fn cleanup(&self) -> Result<(), VmError> {
        let dir = self.dir();
        if dir.exists() {
            fs::remove_dir_all(&dir)
                .or_else(|_| fs::remove_dir_all(&dir))
                .map_err(io_err(format!("removing the jail {}", dir.display())))?;
        }
        if let Ok(cgroup) = self.cgroup_dir()
            && cgroup.exists()
        {
            // rmdir, not remove_dir_all: a cgroup's files are not removable.
            fs::remove_dir(&cgroup).map_err(io_err(format!("removing the cgroup {}", cgroup.display())))?;
        }
        Ok(())
    }
}
