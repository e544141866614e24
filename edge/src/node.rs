//! The edge process: registers with the control plane, follows its slice of the log,
//! persists it (redb) and reconciles the sandboxes of this machine toward it through
//! the container backend or, for microVM sandboxes, the QEMU driver (`microvms.rs`);
//! reports what it observes; sends heartbeats; serves the per-sandbox proxy. Sandboxes
//! are not its children (each runs under its own shim), so a killed edge leaves them
//! running and a restarted one re-adopts them.

use crate::container::warm::{Claim, WARM_ID_PREFIX, WarmPool};
use crate::container::{BindMount, ContainerBackend, ContainerConfig, Limits, SandboxSpec, SandboxStatus};
use crate::desired::{DesiredSandbox, SliceState};
use crate::images::ImageStore;
use crate::microvms::{FromSnapshot, MicroVms, MicroVmsConfig};
use crate::proxy::{self, AgentAddr, Resolver};
use crate::reconcile::{Action, Running, plan, plan_snapshots, plan_transfers};
use crate::slice::{SliceClient, SliceFollower};
use crate::transfer::{self, Manifest};
use opendsec_commands::Observation;
use opendsec_edge_api::pb::{Capacity, HeartbeatRequest};
use opendsec_projections::Isolation;
use redb::{Database, ReadableDatabase, TableDefinition};
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const STATE: TableDefinition<&str, &[u8]> = TableDefinition::new("edge_state");

/// Where the agent binary appears inside every sandbox (read-only).
pub const AGENT_PATH_IN_SANDBOX: &str = "/.opendsec/agent";
/// Where the agent's per-sandbox configuration (token, environment, start command)
/// appears inside the sandbox (read-only).
pub const AGENT_CONFIG_IN_SANDBOX: &str = "/.opendsec/config";
/// How long a template's start command may take to open its port before the sandbox fails.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// Resumes of a microVM tried in a row before it is reported failed.
const MAX_RESUME_TRIES: u32 = 3;
/// A prepared transfer no edge came to pull is removed after this long.
const TRANSFER_TTL: Duration = Duration::from_secs(30 * 60);

#[derive(Clone, Debug)]
pub struct EdgeConfig {
    /// This edge's name (unique in the cluster).
    pub name: String,
    /// A control node's peer address.
    pub control_peer: String,
    /// A token with edge:write, from the root project.
    pub token: String,
    /// The key the gateway presents to this edge's proxy.
    pub edge_key: String,
    /// Holds `edge.redb` and the agents' sockets.
    pub data_dir: PathBuf,
    /// The proxy's listen address, also registered as the edge's address.
    pub proxy_listen: String,
    pub capacity: Capacity,
    pub container: ContainerConfig,
    pub images_dir: PathBuf,
    /// The static agent binary, bind-mounted read-only into every sandbox.
    pub agent_binary: PathBuf,
    /// Size of each sandbox's writable disk.
    pub disk_bytes: u64,
    /// Processes (and threads) per sandbox.
    pub pids: u32,
    /// MicroVM sandboxes, when this edge runs them (`None`: it runs containers only).
    pub microvm: Option<MicroVmEdgeConfig>,
    /// Warm containers kept per image, for the two images created from most recently
    /// (see `container::warm`); 0 keeps none.
    pub warm_sandboxes: usize,
}

/// Images whose warm containers are kept at once (the most recently used).
const WARM_IMAGES: usize = 2;

/// What an edge needs to run microVM sandboxes.
#[derive(Clone, Debug)]
pub struct MicroVmEdgeConfig {
    /// `opendsec-vm-shim`, the detached parent of each QEMU.
    pub shim: PathBuf,
}

/// The edge's microVMs: being prepared (the driver's first start builds the guest kernel
/// and initramfs), ready, or unavailable and why.
enum VmsState {
    Preparing,
    Ready(Arc<MicroVms>),
    Unavailable(String),
}

#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("edge state store: {0}")]
    Store(String),
    #[error("container backend: {0}")]
    Backend(#[from] crate::container::ContainerError),
    #[error("image store: {0}")]
    Images(#[from] crate::images::ImageError),
    #[error("microVM: {0}")]
    Vm(#[from] crate::vm::VmError),
    /// The sandbox is a microVM and this edge runs none (or not yet).
    #[error("{0}")]
    NoMicroVms(String),
    #[error("control plane: {0}")]
    Control(#[from] crate::slice::SliceError),
    /// Pulling the state a sandbox starts from off another edge failed.
    #[error("{0}")]
    Transfer(#[from] crate::transfer::TransferError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// How long no create must have been under way before a warm container is made.
const WARM_QUIET: Duration = Duration::from_millis(20);

/// The agent's arguments after `serve --listen-fd 3` for a sandbox of `image`: where its
/// token, environment and (if the image has one) start command are.
fn agent_args(image: &crate::images::Image) -> Vec<String> {
    let mut args = vec![
        "--access-token-file".to_string(),
        format!("{AGENT_CONFIG_IN_SANDBOX}/token"),
        "--env-file".into(),
        format!("{AGENT_CONFIG_IN_SANDBOX}/env.json"),
    ];
    if image.config.start.is_some() {
        args.extend(["--start-file".into(), format!("{AGENT_CONFIG_IN_SANDBOX}/start.json")]);
    }
    args
}

/// A directory only root may enter (an agent's config directory).
fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}

fn store_err(e: impl std::fmt::Display) -> EdgeError {
    EdgeError::Store(e.to_string())
}

struct Edge {
    cfg: EdgeConfig,
    backend: ContainerBackend,
    images: ImageStore,
    db: Database,
    slice: Mutex<SliceState>,
    client: SliceClient,
    /// Sandboxes being created right now (creation runs beside the loop).
    creating: Mutex<BTreeSet<String>>,
    /// Sandboxes whose creation failed here: never retried (the failure is reported).
    failed: Mutex<BTreeSet<String>>,
    /// One creation at a time touches the host's mounts and loop devices.
    create_lock: Mutex<()>,
    /// Warm containers ready to be claimed, per image.
    warm: WarmPool,
    /// Snapshots being taken right now.
    snapshotting: Mutex<BTreeSet<String>>,
    /// Sandboxes seen out of memory while running (their exit is reported as an OOM).
    oom_seen: Mutex<BTreeSet<String>>,
    /// The last observation, for admission requests between two rounds.
    last_observed: Mutex<BTreeMap<String, Running>>,
    /// Sandboxes admitted but not yet in the slice, with when: counted by admission.
    admitted: Mutex<BTreeMap<String, (u64, u64, Instant)>>,
    /// What was last reported per sandbox, and when: a report is repeated only once the
    /// slice has had time to show it, so observations are not logged twice.
    reported: Mutex<BTreeMap<String, (Observation, Instant)>>,
    wake: tokio::sync::Notify,
    /// The log index of this run's registration: once the slice is past it, it holds
    /// everything committed before the edge started (see `reconcile::plan`).
    registered_at: u64,
    /// The microVM driver's state (always `Unavailable` when the config has none).
    vms: Mutex<VmsState>,
    /// MicroVMs whose resume failed, and how often in a row.
    resume_failures: Mutex<BTreeMap<String, u32>>,
    /// Transfers being prepared right now.
    preparing: Mutex<BTreeSet<String>>,
    /// One pull per transfer at a time (the copies of one fork share it).
    import_locks: Mutex<BTreeMap<String, Arc<Mutex<()>>>>,
    /// The runtime, for the async pulls that blocking creations make.
    rt: tokio::runtime::Handle,
}

impl Edge {
    /// The microVMs, when ready; otherwise why a microVM cannot be handled now.
    fn vms(&self) -> Result<Arc<MicroVms>, EdgeError> {
        match &*self.vms.lock().expect("vms lock") {
            VmsState::Ready(v) => Ok(v.clone()),
            VmsState::Preparing => Err(EdgeError::NoMicroVms(
                "this edge is still preparing its microVM driver".into(),
            )),
            VmsState::Unavailable(why) => Err(EdgeError::NoMicroVms(format!("this edge runs no microVMs: {why}"))),
        }
    }

    fn vms_preparing(&self) -> bool {
        matches!(&*self.vms.lock().expect("vms lock"), VmsState::Preparing)
    }

    /// Whether sandbox `id` is a microVM: the slice says so, or (an orphan) the driver has it.
    fn is_vm(&self, id: &str) -> bool {
        let in_slice = self
            .slice
            .lock()
            .expect("slice lock")
            .sandboxes
            .get(id)
            .map(|d| d.isolation.is_machine());
        match in_slice {
            Some(v) => v,
            None => self.vms().is_ok_and(|v| v.has(id)),
        }
    }

    fn socket_path(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("agents").join(format!("{id}.sock"))
    }

    fn persist(&self) -> Result<(), EdgeError> {
        let bytes = serde_json::to_vec(&*self.slice.lock().expect("slice lock")).map_err(store_err)?;
        let tx = self.db.begin_write().map_err(store_err)?;
        {
            let mut t = tx.open_table(STATE).map_err(store_err)?;
            t.insert("slice", bytes.as_slice()).map_err(store_err)?;
        }
        tx.commit().map_err(store_err)
    }

    /// What runs on this machine, as the backend sees it.
    fn observe(&self, creating: &BTreeSet<String>) -> Result<BTreeMap<String, Running>, EdgeError> {
        let mut out = BTreeMap::new();
        // A sandbox being created is half there (a directory, no container yet): it is
        // observed once its creation has finished.
        for h in self.backend.list()? {
            if creating.contains(&h.id) {
                continue;
            }
            let st = match self.backend.quick_state(&h.id) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(sandbox = %h.id, error = %e, "cannot read sandbox state");
                    continue;
                }
            };
            let oom_now = || crate::container::cgroup::oom_kills(&h.record.cgroups_path).unwrap_or(0) > 0;
            // The cgroup's counter (while it exists) and what this edge saw before the end
            // count: an OOM is never reported as a plain exit.
            let oom_known = || oom_now() || self.oom_seen.lock().expect("oom lock").contains(&h.id);
            let running = match (st.status, st.exit) {
                (_, Some(exit)) => Running::Exited {
                    exit_code: exit.exit_code,
                    oom_killed: exit.oom_killed || oom_known(),
                },
                (SandboxStatus::Paused, None) => Running::Paused,
                (SandboxStatus::Created | SandboxStatus::Running, None) => {
                    if oom_now() {
                        self.oom_seen.lock().expect("oom lock").insert(h.id.clone());
                        Running::OutOfMemory
                    } else {
                        Running::Running
                    }
                }
                // Ended before its shim wrote why (e.g. just killed for its OOM).
                (SandboxStatus::Stopped | SandboxStatus::Lost, None) => Running::Exited {
                    exit_code: 137,
                    oom_killed: oom_known(),
                },
            };
            out.insert(h.id, running);
        }
        if let Ok(vms) = self.vms() {
            out.extend(vms.observe()?.into_iter().filter(|(id, _)| !creating.contains(id)));
        }
        Ok(out)
    }

    fn snapshots_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("snapshots")
    }

    /// State this edge prepared for other edges to pull: `transfers/<id>/` (whole once its
    /// manifest is there), or `transfers/<id>.failed` saying why it cannot be had.
    fn transfers_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("transfers")
    }

    fn transfer_failure(&self, id: &str) -> PathBuf {
        self.transfers_dir().join(format!("{id}.failed"))
    }

    /// State pulled from other edges: `imports/<transfer>/`, removed once every sandbox
    /// of this edge that starts from it has been created (or has ended).
    fn imports_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("imports")
    }

    /// The per-sandbox directory bind-mounted read-only at [`AGENT_CONFIG_IN_SANDBOX`].
    fn config_dir(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("config").join(id)
    }

    /// A fork's private copy of its source's file system (its top read-only layer).
    fn fork_layer(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("forks").join(id)
    }

    /// The writable upper dir of a sandbox's overlay (on its size-limited disk).
    fn upper_dir(&self, id: &str) -> PathBuf {
        self.backend.config().sandboxes_root.join(id).join("disk").join("upper")
    }

    /// The snapshot layers beneath a sandbox started from `snapshot`, bottom first.
    fn snapshot_layers(&self, snapshot: &str) -> Result<Vec<PathBuf>, EdgeError> {
        let slice = self.slice.lock().expect("slice lock");
        let mut chain = Vec::new();
        let mut next = Some(snapshot.to_string());
        while let Some(id) = next {
            if chain.len() > 64 {
                return Err(EdgeError::Store(format!(
                    "snapshot {snapshot} has a parent chain over 64 deep"
                )));
            }
            let dir = self.snapshots_dir().join(&id);
            if !dir.is_dir() {
                return Err(EdgeError::Store(format!("snapshot {id} has no files on this edge")));
            }
            chain.push(dir);
            next = slice.snapshots.get(&id).and_then(|x| x.parent.clone());
        }
        chain.reverse();
        Ok(chain)
    }

    /// Writes the agent's configuration: its access token, the sandbox's environment and
    /// the image's start command.
    fn write_agent_config(&self, d: &DesiredSandbox, image: &crate::images::Image) -> Result<(), EdgeError> {
        let dir = self.config_dir(&d.id);
        let _ = std::fs::remove_dir_all(&dir);
        make_private_dir(&dir)?;
        self.write_agent_files(d, image, &dir)
    }

    /// The spec of container `id` of `image` served by the agent: the agent as PID 1 on a
    /// listening socket at [`Self::socket_path`] (returned: keep it open until the
    /// container is created), its binary and [`Self::config_dir`] bound read-only, and
    /// `limits`. The same for a sandbox and for a warm container.
    fn agent_spec(
        &self,
        id: &str,
        image: &crate::images::Image,
        limits: Limits,
    ) -> Result<(SandboxSpec, std::os::unix::net::UnixListener), EdgeError> {
        let sock = self.socket_path(id);
        let _ = std::fs::remove_file(&sock);
        // The socket lives outside the sandbox; the agent gets only the listening fd.
        let listener = std::os::unix::net::UnixListener::bind(&sock)?;
        let mut args = vec![
            AGENT_PATH_IN_SANDBOX.into(),
            "serve".into(),
            "--listen-fd".into(),
            "3".into(),
        ];
        args.extend(agent_args(image));
        let mut spec = SandboxSpec::from_image(id.to_string(), &self.images, image, args)?;
        spec.limits = limits;
        spec.binds.push(BindMount {
            host_path: self.cfg.agent_binary.clone(),
            container_path: AGENT_PATH_IN_SANDBOX.into(),
        });
        spec.binds.push(BindMount {
            host_path: self.config_dir(id),
            container_path: AGENT_CONFIG_IN_SANDBOX.into(),
        });
        spec.extra_fds.push(listener.as_raw_fd());
        Ok((spec, listener))
    }

    /// The agent's per-sandbox files (token, environment, start command) in `dir`,
    /// readable by the agent (root in the sandbox) only.
    fn write_agent_files(&self, d: &DesiredSandbox, image: &crate::images::Image, dir: &Path) -> Result<(), EdgeError> {
        use std::os::unix::fs::OpenOptionsExt;
        let write = |name: &str, bytes: &[u8]| -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(dir.join(name))?;
            f.write_all(bytes)
        };
        let token =
            opendsec_edge_api::sandbox_token(&self.cfg.edge_key, opendsec_edge_api::SandboxTokenKind::Agent, &d.id);
        write("token", token.as_bytes())?;
        write("env.json", &serde_json::to_vec(&d.env).map_err(store_err)?)?;
        if let Some(start) = &image.config.start {
            write("start.json", &serde_json::to_vec(start).map_err(store_err)?)?;
        }
        Ok(())
    }

    /// Runs `f` on sandbox `sandbox`'s file system (its overlay upper dir) while the
    /// sandbox is frozen, so what `f` reads is consistent; it is thawed again unless it
    /// was paused.
    fn with_frozen_upper<T>(
        &self,
        sandbox: &str,
        f: impl FnOnce(&std::path::Path) -> Result<T, EdgeError>,
    ) -> Result<T, EdgeError> {
        let upper = self.upper_dir(sandbox);
        if !upper.is_dir() {
            return Err(EdgeError::Store(format!(
                "sandbox {sandbox} has no file system on this edge"
            )));
        }
        let was_running = matches!(
            self.backend.quick_state(sandbox).map(|s| s.status),
            Ok(crate::container::SandboxStatus::Running)
        );
        if was_running {
            self.backend.pause(sandbox)?;
        }
        // Flush what the sandbox wrote before reading its files from outside.
        if let Ok(f) = std::fs::File::open(&upper) {
            // SAFETY: syncfs on a valid, open fd.
            unsafe { libc::syncfs(f.as_raw_fd()) };
        }
        let result = f(&upper);
        if was_running {
            if let Err(e) = self.backend.resume(sandbox) {
                tracing::error!(%sandbox, error = %e, "cannot thaw the sandbox after reading its file system");
            }
        }
        result
    }

    /// Copies a running sandbox's file system (its overlay upper dir) to `dest`, freezing
    /// it meanwhile so the copy is consistent; it is thawed again unless it was paused.
    fn copy_upper(&self, sandbox: &str, dest: &std::path::Path) -> Result<(), EdgeError> {
        self.with_frozen_upper(sandbox, |upper| {
            copy_tree(upper, dest).map_err(|e| EdgeError::Store(format!("copying the file system of {sandbox}: {e}")))
        })
    }

    // ---- state served to other edges, and pulled from them ----

    /// Prepares transfer `id` in `transfers/<id>/`: a microVM's snapshot (a fork snapshot
    /// of a running source, taken now: it stops only while its state is copied; or a stored
    /// snapshot's files, linked), or a container's file-system layers as tar archives
    /// (every layer of the source beneath its image, then its upper dir, taken frozen; or
    /// a stored snapshot's chain); then the manifest with each file's digest.
    fn make_transfer(&self, id: &str) -> Result<u64, EdgeError> {
        use crate::desired::TransferSource;
        let t = self
            .slice
            .lock()
            .expect("slice lock")
            .served
            .get(id)
            .cloned()
            .ok_or_else(|| EdgeError::Store(format!("transfer {id} is no longer served")))?;
        let dest = self.transfers_dir().join(id);
        let tmp = self.transfers_dir().join(format!(".tmp-{id}"));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(self.transfers_dir())?;
        let made = (|| -> Result<(), EdgeError> {
            let (source_sandbox, layers) = match (&t.source, t.isolation) {
                (TransferSource::Fork { sandbox }, Isolation::Microvm | Isolation::Vm) => {
                    self.vms()?.snapshot(sandbox, &tmp)?;
                    (sandbox.clone(), vec![])
                }
                (TransferSource::Snapshot { snapshot }, Isolation::Microvm | Isolation::Vm) => {
                    std::fs::create_dir(&tmp)?;
                    let from = self.snapshots_dir().join(snapshot);
                    for e in std::fs::read_dir(&from)? {
                        let e = e?;
                        if e.file_type()?.is_file() {
                            // The snapshot's files never change: a link is a copy.
                            if std::fs::hard_link(e.path(), tmp.join(e.file_name())).is_err() {
                                std::fs::copy(e.path(), tmp.join(e.file_name()))?;
                            }
                        }
                    }
                    let source = self
                        .slice
                        .lock()
                        .expect("slice lock")
                        .snapshots
                        .get(snapshot)
                        .map(|x| x.sandbox.clone())
                        .unwrap_or_default();
                    (source, vec![])
                }
                (TransferSource::Fork { sandbox }, Isolation::Container) => {
                    std::fs::create_dir(&tmp)?;
                    // Its own layers beneath (snapshots it started from, a fork's copy),
                    // then what it wrote: everything but the image, which every edge has.
                    let images = self.images.root().to_path_buf();
                    let below: Vec<PathBuf> = self
                        .backend
                        .get(sandbox)?
                        .record
                        .layers
                        .into_iter()
                        .filter(|l| !l.starts_with(&images))
                        .collect();
                    let mut names = Vec::new();
                    for (k, layer) in below.iter().enumerate() {
                        let name = format!("layer-{k}.tar");
                        tar_create(layer, &tmp.join(&name))?;
                        names.push(name);
                    }
                    let top = format!("layer-{}.tar", below.len());
                    self.with_frozen_upper(sandbox, |upper| tar_create(upper, &tmp.join(&top)))?;
                    names.push(top);
                    (sandbox.clone(), names)
                }
                (TransferSource::Snapshot { snapshot }, Isolation::Container) => {
                    std::fs::create_dir(&tmp)?;
                    let mut names = Vec::new();
                    for (k, layer) in self.snapshot_layers(snapshot)?.iter().enumerate() {
                        let name = format!("layer-{k}.tar");
                        tar_create(layer, &tmp.join(&name))?;
                        names.push(name);
                    }
                    let source = self
                        .slice
                        .lock()
                        .expect("slice lock")
                        .snapshots
                        .get(snapshot)
                        .map(|x| x.sandbox.clone())
                        .unwrap_or_default();
                    (source, names)
                }
            };
            transfer::write_manifest(&tmp, id, &t.isolation.to_event(), &source_sandbox, layers)?;
            let _ = std::fs::remove_dir_all(&dest);
            std::fs::rename(&tmp, &dest)?;
            Ok(())
        })();
        if let Err(e) = made {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        Ok(dir_allocated(&dest))
    }

    /// Removes transfer `id`'s files, and forgets it once every edge has pulled it.
    fn remove_transfer(&self, id: &str) -> Result<(), EdgeError> {
        let _ = std::fs::remove_file(self.transfer_failure(id));
        match std::fs::remove_dir_all(self.transfers_dir().join(id)) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e.into()),
            _ => {}
        }
        let forgot = {
            let mut slice = self.slice.lock().expect("slice lock");
            let done = slice.served.get(id).is_some_and(|t| !t.is_wanted());
            done && slice.served.remove(id).is_some()
        };
        if forgot {
            self.persist()?;
        }
        Ok(())
    }

    /// The transfers prepared here (or failed, with a reason), and removal of those no
    /// edge came to pull within [`TRANSFER_TTL`].
    fn present_transfers(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for e in std::fs::read_dir(self.transfers_dir()).into_iter().flatten().flatten() {
            let Some(name) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            if name.starts_with('.') {
                continue;
            }
            let stale = e
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t.elapsed().is_ok_and(|age| age > TRANSFER_TTL));
            let id = name.strip_suffix(".failed").unwrap_or(&name).to_string();
            if stale {
                tracing::warn!(transfer = %id, "removing a transfer no edge pulled in time");
                let _ = std::fs::remove_file(self.transfer_failure(&id));
                let _ = std::fs::remove_dir_all(self.transfers_dir().join(&id));
                if let Some(t) = self.slice.lock().expect("slice lock").served.get_mut(&id) {
                    t.pulled.extend(t.destinations.keys().cloned());
                }
                continue;
            }
            out.insert(id);
        }
        out
    }

    /// The state sandbox `d` starts from, pulled from the edge that holds it (once per
    /// transfer: the copies of one fork share it): its directory and manifest.
    fn import(&self, d: &DesiredSandbox) -> Result<(PathBuf, Manifest), EdgeError> {
        let (Some(id), Some(source_edge)) = (d.transfer.as_deref(), d.source_edge.as_deref()) else {
            return Err(EdgeError::Store(format!(
                "sandbox {} starts from no other edge's state",
                d.id
            )));
        };
        if !transfer::valid_transfer(id) {
            return Err(EdgeError::Store(format!("transfer id {id:?} is malformed")));
        }
        let lock = self
            .import_locks
            .lock()
            .expect("import locks")
            .entry(id.to_string())
            .or_default()
            .clone();
        let _one = lock.lock().expect("import lock");
        let dir = self.imports_dir().join(id);
        if let Ok(m) = transfer::read_manifest(&dir) {
            return Ok((dir, m));
        }
        let address = self.slice.lock().expect("slice lock").edges.get(source_edge).cloned();
        let address = address.ok_or_else(|| {
            EdgeError::Store(format!(
                "edge {source_edge}, which holds the state sandbox {} starts from, is not registered",
                d.id
            ))
        })?;
        let req = transfer::PullRequest {
            transfer: id,
            source_edge,
            address: &address,
            me: &self.cfg.name,
            cluster_key: &self.cfg.edge_key,
        };
        let pulled = self.rt.block_on(transfer::pull(&req, &dir))?;
        let data: u64 = pulled.manifest.files.iter().map(|f| f.data_bytes).sum();
        tracing::info!(
            transfer = %id,
            from = %source_edge,
            files = pulled.manifest.files.len(),
            wire_bytes = pulled.wire_bytes,
            data_bytes = data,
            took_ms = pulled.took.as_millis() as u64,
            "pulled a transfer from another edge"
        );
        Ok((dir, pulled.manifest))
    }

    /// Removes pulled state no sandbox still waits to start from.
    fn sweep_imports(&self, observed: &BTreeMap<String, Running>) {
        let Ok(entries) = std::fs::read_dir(self.imports_dir()) else {
            return;
        };
        let creating = self.creating.lock().expect("creating lock").clone();
        let failed = self.failed.lock().expect("failed lock").clone();
        let slice = self.slice.lock().expect("slice lock");
        for e in entries.flatten() {
            let Some(id) = e.file_name().to_str().map(str::to_string) else {
                continue;
            };
            let waiting = slice
                .sandboxes
                .values()
                .filter(|d| d.transfer.as_deref() == Some(id.as_str()))
                .any(|d| {
                    creating.contains(&d.id)
                        || (d.observed == opendsec_projections::Observed::Pending
                            && d.desired == opendsec_projections::Desired::Running
                            && !failed.contains(&d.id)
                            && !observed.contains_key(&d.id))
                });
            if !waiting {
                tracing::info!(transfer = %id, "removing pulled state no sandbox waits for");
                let _ = std::fs::remove_dir_all(e.path());
                self.import_locks.lock().expect("import locks").remove(&id);
            }
        }
    }

    fn create(self: &Arc<Self>, d: &DesiredSandbox) -> Result<(), EdgeError> {
        let image = self.images.ensure(
            &d.image,
            &|p| tracing::info!(image = %d.image, progress = ?p, "building image"),
        )?;
        // A plain create from an image claims a warm container of that image if one is
        // ready; either way the image is kept warm for the next create.
        let plain = d.transfer.is_none() && d.snapshot.is_none() && d.fork_of.is_none();
        if plain && self.warm.enabled() {
            let taken = self.warm.take(&d.image);
            // Keeps the image warm; another image's warm containers may make room for it.
            for dropped in self.warm.want(&d.image) {
                self.discard_warm(&dropped);
            }
            if let Some(warm) = taken {
                let t = Instant::now();
                match self.claim_warm(d, &image, &warm) {
                    Ok(()) => {
                        tracing::debug!(sandbox = %d.id, %warm, took = ?t.elapsed(), "claimed a warm container");
                        self.refill_warm();
                        return Ok(());
                    }
                    Err(e) => {
                        tracing::warn!(sandbox = %d.id, %warm, error = %e, "cannot claim a warm container; creating one")
                    }
                }
            }
        }
        let created = self.create_cold(d, &image);
        if plain {
            self.refill_warm();
        }
        created
    }

    /// Limits of a sandbox on this edge.
    fn limits(&self, d: &DesiredSandbox) -> Limits {
        Limits {
            memory_bytes: d.memory_mb << 20,
            cpu_millis: d.cpu_millis.min(u32::MAX as u64) as u32,
            pids: self.cfg.pids,
            io_weight: Some(100),
            disk_bytes: self.cfg.disk_bytes,
        }
    }

    fn create_cold(&self, d: &DesiredSandbox, image: &crate::images::Image) -> Result<(), EdgeError> {
        self.write_agent_config(d, image)?;
        let (mut spec, listener) = self.agent_spec(&d.id, image, self.limits(d))?;
        if d.transfer.is_some() {
            // Its source's layers live on another edge: pulled, then unpacked into its
            // own directory (removed with it), bottom first.
            let (dir, manifest) = self.import(d)?;
            for (k, name) in manifest.layers.iter().enumerate() {
                let layer = self.fork_layer(&d.id).join(k.to_string());
                if !layer.is_dir() {
                    tar_extract(&dir.join(name), &layer)?;
                }
                spec.layers.push(layer);
            }
        } else if let Some(snap) = &d.snapshot {
            // A sandbox started from a snapshot stacks the snapshot's layers on the image's.
            spec.layers.extend(self.snapshot_layers(snap)?);
        }
        // A fork starts from a copy of its source's file system as it is now: the layers
        // its source was forked with (copied: they go when their sandbox goes), then what
        // its source wrote, in `forks/<id>/<k>`, bottom first.
        if let (Some(source), None) = (&d.fork_of, &d.transfer) {
            let dir = self.fork_layer(&d.id);
            let source_forks = self.fork_layer(source);
            let inherited: Vec<PathBuf> = self
                .backend
                .get(source)?
                .record
                .layers
                .into_iter()
                .filter(|l| l.starts_with(&source_forks))
                .collect();
            for (k, from) in inherited.iter().enumerate() {
                let layer = dir.join(k.to_string());
                if !layer.is_dir() {
                    copy_tree(from, &layer)?;
                }
                spec.layers.push(layer);
            }
            let layer = dir.join(inherited.len().to_string());
            if !layer.is_dir() {
                self.copy_upper(source, &layer)?;
            }
            spec.layers.push(layer);
        }
        spec.labels = d.labels.clone();
        {
            let _one_at_a_time = self.create_lock.lock().expect("create lock");
            self.backend.create(&spec)?;
        }
        drop(listener); // the agent holds its own copy
        Ok(())
    }

    /// Makes warm container `<prefix><pid>-<n>` of `image` (see `container::warm`): its
    /// agent's socket and an empty config directory under the warm id, the agent's
    /// files come at claim.
    fn make_warm(&self, image_name: &str) -> Result<String, EdgeError> {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let wid = format!("{WARM_ID_PREFIX}{}-{n}", std::process::id());
        let image = self.images.ensure(
            image_name,
            &|p| tracing::info!(image = %image_name, progress = ?p, "building image"),
        )?;
        let made = (|| {
            let config = self.config_dir(&wid);
            let _ = std::fs::remove_dir_all(&config);
            make_private_dir(&config)?;
            // Memory and CPU are the default's until a sandbox claims it and sets its own.
            let limits = Limits {
                pids: self.cfg.pids,
                io_weight: Some(100),
                disk_bytes: self.cfg.disk_bytes,
                ..Limits::default()
            };
            let (spec, _listener) = self.agent_spec(&wid, &image, limits)?;
            let _one_at_a_time = self.create_lock.lock().expect("create lock");
            self.backend.create_unstarted(&spec)?;
            Ok::<(), EdgeError>(())
        })();
        match made {
            Ok(()) => Ok(wid),
            Err(e) => {
                self.discard_warm(&wid);
                Err(e)
            }
        }
    }

    /// Deletes warm container `wid` with its agent's socket and config directory.
    fn discard_warm(&self, wid: &str) {
        self.backend.discard_unstarted(wid);
        let _ = std::fs::remove_file(self.socket_path(wid));
        let _ = std::fs::remove_dir_all(self.config_dir(wid));
    }

    /// Makes warm container `wid` sandbox `d`: its agent's files and socket take the
    /// sandbox's names (the container sees the same directory and socket), then the
    /// backend renames, limits and starts it. On error nothing of either is left.
    fn claim_warm(&self, d: &DesiredSandbox, image: &crate::images::Image, wid: &str) -> Result<(), EdgeError> {
        let same_image = match self.backend.unstarted_record(wid) {
            Ok(r) => r.layers == self.images.layer_dirs(image)?,
            Err(_) => false,
        };
        if !same_image {
            self.discard_warm(wid);
            return Err(EdgeError::Store(format!(
                "warm container {wid} is not of image {}'s current layers",
                d.image
            )));
        }
        let config = self.config_dir(&d.id);
        let sock = self.socket_path(&d.id);
        let claimed = (|| {
            let _ = std::fs::remove_dir_all(&config);
            std::fs::rename(self.config_dir(wid), &config)?;
            self.write_agent_files(d, image, &config)?;
            let _ = std::fs::remove_file(&sock);
            std::fs::rename(self.socket_path(wid), &sock)?;
            let limits = self.limits(d);
            self.backend.claim(
                wid,
                &Claim {
                    id: &d.id,
                    limits: &limits,
                    labels: &d.labels,
                },
            )?;
            Ok::<(), EdgeError>(())
        })();
        if claimed.is_err() {
            // `claim` removed the container on its own error; before it, it is still warm.
            self.discard_warm(wid);
            let _ = std::fs::remove_dir_all(&config);
            let _ = std::fs::remove_file(&sock);
        }
        claimed
    }

    /// Starts the filler thread unless one runs: it makes warm containers for the wanted
    /// images, one at a time, at the lowest priority, and only while no create is under
    /// way (warm containers are made in idle time, never at a create's expense).
    fn refill_warm(self: &Arc<Self>) {
        if !self.warm.enabled() || self.warm.next_job().is_none() || !self.warm.start_filling() {
            return;
        }
        let edge = self.clone();
        let spawned = std::thread::Builder::new()
            .name("warm-containers".into())
            .spawn(move || {
                crate::container::lower_priority();
                loop {
                    // Quiet first: creates in flight (a burst) have the machine to themselves.
                    let mut idle_since = Instant::now();
                    loop {
                        if !edge.creating.lock().expect("creating lock").is_empty() {
                            idle_since = Instant::now();
                        } else if idle_since.elapsed() >= WARM_QUIET {
                            break;
                        }
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    let Some(image) = edge.warm.next_job() else {
                        edge.warm.filler_done();
                        // A take between `next_job` and `filler_done` would find no filler.
                        if edge.warm.next_job().is_some() && edge.warm.start_filling() {
                            continue;
                        }
                        return;
                    };
                    match edge.make_warm(&image) {
                        Ok(wid) => {
                            if !edge.warm.add(&image, wid.clone()) {
                                edge.discard_warm(&wid);
                            }
                        }
                        Err(e) => {
                            // Creates make their own containers meanwhile; the next one retries.
                            tracing::warn!(%image, error = %e, "cannot make a warm container");
                            edge.warm.filler_done();
                            return;
                        }
                    }
                }
            });
        if spawned.is_err() {
            self.warm.filler_done();
        }
    }

    /// Discards every warm container (the edge stops: none outlives it), waiting for the
    /// filler to finish the one it is making.
    fn drain_warm(&self) {
        let ready = self.warm.close();
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.warm.filling() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        for wid in ready {
            self.discard_warm(&wid);
        }
    }

    /// Discards the warm containers an edge that did not stop left behind, with their
    /// sockets and config directories.
    fn discard_leftover_warm(&self) {
        for wid in self.backend.unstarted() {
            self.discard_warm(&wid);
        }
        for dir in [self.cfg.data_dir.join("config"), self.cfg.data_dir.join("agents")] {
            for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
                if entry.file_name().to_string_lossy().starts_with(WARM_ID_PREFIX) {
                    let p = entry.path();
                    let _ = if p.is_dir() {
                        std::fs::remove_dir_all(&p)
                    } else {
                        std::fs::remove_file(&p)
                    };
                }
            }
        }
    }

    /// Waits until the agent says the sandbox is up (a template's start command has
    /// opened its port): `GET /health` answers 204.
    async fn wait_started(&self, id: &str) -> Result<(), String> {
        let agent = AgentAddr::Unix(self.socket_path(id));
        let deadline = Instant::now() + START_TIMEOUT;
        let mut last = String::from("no answer yet");
        while Instant::now() < deadline {
            match crate::proxy::agent_health(&agent).await {
                Ok(204) | Ok(200) => return Ok(()),
                Ok(code) => last = format!("the agent answers {code}"),
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "the start command did not become ready within {START_TIMEOUT:?}: {last}"
        ))
    }

    /// Takes snapshot `id` of `sandbox` (unless its files exist already) and returns its size.
    fn take_snapshot(&self, id: &str, sandbox: &str, isolation: Isolation) -> Result<u64, EdgeError> {
        let dest = self.snapshots_dir().join(id);
        match isolation {
            Isolation::Container => {
                if !dest.is_dir() {
                    self.copy_upper(sandbox, &dest)?;
                }
                Ok(dir_size(&dest))
            }
            Isolation::Microvm | Isolation::Vm => {
                if !dest.is_dir() {
                    // Taken beside its final name and renamed, so a crash leaves no half snapshot.
                    let tmp = self.snapshots_dir().join(format!(".tmp-{id}"));
                    let _ = std::fs::remove_dir_all(&tmp);
                    std::fs::create_dir_all(self.snapshots_dir())?;
                    self.vms()?.snapshot(sandbox, &tmp)?;
                    std::fs::rename(&tmp, &dest)?;
                }
                // Its RAM and disk files are sparse: what counts is the data they hold.
                Ok(dir_allocated(&dest))
            }
        }
    }

    /// Creates a microVM sandbox: cold boot, or a restore of the snapshot it starts from.
    fn create_vm(&self, d: &DesiredSandbox) -> Result<(), EdgeError> {
        let vms = self.vms()?;
        let image = self.images.ensure(
            &d.image,
            &|p| tracing::info!(image = %d.image, progress = ?p, "building image"),
        )?;
        let source = match &d.snapshot {
            None => None,
            // On another edge: pulled from there.
            Some(_) if d.transfer.is_some() => {
                let (dir, manifest) = self.import(d)?;
                Some((dir, manifest.source_sandbox))
            }
            Some(snap) => {
                let source = self
                    .slice
                    .lock()
                    .expect("slice lock")
                    .snapshots
                    .get(snap)
                    .map(|x| x.sandbox.clone());
                let source =
                    source.ok_or_else(|| EdgeError::Store(format!("snapshot {snap} is unknown to this edge")))?;
                Some((self.snapshots_dir().join(snap), source))
            }
        };
        let from = source.as_ref().map(|(dir, source)| FromSnapshot { dir, source });
        vms.create(d, &image, from)?;
        Ok(())
    }

    /// Creates microVM fork copies `copies` of `source` in one fork (they share its RAM),
    /// or, when the source runs on another edge, each from the fork snapshot pulled from
    /// there. On failure no copy is left.
    fn fork_vms(&self, source: &str, copies: &[DesiredSandbox]) -> Result<(), EdgeError> {
        let vms = self.vms()?;
        let image_name = &copies[0].image;
        let image = self.images.ensure(
            image_name,
            &|p| tracing::info!(image = %image_name, progress = ?p, "building image"),
        )?;
        if copies[0].transfer.is_some() {
            let t = Instant::now();
            let (dir, manifest) = self.import(&copies[0])?;
            let mut made: Vec<&str> = Vec::new();
            for c in copies {
                let from = FromSnapshot {
                    dir: &dir,
                    source: &manifest.source_sandbox,
                };
                if let Err(e) = vms.create(c, &image, Some(from)) {
                    for id in made {
                        let _ = vms.remove(id);
                    }
                    return Err(e.into());
                }
                made.push(&c.id);
            }
            tracing::info!(%source, copies = copies.len(), took_ms = t.elapsed().as_millis() as u64, "made microVM fork copies from state pulled from another edge");
            return Ok(());
        }
        let scratch = self
            .cfg
            .data_dir
            .join("vm-scratch")
            .join(format!("{source}-{}", opendsec_edge_api::now_ms()));
        std::fs::create_dir_all(scratch.parent().expect("a scratch dir has a parent"))?;
        let refs: Vec<&DesiredSandbox> = copies.iter().collect();
        let paused = vms.fork(source, &refs, &image, &scratch)?;
        tracing::info!(%source, copies = copies.len(), source_paused_ms = paused.as_millis() as u64, "forked a microVM");
        Ok(())
    }

    async fn act(self: &Arc<Self>, action: Action, observed: &BTreeMap<String, Running>) {
        let result: Result<(), EdgeError> = match action {
            Action::Create { id } => {
                tracing::debug!(sandbox = %id, "create: start");
                let Some(d) = self.slice.lock().expect("slice lock").sandboxes.get(&id).cloned() else {
                    return;
                };
                if self.failed.lock().expect("failed lock").contains(&id) {
                    return; // its failure is reported; it is not retried
                }
                if d.isolation.is_machine() {
                    return self.start_vm_creation(d, observed).await;
                }
                if !self.creating.lock().expect("creating lock").insert(id.clone()) {
                    return; // already under way
                }
                if let Err(why) = self.admit(&d, observed) {
                    self.creating.lock().expect("creating lock").remove(&id);
                    self.report(&id, Observation::Failed { reason: why }).await;
                    return;
                }
                let edge = self.clone();
                tokio::spawn(async move {
                    let d2 = d.clone();
                    let e2 = edge.clone();
                    let r = tokio::task::spawn_blocking(move || e2.create(&d2)).await;
                    // A template with a start command is ready once its port is open.
                    let r = match r {
                        Ok(Ok(())) if edge.has_start_command(&d.image) => match edge.wait_started(&d.id).await {
                            Ok(()) => Ok(Ok(())),
                            Err(why) => {
                                tracing::warn!(sandbox = %d.id, %why, "start command failed");
                                let _ = edge.backend.kill(&d.id, libc::SIGKILL);
                                edge.failed.lock().expect("failed lock").insert(d.id.clone());
                                edge.creating.lock().expect("creating lock").remove(&d.id);
                                edge.report(&d.id, Observation::Failed { reason: why }).await;
                                edge.wake.notify_one();
                                return;
                            }
                        },
                        other => other,
                    };
                    edge.creating.lock().expect("creating lock").remove(&d.id);
                    match r {
                        Ok(Ok(())) => tracing::info!(sandbox = %d.id, "created"),
                        Ok(Err(EdgeError::Backend(crate::container::ContainerError::AlreadyExists(_)))) => {
                            tracing::debug!(sandbox = %d.id, "already created");
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(sandbox = %d.id, error = %e, "create failed");
                            edge.failed.lock().expect("failed lock").insert(d.id.clone());
                            edge.report(
                                &d.id,
                                Observation::Failed {
                                    reason: format!("create failed: {e}"),
                                },
                            )
                            .await;
                        }
                        Err(e) => tracing::error!(sandbox = %d.id, error = %e, "create task panicked"),
                    }
                    edge.wake.notify_one();
                });
                Ok(())
            }
            Action::Pause { id } if self.is_vm(&id) => self.blocking(move |e| Ok(e.vms()?.pause(&id)?)).await,
            Action::Resume { id } if self.is_vm(&id) => {
                if self.failed.lock().expect("failed lock").contains(&id) {
                    return; // reported failed: no more tries while the log catches up
                }
                let sid = id.clone();
                let resumed = self.blocking(move |e| Ok(e.vms()?.resume(&sid)?)).await;
                // A VM that cannot be restored (its snapshot is damaged, QEMU refuses it)
                // would be tried for ever: after a few tries it is reported failed.
                let tries = {
                    let mut failures = self.resume_failures.lock().expect("resume failures lock");
                    match &resumed {
                        Ok(()) => {
                            failures.remove(&id);
                            0
                        }
                        Err(_) => {
                            let n = failures.entry(id.clone()).or_insert(0);
                            *n += 1;
                            *n
                        }
                    }
                };
                match resumed {
                    Err(e) if tries >= MAX_RESUME_TRIES => {
                        self.failed.lock().expect("failed lock").insert(id.clone());
                        self.report(
                            &id,
                            Observation::Failed {
                                reason: format!("the microVM could not be restored ({tries} tries): {e}"),
                            },
                        )
                        .await;
                        Ok(())
                    }
                    other => other,
                }
            }
            Action::Stop { id, reason } if self.is_vm(&id) => {
                tracing::info!(sandbox = %id, %reason, "stopping a microVM");
                self.blocking(move |e| Ok(e.vms()?.stop(&id)?)).await
            }
            Action::Remove { id } if self.is_vm(&id) => self.blocking(move |e| Ok(e.vms()?.remove(&id)?)).await,
            Action::Pause { id } => {
                self.blocking(move |e| {
                    e.backend.pause(&id)?;
                    // A paused sandbox gives its memory back where the host can (cgroup v2).
                    if let Ok(h) = e.backend.get(&id) {
                        if let Some(freed) = crate::container::cgroup::reclaim(&h.record.cgroups_path) {
                            tracing::info!(sandbox = %id, freed_bytes = freed, "reclaimed the paused sandbox's memory");
                        }
                    }
                    Ok(())
                })
                .await
            }
            Action::Resume { id } => {
                self.blocking(move |e| e.backend.resume(&id).map_err(EdgeError::from))
                    .await
            }
            Action::Stop { id, reason } => {
                tracing::info!(sandbox = %id, %reason, "stopping");
                self.blocking(move |e| {
                    // Thaw first: a frozen process cannot die.
                    let _ = e.backend.resume(&id);
                    e.backend.kill(&id, libc::SIGKILL).map_err(EdgeError::from)
                })
                .await
            }
            Action::Remove { id } => {
                let sock = self.socket_path(&id);
                self.blocking(move |e| {
                    let r = e.backend.delete(&id).map_err(EdgeError::from);
                    let _ = std::fs::remove_file(sock);
                    let _ = std::fs::remove_dir_all(e.config_dir(&id));
                    let _ = std::fs::remove_dir_all(e.fork_layer(&id));
                    r
                })
                .await
            }
            Action::TakeSnapshot { id, sandbox } => {
                if !self.snapshotting.lock().expect("snapshot lock").insert(id.clone()) {
                    return; // under way
                }
                let (e, sid) = (self.clone(), id.clone());
                let isolation = self
                    .slice
                    .lock()
                    .expect("slice lock")
                    .snapshots
                    .get(&id)
                    .map(|x| x.isolation)
                    .unwrap_or_default();
                let taken = tokio::task::spawn_blocking(move || e.take_snapshot(&sid, &sandbox, isolation)).await;
                self.snapshotting.lock().expect("snapshot lock").remove(&id);
                let result = match taken {
                    Ok(Ok(size_bytes)) => opendsec_commands::SnapshotResult::Ready { size_bytes },
                    Ok(Err(e)) => opendsec_commands::SnapshotResult::Failed { reason: e.to_string() },
                    Err(e) => opendsec_commands::SnapshotResult::Failed {
                        reason: format!("snapshot task failed: {e}"),
                    },
                };
                self.report_snapshot(&id, result).await;
                Ok(())
            }
            Action::FailSnapshot { id, reason } => {
                self.report_snapshot(&id, opendsec_commands::SnapshotResult::Failed { reason })
                    .await;
                Ok(())
            }
            Action::RemoveSnapshot { id } => {
                let dir = self.snapshots_dir().join(&id);
                // What was prepared of it for other edges goes too.
                let served = self.transfers_dir().join(&id);
                self.blocking(move |_| {
                    let _ = std::fs::remove_dir_all(served);
                    std::fs::remove_dir_all(dir).map_err(EdgeError::from)
                })
                .await
            }
            Action::MakeTransfer { id } => {
                if !self.preparing.lock().expect("preparing lock").insert(id.clone()) {
                    return; // under way
                }
                let edge = self.clone();
                tokio::spawn(async move {
                    let (e, tid) = (edge.clone(), id.clone());
                    let t = Instant::now();
                    let made = tokio::task::spawn_blocking(move || e.make_transfer(&tid))
                        .await
                        .unwrap_or_else(|p| Err(EdgeError::Store(format!("the task panicked: {p}"))));
                    match made {
                        Ok(bytes) => {
                            tracing::info!(transfer = %id, bytes, took_ms = t.elapsed().as_millis() as u64, "prepared state for another edge to pull")
                        }
                        Err(e) => {
                            tracing::warn!(transfer = %id, error = %e, "cannot prepare state for another edge");
                            let _ = std::fs::write(
                                edge.transfer_failure(&id),
                                format!("the source edge cannot provide it: {e}"),
                            );
                        }
                    }
                    edge.preparing.lock().expect("preparing lock").remove(&id);
                    edge.wake.notify_one();
                });
                Ok(())
            }
            Action::FailTransfer { id, reason } => {
                tracing::warn!(transfer = %id, %reason, "state another edge is to pull cannot be had");
                std::fs::create_dir_all(self.transfers_dir())
                    .and_then(|()| std::fs::write(self.transfer_failure(&id), reason))
                    .map_err(EdgeError::from)
            }
            Action::RemoveTransfer { id } => self.blocking(move |e| e.remove_transfer(&id)).await,
            Action::Report { id, mut observation } => {
                if observation == Observation::Ready && self.is_vm(&id) {
                    // A microVM restored from another's memory answers only that one's
                    // token until re-keyed (done at its creation; again here in case the
                    // edge died in between): it is ready once it takes its own.
                    let source = {
                        let slice = self.slice.lock().expect("slice lock");
                        slice.sandboxes.get(&id).and_then(|d| {
                            d.fork_of.clone().map(Some).or_else(|| {
                                d.snapshot
                                    .as_ref()
                                    .map(|snap| slice.snapshots.get(snap).map(|x| x.sandbox.clone()))
                            })
                        })
                    };
                    if let Some(source) = source {
                        let sid = id.clone();
                        if let Err(e) = self
                            .blocking(move |e| Ok(e.vms()?.ensure_token(&sid, source.as_deref())?))
                            .await
                        {
                            tracing::warn!(sandbox = %id, error = %e, "the microVM's agent does not take its token yet; retried on the next round");
                            return;
                        }
                    }
                    // And it says how it runs: its VMM and accelerator (from its record).
                    match self
                        .vms()
                        .map_err(|e| e.to_string())
                        .and_then(|v| v.runtime(&id).map_err(|e| e.to_string()))
                    {
                        Ok((vmm, accelerator)) => observation = Observation::VmReady { vmm, accelerator },
                        Err(e) => {
                            tracing::warn!(sandbox = %id, error = %e, "cannot read how the microVM runs; retried on the next round");
                            return;
                        }
                    }
                }
                self.report(&id, observation).await;
                Ok(())
            }
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "reconcile action failed; it is retried on the next round");
        }
    }

    /// Starts creating microVM sandbox `d` beside the loop. A fork copy is made together
    /// with every other copy of its source still to be made (one fork: they share its
    /// frozen RAM), once the source itself exists here.
    async fn start_vm_creation(self: &Arc<Self>, d: DesiredSandbox, observed: &BTreeMap<String, Running>) {
        let batch: Vec<DesiredSandbox> = match &d.fork_of {
            None => vec![d.clone()],
            Some(src) => {
                let creating = self.creating.lock().expect("creating lock").clone();
                let slice = self.slice.lock().expect("slice lock");
                let source_pending = slice.sandboxes.get(src).is_some_and(|s| {
                    s.observed == opendsec_projections::Observed::Pending
                        && s.desired == opendsec_projections::Desired::Running
                });
                if creating.contains(src) || source_pending {
                    return; // the source is not up yet: the next round tries again
                }
                let failed = self.failed.lock().expect("failed lock");
                slice
                    .sandboxes
                    .values()
                    .filter(|c| {
                        c.fork_of.as_deref() == Some(src.as_str())
                            && c.isolation.is_machine()
                            && c.transfer == d.transfer
                    })
                    .filter(|c| {
                        c.observed == opendsec_projections::Observed::Pending
                            && c.desired == opendsec_projections::Desired::Running
                    })
                    .filter(|c| !creating.contains(&c.id) && !failed.contains(&c.id) && !observed.contains_key(&c.id))
                    .take(crate::vm::MAX_FORK_COUNT)
                    .cloned()
                    .collect()
            }
        };
        let mut claimed = Vec::new();
        for c in batch {
            if !self.creating.lock().expect("creating lock").insert(c.id.clone()) {
                continue;
            }
            if let Err(why) = self.admit(&c, observed) {
                self.creating.lock().expect("creating lock").remove(&c.id);
                self.report(&c.id, Observation::Failed { reason: why }).await;
                continue;
            }
            claimed.push(c);
        }
        if claimed.is_empty() {
            return;
        }
        let edge = self.clone();
        tokio::spawn(async move {
            let (e2, batch) = (edge.clone(), claimed.clone());
            let made = tokio::task::spawn_blocking(move || match batch[0].fork_of.clone() {
                Some(source) => e2.fork_vms(&source, &batch),
                None => e2.create_vm(&batch[0]),
            })
            .await
            .unwrap_or_else(|p| Err(EdgeError::Store(format!("the create task panicked: {p}"))));
            for c in &claimed {
                edge.creating.lock().expect("creating lock").remove(&c.id);
            }
            match made {
                Ok(()) => {
                    tracing::info!(sandboxes = ?claimed.iter().map(|c| &c.id).collect::<Vec<_>>(), "created microVMs")
                }
                Err(e) => {
                    tracing::warn!(error = %e, "microVM create failed");
                    for c in &claimed {
                        edge.failed.lock().expect("failed lock").insert(c.id.clone());
                        edge.report(
                            &c.id,
                            Observation::Failed {
                                reason: format!("create failed: {e}"),
                            },
                        )
                        .await;
                    }
                }
            }
            edge.wake.notify_one();
        });
    }

    async fn blocking(
        self: &Arc<Self>,
        f: impl FnOnce(&Edge) -> Result<(), EdgeError> + Send + 'static,
    ) -> Result<(), EdgeError> {
        let e = self.clone();
        tokio::task::spawn_blocking(move || f(&e))
            .await
            .unwrap_or_else(|p| Err(EdgeError::Store(format!("task panicked: {p}"))))
    }

    /// The edge's final word on admission, from what really runs here: the sandboxes the
    /// backend sees and those being created, against this edge's capacity, and the
    /// memory the host still has.
    fn admit(&self, d: &DesiredSandbox, observed: &BTreeMap<String, Running>) -> Result<(), String> {
        self.admit_usage(&d.id, d.cpu_millis, d.memory_mb, d.isolation, observed)
    }

    /// Admission from usage: what this edge runs or has promised to run (live sandboxes
    /// of its slice, anything the backend still runs or creates, sandboxes admitted in the
    /// last 30 s that the slice does not show yet), plus the request. MicroVMs count like
    /// containers (their memory is their guest's RAM); a microVM also needs this edge to
    /// run them and room on disk for its RAM file (a paused VM's memory lives there) on
    /// top of the writable disk every sandbox gets. A full VM counts as a microVM (its
    /// disk is an overlay that holds what it writes) and needs a driver that can build
    /// boot disks.
    fn admit_usage(
        &self,
        id: &str,
        cpu_millis: u64,
        memory_mb: u64,
        isolation: Isolation,
        observed: &BTreeMap<String, Running>,
    ) -> Result<(), String> {
        if isolation.is_machine()
            && let VmsState::Unavailable(why) = &*self.vms.lock().expect("vms lock")
        {
            return Err(format!("admission: edge {} runs no microVMs: {why}", self.cfg.name));
        }
        if isolation == Isolation::Vm && !crate::vm::host_can_build_boot_disks() {
            return Err(format!(
                "admission: edge {} runs no full VMs: extlinux, syslinux's mbr.bin or qemu-img is missing",
                self.cfg.name
            ));
        }
        let disk_need = self.cfg.disk_bytes + if isolation.is_machine() { memory_mb << 20 } else { 0 };
        if let Ok(v) = nix::sys::statvfs::statvfs(&self.cfg.data_dir) {
            let avail = v.blocks_available() * v.fragment_size();
            if avail < disk_need {
                return Err(format!(
                    "admission: edge {} has {} MB of disk left, the sandbox needs {} MB",
                    self.cfg.name,
                    avail >> 20,
                    disk_need >> 20
                ));
            }
        }
        let slice = self.slice.lock().expect("slice lock");
        let creating = self.creating.lock().expect("creating lock");
        let mut admitted = self.admitted.lock().expect("admitted lock");
        admitted.retain(|k, (_, _, at)| at.elapsed() < Duration::from_secs(30) && !slice.sandboxes.contains_key(k));
        let here: Vec<(u64, u64)> = slice
            .sandboxes
            .values()
            .filter(|s| s.id != id)
            .filter(|s| {
                let committed = !s.is_terminal() && s.desired != opendsec_projections::Desired::Killed;
                committed
                    || creating.contains(&s.id)
                    || matches!(
                        observed.get(&s.id),
                        Some(Running::Running | Running::Paused | Running::OutOfMemory)
                    )
            })
            .map(|s| (s.cpu_millis, s.memory_mb))
            .chain(
                admitted
                    .iter()
                    .filter(|(k, _)| k.as_str() != id)
                    .map(|(_, (c, m, _))| (*c, *m)),
            )
            .collect();
        let cap = &self.cfg.capacity;
        let mem: u64 = here.iter().map(|(_, m)| m).sum::<u64>() + memory_mb;
        let cpu: u64 = here.iter().map(|(c, _)| c).sum::<u64>() + cpu_millis;
        let d = (memory_mb, cpu_millis);
        if here.len() as u64 + 1 > cap.sandboxes {
            return Err(format!(
                "admission: edge {} already runs its maximum of {} sandboxes",
                self.cfg.name, cap.sandboxes
            ));
        }
        if mem > cap.memory_mb {
            return Err(format!(
                "admission: edge {} has no room for {} MB of memory",
                self.cfg.name, d.0
            ));
        }
        if cpu > cap.cpu_millis {
            return Err(format!(
                "admission: edge {} has no room for {} millicores",
                self.cfg.name, d.1
            ));
        }
        if let Some(avail) = host_mem_available_mb() {
            if avail < d.0 / 4 {
                return Err(format!(
                    "admission: host of edge {} has only {avail} MB of memory available",
                    self.cfg.name
                ));
            }
        }
        Ok(())
    }

    async fn report(&self, id: &str, observation: Observation) {
        {
            let reported = self.reported.lock().expect("reported lock");
            if let Some((last, at)) = reported.get(id) {
                if *last == observation && at.elapsed() < Duration::from_secs(10) {
                    return;
                }
            }
        }
        let request_id = format!("{}:{id}:{observation:?}", self.cfg.name);
        let mut client = self.client.clone();
        match client.report(id, &observation, &request_id).await {
            Ok(index) => {
                tracing::info!(sandbox = %id, ?observation, index, "reported");
                self.reported
                    .lock()
                    .expect("reported lock")
                    .insert(id.to_string(), (observation, Instant::now()));
            }
            Err(e) => tracing::warn!(sandbox = %id, error = %e, "report failed; retried on the next round"),
        }
    }

    /// A sandbox's counters for the metrics endpoint.
    fn sample(&self, id: &str) -> Option<proxy::Sample> {
        if self.is_vm(id) {
            return self.vms().ok()?.sample(id);
        }
        let h = self.backend.get(id).ok()?;
        let u = crate::container::cgroup::usage(&h.record.cgroups_path).unwrap_or_default();
        let (disk_used, disk_total) = nix::sys::statvfs::statvfs(&h.dir.join("disk"))
            .map(|v| {
                let f = v.fragment_size() as u64;
                (
                    v.blocks().saturating_sub(v.blocks_free()) as u64 * f,
                    v.blocks() as u64 * f,
                )
            })
            .unwrap_or((0, self.cfg.disk_bytes));
        Some(proxy::Sample {
            cpu_usec: u.cpu_usec,
            cpu_count: (h.record.limits.cpu_millis as u64).div_ceil(1000).max(1),
            mem_used: u.memory_bytes,
            mem_total: h.record.limits.memory_bytes,
            mem_cache: u.cache_bytes,
            disk_used,
            disk_total,
            runtime: None,
        })
    }

    fn has_start_command(&self, image: &str) -> bool {
        self.images
            .get(image)
            .map(|i| i.config.start.is_some())
            .unwrap_or(false)
    }

    async fn report_snapshot(&self, id: &str, result: opendsec_commands::SnapshotResult) {
        let key = format!("snapshot:{id}");
        let as_obs = Observation::Failed {
            reason: format!("{result:?}"),
        };
        {
            let reported = self.reported.lock().expect("reported lock");
            if let Some((last, at)) = reported.get(&key) {
                if *last == as_obs && at.elapsed() < Duration::from_secs(10) {
                    return;
                }
            }
        }
        let mut client = self.client.clone();
        match client
            .report_snapshot(id, &result, &format!("{}:{key}", self.cfg.name))
            .await
        {
            Ok(index) => {
                tracing::info!(snapshot = %id, ?result, index, "reported");
                self.reported
                    .lock()
                    .expect("reported lock")
                    .insert(key, (as_obs, Instant::now()));
            }
            Err(e) => tracing::warn!(snapshot = %id, error = %e, "snapshot report failed; retried on the next round"),
        }
    }

    /// The snapshots whose files are on this machine.
    fn present_snapshots(&self) -> BTreeSet<String> {
        std::fs::read_dir(self.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_string))
            .filter(|n| !n.starts_with('.'))
            .collect()
    }

    async fn reconcile(self: &Arc<Self>) {
        // One snapshot of the creations under way, taken before observing, serves both
        // the observation and the plan, so a creation that ends in between is not
        // mistaken for a missing sandbox.
        let creating = self.creating.lock().expect("creating lock").clone();
        let (e, c) = (self.clone(), creating.clone());
        let observed = match tokio::task::spawn_blocking(move || e.observe(&c)).await {
            Ok(Ok(o)) => o,
            Ok(Err(err)) => {
                tracing::warn!(error = %err, "cannot observe sandboxes");
                return;
            }
            Err(_) => return,
        };
        *self.last_observed.lock().expect("observed lock") = observed.clone();
        let present = self.present_snapshots();
        let served = self.present_transfers();
        let preparing = self.preparing.lock().expect("preparing lock").clone();
        let actions = {
            let slice = self.slice.lock().expect("slice lock");
            let containers_only;
            let slice = if self.vms_preparing() {
                // The driver cannot see its VMs yet: leave microVM sandboxes alone rather
                // than take them for lost.
                let mut containers = slice.clone();
                containers.sandboxes.retain(|_, d| d.isolation == Isolation::Container);
                containers.snapshots.retain(|_, x| x.isolation == Isolation::Container);
                containers.served.retain(|_, t| t.isolation == Isolation::Container);
                containers_only = containers;
                &containers_only
            } else {
                &*slice
            };
            let caught_up = slice.next_index > self.registered_at;
            let mut a = plan(slice, &observed, opendsec_edge_api::now_ms(), caught_up);
            a.extend(plan_snapshots(slice, &observed, &present));
            a.extend(
                plan_transfers(slice, &observed, &served)
                    .into_iter()
                    .filter(|x| !matches!(x, Action::MakeTransfer { id } if preparing.contains(id))),
            );
            a
        };
        self.sweep_imports(&observed);
        let mut changed = false;
        for a in actions {
            if let Action::Create { id } = &a {
                if creating.contains(id) {
                    continue;
                }
            }
            // Pausing, resuming and stopping change what the next observation sees:
            // observe again right away rather than at the next tick.
            changed |= matches!(a, Action::Pause { .. } | Action::Resume { .. } | Action::Stop { .. });
            self.act(a, &observed).await;
        }
        if changed {
            self.wake.notify_one();
        }
    }

    fn heartbeat(&self) -> HeartbeatRequest {
        let slice = self.slice.lock().expect("slice lock");
        let live: Vec<&DesiredSandbox> = slice.sandboxes.values().filter(|s| !s.is_terminal()).collect();
        HeartbeatRequest {
            edge: self.cfg.name.clone(),
            running_sandboxes: live.len() as u64,
            cpu_millis_used: live.iter().map(|s| s.cpu_millis).sum(),
            memory_mb_used: live.iter().map(|s| s.memory_mb).sum(),
        }
    }
}

/// Archives directory `dir` into `dest` with everything overlayfs needs of a layer:
/// owners, modes, xattrs (opaque-dir marks), whiteout devices, sparse files.
fn tar_create(dir: &std::path::Path, dest: &std::path::Path) -> Result<(), EdgeError> {
    let out = std::process::Command::new("tar")
        .args([
            "--create",
            "--sparse",
            "--xattrs",
            "--xattrs-include=*",
            "--numeric-owner",
            "--file",
        ])
        .arg(dest)
        .arg("--directory")
        .arg(dir)
        .arg(".")
        .output()?;
    if !out.status.success() {
        return Err(EdgeError::Store(format!(
            "archiving {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Unpacks an archive of [`tar_create`] into `dest` (made beside and renamed, so a crash
/// leaves no half layer).
fn tar_extract(archive: &std::path::Path, dest: &std::path::Path) -> Result<(), EdgeError> {
    let tmp = dest.with_file_name(format!(
        ".tmp-{}",
        dest.file_name().and_then(|n| n.to_str()).unwrap_or("layer")
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let out = std::process::Command::new("tar")
        .args([
            "--extract",
            "--xattrs",
            "--xattrs-include=*",
            "--numeric-owner",
            "--same-owner",
            "--same-permissions",
            "--file",
        ])
        .arg(archive)
        .arg("--directory")
        .arg(&tmp)
        .output()?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(EdgeError::Store(format!(
            "unpacking {}: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::rename(&tmp, dest)?;
    Ok(())
}

/// Bytes used by the files under `dir` (not following symlinks).
fn dir_size(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

/// Bytes allocated on disk by the files directly in `dir` (sparse files count their data).
fn dir_allocated(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// MemAvailable of the host, in MB.
fn host_mem_available_mb() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024)
}

/// Copies directory `from` to a new `dest` (through a temporary name, so `dest` exists
/// only complete). `cp -a` keeps owners, modes, xattrs (overlay's opaque-dir marks) and
/// the whiteout devices that record deletions of lower files.
fn copy_tree(from: &std::path::Path, dest: &std::path::Path) -> Result<(), EdgeError> {
    let tmp = dest.with_file_name(format!(
        ".tmp-{}",
        dest.file_name().and_then(|n| n.to_str()).unwrap_or("copy")
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    if let Some(parent) = tmp.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let out = std::process::Command::new("cp")
        .arg("-a")
        .arg("--")
        .arg(from)
        .arg(&tmp)
        .output()?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(EdgeError::Store(format!(
            "copying {}: {}",
            from.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::rename(&tmp, dest)?;
    Ok(())
}

/// Runs the edge until `shutdown` resolves. Sandboxes keep running afterwards.
pub async fn run(cfg: EdgeConfig, shutdown: impl std::future::Future<Output = ()>) -> Result<(), EdgeError> {
    std::fs::create_dir_all(cfg.data_dir.join("agents"))?;
    let db = Database::create(cfg.data_dir.join("edge.redb")).map_err(store_err)?;
    let saved: Option<SliceState> = {
        let tx = db.begin_read().map_err(store_err)?;
        match tx.open_table(STATE) {
            Ok(t) => t
                .get("slice")
                .map_err(store_err)?
                .and_then(|v| serde_json::from_slice(v.value()).ok()),
            Err(_) => None,
        }
    };
    let slice = saved
        .filter(|s| s.edge == cfg.name)
        .unwrap_or_else(|| SliceState::new(&cfg.name));
    let backend = ContainerBackend::new(cfg.container.clone())?;
    let images = ImageStore::open(&cfg.images_dir)?;
    let mut client = SliceClient::connect(&cfg.control_peer, &cfg.token)?;
    // Listening before registering: once registered, the edge is asked to admit
    // sandboxes and is sent their traffic.
    let listener = tokio::net::TcpListener::bind(&cfg.proxy_listen).await?;

    // Register (retrying until the control plane answers).
    let mut delay = Duration::from_millis(100);
    let registered_at = loop {
        let mut labels = BTreeMap::from([(opendsec_commands::ADMISSION_LABEL.to_string(), "http".to_string())]);
        if cfg.microvm.is_some() {
            labels.insert(opendsec_commands::MICROVM_LABEL.to_string(), "qemu".to_string());
            if crate::vm::host_can_build_boot_disks() {
                labels.insert(opendsec_commands::FULLVM_LABEL.to_string(), "q35".to_string());
            }
        }
        match client
            .register(&cfg.name, &cfg.proxy_listen, cfg.capacity, labels)
            .await
        {
            Ok((ordinal, index)) => {
                tracing::info!(edge = %cfg.name, ordinal, index, "registered");
                break index;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot register yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    };

    let next_index = slice.next_index;
    let edge = Arc::new(Edge {
        backend,
        images,
        db,
        slice: Mutex::new(slice),
        client: client.clone(),
        creating: Mutex::new(BTreeSet::new()),
        failed: Mutex::new(BTreeSet::new()),
        create_lock: Mutex::new(()),
        warm: WarmPool::new(cfg.warm_sandboxes, WARM_IMAGES),
        oom_seen: Mutex::new(BTreeSet::new()),
        snapshotting: Mutex::new(BTreeSet::new()),
        last_observed: Mutex::new(BTreeMap::new()),
        admitted: Mutex::new(BTreeMap::new()),
        reported: Mutex::new(BTreeMap::new()),
        wake: tokio::sync::Notify::new(),
        registered_at,
        resume_failures: Mutex::new(BTreeMap::new()),
        preparing: Mutex::new(BTreeSet::new()),
        import_locks: Mutex::new(BTreeMap::new()),
        rt: tokio::runtime::Handle::current(),
        vms: Mutex::new(if cfg.microvm.is_some() {
            VmsState::Preparing
        } else {
            VmsState::Unavailable("it was started without microVM support".into())
        }),
        cfg,
    });
    // Warm containers a killed edge left are not claimable (their filler is gone).
    let e = edge.clone();
    let _ = tokio::task::spawn_blocking(move || e.discard_leftover_warm()).await;
    if let Some(mv) = edge.cfg.microvm.clone() {
        // The driver's first start on a machine builds the guest kernel and initramfs:
        // containers are served meanwhile; microVM sandboxes wait for it.
        let vcfg = MicroVmsConfig {
            root: edge.cfg.data_dir.join("vms"),
            images: edge.images.clone(),
            agent_binary: edge.cfg.agent_binary.clone(),
            shim: mv.shim,
            edge_key: edge.cfg.edge_key.clone(),
            disk_mb: edge.cfg.disk_bytes >> 20,
        };
        let e = edge.clone();
        tokio::spawn(async move {
            let opened = tokio::task::spawn_blocking(move || MicroVms::open(vcfg)).await;
            let state = match opened {
                Ok(Ok(v)) => {
                    tracing::info!(accelerator = v.accel().accel.as_str(), reason = %v.accel().reason, vmm = v.vmm().vmm.as_str(), vmm_reason = %v.vmm().reason, "microVMs ready");
                    VmsState::Ready(Arc::new(v))
                }
                Ok(Err(err)) => {
                    tracing::error!(error = %err, "this edge cannot run microVMs");
                    VmsState::Unavailable(err.to_string())
                }
                Err(err) => VmsState::Unavailable(format!("preparing the microVM driver panicked: {err}")),
            };
            *e.vms.lock().expect("vms lock") = state;
            e.wake.notify_one();
        });
    }
    let agents = edge.cfg.data_dir.join("agents");
    let vm_root = edge.cfg.data_dir.join("vms");
    let resolve: Resolver = Arc::new(move |id: &str| {
        let valid = !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        if !valid {
            return None;
        }
        let p = agents.join(format!("{id}.sock"));
        if p.exists() {
            return Some(AgentAddr::Unix(p));
        }
        // Read from the VM's record: a restarted edge serves its VMs before its driver is ready.
        crate::vm::agent_channel_at(&vm_root, id).map(AgentAddr::MicroVm)
    });
    let judge = edge.clone();
    let admitter: proxy::Admitter = Arc::new(move |ask| {
        let observed = judge.last_observed.lock().expect("observed lock").clone();
        let isolation = Isolation::from_event(&ask.isolation)
            .ok_or_else(|| format!("admission: isolation {:?} is unknown to this edge", ask.isolation))?;
        judge.admit_usage(&ask.sandbox, ask.cpu_millis, ask.memory_mb, isolation, &observed)?;
        judge
            .admitted
            .lock()
            .expect("admitted lock")
            .insert(ask.sandbox.clone(), (ask.cpu_millis, ask.memory_mb, Instant::now()));
        Ok(())
    });
    let sampled = edge.clone();
    let sampler: proxy::Sampler = Arc::new(move |id| sampled.sample(id));
    let reader = edge.clone();
    let logs: proxy::LogReader = Arc::new(move |id, max| match reader.is_vm(id) {
        true => reader.vms().ok()?.log(id, max),
        false => reader.backend.read_log(id, max).ok(),
    });
    let server = edge.clone();
    let lookup: Arc<dyn Fn(&str, &str) -> Result<PathBuf, (u16, String)> + Send + Sync> =
        Arc::new(move |id: &str, to: &str| {
            {
                let slice = server.slice.lock().expect("slice lock");
                let Some(t) = slice.served.get(id) else {
                    return Err((404, format!("edge {} serves no transfer {id}", server.cfg.name)));
                };
                if !t.sends_to(to) {
                    return Err((403, format!("transfer {id} is not for edge {to}")));
                }
            }
            if let Ok(why) = std::fs::read_to_string(server.transfer_failure(id)) {
                return Err((410, why));
            }
            let dir = server.transfers_dir().join(id);
            if dir.join(transfer::MANIFEST).is_file() {
                Ok(dir)
            } else {
                Err((503, format!("transfer {id} is being prepared")))
            }
        });
    let done = edge.clone();
    let pulled: Arc<dyn Fn(&str, &str) + Send + Sync> = Arc::new(move |id: &str, to: &str| {
        {
            let mut slice = done.slice.lock().expect("slice lock");
            if let Some(t) = slice.served.get_mut(id) {
                let theirs: Vec<String> = t
                    .destinations
                    .iter()
                    .filter(|(_, e)| e.as_str() == to)
                    .map(|(s, _)| s.clone())
                    .collect();
                t.pulled.extend(theirs);
            }
        }
        if let Err(e) = done.persist() {
            tracing::error!(error = %e, "cannot persist the slice");
        }
        tracing::info!(transfer = %id, by = %to, "another edge pulled a transfer");
        done.wake.notify_one();
    });
    let transfers = proxy::Transfers { lookup, pulled };
    let hooks = proxy::Hooks {
        admitter: Some(admitter),
        sampler: Some(sampler),
        logs: Some(logs),
        transfers: Some(transfers),
    };
    let proxy_task = tokio::spawn(proxy::serve_with(listener, edge.cfg.edge_key.clone(), resolve, hooks));

    // The follower runs on its own task: a burst of slice messages is folded as it comes,
    // and the loop below persists and reconciles once per burst, not once per message.
    let (slice_tx, mut slice_rx) = tokio::sync::mpsc::channel(1024);
    let follower_edge = edge.cfg.name.clone();
    let follower_task = tokio::spawn(async move {
        let mut follower = SliceFollower::new(client, &follower_edge, next_index);
        loop {
            let msg = follower.next().await;
            if slice_tx.send(msg).await.is_err() {
                return;
            }
        }
    });
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    let mut heartbeat = tokio::time::interval(Duration::from_secs(2));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(msg) = slice_rx.recv() => {
                {
                    let mut slice = edge.slice.lock().expect("slice lock");
                    slice.apply(&msg);
                    while let Ok(more) = slice_rx.try_recv() {
                        slice.apply(&more);
                    }
                }
                // Acting first: what the slice asks is idempotent, so an edge that dies
                // before persisting re-reads those events from the log and finds them done.
                edge.reconcile().await;
                if let Err(e) = edge.persist() {
                    tracing::error!(error = %e, "cannot persist the slice");
                }
            }
            _ = tick.tick() => edge.reconcile().await,
            _ = edge.wake.notified() => edge.reconcile().await,
            _ = heartbeat.tick() => {
                let hb = edge.heartbeat();
                let mut c = edge.client.clone();
                if let Err(e) = c.heartbeat(hb).await {
                    tracing::debug!(error = %e, "heartbeat failed");
                }
            }
        }
    }
    proxy_task.abort();
    follower_task.abort();
    // Sandboxes run on; warm containers and disks, which nothing uses yet, do not
    // outlive the edge.
    let e = edge.clone();
    let _ = tokio::task::spawn_blocking(move || {
        e.drain_warm();
        e.backend.drain_warm_disks()
    })
    .await;
    Ok(())
}
