//! The OCI runtime spec (config.json) of a sandbox: its own namespaces (no host
//! network: only `lo`), cgroup limits, a reduced capability set, no_new_privileges,
//! the seccomp allow list of [`super::seccomp`], masked and read-only /proc paths, only
//! the default devices, and lxcfs's views of /proc and /sys (see [`super::lxcfs`]) bound
//! over the container's own, on a cpuset of its own (see [`super::cpus`]); where the host
//! has AppArmor, PID 1 (the agent) runs under [`super::apparmor::AGENT_PROFILE`].

use std::collections::{HashMap, HashSet};

use oci_spec::runtime::{
    Capability, LinuxBlockIoBuilder, LinuxBuilder, LinuxCapabilitiesBuilder, LinuxCpuBuilder, LinuxDeviceCgroupBuilder,
    LinuxDeviceType, LinuxIdMappingBuilder, LinuxMemoryBuilder, LinuxNamespaceBuilder, LinuxNamespaceType,
    LinuxPidsBuilder, LinuxResourcesBuilder, Mount, MountBuilder, PosixRlimitBuilder, PosixRlimitType, ProcessBuilder,
    RootBuilder, Spec, SpecBuilder, UserBuilder,
};

use super::{ContainerError, SandboxSpec};

pub const CPU_PERIOD_US: u64 = 100_000;
/// `cpu.shares` of a best-effort sandbox (the kernel's least; v2 weight 1), and of every
/// other (the kernel's default).
const BEST_EFFORT_SHARES: u64 = 2;
const DEFAULT_SHARES: u64 = 1024;

/// A sandbox's CPU weight against the others.
pub fn cpu_shares(limits: &super::Limits) -> u64 {
    if limits.best_effort {
        BEST_EFFORT_SHARES
    } else {
        DEFAULT_SHARES
    }
}

/// Masked: replaced by /dev/null (files) or an empty read-only tmpfs (dirs).
pub const MASKED_PATHS: &[&str] = &[
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/proc/sysrq-trigger",
    // The host's core dump handler (a path or a pipe to a host program).
    "/proc/sys/kernel/core_pattern",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

pub const READONLY_PATHS: &[&str] = &["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys"];

/// Capabilities kept (bounding = permitted = effective for root; a non-root process
/// gets none effective). Left out on purpose, among others: SYS_ADMIN, NET_ADMIN,
/// SYS_PTRACE, SYS_MODULE, SYS_RAWIO, SYS_TIME, SYS_BOOT, MKNOD, NET_RAW, AUDIT_CONTROL,
/// MAC_*, BPF, PERFMON, SYS_RESOURCE, DAC_READ_SEARCH, LINUX_IMMUTABLE, IPC_LOCK.
const CAPABILITIES: &[Capability] = &[
    Capability::AuditWrite,
    Capability::Chown,
    Capability::DacOverride,
    Capability::Fowner,
    Capability::Fsetid,
    Capability::Kill,
    Capability::NetBindService,
    Capability::Setfcap,
    Capability::Setgid,
    Capability::Setpcap,
    Capability::Setuid,
    Capability::SysChroot,
];

/// What the host supports, decided once by the backend.
#[derive(Clone, Copy, Debug)]
pub struct HostSupport {
    pub io_weight: bool,
    pub swap_limit: bool,
    /// The sandboxes' AppArmor profiles are loaded (see [`super::apparmor`]).
    pub apparmor: bool,
}

/// Where a sandbox is placed on this host, decided by the backend when it is made.
#[derive(Default)]
pub struct Placement<'a> {
    /// With a base, the container is in a user namespace of its own that maps its ids
    /// 0..65535 to the host range from there (see `idmap.rs`).
    pub id_base: Option<u32>,
    /// Its cpuset (`None`: every CPU).
    pub cpus: Option<&'a str>,
    /// The lxcfs whose views it gets (`None`: it sees the host's /proc and /sys files).
    pub views: Option<&'a super::lxcfs::Lxcfs>,
}

fn invalid(e: impl std::fmt::Display) -> ContainerError {
    ContainerError::Invalid(format!("building the OCI spec: {e}"))
}

/// The spec of `spec`'s container, placed as `placement` says.
pub fn build_spec(
    spec: &SandboxSpec,
    cgroups_path: &str,
    host: HostSupport,
    placement: &Placement,
) -> Result<Spec, ContainerError> {
    let id_base = placement.id_base;
    let caps: HashSet<Capability> = CAPABILITIES.iter().copied().collect();
    let capabilities = LinuxCapabilitiesBuilder::default()
        .bounding(caps.clone())
        .permitted(caps.clone())
        .effective(caps)
        .inheritable(HashSet::new())
        .ambient(HashSet::new())
        .build()
        .map_err(invalid)?;
    let (uid, gid) = spec.process.user;
    let user = UserBuilder::default().uid(uid).gid(gid).build().map_err(invalid)?;
    let nofile = nofile_limit();
    let mut process = ProcessBuilder::default()
        .terminal(false)
        .user(user)
        .args(spec.process.args.clone())
        .env(spec.process.env.clone())
        .cwd(spec.process.cwd.clone())
        .capabilities(capabilities)
        .no_new_privileges(true)
        .rlimits(vec![
            PosixRlimitBuilder::default()
                .typ(PosixRlimitType::RlimitNofile)
                .hard(nofile)
                .soft(nofile)
                .build()
                .map_err(invalid)?,
        ])
        .build()
        .map_err(invalid)?;
    if host.apparmor {
        process.set_apparmor_profile(Some(super::apparmor::AGENT_PROFILE.into()));
    }

    let user_ns = id_base.map(|_| LinuxNamespaceType::User);
    let namespaces = user_ns
        .into_iter()
        .chain([
            LinuxNamespaceType::Pid,
            LinuxNamespaceType::Mount,
            LinuxNamespaceType::Ipc,
            LinuxNamespaceType::Uts,
            LinuxNamespaceType::Cgroup,
            // The edge's namespace for it (its link, its policy), or a new, empty one: the
            // runtime brings up `lo`, nothing else exists.
            LinuxNamespaceType::Network,
        ])
        .map(|typ| {
            let mut ns = LinuxNamespaceBuilder::default().typ(typ);
            if let (LinuxNamespaceType::Network, Some(path)) = (typ, &spec.netns) {
                ns = ns.path(path.clone());
            }
            ns.build().map_err(invalid)
        })
        .collect::<Result<Vec<_>, _>>()?;

    let limits = &spec.limits;
    let memory = limits.memory_bytes as i64;
    let mut memory_builder = LinuxMemoryBuilder::default().limit(memory);
    if host.swap_limit {
        // OCI swap = memory + swap: equal to the limit means no swap at all.
        memory_builder = memory_builder.swap(memory);
    }
    let mut cpu = LinuxCpuBuilder::default()
        .quota((limits.cpu_millis as u64 * CPU_PERIOD_US / 1000) as i64)
        .period(CPU_PERIOD_US)
        .shares(cpu_shares(limits));
    if let Some(cpus) = placement.cpus {
        cpu = cpu.cpus(cpus.to_string());
    }
    let mut resources = LinuxResourcesBuilder::default()
        .memory(memory_builder.build().map_err(invalid)?)
        .cpu(cpu.build().map_err(invalid)?)
        .pids(
            LinuxPidsBuilder::default()
                .limit(limits.pids as i64)
                .build()
                .map_err(invalid)?,
        )
        .devices(device_rules()?);
    if let (Some(weight), true) = (limits.io_weight, host.io_weight) {
        resources = resources.block_io(LinuxBlockIoBuilder::default().weight(weight).build().map_err(invalid)?);
    }

    let mut linux = LinuxBuilder::default();
    if let Some(base) = id_base {
        let map = LinuxIdMappingBuilder::default()
            .container_id(0u32)
            .host_id(base)
            .size(super::idmap::RANGE)
            .build()
            .map_err(invalid)?;
        linux = linux.uid_mappings(vec![map]).gid_mappings(vec![map]);
    }
    let linux = linux
        .namespaces(namespaces)
        .cgroups_path(cgroups_path)
        .resources(resources.build().map_err(invalid)?)
        .seccomp(super::seccomp::profile()?)
        .masked_paths(MASKED_PATHS.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .readonly_paths(READONLY_PATHS.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .rootfs_propagation("private")
        .devices(vec![])
        .build()
        .map_err(invalid)?;

    let mut mounts = default_mounts(spec.sysfs.as_deref())?;
    if let Some(lxcfs) = placement.views {
        for view in super::lxcfs::VIEWS {
            // A bind of a FUSE file shows its path in the FUSE file system (`/proc/meminfo`)
            // in the container's mountinfo, never the host's mount point.
            mounts.push(
                MountBuilder::default()
                    .destination(view)
                    .typ("bind")
                    .source(lxcfs.source(view))
                    .options(["bind", "ro", "nosuid", "nodev", "noexec"].map(String::from).to_vec())
                    .build()
                    .map_err(invalid)?,
            );
        }
    }
    for bind in &spec.binds {
        mounts.push(
            MountBuilder::default()
                .destination(&bind.container_path)
                .typ("bind")
                .source(&bind.host_path)
                .options(vec!["rbind".into(), "ro".into(), "nosuid".into(), "nodev".into()])
                .build()
                .map_err(invalid)?,
        );
    }

    let mut annotations = HashMap::new();
    for (k, v) in &spec.labels {
        annotations.insert(format!("dev.opendsec.label.{k}"), v.clone());
    }

    SpecBuilder::default()
        .version("1.0.2")
        .root(
            RootBuilder::default()
                .path("rootfs")
                .readonly(false)
                .build()
                .map_err(invalid)?,
        )
        .hostname(spec.id.clone())
        .process(process)
        .mounts(mounts)
        .linux(linux)
        .annotations(annotations)
        .build()
        .map_err(invalid)
}

fn nofile_limit() -> u64 {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit fills the struct we own.
    let hard = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0 {
        rl.rlim_max
    } else {
        1024
    };
    // Never above the edge's own hard limit: raising needs CAP_SYS_RESOURCE.
    hard.min(65536)
}

fn mount(dest: &str, typ: &str, source: &str, options: &[&str]) -> Result<Mount, ContainerError> {
    MountBuilder::default()
        .destination(dest)
        .typ(typ)
        .source(source)
        .options(options.iter().map(|s| s.to_string()).collect::<Vec<_>>())
        .build()
        .map_err(invalid)
}

fn default_mounts(sysfs: Option<&std::path::Path>) -> Result<Vec<Mount>, ContainerError> {
    let sys = match sysfs {
        Some(path) => MountBuilder::default()
            .destination("/sys")
            .typ("bind")
            .source(path)
            .options(["bind", "ro", "nosuid", "nodev", "noexec"].map(String::from).to_vec())
            .build()
            .map_err(invalid)?,
        None => mount("/sys", "sysfs", "sysfs", &["nosuid", "noexec", "nodev", "ro"])?,
    };
    Ok(vec![
        mount("/proc", "proc", "proc", &["nosuid", "noexec", "nodev"])?,
        mount(
            "/dev",
            "tmpfs",
            "tmpfs",
            &["nosuid", "strictatime", "mode=755", "size=65536k"],
        )?,
        mount(
            "/dev/pts",
            "devpts",
            "devpts",
            &["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        )?,
        mount(
            "/dev/shm",
            "tmpfs",
            "shm",
            &["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        )?,
        mount("/dev/mqueue", "mqueue", "mqueue", &["nosuid", "noexec", "nodev"])?,
        sys,
        mount(
            "/sys/fs/cgroup",
            "cgroup",
            "cgroup",
            &["nosuid", "noexec", "nodev", "relatime", "ro"],
        )?,
    ])
}

/// Deny every device, then allow the default set (null, zero, full, random, urandom,
/// tty, ptmx, pts). The runtime creates those nodes; no host device is ever bound in.
fn device_rules() -> Result<Vec<oci_spec::runtime::LinuxDeviceCgroup>, ContainerError> {
    let mut rules = vec![
        LinuxDeviceCgroupBuilder::default()
            .allow(false)
            .access("rwm")
            .build()
            .map_err(invalid)?,
    ];
    for (major, minor) in [
        (1, Some(3)),
        (1, Some(5)),
        (1, Some(7)),
        (1, Some(8)),
        (1, Some(9)),
        (5, Some(0)),
        (5, Some(2)),
        (136, None),
    ] {
        let mut b = LinuxDeviceCgroupBuilder::default()
            .allow(true)
            .typ(LinuxDeviceType::C)
            .major(major)
            .access("rwm");
        if let Some(minor) = minor {
            b = b.minor(minor);
        }
        rules.push(b.build().map_err(invalid)?);
    }
    Ok(rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec_json(apparmor: bool) -> serde_json::Value {
        let spec = SandboxSpec {
            id: "s1".into(),
            layers: vec!["/layer".into()],
            process: super::super::ProcessSpec {
                args: vec!["/.opendsec/agent".into()],
                env: vec![],
                cwd: "/".into(),
                user: (0, 0),
            },
            limits: super::super::Limits::default(),
            binds: vec![],
            netns: None,
            sysfs: None,
            extra_fds: vec![],
            labels: Default::default(),
        };
        let host = HostSupport {
            io_weight: true,
            swap_limit: true,
            apparmor,
        };
        let mut v =
            serde_json::to_value(build_spec(&spec, "/opendsec/s1", host, &Placement::default()).unwrap()).unwrap();
        // Capability sets come out in hash order.
        for set in v["process"]["capabilities"].as_object_mut().unwrap().values_mut() {
            set.as_array_mut().unwrap().sort_by_key(|c| c.to_string());
        }
        v
    }

    #[test]
    fn pid_1_runs_under_the_agents_apparmor_profile_only_where_it_is_loaded() {
        assert_eq!(spec_json(true)["process"]["apparmorProfile"], "opendsec-agent");
        let off = spec_json(false);
        assert!(off["process"].get("apparmorProfile").is_none(), "{}", off["process"]);
        // Everything else is the same either way.
        let mut on = spec_json(true);
        on["process"].as_object_mut().unwrap().remove("apparmorProfile");
        assert_eq!(on, off);
    }
}
