//! The edge process: registers with the control plane, follows its slice of the log,
//! persists it (redb) and reconciles the sandboxes of this machine toward it through
//! the container backend; reports what it observes; sends heartbeats; serves the
//! per-sandbox proxy. Sandboxes are not its children (each runs under its own shim),
//! so a killed edge leaves them running and a restarted one re-adopts them.

use crate::container::{BindMount, ContainerBackend, ContainerConfig, Limits, SandboxStatus, SandboxSpec};
use crate::desired::{DesiredSandbox, SliceState};
use crate::images::ImageStore;
use crate::proxy::{self, Resolver};
use crate::reconcile::{plan, Action, Running};
use crate::slice::{SliceClient, SliceFollower};
use opendsec_commands::Observation;
use opendsec_control::pb::{Capacity, HeartbeatRequest};
use redb::{Database, ReadableDatabase, TableDefinition};
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const STATE: TableDefinition<&str, &[u8]> = TableDefinition::new("edge_state");

/// Where the agent binary appears inside every sandbox (read-only).
pub const AGENT_PATH_IN_SANDBOX: &str = "/.opendsec/agent";

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
}

#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("edge state store: {0}")]
    Store(String),
    #[error("container backend: {0}")]
    Backend(#[from] crate::container::ContainerError),
    #[error("image store: {0}")]
    Images(#[from] crate::images::ImageError),
    #[error("control plane: {0}")]
    Control(#[from] crate::slice::SliceError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
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
}

impl Edge {
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
            let running = match (st.status, st.exit) {
                // The shim's record, the cgroup's counter (while it exists) and what this
                // edge saw before the end all count: an OOM is never reported as a plain exit.
                (_, Some(exit)) => Running::Exited {
                    exit_code: exit.exit_code,
                    oom_killed: exit.oom_killed || oom_now() || self.oom_seen.lock().expect("oom lock").contains(&h.id),
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
                (SandboxStatus::Stopped | SandboxStatus::Lost, None) => Running::Exited { exit_code: 137, oom_killed: false },
            };
            out.insert(h.id, running);
        }
        Ok(out)
    }

    fn create(&self, d: &DesiredSandbox) -> Result<(), EdgeError> {
        let image = self.images.ensure(&d.image, &|p| tracing::info!(image = %d.image, progress = ?p, "building image"))?;
        let sock = self.socket_path(&d.id);
        let _ = std::fs::remove_file(&sock);
        // The socket lives outside the sandbox; the agent gets only the listening fd.
        let listener = std::os::unix::net::UnixListener::bind(&sock)?;
        let mut spec = SandboxSpec::from_image(
            d.id.clone(),
            &self.images,
            &image,
            vec![AGENT_PATH_IN_SANDBOX.into(), "serve".into(), "--listen-fd".into(), "3".into()],
        )?;
        spec.limits = Limits {
            memory_bytes: d.memory_mb << 20,
            cpu_millis: d.cpu_millis.min(u32::MAX as u64) as u32,
            pids: self.cfg.pids,
            io_weight: Some(100),
            disk_bytes: self.cfg.disk_bytes,
        };
        spec.binds.push(BindMount { host_path: self.cfg.agent_binary.clone(), container_path: AGENT_PATH_IN_SANDBOX.into() });
        spec.extra_fds.push(listener.as_raw_fd());
        spec.labels = d.labels.clone();
        {
            let _one_at_a_time = self.create_lock.lock().expect("create lock");
            self.backend.create(&spec)?;
        }
        drop(listener); // the agent holds its own copy
        Ok(())
    }

    async fn act(self: &Arc<Self>, action: Action, observed: &BTreeMap<String, Running>) {
        let result: Result<(), EdgeError> = match action {
            Action::Create { id } => {
                let Some(d) = self.slice.lock().expect("slice lock").sandboxes.get(&id).cloned() else { return };
                if self.failed.lock().expect("failed lock").contains(&id) {
                    return; // its failure is reported; it is not retried
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
                    edge.creating.lock().expect("creating lock").remove(&d.id);
                    match r {
                        Ok(Ok(())) => tracing::info!(sandbox = %d.id, "created"),
                        Ok(Err(EdgeError::Backend(crate::container::ContainerError::AlreadyExists(_)))) => {
                            tracing::debug!(sandbox = %d.id, "already created");
                        }
                        Ok(Err(e)) => {
                            tracing::warn!(sandbox = %d.id, error = %e, "create failed");
                            edge.failed.lock().expect("failed lock").insert(d.id.clone());
                            edge.report(&d.id, Observation::Failed { reason: format!("create failed: {e}") }).await;
                        }
                        Err(e) => tracing::error!(sandbox = %d.id, error = %e, "create task panicked"),
                    }
                    edge.wake.notify_one();
                });
                Ok(())
            }
            Action::Pause { id } => self.blocking(move |e| e.backend.pause(&id).map_err(EdgeError::from)).await,
            Action::Resume { id } => self.blocking(move |e| e.backend.resume(&id).map_err(EdgeError::from)).await,
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
                    r
                })
                .await
            }
            Action::Report { id, observation } => {
                self.report(&id, observation).await;
                Ok(())
            }
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "reconcile action failed; it is retried on the next round");
        }
    }

    async fn blocking(self: &Arc<Self>, f: impl FnOnce(&Edge) -> Result<(), EdgeError> + Send + 'static) -> Result<(), EdgeError> {
        let e = self.clone();
        tokio::task::spawn_blocking(move || f(&e)).await.unwrap_or_else(|p| Err(EdgeError::Store(format!("task panicked: {p}"))))
    }

    /// The edge's final word on admission, from what really runs here: the sandboxes the
    /// backend sees and those being created, against this edge's capacity, and the
    /// memory the host still has.
    fn admit(&self, d: &DesiredSandbox, observed: &BTreeMap<String, Running>) -> Result<(), String> {
        self.admit_usage(&d.id, d.cpu_millis, d.memory_mb, observed)
    }

    /// Admission from usage: what this edge runs or has promised to run (live sandboxes
    /// of its slice, anything the backend still runs or creates, sandboxes admitted in the
    /// last 30 s that the slice does not show yet), plus the request.
    fn admit_usage(&self, id: &str, cpu_millis: u64, memory_mb: u64, observed: &BTreeMap<String, Running>) -> Result<(), String> {
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
                committed || creating.contains(&s.id) || matches!(observed.get(&s.id), Some(Running::Running | Running::Paused | Running::OutOfMemory))
            })
            .map(|s| (s.cpu_millis, s.memory_mb))
            .chain(admitted.iter().filter(|(k, _)| k.as_str() != id).map(|(_, (c, m, _))| (*c, *m)))
            .collect();
        let cap = &self.cfg.capacity;
        let mem: u64 = here.iter().map(|(_, m)| m).sum::<u64>() + memory_mb;
        let cpu: u64 = here.iter().map(|(c, _)| c).sum::<u64>() + cpu_millis;
        let d = (memory_mb, cpu_millis);
        if here.len() as u64 + 1 > cap.sandboxes {
            return Err(format!("admission: edge {} already runs its maximum of {} sandboxes", self.cfg.name, cap.sandboxes));
        }
        if mem > cap.memory_mb {
            return Err(format!("admission: edge {} has no room for {} MB of memory", self.cfg.name, d.0));
        }
        if cpu > cap.cpu_millis {
            return Err(format!("admission: edge {} has no room for {} millicores", self.cfg.name, d.1));
        }
        if let Some(avail) = host_mem_available_mb() {
            if avail < d.0 / 4 {
                return Err(format!("admission: host of edge {} has only {avail} MB of memory available", self.cfg.name));
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
                self.reported.lock().expect("reported lock").insert(id.to_string(), (observation, Instant::now()));
            }
            Err(e) => tracing::warn!(sandbox = %id, error = %e, "report failed; retried on the next round"),
        }
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
        let actions = {
            let slice = self.slice.lock().expect("slice lock");
            plan(&slice, &observed, opendsec_control::now_ms())
        };
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

/// MemAvailable of the host, in MB.
fn host_mem_available_mb() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024)
}

/// Runs the edge until `shutdown` resolves. Sandboxes keep running afterwards.
pub async fn run(cfg: EdgeConfig, shutdown: impl std::future::Future<Output = ()>) -> Result<(), EdgeError> {
    std::fs::create_dir_all(cfg.data_dir.join("agents"))?;
    let db = Database::create(cfg.data_dir.join("edge.redb")).map_err(store_err)?;
    let saved: Option<SliceState> = {
        let tx = db.begin_read().map_err(store_err)?;
        match tx.open_table(STATE) {
            Ok(t) => t.get("slice").map_err(store_err)?.and_then(|v| serde_json::from_slice(v.value()).ok()),
            Err(_) => None,
        }
    };
    let slice = saved.filter(|s| s.edge == cfg.name).unwrap_or_else(|| SliceState::new(&cfg.name));
    let backend = ContainerBackend::new(cfg.container.clone())?;
    let images = ImageStore::open(&cfg.images_dir)?;
    let mut client = SliceClient::connect(&cfg.control_peer, &cfg.token)?;

    // Register (retrying until the control plane answers).
    let mut delay = Duration::from_millis(100);
    loop {
        let labels = BTreeMap::from([(opendsec_commands::ADMISSION_LABEL.to_string(), "http".to_string())]);
        match client.register(&cfg.name, &cfg.proxy_listen, cfg.capacity, labels).await {
            Ok((ordinal, _)) => {
                tracing::info!(edge = %cfg.name, ordinal, "registered");
                break;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot register yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }

    let listener = tokio::net::TcpListener::bind(&cfg.proxy_listen).await?;
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
        oom_seen: Mutex::new(BTreeSet::new()),
        last_observed: Mutex::new(BTreeMap::new()),
        admitted: Mutex::new(BTreeMap::new()),
        reported: Mutex::new(BTreeMap::new()),
        wake: tokio::sync::Notify::new(),
        cfg,
    });
    let agents = edge.cfg.data_dir.join("agents");
    let resolve: Resolver = Arc::new(move |id: &str| {
        let valid = !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
        let p = agents.join(format!("{id}.sock"));
        (valid && p.exists()).then_some(p)
    });
    let judge = edge.clone();
    let admitter: proxy::Admitter = Arc::new(move |ask| {
        let observed = judge.last_observed.lock().expect("observed lock").clone();
        judge.admit_usage(&ask.sandbox, ask.cpu_millis, ask.memory_mb, &observed)?;
        judge.admitted.lock().expect("admitted lock").insert(ask.sandbox.clone(), (ask.cpu_millis, ask.memory_mb, Instant::now()));
        Ok(())
    });
    let proxy_task = tokio::spawn(proxy::serve_with_admission(listener, edge.cfg.edge_key.clone(), resolve, Some(admitter)));

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
                if let Err(e) = edge.persist() {
                    tracing::error!(error = %e, "cannot persist the slice");
                }
                edge.reconcile().await;
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
    Ok(())
}
