//! # opendsec-log: a generic replicated, durable log
//!
//! This crate turns an application's deterministic [`StateMachine`] into a replicated one:
//! payloads proposed on the leader ([`LogNode::propose`]) are appended to a Raft log
//! (openraft), made durable in a [redb] file, replicated to the peers, and applied in
//! index order on every node.
//!
//! What is on disk (one redb file, `<data_dir>/log.redb`):
//! - the Raft vote, the committed log id and the last purged log id;
//! - the live Raft log (an append is durable, in the append journal beside it or in a
//!   redb commit, before openraft is told it is flushed; one writer thread makes every
//!   queued append durable with one fsync, while the entries are already readable from
//!   memory: see [`store`]);
//! - the latest snapshot (the application's [`StateMachine::snapshot`] bytes plus Raft
//!   metadata). The application state itself is kept only in memory: after a restart it
//!   is restored from the latest snapshot, then the committed entries after it are re-applied;
//! - the **archive**: when openraft purges log entries after a snapshot, the purged
//!   application entries are first copied into the archive table in the same write
//!   transaction, so history is never lost unless a retention is configured
//!   ([`LogConfig::archive_retention`]). [`LogNode::read_entries`] reads archive + live log.
//!
//! Peers talk on one port ([`serve_peer`], see [`peer_port`]): appends are pipelined over
//! the [`replication`] protocol (one framed connection per follower, opened with a
//! versioned [`handshake`]); votes, pre-votes and snapshot installs go by a small tonic
//! service ([`LogNode::raft_service`]), added to the caller's router so that the port can
//! host the application's gRPC services and its own framed protocols too:
//!
//! ```no_run
//! # async fn demo<S: opendsec_log::StateMachine>(node: opendsec_log::LogNode<S>) -> Result<(), Box<dyn std::error::Error>> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:7410").await?;
//! // `Some(router)` serves the application's own gRPC services on the same port too.
//! opendsec_log::serve_peer(listener, &node, None, std::future::pending()).await?;
//! # Ok(()) }
//! ```

mod config;
mod error;
pub mod frames;
pub mod handshake;
mod journal;
mod network;
mod node;
pub mod peer_port;
pub mod replication;
mod service;
mod sm;
pub mod store;

/// Entry points for the fuzz targets (`fuzz/`): what the log reads from a peer or from
/// its own files after a crash, over arbitrary bytes, and encoders of valid inputs for
/// their seed corpus. Not an API: nothing else calls these.
#[doc(hidden)]
pub mod fuzzing {
    use openraft::entry::RaftEntry;
    use openraft::raft::AppendEntriesRequest;

    use crate::typ::{Entry, LogId, Vote};
    use crate::{LogError, Payload, TypeConfig};

    fn log_id(term: u64, index: u64) -> LogId {
        LogId::new(openraft::impls::leader_id_adv::LeaderId { term, node_id: 1 }, index)
    }

    /// Journal recovery over `data` as the contents of `log.journal`, live generation
    /// `live`: the records found and their entries decoded and checked, as `Store::open`
    /// does before it writes them to redb. Returns how many entries were recovered.
    pub fn recover_journal(data: &[u8], live: u64) -> Result<usize, LogError> {
        let records = crate::journal::records(data, live);
        Ok(crate::journal::entries(&records)?.len())
    }

    /// A journal's contents holding `payloads` as application entries of term 1 from
    /// index `first`, written with `generation`.
    pub fn journal_of(generation: u64, first: u64, payloads: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for (index, p) in (first..).zip(payloads) {
            let entry = Entry::new_normal(log_id(1, index), Payload(p.to_vec()));
            let bytes = crate::encode(&entry).expect("an entry encodes");
            crate::journal::put_record(&mut out, generation, index, &bytes).expect("a small record");
        }
        out
    }

    /// Decodes one replication frame's payload as a follower does (an append request).
    pub fn decode_append_request(frame: &[u8]) -> std::io::Result<usize> {
        crate::decode::<AppendEntriesRequest<TypeConfig>>(frame).map(|rpc| rpc.entries.len())
    }

    /// One replication frame's payload: an append request carrying `payloads` after `prev`.
    pub fn append_request_of(prev: u64, payloads: &[&[u8]]) -> Vec<u8> {
        let rpc = AppendEntriesRequest::<TypeConfig> {
            vote: Vote::new_committed(1, 1),
            prev_log_id: (prev > 0).then(|| log_id(1, prev)),
            entries: (prev + 1..)
                .zip(payloads)
                .map(|(index, p)| Entry::new_normal(log_id(1, index), Payload(p.to_vec())))
                .collect(),
            leader_commit: (prev > 0).then(|| log_id(1, prev)),
        };
        crate::encode(&rpc).expect("a request encodes")
    }
}

/// Generated gRPC code for `proto/raft.proto` (package `opendsec.raft.v1`).
pub mod pb {
    #![allow(missing_docs, clippy::all)]
    tonic::include_proto!("opendsec.raft.v1");
}

pub use config::LogConfig;
pub use error::{LogError, MembershipError, ProposeError};
pub use node::{Applied, AppliedEntry, Leadership, LogNode, Status};
pub use peer_port::{
    PeerInfo, PeerReadHalf, PeerStream, PeerWriteHalf, SideProtocol, grpc_server, peer_of, serve_peer, serve_peer_with,
};
pub use service::RaftGrpc;
pub use sm::SmStore;

/// The `RaftServiceServer` type to add to a tonic router, for a node running state machine `S`.
pub type RaftServer<S> = pb::raft_service_server::RaftServiceServer<RaftGrpc<S>>;

/// The application's deterministic state machine. The log applies committed payloads to it in index order.
pub trait StateMachine: Send + Sync + 'static {
    /// Apply one committed entry's payload; the returned bytes are handed to the proposer.
    fn apply(&mut self, index: u64, payload: &[u8]) -> Vec<u8>;
    /// Serialize the whole state (Raft snapshots).
    fn snapshot(&self) -> Vec<u8>;
    /// Replace the whole state with a snapshot's content.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String>;
}

/// An application payload as carried in the Raft log (opaque bytes).
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Payload(#[serde(with = "serde_bytes")] pub Vec<u8>);

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Payload({} bytes)", self.0.len())
    }
}

impl std::fmt::Display for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0.len())
    }
}

openraft::declare_raft_types!(
    /// The openraft type configuration of this log: u64 node ids, `BasicNode { addr }` node
    /// info (the peer's gRPC `host:port`), opaque byte payloads and responses.
    pub TypeConfig:
        D = Payload,
        R = Vec<u8>,
        NodeId = u64,
        Node = openraft::BasicNode,
);

/// openraft type aliases used throughout the crate.
pub(crate) mod typ {
    use super::TypeConfig;
    pub type LogId = openraft::alias::LogIdOf<TypeConfig>;
    pub type Vote = openraft::alias::VoteOf<TypeConfig>;
    pub type Entry = openraft::alias::EntryOf<TypeConfig>;
    pub type StoredMembership = openraft::alias::StoredMembershipOf<TypeConfig>;
    pub type SnapshotMeta = openraft::alias::SnapshotMetaOf<TypeConfig>;
    pub type Snapshot = openraft::alias::SnapshotOf<TypeConfig, Vec<u8>>;
}

/// Encode with postcard (the crate's single binary encoding, on disk and on the wire).
pub(crate) fn encode<T: serde::Serialize>(v: &T) -> Result<Vec<u8>, std::io::Error> {
    postcard::to_stdvec(v).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

/// Decode postcard bytes written by [`encode`].
pub(crate) fn decode<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, std::io::Error> {
    postcard::from_bytes(b).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod payload_encoding {
    use super::Payload;

    /// Payloads are encoded as one run of bytes (not byte by byte, as a sequence): the
    /// same bytes on disk and on the wire as before, so journals, logs and peers of the
    /// earlier encoding read alike.
    #[test]
    fn a_payload_encodes_as_the_byte_sequence_it_was_before() {
        for bytes in [vec![], vec![0u8, 1, 255], vec![7u8; 300]] {
            let now = postcard::to_stdvec(&Payload(bytes.clone())).unwrap();
            assert_eq!(now, postcard::to_stdvec(&bytes).unwrap());
            let back: Payload = postcard::from_bytes(&now).unwrap();
            assert_eq!(back, Payload(bytes));
        }
    }
}
