//! Forwarding writes to the leader over a plain framed connection on the peer port.
//!
//! A follower forwards every write it gets to the leader. Over gRPC each write crossed
//! five tasks and HTTP/2's framing and flow control both ways: with every client on the
//! leader, a 3-node cluster wrote about a fifth more. Here a follower keeps one TCP
//! connection per leader:
//! it opens with [`MAGIC`], the leader answers [`MAGIC`], then each side sends
//! length-prefixed protobuf frames (`StreamedSubmit` one way, `StreamedReply` the
//! other, matched by id, replies in any order). Writes queued meanwhile go out in one
//! `write` call. Each write carries its caller's bearer token and is authenticated and
//! authorised by the leader, as over gRPC.
//!
//! A leader that does not answer the magic (an older node: gRPC takes the bytes for a bad
//! HTTP/2 preface and closes) makes [`RawForwarder::submit`] return
//! [`ForwardError::Unsupported`] for writes it never sent; the caller then uses the gRPC
//! stream ([`crate::peer::Forwarder`]).

use crate::node::ControlNode;
use crate::pb::{StreamedReply, StreamedSubmit, SubmitReply, SubmitRequest};
use prost::Message;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};

/// The first bytes of a forwarding connection, and the leader's answer to them.
pub const MAGIC: [u8; 4] = *b"ODF1";
/// How long connecting and the magic's answer may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a write was not forwarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardError {
    /// The leader does not speak this protocol; the write was not sent.
    Unsupported,
    /// The connection failed (the write's outcome may be unknown).
    Failed(String),
}

type Waiter = oneshot::Sender<Result<SubmitReply, ForwardError>>;

fn put_frame(out: &mut Vec<u8>, msg: &impl Message) {
    opendsec_log::frames::put(out, &msg.encode_to_vec());
}

/// Writes what `rx` yields, as frames, each batch of queued messages in one call.
async fn write_frames<M: Message>(
    mut w: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<M>,
) -> String {
    let mut buf = Vec::new();
    while let Some(first) = rx.recv().await {
        buf.clear();
        put_frame(&mut buf, &first);
        while let Ok(more) = rx.try_recv() {
            put_frame(&mut buf, &more);
        }
        if let Err(e) = w.write_all(&buf).await {
            return format!("writing to the connection: {e}");
        }
    }
    "the node is closing".into()
}

/// Serves one forwarding connection on the leader (its magic not yet read).
pub fn serve(node: ControlNode, conn: TcpStream) {
    tokio::spawn(async move {
        let (rd, mut wr) = conn.into_split();
        let mut rd = BufReader::new(rd);
        let mut magic = [0u8; 4];
        if rd.read_exact(&mut magic).await.is_err() || magic != MAGIC || wr.write_all(&MAGIC).await.is_err() {
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel::<StreamedReply>();
        let writer = tokio::spawn(write_frames(wr, rx));
        let mut buf = Vec::new();
        loop {
            match opendsec_log::frames::read(&mut rd, &mut buf).await {
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
                let _ = tx.send(StreamedReply {
                    id: m.id,
                    reply: Some(reply),
                });
            });
        }
        // Replies still being decided go out as they come; the writer ends with the last.
        drop(tx);
        let _ = writer.await;
    });
}

const OPEN: u8 = 0;
const CLOSED: u8 = 1;
const UNSUPPORTED: u8 = 2;

/// A follower's connection to one leader for forwarding writes. Cloning shares it.
/// Once it breaks, every write waiting on it fails and [`RawForwarder::is_closed`]
/// turns true: the node then opens a new one.
#[derive(Clone)]
pub struct RawForwarder {
    queue: mpsc::UnboundedSender<(SubmitRequest, Waiter)>,
    state: Arc<AtomicU8>,
}

impl RawForwarder {
    /// Starts connecting to the leader's peer address `addr` (`host:port`).
    pub fn new(addr: String) -> RawForwarder {
        let (queue, rx) = mpsc::unbounded_channel();
        let state = Arc::new(AtomicU8::new(OPEN));
        tokio::spawn(run(addr, rx, state.clone()));
        RawForwarder { queue, state }
    }

    /// Whether it can take no more writes (broken, or the leader does not speak it).
    pub fn is_closed(&self) -> bool {
        self.state.load(Ordering::Acquire) != OPEN
    }

    /// Whether the leader turned out not to speak this protocol.
    pub fn is_unsupported(&self) -> bool {
        self.state.load(Ordering::Acquire) == UNSUPPORTED
    }

    /// Forwards one write and waits for the leader's reply.
    pub async fn submit(&self, req: SubmitRequest) -> Result<SubmitReply, ForwardError> {
        if self.is_unsupported() {
            return Err(ForwardError::Unsupported);
        }
        let (tx, rx) = oneshot::channel();
        self.queue
            .send((req, tx))
            .map_err(|_| ForwardError::Failed("the connection to the leader is closed".into()))?;
        rx.await
            .map_err(|_| ForwardError::Failed("the connection to the leader closed before its reply".into()))?
    }
}

/// Connects and exchanges the magic; `Err((true, _))` if the leader does not speak the protocol.
async fn connect(addr: &str) -> Result<TcpStream, (bool, String)> {
    let handshake = async {
        let mut conn = TcpStream::connect(addr)
            .await
            .map_err(|e| (false, format!("connecting to the leader {addr}: {e}")))?;
        let _ = conn.set_nodelay(true);
        conn.write_all(&MAGIC)
            .await
            .map_err(|e| (false, format!("writing to the leader {addr}: {e}")))?;
        let mut answer = [0u8; 4];
        match conn.read_exact(&mut answer).await {
            Ok(_) if answer == MAGIC => Ok(conn),
            Err(e) if e.kind() != std::io::ErrorKind::UnexpectedEof => {
                Err((false, format!("reading from the leader {addr}: {e}")))
            }
            // An HTTP/2 server answers with its own frames, or closes.
            _ => Err((
                true,
                format!("the leader {addr} does not forward over plain connections"),
            )),
        }
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake)
        .await
        .unwrap_or_else(|_| {
            Err((
                false,
                format!("the leader {addr} did not answer within {HANDSHAKE_TIMEOUT:?}"),
            ))
        })
}

async fn run(addr: String, mut rx: mpsc::UnboundedReceiver<(SubmitRequest, Waiter)>, state: Arc<AtomicU8>) {
    let conn = match connect(&addr).await {
        Ok(c) => c,
        Err((unsupported, why)) => {
            // Nothing was sent: the writes queued meanwhile can go another way.
            state.store(if unsupported { UNSUPPORTED } else { CLOSED }, Ordering::Release);
            rx.close();
            while let Ok((_, w)) = rx.try_recv() {
                let _ = w.send(Err(if unsupported {
                    ForwardError::Unsupported
                } else {
                    ForwardError::Failed(why.clone())
                }));
            }
            return;
        }
    };
    let (rd, wr) = conn.into_split();
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
    state.store(CLOSED, Ordering::Release);
    rx.close();
    let mut left: Vec<Waiter> = pending
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain()
        .map(|(_, w)| w)
        .collect();
    left.extend(std::iter::from_fn(|| rx.try_recv().ok().map(|(_, w)| w)));
    for w in left {
        let _ = w.send(Err(ForwardError::Failed(format!("leader {addr}: {why}"))));
    }
}
