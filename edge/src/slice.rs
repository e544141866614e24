//! `SliceClient`: an edge's connection to the `EdgeSlice` service, and `SliceFollower`,
//! which turns the watch stream into a sequence of slice messages that survives
//! disconnects by resuming from the last index it handed out.

use opendsec_commands::Observation;
use opendsec_edge_api::pb::edge_slice_client::EdgeSliceClient;
use opendsec_edge_api::pb::{
    Capacity, HeartbeatRequest, RegisterRequest, ReportRequest, SliceMessage, TransferTokenReply, TransferTokenRequest,
    WatchRequest, slice_message::Body,
};
use std::collections::BTreeMap;
use std::time::Duration;
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Streaming};

#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    /// the control plane at {0} cannot be reached
    #[error("the control plane at {0} cannot be reached: {1}")]
    Connect(String, String),
    /// the control plane refused the call
    #[error("{0}")]
    Status(#[from] tonic::Status),
    #[error("the edge token is not valid ASCII")]
    BadToken,
}

#[derive(Clone)]
pub struct SliceClient {
    client: EdgeSliceClient<Channel>,
    auth: MetadataValue<tonic::metadata::Ascii>,
}

impl SliceClient {
    /// Connects lazily to a control node's peer address as the edge `trust` names (mutual
    /// TLS), with its token (edge:write).
    pub fn connect(
        peer_addr: &str,
        bearer: &str,
        trust: std::sync::Arc<opendsec_trust::Trust>,
    ) -> Result<SliceClient, SliceError> {
        let control = opendsec_trust::Expect::Role(opendsec_trust::Role::Control);
        let ch = Endpoint::from_shared(format!("http://{peer_addr}"))
            .map_err(|e| SliceError::Connect(peer_addr.to_string(), e.to_string()))?
            .connect_timeout(Duration::from_secs(2))
            .connect_with_connector_lazy(opendsec_trust::tls_connector(trust, control));
        let auth = format!("Bearer {bearer}").parse().map_err(|_| SliceError::BadToken)?;
        Ok(SliceClient {
            client: EdgeSliceClient::new(ch),
            auth,
        })
    }

    fn req<T>(&self, body: T) -> Request<T> {
        let mut r = Request::new(body);
        r.metadata_mut().insert("authorization", self.auth.clone());
        r
    }

    /// Registers (or re-registers) the edge; returns its ordinal and the log index.
    pub async fn register(
        &mut self,
        edge: &str,
        address: &str,
        capacity: Capacity,
        labels: BTreeMap<String, String>,
    ) -> Result<(u32, u64), SliceError> {
        let r = self
            .client
            .register(self.req(RegisterRequest {
                edge: edge.into(),
                address: address.into(),
                capacity: Some(capacity),
                labels,
            }))
            .await?
            .into_inner();
        Ok((r.ordinal, r.index))
    }

    /// Opens the edge's slice from `from_index`.
    pub async fn watch(&mut self, edge: &str, from_index: u64) -> Result<Streaming<SliceMessage>, SliceError> {
        Ok(self
            .client
            .watch(self.req(WatchRequest {
                edge: edge.into(),
                from_index,
            }))
            .await?
            .into_inner())
    }

    /// What opens `transfer` (the state a sandbox of `edge` starts from) on the edge
    /// holding it, and the agent token that state's sandbox held, both keyed with that
    /// edge's key (which this edge does not hold).
    pub async fn transfer_token(&mut self, edge: &str, transfer: &str) -> Result<TransferTokenReply, SliceError> {
        Ok(self
            .client
            .transfer_token(self.req(TransferTokenRequest {
                edge: edge.into(),
                transfer: transfer.into(),
            }))
            .await?
            .into_inner())
    }

    /// Reports an observation of one of the edge's sandboxes; returns the log index.
    pub async fn report(
        &mut self,
        sandbox: &str,
        observation: &Observation,
        request_id: &str,
    ) -> Result<u64, SliceError> {
        let observation_json = serde_json::to_string(observation).expect("observations serialise");
        let r = self
            .client
            .report(self.req(ReportRequest {
                sandbox: sandbox.into(),
                observation_json,
                request_id: request_id.into(),
                ..Default::default()
            }))
            .await?
            .into_inner();
        Ok(r.index)
    }

    /// Reports the result of taking a snapshot.
    pub async fn report_snapshot(
        &mut self,
        snapshot: &str,
        result: &opendsec_commands::SnapshotResult,
        request_id: &str,
    ) -> Result<u64, SliceError> {
        let snapshot_result_json = serde_json::to_string(result).expect("snapshot results serialise");
        let r = self
            .client
            .report(self.req(ReportRequest {
                snapshot: snapshot.into(),
                snapshot_result_json,
                request_id: request_id.into(),
                ..Default::default()
            }))
            .await?
            .into_inner();
        Ok(r.index)
    }

    /// Reports what came of pulling image `name`.
    pub async fn report_image(
        &mut self,
        name: &str,
        result: &opendsec_commands::ImageResult,
        request_id: &str,
    ) -> Result<u64, SliceError> {
        let image_result_json = serde_json::to_string(result).expect("image results serialise");
        let r = self
            .client
            .report(self.req(ReportRequest {
                image: name.into(),
                image_result_json,
                request_id: request_id.into(),
                ..Default::default()
            }))
            .await?
            .into_inner();
        Ok(r.index)
    }

    /// Soft state: liveness and usage, kept in the control node's memory only.
    /// Sends a heartbeat; the reply says when the control node last rotated the
    /// cluster's certificates (ms; 0: not since it started).
    pub async fn heartbeat(&mut self, hb: HeartbeatRequest) -> Result<u64, SliceError> {
        let reply = self.client.heartbeat(self.req(hb)).await?.into_inner();
        Ok(reply.certificates_rotated_at_ms)
    }
}

/// Follows an edge's slice for ever: reconnects after errors and resumes after the
/// last index it returned, so no entry is lost or repeated.
pub struct SliceFollower {
    client: SliceClient,
    edge: String,
    next_index: u64,
    stream: Option<Streaming<SliceMessage>>,
}

impl SliceFollower {
    pub fn new(client: SliceClient, edge: &str, from_index: u64) -> SliceFollower {
        SliceFollower {
            client,
            edge: edge.to_string(),
            next_index: from_index.max(1),
            stream: None,
        }
    }

    /// The first index not yet returned (what an edge persists to resume after a restart).
    pub fn next_index(&self) -> u64 {
        self.next_index
    }

    /// Drops the connection (the next call reconnects and resumes).
    pub fn disconnect(&mut self) {
        self.stream = None;
    }

    /// The next message of the slice, reconnecting as needed.
    pub async fn next(&mut self) -> SliceMessage {
        loop {
            if self.stream.is_none() {
                match self.client.watch(&self.edge, self.next_index).await {
                    Ok(s) => self.stream = Some(s),
                    Err(e) => {
                        tracing::warn!(edge = %self.edge, error = %e, "slice watch failed; retrying");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                        continue;
                    }
                }
            }
            let stream = self.stream.as_mut().expect("connected above");
            match stream.message().await {
                Ok(Some(m)) => {
                    let last = match &m.body {
                        Some(Body::Snapshot(s)) => s.index,
                        Some(Body::Entry(e)) => e.index,
                        Some(Body::Progress(p)) => p.index,
                        None => continue,
                    };
                    let is_snapshot = matches!(m.body, Some(Body::Snapshot(_)));
                    if last < self.next_index && !is_snapshot {
                        continue; // already handed out before a reconnect
                    }
                    self.next_index = last + 1;
                    return m;
                }
                Ok(None) | Err(_) => {
                    self.stream = None;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
    }
}
