//! Edge admission: before a sandbox is logged on an edge that answers admission
//! requests, the leader asks the edge itself (`POST /admit` on its proxy, with the edge
//! key). The edge judges from what really runs there; a refusal (or no answer) makes the
//! leader place the sandbox again without that edge. The call is mutual TLS: the edge
//! must present its own certificate, the leader presents its control node's.

use http_body_util::BodyExt;
use std::time::Duration;

pub use opendsec_edge_api::admission::{AdmitRefusal, AdmitRequest};
use opendsec_edge_api::headers::EDGE_KEY_HEADER;

/// The client admission requests go through: connections to edges are kept alive,
/// since every sandbox placed on an admitting edge is asked about first.
pub fn client(trust: std::sync::Arc<opendsec_trust::Trust>) -> opendsec_http::Client {
    opendsec_http::Client::with_trust(None, trust)
}

/// Asks edge `edge` at `address` through `client`; `Err` carries why it did not admit.
pub async fn ask(
    client: &opendsec_http::Client,
    edge: &str,
    address: &str,
    edge_key: &str,
    req: &AdmitRequest,
) -> Result<(), String> {
    let call = async {
        let body = serde_json::to_vec(req).map_err(|e| e.to_string())?;
        let request = hyper::Request::post("/admit")
            .header("host", "edge")
            .header("content-type", "application/json")
            .header(EDGE_KEY_HEADER, edge_key)
            .body(opendsec_http::full(body))
            .map_err(|e| e.to_string())?;
        let to = opendsec_http::Endpoint::Edge {
            addr: address.to_string(),
            edge: edge.to_string(),
        };
        let resp = client.send(&to, request).await.map_err(|e| match e {
            opendsec_http::Error::Connect { source, .. } => format!("edge unreachable: {source}"),
            opendsec_http::Error::Handshake { source, .. } => format!("edge handshake: {source}"),
            other => format!("edge admission call: {other}"),
        })?;
        let status = resp.status();
        let text = resp
            .into_body()
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).to_string())
            .unwrap_or_default();
        if status.is_success() {
            Ok(())
        } else {
            Err(serde_json::from_str::<AdmitRefusal>(&text).map_or(text, |r| r.message))
        }
    };
    // Generous: an edge busy creating hundreds of sandboxes still answers, just later.
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(r) => r,
        Err(_) => Err("edge admission timed out".into()),
    }
}
