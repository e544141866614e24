//! The peer port: one listener for everything nodes say to each other, every connection
//! mutual TLS under the cluster's CA (`opendsec_trust`). The TLS handshake comes first:
//! a connection that does not complete it within [`FIRST_BYTES_WITHIN`] is dropped before
//! any of its bytes are read as a protocol's. Then each connection is sorted by its first
//! four bytes, read inside the session: a protocol's magic (see [`crate::handshake`])
//! sends it to that protocol (replication, always; the caller's own, such as write
//! forwarding); anything else is gRPC (HTTP/2 opens with its fixed preface), served by the
//! caller's tonic router plus the Raft service (votes and snapshots).
//!
//! A connection carries the identity of its client's certificate ([`PeerInfo`], also in
//! each gRPC request's extensions), or none for a client that presented no certificate;
//! each protocol decides what it serves whom (replication and Raft: control nodes only).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use opendsec_trust::{Identity, Role};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::{LogNode, StateMachine};

/// How long a new connection may take to finish its TLS handshake and send its first
/// four bytes.
pub const FIRST_BYTES_WITHIN: Duration = Duration::from_secs(5);
/// Connections sorted at once; more wait in the listener's backlog, so silent
/// connections cannot pile up tasks without bound.
const SORTING_AT_ONCE: usize = 256;

/// Who is at the other end of a peer-port connection.
#[derive(Clone, Debug)]
pub struct PeerInfo {
    pub remote: Option<std::net::SocketAddr>,
    /// From the client's certificate (verified by the handshake); `None` if it had none.
    pub identity: Option<Identity>,
}

impl PeerInfo {
    /// Whether the peer is a component of `role`.
    pub fn is(&self, role: Role) -> bool {
        self.identity.as_ref().is_some_and(|i| i.role == role)
    }

    /// The peer's identity for messages ("control node 2", "no certificate").
    pub fn who(&self) -> String {
        match &self.identity {
            Some(i) => i.to_string(),
            None => "a peer without a certificate".into(),
        }
    }
}

/// The peer identity of a gRPC request on the peer port.
pub fn peer_of<T>(req: &tonic::Request<T>) -> PeerInfo {
    req.extensions().get::<PeerInfo>().cloned().unwrap_or(PeerInfo {
        remote: None,
        identity: None,
    })
}

/// A connection on the peer port, its first bytes already read to sort it and replayed
/// to the reader first.
pub struct PeerStream {
    replay: Vec<u8>,
    inner: tokio_rustls::server::TlsStream<TcpStream>,
    info: PeerInfo,
}

/// The halves of a [`PeerStream`] (see [`PeerStream::into_split`]).
pub type PeerReadHalf = tokio::io::ReadHalf<PeerStream>;
pub type PeerWriteHalf = tokio::io::WriteHalf<PeerStream>;

impl PeerStream {
    /// Completes the TLS handshake and reads up to four bytes, all within
    /// [`FIRST_BYTES_WITHIN`] (fewer bytes if the connection ends or stays silent);
    /// `None` if the handshake fails.
    async fn sort(tcp: TcpStream, trust: &opendsec_trust::Trust) -> Option<(PeerStream, Vec<u8>)> {
        let remote = tcp.peer_addr().ok();
        let open = async {
            let (mut inner, identity) = match trust.accept(tcp).await {
                Ok(x) => x,
                Err(e) => {
                    tracing::debug!(?remote, error = %e, "peer port: TLS handshake failed");
                    return None;
                }
            };
            let mut first = [0u8; 4];
            let mut got = 0;
            while got < first.len() {
                match inner.read(&mut first[got..]).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got += n,
                }
            }
            Some((inner, identity, first[..got].to_vec()))
        };
        let (inner, identity, first) = tokio::time::timeout(FIRST_BYTES_WITHIN, open).await.ok()??;
        Some((
            PeerStream {
                replay: first.clone(),
                inner,
                info: PeerInfo { remote, identity },
            },
            first,
        ))
    }

    /// Who the peer is.
    pub fn peer(&self) -> &PeerInfo {
        &self.info
    }

    /// Splits it for a reader and a writer on separate tasks.
    pub fn into_split(self) -> (PeerReadHalf, PeerWriteHalf) {
        tokio::io::split(self)
    }
}

impl AsyncRead for PeerStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.replay.is_empty() {
            return Pin::new(&mut this.inner).poll_read(cx, buf);
        }
        let n = this.replay.len().min(buf.remaining());
        buf.put_slice(&this.replay[..n]);
        this.replay.drain(..n);
        Poll::Ready(Ok(()))
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
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.info.clone()
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
    let raft = node.raft().clone();
    let trust = node.trust().clone();
    let mut sides = vec![SideProtocol {
        magic: crate::replication::PROTOCOL.magic,
        serve: Arc::new(move |conn| crate::replication::serve(raft.clone(), conn)),
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
            let (sides, grpc_tx, trust) = (sides.clone(), grpc_tx.clone(), trust.clone());
            tokio::spawn(async move {
                let sorted = PeerStream::sort(conn, &trust).await;
                drop(permit);
                let Some((conn, first)) = sorted else { return };
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
    use opendsec_trust::{Expect, Identity, Role, test_trust};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn the_bytes_read_to_sort_a_connection_are_read_again_by_its_protocol_with_the_peers_identity() {
        let server = test_trust(Identity::control(1));
        let client = test_trust(Identity::control(2));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let talk = tokio::spawn(async move {
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let mut c = client.connect(tcp, &Expect::Role(Role::Control)).await.unwrap();
            c.write_all(b"ODxxhello").await.unwrap();
            c.shutdown().await.unwrap();
        });
        let (conn, _) = l.accept().await.unwrap();
        let (conn, first) = super::PeerStream::sort(conn, &server).await.unwrap();
        assert_eq!(first, b"ODxx");
        assert_eq!(conn.peer().identity, Some(Identity::control(2)));
        let (mut rd, _wr) = conn.into_split();
        let mut all = Vec::new();
        talk.await.unwrap();
        let _ = rd.read_to_end(&mut all).await;
        assert_eq!(all, b"ODxxhello");
    }

    #[tokio::test]
    async fn a_connection_that_does_not_speak_tls_is_dropped_unsorted() {
        let server = test_trust(Identity::control(1));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
            let _ = c.write_all(b"ODRP\x00\x00\x00\x05hello").await;
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        });
        let (conn, _) = l.accept().await.unwrap();
        assert!(super::PeerStream::sort(conn, &server).await.is_none());
    }
}
