//! The edge's loop. It listens, then registers (with its proxy address and capacity: a
//! registered edge is asked to admit sandboxes at once), follows its slice, and
//! reconciles every 500 ms, on every burst of slice messages and whenever an action asks
//! (observe the backends, `plan`, act, report), then persists the slice in `edge.redb`
//! (acting first is safe: every action is idempotent, and an edge that dies before
//! persisting re-reads those events). Heartbeats every 2 s.

use super::backend::{Machines, VmsState, agent_addr};
use super::{Edge, EdgeConfig, EdgeError, WARM_IMAGES, adoption, store_err};
use crate::container::ContainerBackend;
use crate::container::warm::WarmPool;
use crate::images::ImageStore;
use crate::proxy::{self, Resolver};
use crate::reconcile::{
    Action, Running, plan, plan_imports, plan_oom, plan_packs, plan_pulls, plan_snapshots, plan_transfers,
};
use crate::slice::{SliceClient, SliceFollower};
use opendsec_edge_api::pb::HeartbeatRequest;
use redb::Database;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Container creations that may hold a blocking thread at once: enough to keep every
/// core busy with the parts that run in parallel (disks, layers, the agent's files)
/// while one at a time holds `create_lock`.
fn creation_slots() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get()) * 4
}

/// Runs the edge until `shutdown` resolves. Sandboxes keep running afterwards.
pub async fn run(mut cfg: EdgeConfig, shutdown: impl std::future::Future<Output = ()>) -> Result<(), EdgeError> {
    std::fs::create_dir_all(cfg.data_dir.join("agents"))?;
    let trust = match cfg.trust.clone() {
        Some(t) => t,
        None => {
            let (trust, key) = crate::identity::load_or_join(
                &cfg.data_dir,
                &cfg.name,
                &cfg.control_peer,
                &cfg.token,
                cfg.ca_pem.as_deref(),
                registration(&cfg),
            )
            .await?;
            cfg.edge_key = key;
            cfg.trust = Some(trust.clone());
            trust
        }
    };
    tokio::spawn(keep_renewed(trust.clone(), cfg.clone()));
    let agent_dir = super::agent::prepare_agent_dir(&cfg.data_dir, &cfg.agent_binary)?;
    let db = Database::create(cfg.data_dir.join("edge.redb")).map_err(store_err)?;
    let slice = adoption::saved_slice(&db, &cfg)?;
    let containers = ContainerBackend::new(cfg.container.clone())?;
    let images = ImageStore::open(&cfg.images_dir)?;
    let mut client = SliceClient::connect(&cfg.control_peer, &cfg.token, trust.clone())?;
    // The sandboxes' network before registering: an edge that cannot give one takes none.
    let net = match &cfg.network {
        None => None,
        Some(nc) => {
            // In the sandbox-files tmpfs (as the agent is): what a sandbox's mount table
            // shows of its /etc/resolv.conf and /etc/hosts names no host path.
            let files = agent_dir.parent().unwrap_or(&agent_dir).join("net");
            Some(crate::net::Network::open(nc, &cfg.name, &cfg.data_dir, &files)?)
        }
    };
    if let Some(net) = &net {
        // Networks of sandboxes still running stay; everything else of this edge's goes.
        let mut live: BTreeSet<String> = containers.list()?.into_iter().map(|h| h.id).collect();
        // MicroVMs, by their records (the driver is prepared later, beside the loop).
        for e in std::fs::read_dir(cfg.data_dir.join("vms").join("vms"))
            .into_iter()
            .flatten()
            .flatten()
        {
            live.insert(e.file_name().to_string_lossy().into_owned());
        }
        net.adopt(&live);
    }
    // Listening before registering: once registered, the edge is asked to admit
    // sandboxes and is sent their traffic.
    let listener = tokio::net::TcpListener::bind(&cfg.proxy_listen).await?;
    let registered_at = register(&mut client, &cfg).await;

    let next_index = slice.next_index;
    let machines = Machines::new(if cfg.microvm.is_some() {
        VmsState::Preparing
    } else {
        VmsState::Unavailable("it was started without microVM support".into())
    });
    let edge = Arc::new(Edge {
        trust: trust.clone(),
        renewing: Default::default(),
        containers,
        machines,
        images,
        db,
        slice: Mutex::new(slice),
        client: client.clone(),
        creating: Mutex::new(BTreeSet::new()),
        failed: Mutex::new(BTreeSet::new()),
        create_lock: Mutex::new(()),
        creation_slots: tokio::sync::Semaphore::new(creation_slots()),
        warm: WarmPool::new(cfg.warm_sandboxes, WARM_IMAGES),
        oom_seen: Mutex::new(BTreeMap::new()),
        oom_log: crate::container::oom::OomLog::follow(),
        warm_config: Mutex::new(BTreeMap::new()),
        agent_dir,
        snapshotting: Mutex::new(BTreeSet::new()),
        last_observed: Mutex::new(BTreeMap::new()),
        changing: Mutex::new(BTreeSet::new()),
        admitted: Mutex::new(BTreeMap::new()),
        reported: Mutex::new(BTreeMap::new()),
        wake: tokio::sync::Notify::new(),
        registered_at,
        resume_failures: Mutex::new(BTreeMap::new()),
        preparing: Mutex::new(BTreeSet::new()),
        import_locks: Mutex::new(BTreeMap::new()),
        image_gc: Default::default(),
        rt: tokio::runtime::Handle::current(),
        pulls: Default::default(),
        imports: Default::default(),
        metrics_history: crate::metrics_history::MetricsHistory::new(),
        net,
        detach_queue: Mutex::new(None),
        cfg,
    });
    // Warm containers a killed edge left are not claimable (their filler is gone).
    let e = edge.clone();
    let _ = tokio::task::spawn_blocking(move || e.discard_leftover_warm()).await;
    edge.start_machines();
    let proxy_task = tokio::spawn(edge.clone().serve_proxy(listener));
    let history_task = tokio::spawn(edge.clone().keep_metrics_history());
    let dns_task = edge.net.clone().map(|n| tokio::spawn(n.serve()));

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
            _ = heartbeat.tick() => edge.send_heartbeat().await,
        }
    }
    proxy_task.abort();
    history_task.abort();
    follower_task.abort();
    if let Some(t) = dns_task {
        t.abort();
    }
    // Sandboxes run on; warm containers and disks, which nothing uses yet, do not
    // outlive the edge.
    let e = edge.clone();
    let _ = tokio::task::spawn_blocking(move || {
        e.drain_warm();
        e.containers.drain_warm_disks();
        super::agent::release_agent_dir(&e.cfg.data_dir);
    })
    .await;
    Ok(())
}

/// Registers the edge, retrying until the control plane answers, and returns the log
/// index of this registration. Its labels say what it runs: microVMs, and full VMs where
/// the boot disk tools are installed.
/// What the edge registers as: its name, address, capacity and what it can do.
fn registration(cfg: &EdgeConfig) -> opendsec_edge_api::pb::RegisterRequest {
    let mut labels = BTreeMap::from([(opendsec_commands::ADMISSION_LABEL.to_string(), "http".to_string())]);
    if cfg.network.is_some() {
        labels.insert(opendsec_commands::EGRESS_LABEL.to_string(), "nftables".to_string());
    }
    if cfg.microvm.is_some() {
        labels.insert(opendsec_commands::MICROVM_LABEL.to_string(), "qemu".to_string());
        if crate::vm::host_can_build_boot_disks() {
            labels.insert(opendsec_commands::FULLVM_LABEL.to_string(), "q35".to_string());
        }
    }
    opendsec_edge_api::pb::RegisterRequest {
        edge: cfg.name.clone(),
        address: cfg.proxy_listen.clone(),
        capacity: Some(cfg.capacity),
        labels,
    }
}

/// A fresh certificate for this edge: a joined edge asks its control node (its current
/// certificate proves who asks); the embedded edge of `opendsec up`, whose trust holds
/// the CA of its process, issues it there.
async fn renew_certificate(trust: &opendsec_trust::Trust, cfg: &EdgeConfig) -> Result<(), String> {
    if trust.issuer().is_some() {
        trust.reissue().map_err(|e| e.to_string())?;
        tracing::info!(edge = %trust.identity().name, "certificate renewed from this process's CA");
        return Ok(());
    }
    crate::identity::renew(trust, &cfg.data_dir, &cfg.control_peer, &cfg.token)
        .await
        .map_err(|e| e.to_string())
}

/// Renews the edge's certificate when a third of its life is left (checked hourly, and
/// retried every minute after a failure).
async fn keep_renewed(trust: std::sync::Arc<opendsec_trust::Trust>, cfg: EdgeConfig) {
    let margin = Duration::from_secs(opendsec_trust::LEAF_DAYS as u64 * 86_400 / 3);
    loop {
        let due = trust
            .not_after()
            .and_then(|t| t.duration_since(std::time::SystemTime::now()).ok())
            .is_none_or(|left| left < margin);
        let wait = if !due {
            Duration::from_secs(3600)
        } else {
            match renew_certificate(&trust, &cfg).await {
                Ok(()) => Duration::from_secs(3600),
                Err(e) => {
                    tracing::warn!(error = %e, "cannot renew the edge's certificate yet");
                    Duration::from_secs(60)
                }
            }
        };
        tokio::time::sleep(wait).await;
    }
}

async fn register(client: &mut SliceClient, cfg: &EdgeConfig) -> u64 {
    let mut delay = Duration::from_millis(100);
    loop {
        let r = registration(cfg);
        match client
            .register(&r.edge, &r.address, r.capacity.unwrap_or(cfg.capacity), r.labels)
            .await
        {
            Ok((ordinal, index)) => {
                tracing::info!(edge = %cfg.name, ordinal, index, "registered");
                return index;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot register yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

impl Edge {
    /// Serves the per-sandbox proxy (`crate::proxy`) with the edge's hooks: where each
    /// agent listens, admission, metrics, logs, the transfers it serves, store
    /// collections and image uploads.
    async fn serve_proxy(self: Arc<Self>, listener: tokio::net::TcpListener) {
        let agents = self.cfg.data_dir.join("agents");
        let vm_root = self.cfg.data_dir.join("vms");
        let resolve: Resolver = Arc::new(move |id: &str| agent_addr(&agents, &vm_root, id));
        let sampled = self.clone();
        let sampler: proxy::Sampler = Arc::new(move |id| {
            let mut s = sampled.backend_of(id).sample(id, sampled.cfg.disk_bytes)?;
            s.network = sampled.net.as_ref().and_then(|n| n.sample(id));
            Some(s)
        });
        let reader = self.clone();
        let logs: proxy::LogReader = Arc::new(move |id, max| reader.backend_of(id).log(id, max));
        let kept = self.clone();
        // A sandbox this edge runs but has not sampled yet (under 10 s old) has an empty
        // history, not none.
        let history: proxy::HistoryReader = Arc::new(move |id, start, end| {
            kept.metrics_history.range(id, start, end).or_else(|| {
                let observed = kept.last_observed.lock().expect("observed lock");
                observed.contains_key(id).then(Vec::new)
            })
        });
        let (pusher, push_progress) = self.pusher();
        let hooks = proxy::Hooks {
            admitter: Some(self.admitter()),
            sampler: Some(sampler),
            logs: Some(logs),
            history: Some(history),
            transfers: Some(self.transfer_hooks()),
            prune: Some(self.pruner()),
            imports: Some(self.import_hooks()),
            push: Some(pusher),
            push_progress: Some(push_progress),
            settling: Some({
                let e = self.clone();
                Arc::new(move |id: &str, after: Option<u64>| e.settling(id, after))
            }),
        };
        proxy::serve_with(listener, self.trust.clone(), self.cfg.edge_key.clone(), resolve, hooks).await
    }

    /// Samples every running sandbox each `metrics_history::INTERVAL` into
    /// `metrics_history`, going by the last observation: sandboxes gone from it are
    /// forgotten, paused ones keep their points.
    async fn keep_metrics_history(self: Arc<Self>) {
        let mut every = tokio::time::interval(crate::metrics_history::INTERVAL);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let e = self.clone();
            let _ = tokio::task::spawn_blocking(move || {
                let observed = e.last_observed.lock().expect("observed lock").clone();
                let running = |id: &str| matches!(observed.get(id), Some(Running::Running));
                e.metrics_history.retain(
                    |id| matches!(observed.get(id), Some(Running::Running | Running::Paused { .. })),
                    running,
                );
                for id in observed.keys().filter(|id| running(id)) {
                    if let Some(sample) = e.backend_of(id).sample(id, e.cfg.disk_bytes) {
                        e.metrics_history.record(id, opendsec_edge_api::now_ms(), &sample);
                    }
                }
            })
            .await;
        }
    }

    /// One round: observe, plan, act.
    async fn reconcile(self: &Arc<Self>) {
        // One snapshot of the creations under way, taken before observing, serves both
        // the observation and the plan, so a creation that ends in between is not
        // mistaken for a missing sandbox.
        let creating = self.creating.lock().expect("creating lock").clone();
        // Policies first: a changed one is enforced without waiting for the observation.
        let stale = self.stale_networks(&creating);
        if !stale.is_empty() {
            let e = self.clone();
            let _ = tokio::task::spawn_blocking(move || e.apply_networks(stale)).await;
        }
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
        // The images in use are published before a create of them starts.
        let e = self.clone();
        let _ = tokio::task::spawn_blocking(move || e.image_gc_round()).await;
        let actions = self.plan(&observed);
        self.sweep_imports(&observed);
        let mut changed = false;
        for a in actions {
            if let Action::Create { id } = &a
                && creating.contains(id)
            {
                continue;
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

    /// What to do about the slice given what runs here: sandboxes, snapshots, transfers.
    fn plan(&self, observed: &BTreeMap<String, crate::reconcile::Running>) -> Vec<Action> {
        let present = self.present_snapshots();
        let served = self.present_transfers();
        let preparing = self.preparing.lock().expect("preparing lock").clone();
        let slice = self.slice.lock().expect("slice lock");
        let containers_only = self.slice_while_preparing(&slice);
        let slice = containers_only.as_ref().unwrap_or(&slice);
        let caught_up = slice.next_index > self.registered_at;
        let mut a = plan(slice, observed, opendsec_edge_api::now_ms(), caught_up);
        a.extend(plan_oom(slice, &self.oom_seen.lock().expect("oom lock")));
        a.extend(plan_snapshots(slice, observed, &present));
        let under_way = self.pulls.names();
        a.extend(plan_pulls(slice, &under_way));
        a.extend(plan_packs(slice, observed, &under_way));
        let overdue = self.imports.overdue(&slice.imports, &under_way);
        a.extend(plan_imports(slice, &under_way, |name| overdue.contains(name)));
        a.extend(
            plan_transfers(slice, observed, &served)
                .into_iter()
                .filter(|x| !matches!(x, Action::MakeTransfer { id } if preparing.contains(id))),
        );
        a
    }

    async fn send_heartbeat(&self) {
        let hb = self.heartbeat();
        let mut c = self.client.clone();
        match c.heartbeat(hb).await {
            Err(e) => tracing::debug!(error = %e, "heartbeat failed"),
            // The cluster's certificates were rotated after this edge's was issued: it
            // renews its own (new connections present the new one).
            Ok(rotated) if crate::identity::must_renew(&self.trust, rotated) => {
                use std::sync::atomic::Ordering;
                if self.renewing.swap(true, Ordering::AcqRel) {
                    return;
                }
                let (trust, cfg, renewing) = (self.trust.clone(), self.cfg.clone(), self.renewing.clone());
                tokio::spawn(async move {
                    if let Err(e) = renew_certificate(&trust, &cfg).await {
                        tracing::warn!(error = %e, "cannot renew the edge's certificate after a rotation yet");
                    }
                    renewing.store(false, Ordering::Release);
                });
            }
            Ok(_) => {}
        }
    }

    fn heartbeat(&self) -> HeartbeatRequest {
        let slice = self.slice.lock().expect("slice lock");
        let live: Vec<&crate::desired::DesiredSandbox> =
            slice.sandboxes.values().filter(|s| !s.is_terminal()).collect();
        HeartbeatRequest {
            edge: self.cfg.name.clone(),
            running_sandboxes: live.len() as u64,
            cpu_millis_used: live.iter().map(|s| s.cpu_millis).sum(),
            memory_mb_used: live.iter().map(|s| s.memory_mb).sum(),
            pulls: self.pulls.progress(),
        }
    }
}
