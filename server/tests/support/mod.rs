//! Real `opendsec` processes on 127.0.0.1 for cluster tests: spawn, kill -9, restart.

#![allow(dead_code)]

use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Node {
    pub id: u64,
    pub http: String,
    pub peer: String,
    pub data_dir: PathBuf,
    pub child: Option<Child>,
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub key_file: PathBuf,
    pub nodes: Vec<Node>,
    pub token: String,
    pub http: reqwest::Client,
}

use opendsec_edge::testing::free_port;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_opendsec")
}

impl Node {
    fn spawn(&mut self, key_file: &PathBuf, init_members: Option<String>) {
        let pki = key_file.with_file_name("pki");
        let log = std::fs::File::create(self.data_dir.with_extension(format!("log.{}", std::process::id()))).unwrap();
        let mut cmd = Command::new(bin());
        cmd.args(["control", "--id", &self.id.to_string()])
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(["--listen", &self.http, "--peer-listen", &self.peer])
            .arg("--cluster-key-file")
            .arg(key_file)
            .arg("--pki-dir")
            .arg(&pki)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(log);
        if let Some(m) = init_members {
            cmd.args(["--init-members", &m]);
        }
        self.child = Some(cmd.spawn().expect("spawn opendsec"));
    }

    /// SIGKILL: no shutdown path runs.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: the process stops answering, as a node cut off by a partition.
    pub fn stop(&self) {
        self.signal(nix::sys::signal::Signal::SIGSTOP);
    }

    /// SIGCONT after [`Node::stop`].
    pub fn cont(&self) {
        self.signal(nix::sys::signal::Signal::SIGCONT);
    }

    fn signal(&self, sig: nix::sys::signal::Signal) {
        let child = self.child.as_ref().expect("the node runs");
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(child.id() as i32), sig).unwrap();
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for n in &mut self.nodes {
            n.kill9();
        }
    }
}

impl Cluster {
    /// Starts `n` nodes, initialises the cluster through node 1 and bootstraps it.
    pub async fn start(n: u64) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let key_file = dir.path().join("cluster.key");
        std::fs::write(&key_file, "test-cluster-key-0123456789abcdef").unwrap();
        // The cluster's CA, shared by its control nodes (as the README's cluster does).
        let made = Command::new(bin())
            .args(["ca", "--dir"])
            .arg(dir.path().join("pki"))
            .output()
            .expect("run opendsec ca");
        assert!(
            made.status.success(),
            "opendsec ca: {}",
            String::from_utf8_lossy(&made.stderr)
        );
        let mut nodes: Vec<Node> = (1..=n)
            .map(|id| Node {
                id,
                http: format!("127.0.0.1:{}", free_port()),
                peer: format!("127.0.0.1:{}", free_port()),
                data_dir: dir.path().join(format!("node{id}")),
                child: None,
            })
            .collect();
        let members: Vec<String> = nodes.iter().map(|x| format!("{}={}", x.id, x.peer)).collect();
        let members = members.join(",");
        for node in nodes.iter_mut() {
            let init = (node.id == 1).then(|| members.clone());
            node.spawn(&key_file, init);
        }
        let token_file = dir.path().join("admin.token");
        let peers: Vec<String> = nodes.iter().map(|x| x.peer.clone()).collect();
        let out = Command::new(bin())
            .args(["init", "--peer", &peers.join(",")])
            .arg("--pki-dir")
            .arg(dir.path().join("pki"))
            .arg("--token-file")
            .arg(&token_file)
            .output()
            .expect("run opendsec init");
        assert!(
            out.status.success(),
            "opendsec init failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let token = std::fs::read_to_string(&token_file).unwrap();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        let c = Cluster {
            dir,
            key_file,
            nodes,
            token,
            http,
        };
        for i in 0..c.nodes.len() {
            c.wait_http(i).await;
        }
        c
    }

    /// Starts one more node (not yet a member); returns its index in `nodes`.
    pub async fn spawn_extra(&mut self, id: u64) -> usize {
        let mut node = Node {
            id,
            http: format!("127.0.0.1:{}", free_port()),
            peer: format!("127.0.0.1:{}", free_port()),
            data_dir: self.dir.path().join(format!("node{id}")),
            child: None,
        };
        node.spawn(&self.key_file, None);
        self.nodes.push(node);
        let i = self.nodes.len() - 1;
        self.wait_http(i).await;
        i
    }

    pub fn restart(&mut self, i: usize) {
        let key = self.key_file.clone();
        self.nodes[i].spawn(&key, None);
    }

    pub async fn wait_http(&self, i: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if self.http.get(self.nodes[i].url("/health")).send().await.is_ok() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("node {} did not answer HTTP within 20 s", self.nodes[i].id);
    }

    pub async fn get(&self, i: usize, path: &str, token: &str) -> Result<(u16, Value), String> {
        let r = self
            .http
            .get(self.nodes[i].url(path))
            .bearer_auth(token)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = r.status().as_u16();
        let body = r.json::<Value>().await.unwrap_or(Value::Null);
        Ok((status, body))
    }

    /// Every item of a list (`key`: `sandboxes`, `projects`, ...), page after page.
    pub async fn list_all(&self, i: usize, path: &str, key: &str, token: &str) -> Result<Vec<Value>, String> {
        let mut all = Vec::new();
        let mut next: Option<String> = None;
        loop {
            let url = match &next {
                None => path.to_string(),
                Some(t) => format!("{path}{}page_token={t}", if path.contains('?') { '&' } else { '?' }),
            };
            let (status, page) = self.get(i, &url, token).await?;
            if status != 200 {
                return Err(format!("{url}: {status} {page}"));
            }
            all.extend(page[key].as_array().cloned().unwrap_or_default());
            match page["next_page_token"].as_str() {
                Some(t) => next = Some(t.to_string()),
                None => return Ok(all),
            }
        }
    }

    pub async fn post(&self, i: usize, path: &str, token: &str, body: Value) -> Result<(u16, Value), String> {
        let r = self
            .http
            .post(self.nodes[i].url(path))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let status = r.status().as_u16();
        let body = r.json::<Value>().await.unwrap_or(Value::Null);
        Ok((status, body))
    }

    pub async fn status(&self, i: usize) -> Option<Value> {
        match self.get(i, "/v1/cluster", &self.token).await {
            Ok((200, v)) => Some(v),
            _ => None,
        }
    }

    /// The index (into `nodes`) of the current leader, as the live nodes see it.
    pub async fn leader(&self) -> Option<usize> {
        for i in 0..self.nodes.len() {
            if self.nodes[i].child.is_none() {
                continue;
            }
            if let Some(s) = self.status(i).await
                && let Some(id) = s["leader_id"].as_u64()
            {
                return self.nodes.iter().position(|n| n.id == id && n.child.is_some());
            }
        }
        None
    }

    /// Registers an edge with room for `sandboxes` so sandbox creates can be placed.
    pub async fn register_edge(&self, name: &str, sandboxes: u64) {
        let body = json!({"edge": name, "address": "127.0.0.1:1", "capacity": {"sandboxes": sandboxes, "cpu_millis": sandboxes * 1000, "memory_mb": sandboxes * 1024}, "labels": {}});
        let (s, v) = self.post(0, "/v1/edges", &self.token, body).await.unwrap();
        assert!(s < 300, "edge registration failed: {s} {v}");
    }

    /// Waits until every live node has applied the same index and shows the same state hash.
    pub async fn wait_converged(&self, within: Duration) -> Vec<Value> {
        let deadline = Instant::now() + within;
        let mut last = vec![];
        while Instant::now() < deadline {
            let mut all = vec![];
            for i in 0..self.nodes.len() {
                if let Some(s) = self.status(i).await {
                    all.push(s);
                }
            }
            let same = all.len() == self.nodes.len()
                && all.windows(2).all(|w| {
                    w[0]["applied_index"] == w[1]["applied_index"] && w[0]["state_hash"] == w[1]["state_hash"]
                });
            if same {
                return all;
            }
            last = all;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("nodes did not converge within {within:?}: {last:#?}");
    }
}
