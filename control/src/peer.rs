//! The `Control` gRPC service (how `opendsec init` bootstraps a cluster, and how a
//! follower asks the leader's read index: for control nodes' and operator tools'
//! certificates only), and the leader's side of a forwarded write: decoding it, deciding it with its
//! caller's token, and encoding the result (the transport is `forward.rs`).

use crate::Credential;
use crate::node::{ControlNode, SubmitError, Submitted};
use crate::pb::{
    BootstrapRequest, ReadIndexReply, ReadIndexRequest, RotateCertificatesReply, RotateCertificatesRequest,
    SubmitReply, SubmitRequest, control_server::Control,
};
use opendsec_commands::{Command, Decided, Rejection, RejectionKind};
use opendsec_projections::schema::{self, Batch};
use opendsec_trust::Role;
use prost::Message;
use tonic::{Request, Response, Status};

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

#[tonic::async_trait]
impl Control for ControlService {
    async fn bootstrap(&self, req: Request<BootstrapRequest>) -> Result<Response<SubmitReply>, Status> {
        let peer = opendsec_log::peer_of(&req);
        if !(peer.is(Role::Control) || peer.is(Role::Operator)) {
            tracing::warn!(peer = %peer.who(), remote = ?peer.remote, "denied: bootstrap from outside the control plane");
            return Err(Status::permission_denied(format!(
                "bootstrap is for control hosts (a control node's or operator tool's certificate); this connection is {}",
                peer.who()
            )));
        }
        let req = req.into_inner();
        let cmd = Command::Bootstrap {
            project_name: req.project_name,
            token_name: req.token_name,
            secret_sha256: req.secret_sha256,
        };
        let result = self.node.submit(Credential::System, req.request_id, cmd).await;
        let batch = result.as_ref().ok().map(batch_of);
        Ok(Response::new(result_to_reply(result, batch)))
    }

    async fn read_index(&self, req: Request<ReadIndexRequest>) -> Result<Response<ReadIndexReply>, Status> {
        let peer = opendsec_log::peer_of(&req);
        if !peer.is(Role::Control) {
            tracing::warn!(peer = %peer.who(), remote = ?peer.remote, "denied: a read index asked from outside the control plane");
            return Err(Status::permission_denied("the read index is for control nodes"));
        }
        let req = req.into_inner();
        // The leader's view of the token: revoked here is refused everywhere that asks.
        self.node
            .authenticate(&req.bearer)
            .map_err(|r| Status::unauthenticated(r.message))?;
        let index = self
            .node
            .log()
            .read_index(crate::node::CONFIRM_TIMEOUT)
            .await
            .map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(ReadIndexReply { index }))
    }

    async fn rotate_certificates(
        &self,
        req: Request<RotateCertificatesRequest>,
    ) -> Result<Response<RotateCertificatesReply>, Status> {
        let peer = opendsec_log::peer_of(&req);
        if !peer.is(Role::Control) {
            tracing::warn!(peer = %peer.who(), remote = ?peer.remote, "denied: a certificate rotation asked from outside the control plane");
            return Err(Status::permission_denied(
                "certificate rotation is asked by control nodes",
            ));
        }
        let not_after_ms = self
            .node
            .rotate_certificates_here()
            .map_err(Status::failed_precondition)?;
        Ok(Response::new(RotateCertificatesReply {
            node_id: self.node.config().node_id,
            not_after_ms,
        }))
    }
}
