//! Edge admission: before a sandbox is logged on an edge that answers admission
//! requests, the leader asks the edge itself (`POST /admit` on its proxy, with the edge
//! key). The edge judges from what really runs there; a refusal (or no answer) makes the
//! leader place the sandbox again without that edge.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use std::time::Duration;

pub use opendsec_edge_api::admission::AdmitRequest;
use opendsec_edge_api::headers::EDGE_KEY_HEADER;

/// Asks the edge at `address`; `Err` carries why it did not admit.
pub async fn ask(address: &str, edge_key: &str, req: &AdmitRequest) -> Result<(), String> {
    let call = async {
        let tcp = tokio::net::TcpStream::connect(address)
            .await
            .map_err(|e| format!("edge unreachable: {e}"))?;
        let _ = tcp.set_nodelay(true);
        let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
            .await
            .map_err(|e| format!("edge handshake: {e}"))?;
        tokio::spawn(conn);
        let body = serde_json::to_vec(req).map_err(|e| e.to_string())?;
        let request = hyper::Request::post("/admit")
            .header("host", "edge")
            .header("content-type", "application/json")
            .header(EDGE_KEY_HEADER, edge_key)
            .body(Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let resp = send
            .send_request(request)
            .await
            .map_err(|e| format!("edge admission call: {e}"))?;
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
            let why = serde_json::from_str::<serde_json::Value>(&text)
                .ok()
                .and_then(|v| v["message"].as_str().map(str::to_string))
                .unwrap_or(text);
            Err(why)
        }
    };
    // Generous: an edge busy creating hundreds of sandboxes still answers, just later.
    match tokio::time::timeout(Duration::from_secs(10), call).await {
        Ok(r) => r,
        Err(_) => Err("edge admission timed out".into()),
    }
}
