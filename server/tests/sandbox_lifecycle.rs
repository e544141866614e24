//! Specification: real container sandboxes through the whole path (REST -> log ->
//! edge -> crun/runc -> agent), with `opendsec up` running as a real process.
//! Needs root, crun or runc, busybox-static and the static agent (`./ops/test.sh`
//! installs and builds them).

#[path = "support/up.rs"]
mod up;

use serde_json::{Value, json};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use up::{cleanup_edge, free_port, static_agent};

struct Up {
    dir: tempfile::TempDir,
    http: String,
    peer: String,
    edge: String,
    child: Option<Child>,
    token: String,
    key: String,
    /// The edge's proxy, as the gateway reaches it (see `up::edge_door`).
    door: String,
    client: reqwest::Client,
}

impl Drop for Up {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            // Show what the server said: the temp dir goes away with the test.
            for e in std::fs::read_dir(self.dir.path()).into_iter().flatten().flatten() {
                if e.file_name().to_string_lossy().starts_with("up-") {
                    let text = std::fs::read_to_string(e.path()).unwrap_or_default();
                    let tail: Vec<&str> = text.lines().filter(|l| !l.contains(" served ")).collect();
                    eprintln!(
                        "--- {} (last lines) ---\n{}",
                        e.path().display(),
                        tail[tail.len().saturating_sub(40)..].join("\n")
                    );
                }
            }
        }
        // Leave no container behind: remove every sandbox of this test's edge.
        cleanup_edge(&self.dir.path().join("data/edge"));
    }
}

impl Up {
    fn spawn(&mut self) {
        let n = std::fs::read_dir(self.dir.path()).map(|d| d.count()).unwrap_or(0);
        let log = std::fs::File::create(self.dir.path().join(format!("up-{n}.log"))).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_opendsec"))
            .args(["up", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args([
                "--listen",
                &self.http,
                "--peer-listen",
                &self.peer,
                "--edge-listen",
                &self.edge,
            ])
            .arg("--agent")
            .arg(static_agent())
            .args(["--edge-sandboxes", "40", "--disk-mb", "64"])
            .env("RUST_LOG", "info,openraft=warn")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start opendsec up");
        self.child = Some(child);
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    async fn start() -> Up {
        let dir = tempfile::tempdir().unwrap();
        let mut up = Up {
            http: format!("127.0.0.1:{}", free_port()),
            peer: format!("127.0.0.1:{}", free_port()),
            edge: format!("127.0.0.1:{}", free_port()),
            dir,
            child: None,
            token: String::new(),
            key: String::new(),
            door: String::new(),
            client: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
        };
        up.spawn();
        let token_file = up.dir.path().join("token");
        let out = Command::new(env!("CARGO_BIN_EXE_opendsec"))
            .args(["init", "--peer", &up.peer, "--data-dir"])
            .arg(up.dir.path().join("data"))
            .arg("--token-file")
            .arg(&token_file)
            .output()
            .unwrap();
        assert!(out.status.success(), "init: {}", String::from_utf8_lossy(&out.stderr));
        up.token = std::fs::read_to_string(token_file).unwrap();
        let cluster_key = std::fs::read_to_string(up.dir.path().join("data/cluster.key")).unwrap();
        up.key = opendsec_control::edge_key(cluster_key.trim(), "edge-1");
        up.door = up::edge_door(&up.dir.path().join("data/tls"), &up.edge, "edge-1").await;
        up.wait_for(
            |v| v["edges"].as_array().is_some_and(|e| !e.is_empty()),
            "/v1/edges",
            Duration::from_secs(30),
        )
        .await;
        up
    }

    async fn get(&self, path: &str) -> Value {
        let r = self
            .client
            .get(format!("http://{}{path}", self.http))
            .bearer_auth(&self.token)
            .send()
            .await
            .unwrap();
        r.json().await.unwrap()
    }

    async fn send(&self, method: reqwest::Method, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .client
            .request(method, format!("http://{}{path}", self.http))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let s = r.status().as_u16();
        (s, r.json().await.unwrap_or(Value::Null))
    }

    async fn wait_for(&self, ok: impl Fn(&Value) -> bool, path: &str, within: Duration) -> Value {
        let deadline = Instant::now() + within;
        loop {
            if let Ok(r) = self
                .client
                .get(format!("http://{}{path}", self.http))
                .bearer_auth(&self.token)
                .send()
                .await
                && let Ok(v) = r.json::<Value>().await
            {
                if ok(&v) {
                    return v;
                }
                if Instant::now() > deadline {
                    panic!("{path} did not reach the expected state within {within:?}: {v}");
                }
            }
            assert!(Instant::now() < deadline, "{path} did not answer within {within:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn create(&self, body: Value) -> String {
        let (s, v) = self.send(reqwest::Method::POST, "/v1/sandboxes", body).await;
        assert_eq!(s, 201, "{v}");
        v["sandbox"]["id"].as_str().unwrap().to_string()
    }

    async fn wait_state(&self, id: &str, state: &str) -> Value {
        self.wait_for(
            |v| v["state"] == state,
            &format!("/v1/sandboxes/{id}"),
            Duration::from_secs(60),
        )
        .await
    }

    /// Runs `sh -c cmd` in the sandbox through its edge's proxy; returns (stdout, exit code).
    async fn exec(&self, id: &str, cmd: &str) -> (String, i64) {
        self.try_exec(id, cmd)
            .await
            .unwrap_or_else(|e| panic!("exec in {id}: {e}"))
    }

    /// Like `exec`, but a stream cut short (the sandbox died under it) is an error.
    async fn try_exec(&self, id: &str, cmd: &str) -> Result<(String, i64), String> {
        self.try_exec_as(id, cmd, None).await
    }

    /// Like `try_exec`, as `user` (E2B's `Authorization: Basic <user:>`), or as the
    /// sandbox's default user.
    async fn try_exec_as(&self, id: &str, cmd: &str, user: Option<&str>) -> Result<(String, i64), String> {
        up::edge_exec(&self.client, &self.door, &self.key, id, cmd, user).await
    }

    /// Runs `script` in sandbox `id` as a user does: through the gateway's REST agent
    /// route (`/v1/sandboxes/{id}/agent/...`) with the admin token.
    async fn rest_exec(&self, id: &str, script: &str) -> Result<(String, i64), String> {
        up::rest_exec(&self.client, &self.http, &self.token, id, "/bin/sh", &["-c", script]).await
    }

    /// Sandbox directories on the edge's disk (named by their 20-hex-digit ids).
    fn containers_on_disk(&self) -> usize {
        std::fs::read_dir(self.dir.path().join("data/edge/sandboxes"))
            .map(|d| {
                d.flatten()
                    .filter(|e| {
                        let n = e.file_name().to_string_lossy().to_string();
                        n.len() == 20 && n.bytes().all(|b| b.is_ascii_hexdigit()) && e.path().is_dir()
                    })
                    .count()
            })
            .unwrap_or(0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_runs_commands_pauses_resumes_and_is_killed() {
    let up = Up::start().await;
    let id = up
        .create(json!({"image": "busybox", "memory_mb": 128, "cpu_millis": 500}))
        .await;
    up.wait_state(&id, "running").await;

    let (out, code) = up.exec(&id, "echo $((6*7)); id -un; hostname").await;
    assert_eq!((out.as_str(), code), (format!("42\nuser\n{id}\n").as_str(), 0));
    let (_, code) = up.exec(&id, "exit 3").await;
    assert_eq!(code, 3);

    // Even through its edge's proxy, the agent serves nothing without the sandbox's token.
    let r = up
        .client
        .post(format!("http://{}/sandboxes/{id}/process.Process/List", up.door))
        .header("x-opendsec-edge-key", &up.key)
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    // Its console (PID 1's output) is readable through the API, as text.
    let r = up
        .client
        .get(format!("http://{}/v1/sandboxes/{id}/logs?max_bytes=4096", up.http))
        .bearer_auth(&up.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    assert!(r.bytes().await.unwrap().len() <= 4096);

    let (s, _) = up
        .send(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/pause"), json!({}))
        .await;
    assert!(s < 300);
    up.wait_state(&id, "paused").await;
    let (s, _) = up
        .send(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/resume"), json!({}))
        .await;
    assert!(s < 300);
    up.wait_state(&id, "running").await;
    assert_eq!(up.exec(&id, "echo back").await.0, "back\n");

    let (s, _) = up
        .send(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"), json!({}))
        .await;
    assert!(s < 300);
    let v = up.wait_state(&id, "exited").await;
    assert_eq!(v["reason"], "user", "{v}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while up.containers_on_disk() > 0 {
        assert!(
            Instant::now() < deadline,
            "the killed sandbox's resources were not freed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_system_pause_ends_every_process_keeps_the_files_and_its_resume_boots_it_again() {
    let mut up = Up::start().await;
    let id = up
        .create(json!({"image": "busybox", "memory_mb": 128, "cpu_millis": 500}))
        .await;
    up.wait_state(&id, "running").await;
    let (out, code) = up
        .exec(&id, "echo kept > /home/user/f; sleep 100000 >/dev/null 2>&1 & echo $!")
        .await;
    assert_eq!(code, 0, "{out}");
    let init = |up: &Up| {
        let path = up.dir.path().join(format!("data/edge/sandboxes/{id}/init.pid"));
        std::fs::read_to_string(path)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
    };
    let pid1 = init(&up).expect("a running sandbox has a PID 1");

    // Bad bodies name the field, and change nothing.
    let pause = format!("/v1/sandboxes/{id}/pause");
    let (s, v) = up
        .send(reqwest::Method::POST, &pause, json!({"filesystem": "yes"}))
        .await;
    assert_eq!((s, v["field"].as_str()), (400, Some("filesystem")), "{v}");
    let (s, v) = up.send(reqwest::Method::POST, &pause, json!({"memory": false})).await;
    assert_eq!(s, 400, "{v}");
    assert!(v["message"].as_str().unwrap().contains("memory"), "{v}");
    assert_eq!(up.get(&format!("/v1/sandboxes/{id}")).await["state"], "running");

    let (s, v) = up
        .send(reqwest::Method::POST, &pause, json!({"filesystem": true}))
        .await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["sandbox"]["pause_filesystem"], true, "{v}");
    up.wait_state(&id, "paused").await;
    // Every process is gone, PID 1 too: none holds memory; the files stay on the edge.
    assert!(!Path::new(&format!("/proc/{pid1}")).exists(), "PID 1 still runs");
    assert_eq!(up.containers_on_disk(), 1);

    // An edge that restarts finds it paused, not ended.
    up.kill9();
    up.spawn();
    up.wait_for(
        |v| v["sandboxes"].as_array().is_some_and(|s| s.len() == 1),
        "/v1/sandboxes",
        Duration::from_secs(30),
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(up.wait_state(&id, "paused").await["reason"], Value::Null);

    // A resume without a body boots it again on its files.
    let r = up
        .client
        .post(format!("http://{}/v1/sandboxes/{id}/resume", up.http))
        .bearer_auth(&up.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    up.wait_state(&id, "running").await;
    let (out, code) = up.exec(&id, "cat /home/user/f; pidof sleep || echo no sleep").await;
    assert_eq!((out.as_str(), code), ("kept\nno sleep\n", 0));
    assert_ne!(init(&up), Some(pid1), "a new PID 1");
    // It pauses and resumes as any other: frozen with its memory this time.
    let (out, _) = up.exec(&id, "sleep 100000 >/dev/null 2>&1 & echo $!").await;
    let (s, v) = up.send(reqwest::Method::POST, &pause, json!({})).await;
    assert_eq!((s, v["sandbox"]["pause_filesystem"].as_bool()), (200, None), "{v}");
    up.wait_state(&id, "paused").await;
    up.send(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/resume"), json!({}))
        .await;
    up.wait_state(&id, "running").await;
    assert_eq!(up.exec(&id, "pidof sleep").await.0, out);

    // A resume recorded right after a pause, before the edge has carried the pause out
    // (REST records both at once), and a call right after it (REST, through the gateway):
    // the call waits on the edge until the sandbox runs again rather than meet the agent
    // the pause is ending.
    for filesystem in [true, false, true] {
        let (s, v) = up
            .send(reqwest::Method::POST, &pause, json!({"filesystem": filesystem}))
            .await;
        assert_eq!(s, 200, "{v}");
        let (s, v) = up
            .send(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/resume"), json!({}))
            .await;
        assert_eq!(s, 200, "{v}");
        let answer = up.rest_exec(&id, "cat /home/user/f").await;
        assert_eq!(
            answer,
            Ok(("kept\n".to_string(), 0)),
            "after a pause with filesystem {filesystem}"
        );
    }
    up.wait_state(&id, "running").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_past_its_timeout_is_stopped_by_the_edge_and_the_log_says_so() {
    let up = Up::start().await;
    let id = up
        .create(json!({"image": "busybox", "memory_mb": 64, "cpu_millis": 200, "timeout_seconds": 2}))
        .await;
    up.wait_state(&id, "running").await;
    let v = up.wait_state(&id, "exited").await;
    assert_eq!(v["reason"], "timeout", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_survive_a_kill_9_of_their_edge_and_control_plane_and_are_re_adopted() {
    const N: usize = 20;
    let mut up = Up::start().await;
    let mut ids = Vec::new();
    for _ in 0..N {
        ids.push(
            up.create(json!({"image": "busybox", "memory_mb": 64, "cpu_millis": 50}))
                .await,
        );
    }
    for id in &ids {
        up.wait_state(id, "running").await;
        // A long process with state only in memory: its pid must survive.
        let (out, code) = up.exec(id, "sleep 100000 >/dev/null 2>&1 & echo $!").await;
        assert_eq!(code, 0, "{out}");
    }
    let pids_before: Vec<String> = {
        let mut v = Vec::new();
        for id in &ids {
            v.push(up.exec(id, "pidof sleep").await.0);
        }
        v
    };

    up.kill9();
    up.spawn();
    up.wait_for(
        |v| v["sandboxes"].as_array().is_some_and(|s| s.len() == N),
        "/v1/sandboxes",
        Duration::from_secs(30),
    )
    .await;
    for (id, before) in ids.iter().zip(&pids_before) {
        up.wait_state(id, "running").await;
        let (after, code) = up.exec(id, "pidof sleep").await;
        assert_eq!(
            (after.as_str(), code),
            (before.as_str(), 0),
            "sandbox {id} lost its process"
        );
    }
    assert_eq!(up.containers_on_disk(), N, "nothing duplicated, nothing orphaned");
    let list = up.get("/v1/sandboxes").await;
    assert_eq!(list["sandboxes"].as_array().unwrap().len(), N);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_over_the_memory_limit_is_killed_alone_and_the_sandbox_lives_on() {
    let up = Up::start().await;
    let hog = up
        .create(json!({"image": "busybox", "memory_mb": 64, "cpu_millis": 200}))
        .await;
    let bystander = up
        .create(json!({"image": "busybox", "memory_mb": 64, "cpu_millis": 200}))
        .await;
    up.wait_state(&hog, "running").await;
    up.wait_state(&bystander, "running").await;
    up.exec(&hog, "echo kept > /home/user/kept && (sleep 1000 >/dev/null 2>&1 &)")
        .await;
    let (sleeper, _) = up.exec(&hog, "pidof sleep").await;

    // `tail` keeps the one endless "line" of zeros in memory: far past 64 MB. The kernel
    // kills it, as it would in a VM; the shell sees it killed (128 + 9).
    let (_, code) = up
        .try_exec(&hog, "head -c 300000000 /dev/zero | tail > /dev/null")
        .await
        .expect("the agent answers for the command it ran");
    assert_eq!(code, 137, "the hog was killed");

    let path = format!("/v1/sandboxes/{hog}");
    let v = up
        .wait_for(|v| v["oom_kills"].as_u64() >= Some(1), &path, Duration::from_secs(30))
        .await;
    assert_eq!(v["state"], "running", "one process's OOM does not end the sandbox: {v}");
    assert_eq!(v["last_oom_command"], "tail", "{v}");
    assert_eq!(v["oom_killed"], false, "{v}");
    // Everything else in it lives on: its files and its other processes.
    let (after, code) = up.exec(&hog, "cat /home/user/kept; pidof sleep").await;
    assert_eq!((after, code), (format!("kept\n{sleeper}"), 0));
    let m = up.get(&format!("/v1/sandboxes/{hog}/metrics")).await;
    assert!(m["oom_kills"].as_u64() >= Some(1), "{m}");

    let (out, code) = up.exec(&bystander, "echo still here").await;
    assert_eq!((out.as_str(), code), ("still here\n", 0));
    let b = up.get(&format!("/v1/sandboxes/{bystander}")).await;
    assert!(b.get("oom_kills").is_none_or(|n| n == 0), "{b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_code_sees_nothing_of_the_host_and_cannot_touch_the_agent() {
    let up = Up::start().await;
    let a = up
        .create(json!({"image": "busybox", "memory_mb": 128, "cpu_millis": 500}))
        .await;
    let b = up
        .create(json!({"image": "busybox", "memory_mb": 128, "cpu_millis": 500}))
        .await;
    up.wait_state(&a, "running").await;
    up.wait_state(&b, "running").await;
    up.exec(&b, "echo secret > /home/user/b-only").await;

    let checks = [
        // Only its own processes: besides this shell and ps, just the agent (PID 1, its
        // session-holding supervisor, and the server it runs).
        (
            "ps -o comm= > /tmp/ps; grep -vxE 'ps|sh' /tmp/ps | sort | uniq -c | awk '{print $1, $2}'",
            "2 agent\n",
        ),
        (
            "s=$(ps -o pid,ppid,comm | awk '$2 == 1 && $3 == \"agent\" {print $1}'); \
             test -n \"$s\" && ls /proc/$s/fd 2>/dev/null | wc -l",
            "0\n",
        ),
        // Its own interfaces (its /sys is a sysfs of its own namespace), none of the host's.
        ("ls /sys/class/net", "eth0\nlo\n"),
        // Kernel page data stays hidden.
        ("cat /proc/kpagecgroup 2>/dev/null | wc -c", "0\n"),
        // Another sandbox's files are not here.
        ("ls /home/user/b-only 2>&1 >/dev/null | grep -c 'No such file'", "1\n"),
        // The agent binary is read-only, its socket is nowhere in the sandbox.
        ("echo x 2>/dev/null > /.opendsec/agent || echo refused", "refused\n"),
        ("find / -xdev -type s 2>/dev/null | wc -l", "0\n"),
        // The agent cannot be inspected or ptraced by sandbox code.
        ("ls /proc/1/fd 2>/dev/null | wc -l", "0\n"),
    ];
    for (cmd, want) in checks {
        let (out, _) = up.exec(&a, cmd).await;
        assert_eq!(out, want, "`{cmd}` in the sandbox");
    }

    // Writing past the sandbox's disk (64 MiB here) fails inside the sandbox only.
    let (out, _) = up
        .exec(
            &a,
            "yes > /home/user/fill 2>/dev/null; echo done; df -m /home/user | tail -1 | awk '{print $4}'",
        )
        .await;
    assert!(out.starts_with("done\n"), "{out}");
    assert!(out.trim_end().ends_with('0'), "the sandbox's disk is full: {out}");
    let (out, code) = up.exec(&b, "echo fine").await;
    assert_eq!((out.as_str(), code), ("fine\n", 0), "the other sandbox is unaffected");

    // The agent swap: root in the sandbox tries to move the agent's directory away and
    // plant a program and a token of its own at the agent's paths. `/.opendsec` is a
    // read-only mount point holding only the agent: it can be neither moved nor written,
    // and no token rests in any file (the agent read it from a pipe at boot).
    let plant = "rm -f /home/user/fill; mv /.opendsec /.od-old 2>/dev/null && echo moved; \
        echo x 2>/dev/null > /.opendsec/agent && echo wrote; \
        mkdir /.opendsec/config 2>/dev/null && echo planted; \
        ls -A /.opendsec; grep -rl access_token / --exclude-dir=proc --exclude-dir=sys --exclude-dir=.opendsec \
        2>/dev/null | wc -l; echo as $(id -u)";
    let (out, _) = up.try_exec_as(&a, plant, Some("root")).await.unwrap();
    assert_eq!(out, "agent\n0\nas 0\n", "sandbox root changed the agent's directory");
    // Killing the agent's server brings back the agent it runs, with the token it
    // booted with: the planted program never runs, the sandbox's own token still opens it.
    up.exec(
        &a,
        "printf '#!/bin/sh\\necho ran > /tmp/planted-ran\\n' > /tmp/agent; chmod 755 /tmp/agent",
    )
    .await;
    // The stream that kills the server is cut short with it.
    let kill_server = "kill -9 $(ps -o pid,ppid,comm | awk '$2 == 1 && $3 == \"agent\" {print $1}')";
    let _ = up.try_exec_as(&a, kill_server, Some("root")).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let out = loop {
        match up.try_exec(&a, "cat /tmp/planted-ran 2>/dev/null || echo clean").await {
            Ok((out, 0)) => break out,
            other => {
                assert!(Instant::now() < deadline, "the agent did not come back: {other:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(out, "clean\n", "the planted program ran as the agent");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_of_a_fork_has_every_generation_of_files_and_outlives_its_parents() {
    let up = Up::start().await;
    let fork = async |id: &str| -> String {
        let (s, v) = up
            .send(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/fork"),
                json!({"count": 1}),
            )
            .await;
        assert_eq!(s, 201, "fork: {v}");
        v["sandboxes"][0]["id"].as_str().unwrap().to_string()
    };
    let a = up
        .create(json!({"image": "busybox", "memory_mb": 64, "cpu_millis": 100}))
        .await;
    up.wait_state(&a, "running").await;
    assert_eq!(
        up.exec(
            &a,
            "echo one > /home/user/a && echo doomed > /home/user/gone && echo from-a > /home/user/kept"
        )
        .await
        .1,
        0
    );

    let b = fork(&a).await;
    up.wait_state(&b, "running").await;
    assert_eq!(
        up.exec(
            &b,
            "cat /home/user/gone && echo two > /home/user/b && echo changed > /home/user/a && rm /home/user/gone"
        )
        .await,
        ("doomed\n".to_string(), 0)
    );

    let c = fork(&b).await;
    up.wait_state(&c, "running").await;
    let seen =
        "cat /home/user/kept /home/user/a /home/user/b; test -e /home/user/gone && echo gone-is-back || echo gone";
    assert_eq!(
        up.exec(&c, seen).await.0,
        "from-a\nchanged\ntwo\ngone\n",
        "the grandchild has what both generations wrote and deleted"
    );

    // Its parents go; what it was forked from stays its own.
    for id in [&a, &b] {
        let (s, _) = up
            .send(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"), json!({}))
            .await;
        assert!(s < 300);
        up.wait_state(id, "exited").await;
    }
    assert_eq!(up.exec(&c, seen).await.0, "from-a\nchanged\ntwo\ngone\n");
    assert_eq!(
        up.exec(&c, "echo three >> /home/user/b && cat /home/user/b").await.0,
        "two\nthree\n"
    );
}

/// The warm containers (made ahead, not yet claimed) in the edge's sandboxes directory.
fn warm_on_disk(up: &Up) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(up.dir.path().join("data/edge/sandboxes"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().to_string())
                .filter(|n| n.starts_with(".warmc-"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_create_claims_a_warm_container_which_becomes_that_sandbox_and_a_killed_edge_leaves_none() {
    let mut up = Up::start().await;
    // The first create of an image is made from scratch; the edge then keeps two warm.
    let first = up
        .create(json!({"image": "busybox", "memory_mb": 64, "cpu_millis": 100}))
        .await;
    up.wait_state(&first, "running").await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while warm_on_disk(&up).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "no two warm containers within 60 s: {:?}",
            warm_on_disk(&up)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let warm_before = warm_on_disk(&up);

    // The next create claims one: it has the sandbox's token (the exec is authenticated
    // by it), hostname, labels and memory limit (its environment: the E2B tests).
    let id = up
        .create(json!({"image": "busybox", "memory_mb": 80, "cpu_millis": 100, "labels": {"task": "t7"}}))
        .await;
    up.wait_state(&id, "running").await;
    let rec: Value = serde_json::from_slice(
        &std::fs::read(up.dir.path().join("data/edge/sandboxes").join(&id).join("sandbox.json")).unwrap(),
    )
    .unwrap();
    let runtime_id = rec["runtime_id"].as_str().unwrap_or_default().to_string();
    assert!(
        warm_before.contains(&format!(".{runtime_id}")),
        "sandbox {id} was not made from a warm container: {rec}"
    );
    assert_eq!(rec["labels"], json!({"task": "t7"}));
    let (out, code) = up
        .exec(
            &id,
            "hostname; cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max",
        )
        .await;
    assert_eq!((out.as_str(), code), (format!("{id}\n{}\n", 80u64 << 20).as_str(), 0));

    // kill -9: the warm containers it left are discarded by the next edge (which makes
    // its own); the claimed sandbox is a sandbox like any other and runs on.
    let deadline = Instant::now() + Duration::from_secs(60);
    while warm_on_disk(&up).len() < 2 {
        assert!(
            Instant::now() < deadline,
            "the pool did not refill: {:?}",
            warm_on_disk(&up)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = warm_on_disk(&up);
    up.kill9();
    up.spawn();
    up.wait_for(
        |v| v["edges"].as_array().is_some_and(|e| !e.is_empty()),
        "/v1/edges",
        Duration::from_secs(30),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while warm_on_disk(&up).iter().any(|w| left.contains(w)) {
        assert!(
            Instant::now() < deadline,
            "warm containers of the killed edge are still there: {:?}",
            warm_on_disk(&up)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for w in &left {
        let wid = w.trim_start_matches('.');
        assert!(
            !up.dir
                .path()
                .join("data/edge/agents")
                .join(format!("{wid}.sock"))
                .exists(),
            "{wid}'s socket is left"
        );
        assert!(
            !up.dir.path().join("data/edge/config").join(wid).exists(),
            "{wid}'s config is left"
        );
        assert!(
            !Path::new("/sys/fs/cgroup/memory/opendsec").join(wid).exists()
                && !Path::new("/sys/fs/cgroup/opendsec").join(wid).exists(),
            "{wid}'s cgroup is left"
        );
    }
    up.wait_state(&id, "running").await;
    assert_eq!(up.exec(&id, "hostname").await, (format!("{id}\n"), 0));
    assert_eq!(up.containers_on_disk(), 2, "nothing duplicated, nothing orphaned");
}

/// A sandbox's CPU weight against the others, from its cgroup (the record in `dir`):
/// the kernel's least (v1 `cpu.shares` 2, v2 `cpu.weight` 1) or its default (1024, 100).
fn cpu_weight(dir: &Path) -> &'static str {
    let rel = cgroup_of(dir);
    let v1 = Path::new("/sys/fs/cgroup/cpu").join(&rel).join("cpu.shares");
    let v2 = Path::new("/sys/fs/cgroup").join(&rel).join("cpu.weight");
    let (file, least, default) = if v1.exists() {
        (v1, "2", "1024")
    } else {
        (v2, "1", "100")
    };
    let value = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    match value.trim() {
        v if v == least => "least",
        v if v == default => "default",
        v => panic!("{}: {v}, neither the least weight nor the default", file.display()),
    }
}

/// The cgroup (relative to the hierarchies' root) of the container whose record is in `dir`.
fn cgroup_of(dir: &Path) -> String {
    let rec: Value = serde_json::from_slice(&std::fs::read(dir.join("sandbox.json")).unwrap()).unwrap();
    rec["cgroups_path"].as_str().unwrap().trim_matches('/').to_string()
}

/// CPU time the cgroup `rel` has used, in microseconds.
fn cpu_usec(rel: &str) -> u64 {
    let v1 = Path::new("/sys/fs/cgroup/cpuacct").join(rel).join("cpuacct.usage");
    if let Ok(ns) = std::fs::read_to_string(&v1) {
        return ns.trim().parse::<u64>().unwrap() / 1000;
    }
    let stat = std::fs::read_to_string(Path::new("/sys/fs/cgroup").join(rel).join("cpu.stat")).unwrap();
    stat.lines()
        .find_map(|l| l.strip_prefix("usage_usec "))
        .unwrap()
        .parse()
        .unwrap()
}

/// Whether the agent listening on `sock` answers `GET /health` with 204 (a warm
/// container started ahead is ready).
fn agent_healthy(sock: &Path) -> bool {
    use std::io::{Read, Write};
    let Ok(mut s) = std::os::unix::net::UnixStream::connect(sock) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let mut head = [0u8; 12];
    s.write_all(b"GET /health HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n")
        .is_ok()
        && s.read_exact(&mut head).is_ok()
        && &head == b"HTTP/1.1 204"
}

/// A code-interpreter container started ahead runs its Jupyter server and kernels
/// (seconds of CPU) at the least CPU weight, on what sandboxes leave: making one never
/// slows the sandbox that has just claimed its predecessor (its first `run_code`). The
/// sandbox that claims it runs at the default weight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_code_interpreter_started_ahead_runs_at_the_least_cpu_weight_until_a_sandbox_claims_it() {
    let up = Up::start().await;
    let sandboxes = up.dir.path().join("data/edge/sandboxes");
    let agents = up.dir.path().join("data/edge/agents");
    // The first create of the image is made from scratch; the edge then starts warm ones.
    let first = up.create(json!({"image": "code-interpreter-v1"})).await;
    up.wait_state(&first, "running").await;
    assert_eq!(cpu_weight(&sandboxes.join(&first)), "default");
    let deadline = Instant::now() + Duration::from_secs(180);
    let warm = loop {
        let ready = warm_on_disk(&up)
            .into_iter()
            .find(|w| agent_healthy(&agents.join(format!("{}.sock", &w[1..]))));
        if let Some(w) = ready {
            break w;
        }
        assert!(
            Instant::now() < deadline,
            "no code interpreter started ahead within 180 s: {:?}",
            warm_on_disk(&up)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        cpu_weight(&sandboxes.join(&warm)),
        "least",
        "{warm} is started ahead at the least CPU weight"
    );

    // The edge offers it once its CPU is quiet (under 5% of a core over 200 ms).
    let rel = cgroup_of(&sandboxes.join(&warm));
    let mut before = cpu_usec(&rel);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = cpu_usec(&rel);
        if now - before < 10_000 {
            break;
        }
        assert!(Instant::now() < deadline, "{warm} stays busy");
        before = now;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let id = up.create(json!({"image": "code-interpreter-v1"})).await;
    up.wait_state(&id, "running").await;
    let rec: Value = serde_json::from_slice(&std::fs::read(sandboxes.join(&id).join("sandbox.json")).unwrap()).unwrap();
    assert_eq!(
        rec["runtime_id"].as_str().map(|r| format!(".{r}")),
        Some(warm.clone()),
        "sandbox {id} claims {warm}: {rec}"
    );
    assert_eq!(
        cpu_weight(&sandboxes.join(&id)),
        "default",
        "the sandbox that claims it has the default CPU weight"
    );
    // Its processes keep the default CPU class (SCHED_OTHER): the least weight was the
    // cgroup's alone.
    let (class, code) = up
        .exec(&id, "cut -d' ' -f41 /proc/1/stat; cut -d' ' -f41 /proc/self/stat")
        .await;
    assert_eq!(
        (class.as_str(), code),
        ("0\n0\n", 0),
        "scheduling policies of PID 1 and a command"
    );
}

/// The edge keeps a point of each running sandbox's metrics every 5 s; REST serves a
/// range of them, and `opendsecctl sandbox metrics <id> --since` prints them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_sandbox_has_a_metrics_history_served_by_rest_and_the_cli() {
    let up = Up::start().await;
    let id = up.create(json!({"image": "busybox"})).await;
    up.wait_state(&id, "running").await;
    let started_ms = opendsec_control::now_ms();

    for (query, field) in [
        ("start_ms=soon", "start_ms"),
        ("end_ms=-1", "end_ms"),
        ("start_ms=5&end_ms=4", "end_ms"),
    ] {
        let (status, body) = up
            .send(
                reqwest::Method::GET,
                &format!("/v1/sandboxes/{id}/metrics/history?{query}"),
                Value::Null,
            )
            .await;
        assert_eq!((status, body["field"].as_str()), (400, Some(field)), "{query}: {body}");
    }

    // Before its first point, the history is empty (not missing); then a baseline and
    // a point every 5 s.
    let path = format!("/v1/sandboxes/{id}/metrics/history");
    let early = up.get(&path).await;
    assert!(early["points"].as_array().is_some_and(|p| p.len() <= 1), "{early}");
    let h = up
        .wait_for(
            |v| v["points"].as_array().is_some_and(|p| p.len() >= 2),
            &path,
            Duration::from_secs(25),
        )
        .await;
    let points = h["points"].as_array().unwrap();
    let times: Vec<u64> = points.iter().map(|p| p["timestamp_ms"].as_u64().unwrap()).collect();
    assert!(
        times.windows(2).all(|w| (4000..=7000).contains(&(w[1] - w[0]))),
        "every 5 s: {times:?}"
    );
    for p in points {
        assert!(
            p["mem_total"].as_u64() > Some(0) && p["mem_used"].as_u64() <= p["mem_total"].as_u64(),
            "{p}"
        );
        assert!((0.0..=100.0).contains(&p["cpu_used_pct"].as_f64().unwrap()), "{p}");
        assert!(p["disk_total"].as_u64() > Some(0), "{p}");
    }
    // A range holds only its points; one before the sandbox holds none.
    let last = *times.last().unwrap();
    let one = up.get(&format!("{path}?start_ms={last}&end_ms={last}")).await;
    assert_eq!(one["points"].as_array().map(Vec::len), Some(1), "{one}");
    let before = up.get(&format!("{path}?end_ms={}", started_ms - 60_000)).await;
    assert_eq!(before["points"], json!([]), "{before}");

    let ctl = Path::new(env!("CARGO_BIN_EXE_opendsec")).with_file_name("opendsecctl");
    assert!(
        ctl.is_file(),
        "opendsecctl is not built beside opendsec: cargo build -p opendsec-sdk --bins"
    );
    let run = |args: &[&str]| {
        let out = Command::new(&ctl)
            .args(args)
            .env("OPENDSEC_URL", format!("http://{}", up.http))
            .env("OPENDSEC_TOKEN", up.token.trim())
            .output()
            .expect("run opendsecctl");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, stdout, stderr) = run(&["sandbox", "metrics", &id, "--since", "10m"]);
    assert_eq!(code, Some(0), "{stderr}");
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines[0].starts_with("TIME") && lines[0].contains("CPU %"), "{stdout}");
    assert!(lines.len() > points.len(), "a row per point: {stdout}");
    let (code, stdout, _) = run(&["--output", "json", "sandbox", "metrics", &id, "--since", "10m"]);
    let v: Value = serde_json::from_str(&stdout).expect("json");
    assert!(
        code == Some(0) && v["points"].as_array().is_some_and(|p| p.len() >= points.len()),
        "{stdout}"
    );
    let (code, _, stderr) = run(&["sandbox", "metrics", &id, "--since", "ten"]);
    assert!(code != Some(0) && stderr.contains("not a span"), "{stderr}");
}
