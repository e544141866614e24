//! Real nodes for tests: a control node on 127.0.0.1 with its peer port served,
//! a data directory of its own, initialised and bootstrapped. No mocks.

use crate::node::{ControlConfig, ControlNode};
use crate::{Credential, format_token, new_cluster_key, new_token_secret, serve_peer};
use opendsec_commands::Command;
use std::collections::BTreeMap;
use std::time::Duration;
use tempfile::TempDir;

pub struct TestNode {
    pub node: ControlNode,
    pub peer_addr: String,
    /// The first admin token (`odsec_...`), holding every right.
    pub admin_token: String,
    pub root_project: String,
    pub dir: TempDir,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl TestNode {
    /// A component `id` of this node's cluster: a certificate from the node's CA.
    pub fn peer_trust(&self, id: opendsec_trust::Identity) -> std::sync::Arc<opendsec_trust::Trust> {
        std::sync::Arc::new(self.node.trust().sibling(id).expect("the test node holds its CA"))
    }

    pub async fn shutdown(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.node.shutdown().await;
    }
}

/// Starts a node's peer server on a fresh loopback port.
pub async fn start(
    cfg_for: impl FnOnce(String) -> ControlConfig,
) -> (ControlNode, String, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr").to_string();
    let node = ControlNode::open(cfg_for(addr.clone()))
        .await
        .expect("open control node");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let n = node.clone();
    tokio::spawn(async move {
        let _ = serve_peer(n, listener, async {
            let _ = rx.await;
        })
        .await;
    });
    (node, addr, tx)
}

/// Bootstraps a cluster through `node` (its leader); returns (admin token, root project id).
pub async fn bootstrap(node: &ControlNode) -> (String, String) {
    let (secret, hash) = new_token_secret();
    let cmd = Command::Bootstrap {
        project_name: "root".into(),
        token_name: "admin".into(),
        secret_sha256: hash,
    };
    let s = node
        .submit(Credential::System, "bootstrap".into(), cmd)
        .await
        .expect("bootstrap");
    (format_token(&s.decided.target, &secret), s.decided.project)
}

/// One initialised, bootstrapped node; `tune` may change its configuration.
pub async fn single_node_with(tune: impl FnOnce(&mut ControlConfig)) -> TestNode {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().to_path_buf();
    let (node, peer_addr, stop) = start(|addr| {
        let ca = opendsec_trust::Ca::load_or_create(&path.join("tls")).expect("the test node's CA");
        let trust = std::sync::Arc::new(
            opendsec_trust::Trust::issued_by(ca, opendsec_trust::Identity::control(1))
                .expect("the test node's certificate"),
        );
        let mut cfg = ControlConfig::new(1, path, addr, new_cluster_key(), trust);
        tune(&mut cfg);
        cfg
    })
    .await;
    node.initialize(BTreeMap::from([(1, peer_addr.clone())]))
        .await
        .expect("initialise");
    wait_for_leader(&node).await;
    let (admin_token, root_project) = bootstrap(&node).await;
    TestNode {
        node,
        peer_addr,
        admin_token,
        root_project,
        dir,
        stop: Some(stop),
    }
}

pub async fn single_node() -> TestNode {
    single_node_with(|_| {}).await
}

/// Reports sandbox `id` running, as its edge does once it has started it (tests whose
/// "edge" is a proxy in front of an agent they started themselves).
pub async fn report_ready(node: &ControlNode, id: &str) {
    let ready = Command::ReportSandbox {
        sandbox: id.to_string(),
        observation: opendsec_commands::Observation::Ready,
    };
    node.submit(
        Credential::System,
        format!("ready:{id}#{}", uuid::Uuid::new_v4().simple()),
        ready,
    )
    .await
    .unwrap_or_else(|e| panic!("reporting {id} ready: {e:?}"));
}

/// Waits (up to 10 s) until the node knows a leader.
pub async fn wait_for_leader(node: &ControlNode) {
    for _ in 0..200 {
        if node.log().status().leader_id.is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("no leader elected within 10 s");
}
