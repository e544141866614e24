//! The edge process: registers with the control plane, follows its slice of the log,
//! persists it (redb) and reconciles the sandboxes of this machine toward it through its
//! backends: containers, or machines (microVMs and full VMs); reports what it observes;
//! sends heartbeats; serves the per-sandbox proxy. Sandboxes are not its children (each
//! runs under its own shim), so a killed edge leaves them running and a restarted one
//! re-adopts them.
//!
//! The rooms, by job:
//! - `run.rs`: [`run`], the loop: register, follow the slice, reconcile (observe, plan,
//!   act), persist, heartbeat, serve the proxy.
//! - `act.rs`: one planned action carried out.
//! - `backend.rs`: [`backend::Backend`], the one place containers and machines are told
//!   apart; `containers.rs` the node's side of the container backend (`crate::microvms`
//!   is the machines').
//! - `create.rs`: creating sandboxes beside the loop; `agent.rs` what their agent gets;
//!   `warm.rs` warm containers.
//! - `admission.rs`: the edge's final word on admission.
//! - `adoption.rs`: taking up what an earlier run left (sandboxes, the saved slice).
//! - `snapshots.rs`, `transfers.rs`: snapshots, and state moving between edges.
//! - `pulls.rs`, `packs.rs`, `imports.rs`: images pulled from registries, images packed
//!   from this edge's container sandboxes (their writable layer, residue left out), and
//!   images imported from tarballs uploaded through the proxy; `image_gc.rs`
//!   the edge's in-use set in the image store, deleted images' records, collections.
//! - `network.rs`: each container sandbox's network (`crate::net`): attached before its
//!   container, its policy applied before its PID 1 runs and whenever the log changes it.
//! - `paths.rs`, `files.rs`: where the node keeps a sandbox's files, and how it copies them.
//!
//! Not yet: memory snapshots of containers (CRIU does not work here; a
//! microVM's snapshots carry its memory), gVisor, TLS on edge-to-edge transfers (bind
//! edges' proxies to a private network).

mod act;
mod admission;
mod adoption;
mod agent;
mod backend;
mod containers;
mod create;
mod files;
mod image_gc;
mod imports;
mod network;
mod packs;
mod paths;
mod pulls;
mod run;
mod snapshots;
mod transfers;
mod warm;

pub use pulls::RegistrySettings;
pub use run::run;

use crate::container::warm::WarmPool;
use crate::container::{ContainerBackend, ContainerConfig};
use crate::desired::SliceState;
use crate::images::ImageStore;
use crate::reconcile::Running;
use crate::slice::SliceClient;
use backend::Machines;
use opendsec_commands::Observation;
use opendsec_edge_api::pb::Capacity;
use redb::{Database, TableDefinition};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const STATE: TableDefinition<&str, &[u8]> = TableDefinition::new("edge_state");

/// The agent's directory inside every container: a read-only mount holding only the
/// agent binary.
pub const AGENT_DIR_IN_SANDBOX: &str = "/.opendsec";
/// Where the agent binary appears inside every sandbox (read-only).
pub const AGENT_PATH_IN_SANDBOX: &str = "/.opendsec/agent";
/// Resumes of a microVM tried in a row before it is reported failed.
const MAX_RESUME_TRIES: u32 = 3;

#[derive(Clone, Debug)]
pub struct EdgeConfig {
    /// This edge's name (unique in the cluster).
    pub name: String,
    /// A control node's peer address.
    pub control_peer: String,
    /// A token with edge:write, from the root project.
    pub token: String,
    /// The key the gateway presents to this edge's proxy (empty: from the edge's
    /// identity, see [`crate::identity`]).
    pub edge_key: String,
    /// This edge's certificate and the CA it trusts, when its control node gave them
    /// (the embedded edge); `None`: from the data directory, or by joining.
    pub trust: Option<std::sync::Arc<opendsec_trust::Trust>>,
    /// The cluster CA (PEM) a new edge checks the control plane by when it joins.
    pub ca_pem: Option<String>,
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
    /// Plain-HTTP registries and credentials for image pulls.
    pub registries: RegistrySettings,
    /// Container sandboxes' networking (`crate::net`); `None`: only `lo` in each.
    pub network: Option<crate::net::NetConfig>,
}

/// Images whose warm containers are kept at once (the most recently used).
const WARM_IMAGES: usize = 2;

/// What an edge needs to run microVM sandboxes.
#[derive(Clone, Debug)]
pub struct MicroVmEdgeConfig {
    /// `opendsec-vm-shim`, the detached parent of each QEMU.
    pub shim: PathBuf,
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
    #[error("{0}")]
    Identity(#[from] crate::identity::IdentityError),
    /// Pulling the state a sandbox starts from off another edge failed.
    #[error("{0}")]
    Transfer(#[from] crate::transfer::TransferError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Net(#[from] crate::net::NetError),
    /// A create names an image packed on another edge (packed images stay where they were
    /// made), or packed here and since removed from the store.
    #[error(
        "image {image} was packed on edge {edge} and is not in this edge's store; packed images start only \
         on the edge that packed them: make room there, or pack the image again from a sandbox on this edge"
    )]
    PackedElsewhere { image: String, edge: String },
}

/// A reason as the log takes it: control characters (from a hostile image's bytes, a
/// tool's output) shown as U+FFFD and the text cut to the log's limit. A reason the log
/// refuses would be retried for ever and the sandbox never reported.
pub(crate) fn fit_reason(reason: &str) -> String {
    let max = opendsec_commands::LIMITS.reason_len;
    let mut out = String::with_capacity(reason.len().min(max));
    for c in reason.chars() {
        let c = if c.is_control() && c != '\n' { '\u{fffd}' } else { c };
        if out.len() + c.len_utf8() > max - 3 {
            out.push_str("...");
            break;
        }
        out.push(c);
    }
    out
}

fn store_err(e: impl std::fmt::Display) -> EdgeError {
    EdgeError::Store(e.to_string())
}

/// The edge's state, shared by the loop and the tasks it runs beside it. The rooms above
/// each add an `impl Edge` block for their job.
struct Edge {
    cfg: EdgeConfig,
    /// This edge's certificate (its proxy's TLS, transfers from other edges).
    trust: std::sync::Arc<opendsec_trust::Trust>,
    /// A renewal is under way.
    renewing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// The container backend (reached through [`backend::Backend`] for what both
    /// backends do).
    containers: ContainerBackend,
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
    /// How many container creations hold a blocking thread at once; the others wait
    /// without one. A burst of N creates otherwise parked N threads on `create_lock`,
    /// each with its own allocator heap (~0.6 MiB of RSS per sandbox in a burst).
    creation_slots: tokio::sync::Semaphore,
    /// Warm containers ready to be claimed, per image.
    warm: WarmPool,
    /// Snapshots being taken right now.
    snapshotting: Mutex<BTreeSet<String>>,
    /// OOM kills counted inside running containers (reported until the log has them).
    oom_seen: Mutex<BTreeMap<String, crate::reconcile::OomKills>>,
    /// What the edge holds of warm containers' agents until a sandbox claims them.
    warm_config: Mutex<BTreeMap<String, warm::WarmAgent>>,
    /// The directory bound read-only at [`AGENT_DIR_IN_SANDBOX`] (see `agent.rs`).
    agent_dir: PathBuf,
    /// Who the kernel's OOM killer ended, per memory cgroup.
    oom_log: Arc<crate::container::oom::OomLog>,
    /// The last observation, for admission requests between two rounds.
    last_observed: Mutex<BTreeMap<String, Running>>,
    /// Sandboxes whose pause or resume is being carried out right now (see `act.rs`).
    changing: Mutex<BTreeSet<String>>,
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
    machines: Machines,
    /// MicroVMs whose resume failed, and how often in a row.
    resume_failures: Mutex<BTreeMap<String, u32>>,
    /// Transfers being prepared right now.
    preparing: Mutex<BTreeSet<String>>,
    /// One pull per transfer at a time (the copies of one fork share it).
    import_locks: Mutex<BTreeMap<String, Arc<Mutex<()>>>>,
    /// The edge's part in the image store's GC (`image_gc.rs`).
    image_gc: Mutex<image_gc::ImageGc>,
    /// The runtime, for the async pulls that blocking creations make.
    rt: tokio::runtime::Handle,
    /// Image pulls, packs and imports under way (`pulls.rs`, `packs.rs`, `imports.rs`).
    pulls: pulls::Pulls,
    /// Imports awaiting their upload, and the uploads' files (`imports.rs`).
    imports: imports::Imports,
    /// The last 8 h of each running sandbox's metrics, a point every 5 s (`run.rs`).
    metrics_history: crate::metrics_history::MetricsHistory,
    /// Container sandboxes' networks (`network.rs`); `None` when the edge runs without.
    net: Option<Arc<crate::net::Network>>,
    /// Ended sandboxes whose network the teardown thread removes (`network.rs`).
    detach_queue: Mutex<Option<std::sync::mpsc::Sender<String>>>,
}

impl Edge {
    /// Saves the slice (with its resume index) in `edge.redb`.
    fn persist(&self) -> Result<(), EdgeError> {
        let bytes = serde_json::to_vec(&*self.slice.lock().expect("slice lock")).map_err(store_err)?;
        let tx = self.db.begin_write().map_err(store_err)?;
        {
            let mut t = tx.open_table(STATE).map_err(store_err)?;
            t.insert("slice", bytes.as_slice()).map_err(store_err)?;
        }
        tx.commit().map_err(store_err)
    }

    /// Runs `f` on a blocking thread: backend calls block (runtime, QMP, file copies).
    async fn blocking(
        self: &Arc<Self>,
        f: impl FnOnce(&Edge) -> Result<(), EdgeError> + Send + 'static,
    ) -> Result<(), EdgeError> {
        let e = self.clone();
        tokio::task::spawn_blocking(move || f(&e))
            .await
            .unwrap_or_else(|p| Err(EdgeError::Store(format!("task panicked: {p}"))))
    }

    /// Reports what this edge observes of sandbox `id` to the log (once: a repeat waits
    /// until the slice has had time to show the first).
    async fn report(&self, id: &str, observation: Observation) {
        let observation = match observation {
            Observation::Failed { reason } => Observation::Failed {
                reason: fit_reason(&reason),
            },
            Observation::Exited {
                exit_code,
                oom_killed,
                reason,
            } => Observation::Exited {
                exit_code,
                oom_killed,
                reason: fit_reason(&reason),
            },
            other => other,
        };
        {
            let reported = self.reported.lock().expect("reported lock");
            if let Some((last, at)) = reported.get(id)
                && *last == observation
                && at.elapsed() < Duration::from_secs(10)
            {
                return;
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
}

#[cfg(test)]
mod tests {
    use super::fit_reason;

    #[test]
    fn a_reason_with_a_hostile_images_bytes_still_fits_the_log() {
        let hostile = format!("malformed: \u{1b}[31m\u{0}{}", "x".repeat(5000));
        let fitted = fit_reason(&hostile);
        assert!(fitted.len() <= opendsec_commands::LIMITS.reason_len, "{}", fitted.len());
        assert!(!fitted.chars().any(|c| c.is_control() && c != '\n'), "{fitted:?}");
        assert!(fitted.starts_with("malformed: \u{fffd}[31m\u{fffd}x"), "{fitted:?}");
        assert!(fitted.ends_with("..."));
        assert_eq!(fit_reason("line one\nline two"), "line one\nline two");
    }
}
