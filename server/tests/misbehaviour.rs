//! The misbehaviour suite: what code written by a model that hunts for answers and breaks
//! things does inside a sandbox, as root (E2B gives root), against a real `opendsec up`
//! on crun and on runc. Every case checks the misbehaving sandbox, a bystander sandbox of
//! the same edge (it still answers, its files are intact), and the host (the control
//! plane still answers; what the case targets on the host is unchanged).
//!
//! Cases: forged requests to the agent, the edge and the gateway; reading the agent's
//! token; `/proc` and `/sys` (and what the sandbox sees of itself); a fork bomb; a memory hog (the sandbox survives, the OOM is
//! reported); `yes > file`; inotify exhaustion against another sandbox's watches; setuid
//! planting through a snapshot; the denied kernel interfaces (io_uring and others answer
//! EPERM); port scans of the host, the gateway and other sandboxes; ptrace of the agent.
//! (A microVM's CPU quota is checked in `edge/tests/vm_microvm.rs`.)

#[path = "support/up.rs"]
mod up;

use reqwest::Method;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use up::{Up, edge_exec};

/// A misbehaving sandbox and a bystander on one edge, and what the bystander holds.
struct Scene {
    up: Up,
    key: String,
    /// The edge's proxy, as the gateway reaches it (see `up::edge_door`).
    door: String,
    bystander: String,
}

impl Scene {
    async fn start(runtime: &str) -> Scene {
        let up = Up::start_on(runtime).await;
        up.ensure_image("base", Duration::from_secs(600)).await;
        let key = up.edge_key();
        let door = up.edge_door().await;
        let mut scene = Scene {
            up,
            key,
            door,
            bystander: String::new(),
        };
        scene.bystander = scene.create(json!({"image": "base", "memory_mb": 256})).await;
        scene
            .sh(&scene.bystander, None, "echo mine > /home/user/bystander-file")
            .await;
        scene
    }

    async fn create(&self, body: Value) -> String {
        let (s, v) = self.up.send(Method::POST, "/v1/sandboxes", Some(body)).await;
        assert_eq!(s, 201, "{v}");
        let id = v["sandbox"]["id"].as_str().unwrap().to_string();
        self.wait_state(&id, "running").await;
        id
    }

    async fn sandbox(&self, id: &str) -> Value {
        self.up.send(Method::GET, &format!("/v1/sandboxes/{id}"), None).await.1
    }

    async fn wait_state(&self, id: &str, state: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let v = self.sandbox(id).await;
            if v["state"] == state {
                return v;
            }
            assert!(Instant::now() < deadline, "sandbox {id} is not {state}: {v}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Runs `script` in sandbox `id` as `user` (root when `Some("root")`); panics if the
    /// agent does not answer.
    async fn sh(&self, id: &str, user: Option<&str>, script: &str) -> (String, i64) {
        self.try_sh(id, user, script)
            .await
            .unwrap_or_else(|e| panic!("`{script}` in {id}: {e}"))
    }

    async fn try_sh(&self, id: &str, user: Option<&str>, script: &str) -> Result<(String, i64), String> {
        edge_exec(&self.up.client, &self.door, &self.key, id, script, user).await
    }

    /// The bystander answers and its file is intact; the control plane answers.
    async fn others_unharmed(&self, case: &str) {
        let (out, code) = self.sh(&self.bystander, None, "cat /home/user/bystander-file").await;
        assert_eq!((out.as_str(), code), ("mine\n", 0), "{case}: the bystander was harmed");
        let (s, _) = self.up.send(Method::GET, "/v1/sandboxes", None).await;
        assert_eq!(s, 200, "{case}: the control plane does not answer");
    }
}

/// A Python probe run in a `base` sandbox.
fn python(code: &str) -> String {
    format!("python3 - <<'EOF'\n{code}\nEOF")
}

async fn misbehave(runtime: &str) {
    let scene = Scene::start(runtime).await;
    let up = &scene.up;
    let bad = scene.create(json!({"image": "base", "memory_mb": 256})).await;
    let root = Some("root");

    // Forged requests: nothing of the agent, the edge or the gateway is reachable from
    // inside. The agent's socket lives outside the sandbox; its network is its own lo.
    let ports: Vec<u16> = [&up.http, &up.edge, &up.peer]
        .iter()
        .map(|a| a.rsplit(':').next().unwrap().parse().unwrap())
        .collect();
    let probe = format!(
        "{}\nfind / -xdev -type s 2>/dev/null | wc -l",
        python(&format!(
            "import socket\n\
             out = []\n\
             for p in {ports:?}:\n\
             \x20   s = socket.socket(); s.settimeout(2)\n\
             \x20   out.append(s.connect_ex(('127.0.0.1', p)))\n\
             print(out)"
        ))
    );
    let (out, _) = scene.sh(&bad, root, &probe).await;
    let refused = nix::libc::ECONNREFUSED;
    assert_eq!(
        out,
        format!("[{refused}, {refused}, {refused}]\n0\n"),
        "the gateway, edge or peer port, or an agent socket, is reachable from inside"
    );
    scene.others_unharmed("forged requests").await;

    // The agent's token: in no file, not in PID 1's command line or environment.
    let token = opendsec_control::sandbox_token(&scene.key, opendsec_control::SandboxTokenKind::Agent, &bad);
    let (out, _) = scene
        .sh(
            &bad,
            root,
            &format!(
                "grep -rl '{token}' / --exclude-dir=proc --exclude-dir=sys 2>/dev/null | wc -l; \
                 tr '\\0' ' ' < /proc/1/cmdline | grep -c '{token}'; \
                 cat /proc/1/environ >/dev/null 2>&1 && echo environ-readable; \
                 ls -A /.opendsec"
            ),
        )
        .await;
    assert_eq!(out, "0\n0\nagent\n", "the agent's token is readable inside");
    scene.others_unharmed("token").await;

    // /proc and /sys: host-revealing files masked, the kernel's knobs read-only, no host
    // path in the mount table.
    let (out, _) = scene
        .sh(
            &bad,
            root,
            "for f in kcore kpagecount kpageflags kpagecgroup sysrq-trigger timer_list sched_debug keys \
                 sys/kernel/core_pattern; do printf '%s=%s ' $f $(cat /proc/$f 2>/dev/null | wc -c); done; echo; \
             echo 1 > /proc/sys/kernel/panic 2>/dev/null && echo procsys-written; \
             echo x > /sys/kernel/uevent_helper 2>/dev/null && echo sys-written; \
             echo c > /proc/sysrq-trigger 2>/dev/null && echo sysrq-written; \
             cat /proc/self/mountinfo",
        )
        .await;
    let (masked, rest) = out.split_once('\n').unwrap();
    for f in masked.split_whitespace() {
        assert!(f.ends_with("=0"), "/proc/{f} bytes readable inside: {out}");
    }
    assert!(!rest.contains("-written"), "{rest}");
    let data = up.data_dir().display().to_string();
    assert!(!rest.contains(&data), "a host path shows in the mount table:\n{rest}");
    scene.others_unharmed("/proc and /sys").await;

    // What it sees of itself: its own memory and CPUs, as a VM of its size would (lxcfs's
    // views and its cpuset; the default CPU is one core), not the host's.
    let (out, _) = scene
        .sh(
            &bad,
            None,
            "free -m | awk '/^Mem:/{print $2}'; nproc; python3 -c 'import os; print(os.cpu_count())'; \
             grep -c ^processor /proc/cpuinfo",
        )
        .await;
    assert_eq!(out, "256\n1\n1\n1\n", "the sandbox sees the host's memory or CPUs");

    // A fork bomb: held by the sandbox's pids limit; it stops multiplying after 5 s and
    // the sandbox answers again once its processes are gone.
    let _ = scene
        .try_sh(
            &bad,
            None,
            "rm -f /tmp/stop; (sleep 5; touch /tmp/stop) & b() { [ -e /tmp/stop ] || { b | b & }; }; b; \
             sleep 7 2>/dev/null; echo done",
        )
        .await;
    scene.others_unharmed("fork bomb").await;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok((out, 0)) = scene.try_sh(&bad, root, "pkill -9 -u user; echo alive").await
            && out.ends_with("alive\n")
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the sandbox did not recover from its fork bomb"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    // A memory hog: the kernel kills it, the sandbox lives on and the kill is reported.
    let (_, code) = scene
        .sh(&bad, None, "python3 -c 'b=[bytearray(1<<20) for _ in range(2048)]'")
        .await;
    assert_eq!(code, 137, "the hog was killed");
    let deadline = Instant::now() + Duration::from_secs(30);
    let v = loop {
        let v = scene.sandbox(&bad).await;
        if v["oom_kills"].as_u64() >= Some(1) {
            break v;
        }
        assert!(Instant::now() < deadline, "no OOM kill reported: {v}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(
        (v["state"].as_str(), v["last_oom_command"].as_str()),
        (Some("running"), Some("python3"))
    );
    scene.others_unharmed("memory hog").await;

    // `yes > file`: the sandbox's own disk fills, nothing else.
    let (out, _) = scene
        .sh(
            &bad,
            None,
            "yes > /home/user/fill 2>/dev/null; df -m /home/user | tail -1 | awk '{print $4}'; rm -f /home/user/fill",
        )
        .await;
    // Full: `yes` stopped at ENOSPC (df rounds a few KB freed since up to 1 MB).
    let free_mb: u64 = out.trim().parse().unwrap_or(u64::MAX);
    assert!(free_mb <= 1, "the sandbox's disk is full: {out}");
    scene.others_unharmed("yes > file").await;

    // inotify exhaustion: `user` in this sandbox takes every inotify instance it can get
    // (four processes, each until its file limit or its sandbox's memory stops it: the
    // kernel charges instances to the memory cgroup) and holds them; `user` in the bystander
    // is another host uid, and the host's shared pool is not the sandbox's to exhaust
    // (see `container/idmap.rs`): its file watches still work.
    let hog = "import ctypes, os, time\n\
        libc = ctypes.CDLL(None, use_errno=True)\n\
        n = 0\n\
        while libc.inotify_init() >= 0:\n\
        \x20   n += 1\n\
        \x20   if n % 500 == 0: open('/tmp/inotify-%d' % os.getpid(), 'w').write(str(n))\n\
        time.sleep(120)";
    scene
        .sh(
            &bad,
            None,
            &format!(
                "cat > /tmp/hog.py <<'EOF'\n{hog}\nEOF\n\
                 for i in 1 2 3 4; do (setsid python3 /tmp/hog.py >/dev/null 2>&1 &); done; echo started"
            ),
        )
        .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let taken: u64 = loop {
        let (out, _) = scene
            .sh(
                &bad,
                None,
                "ls /tmp/inotify-* 2>/dev/null | wc -l; awk '{s += $1} END {print s}' /tmp/inotify-* 2>/dev/null",
            )
            .await;
        let total: u64 = out.lines().nth(1).unwrap_or("0").trim().parse().unwrap_or(0);
        if total >= 10_000 {
            break total;
        }
        assert!(Instant::now() < deadline, "the inotify hogs did not report: {out}");
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(taken > 10_000, "the hogs took only {taken} inotify instances");
    let watch = python(
        "import ctypes, os\n\
         libc = ctypes.CDLL(None, use_errno=True)\n\
         fd = libc.inotify_init()\n\
         w = libc.inotify_add_watch(fd, b'/home/user', 0x100)\n\
         open('/home/user/new-file', 'w').close()\n\
         print(fd >= 0 and w >= 0 and len(os.read(fd, 4096)) > 0)",
    );
    let (out, _) = scene.sh(&scene.bystander, None, &watch).await;
    assert_eq!(
        out, "True\n",
        "another sandbox's file watches broke while {taken} instances were held"
    );
    scene.others_unharmed("inotify exhaustion").await;
    let (out, _) = scene
        .sh(
            &bad,
            root,
            "pkill -9 -f 'hog[.]py'; while pgrep -f 'hog[.]py' >/dev/null; do sleep 0.1; done; echo stopped",
        )
        .await;
    assert_eq!(out, "stopped\n");

    // Setuid planting through a snapshot: sandbox root makes a setuid-root shell and
    // snapshots it; neither the host's copy nor a sandbox started from it keeps the bit.
    scene
        .sh(
            &bad,
            root,
            "cp /bin/sh /home/user/rootsh && chmod 6755 /home/user/rootsh",
        )
        .await;
    let (s, v) = up
        .send(
            Method::POST,
            &format!("/v1/sandboxes/{bad}/snapshots"),
            Some(json!({"name": "planted"})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let snap = v["snapshot"]["id"].as_str().unwrap().to_string();
    up.wait_snapshot_ready(&snap, Duration::from_secs(120)).await;
    let planted: Vec<std::path::PathBuf> = walk(&up.data_dir().join("edge/snapshots"))
        .into_iter()
        .filter(|p| p.file_name().is_some_and(|n| n == "rootsh"))
        .collect();
    assert!(!planted.is_empty(), "the snapshot holds the planted file");
    for p in &planted {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(p).unwrap().permissions().mode();
        assert_eq!(mode & 0o6000, 0, "{} is setuid/setgid on the host", p.display());
    }
    let restored = scene.create(json!({"image": snap, "memory_mb": 256})).await;
    let (out, _) = scene.sh(&restored, None, "stat -c %a /home/user/rootsh").await;
    assert_eq!(out, "755\n");
    scene.others_unharmed("setuid planting").await;

    // The kernel interfaces a sandbox has no business with answer EPERM, to root too.
    let (out, _) = scene
        .sh(
            &bad,
            root,
            &python(
                "import ctypes\n\
                 libc = ctypes.CDLL(None, use_errno=True)\n\
                 calls = {'io_uring_setup': (425, 8, 0), 'userfaultfd': (323, 0), 'keyctl': (250, 0, 0), \
                          'perf_event_open': (298, 0, 0, -1, -1, 0), 'bpf': (321, 0, 0, 0), \
                          'kexec_load': (246, 0, 0, 0, 0), 'init_module': (175, 0, 0, 0), \
                          'ptrace_attach_agent': (101, 16, 1, 0, 0)}\n\
                 for name, args in calls.items():\n\
                 \x20   r = libc.syscall(*args)\n\
                 \x20   print(name, r, ctypes.get_errno())",
            ),
        )
        .await;
    for line in out.lines() {
        assert!(
            line.ends_with(&format!(" -1 {}", nix::libc::EPERM)),
            "not refused with EPERM: {line}\n{out}"
        );
    }
    assert_eq!(out.lines().count(), 8, "{out}");
    scene.others_unharmed("denied kernel interfaces").await;

    // Port scans: the whole of 127.0.0.1 holds only what the sandbox itself listens on;
    // the metadata address and private networks are refused by its policy (default deny:
    // "No route to host" at once, never a packet out).
    let (out, _) = scene
        .sh(
            &bad,
            root,
            &python(
                "import socket\n\
                 open_ports = []\n\
                 for p in range(1, 65536):\n\
                 \x20   s = socket.socket(); s.settimeout(0.5)\n\
                 \x20   # A connect to the port it was given as its own source is TCP's self-connect.\n\
                 \x20   if s.connect_ex(('127.0.0.1', p)) == 0 and s.getsockname() != s.getpeername(): open_ports.append(p)\n\
                 \x20   s.close()\n\
                 print(open_ports)\n\
                 for host in ['169.254.169.254', '10.0.0.1', '192.168.0.1']:\n\
                 \x20   s = socket.socket(); s.settimeout(1)\n\
                 \x20   print(host, s.connect_ex((host, 80)))",
            ),
        )
        .await;
    let unreachable = nix::libc::EHOSTUNREACH;
    assert_eq!(
        out,
        format!("[]\n169.254.169.254 {unreachable}\n10.0.0.1 {unreachable}\n192.168.0.1 {unreachable}\n"),
        "a port scan from inside found something"
    );
    scene.others_unharmed("port scan").await;

    // ptrace of the agent, its memory, its open files and its root: refused (the agent
    // is not dumpable, ptrace is not in the sandbox's system calls, and root inside has
    // no CAP_SYS_PTRACE). Root inside owns the agent's /proc directory in its own user
    // namespace, so it may list the fd numbers; what they point at stays closed.
    let (out, _) = scene
        .sh(
            &bad,
            root,
            "head -c 1 /proc/1/mem >/dev/null 2>&1 && echo mem-read; \
             readlink /proc/1/fd/* 2>/dev/null | wc -l; \
             for f in /proc/1/fd/*; do head -c 1 $f >/dev/null 2>&1 && echo fd-opened; done; \
             ls /proc/1/root/ >/dev/null 2>&1 && echo root-listed; \
             cat /proc/1/environ >/dev/null 2>&1 && echo environ-read; echo checked",
        )
        .await;
    assert_eq!(out, "0\nchecked\n", "the agent could be inspected");
    // A best-effort sandbox runs under SCHED_IDLE with the least CPU weight, and root in
    // it cannot leave (that needs CAP_SYS_NICE); a latency-sensitive one is SCHED_OTHER
    // at the kernel's default weight. An unknown class is refused, naming the field.
    let (s, v) = up
        .send(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": "base", "cpu_class": "turbo"})),
        )
        .await;
    assert_eq!((s, v["field"].as_str()), (400, Some("cpu_class")), "{v}");
    let idle = scene
        .create(json!({"image": "base", "memory_mb": 256, "cpu_class": "best-effort"}))
        .await;
    assert_eq!(scene.sandbox(&idle).await["cpu_class"], "best-effort");
    let policy = python(
        "import os\n\
         print(os.sched_getscheduler(0))\n\
         try:\n\
         \x20   os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0)); print('left')\n\
         except PermissionError: print('stayed')",
    );
    let (out, _) = scene.sh(&idle, root, &policy).await;
    assert_eq!(out, format!("{}\nstayed\n", nix::libc::SCHED_IDLE));
    let (out, _) = scene.sh(&bad, root, &policy).await;
    assert_eq!(out, format!("{}\nleft\n", nix::libc::SCHED_OTHER));
    assert_eq!(
        cpu_weight(up, &idle),
        2,
        "a best-effort sandbox has the least CPU weight"
    );
    assert_eq!(cpu_weight(up, &bad), 1024);
    scene.others_unharmed("cpu classes").await;

    // The misbehaving sandbox still runs and its agent answers.
    let v = scene.sandbox(&bad).await;
    assert_eq!(v["state"], "running", "{v}");
    scene.others_unharmed("ptrace").await;
}

/// Sandbox `id`'s CPU weight on the host, as v1 `cpu.shares` (v2's `cpu.weight` read back
/// in shares), from the cgroup its record names.
fn cpu_weight(up: &Up, id: &str) -> u64 {
    let record: Value = serde_json::from_slice(
        &std::fs::read(up.data_dir().join(format!("edge/sandboxes/{id}/sandbox.json"))).unwrap(),
    )
    .unwrap();
    let path = record["cgroups_path"].as_str().unwrap().trim_start_matches('/');
    for dir in ["cpu", "cpu,cpuacct"] {
        if let Ok(v) = std::fs::read_to_string(format!("/sys/fs/cgroup/{dir}/{path}/cpu.shares")) {
            return v.trim().parse().unwrap();
        }
    }
    let weight: u64 = std::fs::read_to_string(format!("/sys/fs/cgroup/{path}/cpu.weight"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // runc's mapping, inverted for the two values a sandbox can have.
    if weight == 1 { 2 } else { 1024 }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misbehaving_sandbox_harms_neither_the_host_nor_its_neighbour_on_crun() {
    misbehave("crun").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_misbehaving_sandbox_harms_neither_the_host_nor_its_neighbour_on_runc() {
    misbehave("runc").await;
}
