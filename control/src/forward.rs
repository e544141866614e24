//! The write-forwarding protocol: how a follower hands the writes it gets to the
//! leader, the one way it does.
//!
//! A follower keeps one mutual-TLS connection per leader, on the leader's peer port. It
//! opens with the versioned handshake of `opendsec_log::handshake` ([`PROTOCOL`]), with no
//! credentials: only control nodes forward, each side checks the other's certificate
//! names one, and any other peer is closed on before a frame is read. Then, in version 1, each side sends
//! length-prefixed protobuf frames (`StreamedSubmit` one way, `StreamedReply` the other,
//! matched by id, replies in any order). Writes queued meanwhile go out in one `write`
//! call. Each write carries its caller's bearer token and is authenticated and
//! authorised again by the leader, as if the caller had come there.
//!
//! Why not gRPC: over an HTTP/2 stream each write crossed five tasks and HTTP/2's framing
//! and flow control both ways, and a 3-node cluster with every client on the leader wrote
//! about a fifth more than one whose followers forwarded that way.
//!
//! A leader that speaks none of the versions offered answers with its reason, which
//! both sides log; the writes waiting fail as unavailable, never sent.

use crate::node::ControlNode;
use crate::pb::{StreamedReply, StreamedSubmit, SubmitReply, SubmitRequest};
use opendsec_log::PeerStream;
use opendsec_log::handshake::{HandshakeError, Protocol};
use opendsec_trust::{Expect, Role, Trust};
use prost::Message;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncWrite, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

type Conn = tokio_rustls::client::TlsStream<TcpStream>;

/// The write-forwarding protocol's opening: magic `ODFW`, and the versions this build speaks.
pub const PROTOCOL: Protocol = Protocol {
    name: "write forwarding",
    magic: *b"ODFW",
    versions: &[1],
};
/// How long connecting and the handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest forwarded write (a command's JSON, its bearer and request id): well over
/// the largest command the limits allow, far under what a hostile peer could make the
/// leader allocate.
pub const MAX_FORWARDED_FRAME: usize = 4 << 20;
/// Writes one connection may have in decision at once; the leader reads the next frame
/// only when one of them is answered (back-pressure to the follower).
pub const MAX_IN_FLIGHT: usize = 512;

/// Why a write was not forwarded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ForwardError {
    /// The leader speaks none of the versions offered; the write was not sent.
    #[error("{0}")]
    Refused(String),
    /// The connection failed (the write's outcome may be unknown).
    #[error("{0}")]
    Failed(String),
}

type Waiter = oneshot::Sender<Result<SubmitReply, ForwardError>>;

fn put_frame(out: &mut Vec<u8>, msg: &impl Message) {
    opendsec_log::frames::put(out, &msg.encode_to_vec());
}

/// A queue of messages to write: the follower's (its writes, bounded by its callers) or
/// the leader's (replies, bounded by [`MAX_IN_FLIGHT`]).
trait Queue<M> {
    async fn next(&mut self) -> Option<M>;
    fn more(&mut self) -> Option<M>;
}

impl<M> Queue<M> for mpsc::UnboundedReceiver<M> {
    async fn next(&mut self) -> Option<M> {
        self.recv().await
    }
    fn more(&mut self) -> Option<M> {
        self.try_recv().ok()
    }
}

impl<M> Queue<M> for mpsc::Receiver<M> {
    async fn next(&mut self) -> Option<M> {
        self.recv().await
    }
    fn more(&mut self) -> Option<M> {
        self.try_recv().ok()
    }
}

/// Writes what `rx` yields, as frames, each batch of queued messages in one call.
async fn write_frames<M: Message>(mut w: impl AsyncWrite + Unpin, mut rx: impl Queue<M>) -> String {
    let mut buf = Vec::new();
    while let Some(first) = rx.next().await {
        buf.clear();
        put_frame(&mut buf, &first);
        while let Some(more) = rx.more() {
            put_frame(&mut buf, &more);
        }
        if let Err(e) = w.write_all(&buf).await {
            return format!("writing to the connection: {e}");
        }
    }
    "the node is closing".into()
}

/// Serves one forwarding connection on the leader (its magic not yet read).
pub fn serve(node: ControlNode, conn: PeerStream) {
    tokio::spawn(async move {
        if !conn.peer().is(Role::Control) {
            tracing::warn!(peer = %conn.peer().who(), remote = ?conn.peer().remote, "a forwarding connection from outside the control plane was refused");
            return;
        }
        let (rd, mut wr) = conn.into_split();
        let mut rd = BufReader::new(rd);
        let hello = match PROTOCOL.read_hello(&mut rd).await {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!(error = %e, "a forwarding connection ended before its opening");
                return;
            }
        };
        let choice = PROTOCOL.choose(&hello.versions);
        if PROTOCOL.answer(&mut wr, &choice).await.is_err() || choice.is_err() {
            return;
        }
        let (tx, rx) = mpsc::channel::<StreamedReply>(MAX_IN_FLIGHT);
        let writer = tokio::spawn(write_frames(wr, rx));
        let in_flight = Arc::new(tokio::sync::Semaphore::new(MAX_IN_FLIGHT));
        let mut buf = Vec::new();
        loop {
            let Ok(permit) = in_flight.clone().acquire_owned().await else {
                break;
            };
            match opendsec_log::frames::read_at_most(&mut rd, &mut buf, MAX_FORWARDED_FRAME).await {
                Ok(true) => {}
                Ok(false) => break,
                Err(e) => {
                    tracing::debug!(error = %e, "forwarding connection ended");
                    break;
                }
            }
            let Ok(m) = StreamedSubmit::decode(buf.as_slice()) else {
                tracing::warn!("a forwarded write does not decode; closing its connection");
                break;
            };
            // Each write is decided on its own task: a slow one holds no other back.
            let (node, tx) = (node.clone(), tx.clone());
            tokio::spawn(async move {
                let reply = crate::peer::submit_forwarded(&node, m.request.unwrap_or_default()).await;
                let _ = tx
                    .send(StreamedReply {
                        id: m.id,
                        reply: Some(reply),
                    })
                    .await;
                drop(permit);
            });
        }
        // Replies still being decided go out as they come; the writer ends with the last.
        drop(tx);
        let _ = writer.await;
    });
}

/// A follower's connection to one leader for forwarding writes. Cloning shares it.
/// Once it breaks (or the leader refused it), every write waiting on it fails and
/// [`Forwarder::is_closed`] turns true: the node then opens a new one.
#[derive(Clone)]
pub struct Forwarder {
    queue: mpsc::UnboundedSender<(SubmitRequest, Waiter)>,
    /// Why it closed, once it did.
    closed: Arc<OnceLock<ForwardError>>,
}

impl Forwarder {
    /// Starts connecting to the leader's peer address `addr` (`host:port`) as `trust`'s
    /// control node.
    pub fn new(addr: String, trust: Arc<Trust>) -> Forwarder {
        Forwarder::offering(addr, trust, PROTOCOL.versions)
    }

    /// As [`Forwarder::new`], offering `versions` instead of those this build speaks
    /// (tests of the negotiation).
    pub fn offering(addr: String, trust: Arc<Trust>, versions: &'static [u16]) -> Forwarder {
        let (queue, rx) = mpsc::unbounded_channel();
        let closed = Arc::new(OnceLock::new());
        tokio::spawn(run(addr, trust, versions, rx, closed.clone()));
        Forwarder { queue, closed }
    }

    /// Whether it can take no more writes.
    pub fn is_closed(&self) -> bool {
        self.closed.get().is_some()
    }

    /// Forwards one write and waits for the leader's reply.
    pub async fn submit(&self, req: SubmitRequest) -> Result<SubmitReply, ForwardError> {
        let (tx, rx) = oneshot::channel();
        self.queue.send((req, tx)).map_err(|_| {
            self.closed
                .get()
                .cloned()
                .unwrap_or_else(|| ForwardError::Failed("closed".into()))
        })?;
        rx.await
            .map_err(|_| ForwardError::Failed("the connection to the leader closed before its reply".into()))?
    }
}

/// Connects and negotiates the version. A refusal is logged here (the leader logs it too).
async fn connect(addr: &str, trust: &Trust, versions: &[u16]) -> Result<Conn, ForwardError> {
    let handshake = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| ForwardError::Failed(format!("connecting to the leader {addr}: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let mut conn = trust
            .connect(tcp, &Expect::Role(Role::Control))
            .await
            .map_err(|e| ForwardError::Failed(format!("the leader {addr}: TLS: {e}")))?;
        match PROTOCOL.offer(&mut conn, versions, &[]).await {
            Ok(_version) => Ok(conn),
            Err(e @ HandshakeError::Refused { .. }) => {
                tracing::warn!(leader = %addr, error = %e, "the leader refused to take forwarded writes");
                Err(ForwardError::Refused(format!("the leader {addr}: {e}")))
            }
            Err(e) => Err(ForwardError::Failed(format!("the leader {addr}: {e}"))),
        }
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
        .await
        .unwrap_or_else(|_| {
            Err(ForwardError::Failed(format!(
                "the leader {addr} did not answer within {HANDSHAKE_TIMEOUT:?}"
            )))
        })
}

async fn run(
    addr: String,
    trust: Arc<Trust>,
    versions: &'static [u16],
    mut rx: mpsc::UnboundedReceiver<(SubmitRequest, Waiter)>,
    closed: Arc<OnceLock<ForwardError>>,
) {
    let conn = match connect(&addr, &trust, versions).await {
        Ok(c) => c,
        Err(e) => {
            // Nothing was sent.
            let _ = closed.set(e.clone());
            rx.close();
            while let Ok((_, w)) = rx.try_recv() {
                let _ = w.send(Err(e.clone()));
            }
            return;
        }
    };
    let (rd, wr) = tokio::io::split(conn);
    let pending: Arc<Mutex<HashMap<u64, Waiter>>> = Arc::new(Mutex::new(HashMap::new()));
    // The writer numbers each write and files its waiter before the write goes out.
    let (out, out_rx) = mpsc::unbounded_channel::<StreamedSubmit>();
    let filing = pending.clone();
    let mut next_id = 0u64;
    let pump = async {
        while let Some((req, waiter)) = rx.recv().await {
            next_id += 1;
            filing.lock().unwrap_or_else(|e| e.into_inner()).insert(next_id, waiter);
            if out
                .send(StreamedSubmit {
                    id: next_id,
                    request: Some(req),
                })
                .is_err()
            {
                break;
            }
        }
        "the node is closing".to_string()
    };
    let writer = write_frames(wr, out_rx);
    let answering = pending.clone();
    let reader = async move {
        let mut rd = BufReader::new(rd);
        let mut buf = Vec::new();
        loop {
            match opendsec_log::frames::read(&mut rd, &mut buf).await {
                Ok(true) => {}
                Ok(false) => return "the leader closed the connection".to_string(),
                Err(e) => return format!("reading from the leader: {e}"),
            }
            let Ok(StreamedReply { id, reply }) = StreamedReply::decode(buf.as_slice()) else {
                return "the leader sent a reply that does not decode".into();
            };
            let waiter = answering.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
            if let Some(w) = waiter {
                let _ = w.send(reply.ok_or_else(|| ForwardError::Failed("the leader sent an empty reply".into())));
            }
        }
    };
    let why = tokio::select! {
        w = pump => w,
        w = writer => w,
        w = reader => w,
    };
    let why = ForwardError::Failed(format!("leader {addr}: {why}"));
    let _ = closed.set(why.clone());
    rx.close();
    let mut left: Vec<Waiter> = pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
        .map(|(_, w)| w)
        .collect();
    left.extend(std::iter::from_fn(|| rx.try_recv().ok().map(|(_, w)| w)));
    for w in left {
        let _ = w.send(Err(why.clone()));
    }
}
