//! Error types of the public API.

/// Errors of storage, startup and reads.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The redb database could not be opened, read or written.
    #[error("storage error: {0}")]
    Storage(String),
    /// A file-system operation on the data directory failed.
    #[error("io error: {0}")]
    Io(#[from] std::io::Error),
    /// The configuration was rejected by openraft (e.g. election timeout min >= max).
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The Raft node stopped (shut down or hit a fatal storage error).
    #[error("raft node stopped: {0}")]
    Fatal(String),
    /// `initialize` was refused (e.g. this node is not in the given member set).
    #[error("cluster initialization refused: {0}")]
    Initialize(String),
    /// The requested history starts before the first entry still available on this node
    /// (removed by archive retention, or this node joined through a snapshot).
    #[error("entries before index {first_available} are not available (requested from {requested})")]
    NotAvailable {
        /// First index requested.
        requested: u64,
        /// First index this node can still serve.
        first_available: u64,
    },
    /// This node could not confirm that it leads (for a linearizable read).
    #[error("leadership not confirmed: {0}")]
    NotConfirmed(String),
    /// A wait (e.g. [`crate::LogNode::wait_applied`]) did not complete in time.
    #[error("timed out waiting for index {index} to be applied (applied: {applied})")]
    Timeout {
        /// The index waited for.
        index: u64,
        /// The last applied index when the wait gave up.
        applied: u64,
    },
}

impl From<redb::Error> for LogError {
    fn from(e: redb::Error) -> Self {
        LogError::Storage(e.to_string())
    }
}

/// Errors of [`crate::LogNode::propose`].
#[derive(Debug, thiserror::Error)]
pub enum ProposeError {
    /// This node is not the leader. Retry on `leader_addr` (the peer gRPC address of the leader,
    /// if known). Nothing was appended.
    #[error("not the leader; forward to {leader_id:?} at {leader_addr:?}")]
    ForwardToLeader {
        /// The current leader's id, if known.
        leader_id: Option<u64>,
        /// The current leader's peer address, if known.
        leader_addr: Option<String>,
    },
    /// The entry had been appended on this node but was discarded when it lost leadership;
    /// it may or may not commit through the next leader. Retrying needs application-level
    /// deduplication.
    #[error("proposal outcome unknown (leader changed); leader now {leader_id:?}")]
    Unknown {
        /// The new leader's id, if known.
        leader_id: Option<u64>,
        /// The new leader's peer address, if known.
        leader_addr: Option<String>,
    },
    /// The Raft node stopped (shut down or fatal storage error).
    #[error("raft node stopped: {0}")]
    Fatal(String),
    /// Any other rejection from openraft.
    #[error("proposal rejected: {0}")]
    Rejected(String),
}

/// Errors of membership changes (`add_learner`, `change_membership`, `remove_node`).
#[derive(Debug, thiserror::Error)]
pub enum MembershipError {
    /// This node is not the leader: send the change to the leader.
    #[error("not the leader; forward to {leader_id:?} at {leader_addr:?}")]
    ForwardToLeader {
        /// The current leader's id, if known.
        leader_id: Option<u64>,
        /// The current leader's peer address, if known.
        leader_addr: Option<String>,
    },
    /// openraft refused the change (e.g. a voter that is not a learner yet, a change in progress).
    #[error("membership change refused: {0}")]
    Refused(String),
    /// The Raft node stopped.
    #[error("raft node stopped: {0}")]
    Fatal(String),
}
