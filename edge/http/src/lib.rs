//! The one HTTP/1.1 client OpenDsec's components call each other with: the gateway
//! forwarding to an edge's proxy, the control plane asking an edge to admit a sandbox,
//! an edge pulling state from another, an edge forwarding to a sandbox's agent.
//!
//! [`Client`] is hyper-util's pooled client over [`Stream`]s to TCP or Unix-socket
//! [`Endpoint`]s: the connect timeout, keep-alive and Nagle are set here and nowhere
//! else. [`send_on`] sends one request over a stream the caller opened itself (a
//! microVM's agent, reached from inside its network namespace; a tunnel through an
//! agent). [`Client::forward`] and [`forward_on`] pass on a request this process
//! received, and join the two sides of a protocol upgrade (WebSocket, a tunnel) when
//! the far side agrees to it. Bodies stream both ways; nothing here buffers one.

mod stream;

pub use hyper::body::Incoming;
pub use hyper_util::rt::TokioIo;
pub use stream::{ConnectError, Endpoint, Stream};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::header::{HOST, HeaderValue, UPGRADE};
use hyper::upgrade::OnUpgrade;
use hyper::{Request, Response, StatusCode, Uri};
use std::time::Duration;

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// A request body: anything that streams bytes.
pub type Body = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// Boxes a body into a [`Body`].
pub fn body<B>(b: B) -> Body
where
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    b.map_err(Into::into).boxed_unsync()
}

/// An empty [`Body`].
pub fn empty() -> Body {
    body(http_body_util::Empty::new())
}

/// A [`Body`] of these bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    body(http_body_util::Full::new(bytes.into()))
}

/// How long a pooled connection may stay idle. Below the 30 s after which an agent
/// (hyper's default header-read timeout) closes an idle connection, so the pool never
/// hands out one its server is closing.
const POOL_IDLE: Duration = Duration::from_secs(10);

/// The most idle connections kept per endpoint: a burst leaves a few behind, not all.
const POOL_MAX_IDLE_PER_ENDPOINT: usize = 16;

/// Why a request got no answer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The endpoint is not a `host:port` (or its Unix path cannot be named in a URI).
    #[error("{0} is not an address a request can go to")]
    BadEndpoint(String),
    /// No connection could be opened.
    #[error("cannot connect to {to}: {source}")]
    Connect { to: String, source: ConnectError },
    /// The connection's HTTP handshake failed.
    #[error("the HTTP handshake with {to} failed: {source}")]
    Handshake { to: String, source: hyper::Error },
    /// The request was sent (or being sent) and no answer came back.
    #[error("{to} failed to answer: {source}")]
    Request { to: String, source: BoxError },
}

impl Error {
    /// Whether the far side did not accept a connection within the connect timeout.
    pub fn is_connect_timeout(&self) -> bool {
        matches!(
            self,
            Error::Connect {
                source: ConnectError::Timeout(_),
                ..
            }
        )
    }
}

/// A pooled HTTP/1.1 client. Cheap to clone: clones share the pool. Its connections'
/// tasks run on the runtime that opened them, so keep a client within one runtime.
#[derive(Clone, Debug)]
pub struct Client {
    pool: hyper_util::client::legacy::Client<stream::Connector, Body>,
}

impl Client {
    /// A client whose connections are kept alive and reused, giving up on a connect
    /// after `connect_timeout` when one is set.
    pub fn new(connect_timeout: Option<Duration>) -> Client {
        Client::build(connect_timeout, POOL_MAX_IDLE_PER_ENDPOINT, None)
    }

    /// A client that opens a connection per request and closes it after.
    pub fn unpooled(connect_timeout: Option<Duration>) -> Client {
        Client::build(connect_timeout, 0, None)
    }

    /// As [`Client::new`], reaching edges' proxies ([`Endpoint::Edge`]) over mutual TLS
    /// as the component `trust` names.
    pub fn with_trust(connect_timeout: Option<Duration>, trust: std::sync::Arc<opendsec_trust::Trust>) -> Client {
        Client::build(connect_timeout, POOL_MAX_IDLE_PER_ENDPOINT, Some(trust))
    }

    fn build(
        connect_timeout: Option<Duration>,
        max_idle: usize,
        trust: Option<std::sync::Arc<opendsec_trust::Trust>>,
    ) -> Client {
        let pool = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_timer(hyper_util::rt::TokioTimer::new())
            .pool_idle_timeout(POOL_IDLE)
            .pool_max_idle_per_host(max_idle)
            // The callers name the Host; a Unix socket's URI authority is no host name.
            .set_host(false)
            .build(stream::Connector { connect_timeout, trust });
        Client { pool }
    }

    /// Sends `req` (its URI's path and query) to `to`. The caller's Host header is kept;
    /// without one, a TCP endpoint's `host:port` (`localhost` for a Unix socket) is sent.
    pub async fn send(&self, to: &Endpoint, mut req: Request<Body>) -> Result<Response<Incoming>, Error> {
        let bad = || Error::BadEndpoint(to.to_string());
        let (scheme, authority) = to.base_uri().ok_or_else(bad)?;
        let path = req.uri().path_and_query().cloned();
        *req.uri_mut() = Uri::builder()
            .scheme(scheme)
            .authority(authority)
            .path_and_query(path.map_or_else(|| "/".to_string(), |p| p.to_string()))
            .build()
            .map_err(|_| bad())?;
        if !req.headers().contains_key(HOST) {
            let host = HeaderValue::from_str(to.host_header()).map_err(|_| bad())?;
            req.headers_mut().insert(HOST, host);
        }
        self.pool.request(req).await.map_err(|e| {
            let to = to.to_string();
            if e.is_connect() {
                let source = std::error::Error::source(&e)
                    .and_then(|s| s.downcast_ref::<ConnectError>())
                    .cloned()
                    .unwrap_or_else(|| ConnectError::Io(std::sync::Arc::new(std::io::Error::other(e.to_string()))));
                Error::Connect { to, source }
            } else {
                Error::Request { to, source: e.into() }
            }
        })
    }

    /// Passes on `req`, a request this process received, to `to`; see [`join_upgrade`].
    pub async fn forward<B>(&self, to: &Endpoint, mut req: Request<B>) -> Result<Response<Incoming>, Error>
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        let client_side = take_upgrade(&mut req);
        let mut resp = self.send(to, req.map(body)).await?;
        join_upgrade(client_side, &mut resp);
        Ok(resp)
    }
}

/// Sends `req` as the one request of a new connection over `io` (a stream the caller
/// opened: a microVM's agent, a tunnel). `to` names the far side in errors. A protocol
/// upgrade the far side agrees to is the caller's to take (`hyper::upgrade::on`).
pub async fn send_on<I>(to: &str, io: I, req: Request<Body>) -> Result<Response<Incoming>, Error>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io)
        .await
        .map_err(|source| Error::Handshake {
            to: to.to_string(),
            source,
        })?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "connection ended");
        }
    });
    sender.send_request(req).await.map_err(|e| Error::Request {
        to: to.to_string(),
        source: e.into(),
    })
}

/// [`send_on`] for a request this process received; see [`join_upgrade`].
pub async fn forward_on<I, B>(to: &str, io: I, mut req: Request<B>) -> Result<Response<Incoming>, Error>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    B: http_body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    let client_side = take_upgrade(&mut req);
    let mut resp = send_on(to, io, req.map(body)).await?;
    join_upgrade(client_side, &mut resp);
    Ok(resp)
}

/// The upgrade of a received request that asks for one (it carries `Upgrade`): taken
/// before the request is passed on, since passing it on gives its extensions away.
pub fn take_upgrade<B>(req: &mut Request<B>) -> Option<OnUpgrade> {
    req.headers()
        .contains_key(UPGRADE)
        .then(|| hyper::upgrade::on(&mut *req))
}

/// When the far side agreed to the upgrade (101), joins the upgraded connection of the
/// caller (`client_side`) and of the far side and copies bytes both ways until either
/// ends. The 101 itself goes back to the caller as any answer does.
pub fn join_upgrade(client_side: Option<OnUpgrade>, resp: &mut Response<Incoming>) {
    let Some(client_side) = client_side else { return };
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        return;
    }
    let far_side = hyper::upgrade::on(resp);
    tokio::spawn(async move {
        if let (Ok(near), Ok(far)) = (client_side.await, far_side.await) {
            let mut near = TokioIo::new(near);
            let mut far = TokioIo::new(far);
            let _ = tokio::io::copy_bidirectional(&mut near, &mut far).await;
        }
    });
}
