//! The `EdgeSlice` service (its contract: `opendsec_edge_api`): an edge registers,
//! follows its slice of the log from any index (history first, then live entries,
//! resuming after disconnects), reports what it observes as commands, and sends
//! heartbeats that stay in memory.
//!
//! What belongs to an edge's slice is `opendsec_edge_api::slice`'s to say; this module
//! streams it. If the history an edge asks for is no longer retained, it first gets a
//! snapshot of its sandboxes, then the entries after that snapshot.

use crate::node::{ControlNode, EdgeHeartbeat, SubmitError};
use crate::{Principal, now_ms};
use opendsec_commands::{Command, Observation};
use opendsec_edge_api::pb::edge_slice_server::EdgeSlice;
use opendsec_edge_api::pb::{
    HeartbeatReply, HeartbeatRequest, JoinReply, JoinRequest, Progress, RegisterReply, RegisterRequest, RenewReply,
    RenewRequest, ReportReply, ReportRequest, SliceEntry, SliceMessage, TransferTokenReply, TransferTokenRequest,
    WatchRequest, slice_message::Body,
};
use opendsec_edge_api::slice::{slice_events, slice_snapshot};
use opendsec_projections::{Right, Usage};
use opendsec_trust::{Identity, Role};
use std::pin::Pin;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// Entries skipped (none for this edge) before a `Progress` message is sent.
const PROGRESS_EVERY: u64 = 256;

pub struct EdgeSliceService {
    node: ControlNode,
}

impl EdgeSliceService {
    pub fn new(node: ControlNode) -> Self {
        EdgeSliceService { node }
    }

    fn edge_principal<T>(&self, req: &Request<T>) -> Result<Principal, Status> {
        let bearer = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| Status::unauthenticated("send `authorization: Bearer <edge token>`"))?;
        let p = self
            .node
            .authenticate(bearer)
            .map_err(|r| Status::unauthenticated(r.message))?;
        if !p.has(Right::EdgeWrite) {
            return Err(Status::permission_denied("the token lacks the right edge:write"));
        }
        Ok(p)
    }
}

impl EdgeSliceService {
    /// The calling edge: its token (as [`Self::edge_principal`]) and the edge its
    /// connection's certificate names (the one an edge gets when it joins). A call acts
    /// for that edge only: a token without the edge's certificate (and its key) acts for
    /// no edge, and an edge's certificate acts for no other edge whatever token it sends.
    fn edge_caller<T>(&self, req: &Request<T>) -> Result<(Principal, String), Status> {
        let peer = opendsec_log::peer_of(req);
        let cert_edge = match &peer.identity {
            Some(Identity { role: Role::Edge, name }) => name.clone(),
            _ => {
                tracing::warn!(peer = %peer.who(), remote = ?peer.remote, "denied: an edge call without an edge's certificate");
                return Err(Status::permission_denied(format!(
                    "the edge slice serves edges by their certificates (an edge without one joins first); this connection is {}",
                    peer.who()
                )));
            }
        };
        Ok((self.edge_principal(req)?, cert_edge))
    }

    /// Refuses a call naming another edge than the certificate's.
    fn same_edge(cert_edge: &str, named: &str, what: &str) -> Result<(), Status> {
        if cert_edge == named {
            return Ok(());
        }
        tracing::warn!(%cert_edge, %named, %what, "denied: an edge acting for another");
        Err(Status::permission_denied(format!(
            "edge {cert_edge}'s certificate does not act for edge {named}"
        )))
    }

    /// Refuses (and logs as denied) a watch or heartbeat for an edge that another token
    /// registered: an edge's token speaks for its own edge only.
    fn acts_for(&self, p: &Principal, edge: &str, what: &str) -> Result<(), Status> {
        let owner = self
            .node
            .read(|s| s.placement.edges.get(edge).and_then(|e| e.token.clone()));
        match owner {
            Some(o) if o != p.token_id => {
                tracing::warn!(token = %p.token_id, %edge, %what, "denied: the edge is registered by another token");
                Err(Status::permission_denied(format!(
                    "edge {edge} is registered by another token: only its own token acts for it"
                )))
            }
            _ => Ok(()),
        }
    }
}

fn to_status(e: SubmitError) -> Status {
    match e {
        SubmitError::Rejected { rejection, .. } => match rejection.kind.code() {
            "invalid" => Status::invalid_argument(rejection.message),
            "not_found" => Status::not_found(rejection.message),
            "unauthenticated" => Status::unauthenticated(rejection.message),
            "forbidden" => Status::permission_denied(rejection.message),
            _ => Status::failed_precondition(rejection.message),
        },
        SubmitError::Unavailable(m) => Status::unavailable(m),
        SubmitError::Internal(m) => Status::internal(m),
    }
}

type SliceStream = Pin<Box<dyn Stream<Item = Result<SliceMessage, Status>> + Send>>;

/// Streams one edge's slice from `next` on into `tx` until the receiver goes away.
async fn follow(
    node: ControlNode,
    edge: String,
    mut next: u64,
    mut applied_rx: watch::Receiver<Option<u64>>,
    tx: mpsc::Sender<Result<SliceMessage, Status>>,
) {
    let send = |m: Body| {
        let tx = tx.clone();
        async move { tx.send(Ok(SliceMessage { body: Some(m) })).await.is_ok() }
    };
    // What the slice of an old batch is depends on its outcome, which the audit view
    // keeps only for its retention: before that, the edge starts from a snapshot.
    let first = node
        .log()
        .first_available_index()
        .unwrap_or(1)
        .max(node.read(|s| s.audit.first_index().unwrap_or(0)));
    if next < first {
        let snap = node.read(|s| slice_snapshot(s, &edge));
        next = snap.index + 1;
        if !send(Body::Snapshot(snap)).await {
            return;
        }
    }
    let mut skipped = 0u64;
    loop {
        // Catch up from storage to what the log has applied now (the bound `read_entries` uses).
        let applied = applied_rx.borrow_and_update().unwrap_or(0);
        while next <= applied {
            let to = (next + 999).min(applied);
            let batches = match node.read_batches(next, to) {
                Ok(b) => b,
                Err(e) => {
                    let _ = tx.send(Err(Status::internal(e.to_string()))).await;
                    return;
                }
            };
            for (index, batch) in batches {
                let events = node.read(|s| slice_events(s, &edge, index, &batch));
                if events.is_empty() {
                    skipped += 1;
                    if skipped >= PROGRESS_EVERY {
                        skipped = 0;
                        if !send(Body::Progress(Progress { index })).await {
                            return;
                        }
                    }
                } else {
                    skipped = 0;
                    if !send(Body::Entry(SliceEntry {
                        index,
                        time_ms: batch.time_ms,
                        events,
                    }))
                    .await
                    {
                        return;
                    }
                }
            }
            next = to + 1;
        }
        if skipped > 0 {
            skipped = 0;
            if !send(Body::Progress(Progress { index: next - 1 })).await {
                return;
            }
        }
        // Then wait until more is applied; everything is read from storage above, so a
        // slow watcher never loses entries.
        tokio::select! {
            r = applied_rx.changed() => if r.is_err() { return },
            _ = tx.closed() => return,
        }
    }
}

impl EdgeSliceService {
    /// Logs `r` as edge `r.edge`'s registration by `p`; its ordinal and log index.
    async fn register_edge(&self, p: &Principal, r: RegisterRequest) -> Result<(u32, u64), Status> {
        let cap = r.capacity.unwrap_or_default();
        let cmd = Command::RegisterEdge {
            edge: r.edge.clone(),
            address: r.address,
            capacity: Usage {
                sandboxes: cap.sandboxes,
                cpu_millis: cap.cpu_millis,
                memory_mb: cap.memory_mb,
                metadata_bytes: 0,
            },
            labels: r.labels,
        };
        let s = self
            .node
            .submit(p.credential(), uuid::Uuid::new_v4().to_string(), cmd)
            .await
            .map_err(to_status)?;
        let ordinal = self
            .node
            .read(|st| st.placement.edges.get(&r.edge).map(|e| e.ordinal))
            .unwrap_or_default();
        Ok((ordinal, s.index))
    }
}

#[tonic::async_trait]
impl EdgeSlice for EdgeSliceService {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterReply>, Status> {
        let (p, cert_edge) = self.edge_caller(&req)?;
        let r = req.into_inner();
        Self::same_edge(&cert_edge, &r.edge, "register")?;
        let (ordinal, index) = self.register_edge(&p, r).await?;
        Ok(Response::new(RegisterReply { ordinal, index }))
    }

    async fn join(&self, req: Request<JoinRequest>) -> Result<Response<JoinReply>, Status> {
        let p = self.edge_principal(&req)?;
        let r = req.into_inner();
        let reg = r
            .registration
            .ok_or_else(|| Status::invalid_argument("registration is missing"))?;
        let edge = reg.edge.clone();
        let Some(ca) = self.node.trust().issuer() else {
            return Err(Status::failed_precondition(
                "this control node does not hold the cluster CA: join through one that does",
            ));
        };
        let (taken, owned) = self.node.read(|s| {
            let live = |e: &&opendsec_projections::Edge| !e.deregistered;
            (
                s.placement.edges.get(&edge).filter(live).is_some(),
                s.placement
                    .edges
                    .iter()
                    .find(|(_, e)| !e.deregistered && e.token.as_deref() == Some(p.token_id.as_str()))
                    .map(|(n, _)| n.clone()),
            )
        });
        if let Some(o) = owned {
            tracing::warn!(token = %p.token_id, %edge, joined = %o, "denied: a join token used again");
            return Err(Status::permission_denied(format!(
                "this token joined edge {o} already: a token joins one edge, once (issue a new one for another edge)"
            )));
        }
        if taken {
            tracing::warn!(token = %p.token_id, %edge, "denied: a join for an edge that has joined");
            return Err(Status::already_exists(format!(
                "edge {edge} has joined already and holds its certificate; to join it again (a new machine, a lost key), \
                 deregister it (`opendsecctl edge deregister {edge}`) and give the new edge a new token"
            )));
        }
        // The CA signs what it decides (this edge's identity) for the key the edge made;
        // nothing is returned unless the registration is logged.
        let cert_pem = ca
            .sign_request(&r.csr_pem, &Identity::edge(&edge))
            .map_err(|e| Status::invalid_argument(format!("csr_pem: {e}")))?;
        let (ordinal, index) = self.register_edge(&p, reg).await?;
        tracing::info!(%edge, token = %p.token_id, "an edge joined: its certificate is issued");
        Ok(Response::new(JoinReply {
            ordinal,
            index,
            cert_pem,
            ca_pem: self.node.trust().ca_pem().to_string(),
            edge_key: self.node.edge_key(&edge),
        }))
    }

    async fn renew(&self, req: Request<RenewRequest>) -> Result<Response<RenewReply>, Status> {
        let (p, cert_edge) = self.edge_caller(&req)?;
        let r = req.into_inner();
        Self::same_edge(&cert_edge, &r.edge, "renew")?;
        // Only a live edge, by the token that registered it (a deregistered edge's
        // certificate runs out).
        let registered_by = self.node.read(|s| {
            s.placement
                .edges
                .get(&r.edge)
                .filter(|e| !e.deregistered)
                .map(|e| e.token.clone())
        });
        match registered_by {
            Some(Some(t)) if t == p.token_id => {}
            _ => {
                tracing::warn!(token = %p.token_id, edge = %r.edge, "denied: a renewal for an edge the token does not hold");
                return Err(Status::permission_denied(format!(
                    "edge {} is not registered by this token: only a live edge renews, with its own token",
                    r.edge
                )));
            }
        }
        let Some(ca) = self.node.trust().issuer() else {
            return Err(Status::failed_precondition(
                "this control node does not hold the cluster CA: renew through one that does",
            ));
        };
        let cert_pem = ca
            .sign_request(&r.csr_pem, &Identity::edge(&r.edge))
            .map_err(|e| Status::invalid_argument(format!("csr_pem: {e}")))?;
        Ok(Response::new(RenewReply { cert_pem }))
    }

    type WatchStream = SliceStream;

    async fn watch(&self, req: Request<WatchRequest>) -> Result<Response<SliceStream>, Status> {
        let (p, cert_edge) = self.edge_caller(&req)?;
        let r = req.into_inner();
        if r.edge.is_empty() {
            return Err(Status::invalid_argument("edge must name the watching edge"));
        }
        Self::same_edge(&cert_edge, &r.edge, "watch")?;
        self.acts_for(&p, &r.edge, "watch")?;
        // Watch the applied index before reading history so no entry falls between the two.
        let live = self.node.log().applied_index();
        let (tx, rx) = mpsc::channel(256);
        tokio::spawn(follow(self.node.clone(), r.edge, r.from_index.max(1), live, tx));
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn report(&self, req: Request<ReportRequest>) -> Result<Response<ReportReply>, Status> {
        let (p, cert_edge) = self.edge_caller(&req)?;
        // A report is on the certificate's edge's own sandboxes and snapshots (the command
        // then checks, audited, that the token registered that edge).
        let of = self.node.read(|s| {
            let r = req.get_ref();
            if !r.snapshot.is_empty() {
                s.snapshots.snapshots.get(&r.snapshot).map(|x| x.edge.clone())
            } else if r.image.is_empty() {
                s.sandboxes.sandboxes.get(&r.sandbox).map(|x| x.edge.clone())
            } else {
                None
            }
        });
        if let Some(edge) = of {
            Self::same_edge(&cert_edge, &edge, "report")?;
        }
        let r = req.into_inner();
        // An edge names its reports by what they say (`edge:sandbox:observation`), and the
        // same words recur (a second pause of one sandbox): each report is a request of
        // its own, never a retry of an earlier one (reports are idempotent where it
        // matters: a state already reached is refused, not applied twice).
        let request_id = if r.request_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            format!("{}#{}", r.request_id, uuid::Uuid::new_v4().simple())
        };
        let cmd = if !r.image.is_empty() {
            let result: opendsec_commands::ImageResult = serde_json::from_str(&r.image_result_json)
                .map_err(|e| Status::invalid_argument(format!("image_result_json: {e}")))?;
            Command::ReportImage { name: r.image, result }
        } else if r.snapshot.is_empty() {
            let observation: Observation = serde_json::from_str(&r.observation_json)
                .map_err(|e| Status::invalid_argument(format!("observation_json: {e}")))?;
            Command::ReportSandbox {
                sandbox: r.sandbox,
                observation,
            }
        } else {
            let result: opendsec_commands::SnapshotResult = serde_json::from_str(&r.snapshot_result_json)
                .map_err(|e| Status::invalid_argument(format!("snapshot_result_json: {e}")))?;
            Command::ReportSnapshot {
                snapshot: r.snapshot,
                result,
            }
        };
        let s = self
            .node
            .submit(p.credential(), request_id, cmd)
            .await
            .map_err(to_status)?;
        Ok(Response::new(ReportReply { index: s.index }))
    }

    async fn transfer_token(&self, req: Request<TransferTokenRequest>) -> Result<Response<TransferTokenReply>, Status> {
        let (p, cert_edge) = self.edge_caller(&req)?;
        let r = req.into_inner();
        Self::same_edge(&cert_edge, &r.edge, "transfer token")?;
        self.acts_for(&p, &r.edge, "transfer token")?;
        // A transfer opens only for the edge whose live sandbox starts from it.
        // (the holding edge, the sandbox whose state it is: a fork's source, a snapshot's)
        let source = self.node.read(|s| {
            let x = s
                .sandboxes
                .sandboxes
                .values()
                .find(|x| x.is_live() && x.edge == r.edge && x.transfer.as_deref() == Some(r.transfer.as_str()))?;
            let of = x.fork_of.clone().or_else(|| {
                x.snapshot
                    .as_ref()
                    .and_then(|snap| s.snapshots.snapshots.get(snap))
                    .map(|snap| snap.sandbox.clone())
            });
            Some((x.source_edge.clone()?, of.unwrap_or_default()))
        });
        let Some((source_edge, of)) = source else {
            tracing::warn!(token = %p.token_id, edge = %r.edge, transfer = %r.transfer, "denied: no sandbox of the edge starts from the transfer");
            return Err(Status::permission_denied(format!(
                "no live sandbox of edge {} starts from transfer {}",
                r.edge, r.transfer
            )));
        };
        let key = self.node.edge_key(&source_edge);
        Ok(Response::new(TransferTokenReply {
            token: opendsec_edge_api::transfer_token(&key, &r.transfer, &r.edge),
            source_agent_token: opendsec_edge_api::sandbox_token(&key, opendsec_edge_api::SandboxTokenKind::Agent, &of),
            source_edge,
        }))
    }

    async fn heartbeat(&self, req: Request<HeartbeatRequest>) -> Result<Response<HeartbeatReply>, Status> {
        let (p, cert_edge) = self.edge_caller(&req)?;
        let r = req.into_inner();
        Self::same_edge(&cert_edge, &r.edge, "heartbeat")?;
        self.acts_for(&p, &r.edge, "heartbeat")?;
        self.node.record_heartbeat(EdgeHeartbeat {
            edge: r.edge,
            at_ms: now_ms(),
            running_sandboxes: r.running_sandboxes,
            cpu_millis_used: r.cpu_millis_used,
            memory_mb_used: r.memory_mb_used,
            pulls: r.pulls.into_iter().map(Into::into).collect(),
        });
        Ok(Response::new(HeartbeatReply {
            certificates_rotated_at_ms: self.node.certificates_rotated_at_ms(),
        }))
    }
}
