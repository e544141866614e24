use std::path::PathBuf;

/// Configuration of one log node.
#[derive(Clone, Debug)]
pub struct LogConfig {
    /// This node's Raft id (unique in the cluster, never reused for another data dir).
    pub node_id: u64,
    /// Directory holding `log.redb` (created if missing).
    pub data_dir: PathBuf,
    /// This node's peer gRPC address (`host:port`) as the other nodes reach it. Recorded in
    /// the membership when this node initializes a cluster.
    pub advertise_addr: String,
    /// Build a snapshot after this many log entries since the last one (default 10_000).
    pub snapshot_every: u64,
    /// How many entries already covered by a snapshot stay in the live log (to let slightly
    /// lagging followers catch up by replication instead of a snapshot). Default 1_000.
    pub keep_after_snapshot: u64,
    /// How many of the newest archived (purged) application entries to keep. `None` (the
    /// default) keeps the whole history forever.
    pub archive_retention: Option<u64>,
    /// Election timeout range in milliseconds, (min, max). Default (300, 600).
    pub election_timeout_ms: (u64, u64),
    /// Leader heartbeat interval in milliseconds. Default 100.
    pub heartbeat_ms: u64,
    /// Capacity of the [`crate::LogNode::subscribe`] broadcast channel. Default 8192.
    pub subscribe_capacity: usize,
    /// Timeout of one Raft RPC to a peer, in milliseconds (snapshots get 20x). Default 1_000.
    pub rpc_timeout_ms: u64,
    /// This node's certificate and the cluster CA: every peer-port connection is mutual
    /// TLS, and Raft is spoken only with peers whose certificate names a control node.
    pub trust: std::sync::Arc<opendsec_trust::Trust>,
}

impl LogConfig {
    /// A configuration with the defaults documented on each field.
    pub fn new(
        node_id: u64,
        data_dir: impl Into<PathBuf>,
        advertise_addr: impl Into<String>,
        trust: std::sync::Arc<opendsec_trust::Trust>,
    ) -> Self {
        LogConfig {
            node_id,
            data_dir: data_dir.into(),
            advertise_addr: advertise_addr.into(),
            snapshot_every: 10_000,
            keep_after_snapshot: 1_000,
            archive_retention: None,
            election_timeout_ms: (300, 600),
            heartbeat_ms: 100,
            subscribe_capacity: 8192,
            rpc_timeout_ms: 1_000,
            trust,
        }
    }

    pub(crate) fn raft_config(&self) -> Result<openraft::Config, openraft::ConfigError> {
        let cfg = openraft::Config {
            cluster_name: "opendsec".to_string(),
            election_timeout_min: self.election_timeout_ms.0,
            election_timeout_max: self.election_timeout_ms.1,
            heartbeat_interval: self.heartbeat_ms,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(self.snapshot_every.max(1)),
            max_in_snapshot_log_to_keep: self.keep_after_snapshot,
            purge_batch_size: 1,
            enable_pre_vote: Some(true),
            // The applied state lives in memory; do not let a restarted leader resume
            // leadership without an election.
            enable_leader_restore: Some(false),
            install_snapshot_timeout: self.rpc_timeout_ms * 20,
            ..Default::default()
        };
        cfg.validate()
    }
}
