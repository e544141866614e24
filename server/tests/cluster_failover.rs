//! Specification: a three-node control plane (three real processes on 127.0.0.1)
//! loses no acknowledged write when its leader is killed with SIGKILL under load,
//! elects a new leader that serves writes within 3 s, and lets the killed node
//! catch up so that all three views hash-equal.

mod support;

use serde_json::json;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::Cluster;

const WRITES: usize = 1_200;
const CONCURRENCY: usize = 16;
const KILL_AFTER: usize = 300;

struct Ack {
    id: String,
    started: Instant,
    finished: Instant,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn killing_the_leader_under_load_loses_no_acknowledged_write_and_applies_none_twice() {
    let mut cluster = Cluster::start(3).await;
    cluster.register_edge("edge-a", 10_000).await;

    let urls: Arc<Vec<String>> = Arc::new(cluster.nodes.iter().map(|n| n.url("/v1/sandboxes")).collect());
    let acked = Arc::new(Mutex::new(Vec::<Ack>::new()));
    let count = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..CONCURRENCY {
        let (urls, acked, count, http, token) = (
            urls.clone(),
            acked.clone(),
            count.clone(),
            cluster.http.clone(),
            cluster.token.clone(),
        );
        workers.push(tokio::spawn(async move {
            let mut attempt = w;
            // One request id per write, kept across its retries (as a client retrying
            // after a lost answer does): the write is applied once however often it is sent.
            let mut write = 0;
            let deadline = Instant::now() + Duration::from_secs(120);
            while count.load(Ordering::SeqCst) < WRITES && Instant::now() < deadline {
                attempt += 1;
                let url = &urls[attempt % urls.len()];
                let started = Instant::now();
                let request = format!("w{w}-{write}");
                let body = json!({"image": "busybox", "cpu_millis": 10, "memory_mb": 1,
                                  "labels": {"worker": w.to_string(), "request": request}});
                let resp = http
                    .post(url)
                    .bearer_auth(&token)
                    .header("x-request-id", &request)
                    .json(&body)
                    .send()
                    .await;
                match resp {
                    Ok(r) if r.status().is_success() => {
                        let v: serde_json::Value = r.json().await.expect("create answers JSON");
                        let id = v["sandbox"]["id"]
                            .as_str()
                            .expect("create answers the sandbox id")
                            .to_string();
                        acked.lock().unwrap().push(Ack {
                            id,
                            started,
                            finished: Instant::now(),
                        });
                        count.fetch_add(1, Ordering::SeqCst);
                        write += 1;
                    }
                    // Refused (leader lost mid-flight, no leader yet) or the node is down: try another.
                    _ => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        }));
    }

    let waiting = Instant::now();
    while count.load(Ordering::SeqCst) < KILL_AFTER {
        assert!(
            waiting.elapsed() < Duration::from_secs(60),
            "only {} writes acknowledged before the kill",
            count.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let leader = cluster.leader().await.expect("a leader before the kill");
    let killed_at = Instant::now();
    cluster.nodes[leader].kill9();

    for w in workers {
        w.await.unwrap();
    }
    let acked = Arc::try_unwrap(acked).ok().unwrap().into_inner().unwrap();
    assert!(acked.len() >= WRITES, "only {} writes were acknowledged", acked.len());

    // A new leader served a write that was sent after the kill within 3 s of it.
    let first_after = acked
        .iter()
        .filter(|a| a.started > killed_at)
        .map(|a| a.finished.duration_since(killed_at))
        .min()
        .expect("writes after the kill");
    assert!(
        first_after < Duration::from_secs(3),
        "first write after the kill took {first_after:?}"
    );

    // The killed node comes back from its data directory and catches up.
    cluster.restart(leader);
    cluster.wait_http(leader).await;
    let statuses = cluster.wait_converged(Duration::from_secs(30)).await;
    assert!(statuses.iter().all(|s| s["state_hash"] == statuses[0]["state_hash"]));

    // No write was applied twice: one sandbox per request, whatever its retries.
    let list = cluster
        .list_all(0, "/v1/sandboxes", "sandboxes", &cluster.token)
        .await
        .unwrap();
    let mut requests = std::collections::BTreeMap::<String, usize>::new();
    for s in &list {
        *requests
            .entry(s["labels"]["request"].as_str().unwrap_or_default().to_string())
            .or_default() += 1;
    }
    let twice: Vec<_> = requests.iter().filter(|(_, n)| **n > 1).collect();
    assert!(twice.is_empty(), "writes applied more than once: {twice:?}");

    // Every acknowledged write is present on every node, the restarted one included.
    for i in 0..3 {
        let list = cluster
            .list_all(i, "/v1/sandboxes", "sandboxes", &cluster.token)
            .await
            .unwrap();
        let present: std::collections::BTreeSet<&str> = list.iter().filter_map(|s| s["id"].as_str()).collect();
        let missing: Vec<&str> = acked
            .iter()
            .map(|a| a.id.as_str())
            .filter(|id| !present.contains(id))
            .collect();
        assert!(
            missing.is_empty(),
            "node {} lacks {} acknowledged writes, e.g. {:?}",
            i + 1,
            missing.len(),
            missing.first()
        );
    }
    eprintln!(
        "acknowledged {} writes; first write after the kill answered in {first_after:?}",
        acked.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_is_refused_by_every_node_once_the_revocation_commits() {
    let cluster = Cluster::start(3).await;
    let (s, issued) = cluster
        .post(
            1,
            "/v1/tokens",
            &cluster.token,
            json!({"project": root_project(&cluster).await, "name": "ci", "rights": ["sandbox:read"]}),
        )
        .await
        .unwrap();
    assert_eq!(s, 201, "{issued}");
    let token = issued["token"].as_str().unwrap().to_string();
    let id = issued["id"].as_str().unwrap().to_string();
    cluster.wait_converged(Duration::from_secs(10)).await;
    for i in 0..3 {
        let (s, _) = cluster.get(i, "/v1/sandboxes", &token).await.unwrap();
        assert_eq!(s, 200, "node {} refused a valid token", i + 1);
    }

    let r = cluster
        .http
        .delete(cluster.nodes[2].url(&format!("/v1/tokens/{id}")))
        .bearer_auth(&cluster.token)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "revoke failed: {}", r.status());
    let index: u64 = r.headers()["x-opendsec-index"].to_str().unwrap().parse().unwrap();

    for i in 0..3 {
        // Asking for the revocation's index makes a node answer only once it has applied it.
        let r = cluster
            .http
            .get(cluster.nodes[i].url("/v1/sandboxes"))
            .bearer_auth(&token)
            .header("x-opendsec-min-index", index.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 401, "node {} still accepts a revoked token", i + 1);
    }
    // And without asking, once the entry has reached every node.
    cluster.wait_converged(Duration::from_secs(10)).await;
    for i in 0..3 {
        let (s, body) = cluster.get(i, "/v1/sandboxes", &token).await.unwrap();
        assert_eq!(s, 401, "node {}: {body}", i + 1);
        assert_eq!(body["code"], "unauthenticated");
    }
}

async fn root_project(cluster: &Cluster) -> String {
    let (s, me) = cluster.get(0, "/v1/whoami", &cluster.token).await.unwrap();
    assert_eq!(s, 200, "{me}");
    me["project"].as_str().expect("whoami names the project").to_string()
}
