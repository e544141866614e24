//! The sandbox the network figures are taken from: a `busybox` container sandbox made
//! through the REST API, and where its network is. Its edge records its addresses in
//! `/run/opendsec/net/edges/<tag>/<slot>.json` (`{"slot", "owner", "v4", "v6"}`; a
//! claimed warm container's record names the sandbox once handed over), its namespace
//! is `/run/netns/opendsec-<tag>-<slot>`, and the DNS proxy listens on the edge's
//! gateway address (`edges/<tag>/gateway`), port 53.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::time::{Duration, Instant};

use opendsec_edge::net::DEFAULT_STATE_DIR;
use opendsec_edge::net::addrs::Slot;
use serde_json::{Value, json};

use crate::sandboxes::UpGuard;

pub(super) struct Probe {
    pub(super) id: String,
    /// Its network namespace's name (under /run/netns).
    pub(super) netns: String,
    pub(super) v4: Ipv4Addr,
    /// The DNS proxy: the edge's gateway, port 53.
    pub(super) proxy: SocketAddr,
}

impl Probe {
    /// Creates a busybox sandbox under `network` and waits until it runs.
    pub(super) async fn create(up: &UpGuard, network: Value) -> Result<Probe, String> {
        let id = up.create(&json!({"image": "busybox", "network": network})).await?;
        up.wait_state(&id, "running", Duration::from_millis(50), Duration::from_secs(120))
            .await?;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some((tag, slot)) = find_slot(&id) {
                let gateway =
                    std::fs::read_to_string(Path::new(DEFAULT_STATE_DIR).join("edges").join(&tag).join("gateway"))
                        .map_err(|e| format!("the edge's gateway: {e}"))?;
                let gateway: Ipv4Addr = gateway
                    .trim()
                    .parse()
                    .map_err(|e| format!("the edge's gateway {gateway:?}: {e}"))?;
                let netns = format!("opendsec-{tag}-{}", slot.slot);
                if !Path::new(&super::netns::path(&netns)).exists() {
                    return Err(format!("sandbox {id}: its namespace {netns} does not exist"));
                }
                return Ok(Probe {
                    id,
                    netns,
                    v4: slot.v4,
                    proxy: SocketAddr::new(gateway.into(), 53),
                });
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "sandbox {id} runs but no edge under {DEFAULT_STATE_DIR}/edges records its addresses"
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// `PUT /v1/sandboxes/{id}/network` with `policy` (the whole policy).
    pub(super) async fn set_policy(&self, up: &UpGuard, policy: &Value) -> Result<(), String> {
        let (st, v) = up
            .send(
                reqwest::Method::PUT,
                &format!("/v1/sandboxes/{}/network", self.id),
                Some(policy.clone()),
            )
            .await?;
        if st != 200 {
            return Err(format!(
                "PUT /v1/sandboxes/{}/network {policy}: HTTP {st}: {v}",
                self.id
            ));
        }
        Ok(())
    }
}

/// The edge (its tag) and slot whose record names sandbox `owner`.
fn find_slot(owner: &str) -> Option<(String, Slot)> {
    let edges = std::fs::read_dir(Path::new(DEFAULT_STATE_DIR).join("edges")).ok()?;
    for edge in edges.flatten().filter(|e| e.path().is_dir()) {
        for f in std::fs::read_dir(edge.path()).into_iter().flatten().flatten() {
            if f.path().extension().is_none_or(|x| x != "json") {
                continue;
            }
            let Some(slot) = std::fs::read(f.path())
                .ok()
                .and_then(|b| serde_json::from_slice::<Slot>(&b).ok())
            else {
                continue;
            };
            if slot.owner == owner {
                return Some((edge.file_name().to_string_lossy().to_string(), slot));
            }
        }
    }
    None
}
