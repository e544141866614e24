//! Raft client side: openraft's network factory over tonic gRPC.
//!
//! One lazily-connected tonic `Channel` per peer is kept and shared by every openraft
//! connection to that peer. A tonic channel re-establishes its HTTP/2 connection by itself
//! after a failure, so a killed peer that comes back on the same address is reached again
//! without any action here; a changed address replaces the channel.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use openraft::base::{BoxFuture, BoxStream};
use openraft::errors::{NetworkError, RPCError, ReplicationClosed, StreamingError, Unreachable};
use openraft::network::{RPCOption, RaftNetworkFactory, stream_append_sequential, v2::RaftNetworkV2};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, StreamAppendResult, VoteRequest, VoteResponse,
};
use openraft::{BasicNode, OptionalSend};
use tonic::transport::{Channel, Endpoint};

use crate::pb;
use crate::pb::raft_service_client::RaftServiceClient;
use crate::typ::{Snapshot, Vote};
use crate::{TypeConfig, decode, encode};

/// Snapshot bytes per gRPC stream message.
const SNAPSHOT_CHUNK: usize = 1024 * 1024;
/// Append requests encoded ahead of the transport on a replication stream.
const STREAM_AHEAD: usize = 16;

type Rpc<T> = Result<T, RPCError<TypeConfig>>;

/// The openraft network factory: hands out connections sharing one channel per peer.
#[derive(Clone)]
pub(crate) struct Network {
    channels: Arc<Mutex<HashMap<u64, (String, Channel)>>>,
    rpc_timeout: Duration,
    cluster_key: Arc<str>,
}

impl Network {
    pub(crate) fn new(rpc_timeout: Duration, cluster_key: &str) -> Self {
        Network {
            channels: Arc::new(Mutex::new(HashMap::new())),
            rpc_timeout,
            cluster_key: Arc::from(cluster_key),
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
            .tcp_nodelay(true)
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .connect_lazy();
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
            cluster_key: self.cluster_key.clone(),
            unary_only: false,
            plain: true,
        }
    }
}

/// One openraft connection to a peer.
pub(crate) struct Conn {
    target: u64,
    channel: Result<Channel, String>,
    rpc_timeout: Duration,
    cluster_key: Arc<str>,
    /// The peer's `host:port`.
    addr: String,
    /// The peer does not serve `AppendStream` (an older version): replicate with unary calls.
    unary_only: bool,
    /// Replicate over a plain connection (see [`Conn::open_plain_append`]) until the peer
    /// turns out not to speak it.
    plain: bool,
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
                .max_decoding_message_size(usize::MAX)
                .max_encoding_message_size(usize::MAX)),
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
            cluster_key: self.cluster_key.to_string(),
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

/// Aborts the task feeding a replication stream when the response side is dropped, so that
/// openraft's request generator (which holds its replication state) is dropped with it, as it
/// would be with a unary transport.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Unreachable, if the oldest unanswered request on a replication stream (`sent`: when
/// each was handed to the transport) has waited `ttl` or more.
fn overdue(sent: &Mutex<VecDeque<Instant>>, ttl: Duration, target: u64) -> Option<RPCError<TypeConfig>> {
    let stale = sent
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .front()
        .is_some_and(|t| t.elapsed() >= ttl);
    stale.then(|| {
        RPCError::Unreachable(Unreachable::from_string(format!(
            "node {target} did not answer an append request within {ttl:?}"
        )))
    })
}

type StreamOut<'s> = BoxStream<'s, Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>>;

impl Conn {
    /// Pipelined replication over one `AppendStream` call: requests go out as openraft makes
    /// them; answers come back in order. A request unanswered for `rpc_timeout` ends the
    /// stream as unreachable.
    async fn open_append_stream<S>(&mut self, mut input: S) -> Rpc<StreamOut<'static>>
    where
        S: Stream<Item = AppendEntriesRequest<TypeConfig>> + OptionalSend + Unpin + 'static,
    {
        let mut client = self.client()?;
        // When each request was handed to the transport, oldest first (one per unanswered request).
        let sent: Arc<Mutex<VecDeque<Instant>>> = Arc::default();
        let (tx, rx) = tokio::sync::mpsc::channel::<pb::RaftMessage>(STREAM_AHEAD);
        let feeder = {
            let sent = sent.clone();
            tokio::spawn(async move {
                while let Some(rpc) = input.next().await {
                    let payload = match encode(&rpc) {
                        Ok(p) => p,
                        Err(e) => {
                            tracing::error!("cannot encode an append request: {e}");
                            break;
                        }
                    };
                    sent.lock().unwrap_or_else(|e| e.into_inner()).push_back(Instant::now());
                    if tx
                        .send(pb::RaftMessage {
                            payload,
                            cluster_key: String::new(),
                        })
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            })
        };
        let guard = AbortOnDrop(feeder.abort_handle());
        let mut req = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let key = tonic::metadata::MetadataValue::try_from(&*self.cluster_key).map_err(net_err)?;
        req.metadata_mut().insert(crate::service::KEY_HEADER, key);
        let ttl = self.rpc_timeout;
        let resp = match tokio::time::timeout(ttl, client.append_stream(req)).await {
            Ok(Ok(r)) => r,
            Ok(Err(s)) if s.code() == tonic::Code::Unimplemented => {
                tracing::info!(
                    target = self.target,
                    "peer has no AppendStream: replicating with unary calls"
                );
                self.unary_only = true;
                return Err(status_err(s));
            }
            Ok(Err(s)) => return Err(status_err(s)),
            Err(_) => {
                return Err(RPCError::Unreachable(Unreachable::from_string(format!(
                    "opening a replication stream to node {} timed out after {ttl:?}",
                    self.target
                ))));
            }
        };
        let target = self.target;
        let inbound = resp.into_inner();
        let out = futures::stream::unfold(Some((inbound, sent, guard)), move |state| async move {
            let (mut inbound, sent, guard) = state?;
            loop {
                match tokio::time::timeout(ttl / 2, inbound.message()).await {
                    Ok(Ok(Some(m))) => {
                        sent.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
                        return match decode::<StreamAppendResult<TypeConfig>>(&m.payload) {
                            Ok(r) => Some((Ok(r), Some((inbound, sent, guard)))),
                            Err(e) => Some((Err(net_err(e)), None)),
                        };
                    }
                    Ok(Ok(None)) => return None,
                    Ok(Err(s)) => return Some((Err(status_err(s)), None)),
                    Err(_) => {
                        if let Some(e) = overdue(&sent, ttl, target) {
                            return Some((Err(e), None));
                        }
                    }
                }
            }
        });
        Ok(Box::pin(out))
    }
}

/// Why a plain replication connection was not opened.
enum PlainOpen {
    /// The peer is not there: as unreachable as over gRPC.
    Unreachable(String),
    /// The peer answered otherwise (an older version, or it refused the key): use gRPC,
    /// which reports a refusal properly.
    NotSpoken,
}

impl Conn {
    /// Connects, presents the cluster key and waits for the magic back.
    async fn plain_handshake(&self) -> Result<tokio::net::TcpStream, PlainOpen> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let ttl = self.rpc_timeout;
        let open = async {
            let mut conn = tokio::net::TcpStream::connect(&self.addr).await.map_err(|e| {
                PlainOpen::Unreachable(format!("connecting to node {} at {}: {e}", self.target, self.addr))
            })?;
            let _ = conn.set_nodelay(true);
            let mut hello = crate::service::APPEND_MAGIC.to_vec();
            crate::frames::put(&mut hello, self.cluster_key.as_bytes());
            conn.write_all(&hello)
                .await
                .map_err(|e| PlainOpen::Unreachable(format!("writing to node {}: {e}", self.target)))?;
            let mut answer = [0u8; 4];
            match conn.read_exact(&mut answer).await {
                Ok(_) if answer == crate::service::APPEND_MAGIC => Ok(conn),
                _ => Err(PlainOpen::NotSpoken),
            }
        };
        match tokio::time::timeout(ttl, open).await {
            Ok(r) => r,
            Err(_) => Err(PlainOpen::Unreachable(format!(
                "opening a replication connection to node {} timed out after {ttl:?}",
                self.target
            ))),
        }
    }

    /// Pipelined replication over a plain connection on the peer port (magic `ODR1`, the
    /// cluster key, then length-prefixed requests one way and results the other, in
    /// order): the same exchange as `AppendStream` without HTTP/2's framing, flow
    /// control and task hops. Requests ready together go out in one write. A request
    /// unanswered for `rpc_timeout` ends the stream as unreachable.
    fn open_plain_append<S>(&self, conn: tokio::net::TcpStream, input: S) -> StreamOut<'static>
    where
        S: Stream<Item = AppendEntriesRequest<TypeConfig>> + OptionalSend + Unpin + 'static,
    {
        use tokio::io::AsyncWriteExt;
        let (rd, mut wr) = conn.into_split();
        // When each request was handed to the transport, oldest first (one per unanswered request).
        let sent: Arc<Mutex<VecDeque<Instant>>> = Arc::default();
        let feeder = {
            let sent = sent.clone();
            tokio::spawn(async move {
                let mut input = input.ready_chunks(STREAM_AHEAD);
                let mut buf = Vec::new();
                while let Some(rpcs) = input.next().await {
                    buf.clear();
                    for rpc in &rpcs {
                        match encode(rpc) {
                            Ok(p) => crate::frames::put(&mut buf, &p),
                            Err(e) => {
                                tracing::error!("cannot encode an append request: {e}");
                                return;
                            }
                        }
                    }
                    {
                        let mut sent = sent.lock().unwrap_or_else(|e| e.into_inner());
                        let now = Instant::now();
                        sent.extend(std::iter::repeat_n(now, rpcs.len()));
                    }
                    if wr.write_all(&buf).await.is_err() {
                        return;
                    }
                }
            })
        };
        let guard = AbortOnDrop(feeder.abort_handle());
        let (target, ttl) = (self.target, self.rpc_timeout);
        let rd = tokio::io::BufReader::new(rd);
        let out = futures::stream::unfold(Some((rd, Vec::new(), sent, guard)), move |state| async move {
            let (mut rd, mut buf, sent, guard) = state?;
            loop {
                match tokio::time::timeout(ttl / 2, crate::frames::read(&mut rd, &mut buf)).await {
                    Ok(Ok(true)) => {
                        sent.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
                        return match decode::<StreamAppendResult<TypeConfig>>(&buf) {
                            Ok(r) => Some((Ok(r), Some((rd, buf, sent, guard)))),
                            Err(e) => Some((Err(net_err(e)), None)),
                        };
                    }
                    Ok(Ok(false)) => return None,
                    Ok(Err(e)) => {
                        return Some((
                            Err(RPCError::Unreachable(Unreachable::from_string(format!(
                                "replication connection to node {target}: {e}"
                            )))),
                            None,
                        ));
                    }
                    Err(_) => {
                        if let Some(e) = overdue(&sent, ttl, target) {
                            return Some((Err(e), None));
                        }
                    }
                }
            }
        });
        Box::pin(out)
    }
}

impl RaftNetworkV2<TypeConfig> for Conn {
    type SnapshotData = Vec<u8>;

    fn stream_append<'s, S>(
        &'s mut self,
        input: S,
        option: RPCOption,
    ) -> BoxFuture<'s, Result<StreamOut<'s>, RPCError<TypeConfig>>>
    where
        S: Stream<Item = AppendEntriesRequest<TypeConfig>> + OptionalSend + Unpin + 'static,
    {
        if self.unary_only {
            return stream_append_sequential(self, input, option);
        }
        Box::pin(async move {
            if self.plain {
                match self.plain_handshake().await {
                    Ok(conn) => return Ok(self.open_plain_append(conn, input)),
                    Err(PlainOpen::Unreachable(why)) => {
                        return Err(RPCError::Unreachable(Unreachable::from_string(why)));
                    }
                    Err(PlainOpen::NotSpoken) => {
                        tracing::info!(
                            target = self.target,
                            "peer does not replicate over plain connections: using gRPC"
                        );
                        self.plain = false;
                    }
                }
            }
            self.open_append_stream(input).await
        })
    }

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<TypeConfig>> {
        let ttl = option.hard_ttl().max(self.rpc_timeout);
        self.unary(&rpc, ttl, |mut c, m| async move { c.append_entries(m).await })
            .await
    }

    async fn vote(&mut self, rpc: VoteRequest<TypeConfig>, option: RPCOption) -> Rpc<VoteResponse<TypeConfig>> {
        let ttl = option.hard_ttl().min(self.rpc_timeout);
        self.unary(&rpc, ttl, |mut c, m| async move { c.vote(m).await }).await
    }

    async fn pre_vote(&mut self, rpc: VoteRequest<TypeConfig>, option: RPCOption) -> Rpc<VoteResponse<TypeConfig>> {
        let ttl = option.hard_ttl().min(self.rpc_timeout);
        self.unary(&rpc, ttl, |mut c, m| async move { c.pre_vote(m).await })
            .await
    }

    async fn full_snapshot(
        &mut self,
        vote: Vote,
        snapshot: Snapshot,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        _option: RPCOption,
    ) -> Result<SnapshotResponse<TypeConfig>, StreamingError<TypeConfig>> {
        let meta = encode(&(vote, snapshot.meta)).map_err(|e| to_streaming(net_err(e)))?;
        let mut chunks = vec![pb::SnapshotChunk {
            meta,
            data: Vec::new(),
            cluster_key: self.cluster_key.to_string(),
        }];
        for c in snapshot.snapshot.chunks(SNAPSHOT_CHUNK) {
            chunks.push(pb::SnapshotChunk {
                meta: Vec::new(),
                data: c.to_vec(),
                cluster_key: String::new(),
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
