//! Where a component's HTTP requests go and the byte streams that carry them: an edge's
//! proxy (mutual TLS, the peer checked to be that edge), a plain TCP `host:port`, or a
//! Unix socket (a container's agent). Connecting applies the client's connect timeout
//! and turns Nagle off, in this one place.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpStream, UnixStream};

/// Where a request goes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// Edge `edge`'s proxy at `addr` (`host:port`), over mutual TLS: the far side must
    /// present that edge's certificate, and the client presents its own (see
    /// `Client::with_trust`).
    Edge { addr: String, edge: String },
    /// `host:port` over TCP.
    Tcp(String),
    /// A Unix socket's path.
    Unix(PathBuf),
}

/// The scheme under which Unix sockets appear in the pool's URIs (their path, hex-encoded,
/// is the authority), so that each socket has its own pool of connections.
const UNIX_SCHEME: &str = "unix";
/// The scheme of edges' proxies in the pool's URIs; the edge's name is the authority's
/// user part (`edge@host:port`), so that each edge has its own pool.
const EDGE_SCHEME: &str = "odedge";

impl Endpoint {
    /// The `scheme://authority` the pool keys connections by, and the connector reads back.
    pub(crate) fn base_uri(&self) -> Option<(hyper::http::uri::Scheme, hyper::http::uri::Authority)> {
        match self {
            Endpoint::Edge { addr, edge } => Some((EDGE_SCHEME.parse().ok()?, format!("{edge}@{addr}").parse().ok()?)),
            Endpoint::Tcp(host) => Some((hyper::http::uri::Scheme::HTTP, host.parse().ok()?)),
            Endpoint::Unix(path) => {
                use std::os::unix::ffi::OsStrExt;
                let hex: String = path.as_os_str().as_bytes().iter().map(|b| format!("{b:02x}")).collect();
                Some((UNIX_SCHEME.parse().ok()?, hex.parse().ok()?))
            }
        }
    }

    /// The endpoint a pool URI names (the inverse of `base_uri`).
    pub(crate) fn from_uri(uri: &Uri) -> Option<Endpoint> {
        let authority = uri.authority()?.as_str();
        match uri.scheme_str()? {
            "http" => Some(Endpoint::Tcp(authority.to_string())),
            EDGE_SCHEME => {
                let (edge, addr) = authority.split_once('@')?;
                Some(Endpoint::Edge {
                    addr: addr.to_string(),
                    edge: edge.to_string(),
                })
            }
            UNIX_SCHEME => {
                use std::os::unix::ffi::OsStringExt;
                let bytes = (0..authority.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(authority.get(i..i + 2)?, 16).ok())
                    .collect::<Option<Vec<u8>>>()?;
                Some(Endpoint::Unix(std::ffi::OsString::from_vec(bytes).into()))
            }
            _ => None,
        }
    }

    /// The Host header a request to it carries when the caller set none.
    pub(crate) fn host_header(&self) -> &str {
        match self {
            Endpoint::Edge { addr, .. } => addr,
            Endpoint::Tcp(host) => host,
            Endpoint::Unix(_) => "localhost",
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Edge { addr, edge } => write!(f, "edge {edge} at {addr}"),
            Endpoint::Tcp(host) => f.write_str(host),
            Endpoint::Unix(path) => write!(f, "{}", path.display()),
        }
    }
}

/// Why a connection could not be opened.
#[derive(Clone, Debug, thiserror::Error)]
pub enum ConnectError {
    /// Shared, so that the pool's error (which holds it) can hand out a copy.
    #[error("{0}")]
    Io(std::sync::Arc<io::Error>),
    #[error("no connection within {} s", .0.as_secs_f32())]
    Timeout(Duration),
}

/// A connection to an [`Endpoint`].
#[derive(Debug)]
pub enum Stream {
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>),
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    /// Connects to `to`, giving up after `timeout` when one is set. An edge's proxy is
    /// reached with `trust` (none: refused).
    pub async fn connect(
        to: &Endpoint,
        timeout: Option<Duration>,
        trust: Option<&std::sync::Arc<opendsec_trust::Trust>>,
    ) -> Result<Stream, ConnectError> {
        let connect = async {
            Ok::<_, io::Error>(match to {
                Endpoint::Edge { addr, edge } => {
                    let trust = trust.ok_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::PermissionDenied,
                            "this client has no certificate to reach edges with",
                        )
                    })?;
                    let tcp = TcpStream::connect(addr.as_str()).await?;
                    let _ = tcp.set_nodelay(true);
                    let expect = opendsec_trust::Expect::Exactly(opendsec_trust::Identity::edge(edge));
                    Stream::Tls(Box::new(trust.connect(tcp, &expect).await?))
                }
                Endpoint::Tcp(host) => {
                    let tcp = TcpStream::connect(host.as_str()).await?;
                    // Requests and answers are small and interactive: never hold a write back.
                    let _ = tcp.set_nodelay(true);
                    Stream::Tcp(tcp)
                }
                Endpoint::Unix(path) => Stream::Unix(UnixStream::connect(path).await?),
            })
        };
        let io = |e| ConnectError::Io(std::sync::Arc::new(e));
        match timeout {
            Some(limit) => tokio::time::timeout(limit, connect)
                .await
                .map_err(|_| ConnectError::Timeout(limit))?
                .map_err(io),
            None => connect.await.map_err(io),
        }
    }
}

impl Connection for Stream {
    fn connected(&self) -> Connected {
        Connected::new()
    }
}

impl AsyncRead for Stream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Unix(s) => Pin::new(s).poll_write(cx, buf),
        }
    }
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Unix(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }
    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Tls(s) => s.is_write_vectored(),
            Stream::Tcp(s) => s.is_write_vectored(),
            Stream::Unix(s) => s.is_write_vectored(),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Unix(s) => Pin::new(s).poll_flush(cx),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Stream::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Unix(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

/// The pool's connector: opens a [`Stream`] to the endpoint a pool URI names.
#[derive(Clone, Debug)]
pub(crate) struct Connector {
    pub connect_timeout: Option<Duration>,
    /// The certificate edges' proxies are reached with.
    pub trust: Option<std::sync::Arc<opendsec_trust::Trust>>,
}

type ConnectFuture =
    Pin<Box<dyn std::future::Future<Output = Result<hyper_util::rt::TokioIo<Stream>, ConnectError>> + Send>>;

impl tower_service::Service<Uri> for Connector {
    type Response = hyper_util::rt::TokioIo<Stream>;
    type Error = ConnectError;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let timeout = self.connect_timeout;
        let trust = self.trust.clone();
        Box::pin(async move {
            let to = Endpoint::from_uri(&uri).ok_or_else(|| {
                ConnectError::Io(std::sync::Arc::new(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{uri} names no endpoint"),
                )))
            })?;
            Stream::connect(&to, timeout, trust.as_ref())
                .await
                .map(hyper_util::rt::TokioIo::new)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_survives_the_trip_through_a_pool_uri() {
        for to in [
            Endpoint::Edge {
                addr: "127.0.0.1:7402".into(),
                edge: "edge-1.rack_2".into(),
            },
            Endpoint::Tcp("127.0.0.1:7401".into()),
            Endpoint::Tcp("edge-a.example:80".into()),
            Endpoint::Unix("/run/opendsec/sandboxes/0123456789abcdef0001/agent.sock".into()),
        ] {
            let (scheme, authority) = to.base_uri().unwrap();
            let uri = Uri::builder()
                .scheme(scheme)
                .authority(authority)
                .path_and_query("/x?y")
                .build()
                .unwrap();
            assert_eq!(Endpoint::from_uri(&uri), Some(to));
        }
    }

    #[test]
    fn an_address_that_is_not_host_and_port_is_no_endpoint() {
        assert!(Endpoint::Tcp("not an address".into()).base_uri().is_none());
    }
}
