//! The client's and opendsecctl's agent commands (exec, pty, files) through the whole
//! path: a real single control node behind the real gateway on a loopback port, a
//! real edge proxy, and a real `opendsec-agent` process on a Unix socket.
//!
//! The agent binary must be built first (`cargo build --workspace`).

use opendsec_control::testing::{TestNode, single_node};
use opendsec_sdk::types::*;
use opendsec_sdk::{Client, ExecOutput, ExecRequest, PtyEvent, PtyRequest};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

struct Env {
    url: String,
    t: TestNode,
    id: String,
    dir: tempfile::TempDir,
    _agent: tokio::process::Child,
}

impl Env {
    async fn new() -> Env {
        let t = single_node().await;
        let dir = tempfile::tempdir().unwrap();
        let socket = dir.path().join("agent.sock");
        let agent = opendsec_edge::testing::start_agent(&socket).await;

        let sockets: Arc<Mutex<HashMap<String, PathBuf>>> = Arc::default();
        let map = sockets.clone();
        let resolver: opendsec_edge::proxy::Resolver =
            Arc::new(move |id: &str| map.lock().unwrap().get(id).cloned().map(Into::into));
        let edge = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let edge_addr = edge.local_addr().unwrap().to_string();
        tokio::spawn(opendsec_edge::proxy::serve(
            edge,
            // Edge edge-a's certificate from the node's CA (the gateway checks it).
            t.peer_trust(opendsec_trust::Identity::edge("edge-a")),
            // The edge holds its own key, as every edge does (never the cluster key).
            opendsec_control::edge_key(&t.node.config().cluster_key, "edge-a"),
            resolver,
        ));

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let app = opendsec_gateway::router(t.node.clone());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

        let c = Client::new(&url, t.admin_token.clone()).unwrap();
        let capacity = Resources {
            sandboxes: 10,
            cpu_millis: 64000,
            memory_mb: 65536,
            metadata_bytes: 0,
        };
        c.register_edge(&RegisterEdge {
            edge: "edge-a".into(),
            address: edge_addr,
            capacity,
            labels: BTreeMap::new(),
        })
        .await
        .unwrap();
        let id = c
            .create_sandbox(&CreateSandbox {
                image: "busybox".into(),
                ..Default::default()
            })
            .await
            .unwrap()
            .sandbox
            .id;
        sockets.lock().unwrap().insert(id.clone(), socket);
        // Its edge reports it running (a call to a sandbox still starting waits for that).
        opendsec_control::testing::report_ready(&t.node, &id).await;
        Env {
            url,
            t,
            id,
            dir,
            _agent: agent,
        }
    }

    fn client(&self) -> Client {
        Client::new(&self.url, self.t.admin_token.clone()).unwrap()
    }

    async fn ctl(&self, args: &[&str], stdin: &[u8]) -> (i32, String, String) {
        use tokio::io::AsyncWriteExt;
        let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_opendsecctl"))
            .args(args)
            .env("OPENDSEC_URL", &self.url)
            .env("OPENDSEC_TOKEN", &self.t.admin_token)
            .env_remove("OPENDSEC_TOKEN_FILE")
            .env("HOME", "/nonexistent")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        let data = stdin.to_vec();
        tokio::spawn(async move {
            let _ = input.write_all(&data).await;
        });
        let out = tokio::time::timeout(Duration::from_secs(30), child.wait_with_output())
            .await
            .expect("opendsecctl finished")
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into(),
            String::from_utf8_lossy(&out.stderr).into(),
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_streams_output_and_returns_the_exit_code() {
    let env = Env::new().await;
    let c = env.client();
    let req = ExecRequest {
        cmd: "/bin/sh".into(),
        args: vec![
            "-c".into(),
            "echo one; echo two >&2; pwd; echo \"$GREETING\"; id -un; exit 7".into(),
        ],
        envs: [("GREETING".to_string(), "hi there".to_string())].into(),
        cwd: Some("/tmp".into()),
        user: Some("nobody".into()),
    };
    let (mut out, mut err) = (Vec::new(), Vec::new());
    let code = c
        .exec(&env.id, &req, |o| match o {
            ExecOutput::Stdout(b) => out.extend(b),
            ExecOutput::Stderr(b) => err.extend(b),
        })
        .await
        .unwrap();
    assert_eq!(code, 7);
    assert_eq!(String::from_utf8(out).unwrap(), "one\n/tmp\nhi there\nnobody\n");
    assert_eq!(String::from_utf8(err).unwrap(), "two\n");

    // Chunks arrive as they are written, not at the end.
    let req = ExecRequest {
        cmd: "/bin/sh".into(),
        args: vec!["-c".into(), "echo a; sleep 1; echo b".into()],
        ..Default::default()
    };
    let started = std::time::Instant::now();
    let mut seen = Vec::new();
    c.exec(&env.id, &req, |o| seen.push((started.elapsed(), o)))
        .await
        .unwrap();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(
        seen[1].0 - seen[0].0 >= Duration::from_millis(700),
        "the first chunk came before the sleep: {seen:?}"
    );

    // A program that does not exist: an error, not an exit code.
    let e = c
        .exec(
            &env.id,
            &ExecRequest {
                cmd: "/no/such/program".into(),
                ..Default::default()
            },
            |_| {},
        )
        .await
        .unwrap_err();
    assert!(e.status >= 400, "{e:?}");
    // An unknown sandbox.
    let e = c.exec("00000000000000000000", &req, |_| {}).await.unwrap_err();
    assert_eq!((e.status, e.code.as_str()), (404, "not_found"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_upload_and_download() {
    let env = Env::new().await;
    let c = env.client();
    let path = env.dir.path().join("sub/dir/f.bin");
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    c.upload(&env.id, path.to_str().unwrap(), data.clone()).await.unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), data);
    assert_eq!(c.download(&env.id, path.to_str().unwrap()).await.unwrap(), data);
    let e = c.download(&env.id, "/no/such/file").await.unwrap_err();
    assert_eq!(e.status, 404, "{e:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pty_session_takes_input_resizes_and_exits() {
    let env = Env::new().await;
    let c = env.client();
    let req = PtyRequest {
        exec: ExecRequest {
            cmd: "/bin/sh".into(),
            envs: [("PS1".to_string(), "$ ".to_string())].into(),
            ..Default::default()
        },
        cols: 80,
        rows: 24,
    };
    let mut s = c.pty(&env.id, &req).await.unwrap();
    assert!(s.pid() > 0);
    let ctl = s.control();

    async fn read_until(s: &mut opendsec_sdk::PtySession, needle: &str) -> String {
        let mut seen = String::new();
        let wait = async {
            loop {
                match s.next().await.unwrap() {
                    PtyEvent::Output(b) => seen.push_str(&String::from_utf8_lossy(&b)),
                    PtyEvent::Exit(c) => panic!("exited with {c} before {needle:?}"),
                }
                if seen.contains(needle) {
                    return;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait)
            .await
            .unwrap_or_else(|_| panic!("no {needle:?} in {seen:?}"));
        seen
    }

    ctl.send_input(b"echo sum-$((40+2))\n").await.unwrap();
    read_until(&mut s, "sum-42").await;
    ctl.resize(100, 30).await.unwrap();
    ctl.send_input(b"stty size\n").await.unwrap();
    read_until(&mut s, "30 100").await;
    ctl.send_input(b"exit 5\n").await.unwrap();
    let code = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let PtyEvent::Exit(c) = s.next().await.unwrap() {
                return c;
            }
        }
    })
    .await
    .unwrap();
    assert_eq!(code, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn opendsecctl_exec_cp_and_shell() {
    let env = Env::new().await;
    let id = env.id.as_str();

    let (code, out, err) = env
        .ctl(
            &[
                "sandbox",
                "exec",
                id,
                "--env",
                "X=y",
                "--cwd",
                "/tmp",
                "--",
                "sh",
                "-c",
                "echo out $X; pwd; echo err >&2; exit 5",
            ],
            b"",
        )
        .await;
    assert_eq!((code, out.as_str(), err.as_str()), (5, "out y\n/tmp\n", "err\n"));
    let (code, out, _) = env
        .ctl(&["sandbox", "exec", id, "--user", "nobody", "id", "-un"], b"")
        .await;
    assert_eq!((code, out.as_str()), (0, "nobody\n"));
    let (code, _, err) = env
        .ctl(&["sandbox", "exec", "00000000000000000000", "--", "true"], b"")
        .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("does not exist"), "{err}");

    // cp up, down, and to stdout.
    let local = env.dir.path().join("local.bin");
    let data: Vec<u8> = (0..2_500_000u32).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(&local, &data).unwrap();
    let remote_dir = env.dir.path().join("remote");
    let remote = format!("{id}:{}/", remote_dir.display());
    let (code, out, err) = env.ctl(&["sandbox", "cp", local.to_str().unwrap(), &remote], b"").await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out.trim(),
        format!("copied {} bytes to {id}:{}/local.bin", data.len(), remote_dir.display())
    );
    assert_eq!(std::fs::read(remote_dir.join("local.bin")).unwrap(), data);
    let back = env.dir.path().join("back.bin");
    let (code, _, err) = env
        .ctl(
            &[
                "sandbox",
                "cp",
                &format!("{id}:{}/local.bin", remote_dir.display()),
                back.to_str().unwrap(),
            ],
            b"",
        )
        .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read(&back).unwrap(), data);
    let (code, _, _) = env
        .ctl(
            &[
                "sandbox",
                "cp",
                "-",
                &format!("{id}:{}/small.txt", remote_dir.display()),
            ],
            b"from stdin",
        )
        .await;
    assert_eq!(code, 0);
    let (code, out, _) = env
        .ctl(
            &[
                "sandbox",
                "cp",
                &format!("{id}:{}/small.txt", remote_dir.display()),
                "-",
            ],
            b"",
        )
        .await;
    assert_eq!((code, out.as_str()), (0, "from stdin"));
    let (code, _, err) = env.ctl(&["sandbox", "cp", "a", "b"], b"").await;
    assert_eq!(code, 1);
    assert!(err.contains("one side must be in a sandbox"), "{err}");

    // shell with a piped (non-terminal) stdin: input is forwarded, the exit code comes back.
    let (code, out, err) = env
        .ctl(
            &["sandbox", "shell", id, "--cmd", "/bin/sh"],
            b"echo shell-$((2*3))\nexit 4\n",
        )
        .await;
    assert_eq!(code, 4, "{out} {err}");
    assert!(out.contains("shell-6"), "{out}");
}
