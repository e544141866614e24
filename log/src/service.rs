//! Raft server side: the tonic service peers call, to be added to the caller's router.

use std::future::Future;
use std::pin::Pin;

use futures::{Stream, StreamExt};

use openraft::Raft;
use openraft::raft::{AppendEntriesRequest, VoteRequest};
use tonic::{Request, Response, Status, Streaming};

use crate::pb::raft_service_server::{RaftService, RaftServiceServer};
use crate::pb::{RaftMessage, SnapshotChunk};
use crate::sm::SmStore;
use crate::typ::{Snapshot, SnapshotMeta, Vote};
use crate::{LogNode, RaftServer, StateMachine, TypeConfig, decode, encode};

/// The gRPC handler of the Raft peer protocol for one node. Build the tonic service with
/// [`LogNode::raft_service`].
pub struct RaftGrpc<S: StateMachine> {
    raft: Raft<TypeConfig, SmStore<S>>,
    cluster_key: String,
}

impl<S: StateMachine> RaftGrpc<S> {
    pub(crate) fn server(raft: Raft<TypeConfig, SmStore<S>>, cluster_key: String) -> RaftServer<S> {
        RaftServiceServer::new(RaftGrpc { raft, cluster_key })
            .max_decoding_message_size(usize::MAX)
            .max_encoding_message_size(usize::MAX)
    }
}

/// Refuses a peer that does not present this cluster's key (compared in constant time).
fn check_key(expected: &str, got: &str) -> Result<(), Status> {
    let same = expected.len() == got.len()
        && expected.bytes().zip(got.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
    if same {
        Ok(())
    } else {
        Err(Status::permission_denied("wrong or missing cluster key"))
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
    Ok(Response::new(RaftMessage { payload, cluster_key: String::new() }))
}

/// The request metadata key carrying the cluster key on streaming calls.
pub(crate) const KEY_HEADER: &str = "opendsec-cluster-key";

type AppendStreamOut = Pin<Box<dyn Stream<Item = Result<RaftMessage, Status>> + Send + 'static>>;

#[tonic::async_trait]
impl<S: StateMachine> RaftService for RaftGrpc<S> {
    type AppendStreamStream = AppendStreamOut;

    async fn append_stream(
        &self,
        req: Request<Streaming<RaftMessage>>,
    ) -> Result<Response<AppendStreamOut>, Status> {
        let key = req.metadata().get(KEY_HEADER).and_then(|v| v.to_str().ok()).unwrap_or("");
        check_key(&self.cluster_key, key)?;
        // An undecodable request or a broken stream ends the input; openraft then answers
        // what it received and the leader starts a new stream.
        let input = tokio_stream::StreamExt::map_while(req.into_inner(), |m| match m {
            Ok(m) => match decode::<AppendEntriesRequest<TypeConfig>>(&m.payload) {
                Ok(rpc) => Some(rpc),
                Err(e) => {
                    tracing::warn!("undecodable append request on a replication stream: {e}");
                    None
                }
            },
            Err(_) => None,
        });
        let out = self.raft.stream_append(input).map(|r| match r {
            Ok(res) => {
                let payload = encode(&res).map_err(|e| Status::internal(e.to_string()))?;
                Ok(RaftMessage { payload, cluster_key: String::new() })
            }
            Err(fatal) => Err(stopped(fatal)),
        });
        Ok(Response::new(Box::pin(out)))
    }

    async fn append_entries(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let msg = req.into_inner();
        check_key(&self.cluster_key, &msg.cluster_key)?;
        let rpc: AppendEntriesRequest<TypeConfig> = decode(&msg.payload).map_err(bad_request)?;
        let resp = self.raft.append_entries(rpc).await.map_err(stopped)?;
        reply(&resp)
    }

    async fn vote(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let msg = req.into_inner();
        check_key(&self.cluster_key, &msg.cluster_key)?;
        let rpc: VoteRequest<TypeConfig> = decode(&msg.payload).map_err(bad_request)?;
        let resp = self.raft.vote(rpc).await.map_err(stopped)?;
        reply(&resp)
    }

    async fn pre_vote(&self, req: Request<RaftMessage>) -> Result<Response<RaftMessage>, Status> {
        let msg = req.into_inner();
        check_key(&self.cluster_key, &msg.cluster_key)?;
        let rpc: VoteRequest<TypeConfig> = decode(&msg.payload).map_err(bad_request)?;
        let resp = self.raft.pre_vote(rpc).await.map_err(stopped)?;
        reply(&resp)
    }

    async fn install_snapshot(
        &self,
        req: Request<Streaming<SnapshotChunk>>,
    ) -> Result<Response<RaftMessage>, Status> {
        let mut stream = req.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::invalid_argument("empty snapshot stream"))?;
        check_key(&self.cluster_key, &first.cluster_key)?;
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

/// Serve the Raft peer service (plus whatever `extra` already routes) on `listener` until
/// `shutdown` completes. `extra` is a router made with `tonic::transport::Server::builder()`
/// carrying the node's other peer-port services; `None` serves the Raft service alone.
pub async fn serve_peer<S: StateMachine>(
    listener: tokio::net::TcpListener,
    node: &LogNode<S>,
    extra: Option<tonic::transport::server::Router>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let router = match extra {
        Some(r) => r.add_service(node.raft_service()),
        None => tonic::transport::Server::builder().add_service(node.raft_service()),
    };
    router
        .serve_with_incoming_shutdown(
            // Small RPCs must not wait for Nagle's algorithm (40 ms stalls with delayed ACKs).
            tokio_stream::StreamExt::map(tokio_stream::wrappers::TcpListenerStream::new(listener), |conn| {
                conn.inspect(|s| {
                    let _ = s.set_nodelay(true);
                })
            }),
            shutdown,
        )
        .await
}
