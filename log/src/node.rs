//! The public handle: [`LogNode`].

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use openraft::async_runtime::WatchReceiver;
use openraft::errors::{ClientWriteError, ForwardToLeader, InitializeError, RaftError};
use openraft::{BasicNode, ChangeMembers, Raft, ServerState};
use tokio::sync::{broadcast, watch};

use crate::config::LogConfig;
use crate::error::{LogError, MembershipError, ProposeError};
use crate::network::Network;
use crate::service::RaftGrpc;
use crate::sm::SmStore;
use crate::store::{Inline, Store};
use crate::{Payload, RaftServer, StateMachine, TypeConfig};

/// The result of a successful [`LogNode::propose`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Applied {
    /// The log index the payload was committed at.
    pub index: u64,
    /// What [`StateMachine::apply`] returned for it.
    pub response: Vec<u8>,
}

/// An application entry applied on this node, as sent to [`LogNode::subscribe`]rs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppliedEntry {
    /// Its log index.
    pub index: u64,
    /// Its payload.
    pub payload: Arc<[u8]>,
}

/// Who leads (see [`LogNode::leadership`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Leadership {
    pub is_leader: bool,
    pub leader_id: Option<u64>,
    /// The leader's peer address, if known.
    pub leader_addr: Option<String>,
}

/// A point-in-time view of this node (see [`LogNode::status`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Status {
    /// This node's id.
    pub node_id: u64,
    /// The leader this node knows of.
    pub leader_id: Option<u64>,
    /// Whether this node is the leader.
    pub is_leader: bool,
    /// The current Raft term.
    pub current_term: u64,
    /// Index of the last entry in the local log (committed or not).
    pub last_log_index: Option<u64>,
    /// Index of the last entry applied to the state machine here.
    pub last_applied: Option<u64>,
    /// Index of the last snapshot, if any.
    pub snapshot_index: Option<u64>,
    /// Every member (voters and learners): id -> peer address.
    pub membership: BTreeMap<u64, String>,
    /// The voter ids.
    pub voters: BTreeSet<u64>,
    /// First index of the history readable with [`LogNode::read_entries`].
    pub first_available_index: u64,
}

struct Inner<S: StateMachine> {
    raft: Raft<TypeConfig, SmStore<S>>,
    sm: SmStore<S>,
    store: Store,
    node_id: u64,
    advertise_addr: String,
    trust: Arc<opendsec_trust::Trust>,
}

/// A handle on a running log node (cheap to clone; all clones share the node).
pub struct LogNode<S: StateMachine> {
    inner: Arc<Inner<S>>,
}

impl<S: StateMachine> Clone for LogNode<S> {
    fn clone(&self) -> Self {
        LogNode {
            inner: self.inner.clone(),
        }
    }
}

fn fatal(e: impl std::fmt::Display) -> LogError {
    LogError::Fatal(e.to_string())
}

impl<S: StateMachine> LogNode<S> {
    /// Open the node's storage in `cfg.data_dir` and start Raft. The state machine `sm` must be
    /// empty: it is restored from the latest stored snapshot and the committed entries after
    /// it. Serve its peer port ([`crate::serve_peer`]) so the peers can reach this node.
    pub async fn open(cfg: LogConfig, sm: S) -> Result<Self, LogError> {
        let raft_cfg = cfg.raft_config().map_err(|e| LogError::Config(e.to_string()))?;
        let store = Store::open(&cfg.data_dir, cfg.archive_retention)?;
        let sm = SmStore::new(sm, store.clone(), cfg.subscribe_capacity);
        let network = Network::new(Duration::from_millis(cfg.rpc_timeout_ms.max(1)), cfg.trust.clone());
        let raft = match Raft::new(cfg.node_id, Arc::new(raft_cfg), network, store.clone(), sm.clone()).await {
            Ok(r) => r,
            Err(e) => {
                store.close();
                return Err(fatal(e));
            }
        };
        // A node alone in its cluster, and a follower, commit appends on the core's thread
        // when they can (see `Store::set_inline`); membership and role changes switch it.
        let mut server = raft.server_metrics();
        let watched = store.clone();
        tokio::spawn(async move {
            loop {
                let mode = {
                    let m = server.borrow_watched();
                    let membership = m.membership_config.membership();
                    if membership.voter_ids().count() == 1 && membership.nodes().count() == 1 {
                        Inline::Lone
                    } else if m.state == openraft::ServerState::Follower {
                        Inline::Follower
                    } else {
                        Inline::Off
                    }
                };
                watched.set_inline(mode);
                if server.changed().await.is_err() {
                    break;
                }
            }
        });
        Ok(LogNode {
            inner: Arc::new(Inner {
                raft,
                sm,
                store,
                node_id: cfg.node_id,
                advertise_addr: cfg.advertise_addr,
                trust: cfg.trust,
            }),
        })
    }

    /// The tonic service of Raft's votes and snapshot installs ([`crate::serve_peer`] serves
    /// it, beside the replication protocol).
    pub fn raft_service(&self) -> RaftServer<S> {
        RaftGrpc::server(self.inner.raft.clone())
    }

    /// This node's certificate and the CA it trusts (its peer port's TLS).
    pub fn trust(&self) -> &Arc<opendsec_trust::Trust> {
        &self.inner.trust
    }

    /// This node's id.
    pub fn node_id(&self) -> u64 {
        self.inner.node_id
    }

    /// The underlying openraft handle (for advanced uses: metrics, linearizable reads...).
    pub fn raft(&self) -> &Raft<TypeConfig, SmStore<S>> {
        &self.inner.raft
    }

    /// Form a new cluster with `members` (id -> peer address) as voters. Call it on one node
    /// of a pristine cluster (or on every node with the same members). Idempotent: `Ok` if the
    /// node is already initialized.
    pub async fn initialize(&self, members: BTreeMap<u64, String>) -> Result<(), LogError> {
        let raft = &self.inner.raft;
        if raft.is_initialized().await.map_err(fatal)? {
            return Ok(());
        }
        let mut nodes: BTreeMap<u64, BasicNode> =
            members.into_iter().map(|(id, addr)| (id, BasicNode { addr })).collect();
        if nodes.is_empty() {
            nodes.insert(
                self.inner.node_id,
                BasicNode {
                    addr: self.inner.advertise_addr.clone(),
                },
            );
        }
        match raft.initialize(nodes).await {
            Ok(()) => Ok(()),
            Err(RaftError::APIError(InitializeError::NotAllowed(_))) => Ok(()),
            Err(RaftError::APIError(e)) => Err(LogError::Initialize(e.to_string())),
            Err(RaftError::Fatal(e)) => Err(fatal(e)),
        }
    }

    fn leader_addr(&self, id: Option<u64>) -> Option<String> {
        let id = id?;
        let m = self.inner.raft.metrics().borrow_watched().membership_config.clone();
        m.get_node(&id).map(|n| n.addr.clone())
    }

    fn forward(&self, f: ForwardToLeader<TypeConfig>) -> (Option<u64>, Option<String>) {
        let addr = f.leader_node.map(|n| n.addr).or_else(|| self.leader_addr(f.leader_id));
        (f.leader_id, addr)
    }

    /// Append `payload` to the log. Returns once it is committed and applied on this node
    /// (which must be the leader), with what [`StateMachine::apply`] returned.
    pub async fn propose(&self, payload: Vec<u8>) -> Result<Applied, ProposeError> {
        match self.inner.raft.client_write(Payload(payload)).await {
            Ok(r) => Ok(Applied {
                index: r.log_id.index(),
                response: r.data,
            }),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                let (leader_id, leader_addr) = self.forward(f);
                Err(ProposeError::ForwardToLeader { leader_id, leader_addr })
            }
            Err(RaftError::APIError(ClientWriteError::LogEntryDiscarded(f))) => {
                let (leader_id, leader_addr) = self.forward(f);
                Err(ProposeError::Unknown { leader_id, leader_addr })
            }
            Err(RaftError::APIError(e)) => Err(ProposeError::Rejected(e.to_string())),
            Err(RaftError::Fatal(e)) => Err(ProposeError::Fatal(e.to_string())),
        }
    }

    fn membership_result<T>(
        &self,
        r: Result<T, RaftError<TypeConfig, ClientWriteError<TypeConfig>>>,
    ) -> Result<(), MembershipError> {
        match r {
            Ok(_) => Ok(()),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f)))
            | Err(RaftError::APIError(ClientWriteError::LogEntryDiscarded(f))) => {
                let (leader_id, leader_addr) = self.forward(f);
                Err(MembershipError::ForwardToLeader { leader_id, leader_addr })
            }
            Err(RaftError::APIError(e)) => Err(MembershipError::Refused(e.to_string())),
            Err(RaftError::Fatal(e)) => Err(MembershipError::Fatal(e.to_string())),
        }
    }

    /// Add (or re-address) a non-voting member that receives the log. Returns once the learner
    /// has caught up with the leader's log (by replication or snapshot). Leader only.
    pub async fn add_learner(&self, id: u64, addr: String) -> Result<(), MembershipError> {
        let r = self.inner.raft.add_learner(id, BasicNode { addr }, true).await;
        self.membership_result(r)
    }

    /// Make `voters` the exact voter set (every one must already be a member: add new ones
    /// with [`Self::add_learner`] first). Voters left out are removed from the cluster.
    /// Leader only.
    pub async fn change_membership(&self, voters: BTreeSet<u64>) -> Result<(), MembershipError> {
        let r = self
            .inner
            .raft
            .change_membership(ChangeMembers::ReplaceAllVoters(voters), false)
            .await;
        self.membership_result(r)
    }

    /// Remove node `id` (voter or learner) from the cluster. Leader only.
    pub async fn remove_node(&self, id: u64) -> Result<(), MembershipError> {
        let is_voter = self
            .inner
            .raft
            .metrics()
            .borrow_watched()
            .membership_config
            .voter_ids()
            .any(|v| v == id);
        let change = if is_voter {
            ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        } else {
            ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        };
        let r = self.inner.raft.change_membership(change, false).await;
        self.membership_result(r)
    }

    /// A snapshot of this node's Raft view.
    /// Whether this node leads, and who does: cheap enough for every write (no
    /// storage read, no copy of the metrics).
    pub fn leadership(&self) -> Leadership {
        let metrics = self.inner.raft.metrics();
        let m = metrics.borrow_watched();
        let leader_addr = m.current_leader.and_then(|id| {
            m.membership_config
                .nodes()
                .find(|(n, _)| **n == id)
                .map(|(_, node)| node.addr.clone())
        });
        Leadership {
            is_leader: m.state == ServerState::Leader,
            leader_id: m.current_leader,
            leader_addr,
        }
    }

    /// On the leader: the log index a read must see to be linearizable, once this node
    /// has applied it. Leadership is confirmed by the leader's lease while it holds, else
    /// by a round to a quorum. An error on a follower, or where leadership cannot be
    /// confirmed within `timeout`.
    pub async fn read_index(&self, timeout: Duration) -> Result<u64, LogError> {
        let read = tokio::time::timeout(
            timeout,
            self.inner.raft.ensure_linearizable(openraft::ReadPolicy::LeaseRead),
        )
        .await
        .map_err(|_| LogError::NotConfirmed(format!("no quorum answered within {} ms", timeout.as_millis())))?
        .map_err(|e| LogError::NotConfirmed(e.to_string()))?;
        Ok(read.index())
    }

    pub fn status(&self) -> Status {
        let m = self.inner.raft.metrics().borrow_watched().clone();
        let membership = m
            .membership_config
            .nodes()
            .map(|(id, n)| (*id, n.addr.clone()))
            .collect();
        let voters = m.membership_config.voter_ids().collect();
        Status {
            node_id: self.inner.node_id,
            leader_id: m.current_leader,
            is_leader: m.state == ServerState::Leader,
            current_term: m.current_term,
            last_log_index: m.last_log_index,
            last_applied: *self.inner.sm.shared.applied_tx.borrow(),
            snapshot_index: m.snapshot.map(|s| s.index()),
            membership,
            voters,
            first_available_index: self.first_available_index().unwrap_or(0),
        }
    }

    /// Receive every application entry applied on this node from now on, in index order.
    /// A receiver that falls behind by more than `LogConfig::subscribe_capacity` entries gets
    /// `RecvError::Lagged` and should catch up with [`Self::read_entries`]. When this node
    /// installs a snapshot, the entries it covers are not sent (the indexes jump).
    pub fn subscribe(&self) -> broadcast::Receiver<AppliedEntry> {
        self.inner.sm.shared.events.subscribe()
    }

    /// A watch of the last applied index on this node.
    pub fn applied_index(&self) -> watch::Receiver<Option<u64>> {
        self.inner.sm.shared.applied_tx.subscribe()
    }

    /// The committed application payloads with index in `from..=to_inclusive` (capped at the
    /// last index applied on this node), from the archive and the live log, in index order;
    /// blank and membership entries are skipped. Fails with [`LogError::NotAvailable`] if
    /// `from` is before [`Self::first_available_index`].
    pub fn read_entries(&self, from: u64, to_inclusive: u64) -> Result<Vec<(u64, Vec<u8>)>, LogError> {
        let applied = *self.inner.sm.shared.applied_tx.borrow();
        let Some(applied) = applied else {
            return Ok(Vec::new());
        };
        self.inner.store.read_entries(from, to_inclusive.min(applied))
    }

    /// The first index from which this node holds the complete history (see
    /// [`LogConfig::archive_retention`]; a node that joined through a snapshot starts after it).
    pub fn first_available_index(&self) -> Result<u64, LogError> {
        Ok(self.inner.store.first_available_index()?)
    }

    /// Number of entries in the live Raft log and in the archive (diagnostics).
    pub fn storage_counts(&self) -> Result<(u64, u64), LogError> {
        Ok((self.inner.store.live_count()?, self.inner.store.archived_count()?))
    }

    /// Counters of this node's storage work (appends, fsyncs, reads) since it opened:
    /// diagnostics and benchmarks.
    pub fn io_stats(&self) -> crate::store::IoStats {
        self.inner.store.io_stats()
    }

    /// Run `f` on the applied state (a read lock is held meanwhile: keep it short).
    pub fn with_state<R>(&self, f: impl FnOnce(&S) -> R) -> R {
        let st = self.inner.sm.shared.read();
        f(&st.app)
    }

    /// Wait until entry `index` is applied on this node (read-your-writes on a follower: pass
    /// the index returned by the leader's `propose`).
    pub async fn wait_applied(&self, index: u64, timeout: Duration) -> Result<(), LogError> {
        let mut rx = self.inner.sm.shared.applied_tx.subscribe();
        let r = tokio::time::timeout(timeout, async {
            rx.wait_for(|a| a.is_some_and(|a| a >= index)).await.map(|_| ())
        })
        .await;
        match r {
            Ok(Ok(())) => Ok(()),
            Ok(Err(_)) => Err(LogError::Fatal("state machine dropped".into())),
            Err(_) => Err(LogError::Timeout {
                index,
                applied: (*rx.borrow()).unwrap_or(0),
            }),
        }
    }

    /// Build a snapshot now (and purge/archive the log it covers, keeping
    /// `keep_after_snapshot` entries). Returns once the snapshot is stored, or after 30 s.
    pub async fn trigger_snapshot(&self) -> Result<(), LogError> {
        let target = *self.inner.sm.shared.applied_tx.borrow();
        let Some(target) = target else {
            self.inner.raft.trigger().snapshot().await.map_err(fatal)?;
            return Ok(());
        };
        // openraft drops a trigger that arrives while a build (e.g. one its policy started)
        // is in flight, and that build may end below `target`: trigger again until covered.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            self.inner.raft.trigger().snapshot().await.map_err(fatal)?;
            let r = self
                .inner
                .raft
                .wait(Some(Duration::from_secs(1)))
                .metrics(|m| m.snapshot.is_some_and(|s| s.index() >= target), "snapshot built")
                .await;
            match r {
                Ok(_) => return Ok(()),
                Err(openraft::metrics::WaitError::Timeout(..)) if tokio::time::Instant::now() < deadline => {}
                Err(e) => return Err(fatal(e)),
            }
        }
    }

    /// Stop Raft and release the data directory (a new [`LogNode::open`] on it may follow).
    /// Every clone of this handle stops working. Idempotent.
    pub async fn shutdown(&self) -> Result<(), LogError> {
        let r = self.inner.raft.shutdown().await;
        self.inner.store.close();
        r.map_err(fatal)
    }
}
