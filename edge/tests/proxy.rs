//! Specification of the edge proxy: with the edge key, a request for
//! `/sandboxes/{id}/{path}` reaches the real agent of that sandbox (over its Unix
//! socket) and streams back; without the key, or for an unknown sandbox, it is refused.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use opendsec_edge::proxy::{self, EDGE_KEY_HEADER, Resolver};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

struct Agent(Child);
impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn start(dir: &std::path::Path) -> (Agent, String) {
    let sock = dir.join("agent.sock");
    let child = Command::new(opendsec_edge::testing::agent_binary())
        .args(["serve", "--listen"])
        .arg(format!("unix:{}", sock.display()))
        .args(["--default-user", "root"])
        .spawn()
        .expect("start the agent");
    for _ in 0..100 {
        if sock.exists() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let resolve: Resolver = Arc::new(move |id| (id == "sb1").then(|| sock.clone().into()));
    let edge = opendsec_trust::test_trust(opendsec_trust::Identity::edge("e1"));
    tokio::spawn(proxy::serve(listener, edge, "edge-key".into(), resolve));
    (Agent(child), addr)
}

/// One request on a new connection to the proxy, as a gateway of the cluster (mutual TLS).
async fn call(addr: &str, req: Request<Full<Bytes>>) -> (u16, Vec<u8>) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let gateway = opendsec_trust::test_trust(opendsec_trust::Identity::gateway(1));
    let edge = opendsec_trust::Expect::Exactly(opendsec_trust::Identity::edge("e1"));
    let tls = gateway.connect(tcp, &edge).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
        .await
        .unwrap();
    tokio::spawn(conn);
    let resp = send.send_request(req).await.unwrap();
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.unwrap().to_bytes().to_vec();
    (status, body)
}

fn get(path: &str, key: Option<&str>) -> Request<Full<Bytes>> {
    let mut b = Request::get(path).header("host", "edge");
    if let Some(k) = key {
        b = b.header(EDGE_KEY_HEADER, k);
    }
    b.body(Full::new(Bytes::new())).unwrap()
}

/// One Connect streaming request envelope: flags, big-endian length, JSON.
fn envelope(json: &str) -> Vec<u8> {
    let mut out = vec![0u8];
    out.extend_from_slice(&(json.len() as u32).to_be_bytes());
    out.extend_from_slice(json.as_bytes());
    out
}

#[tokio::test]
async fn requests_reach_the_sandboxes_agent_only_with_the_edge_key() {
    let dir = tempfile::tempdir().unwrap();
    let (_agent, addr) = start(dir.path()).await;

    let (status, body) = call(&addr, get("/sandboxes/sb1/health", None)).await;
    assert_eq!(status, 401, "{}", String::from_utf8_lossy(&body));
    let (status, _) = call(&addr, get("/sandboxes/sb1/health", Some("wrong-key"))).await;
    assert_eq!(status, 401);

    let (status, body) = call(&addr, get("/sandboxes/nope/health", Some("edge-key"))).await;
    assert_eq!(status, 502);
    assert!(
        String::from_utf8_lossy(&body).contains("was not found"),
        "E2B reads this as a gone sandbox"
    );

    let (status, _) = call(&addr, get("/sandboxes/sb1/health", Some("edge-key"))).await;
    assert_eq!(status, 204);

    // A streaming RPC goes through unchanged: process.Process/Start of `echo hi`.
    let start = envelope(r#"{"process":{"cmd":"/bin/sh","args":["-c","echo hi"]}}"#);
    let req = Request::post("/sandboxes/sb1/process.Process/Start")
        .header("host", "edge")
        .header(EDGE_KEY_HEADER, "edge-key")
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .body(Full::new(Bytes::from(start)))
        .unwrap();
    let (status, body) = call(&addr, req).await;
    assert_eq!(status, 200);
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("\"start\""), "{text}");
    assert!(text.contains("aGkK"), "stdout \"hi\\n\" in base64: {text}");
    assert!(
        text.contains("\"exitCode\"") || text.contains("\"exited\":true"),
        "{text}"
    );
}

/// Sends one request as `who` (over TLS with its certificate), or over plain TCP when
/// `None`; `Err` when the proxy closes the connection without an answer.
async fn call_as(addr: &str, who: Option<std::sync::Arc<opendsec_trust::Trust>>) -> Result<u16, String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let req = get("/sandboxes/sb1/health", Some("edge-key"));
    let status = match who {
        Some(trust) => {
            let edge = opendsec_trust::Expect::Exactly(opendsec_trust::Identity::edge("e1"));
            let tls = trust.connect(tcp, &edge).await.map_err(|e| e.to_string())?;
            let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            send.send_request(req).await.map_err(|e| e.to_string())?.status()
        }
        None => {
            let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            send.send_request(req).await.map_err(|e| e.to_string())?.status()
        }
    };
    Ok(status.as_u16())
}

#[tokio::test]
async fn the_proxy_serves_the_clusters_gateways_control_nodes_and_edges_only() {
    use opendsec_trust::{Identity, test_trust};
    let dir = tempfile::tempdir().unwrap();
    let (_agent, addr) = start(dir.path()).await;
    for who in [Identity::gateway(1), Identity::control(2), Identity::edge("e2")] {
        assert_eq!(call_as(&addr, Some(test_trust(who.clone()))).await, Ok(204), "{who}");
    }
    // An operator tool's certificate, another CA's gateway, and plain HTTP get nothing,
    // the edge key notwithstanding.
    let foreign = opendsec_trust::test_cluster(&[Identity::gateway(1)]).remove(0);
    for (what, who) in [
        ("an operator tool", Some(test_trust(Identity::operator("init")))),
        ("another CA's gateway", Some(foreign)),
        ("plain HTTP", None),
    ] {
        assert!(call_as(&addr, who).await.is_err(), "{what} was answered");
    }
}
