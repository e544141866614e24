//! The replication protocol: how a leader streams appends to a follower, the one
//! transport for Raft's AppendEntries (votes and snapshots go by the Raft gRPC service,
//! see `service.rs`).
//!
//! One mutual-TLS connection on the peer port per openraft replication stream, between
//! control nodes only (each checks the other's certificate names a control node: the
//! server closes on anyone else unanswered). It opens with the versioned handshake of
//! [`crate::handshake`] ([`PROTOCOL`], no credentials: the session is the proof). Then openraft's
//! `AppendEntriesRequest`s go one way and its `StreamAppendResult`s come back the other,
//! in order, each a postcard-encoded length-prefixed frame (version 1). The leader sends
//! the next request without waiting for the previous answer (pipelining); requests, or
//! results, ready together go out in one write. A request unanswered for the RPC timeout
//! ends the stream as unreachable, and openraft opens a new one. Compared with a gRPC
//! stream, this saves HTTP/2's framing, flow control and task hops on the hot path.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use openraft::OptionalSend;
use openraft::Raft;
use openraft::base::BoxStream;
use openraft::errors::{NetworkError, RPCError, Unreachable};
use openraft::raft::{AppendEntriesRequest, StreamAppendResult};
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A replication connection, from the leader's side.
pub(crate) type Conn = tokio_rustls::client::TlsStream<TcpStream>;

use crate::handshake::{HandshakeError, Protocol};
use crate::peer_port::PeerStream;
use crate::sm::SmStore;
use crate::{StateMachine, TypeConfig, decode, encode};

/// The replication protocol's opening: magic `ODRP`, and the versions this build speaks.
pub const PROTOCOL: Protocol = Protocol {
    name: "replication",
    magic: *b"ODRP",
    versions: &[1],
};

/// Append requests encoded ahead of the transport on a replication stream.
const STREAM_AHEAD: usize = 16;

pub(crate) type StreamOut<'s> = BoxStream<'s, Result<StreamAppendResult<TypeConfig>, RPCError<TypeConfig>>>;

fn unreachable(why: String) -> RPCError<TypeConfig> {
    RPCError::Unreachable(Unreachable::from_string(why))
}

/// Connects to node `target` at `addr` and opens a replication connection. A refusal (no
/// common version) is logged here, and reported as unreachable so that openraft backs off.
pub(crate) async fn connect(
    target: u64,
    addr: &str,
    trust: &opendsec_trust::Trust,
    ttl: Duration,
) -> Result<Conn, RPCError<TypeConfig>> {
    let open = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| unreachable(format!("connecting to node {target} at {addr}: {e}")))?;
        let _ = tcp.set_nodelay(true);
        let control = opendsec_trust::Expect::Role(opendsec_trust::Role::Control);
        let mut conn = match trust.connect(tcp, &control).await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(target, %addr, error = %e, "cannot replicate to a peer: TLS");
                return Err(unreachable(format!("node {target} at {addr}: TLS: {e}")));
            }
        };
        match PROTOCOL.offer(&mut conn, PROTOCOL.versions, &[]).await {
            Ok(_version) => Ok(conn),
            Err(e @ HandshakeError::Io { .. }) => Err(unreachable(format!("node {target} at {addr}: {e}"))),
            Err(e) => {
                tracing::warn!(target, %addr, error = %e, "cannot replicate to a peer");
                Err(unreachable(format!("node {target} at {addr}: {e}")))
            }
        }
    };
    tokio::time::timeout(ttl, open).await.unwrap_or_else(|_| {
        Err(unreachable(format!(
            "opening a replication connection to node {target} timed out after {ttl:?}"
        )))
    })
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
    stale.then(|| unreachable(format!("node {target} did not answer an append request within {ttl:?}")))
}

/// Streams `input` over `conn` (opened by [`connect`]) and yields the results in order.
pub(crate) fn stream<S>(conn: Conn, input: S, target: u64, ttl: Duration) -> StreamOut<'static>
where
    S: Stream<Item = AppendEntriesRequest<TypeConfig>> + OptionalSend + Unpin + 'static,
{
    let (rd, mut wr) = tokio::io::split(conn);
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
            // The input ended: close the sending side (TLS close_notify, then the TCP
            // half-close), so that the follower ends its side and the results end too.
            let _ = wr.shutdown().await;
        })
    };
    let guard = AbortOnDrop(feeder.abort_handle());
    let rd = tokio::io::BufReader::new(rd);
    let out = futures::stream::unfold(Some((rd, Vec::new(), sent, guard)), move |state| async move {
        let (mut rd, mut buf, sent, guard) = state?;
        loop {
            match tokio::time::timeout(ttl / 2, crate::frames::read(&mut rd, &mut buf)).await {
                Ok(Ok(true)) => {
                    sent.lock().unwrap_or_else(|e| e.into_inner()).pop_front();
                    return match decode::<StreamAppendResult<TypeConfig>>(&buf) {
                        Ok(r) => Some((Ok(r), Some((rd, buf, sent, guard)))),
                        Err(e) => Some((Err(RPCError::Network(NetworkError::new(&e))), None)),
                    };
                }
                Ok(Ok(false)) => return None,
                Ok(Err(e)) => {
                    return Some((
                        Err(unreachable(format!("replication connection to node {target}: {e}"))),
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

/// Serves one replication connection (its magic not yet read): the opening, then append
/// requests in and their results out, in order. Results ready together go out in one write.
pub(crate) fn serve<S: StateMachine>(raft: Raft<TypeConfig, SmStore<S>>, conn: PeerStream) {
    tokio::spawn(async move {
        if !conn.peer().is(opendsec_trust::Role::Control) {
            tracing::warn!(peer = %conn.peer().who(), remote = ?conn.peer().remote, "a replication connection from outside the control plane was refused");
            return;
        }
        let (rd, mut wr) = conn.into_split();
        let mut rd = tokio::io::BufReader::new(rd);
        let hello = match PROTOCOL.read_hello(&mut rd).await {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!(error = %e, "a replication connection ended before its opening");
                return;
            }
        };
        let choice = PROTOCOL.choose(&hello.versions);
        if PROTOCOL.answer(&mut wr, &choice).await.is_err() || choice.is_err() {
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
        // The input ended (the leader closed its side): close ours the TLS way, so that
        // the leader reads a clean end rather than a truncated session.
        let _ = wr.shutdown().await;
    });
}
