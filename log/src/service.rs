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
    let same =
        expected.len() == got.len() && expected.bytes().zip(got.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0;
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
    Ok(Response::new(RaftMessage {
        payload,
        cluster_key: String::new(),
    }))
}

/// The request metadata key carrying the cluster key on streaming calls.
pub(crate) const KEY_HEADER: &str = "opendsec-cluster-key";

type AppendStreamOut = Pin<Box<dyn Stream<Item = Result<RaftMessage, Status>> + Send + 'static>>;

/// The first bytes of a plain replication connection (see `network.rs`).
pub(crate) const APPEND_MAGIC: [u8; 4] = *b"ODR1";

/// Serves one plain replication connection (its magic not yet read): the cluster key in
/// the first frame (the magic comes back if it is right), then append requests in and
/// their results out, in order, as over `AppendStream`. Results ready together go out in
/// one write.
pub(crate) fn serve_raw_append<S: StateMachine>(
    raft: Raft<TypeConfig, SmStore<S>>,
    cluster_key: std::sync::Arc<str>,
    conn: tokio::net::TcpStream,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tokio::spawn(async move {
        let (rd, mut wr) = conn.into_split();
        let mut rd = tokio::io::BufReader::new(rd);
        let mut magic = [0u8; 4];
        if rd.read_exact(&mut magic).await.is_err() || magic != APPEND_MAGIC {
            return;
        }
        let mut key = Vec::new();
        if !matches!(crate::frames::read(&mut rd, &mut key).await, Ok(true)) {
            return;
        }
        if check_key(&cluster_key, std::str::from_utf8(&key).unwrap_or("")).is_err() {
            tracing::warn!("a replication connection without the cluster key was refused");
            return;
        }
        if wr.write_all(&APPEND_MAGIC).await.is_err() {
            return;
        }
        // An undecodable request or a broken connection ends the input; openraft then
        // answers what it received and the leader opens a new stream.
        let input = futures::stream::unfold((rd, Vec::new()), |(mut rd, mut buf)| async move {
            match crate::frames::read(&mut rd, &mut buf).await {
                Ok(true) => match decode::<AppendEntriesRequest<TypeConfig>>(&buf) {
                    Ok(rpc) => Some((rpc, (rd, buf))),
                    Err(e) => {
                        tracing::warn!("undecodable append request on a replication connection: {e}");
                        None
                    }
                },
                _ => None,
            }
        });
        let mut out = Box::pin(raft.stream_append(Box::pin(input)).ready_chunks(64));
        let mut wbuf = Vec::new();
        while let Some(results) = out.next().await {
            wbuf.clear();
            for r in results {
                let Ok(res) = r else { return };
                match encode(&res) {
                    Ok(p) => crate::frames::put(&mut wbuf, &p),
                    Err(e) => {
                        tracing::error!("cannot encode an append result: {e}");
                        return;
                    }
                }
            }
            if wr.write_all(&wbuf).await.is_err() {
                return;
            }
        }
    });
}

#[tonic::async_trait]
impl<S: StateMachine> RaftService for RaftGrpc<S> {
    type AppendStreamStream = AppendStreamOut;

    async fn append_stream(&self, req: Request<Streaming<RaftMessage>>) -> Result<Response<AppendStreamOut>, Status> {
        let key = req
            .metadata()
            .get(KEY_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
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
                Ok(RaftMessage {
                    payload,
                    cluster_key: String::new(),
                })
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

    async fn install_snapshot(&self, req: Request<Streaming<SnapshotChunk>>) -> Result<Response<RaftMessage>, Status> {
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

/// A protocol of the node's own beside gRPC on the peer port: connections whose first
/// four bytes are `magic` go to `serve` (the bytes still unread); every other connection
/// is gRPC (HTTP/2 opens with its fixed preface).
pub struct SideProtocol {
    pub magic: [u8; 4],
    pub serve: std::sync::Arc<dyn Fn(tokio::net::TcpStream) + Send + Sync>,
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
    serve_peer_with(listener, node, extra, None, shutdown).await
}

/// The first bytes of a new connection: `n` of them, fewer if it ends or sends nothing
/// for 10 s. Peeked: they stay to be read.
async fn first_bytes(conn: &tokio::net::TcpStream, n: usize) -> Vec<u8> {
    let mut buf = vec![0u8; n];
    let peek = async {
        loop {
            match conn.peek(&mut buf).await {
                Ok(got) if got >= n || got == 0 => return got,
                Ok(_) => tokio::time::sleep(std::time::Duration::from_millis(1)).await,
                Err(_) => return 0,
            }
        }
    };
    let got = tokio::time::timeout(std::time::Duration::from_secs(10), peek)
        .await
        .unwrap_or(0);
    buf.truncate(got);
    buf
}

/// As [`serve_peer`], with `side` served beside gRPC on the same port. Plain replication
/// connections (see `network.rs`) are always served.
pub async fn serve_peer_with<S: StateMachine>(
    listener: tokio::net::TcpListener,
    node: &LogNode<S>,
    extra: Option<tonic::transport::server::Router>,
    side: Option<SideProtocol>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let router = match extra {
        Some(r) => r.add_service(node.raft_service()),
        None => tonic::transport::Server::builder().add_service(node.raft_service()),
    };
    let (raft, key) = (node.raft().clone(), node.cluster_key());
    let mut sides = vec![SideProtocol {
        magic: APPEND_MAGIC,
        serve: std::sync::Arc::new(move |conn| serve_raw_append(raft.clone(), key.clone(), conn)),
    }];
    sides.extend(side);
    // Each connection is sorted by its first bytes on a task of its own (a slow one holds
    // up no other), then handed to gRPC or to the protocol its magic names. Small
    // messages must not wait for Nagle's algorithm (40 ms stalls with delayed ACKs).
    let (grpc_tx, grpc_rx) = tokio::sync::mpsc::channel::<std::io::Result<tokio::net::TcpStream>>(64);
    let sides = std::sync::Arc::new(sides);
    let accept = tokio::spawn(async move {
        loop {
            let conn = match listener.accept().await {
                Ok((c, _)) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "peer port: accept failed");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = conn.set_nodelay(true);
            let (sides, grpc_tx) = (sides.clone(), grpc_tx.clone());
            tokio::spawn(async move {
                let first = first_bytes(&conn, 4).await;
                match sides.iter().find(|s| s.magic[..] == first[..]) {
                    Some(side) => (side.serve)(conn),
                    None => {
                        let _ = grpc_tx.send(Ok(conn)).await;
                    }
                }
            });
        }
    });
    let served = router
        .serve_with_incoming_shutdown(tokio_stream::wrappers::ReceiverStream::new(grpc_rx), shutdown)
        .await;
    accept.abort();
    served
}
