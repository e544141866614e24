//! The `Control` service: how a follower hands a write to the leader, and how
//! `opendsec init` bootstraps a cluster with the cluster key.
//!
//! A follower forwards over one `SubmitStream` per leader ([`Forwarder`]): each write
//! is a message on a long-lived HTTP/2 stream, not a call of its own, so forwarding
//! costs no per-write stream set-up and concurrent writes share frames and syscalls.
//! A leader without the stream (an older node) is called with unary `Submit`.

use crate::Credential;
use crate::node::{ControlNode, SubmitError, Submitted};
use crate::pb::control_client::ControlClient;
use crate::pb::{BootstrapRequest, StreamedReply, StreamedSubmit, SubmitReply, SubmitRequest, control_server::Control};
use opendsec_commands::{Command, Decided, Rejection, RejectionKind};
use opendsec_projections::schema::{self, Batch};
use prost::Message;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

pub struct ControlService {
    node: ControlNode,
}

impl ControlService {
    pub fn new(node: ControlNode) -> Self {
        ControlService { node }
    }
}

/// Encodes a submit result for the wire.
pub fn result_to_reply(r: Result<Submitted, SubmitError>, batch: Option<Batch>) -> SubmitReply {
    match r {
        Ok(s) => SubmitReply {
            index: s.index,
            batch: batch.map(|b| b.encode_to_vec()).unwrap_or_default(),
            logged: true,
            ..Default::default()
        },
        Err(SubmitError::Rejected { rejection, index }) => SubmitReply {
            index: index.unwrap_or(0),
            logged: index.is_some(),
            rejection_json: serde_json::to_string(&rejection).unwrap_or_default(),
            ..Default::default()
        },
        Err(e) => SubmitReply {
            error: e.to_string(),
            ..Default::default()
        },
    }
}

/// Decodes a submit result from the wire.
pub fn reply_to_result(r: SubmitReply) -> Result<Submitted, SubmitError> {
    if !r.error.is_empty() {
        return Err(SubmitError::Unavailable(r.error));
    }
    if !r.rejection_json.is_empty() {
        let rejection: Rejection =
            serde_json::from_str(&r.rejection_json).map_err(|e| SubmitError::Internal(e.to_string()))?;
        return Err(SubmitError::Rejected {
            rejection,
            index: r.logged.then_some(r.index),
        });
    }
    let batch = schema::decode_batch(&r.batch).map_err(|e| SubmitError::Internal(e.to_string()))?;
    let events = schema::batch_events(&batch).map_err(|e| SubmitError::Internal(e.to_string()))?;
    Ok(Submitted {
        index: r.index,
        decided: Decided {
            events,
            project: batch.project,
            target: batch.target,
        },
    })
}

fn batch_of(s: &Submitted) -> Batch {
    Batch {
        project: s.decided.project.clone(),
        target: s.decided.target.clone(),
        events: s.decided.events.iter().map(|e| e.to_envelope()).collect(),
        ..Default::default()
    }
}

/// Decides one forwarded write on this node (the leader) and encodes the result.
pub(crate) async fn submit_forwarded(node: &ControlNode, req: SubmitRequest) -> SubmitReply {
    let cmd: Command = match serde_json::from_str(&req.command_json) {
        Ok(c) => c,
        Err(e) => {
            let r = Rejection::new(RejectionKind::Invalid, format!("command does not decode: {e}"));
            return result_to_reply(Err(r.into()), None);
        }
    };
    let result = node.submit(Credential::Bearer(req.bearer), req.request_id, cmd).await;
    let batch = result.as_ref().ok().map(batch_of);
    result_to_reply(result, batch)
}

type ReplyStream = Pin<Box<dyn Stream<Item = Result<StreamedReply, Status>> + Send>>;

#[tonic::async_trait]
impl Control for ControlService {
    async fn submit(&self, req: Request<SubmitRequest>) -> Result<Response<SubmitReply>, Status> {
        Ok(Response::new(submit_forwarded(&self.node, req.into_inner()).await))
    }

    type SubmitStreamStream = ReplyStream;

    async fn submit_stream(&self, req: Request<Streaming<StreamedSubmit>>) -> Result<Response<ReplyStream>, Status> {
        let mut inbound = req.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        let node = self.node.clone();
        tokio::spawn(async move {
            // Each write is decided on its own task: a slow one holds no other back.
            while let Ok(Some(m)) = inbound.message().await {
                let (node, tx) = (node.clone(), tx.clone());
                tokio::spawn(async move {
                    let reply = submit_forwarded(&node, m.request.unwrap_or_default()).await;
                    let _ = tx.send(Ok(StreamedReply {
                        id: m.id,
                        reply: Some(reply),
                    }));
                });
            }
        });
        Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
    }

    async fn bootstrap(&self, req: Request<BootstrapRequest>) -> Result<Response<SubmitReply>, Status> {
        let req = req.into_inner();
        if !self.node.cluster_key_matches(&req.cluster_key) {
            return Err(Status::permission_denied("wrong cluster key"));
        }
        let cmd = Command::Bootstrap {
            project_name: req.project_name,
            token_name: req.token_name,
            secret_sha256: req.secret_sha256,
        };
        let result = self.node.submit(Credential::System, req.request_id, cmd).await;
        let batch = result.as_ref().ok().map(batch_of);
        Ok(Response::new(result_to_reply(result, batch)))
    }
}

type Waiter = oneshot::Sender<Result<SubmitReply, String>>;

/// One write by unary `Submit`.
async fn unary(mut client: ControlClient<Channel>, req: SubmitRequest) -> Result<SubmitReply, String> {
    client
        .submit(req)
        .await
        .map(|r| r.into_inner())
        .map_err(|s| s.message().to_string())
}

/// A follower's one stream of forwarded writes to one leader. Cloning shares it.
/// Once the stream breaks, every write waiting on it fails (its outcome is unknown to
/// this node, as with a broken call) and [`Forwarder::is_closed`] turns true: the node
/// then opens a new one.
#[derive(Clone)]
pub struct Forwarder {
    client: ControlClient<Channel>,
    queue: mpsc::UnboundedSender<(SubmitRequest, Waiter)>,
    closed: Arc<AtomicBool>,
    /// The leader does not serve `SubmitStream`: every write is a unary call.
    unary: Arc<AtomicBool>,
}

impl Forwarder {
    pub fn new(client: ControlClient<Channel>) -> Forwarder {
        let (queue, rx) = mpsc::unbounded_channel();
        let f = Forwarder {
            client,
            queue,
            closed: Arc::new(AtomicBool::new(false)),
            unary: Arc::new(AtomicBool::new(false)),
        };
        tokio::spawn(f.clone().run(rx));
        f
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Forwards one write and waits for the leader's reply.
    pub async fn submit(&self, req: SubmitRequest) -> Result<SubmitReply, String> {
        if self.unary.load(Ordering::Acquire) {
            return unary(self.client.clone(), req).await;
        }
        let (tx, rx) = oneshot::channel();
        self.queue
            .send((req, tx))
            .map_err(|_| "the stream to the leader is closed".to_string())?;
        rx.await
            .map_err(|_| "the stream to the leader closed before its reply".to_string())?
    }

    async fn run(self, mut rx: mpsc::UnboundedReceiver<(SubmitRequest, Waiter)>) {
        let why = self.pump(&mut rx).await;
        self.closed.store(true, Ordering::Release);
        rx.close();
        while let Ok((req, waiter)) = rx.try_recv() {
            // Queued after the break: never sent, so safe to send again by unary call.
            if self.unary.load(Ordering::Acquire) {
                self.unary_for(req, waiter);
            } else {
                let _ = waiter.send(Err(why.clone()));
            }
        }
    }

    /// Sends `req` by unary call on a task of its own; `waiter` gets the reply.
    fn unary_for(&self, req: SubmitRequest, waiter: Waiter) {
        let client = self.client.clone();
        tokio::spawn(async move {
            let _ = waiter.send(unary(client, req).await);
        });
    }

    /// Runs the stream until it breaks; returns why.
    async fn pump(&self, rx: &mut mpsc::UnboundedReceiver<(SubmitRequest, Waiter)>) -> String {
        // Nothing is opened before the first write.
        let Some(first) = rx.recv().await else {
            return "the node is closing".into();
        };
        let (out, out_rx) = mpsc::unbounded_channel::<StreamedSubmit>();
        let mut pending: HashMap<u64, Waiter> = HashMap::new();
        let mut next_id = 0u64;
        let mut send = |(req, waiter): (SubmitRequest, Waiter), pending: &mut HashMap<u64, Waiter>| {
            next_id += 1;
            pending.insert(next_id, waiter);
            let _ = out.send(StreamedSubmit {
                id: next_id,
                request: Some(req),
            });
        };
        let (first_req, first_waiter) = first;
        send((first_req.clone(), first_waiter), &mut pending);
        let mut inbound = match self
            .client
            .clone()
            .submit_stream(UnboundedReceiverStream::new(out_rx))
            .await
        {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::Unimplemented => {
                self.unary.store(true, Ordering::Release);
                // The first write was never decided: send it again, by unary call.
                if let Some(w) = pending.remove(&1) {
                    self.unary_for(first_req, w);
                }
                return "the leader forwards by unary calls".into();
            }
            Err(s) => {
                let why = format!("opening the stream to the leader: {}", s.message());
                for (_, w) in pending.drain() {
                    let _ = w.send(Err(why.clone()));
                }
                return why;
            }
        };
        let why = loop {
            tokio::select! {
                next = rx.recv() => match next {
                    Some(item) => send(item, &mut pending),
                    None => break "the node is closing".to_string(),
                },
                reply = inbound.next() => match reply {
                    Some(Ok(StreamedReply { id, reply })) => {
                        if let Some(w) = pending.remove(&id) {
                            let _ = w.send(reply.ok_or_else(|| "the leader sent an empty reply".to_string()));
                        }
                    }
                    Some(Err(s)) => break format!("the stream to the leader broke: {}", s.message()),
                    None => break "the leader ended the stream".to_string(),
                },
            }
        };
        for (_, w) in pending.drain() {
            let _ = w.send(Err(why.clone()));
        }
        why
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::control_server::ControlServer;
    use std::time::Duration;

    /// What a node of each kind answers: `request_id` comes back as the reply's index.
    enum Kind {
        /// Serves `SubmitStream`, answering a window of writes in reverse order.
        Streams,
        /// A node from before `SubmitStream`: unary `Submit` only.
        Old,
        /// Ends every stream after its first write, unanswered.
        Breaks,
    }

    struct TestNode(Kind);

    fn answer(req: &SubmitRequest) -> SubmitReply {
        SubmitReply {
            index: req.request_id.parse().unwrap_or(0),
            logged: true,
            ..Default::default()
        }
    }

    #[tonic::async_trait]
    impl Control for TestNode {
        async fn submit(&self, req: Request<SubmitRequest>) -> Result<Response<SubmitReply>, Status> {
            Ok(Response::new(answer(req.get_ref())))
        }

        type SubmitStreamStream = ReplyStream;

        async fn submit_stream(
            &self,
            req: Request<Streaming<StreamedSubmit>>,
        ) -> Result<Response<ReplyStream>, Status> {
            let mut inbound = req.into_inner();
            let (tx, rx) = mpsc::unbounded_channel();
            match self.0 {
                Kind::Old => return Err(Status::unimplemented("no such method")),
                Kind::Breaks => {
                    tokio::spawn(async move {
                        let _ = inbound.message().await;
                        let _ = tx.send(Err(Status::unavailable("going away")));
                    });
                }
                Kind::Streams => {
                    tokio::spawn(async move {
                        let mut window = Vec::new();
                        while let Ok(Some(m)) = inbound.message().await {
                            window.push(m);
                            if window.len() == 5 {
                                for m in window.drain(..).rev() {
                                    let reply = answer(m.request.as_ref().unwrap());
                                    let _ = tx.send(Ok(StreamedReply {
                                        id: m.id,
                                        reply: Some(reply),
                                    }));
                                }
                            }
                        }
                    });
                }
            }
            Ok(Response::new(Box::pin(UnboundedReceiverStream::new(rx))))
        }

        async fn bootstrap(&self, _: Request<BootstrapRequest>) -> Result<Response<SubmitReply>, Status> {
            Err(Status::unimplemented("not in this test"))
        }
    }

    async fn serve(kind: Kind) -> Forwarder {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(ControlServer::new(TestNode(kind)))
                .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
        );
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect_lazy();
        Forwarder::new(ControlClient::new(ch))
    }

    fn write(n: u64) -> SubmitRequest {
        SubmitRequest {
            bearer: "b".into(),
            request_id: n.to_string(),
            command_json: "{}".into(),
        }
    }

    #[tokio::test]
    async fn concurrent_writes_share_one_stream_and_each_gets_its_own_reply() {
        let f = serve(Kind::Streams).await;
        let calls: Vec<_> = (1..=20u64)
            .map(|n| {
                let f = f.clone();
                tokio::spawn(async move { (n, f.submit(write(n)).await) })
            })
            .collect();
        for call in calls {
            let (n, reply) = tokio::time::timeout(Duration::from_secs(10), call)
                .await
                .unwrap()
                .unwrap();
            assert_eq!(reply.unwrap().index, n, "write {n} got another write's reply");
        }
        assert!(!f.is_closed());
        assert!(!f.unary.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn a_leader_without_the_stream_is_called_write_by_write() {
        let f = serve(Kind::Old).await;
        for n in 1..=3u64 {
            assert_eq!(f.submit(write(n)).await.unwrap().index, n);
        }
        assert!(f.unary.load(Ordering::Acquire));
    }

    #[tokio::test]
    async fn a_broken_stream_fails_its_writes_and_is_replaced() {
        let f = serve(Kind::Breaks).await;
        let err = tokio::time::timeout(Duration::from_secs(10), f.submit(write(1)))
            .await
            .unwrap()
            .unwrap_err();
        assert!(err.contains("going away") || err.contains("closed"), "{err}");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !f.is_closed() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the forwarder never noticed the break"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            f.submit(write(2)).await.is_err(),
            "a closed forwarder takes no more writes"
        );
    }
}
