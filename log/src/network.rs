//! Raft client side: openraft's network factory. Appends go by the replication protocol
//! ([`crate::replication`], one connection per openraft stream); votes, pre-votes and
//! snapshots by the Raft gRPC service.
//!
//! One lazily-connected tonic `Channel` per peer is kept and shared by every openraft
//! connection to that peer. A tonic channel re-establishes its HTTP/2 connection by itself
//! after a failure, so a killed peer that comes back on the same address is reached again
//! without any action here; a changed address replaces the channel.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::Stream;
use openraft::BasicNode;
use openraft::OptionalSend;
use openraft::base::BoxFuture;
use openraft::errors::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{
    Backoff, NetBackoff, NetSnapshot, NetStreamAppend, NetTransferLeader, NetVote, RPCOption, RaftNetworkFactory,
};
use openraft::raft::{
    AppendEntriesRequest, SnapshotResponse, StreamAppendResult, TransferLeaderRequest, TransferLeaderResponse,
    VoteRequest, VoteResponse,
};
use tonic::transport::{Channel, Endpoint};

use crate::pb;
use crate::pb::raft_service_client::RaftServiceClient;
use crate::replication::StreamOut;
use crate::typ::{Snapshot, Vote};
use crate::{TypeConfig, decode, encode};

/// Snapshot bytes per gRPC stream message.
const SNAPSHOT_CHUNK: usize = 1024 * 1024;
/// The largest Raft gRPC message either side decodes: a snapshot chunk and its framing.
pub(crate) const MAX_RAFT_MESSAGE: usize = 4 * SNAPSHOT_CHUNK;

type Rpc<T> = Result<T, RPCError<TypeConfig>>;

/// The openraft network factory: hands out connections sharing one channel per peer.
#[derive(Clone)]
pub(crate) struct Network {
    channels: Arc<Mutex<HashMap<u64, (String, Channel)>>>,
    rpc_timeout: Duration,
    trust: Arc<opendsec_trust::Trust>,
}

impl Network {
    pub(crate) fn new(rpc_timeout: Duration, trust: Arc<opendsec_trust::Trust>) -> Self {
        Network {
            channels: Arc::new(Mutex::new(HashMap::new())),
            rpc_timeout,
            trust,
        }
    }

    fn channel(&self, target: u64, addr: &str) -> Result<Channel, String> {
        let mut map = self.channels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((a, ch)) = map.get(&target)
            && a == addr
        {
            return Ok(ch.clone());
        }
        let url = if addr.contains("://") {
            addr.to_string()
        } else {
            format!("http://{addr}")
        };
        let ch = Endpoint::from_shared(url)
            .map_err(|e| format!("invalid peer address {addr:?}: {e}"))?
            .connect_timeout(Duration::from_millis(500))
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .connect_with_connector_lazy(opendsec_trust::tls_connector(
                self.trust.clone(),
                opendsec_trust::Expect::Role(opendsec_trust::Role::Control),
            ));
        map.insert(target, (addr.to_string(), ch.clone()));
        Ok(ch)
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = Conn;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Conn {
        Conn {
            target,
            channel: self.channel(target, &node.addr),
            addr: node
                .addr
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .to_string(),
            rpc_timeout: self.rpc_timeout,
            trust: self.trust.clone(),
        }
    }
}

/// One openraft connection to a peer.
pub(crate) struct Conn {
    target: u64,
    channel: Result<Channel, String>,
    rpc_timeout: Duration,
    trust: Arc<opendsec_trust::Trust>,
    /// The peer's `host:port`.
    addr: String,
}

fn status_err(s: tonic::Status) -> RPCError<TypeConfig> {
    match s.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => {
            RPCError::Unreachable(Unreachable::new(&s))
        }
        _ => RPCError::Network(NetworkError::new(&s)),
    }
}

fn net_err(e: impl std::fmt::Display) -> RPCError<TypeConfig> {
    RPCError::Network(NetworkError::from_string(e.to_string()))
}

fn to_streaming(e: RPCError<TypeConfig>) -> StreamingError<TypeConfig> {
    match e {
        RPCError::Timeout(t) => StreamingError::Timeout(t),
        RPCError::Unreachable(u) => StreamingError::Unreachable(u),
        RPCError::Network(n) => StreamingError::Network(n),
        RPCError::RemoteError(r) => StreamingError::Network(NetworkError::from_string(r.to_string())),
    }
}

impl Conn {
    fn client(&self) -> Rpc<RaftServiceClient<Channel>> {
        match &self.channel {
            Ok(ch) => Ok(RaftServiceClient::new(ch.clone())
                .max_decoding_message_size(MAX_RAFT_MESSAGE)
                .max_encoding_message_size(MAX_RAFT_MESSAGE)),
            Err(e) => Err(RPCError::Unreachable(Unreachable::from_string(e.clone()))),
        }
    }

    async fn unary<Req, Resp, F, Fut>(&self, req: &Req, ttl: Duration, call: F) -> Rpc<Resp>
    where
        Req: serde::Serialize,
        Resp: serde::de::DeserializeOwned,
        F: FnOnce(RaftServiceClient<Channel>, pb::RaftMessage) -> Fut,
        Fut: Future<Output = Result<tonic::Response<pb::RaftMessage>, tonic::Status>>,
    {
        let msg = pb::RaftMessage {
            payload: encode(req).map_err(net_err)?,
        };
        let client = self.client()?;
        let resp = match tokio::time::timeout(ttl, call(client, msg)).await {
            Ok(r) => r.map_err(status_err)?,
            Err(_) => {
                return Err(RPCError::Unreachable(Unreachable::from_string(format!(
                    "rpc to node {} timed out after {ttl:?}",
                    self.target
                ))));
            }
        };
        decode(&resp.into_inner().payload).map_err(net_err)
    }
}

impl NetStreamAppend<TypeConfig> for Conn {
    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        _option: RPCOption,
    ) -> BoxFuture<'s, Result<StreamOut<'s>, RPCError<TypeConfig>>>
    where
        S: Stream<Item = AppendEntriesRequest<TypeConfig>> + OptionalSend + Unpin + 'static,
    {
        use futures::{FutureExt, StreamExt};
        Box::pin(async move {
            let (target, ttl) = (self.target, self.rpc_timeout);
            let mut input = input;
            // A stream of one request that has ended already (openraft's heartbeat, ten a
            // second per follower) goes over the gRPC connection kept to the peer: a new
            // replication connection would cost a TLS handshake each, on a node that may
            // be too busy to finish one within the heartbeat's interval.
            let mut first = Vec::new();
            if let Some(Some(one)) = input.next().now_or_never() {
                match input.next().now_or_never() {
                    Some(None) => {
                        let r: StreamAppendResult<TypeConfig> = self
                            .unary(&one, ttl, |mut c, m| async move { c.append_one(m).await })
                            .await?;
                        let out: StreamOut<'s> = Box::pin(futures::stream::once(async move { Ok(r) }));
                        return Ok(out);
                    }
                    Some(Some(two)) => first.extend([one, two]),
                    None => first.push(one),
                }
            }
            let input = futures::stream::iter(first).chain(input);
            let conn = crate::replication::connect(target, &self.addr, &self.trust, ttl).await?;
            Ok(crate::replication::stream(conn, input, target, ttl))
        })
    }
}

impl NetTransferLeader<TypeConfig> for Conn {
    async fn transfer_leader(
        &mut self,
        _req: TransferLeaderRequest<TypeConfig>,
        _option: RPCOption,
    ) -> Rpc<TransferLeaderResponse<TypeConfig>> {
        Err(RPCError::Unreachable(Unreachable::from_string(
            "leadership transfer is not part of this transport",
        )))
    }
}

impl NetBackoff<TypeConfig> for Conn {
    fn backoff(&self) -> Option<Backoff> {
        // openraft's configured backoff.
        None
    }
}

impl NetVote<TypeConfig> for Conn {
    async fn vote(&mut self, rpc: VoteRequest<TypeConfig>, option: RPCOption) -> Rpc<VoteResponse<TypeConfig>> {
        let ttl = option.hard_ttl().min(self.rpc_timeout);
        self.unary(&rpc, ttl, |mut c, m| async move { c.vote(m).await }).await
    }

    async fn pre_vote(&mut self, rpc: VoteRequest<TypeConfig>, option: RPCOption) -> Rpc<VoteResponse<TypeConfig>> {
        let ttl = option.hard_ttl().min(self.rpc_timeout);
        self.unary(&rpc, ttl, |mut c, m| async move { c.pre_vote(m).await })
            .await
    }
}

impl NetSnapshot<TypeConfig> for Conn {
    type SnapshotData = Vec<u8>;

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let meta = encode(&(vote, snapshot.meta)).map_err(|e| to_streaming(net_err(e)))?;
        let mut chunks = vec![pb::SnapshotChunk { meta, data: Vec::new() }];
        for c in snapshot.snapshot.chunks(SNAPSHOT_CHUNK) {
            chunks.push(pb::SnapshotChunk {
                meta: Vec::new(),
                data: c.to_vec(),
            });
        }
        let mut client = self.client().map_err(to_streaming)?;
        let ttl = self.rpc_timeout * 20;
        let call = async move {
            match tokio::time::timeout(ttl, client.install_snapshot(tokio_stream::iter(chunks))).await {
                Ok(r) => r.map_err(status_err),
                Err(_) => Err(RPCError::Unreachable(Unreachable::from_string(
                    "snapshot transfer timed out",
                ))),
            }
        };
        let resp = tokio::select! {
            r = call => r.map_err(to_streaming)?,
            closed = cancel => return Err(StreamingError::Closed(closed)),
        };
        decode(&resp.into_inner().payload).map_err(|e| to_streaming(net_err(e)))
    }
}
