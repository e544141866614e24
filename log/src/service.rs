//! Raft server side of votes, pre-votes and snapshot installs: the tonic service peers
//! call, served on the peer port beside the caller's own services (see `peer_port.rs`).
//! Appends do not come this way: they come by the replication protocol (`replication.rs`).

use openraft::Raft;
use openraft::raft::VoteRequest;
use tonic::{Request, Response, Status, Streaming};

use crate::pb::raft_service_server::{RaftService, RaftServiceServer};
use crate::pb::{RaftMessage, SnapshotChunk};
use crate::sm::SmStore;
use crate::typ::{Snapshot, SnapshotMeta, Vote};
use crate::{RaftServer, StateMachine, TypeConfig, decode, encode};

/// The gRPC handler of Raft's votes and snapshots for one node. Build the tonic service with
/// [`LogNode::raft_service`].
pub struct RaftGrpc<S: StateMachine> {
    raft: Raft<TypeConfig, SmStore<S>>,
}

impl<S: StateMachine> RaftGrpc<S> {
    pub(crate) fn server(raft: Raft<TypeConfig, SmStore<S>>) -> RaftServer<S> {
        // A vote is small and a snapshot comes in chunks of `SNAPSHOT_CHUNK`: nothing
        // larger is decoded, so an unauthenticated peer cannot make the node buffer more.
        RaftServiceServer::new(RaftGrpc { raft })
            .max_decoding_message_size(crate::network::MAX_RAFT_MESSAGE)
            .max_encoding_message_size(crate::network::MAX_RAFT_MESSAGE)
    }
}

/// Refuses a peer whose certificate does not name a control node.
fn check_peer<T>(req: &Request<T>) -> Result<(), Status> {
    let peer = crate::peer_port::peer_of(req);
    if peer.is(opendsec_trust::Role::Control) {
        Ok(())
    } else {
        tracing::warn!(peer = %peer.who(), remote = ?peer.remote, "a Raft call from outside the control plane was refused");
        Err(Status::permission_denied("Raft is spoken between control nodes only"))
    }
}

fn bad_request(e: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("undecodable raft message: {e}"))
}

/// The local node stopped: peers see it as unreachable.
fn stopped(e: impl std::fmt::Display) -> Status {
    Status::unavailable(format!("raft node stopped: {e}"))
}

fn reply<T: serde::Serialize>(v: &T) -> Result<Response<RaftMessage>, Status> {
    let payload = encode(v).map_err(|e| Status::internal(e.to_string()))?;
    Ok(Response::new(RaftMessage { payload }))
}

#[tonic::async_trait]
impl<S: StateMachine> RaftService for RaftGrpc<S> {
    async fn vote(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        check_peer(&req)?;
        let msg = req.into_inner();
        let rpc: VoteRequest<TypeConfig> = decode(&msg.payload).map_err(bad_request)?;
        let resp = self.raft.vote(rpc).await.map_err(stopped)?;
        reply(&resp)
    }

    async fn append_one(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        use futures::StreamExt;
        check_peer(&req)?;
        let msg = req.into_inner();
        let rpc: openraft::raft::AppendEntriesRequest<TypeConfig> = decode(&msg.payload).map_err(bad_request)?;
        let mut out = Box::pin(
            self.raft
                .stream_append(Box::pin(futures::stream::once(async move { rpc }))),
        );
        match out.next().await {
            Some(Ok(result)) => reply(&result),
            Some(Err(e)) => Err(stopped(e)),
            None => Err(Status::unavailable("raft answered nothing")),
        }
    }

    async fn pre_vote(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        check_peer(&req)?;
        let msg = req.into_inner();
        let rpc: VoteRequest<TypeConfig> = decode(&msg.payload).map_err(bad_request)?;
        let resp = self.raft.pre_vote(rpc).await.map_err(stopped)?;
        reply(&resp)
    }

    async fn install_snapshot(&self, req: Request<Streaming<SnapshotChunk>>) -> Result<Response<RaftMessage>, Status> {
        check_peer(&req)?;
        let mut stream = req.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("empty snapshot stream"))?;
        let (vote, meta): (Vote, SnapshotMeta) = decode(&first.meta).map_err(bad_request)?;
        let mut data = first.data;
        while let Some(chunk) = stream.message().await? {
            data.extend_from_slice(&chunk.data);
        }
        let resp = self
            .raft
            .install_full_snapshot(vote, Snapshot { meta, snapshot: data })
            .await
            .map_err(stopped)?;
        reply(&resp)
    }
}
