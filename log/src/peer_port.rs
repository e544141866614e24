//! The peer port: one listener for everything nodes say to each other. Each connection
//! is sorted by its first four bytes, read from the connection once it is up: a
//! protocol's magic (see [`crate::handshake`]) sends it to that protocol (replication,
//! always; the caller's own, such as write forwarding); anything else is gRPC (HTTP/2
//! opens with its fixed preface), served by the caller's tonic router plus the Raft
//! service (votes and snapshots).
//!
//! The bytes are read through [`PeerStream`], not peeked at the TCP layer, and replayed
//! to whoever takes the connection: when mutual TLS goes under the peer port, the same
//! sorting runs on the decrypted session after the TLS handshake.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::{LogNode, StateMachine};

/// How long a new connection may take to send its first four bytes.
const FIRST_BYTES_WITHIN: Duration = Duration::from_secs(5);
/// Connections sorted at once; more wait in the listener's backlog, so silent
/// connections cannot pile up tasks without bound.
const SORTING_AT_ONCE: usize = 256;

/// A connection on the peer port, its first bytes already read to sort it and replayed
/// to the reader first.
pub struct PeerStream {
    replay: Vec<u8>,
    inner: TcpStream,
}

/// The read half of a [`PeerStream`] (see [`PeerStream::into_split`]).
pub struct PeerReadHalf {
    replay: Vec<u8>,
    inner: tokio::net::tcp::OwnedReadHalf,
}

/// Serves `replay` before reading `inner`.
fn poll_replay<R: AsyncRead + Unpin>(
    replay: &mut Vec<u8>,
    inner: &mut R,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
) -> Poll<std::io::Result<()>> {
    if replay.is_empty() {
        return Pin::new(inner).poll_read(cx, buf);
    }
    let n = replay.len().min(buf.remaining());
    buf.put_slice(&replay[..n]);
    replay.drain(..n);
    Poll::Ready(Ok(()))
}

impl PeerStream {
    /// Reads up to four bytes (fewer if the connection ends or stays silent for 10 s).
    async fn sort(mut inner: TcpStream) -> (PeerStream, Vec<u8>) {
        let mut first = [0u8; 4];
        let mut got = 0;
        let read = async {
            while got < first.len() {
                match inner.read(&mut first[got..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n,
                }
            }
        };
        let _ = tokio::time::timeout(FIRST_BYTES_WITHIN, read).await;
        let first = first[..got].to_vec();
        (
            PeerStream {
                replay: first.clone(),
                inner,
            },
            first,
        )
    }

    /// Splits it for a reader and a writer on separate tasks.
    pub fn into_split(self) -> (PeerReadHalf, tokio::net::tcp::OwnedWriteHalf) {
        let (rd, wr) = self.inner.into_split();
        (
            PeerReadHalf {
                replay: self.replay,
                inner: rd,
            },
            wr,
        )
    }
}

impl AsyncRead for PeerReadHalf {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        poll_replay(&mut this.replay, &mut this.inner, cx, buf)
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        poll_replay(&mut this.replay, &mut this.inner, cx, buf)
    }
}

impl AsyncWrite for PeerStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl tonic::transport::server::Connected for PeerStream {
    type ConnectInfo = tonic::transport::server::TcpConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

/// The peer port's gRPC server, bounded against peers that hold connections and streams
/// open: at most 64 streams per connection, and keep-alive pings that end a connection
/// whose peer stopped answering.
pub fn grpc_server() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .max_concurrent_streams(Some(64))
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
}

/// A protocol of the node's own beside gRPC on the peer port: connections whose first
/// four bytes are `magic` go to `serve`, those bytes still to be read (so that its
/// handshake reads the whole opening).
pub struct SideProtocol {
    pub magic: [u8; 4],
    pub serve: Arc<dyn Fn(PeerStream) + Send + Sync>,
}

/// Serve the Raft peer protocols (plus whatever `extra` already routes) on `listener` until
/// `shutdown` completes. `extra` is a router made with `tonic::transport::Server::builder()`
/// carrying the node's other peer-port gRPC services; `None` serves the log's alone.
pub async fn serve_peer<S: StateMachine>(
    listener: tokio::net::TcpListener,
    node: &LogNode<S>,
    extra: Option<tonic::transport::server::Router>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_peer_with(listener, node, extra, None, shutdown).await
}

/// As [`serve_peer`], with `side` served beside gRPC on the same port. Replication
/// connections (see [`crate::replication`]) are always served.
pub async fn serve_peer_with<S: StateMachine>(
    listener: tokio::net::TcpListener,
    node: &LogNode<S>,
    extra: Option<tonic::transport::server::Router>,
    side: Option<SideProtocol>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let router = match extra {
        Some(r) => r.add_service(node.raft_service()),
        None => grpc_server().add_service(node.raft_service()),
    };
    let (raft, key) = (node.raft().clone(), node.cluster_key());
    let mut sides = vec![SideProtocol {
        magic: crate::replication::PROTOCOL.magic,
        serve: Arc::new(move |conn| crate::replication::serve(raft.clone(), key.clone(), conn)),
    }];
    sides.extend(side);
    // Each connection is sorted on a task of its own (a slow one holds up no other), then
    // handed to gRPC or to the protocol its magic names. Small messages must not wait
    // for Nagle's algorithm (40 ms stalls with delayed ACKs).
    let (grpc_tx, grpc_rx) = tokio::sync::mpsc::channel::<std::io::Result<PeerStream>>(64);
    let sides = Arc::new(sides);
    let sorting = Arc::new(tokio::sync::Semaphore::new(SORTING_AT_ONCE));
    let accept = tokio::spawn(async move {
        loop {
            let Ok(permit) = sorting.clone().acquire_owned().await else {
                return;
            };
            let conn = match listener.accept().await {
                Ok((c, _)) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "peer port: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = conn.set_nodelay(true);
            let (sides, grpc_tx) = (sides.clone(), grpc_tx.clone());
            tokio::spawn(async move {
                let (conn, first) = PeerStream::sort(conn).await;
                drop(permit);
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

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_bytes_read_to_sort_a_connection_are_read_again_by_its_protocol() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let client = tokio::spawn(async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            c.write_all(b"ODxxhello").await.unwrap();
        });
        let (conn, _) = l.accept().await.unwrap();
        let (conn, first) = super::PeerStream::sort(conn).await;
        assert_eq!(first, b"ODxx");
        let (mut rd, _wr) = conn.into_split();
        let mut all = Vec::new();
        client.await.unwrap();
        rd.read_to_end(&mut all).await.unwrap();
        assert_eq!(all, b"ODxxhello");
    }
}
