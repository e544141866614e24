//! The system under test: real `opendsec control` processes (1 or 3) on loopback,
//! driven through the REST API.
//!
//! Setup builds nothing: it runs the `opendsec` binary given by `--opt
//! opendsec_bin=PATH`, else `$CARGO_TARGET_DIR/release/opendsec`, else
//! `target/release/opendsec` of the workspace (`ops/bench.sh` builds it in release
//! first). It starts the nodes with their data dirs under the bench data dir (the same
//! disk as the redb baseline), bootstraps the cluster with `opendsec init`, registers
//! one edge with ample capacity and creates [`SANDBOXES`] sandboxes.
//!
//! One write = `PUT /v1/sandboxes/{id}/labels` with one label: key `b` and a value of
//! `payload - 1` (at most 255, the label rule's limit) characters of `[a-z0-9]`, so a
//! 256-byte payload is 1 key byte + 255 value bytes. That is one durable, replicated
//! log append per write through the whole API path: authentication, `decide`, Raft
//! (fsync on a majority), apply, and the HTTP reply. Worker `w` talks to node
//! `w % nodes` (followers forward to the leader), as the etcd baseline does, and sets
//! the labels of sandbox `w % SANDBOXES`.
//!
//! Dropping the [`OpendsecCluster`] kills every node and deletes the data; nodes also
//! get SIGKILL if the benchmark process dies (PR_SET_PDEATHSIG).

use crate::log_tail;
use std::fs::File;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tempfile::TempDir;

use crate::load::{BoxFuture, WriteTarget};
use crate::targets::{ReplaySource, Session, SetupCtx};

/// Sandboxes the writes cycle over.
pub const SANDBOXES: usize = 64;
/// Label key of every write.
pub const LABEL_KEY: &str = "b";
/// The label rule: values up to 255 characters.
pub const MAX_LABEL_VALUE: usize = 255;

/// The label value length used for a payload of `payload_len` bytes (key + value = payload,
/// capped at the 255-character value limit).
pub fn value_len(payload_len: usize) -> usize {
    payload_len.saturating_sub(LABEL_KEY.len()).clamp(1, MAX_LABEL_VALUE)
}

/// What the output says about how an opendsec write is made.
pub fn describe(payload_len: usize) -> String {
    let v = value_len(payload_len);
    format!(
        "opendsec write = PUT /v1/sandboxes/{{id}}/labels {{\"labels\":{{\"{LABEL_KEY}\":<{v} chars of [a-z0-9]>}}}} \
         (key {} B + value {v} B = {} B of label; label values are limited to {MAX_LABEL_VALUE} chars), \
         one replicated log append each through auth, decide, Raft and apply",
        LABEL_KEY.len(),
        LABEL_KEY.len() + v
    )
}

fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// The `opendsec` executable: `--opt opendsec_bin`, `$CARGO_TARGET_DIR/release/opendsec`,
/// or the workspace's `target/release/opendsec`.
pub fn find_bin(ctx: &SetupCtx) -> Result<PathBuf, String> {
    if let Some(p) = ctx.opts.get("opendsec_bin") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(format!("--opt opendsec_bin={}: no such file", p.display()))
        };
    }
    let mut tried = Vec::new();
    if let Ok(t) = std::env::var("CARGO_TARGET_DIR") {
        tried.push(PathBuf::from(t).join("release").join("opendsec"));
    }
    let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join("..");
    tried.push(ws.join("target").join("release").join("opendsec"));
    tried.iter().find(|p| p.is_file()).cloned().ok_or_else(|| {
        format!(
            "no opendsec binary at {}; build it with `cargo build --release -p opendsec` or pass --opt opendsec_bin=PATH",
            tried.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" or ")
        )
    })
}

struct Node {
    http: String,
    peer: String,
    log: PathBuf,
    child: Option<Child>,
}

/// A running OpenDsec cluster. Drop kills every node and deletes the data.
pub struct OpendsecCluster {
    nodes: Vec<Node>,
    pub token: String,
    pub urls: Vec<String>,
    dir: Option<TempDir>,
}

impl Drop for OpendsecCluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            if let Some(c) = n.child.as_mut() {
                let _ = c.kill();
            }
        }
        for n in &mut self.nodes {
            if let Some(mut c) = n.child.take() {
                let _ = c.wait();
            }
        }
        if let Some(d) = self.dir.take() {
            let _ = d.close();
        }
    }
}

async fn call(req: reqwest::RequestBuilder) -> Result<Value, String> {
    let r = req.send().await.map_err(|e| e.to_string())?;
    let st = r.status();
    let body = r.text().await.map_err(|e| e.to_string())?;
    if !st.is_success() {
        return Err(format!("{st}: {}", body.chars().take(300).collect::<String>()));
    }
    serde_json::from_str(&body).map_err(|e| format!("bad JSON ({e}): {}", body.chars().take(200).collect::<String>()))
}

impl OpendsecCluster {
    /// Starts `members` nodes, bootstraps the cluster and waits until every node answers.
    pub async fn start(bin: &Path, data_root: &Path, members: usize) -> Result<Self, String> {
        std::fs::create_dir_all(data_root).map_err(|e| format!("create {data_root:?}: {e}"))?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("opendsec{members}-"))
            .tempdir_in(data_root)
            .map_err(|e| format!("tempdir in {data_root:?}: {e}"))?;
        let key_file = dir.path().join("cluster.key");
        // Any secret string works; the nodes only compare it.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let key = format!("{:032x}{:08x}", nanos, std::process::id());
        std::fs::write(&key_file, key).map_err(|e| e.to_string())?;
        let mut nodes = Vec::new();
        for id in 1..=members {
            nodes.push(Node {
                http: format!("127.0.0.1:{}", free_port()?),
                peer: format!("127.0.0.1:{}", free_port()?),
                log: dir.path().join(format!("node{id}.log")),
                child: None,
            });
        }
        let init_members = nodes
            .iter()
            .enumerate()
            .map(|(i, n)| format!("{}={}", i + 1, n.peer))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = OpendsecCluster {
            urls: nodes.iter().map(|n| format!("http://{}", n.http)).collect(),
            nodes,
            token: String::new(),
            dir: None,
        };
        // One CA for the cluster: every peer connection is mutual TLS under it.
        let pki = dir.path().join("pki");
        let made = Command::new(bin)
            .args(["ca", "--dir"])
            .arg(&pki)
            .output()
            .map_err(|e| format!("run {} ca: {e}", bin.display()))?;
        if !made.status.success() {
            return Err(format!("opendsec ca: {}", String::from_utf8_lossy(&made.stderr).trim()));
        }
        for (i, n) in cluster.nodes.iter_mut().enumerate() {
            let log = File::create(&n.log).map_err(|e| e.to_string())?;
            let mut cmd = Command::new(bin);
            cmd.args(["control", "--id", &(i + 1).to_string()])
                .arg("--data-dir")
                .arg(dir.path().join(format!("node{}", i + 1)))
                .args(["--listen", &n.http, "--peer-listen", &n.peer])
                .arg("--cluster-key-file")
                .arg(&key_file)
                .arg("--pki-dir")
                .arg(&pki)
                .args(["--worker-threads", &crate::member_threads(members).to_string()])
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log);
            if i == 0 {
                cmd.args(["--init-members", &init_members]);
            }
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            n.child = Some(cmd.spawn().map_err(|e| format!("spawn {}: {e}", bin.display()))?);
        }
        let token_file = dir.path().join("admin.token");
        let peers = cluster
            .nodes
            .iter()
            .map(|n| n.peer.clone())
            .collect::<Vec<_>>()
            .join(",");
        cluster.dir = Some(dir);
        let out = tokio::process::Command::new(bin)
            .args(["init", "--peer", &peers])
            .arg("--pki-dir")
            .arg(&pki)
            .arg("--token-file")
            .arg(&token_file)
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| format!("run {} init: {e}", bin.display()))?;
        if !out.status.success() {
            let logs: Vec<String> = cluster.nodes.iter().map(|n| log_tail(&n.log, 5)).collect();
            return Err(format!(
                "opendsec init failed: {}; node logs: {logs:?}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        cluster.token = std::fs::read_to_string(&token_file)
            .map_err(|e| e.to_string())?
            .trim()
            .to_string();

        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(60);
        for k in 0..cluster.nodes.len() {
            loop {
                if let Some(Ok(Some(st))) = cluster.nodes[k].child.as_mut().map(|c| c.try_wait()) {
                    return Err(format!(
                        "opendsec node {} exited ({st}): {}",
                        k + 1,
                        log_tail(&cluster.nodes[k].log, 5)
                    ));
                }
                // Ready = it answers /v1/cluster and knows a leader.
                let r = call(
                    http.get(format!("{}/v1/cluster", cluster.urls[k]))
                        .bearer_auth(&cluster.token),
                )
                .await;
                if let Ok(v) = r
                    && v["leader_id"].as_u64().is_some()
                {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!(
                        "opendsec node {} not ready after 60 s: {}",
                        k + 1,
                        log_tail(&cluster.nodes[k].log, 5)
                    ));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        Ok(cluster)
    }
}

/// Writes through `PUT /v1/sandboxes/{id}/labels`; see the module docs.
pub struct OpendsecTarget {
    http: reqwest::Client,
    token: String,
    /// Per node: per sandbox, the labels URL.
    urls: Vec<Vec<String>>,
    value_len: usize,
}

impl WriteTarget for OpendsecTarget {
    fn name(&self) -> String {
        format!("opendsec {}-node", self.urls.len())
    }
    fn write(&self, worker: usize, _seq: u64, payload: Vec<u8>) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let node = &self.urls[worker % self.urls.len()];
            let url = &node[worker % node.len()];
            // The payload's bytes, mapped onto what a label value accepts.
            const ALPHABET: &[u8; 36] = b"abcdefghijklmnopqrstuvwxyz0123456789";
            let value: String = payload
                .iter()
                .cycle()
                .take(self.value_len)
                .map(|b| ALPHABET[(*b % 36) as usize] as char)
                .collect();
            let body = format!("{{\"labels\":{{\"{LABEL_KEY}\":\"{value}\"}}}}");
            let r = self
                .http
                .put(url)
                .bearer_auth(&self.token)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if r.status().is_success() {
                let _ = r.bytes().await;
                Ok(())
            } else {
                let st = r.status();
                Err(format!(
                    "{st}: {}",
                    r.text().await.unwrap_or_default().chars().take(300).collect::<String>()
                ))
            }
        })
    }
}

/// Replay through the API: `GET /v1/replay?to=<applied index>&view=sandboxes` on node 1.
/// The server starts from its newest checkpoint (one every 10,000 entries by default)
/// and folds the entries after it, so this is checkpoint load + fold of the tail + the
/// JSON of the sandboxes view, not a fold of the whole log. Returns the index replayed to.
pub struct ApiReplay {
    http: reqwest::Client,
    token: String,
    url: String,
    members: usize,
}

impl ReplaySource for ApiReplay {
    fn name(&self) -> String {
        format!(
            "opendsec {}-node GET /v1/replay?to=<last index>&view=sandboxes",
            self.members
        )
    }
    fn replay(&self) -> BoxFuture<'_, Result<u64, String>> {
        Box::pin(async move {
            let st = call(
                self.http
                    .get(format!("{}/v1/cluster", self.url))
                    .bearer_auth(&self.token),
            )
            .await?;
            let to = st["applied_index"].as_u64().ok_or("no applied_index in /v1/cluster")?;
            let v = call(
                self.http
                    .get(format!("{}/v1/replay?to={to}&view=sandboxes", self.url))
                    .bearer_auth(&self.token),
            )
            .await?;
            let got = v["index"].as_u64().ok_or("no index in the replay answer")?;
            if got != to {
                return Err(format!("replay answered index {got}, asked for {to}"));
            }
            Ok(got)
        })
    }
    fn note(&self, events: u64) -> Option<String> {
        Some(if events >= 10_000 {
            format!(
                "= load the newest checkpoint (one every 10,000 entries) + fold the ~{} entries after it + render the view; \
                 not a fold of all {events} entries",
                events % 10_000
            )
        } else {
            format!("= no checkpoint yet: fold of all {events} entries + render the view")
        })
    }
}

pub async fn setup(ctx: SetupCtx, members: usize) -> Result<Session, String> {
    let bin = find_bin(&ctx)?;
    let cluster = OpendsecCluster::start(&bin, &ctx.data_dir, members).await?;
    let admin = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| e.to_string())?;
    let base = &cluster.urls[0];
    call(
        admin
            .post(format!("{base}/v1/edges"))
            .bearer_auth(&cluster.token)
            .json(&json!({
                "edge": "bench-edge",
                "address": "127.0.0.1:1",
                "capacity": {"sandboxes": 1_000_000u64, "cpu_millis": 1_000_000_000u64, "memory_mb": 1_000_000_000u64},
                "labels": {}
            })),
    )
    .await
    .map_err(|e| format!("register edge: {e}"))?;
    let mut ids = Vec::new();
    for i in 0..SANDBOXES {
        let v = call(
            admin
                .post(format!("{base}/v1/sandboxes"))
                .bearer_auth(&cluster.token)
                .json(&json!({"image": "busybox", "cpu_millis": 100, "memory_mb": 64, "labels": {"n": i.to_string()}})),
        )
        .await
        .map_err(|e| format!("create sandbox {i}: {e}"))?;
        let id = v["sandbox"]["id"]
            .as_str()
            .ok_or_else(|| format!("no sandbox id in {v}"))?
            .to_string();
        ids.push(id);
    }
    // Wait until every node has applied the setup, so the load starts from a quiet cluster.
    let want = call(admin.get(format!("{base}/v1/cluster")).bearer_auth(&cluster.token)).await?["applied_index"]
        .as_u64()
        .unwrap_or(0);
    for u in &cluster.urls {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let v = call(admin.get(format!("{u}/v1/cluster")).bearer_auth(&cluster.token)).await?;
            if v["applied_index"].as_u64().unwrap_or(0) >= want {
                break;
            }
            if Instant::now() > deadline {
                return Err(format!("{u} did not apply index {want} within 30 s"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    // One shared pool: one keep-alive connection per concurrent request, as for etcd.
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1024)
        .build()
        .map_err(|e| e.to_string())?;
    let target = Arc::new(OpendsecTarget {
        http: http.clone(),
        token: cluster.token.clone(),
        urls: cluster
            .urls
            .iter()
            .map(|u| ids.iter().map(|id| format!("{u}/v1/sandboxes/{id}/labels")).collect())
            .collect(),
        value_len: value_len(ctx.payload_len),
    });
    let mut s = Session::new(target).with_note(describe(ctx.payload_len));
    if members == 1 {
        s = s.with_replay(Arc::new(ApiReplay {
            http,
            token: cluster.token.clone(),
            url: base.clone(),
            members,
        }));
    }
    Ok(s.with_guard(cluster))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fold::label_value;

    #[test]
    fn payload_maps_to_key_plus_255() {
        assert_eq!(value_len(256), 255);
        assert_eq!(value_len(1000), 255);
        assert_eq!(value_len(64), 63);
        assert_eq!(label_value(7, 255).len(), 255);
        assert!(
            label_value(7, 255)
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        );
    }
}
