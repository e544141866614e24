//! The container backend: OCI bundles run by crun or runc, each under a detached
//! shim (`opendsec-shim`) so that sandboxes are never children of the edge and keep
//! running when the edge dies; a restarted edge re-adopts them from their directories.
//!
//! A sandbox directory `<sandboxes root>/<id>/` holds everything about one sandbox:
//! `sandbox.json` (the record below), `disk.img` + `disk/` (its size-limited scratch
//! disk with the overlay upper/work dirs), `rootfs/` (the overlay), `config.json` (the
//! OCI bundle is this directory), `init.pid`, `shim.pid`, `output.log[.1]` (PID 1's
//! output, size-capped), `runtime.log`, `shim.log` and, once PID 1 has exited,
//! `exit.json`. `stored` marks a sandbox whose processes a file-system-only pause ended
//! ([`ContainerBackend::store`]): its disk and overlay stay, and
//! [`ContainerBackend::restart`] boots it again on them.
//!
//! Rooms: `create.rs` makes a sandbox; `lifecycle.rs` is its life once made (state,
//! signals, freeze, store and restart, removal); `warm.rs` the containers made ahead.
//!
//! **Architecture Invariant**: the edge keeps no state about a sandbox that is not in
//! its directory or in the runtime's state; [`ContainerBackend::list`] rebuilds it all.

pub mod apparmor;
pub mod cgroup;
pub mod cpus;
mod create;
mod disk;
pub mod idmap;
mod lifecycle;
pub mod lxcfs;
pub mod oci;
pub mod oom;
pub mod runtime;
pub mod seccomp;
pub mod shim;
pub mod warm;

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Read};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

pub use disk::is_mounted;
pub(crate) use disk::{attach_loop, lower_priority};
pub use runtime::{Runtime, RuntimeChoice, RuntimeKind};

/// Default directory of sandbox directories on an edge machine.
pub const DEFAULT_SANDBOXES_ROOT: &str = "/var/lib/opendsec/sandboxes";
/// Default state directory of the runtimes (tmpfs: runtimes' state dies with a reboot,
/// as do the containers).
pub const DEFAULT_RUNTIME_ROOT: &str = "/run/opendsec/runtime";

#[derive(Debug, thiserror::Error)]
pub enum ContainerError {
    #[error("invalid sandbox request: {0}")]
    Invalid(String),
    #[error("missing prerequisite: {0}")]
    Prerequisite(String),
    #[error("sandbox {0} already exists")]
    AlreadyExists(String),
    #[error("no sandbox {0}")]
    NotFound(String),
    #[error("{runtime} {command} failed: {message}")]
    Runtime {
        runtime: &'static str,
        command: String,
        message: String,
    },
    #[error("storage: {0}")]
    Storage(String),
    #[error("the shim failed to start sandbox {id}: {message}")]
    Shim { id: String, message: String },
    #[error("{context}: {source}")]
    Io { context: String, source: io::Error },
}

impl ContainerError {
    pub(crate) fn io(context: impl Into<String>, source: io::Error) -> Self {
        ContainerError::Io {
            context: context.into(),
            source,
        }
    }
}

/// Whether this kernel has core scheduling (`PR_SCHED_CORE`), with which each
/// latency-sensitive sandbox's agent takes a cookie of its own (see the agent's `config`).
pub fn core_scheduling() -> bool {
    const PR_SCHED_CORE: libc::c_int = 62;
    const PR_SCHED_CORE_GET: libc::c_ulong = 0;
    let mut cookie: u64 = 0;
    // SAFETY: prctl writes the cookie of this process into the u64 we own.
    unsafe { libc::prctl(PR_SCHED_CORE, PR_SCHED_CORE_GET, 0, 0, &mut cookie as *mut u64) == 0 }
}

/// Resource limits of one sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// Memory limit; swap is limited to zero beyond it.
    pub memory_bytes: u64,
    /// CPU in thousandths of a core (1000 = one core), as a CFS quota per 100 ms period.
    pub cpu_millis: u32,
    /// Maximum number of tasks (processes + threads).
    pub pids: u32,
    /// Relative IO weight (10-1000); ignored (and recorded as not applied) on hosts
    /// whose IO scheduler has no weights.
    pub io_weight: Option<u16>,
    /// Size of the sandbox's writable disk (all writes to the root file system).
    pub disk_bytes: u64,
    /// Best-effort CPU class: the least CPU weight (and SCHED_IDLE, which its agent takes
    /// at boot), so it runs on the time latency-sensitive sandboxes leave.
    #[serde(default)]
    pub best_effort: bool,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            memory_bytes: 512 << 20,
            cpu_millis: 1000,
            pids: 512,
            io_weight: Some(100),
            disk_bytes: 1 << 30,
            best_effort: false,
        }
    }
}

/// PID 1 of the container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessSpec {
    pub args: Vec<String>,
    pub env: Vec<String>,
    pub cwd: String,
    /// (uid, gid); the images' unprivileged `user` is (1000, 1000).
    pub user: (u32, u32),
}

/// A host file or directory bound read-only into the sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BindMount {
    pub host_path: PathBuf,
    pub container_path: String,
}

/// Everything needed to create a sandbox.
#[derive(Clone, Debug)]
pub struct SandboxSpec {
    /// Also the hostname and the runtime's container id: `[A-Za-z0-9_-]`, at most 63.
    pub id: String,
    /// Image layer directories, bottom first (see `ImageStore::layer_dirs`).
    pub layers: Vec<PathBuf>,
    pub process: ProcessSpec,
    pub limits: Limits,
    pub binds: Vec<BindMount>,
    /// Open fds handed to PID 1 as fds 3, 4, ... (e.g. a listening Unix socket).
    /// Borrowed: the backend duplicates them and the caller keeps its own.
    pub extra_fds: Vec<RawFd>,
    pub labels: BTreeMap<String, String>,
    /// The network namespace it joins (the edge's `net` room made it, with the sandbox's
    /// link and policy); `None`: a new, empty one (only `lo`).
    pub netns: Option<PathBuf>,
    /// A sysfs of that namespace, bound read-only at `/sys` (a container in a user
    /// namespace cannot mount one for a namespace it does not own); `None`: the runtime
    /// mounts its own.
    pub sysfs: Option<PathBuf>,
}

impl SandboxSpec {
    /// A spec for `args` in `image`, with the image's environment and working directory,
    /// running as root (set `process.user` to (1000, 1000) for the image's `user`).
    pub fn from_image(
        id: impl Into<String>,
        store: &crate::images::ImageStore,
        image: &crate::images::Image,
        args: Vec<String>,
    ) -> Result<Self, crate::images::ImageError> {
        Ok(Self {
            id: id.into(),
            layers: store.layer_dirs(image)?,
            process: ProcessSpec {
                args,
                env: image.config.env.clone(),
                cwd: if image.config.workdir.is_empty() {
                    "/".into()
                } else {
                    image.config.workdir.clone()
                },
                user: (0, 0),
            },
            limits: Limits::default(),
            binds: Vec::new(),
            extra_fds: Vec::new(),
            labels: BTreeMap::new(),
            netns: None,
            sysfs: None,
        })
    }
}

/// How PID 1 ended (the shim's `exit.json`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitInfo {
    /// The exit code, or 128 + signal when killed by a signal.
    pub exit_code: i32,
    pub signal: Option<i32>,
    /// Init was killed by SIGKILL and the sandbox's memory cgroup counts OOM kills.
    pub oom_killed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SandboxStatus {
    /// The runtime has the container but PID 1 has not started the user program.
    Created,
    Running,
    Paused,
    /// Its processes were ended by a file-system-only pause; its file system is kept and
    /// [`ContainerBackend::restart`] boots it again.
    Stored,
    /// PID 1 has exited (see [`SandboxState::exit`]).
    Stopped,
    /// The directory exists but the runtime does not know the container (e.g. after a
    /// host reboot) and no exit was recorded.
    Lost,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxState {
    pub id: String,
    pub status: SandboxStatus,
    pub init_pid: Option<i32>,
    pub exit: Option<ExitInfo>,
}

/// What is persisted in `sandbox.json`; the shim reads it too.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub id: String,
    /// The runtime's container id when it is not `id`: a warm container claimed by
    /// this sandbox keeps the id it was created with (see [`warm`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime_id: Option<String>,
    pub runtime: Runtime,
    pub cgroups_path: String,
    pub limits: Limits,
    pub io_weight_applied: bool,
    pub layers: Vec<PathBuf>,
    pub labels: BTreeMap<String, String>,
    pub extra_fds: usize,
    pub log_cap_bytes: u64,
    pub created_unix_ms: u64,
    /// The base of its host id range (its user namespace maps 0..65535 there); `None`
    /// for a container without one (an edge started without user namespaces).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id_base: Option<u32>,
    /// Its cpuset (`0-1,3`, see [`cpus`]); `None`: every CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpus: Option<String>,
}

impl SandboxRecord {
    /// The container's id in the runtime.
    pub fn runtime_id(&self) -> &str {
        self.runtime_id.as_deref().unwrap_or(&self.id)
    }
}

/// A sandbox as the backend knows it.
#[derive(Clone, Debug)]
pub struct Handle {
    pub id: String,
    pub dir: PathBuf,
    pub record: SandboxRecord,
}

impl Handle {
    /// PID 1 of the container (host pid namespace), once started.
    pub fn init_pid(&self) -> Option<i32> {
        read_pid(&self.dir.join("init.pid"))
    }
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("output.log")
    }
}

#[derive(Clone, Debug)]
pub struct ContainerConfig {
    pub sandboxes_root: PathBuf,
    /// Parent of the runtimes' state directories.
    pub runtime_root: PathBuf,
    pub runtime: RuntimeChoice,
    /// Path of the `opendsec-shim` binary.
    pub shim: PathBuf,
    /// Cgroup parent of all sandboxes (`/<parent>/<id>`).
    pub cgroup_parent: String,
    /// Warm disks kept ready (see [`disk::Pool`]), and their size: sandboxes asking for
    /// another size make their own. 0 keeps none.
    pub warm_disks: usize,
    pub warm_disk_bytes: u64,
    /// PID 1's output log is rotated at this size (one old file kept).
    pub log_cap_bytes: u64,
    /// Each container in a user namespace of its own (see [`idmap`]). Off only where an
    /// operator says so: root inside is then root outside.
    pub user_namespaces: bool,
    /// The directory of the machine's lxcfs (see [`lxcfs`]), whose views of `/proc` and
    /// `/sys` every container gets; `None` only where an operator says so: sandboxes then
    /// see the host's memory, load and uptime.
    pub lxcfs: Option<PathBuf>,
    /// Where the sandboxes' AppArmor profiles are written before they are loaded, on
    /// hosts whose kernel has AppArmor (see [`apparmor`]); `None` only where an operator
    /// says so: sandbox code is then kept off the agent by everything but AppArmor.
    pub apparmor: Option<PathBuf>,
}

impl Default for ContainerConfig {
    fn default() -> Self {
        let shim = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|d| d.join("opendsec-shim")))
            .filter(|p| p.is_file())
            .or_else(|| runtime::find_binary("opendsec-shim"))
            .unwrap_or_else(|| PathBuf::from("opendsec-shim"));
        Self {
            sandboxes_root: DEFAULT_SANDBOXES_ROOT.into(),
            runtime_root: DEFAULT_RUNTIME_ROOT.into(),
            runtime: RuntimeChoice::Auto,
            shim,
            cgroup_parent: "opendsec".into(),
            log_cap_bytes: 1 << 20,
            warm_disks: 0,
            warm_disk_bytes: Limits::default().disk_bytes,
            user_namespaces: true,
            lxcfs: Some(lxcfs::DEFAULT_DIR.into()),
            apparmor: Some(apparmor::DEFAULT_DIR.into()),
        }
    }
}

pub struct ContainerBackend {
    config: ContainerConfig,
    runtime: Runtime,
    host: oci::HostSupport,
    pool: Option<std::sync::Arc<disk::Pool>>,
    /// The id ranges of the containers' user namespaces (`None`: the edge runs without).
    ids: Option<idmap::IdRanges>,
    /// The views bound into containers (`None`: the edge runs without).
    lxcfs: Option<lxcfs::Lxcfs>,
    /// The sandboxes' cpusets.
    cpus: cpus::CpuSets,
}

impl ContainerBackend {
    pub fn new(config: ContainerConfig) -> Result<Self, ContainerError> {
        if !config.shim.is_file() {
            return Err(ContainerError::Prerequisite(format!(
                "the shim binary {} does not exist (build the opendsec-shim binary)",
                config.shim.display()
            )));
        }
        fs::create_dir_all(&config.sandboxes_root)
            .map_err(|e| ContainerError::io(format!("creating {}", config.sandboxes_root.display()), e))?;
        let runtime = Runtime::resolve(config.runtime, &config.runtime_root)?;
        let apparmor = match &config.apparmor {
            Some(dir) => apparmor::enable(Path::new(apparmor::SYS), dir)?,
            None => {
                tracing::warn!(
                    "AppArmor is off (--insecure-no-apparmor): sandboxes run without a profile that keeps their \
                     code off the agent's files and process"
                );
                false
            }
        };
        let host = oci::HostSupport {
            io_weight: cgroup::io_weight_supported(),
            swap_limit: cgroup::swap_limit_supported(),
            apparmor,
        };
        let pool = (config.warm_disks > 0)
            .then(|| disk::Pool::new(&config.sandboxes_root, config.warm_disk_bytes, config.warm_disks));
        let (lxcfs, found) = match &config.lxcfs {
            Some(dir) => {
                let lxcfs = lxcfs::Lxcfs::new(dir);
                let found = lxcfs.ensure()?;
                tracing::info!(
                    mount = %lxcfs.mount_dir().display(),
                    pid = ?lxcfs.pid(),
                    found = ?found,
                    "sandboxes get lxcfs views: /proc and /sys show their own memory, CPUs, load and uptime"
                );
                (Some(lxcfs), Some(found))
            }
            None => {
                tracing::warn!("lxcfs views are off: sandboxes see the host's memory, CPUs, load and uptime");
                (None, None)
            }
        };
        let mut backend = Self {
            config,
            runtime,
            host,
            pool,
            ids: None,
            lxcfs,
            cpus: cpus::CpuSets::adopt(Vec::new(), std::iter::empty()),
        };
        // What the sandboxes here hold (CPUs, id ranges), read once. Warm containers left
        // behind are discarded at start: what they hold counts until then.
        let mut held: Vec<SandboxRecord> = backend.list()?.into_iter().map(|h| h.record).collect();
        held.extend(
            backend
                .unstarted()
                .iter()
                .filter_map(|w| backend.unstarted_record(w).ok()),
        );
        // Without the cpuset controller no sandbox gets a cpuset (an empty host list).
        let cpuset = cgroup::cpuset_supported();
        let host_cpus = if cpuset { cpus::host_cpus() } else { Vec::new() };
        backend.cpus = cpus::CpuSets::adopt(host_cpus, held.iter().filter_map(|r| r.cpus.as_deref()));
        if found.is_some() {
            // The sandboxes a previous edge left may have had an lxcfs that died since.
            backend.rebind_dead_views();
        }
        if cpuset {
            tracing::info!(
                host_cpus = %cpus::format(backend.cpus.host()),
                "each sandbox runs on a cpuset of ceil(cpu_millis / 1000) CPUs, so nproc shows its own"
            );
        } else {
            tracing::warn!("no cpuset cgroup controller: sandboxes' nproc shows the host's CPUs");
        }
        if backend.config.user_namespaces {
            idmap::probe(&backend.config.sandboxes_root).map_err(|e| {
                ContainerError::Prerequisite(format!(
                    "{e}. Sandboxes are not started without a user namespace of their own; \
                     to run them as host root anyway (unsafe), start the edge with --insecure-no-user-namespaces"
                ))
            })?;
            idmap::raise_shared_limits()?;
            backend.ids = Some(idmap::IdRanges::adopt(held.iter().filter_map(|r| r.id_base)));
        } else {
            tracing::warn!("user namespaces are off: root in a sandbox is root on this host");
        }
        if !core_scheduling() {
            tracing::warn!(
                "this kernel has no core scheduling (CONFIG_SCHED_CORE): a latency-sensitive sandbox's threads \
                 may share SMT siblings with other tenants' threads"
            );
        }
        Ok(backend)
    }

    /// Makes sure lxcfs serves the views (a `statfs` and a `stat` when it does): over a
    /// dead mount it starts a new lxcfs, and whenever the mount is a new one (this edge or
    /// another started it) it binds the new views into every sandbox whose views are dead.
    /// Called before each create and by the edge each time it observes its sandboxes.
    pub fn keep_views(&self) -> Result<(), ContainerError> {
        if let Some(l) = &self.lxcfs
            && l.ensure()? == lxcfs::Found::Restarted
        {
            self.rebind_dead_views();
        }
        Ok(())
    }

    /// Binds the live views into every sandbox and warm container whose PID 1 runs and
    /// whose views are dead.
    fn rebind_dead_views(&self) {
        let Some(l) = &self.lxcfs else { return };
        let mut dirs: Vec<PathBuf> = self.list().unwrap_or_default().into_iter().map(|h| h.dir).collect();
        dirs.extend(
            self.unstarted()
                .iter()
                .map(|w| self.config.sandboxes_root.join(format!(".{w}"))),
        );
        let mut rebound = 0;
        for dir in dirs {
            let Some(pid) = read_pid(&dir.join("init.pid")) else {
                continue;
            };
            if exit_info_in(&dir).ok().flatten().is_some() || !process_alive(pid) || !lxcfs::Lxcfs::dead_in(pid) {
                continue;
            }
            match l.rebind(pid) {
                Ok(()) => rebound += 1,
                Err(e) => tracing::warn!(sandbox = %dir.display(), error = %e, "cannot bind the new lxcfs views"),
            }
        }
        if rebound > 0 {
            tracing::info!(
                sandboxes = rebound,
                "a new lxcfs's views are bound into sandboxes that had dead ones"
            );
        }
    }

    /// Warm disks ready now (0 without a pool).
    pub fn warm_disks_ready(&self) -> usize {
        self.pool.as_ref().map_or(0, |p| p.ready())
    }

    /// Tears down the warm disks (when the edge stops: it leaves none behind).
    pub fn drain_warm_disks(&self) {
        if let Some(p) = &self.pool {
            p.drain();
        }
    }

    pub fn runtime(&self) -> &Runtime {
        &self.runtime
    }

    /// The AppArmor profile the agent stacks on every process it starts, where the edge
    /// loaded the profiles (see [`apparmor`]); its containers' PID 1 runs under
    /// [`apparmor::AGENT_PROFILE`] then.
    pub fn sandbox_profile(&self) -> Option<&'static str> {
        self.host.apparmor.then_some(apparmor::SANDBOX_PROFILE)
    }

    pub fn config(&self) -> &ContainerConfig {
        &self.config
    }

    fn dir(&self, id: &str) -> PathBuf {
        self.config.sandboxes_root.join(id)
    }

    /// The sandbox's handle, from its directory.
    pub fn get(&self, id: &str) -> Result<Handle, ContainerError> {
        validate_id(id)?;
        Self::handle_at(id, self.dir(id))
    }

    fn handle_at(id: &str, dir: PathBuf) -> Result<Handle, ContainerError> {
        let bytes = match fs::read(dir.join("sandbox.json")) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(ContainerError::NotFound(id.into()));
            }
            Err(e) => return Err(ContainerError::io("reading sandbox.json", e)),
        };
        let record: SandboxRecord = serde_json::from_slice(&bytes)
            .map_err(|e| ContainerError::Invalid(format!("corrupt {}/sandbox.json: {e}", dir.display())))?;
        Ok(Handle {
            id: id.into(),
            dir,
            record,
        })
    }

    /// Every sandbox that has a directory, e.g. to re-adopt them after an edge restart.
    pub fn list(&self) -> Result<Vec<Handle>, ContainerError> {
        let mut out = Vec::new();
        let root = &self.config.sandboxes_root;
        for entry in fs::read_dir(root).map_err(|e| ContainerError::io(format!("listing {}", root.display()), e))? {
            let entry = entry.map_err(|e| ContainerError::io("listing sandboxes", e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            if validate_id(&name).is_err() || !entry.path().join("sandbox.json").exists() {
                continue;
            }
            out.push(self.get(&name)?);
        }
        out.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(out)
    }

    /// The last `max_bytes` of PID 1's output (across the rotated file and the current one).
    pub fn read_log(&self, id: &str, max_bytes: usize) -> Result<Vec<u8>, ContainerError> {
        let dir = self.get(id)?.dir;
        let mut data = Vec::new();
        for name in ["output.log.1", "output.log"] {
            if let Ok(mut f) = fs::File::open(dir.join(name)) {
                f.read_to_end(&mut data)
                    .map_err(|e| ContainerError::io("reading output log", e))?;
            }
        }
        let start = data.len().saturating_sub(max_bytes);
        Ok(data.split_off(start))
    }
}

fn validate_id(id: &str) -> Result<(), ContainerError> {
    if id.is_empty()
        || id.len() > 63
        || !id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        || id.starts_with('-')
    {
        return Err(ContainerError::Invalid(format!(
            "sandbox id {id:?}: use 1-63 of [A-Za-z0-9_-], not starting with '-'"
        )));
    }
    Ok(())
}

fn validate(spec: &SandboxSpec) -> Result<(), ContainerError> {
    validate_id(&spec.id)?;
    let l = &spec.limits;
    if l.memory_bytes < (4 << 20) {
        return Err(ContainerError::Invalid("memory limit below 4 MiB".into()));
    }
    if l.cpu_millis < 10 {
        return Err(ContainerError::Invalid("cpu below 10 millicores".into()));
    }
    if l.pids < 1 {
        return Err(ContainerError::Invalid("pids limit must be at least 1".into()));
    }
    if l.io_weight.is_some_and(|w| !(10..=1000).contains(&w)) {
        return Err(ContainerError::Invalid("io weight must be within 10..=1000".into()));
    }
    if l.disk_bytes < (16 << 20) {
        return Err(ContainerError::Invalid("disk below 16 MiB".into()));
    }
    if spec.process.args.is_empty() {
        return Err(ContainerError::Invalid("no process to run".into()));
    }
    if spec.layers.is_empty() {
        return Err(ContainerError::Invalid("no image layers".into()));
    }
    for layer in &spec.layers {
        if !layer.is_absolute() || !layer.is_dir() {
            return Err(ContainerError::Invalid(format!(
                "layer {} is not an existing absolute directory",
                layer.display()
            )));
        }
    }
    for bind in &spec.binds {
        if !bind.host_path.is_absolute() || !bind.host_path.exists() {
            return Err(ContainerError::Invalid(format!(
                "bind source {} does not exist",
                bind.host_path.display()
            )));
        }
        if !bind.container_path.starts_with('/') || bind.container_path.split('/').any(|c| c == "..") {
            return Err(ContainerError::Invalid(format!(
                "bind target {:?} must be absolute, without '..'",
                bind.container_path
            )));
        }
    }
    for &fd in &spec.extra_fds {
        // SAFETY: F_GETFD only queries the descriptor.
        if unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(ContainerError::Invalid(format!("extra fd {fd} is not open")));
        }
    }
    Ok(())
}

pub(crate) fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<(), ContainerError> {
    let tmp = path.with_extension("json.tmp");
    let json = serde_json::to_vec_pretty(value).expect("serialisable");
    fs::write(&tmp, json).map_err(|e| ContainerError::io(format!("writing {}", tmp.display()), e))?;
    fs::rename(&tmp, path).map_err(|e| ContainerError::io(format!("writing {}", path.display()), e))
}

/// The exit the shim recorded in sandbox directory `dir`, if PID 1 has exited.
fn exit_info_in(dir: &Path) -> Result<Option<ExitInfo>, ContainerError> {
    let path = dir.join("exit.json");
    match fs::read(&path) {
        Ok(b) => serde_json::from_slice(&b)
            .map(Some)
            .map_err(|e| ContainerError::Invalid(format!("corrupt {}: {e}", path.display()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(ContainerError::io(format!("reading {}", path.display()), e)),
    }
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

pub(crate) fn read_pid(path: &Path) -> Option<i32> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn process_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks existence and permission.
    unsafe { libc::kill(pid, 0) == 0 }
}

/// Duplicates a borrowed fd (close-on-exec) to a number at or above `min`.
pub(crate) fn dup_above(fd: RawFd, min: RawFd) -> io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC returns a new descriptor that we then own.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, min) };
    if new < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `new` is a fresh descriptor owned by no one else.
    Ok(unsafe { OwnedFd::from_raw_fd(new) })
}
