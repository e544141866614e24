//! `ControlNode`: one member of the control plane. Writes are decided on the leader
//! against the applied state plus the in-flight overlay, proposed to the Raft log and
//! answered once applied; a follower forwards them to the leader. Reads are served
//! from the locally applied state.

use crate::admission::AdmitRequest;
use crate::forward::Forwarder;
use crate::fsm::{Checkpoints, Fsm};
use crate::pb::SubmitRequest;
use crate::{Credential, Principal, now_ms};
use opendsec_commands::{
    ADMISSION_LABEL, Caller, Command, Ctx, Decided, InFlight, Rejection, RejectionKind, batch_for, decide_excluding,
};
use opendsec_log::{LogConfig, LogNode, ProposeError};
use opendsec_projections::Event;
use opendsec_projections::replay::{Until, fold};
use opendsec_projections::schema::{self, Batch};
use opendsec_projections::{Isolation, Outcome, State};
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What [`ControlNode::authenticate`] says of a token this node does not hold (or whose
/// secret does not match): a follower that has not applied its issue yet says the same.
pub const UNKNOWN_TOKEN: &str = "the token is unknown";

/// How a control node is set up.
#[derive(Clone, Debug)]
pub struct ControlConfig {
    pub node_id: u64,
    pub data_dir: PathBuf,
    /// This node's peer (gRPC) address as other nodes reach it.
    pub peer_addr: String,
    /// Shared by the nodes of one cluster, never sent: edges' own keys derive from it.
    pub cluster_key: String,
    /// This node's certificate (a control node's) and the cluster CA, whose key control
    /// nodes hold to sign edges' certificates at join.
    pub trust: Arc<opendsec_trust::Trust>,
    /// A replay checkpoint every this many log entries.
    pub checkpoint_every: u64,
    /// Raft snapshot (and log compaction into the archive) every this many entries.
    pub snapshot_every: u64,
    /// Entries kept in the live log after a snapshot (older ones move to the archive).
    pub keep_after_snapshot: u64,
    /// How many archived entries to keep (`None`: all of them).
    pub archive_retention: Option<u64>,
    /// How often the replay checkpoints the retained history has outlived are dropped.
    pub checkpoint_prune_every: Duration,
}

impl ControlConfig {
    pub fn new(
        node_id: u64,
        data_dir: impl Into<PathBuf>,
        peer_addr: impl Into<String>,
        cluster_key: impl Into<String>,
        trust: Arc<opendsec_trust::Trust>,
    ) -> Self {
        ControlConfig {
            node_id,
            data_dir: data_dir.into(),
            peer_addr: peer_addr.into(),
            cluster_key: cluster_key.into(),
            trust,
            checkpoint_every: 10_000,
            snapshot_every: 100_000,
            keep_after_snapshot: 1_000,
            archive_retention: None,
            checkpoint_prune_every: Duration::from_secs(60),
        }
    }
}

/// A write's accepted result.
#[derive(Clone, Debug)]
pub struct Submitted {
    pub index: u64,
    pub decided: Decided,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The command was refused; `index` is set when the refusal was logged.
    #[error("{rejection}")]
    Rejected { rejection: Rejection, index: Option<u64> },
    /// No leader could be reached, or the outcome is unknown because leadership changed.
    #[error("control plane unavailable: {0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<Rejection> for SubmitError {
    fn from(rejection: Rejection) -> Self {
        SubmitError::Rejected { rejection, index: None }
    }
}

/// What `GET /v1/cluster` shows.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterStatus {
    pub node_id: u64,
    pub leader_id: Option<u64>,
    pub is_leader: bool,
    pub term: u64,
    pub last_log_index: u64,
    pub applied_index: u64,
    pub first_available_index: u64,
    pub members: BTreeMap<u64, String>,
    pub voters: BTreeSet<u64>,
    pub state_hash: String,
}

/// An edge's soft state: held in memory by the node it reports to, never logged (invariant 3).
#[derive(Clone, Debug, Serialize)]
pub struct EdgeHeartbeat {
    pub edge: String,
    pub at_ms: u64,
    pub running_sandboxes: u64,
    pub cpu_millis_used: u64,
    pub memory_mb_used: u64,
    /// Pulls under way on the edge.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub pulls: Vec<PullProgress>,
}

/// How far one image pull on an edge has come (from its last heartbeat).
#[derive(Clone, Debug, Serialize)]
pub struct PullProgress {
    pub name: String,
    pub layers_total: u32,
    pub layers_done: u32,
    pub bytes_total: u64,
    pub bytes_done: u64,
    pub phase: String,
    pub started_ms: u64,
}

impl From<opendsec_edge_api::pb::ImagePull> for PullProgress {
    fn from(p: opendsec_edge_api::pb::ImagePull) -> Self {
        PullProgress {
            name: p.name,
            layers_total: p.layers_total,
            layers_done: p.layers_done,
            bytes_total: p.bytes_total,
            bytes_done: p.bytes_done,
            phase: p.phase,
            started_ms: p.started_ms,
        }
    }
}

/// How long a node that confirmed it is current serves tokens' authority before it
/// confirms again (the most a revocation or a partition can go unseen on a node that has
/// not applied it).
pub const CURRENT_LEASE: Duration = Duration::from_millis(500);
/// How long confirming may take before the node refuses, and how long a failed
/// confirmation is remembered (so callers fail fast, not one timeout each).
pub const CONFIRM_TIMEOUT: Duration = Duration::from_secs(2);
/// The wait before a leader tries again a quorum round that fell short.
const CONFIRM_RETRY: Duration = Duration::from_millis(50);
const FAILED_REMEMBERED: Duration = Duration::from_millis(250);

/// What this node last learnt of being current.
enum Currency {
    Unknown,
    /// Current until then.
    Until(tokio::time::Instant),
    /// Could not confirm; said again until then.
    Failed(tokio::time::Instant, String),
}

struct Inner {
    log: LogNode<Fsm>,
    rates: crate::rates::RateLimiter,
    currency: tokio::sync::Mutex<Currency>,
    /// A gRPC channel to the leader's peer port, for read indexes.
    leader_channel: Mutex<Option<(String, tonic::transport::Channel)>>,
    cfg: ControlConfig,
    inflight: Arc<Mutex<InFlight>>,
    checkpoints: Checkpoints,
    /// Forwarding connections, per leader address.
    forwarders: Mutex<BTreeMap<String, Forwarder>>,
    heartbeats: Mutex<BTreeMap<String, EdgeHeartbeat>>,
    /// This node's client of edges' proxies (admission), as its control node.
    edges: opendsec_http::Client,
    /// The certificate of this node's gateway (its own identity, from the same CA).
    gateway_trust: Arc<opendsec_trust::Trust>,
    /// When this node last rotated its certificates (ms; 0: not since it started), told
    /// to edges with each heartbeat reply.
    rotated_at_ms: std::sync::atomic::AtomicU64,
}

#[derive(Clone)]
pub struct ControlNode {
    inner: Arc<Inner>,
}

/// Keeps the checkpoint file as long as the retained history: every
/// [`ControlConfig::checkpoint_prune_every`], the checkpoints before the one a replay of
/// the oldest retained entry starts from go ([`Checkpoints::prune_before`]). Ends with
/// the node.
async fn prune_checkpoints(inner: std::sync::Weak<Inner>) {
    loop {
        let every = match inner.upgrade() {
            Some(inner) => inner.cfg.checkpoint_prune_every,
            None => return,
        };
        tokio::time::sleep(every).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let (log, checkpoints) = (inner.log.clone(), inner.checkpoints.clone());
        drop(inner);
        let pruned = tokio::task::spawn_blocking(move || {
            let first = log.first_available_index().map_err(|e| e.to_string())?;
            checkpoints.prune_before(first).map_err(|e| e.to_string())
        })
        .await;
        match pruned {
            Ok(Ok(0)) => {}
            Ok(Ok(n)) => tracing::info!(
                checkpoints = n,
                "pruned replay checkpoints older than the retained history"
            ),
            Ok(Err(e)) => tracing::warn!(error = %e, "could not prune replay checkpoints"),
            Err(e) => tracing::warn!(error = %e, "the checkpoint pruning task failed"),
        }
    }
}

fn internal(e: impl std::fmt::Display) -> SubmitError {
    SubmitError::Internal(e.to_string())
}

impl ControlNode {
    /// Opens (or creates) the node's data directory and starts its Raft member.
    pub async fn open(cfg: ControlConfig) -> Result<ControlNode, SubmitError> {
        std::fs::create_dir_all(&cfg.data_dir).map_err(internal)?;
        let checkpoints = Checkpoints::open(&cfg.data_dir.join("checkpoints.redb")).map_err(internal)?;
        let inflight = Arc::new(Mutex::new(InFlight::new()));
        let fsm = Fsm::new(cfg.checkpoint_every, Some(&checkpoints), Some(inflight.clone()));
        let mut log_cfg = LogConfig::new(
            cfg.node_id,
            cfg.data_dir.join("log"),
            cfg.peer_addr.clone(),
            cfg.trust.clone(),
        );
        log_cfg.snapshot_every = cfg.snapshot_every;
        log_cfg.archive_retention = cfg.archive_retention;
        log_cfg.keep_after_snapshot = cfg.keep_after_snapshot;
        let log = LogNode::open(log_cfg, fsm).await.map_err(internal)?;
        // The gateway gets a certificate of its own where the node holds the CA.
        let gateway_trust = match cfg.trust.sibling(opendsec_trust::Identity::gateway(cfg.node_id)) {
            Ok(t) => Arc::new(t),
            Err(_) => cfg.trust.clone(),
        };
        let edges = crate::admission::client(cfg.trust.clone());
        let node = ControlNode {
            inner: Arc::new(Inner {
                log,
                cfg,
                inflight,
                checkpoints,
                forwarders: Mutex::new(BTreeMap::new()),
                heartbeats: Mutex::new(BTreeMap::new()),
                currency: tokio::sync::Mutex::new(Currency::Unknown),
                rates: Default::default(),
                leader_channel: Mutex::new(None),
                edges,
                gateway_trust,
                rotated_at_ms: Default::default(),
            }),
        };
        tokio::spawn(prune_checkpoints(Arc::downgrade(&node.inner)));
        Ok(node)
    }

    pub fn log(&self) -> &LogNode<Fsm> {
        &self.inner.log
    }

    pub fn config(&self) -> &ControlConfig {
        &self.inner.cfg
    }

    /// Makes this node (with `members`) a cluster. Harmless if it already is one.
    pub async fn initialize(&self, members: BTreeMap<u64, String>) -> Result<(), SubmitError> {
        self.inner.log.initialize(members).await.map_err(internal)
    }

    /// Reads the locally applied state.
    pub fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        self.inner.log.with_state(|fsm| f(&fsm.state))
    }

    pub fn applied_index(&self) -> u64 {
        self.read(|s| s.index)
    }

    /// Waits until this node has applied `index` (read-your-writes on any node).
    pub async fn wait_applied(&self, index: u64, timeout: Duration) -> Result<(), SubmitError> {
        self.inner
            .log
            .wait_applied(index, timeout)
            .await
            .map_err(|e| SubmitError::Unavailable(e.to_string()))
    }

    /// Checks a bearer token (`odsec_<id>.<secret>`) against the IAM view.
    pub fn authenticate(&self, bearer: &str) -> Result<Principal, Rejection> {
        let unauth = |m: &str| Rejection::new(RejectionKind::Unauthenticated, m);
        let (id, secret) = crate::split_bearer(bearer).ok_or_else(|| {
            unauth("the token is not an OpenDsec token (odsec_<id>.<secret>) nor an E2B key (e2b_ + 40 hex)")
        })?;
        let hash = hex::encode(Sha256::digest(secret.as_bytes()));
        let now = now_ms();
        self.read(|s| {
            let t = s.iam.tokens.get(id).ok_or_else(|| unauth(UNKNOWN_TOKEN))?;
            if !constant_time_eq(t.secret_sha256.as_bytes(), hash.as_bytes()) {
                return Err(unauth(UNKNOWN_TOKEN));
            }
            if t.revoked.is_some() {
                return Err(unauth("the token was revoked"));
            }
            if t.expires_at_ms.is_some_and(|e| now >= e) {
                return Err(unauth("the token has expired"));
            }
            Ok(Principal {
                token_id: t.id.clone(),
                project: t.project.clone(),
                rights: t.rights.clone(),
                expires_at_ms: t.expires_at_ms,
                bearer: bearer.to_string(),
            })
        })
    }

    /// Confirms that this node is current before it serves `bearer`'s authority: the
    /// leader by its lease (else a quorum round); a follower by the leader's read index,
    /// which the leader answers only for a token it still accepts, applied here. Once
    /// confirmed, the node serves for [`CURRENT_LEASE`] before it confirms again; a node
    /// that cannot (partitioned, no leader, far behind) refuses as unavailable rather than
    /// serve authority that may have been revoked.
    pub async fn confirm_current(&self, bearer: &str) -> Result<(), SubmitError> {
        let mut currency = self.inner.currency.lock().await;
        let now = tokio::time::Instant::now();
        match &*currency {
            Currency::Until(t) if now < *t => return Ok(()),
            Currency::Failed(t, why) if now < *t => return Err(SubmitError::Unavailable(why.clone())),
            _ => {}
        }
        match self.confirm_round(bearer).await {
            Ok(()) => {
                *currency = Currency::Until(now + CURRENT_LEASE);
                Ok(())
            }
            // The leader refused this token: say so; the node itself is not in doubt.
            Err(e @ SubmitError::Rejected { .. }) => Err(e),
            Err(e) => {
                let why = format!("this node cannot confirm it is current ({e}); retry, or ask another node");
                tracing::warn!(%why, "refusing to serve until current");
                *currency = Currency::Failed(tokio::time::Instant::now() + FAILED_REMEMBERED, why.clone());
                Err(SubmitError::Unavailable(why))
            }
        }
    }

    /// Catches up with the leader now (a read index round, whatever the lease), for a
    /// token this node does not hold yet: Ok once this node has applied what the leader
    /// had when it accepted `bearer`; Err if the leader does not accept it either.
    pub async fn catch_up_for(&self, bearer: &str) -> Result<(), SubmitError> {
        self.confirm_round(bearer).await
    }

    async fn confirm_round(&self, bearer: &str) -> Result<(), SubmitError> {
        let l = self.inner.log.leadership();
        if l.is_leader {
            // A round that falls short of a quorum (a follower busy for a moment: a
            // snapshot, a slow disk) is tried again until the timeout: a leader that
            // cannot confirm yet is not one cut off, and failing at once would refuse
            // every caller for a while.
            let deadline = tokio::time::Instant::now() + CONFIRM_TIMEOUT;
            loop {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                match self.inner.log.read_index(left).await {
                    Ok(_) => return Ok(()),
                    Err(e) => {
                        let again = tokio::time::Instant::now() + CONFIRM_RETRY;
                        if again >= deadline || !self.inner.log.leadership().is_leader {
                            return Err(SubmitError::Unavailable(e.to_string()));
                        }
                        tokio::time::sleep_until(again).await;
                    }
                }
            }
        }
        let addr = l
            .leader_addr
            .ok_or_else(|| SubmitError::Unavailable("no leader is known".into()))?;
        let channel = {
            let mut cached = self.inner.leader_channel.lock().unwrap();
            match cached.as_ref() {
                Some((a, c)) if *a == addr => c.clone(),
                _ => {
                    let c = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                        .map_err(|e| SubmitError::Unavailable(format!("leader address {addr}: {e}")))?
                        .connect_timeout(CONFIRM_TIMEOUT)
                        .timeout(CONFIRM_TIMEOUT)
                        .connect_with_connector_lazy(opendsec_trust::tls_connector(
                            self.inner.cfg.trust.clone(),
                            opendsec_trust::Expect::Role(opendsec_trust::Role::Control),
                        ));
                    *cached = Some((addr.clone(), c.clone()));
                    c
                }
            }
        };
        let mut client = crate::pb::control_client::ControlClient::new(channel);
        let asked = client.read_index(crate::pb::ReadIndexRequest {
            bearer: bearer.to_string(),
        });
        let reply = match tokio::time::timeout(CONFIRM_TIMEOUT, asked).await {
            Err(_) => {
                return Err(SubmitError::Unavailable(format!(
                    "the leader at {addr} did not answer within {} s",
                    CONFIRM_TIMEOUT.as_secs()
                )));
            }
            Ok(Err(s)) if s.code() == tonic::Code::Unauthenticated => {
                return Err(Rejection::new(RejectionKind::Unauthenticated, s.message()).into());
            }
            Ok(Err(s)) => {
                return Err(SubmitError::Unavailable(format!(
                    "the leader at {addr}: {}",
                    s.message()
                )));
            }
            Ok(Ok(r)) => r.into_inner(),
        };
        self.wait_applied(reply.index, CONFIRM_TIMEOUT).await
    }

    /// Decides `cmd` on the leader (forwarding there if needed), logs it and returns
    /// once it was applied on the node that decided.
    pub async fn submit(&self, cred: Credential, request_id: String, cmd: Command) -> Result<Submitted, SubmitError> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let leader = match self.submit_here(&cred, &request_id, &cmd).await {
                Err(NotHere::Leader(addr)) => addr,
                Err(NotHere::Failed(e)) => return Err(e),
                Ok(s) => return Ok(s),
            };
            match (leader, &cred) {
                (Some(addr), Credential::Bearer(bearer)) => {
                    match self.forward(&addr, bearer, &request_id, &cmd).await {
                        Err(SubmitError::Unavailable(m)) if tokio::time::Instant::now() < deadline => {
                            tracing::debug!(leader = %addr, error = %m, "forwarding failed; retrying");
                        }
                        other => return other,
                    }
                }
                (Some(_), Credential::System) => {
                    return Err(SubmitError::Unavailable(
                        "system commands run on the leader only".into(),
                    ));
                }
                (None, _) if tokio::time::Instant::now() < deadline => {}
                (None, _) => {
                    return Err(SubmitError::Unavailable(
                        "no leader is elected; check that a majority of the nodes run".into(),
                    ));
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn submit_here(&self, cred: &Credential, request_id: &str, cmd: &Command) -> Result<Submitted, NotHere> {
        let leadership = self.inner.log.leadership();
        if !leadership.is_leader {
            return Err(NotHere::Leader(leadership.leader_addr));
        }
        let principal = match cred {
            Credential::System => None,
            Credential::Bearer(b) => Some(self.authenticate(b).map_err(|r| NotHere::Failed(r.into()))?),
        };
        let caller = match &principal {
            None => Caller::System,
            Some(p) => Caller::Token(p.token_id.clone()),
        };
        let ctx = Ctx {
            time_ms: now_ms(),
            seed: rand::random(),
            request_id: request_id.to_string(),
            caller,
        };
        // A retry of a request the log already holds (a client's, or a follower's after
        // an outcome it could not learn) gets that request's outcome, not a second one.
        let digest = opendsec_commands::request_digest(cmd, &ctx);
        if let Some(first) = self.read(|s| s.requests.applied(request_id, &digest)) {
            return self.first_outcome(first).map_err(NotHere::Failed);
        }
        if let Some(p) = &principal {
            self.read(|s| self.inner.rates.admit_write(s, &p.project, &p.token_id, cmd))
                .map_err(|r| NotHere::Failed(r.into()))?;
        }
        // Decide; if an edge chosen for a new sandbox refuses it at admission, decide
        // again without that edge (each edge has the final word on what it runs).
        let mut refused_by = BTreeSet::new();
        let (batch, decided, ticket) = loop {
            let (batch, decided, ticket) = self.inner.log.with_state(|fsm| {
                // Same lock order as apply: the state, then the overlay.
                let mut inflight = self.inner.inflight.lock().expect("inflight lock");
                let decided = decide_excluding(&fsm.state, &inflight, cmd, &ctx, &refused_by);
                let batch = batch_for(cmd, &ctx, &fsm.state, &decided);
                let ticket = match (&batch, &decided) {
                    (Some(_), Ok(d)) => Some(inflight.reserve_as(ctx.seed, &fsm.state, &d.events)),
                    _ => None,
                };
                (batch, decided, ticket)
            });
            match self.refusing_edge(decided.as_ref().ok()).await {
                Some(edge) => {
                    if let Some(t) = ticket {
                        self.inner.inflight.lock().expect("inflight lock").release(t);
                    }
                    refused_by.insert(edge);
                }
                None => break (batch, decided, ticket),
            }
        };
        let Some(batch) = batch else {
            // Bad input: refused without touching the log.
            return Err(NotHere::Failed(decided.expect_err("only refusals go unlogged").into()));
        };
        let result = self.inner.log.propose(schema::encode_batch(&batch)).await;
        if let Some(t) = ticket {
            self.inner.inflight.lock().expect("inflight lock").release(t);
        }
        let applied = match result {
            Ok(a) => a,
            Err(ProposeError::ForwardToLeader { leader_addr, .. }) => return Err(NotHere::Leader(leader_addr)),
            Err(e @ ProposeError::Unknown { .. }) => {
                return Err(NotHere::Failed(SubmitError::Unavailable(format!(
                    "{e}; look for request id {request_id} in the audit view before retrying"
                ))));
            }
            Err(e) => return Err(NotHere::Failed(SubmitError::Unavailable(e.to_string()))),
        };
        let outcome: Outcome = serde_json::from_slice(&applied.response).map_err(|e| NotHere::Failed(internal(e)))?;
        match (outcome, decided) {
            (Outcome::Applied { index }, Ok(decided)) => Ok(Submitted { index, decided }),
            (Outcome::Denied { index, .. }, Err(rejection)) => Err(NotHere::Failed(SubmitError::Rejected {
                rejection,
                index: Some(index),
            })),
            (Outcome::Rejected { index, message }, _) => Err(NotHere::Failed(SubmitError::Rejected {
                rejection: Rejection::new(RejectionKind::Conflict, format!("lost a race when applied: {message}")),
                index: Some(index),
            })),
            (Outcome::Duplicate { first, .. }, _) => self.first_outcome(first).map_err(NotHere::Failed),
            (o, _) => Err(NotHere::Failed(internal(format!(
                "the log applied an unexpected outcome {o:?}"
            )))),
        }
    }

    /// The outcome of the request whose batch is at `index` (applied or denied), as its
    /// submitter got it.
    fn first_outcome(&self, index: u64) -> Result<Submitted, SubmitError> {
        let (_, batch) = self
            .read_batches(index, index)?
            .into_iter()
            .next()
            .ok_or_else(|| internal(format!("the log has no entry {index}")))?;
        if let Some(d) = batch.denial {
            let kind = RejectionKind::from_code(&d.code).unwrap_or(RejectionKind::Conflict);
            let mut rejection = Rejection::new(kind, d.message);
            rejection.field = (!d.field.is_empty()).then_some(d.field);
            return Err(SubmitError::Rejected {
                rejection,
                index: Some(index),
            });
        }
        let events = schema::batch_events(&batch).map_err(internal)?;
        Ok(Submitted {
            index,
            decided: Decided {
                events,
                project: batch.project,
                target: batch.target,
            },
        })
    }

    /// The first edge that refuses a sandbox `decided` places on it, if any. Only edges
    /// labelled as answering admission are asked; an edge that does not answer refuses.
    async fn refusing_edge(&self, decided: Option<&Decided>) -> Option<String> {
        let decided = decided?;
        let asks: Vec<(String, String, AdmitRequest)> = self.read(|s| {
            decided
                .events
                .iter()
                .filter_map(|ev| match ev {
                    Event::SandboxCreated(c) => {
                        let edge = s.placement.edges.get(&c.edge)?;
                        if edge.labels.get(ADMISSION_LABEL).map(String::as_str) != Some("http") {
                            return None;
                        }
                        // `decide` wrote it from a typed isolation, so it always parses.
                        let isolation = Isolation::from_event(&c.isolation)?;
                        Some((
                            c.edge.clone(),
                            edge.address.clone(),
                            AdmitRequest {
                                sandbox: c.id.clone(),
                                cpu_millis: c.cpu_millis,
                                memory_mb: c.memory_mb,
                                isolation,
                            },
                        ))
                    }
                    _ => None,
                })
                .collect()
        });
        for (edge, address, req) in asks {
            let key = self.edge_key(&edge);
            if let Err(why) = crate::admission::ask(&self.inner.edges, &edge, &address, &key, &req).await {
                tracing::info!(%edge, sandbox = %req.sandbox, %why, "edge refused a sandbox at admission; placing it again");
                return Some(edge);
            }
        }
        None
    }

    async fn forward(
        &self,
        leader: &str,
        bearer: &str,
        request_id: &str,
        cmd: &Command,
    ) -> Result<Submitted, SubmitError> {
        let req = SubmitRequest {
            bearer: bearer.to_string(),
            request_id: request_id.to_string(),
            command_json: serde_json::to_string(cmd).map_err(internal)?,
        };
        // A broken connection is replaced by the next write (see `forwarder`).
        let reply = self
            .forwarder(leader)
            .submit(req)
            .await
            .map_err(|e| SubmitError::Unavailable(e.to_string()))?;
        crate::peer::reply_to_result(reply)
    }

    /// The forwarding connection to `addr`, opened on first use and again after it broke.
    fn forwarder(&self, addr: &str) -> Forwarder {
        let mut forwarders = self.inner.forwarders.lock().expect("forwarders lock");
        if let Some(f) = forwarders.get(addr).filter(|f| !f.is_closed()) {
            return f.clone();
        }
        let f = Forwarder::new(addr.to_string(), self.inner.cfg.trust.clone());
        forwarders.insert(addr.to_string(), f.clone());
        f
    }

    /// Rebuilds the state as it was at `until`, from the newest checkpoint before it.
    pub async fn replay(&self, until: Until) -> Result<State, SubmitError> {
        // The log's applied index bounds what `read_entries` returns.
        let applied = self.inner.log.applied_index().borrow().unwrap_or(0);
        let (from, last) = match until {
            Until::Index(i) => (
                self.inner.checkpoints.at_or_before_index(i).map_err(internal)?,
                i.min(applied),
            ),
            Until::Time(t) => (self.inner.checkpoints.at_or_before_time(t).map_err(internal)?, applied),
        };
        let from = from.unwrap_or_default();
        let start = from.index + 1;
        if start > last {
            return Ok(from);
        }
        let log = self.inner.log.clone();
        tokio::task::spawn_blocking(move || {
            let first = log.first_available_index().map_err(internal)?;
            if start < first {
                return Err(SubmitError::Rejected {
                    rejection: Rejection::field(
                        RejectionKind::NotFound,
                        "to",
                        format!("history before index {first} is no longer retained and no checkpoint covers it"),
                    ),
                    index: None,
                });
            }
            let mut state = from;
            let mut next = start;
            while next <= last {
                let chunk_end = (next + 9_999).min(last);
                let entries = log.read_entries(next, chunk_end).map_err(internal)?;
                let before = state.index;
                state = fold(state, entries.iter().map(|(i, b)| (*i, b.as_slice())), until).0;
                if matches!(until, Until::Time(_)) && state.index == before && !entries.is_empty() {
                    break; // passed the target time
                }
                next = chunk_end + 1;
            }
            Ok(state)
        })
        .await
        .map_err(internal)?
    }

    pub fn cluster_status(&self) -> ClusterStatus {
        let s = self.inner.log.status();
        ClusterStatus {
            node_id: s.node_id,
            leader_id: s.leader_id,
            is_leader: s.is_leader,
            term: s.current_term,
            last_log_index: s.last_log_index.unwrap_or(0),
            applied_index: s.last_applied.unwrap_or(0),
            first_available_index: s.first_available_index,
            members: s.membership,
            voters: s.voters,
            state_hash: self.read(|st| st.hash()),
        }
    }

    /// Adds a node as a voter (it first catches up as a learner). The change is authorised
    /// and audited through the log first, then carried out by this node (the leader).
    pub async fn add_member(
        &self,
        cred: Credential,
        request_id: String,
        id: u64,
        addr: String,
    ) -> Result<(), SubmitError> {
        self.submit(
            cred,
            request_id,
            Command::AddClusterMember {
                node_id: id,
                address: addr.clone(),
            },
        )
        .await?;
        let log = &self.inner.log;
        log.add_learner(id, addr)
            .await
            .map_err(|e| SubmitError::Unavailable(e.to_string()))?;
        let mut voters = log.status().voters;
        voters.insert(id);
        log.change_membership(voters)
            .await
            .map_err(|e| SubmitError::Unavailable(e.to_string()))
    }

    /// Removes a node from the cluster, audited through the log first. Leader only.
    pub async fn remove_member(&self, cred: Credential, request_id: String, id: u64) -> Result<(), SubmitError> {
        self.submit(cred, request_id, Command::RemoveClusterMember { node_id: id })
            .await?;
        self.inner
            .log
            .remove_node(id)
            .await
            .map_err(|e| SubmitError::Unavailable(e.to_string()))
    }

    pub fn record_heartbeat(&self, hb: EdgeHeartbeat) {
        self.inner
            .heartbeats
            .lock()
            .expect("heartbeats lock")
            .insert(hb.edge.clone(), hb);
    }

    pub fn edge_heartbeats(&self) -> Vec<EdgeHeartbeat> {
        self.inner
            .heartbeats
            .lock()
            .expect("heartbeats lock")
            .values()
            .cloned()
            .collect()
    }

    /// Edge `edge`'s own key (see [`crate::edge_key`]): what this node sends it, and what
    /// its sandboxes' tokens and its transfers are keyed with.
    pub fn edge_key(&self, edge: &str) -> String {
        crate::edge_key(&self.inner.cfg.cluster_key, edge)
    }

    /// A sandbox's access token of `kind` (see [`crate::sandbox_token`]), under its edge's
    /// key: the edge of the views, or for one swept from them, of the ordinal in its id.
    pub fn sandbox_token(&self, kind: crate::SandboxTokenKind, sandbox: &str) -> String {
        let edge = self.read(|s| s.sandbox_edge(sandbox).unwrap_or_default().to_string());
        crate::sandbox_token(&self.edge_key(&edge), kind, sandbox)
    }

    /// This node's certificate and the cluster CA.
    pub fn trust(&self) -> &Arc<opendsec_trust::Trust> {
        &self.inner.cfg.trust
    }

    /// The certificate this node's gateway reaches edges with.
    pub fn gateway_trust(&self) -> &Arc<opendsec_trust::Trust> {
        &self.inner.gateway_trust
    }

    /// A fresh key and certificate for this node and its gateway, from the CA it holds:
    /// connections opened from now on present them, open ones keep theirs (no downtime).
    /// Edges hear of it with their next heartbeat's reply and renew theirs. Returns when
    /// the node's new certificate expires (ms).
    pub fn rotate_certificates_here(&self) -> Result<u64, String> {
        let trust = &self.inner.cfg.trust;
        let ca = trust
            .issuer()
            .ok_or_else(|| format!("node {} does not hold the cluster CA", self.inner.cfg.node_id))?;
        trust.reissue().map_err(|e| e.to_string())?;
        if !Arc::ptr_eq(&self.inner.gateway_trust, trust) {
            let id = self.inner.gateway_trust.identity().clone();
            let issued = ca.issue(&id).map_err(|e| e.to_string())?;
            self.inner.gateway_trust.install(&issued).map_err(|e| e.to_string())?;
        }
        self.inner
            .rotated_at_ms
            .store(now_ms(), std::sync::atomic::Ordering::Relaxed);
        let not_after = trust
            .not_after()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64);
        tracing::info!(node = self.inner.cfg.node_id, "certificates rotated");
        Ok(not_after)
    }

    /// When this node last rotated its certificates (ms; 0: not since it started).
    pub fn certificates_rotated_at_ms(&self) -> u64 {
        self.inner.rotated_at_ms.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Rotates the certificates of every member of the cluster (this node's here, the
    /// others' over the peer port): per member, its new certificate's expiry (ms) or why
    /// it was not rotated.
    pub async fn rotate_certificates(&self) -> Vec<(u64, Result<u64, String>)> {
        let me = self.inner.cfg.node_id;
        let mut out = Vec::new();
        for (id, addr) in self.cluster_status().members {
            if id == me {
                out.push((id, self.rotate_certificates_here()));
                continue;
            }
            let control = opendsec_trust::Expect::Role(opendsec_trust::Role::Control);
            let asked = async {
                let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
                    .map_err(|e| e.to_string())?
                    .connect_with_connector(opendsec_trust::tls_connector(self.inner.cfg.trust.clone(), control))
                    .await
                    .map_err(|e| format!("cannot reach node {id} at {addr}: {e}"))?;
                let reply = crate::pb::control_client::ControlClient::new(channel)
                    .rotate_certificates(crate::pb::RotateCertificatesRequest {})
                    .await
                    .map_err(|s| format!("node {id}: {}", s.message()))?;
                Ok::<_, String>(reply.into_inner().not_after_ms)
            };
            let r = tokio::time::timeout(Duration::from_secs(5), asked)
                .await
                .unwrap_or_else(|_| Err(format!("node {id} at {addr} did not answer within 5 s")));
            out.push((id, r));
        }
        out
    }

    /// Encoded batches of `from..=to` (history for replays and edge watches).
    pub fn read_batches(&self, from: u64, to: u64) -> Result<Vec<(u64, Batch)>, SubmitError> {
        let entries = self.inner.log.read_entries(from, to).map_err(internal)?;
        entries
            .into_iter()
            .map(|(i, b)| schema::decode_batch(&b).map(|b| (i, b)).map_err(internal))
            .collect()
    }

    pub async fn shutdown(&self) {
        let _ = self.inner.log.shutdown().await;
    }
}

enum NotHere {
    /// Not the leader; here is the leader's peer address if known.
    Leader(Option<String>),
    Failed(SubmitError),
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
