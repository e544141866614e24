//! Baseline (b): etcd (Debian's `etcd-server`, 3.4) on loopback, driven through its v3
//! HTTP/JSON gateway (`POST <prefix>/kv/put`, key and value base64). Default durability
//! (etcd fsyncs its WAL before acknowledging). Either as etcd ships (plain peer links) or
//! with mutual TLS between its members (`--peer-client-cert-auth`, certificates from a CA
//! made for the run), the analogue of OpenDsec's mutual TLS on its peer port; clients
//! speak plain HTTP to both, as the benchmark speaks plain HTTP to OpenDsec's REST API. The cluster is started by [`setup`] and
//! killed, with its data deleted, when the returned [`Session`] is dropped (also on
//! error or panic); members also get SIGKILL if the benchmark process dies
//! (PR_SET_PDEATHSIG).

use crate::log_tail;
use base64::Engine as _;
use std::fs::File;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::load::{BoxFuture, WriteTarget};
use crate::targets::{Session, SetupCtx};

/// Client ports: `CLIENT_BASE + i`, peer ports `CLIENT_BASE + 10 + i`. The 1-member
/// cluster uses `i = 5` and the 3-member one with peer TLS `i = 20..23`, so that no two
/// clusters' ports clash (every target is set up before any is measured).
pub const CLIENT_BASE: u16 = 23791;

/// A running etcd cluster. Drop kills every member and deletes the data.
pub struct EtcdCluster {
    children: Vec<Child>,
    pub client_urls: Vec<String>,
    /// Gateway prefix that answered, `/v3` or `/v3beta`.
    pub prefix: String,
    dir: Option<TempDir>,
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
        }
        for c in &mut self.children {
            let _ = c.wait();
        }
        if let Some(d) = self.dir.take() {
            let _ = d.close();
        }
    }
}

impl EtcdCluster {
    /// Start `members` members and wait until every one is healthy and a put succeeds.
    pub async fn start(etcd_bin: &str, data_root: &Path, members: usize, peer_tls: bool) -> Result<Self, String> {
        std::fs::create_dir_all(data_root).map_err(|e| format!("create {data_root:?}: {e}"))?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("etcd{members}-"))
            .tempdir_in(data_root)
            .map_err(|e| format!("tempdir in {data_root:?}: {e}"))?;
        let first = match (members, peer_tls) {
            (1, _) => 5,
            (_, false) => 0,
            (_, true) => 20,
        };
        // Peer certificates for 127.0.0.1 from a CA made for the run (both uses: no EKU).
        let peer_scheme = if peer_tls { "https" } else { "http" };
        let mut tls_args: Vec<String> = Vec::new();
        if peer_tls {
            let ca = opendsec_trust::Ca::create(&dir.path().join("pki")).map_err(|e| e.to_string())?;
            let issued = ca
                .issue_server(&["localhost".into()], &[std::net::IpAddr::from([127, 0, 0, 1])])
                .map_err(|e| e.to_string())?;
            let (crt, key) = (dir.path().join("peer.crt"), dir.path().join("peer.key"));
            std::fs::write(&crt, &issued.cert_pem).map_err(|e| e.to_string())?;
            opendsec_trust::write_private(&key, &issued.key_pem).map_err(|e| e.to_string())?;
            let ca_file = opendsec_trust::ca_files(&dir.path().join("pki")).0;
            for (flag, path) in [
                ("--peer-cert-file", &crt),
                ("--peer-key-file", &key),
                ("--peer-trusted-ca-file", &ca_file),
            ] {
                tls_args.push(flag.into());
                tls_args.push(path.to_string_lossy().into_owned());
            }
            tls_args.push("--peer-client-cert-auth".into());
        }
        let idx: Vec<u16> = (first..first + members as u16).collect();
        let client = |i: u16| CLIENT_BASE + i;
        let peer = |i: u16| CLIENT_BASE + 10 + i;
        for &i in &idx {
            for port in [client(i), peer(i)] {
                TcpListener::bind(("127.0.0.1", port))
                    .map_err(|e| format!("port {port} on 127.0.0.1 is not free: {e}"))?;
            }
        }
        let initial_cluster = idx
            .iter()
            .map(|&i| format!("m{i}={peer_scheme}://127.0.0.1:{}", peer(i)))
            .collect::<Vec<_>>()
            .join(",");
        let mut cluster = EtcdCluster {
            children: Vec::new(),
            client_urls: idx.iter().map(|&i| format!("http://127.0.0.1:{}", client(i))).collect(),
            prefix: String::new(),
            dir: None,
        };
        let mut logs = Vec::new();
        for &i in &idx {
            let log_path = dir.path().join(format!("m{i}.log"));
            let log = File::create(&log_path).map_err(|e| e.to_string())?;
            let log2 = log.try_clone().map_err(|e| e.to_string())?;
            let mut cmd = Command::new(etcd_bin);
            cmd.arg("--name")
                .arg(format!("m{i}"))
                .arg("--data-dir")
                .arg(dir.path().join(format!("m{i}")))
                .arg("--listen-client-urls")
                .arg(format!("http://127.0.0.1:{}", client(i)))
                .arg("--advertise-client-urls")
                .arg(format!("http://127.0.0.1:{}", client(i)))
                .arg("--listen-peer-urls")
                .arg(format!("{peer_scheme}://127.0.0.1:{}", peer(i)))
                .arg("--initial-advertise-peer-urls")
                .arg(format!("{peer_scheme}://127.0.0.1:{}", peer(i)))
                .args(&tls_args)
                .arg("--initial-cluster")
                .arg(&initial_cluster)
                .arg("--initial-cluster-state")
                .arg("new")
                .arg("--initial-cluster-token")
                .arg(format!("opendsec-bench-{}", std::process::id()))
                .arg("--logger")
                .arg("zap")
                .arg("--log-level")
                .arg("error")
                .env("GOMAXPROCS", crate::member_threads(idx.len()).to_string())
                .stdin(Stdio::null())
                .stdout(log)
                .stderr(log2);
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                    Ok(())
                });
            }
            let child = cmd
                .spawn()
                .map_err(|e| format!("spawn {etcd_bin}: {e} (apt-get install etcd-server)"))?;
            cluster.children.push(child);
            logs.push(log_path);
        }
        cluster.dir = Some(dir);

        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .map_err(|e| e.to_string())?;
        let deadline = Instant::now() + Duration::from_secs(60);
        // 1. every member answers /health with {"health":"true"}.
        for (k, url) in cluster.client_urls.clone().iter().enumerate() {
            loop {
                if let Ok(Some(st)) = cluster.children[k].try_wait() {
                    return Err(format!("etcd member {url} exited ({st}): {}", log_tail(&logs[k], 5)));
                }
                if let Ok(r) = http.get(format!("{url}/health")).send().await
                    && let Ok(body) = r.text().await
                    && body.contains("\"health\":\"true\"")
                {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(format!(
                        "etcd member {url} not healthy after 60 s: {}",
                        log_tail(&logs[k], 5)
                    ));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        // 2. find the gateway prefix: 3.4 serves /v3 (and /v3beta); 3.3 only /v3beta.
        for prefix in ["/v3", "/v3beta"] {
            let r = http
                .post(format!("{}{prefix}/kv/put", cluster.client_urls[0]))
                .body(put_body(b"opendsec-bench/probe", b"x"))
                .send()
                .await;
            if let Ok(r) = r
                && r.status().is_success()
            {
                cluster.prefix = prefix.to_string();
                return Ok(cluster);
            }
        }
        Err("etcd answered neither /v3/kv/put nor /v3beta/kv/put".into())
    }
}

fn put_body(key: &[u8], value: &[u8]) -> String {
    // base64 output needs no JSON escaping.
    let b64 = |d: &[u8]| base64::engine::general_purpose::STANDARD.encode(d);
    format!("{{\"key\":\"{}\",\"value\":\"{}\"}}", b64(key), b64(value))
}

/// Puts through the gateway. Worker `w` talks to member `w % members`: like etcd's own
/// Go client (round-robin over endpoints), the client does not know the leader, and a
/// follower forwards the proposal to the leader over the peer link. That is the cost a
/// leader-unaware client pays and spreads the HTTP/JSON work over all members; at
/// concurrency 1 every put goes to member 0 (leader or not, as elected).
pub struct EtcdTarget {
    http: reqwest::Client,
    put_urls: Vec<String>,
    members: usize,
}

impl EtcdTarget {
    pub fn new(cluster: &EtcdCluster) -> Result<Self, String> {
        // One shared pool: reqwest opens one HTTP/1.1 keep-alive connection per
        // concurrent request, so each worker ends up with its own connection.
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .pool_max_idle_per_host(1024)
            .build()
            .map_err(|e| e.to_string())?;
        Ok(EtcdTarget {
            http,
            put_urls: cluster
                .client_urls
                .iter()
                .map(|u| format!("{u}{}/kv/put", cluster.prefix))
                .collect(),
            members: cluster.client_urls.len(),
        })
    }
}

impl WriteTarget for EtcdTarget {
    fn name(&self) -> String {
        format!("etcd {}-member", self.members)
    }
    fn write(&self, worker: usize, seq: u64, payload: Vec<u8>) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async move {
            let url = &self.put_urls[worker % self.put_urls.len()];
            let body = put_body(format!("bench/{seq:012}").as_bytes(), &payload);
            let r = self
                .http
                .post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if r.status().is_success() {
                // Drain the body so the connection is reused.
                let _ = r.bytes().await;
                Ok(())
            } else {
                let st = r.status();
                Err(format!("{st}: {}", r.text().await.unwrap_or_default()))
            }
        })
    }
}

pub async fn setup(ctx: SetupCtx, members: usize, peer_tls: bool) -> Result<Session, String> {
    let cluster = EtcdCluster::start(&ctx.etcd_bin, &ctx.data_dir, members, peer_tls).await?;
    let target = Arc::new(EtcdTarget::new(&cluster)?);
    Ok(Session::new(target).with_guard(cluster))
}
