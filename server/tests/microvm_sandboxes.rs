//! Specification: microVM sandboxes through the whole path (REST -> log -> edge -> QEMU
//! microVM -> the agent in the guest), with `opendsec up` running as a real process.
//!
//! Needs root, QEMU (qemu-system-x86), erofs-utils, e2fsprogs, iproute2, the `base` and
//! `busybox` images in the store, the static agent (`OPENDSEC_TEST_AGENT`) and the
//! edge's binaries beside `opendsec` (`opendsec-shim`, `opendsec-vm-shim`: build the
//! workspace, or `cargo build -p opendsec-edge --bins`). Guests run under KVM where a
//! probe guest shows it works at hardware speed, else under TCG (every check here runs
//! either way; the accelerator is printed). Figures are printed as `figure: <name> =
//! <value>`: run with `--nocapture` to see them. The tests run one at a time (a lock):
//! each boots guests, and the machines this runs on have two cores.
//!
//! Run: `cargo test -p opendsec --test microvm_sandboxes -- --nocapture`

#[path = "support/up.rs"]
mod up;
#[path = "support/vms.rs"]
mod vms;

use reqwest::Method;
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use tokio::sync::Mutex;
use up::Up;
use vms::{count, exec, figure, ms, start, start_counter, wait_state};

/// One test at a time: each boots guests under a CPU emulator on a small machine.
static SERIAL: Mutex<()> = Mutex::const_new(());

/// Creates a sandbox through `POST /v1/sandboxes`; returns its id.
async fn create(up: &Up, body: Value) -> String {
    let (s, v) = up.send(Method::POST, "/v1/sandboxes", Some(body.clone())).await;
    assert_eq!(s, 201, "create {body}: {v}");
    v["sandbox"]["id"].as_str().unwrap().to_string()
}

/// A 256 MB microVM of `base`, with `extra` fields in the create body.
async fn create_vm(up: &Up, extra: Value) -> String {
    let mut body = json!({"image": "base", "isolation": "microvm", "memory_mb": 256, "timeout_seconds": 900});
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    create(up, body).await
}

/// The QEMU process of sandbox `id` (started as `-name opendsec-<id>`), if one runs.
fn qemu_pid(id: &str) -> Option<i32> {
    let needle = format!("-name\0opendsec-{id}\0");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        String::from_utf8_lossy(&cmdline).contains(&needle).then_some(pid)
    })
}

/// (RSS, PSS) of a process in KiB.
fn rss_pss_kb(pid: i32) -> (u64, u64) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("Rss:"), field("Pss:"))
}

/// Bytes of `path` resident in the page cache (mincore over a mapping of it).
fn resident_bytes(path: &std::path::Path) -> u64 {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    let len = file.metadata().unwrap().len() as usize;
    if len == 0 {
        return 0;
    }
    let map = unsafe {
        // SAFETY: a read-only shared mapping of a file held open; unmapped below.
        nix::libc::mmap(
            std::ptr::null_mut(),
            len,
            nix::libc::PROT_READ,
            nix::libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(map, nix::libc::MAP_FAILED);
    let mut pages = vec![0u8; len.div_ceil(4096)];
    // SAFETY: `pages` has one byte per page of the mapping.
    let ok = unsafe { nix::libc::mincore(map, len, pages.as_mut_ptr()) };
    // SAFETY: the mapping made above.
    unsafe { nix::libc::munmap(map, len) };
    assert_eq!(ok, 0);
    pages.iter().filter(|b| **b & 1 != 0).count() as u64 * 4096
}

/// Bytes of data a (sparse) file holds on disk.
fn allocated_bytes(path: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

fn agent_token(up: &Up, id: &str) -> String {
    opendsec_control::sandbox_token(&up.edge_key(), opendsec_control::SandboxTokenKind::Agent, id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_microvm_from_base_runs_python_through_the_agent_route() {
    let _one = SERIAL.lock().await;
    let up = start().await;
    let t = Instant::now();
    let id = create_vm(&up, json!({})).await;
    // A command sent while the microVM still boots waits for it, rather than failing.
    let out = exec(&up, &id, "python3", &["-c", "print(6*7)"]).await;
    assert_eq!(out, "42\n");
    figure(
        "microVM create (REST) to python3 -c 'print(6*7)' answered",
        ms(t.elapsed()),
    );
    let v = wait_state(&up, &id, "running", Duration::from_secs(1)).await;
    assert_eq!(
        (v["isolation"].as_str(), v["image"].as_str()),
        (Some("microvm"), Some("base"))
    );
    // It says how it runs: the VMM and accelerator its edge chose (KVM only where a
    // probe guest ran at hardware speed), in the sandbox and in its metrics.
    let (vmm, accelerator) = vms::edge_runtime(&up);
    assert_eq!(v["runtime"], json!({"vmm": vmm, "accelerator": accelerator}), "{v}");
    let (s, m) = up.send(Method::GET, &format!("/v1/sandboxes/{id}/metrics"), None).await;
    assert_eq!(s, 200, "{m}");
    assert_eq!(
        (m["vmm"].as_str(), m["accelerator"].as_str()),
        (Some(vmm.as_str()), Some(accelerator.as_str())),
        "{m}"
    );
    assert_eq!(m["mem_total"], json!(256u64 << 20), "{m}");
    assert!(
        m["mem_used"].as_u64().unwrap() > 0,
        "a running VM's QEMU uses memory: {m}"
    );
    // The guest has its own kernel, and QEMU runs for it.
    let kernel = exec(&up, &id, "uname", &["-r"]).await;
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    assert_ne!(kernel.trim(), host.trim(), "a microVM runs its own kernel");
    assert!(qemu_pid(&id).is_some());
    // The agent in the guest wants this sandbox's token: the proxy with another is refused.
    let r = up
        .client
        .post(format!(
            "http://{}/sandboxes/{id}/process.Process/Start",
            up.edge_door().await
        ))
        .header("x-opendsec-edge-key", up.edge_key())
        .header("x-access-token", agent_token(&up, "someone-else"))
        .header("content-type", "application/connect+json")
        .body(up::connect_frame(br#"{"process":{"cmd":"true"}}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    // Killing it ends its QEMU.
    let (s, _) = up.send(Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, 200);
    let deadline = Instant::now() + Duration::from_secs(30);
    while qemu_pid(&id).is_some() {
        assert!(Instant::now() < deadline, "the QEMU of a killed sandbox still runs");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_microvm_keeps_its_memory_across_pause_resume_and_snapshot_restore() {
    let _one = SERIAL.lock().await;
    let up = start().await;
    let id = create_vm(&up, json!({"auto_resume": true})).await;
    wait_state(&up, &id, "running", Duration::from_secs(180)).await;
    start_counter(&up, &id).await;
    assert_eq!(count(&up, &id).await, 2);
    let pid = qemu_pid(&id).expect("its QEMU runs");
    let (rss, pss) = rss_pss_kb(pid);

    // Pause: the VM's state is snapshotted and its QEMU ends, giving its memory back.
    let t = Instant::now();
    let (s, v) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
    assert_eq!(s, 200, "{v}");
    wait_state(&up, &id, "paused", Duration::from_secs(60)).await;
    figure("pause (REST) to paused", ms(t.elapsed()));
    assert!(qemu_pid(&id).is_none(), "no QEMU process while paused");
    // What the paused VM still holds in memory: no process, and its RAM file (written
    // back) dropped from the page cache.
    let ram = up.data_dir().join("edge/vms/vms").join(&id).join("ram");
    let resident = resident_bytes(&ram);
    figure(
        "running microVM: QEMU RSS / PSS",
        format!("{} / {} MiB", rss / 1024, pss / 1024),
    );
    figure(
        "paused microVM: memory held on the node",
        format!(
            "no process (0 MiB RSS); RAM file resident in the page cache {} MiB, its data on disk {} MiB",
            resident >> 20,
            allocated_bytes(&ram) >> 20
        ),
    );
    assert!(
        resident < 16 << 20,
        "the paused VM's RAM is not released: {resident} bytes resident"
    );

    // A request to it through E2B's traffic path resumes it (auto-resume): the count
    // goes on from where it was, in a new QEMU process.
    let t = Instant::now();
    let frame = up::connect_frame(
        &serde_json::to_vec(
            &json!({"process": {"cmd": "bash", "args": ["-c", "exec 3<>/dev/tcp/127.0.0.1/7777 && cat <&3"]}}),
        )
        .unwrap(),
    );
    let r = up
        .client
        .post(format!("http://{}/process.Process/Start", up.http))
        .header("e2b-sandbox-id", &id)
        .header("x-access-token", agent_token(&up, &id))
        .header("content-type", "application/connect+json")
        .header("connect-protocol-version", "1")
        .body(frame)
        .send()
        .await
        .unwrap();
    let (out, code) = up::read_process_stream(r).await.unwrap();
    assert_eq!(
        (out.trim(), code),
        ("3", 0),
        "the in-memory count continues after an auto-resume"
    );
    figure(
        "paused -> request through E2B's traffic path answered (auto-resume)",
        ms(t.elapsed()),
    );
    let resumed = qemu_pid(&id).expect("a new QEMU runs it");
    assert_ne!(resumed, pid);
    assert_eq!(
        wait_state(&up, &id, "running", Duration::from_secs(10)).await["state"],
        "running"
    );

    // A snapshot holds memory, device state and disk; a sandbox started from it continues
    // where the source was, with a token of its own.
    exec(&up, &id, "sh", &["-c", "echo before-snapshot > /home/user/mark"]).await;
    let t = Instant::now();
    let (s, v) = up
        .send(
            Method::POST,
            &format!("/v1/sandboxes/{id}/snapshots"),
            Some(json!({"name": "warm"})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["snapshot"]["isolation"], "microvm");
    let snap = v["snapshot"]["id"].as_str().unwrap().to_string();
    let taken = up.wait_snapshot_ready(&snap, Duration::from_secs(120)).await;
    figure(
        "snapshot (REST) to ready",
        format!(
            "{} ({} MiB of data)",
            ms(t.elapsed()),
            taken["size_bytes"].as_u64().unwrap() >> 20
        ),
    );
    assert_eq!(count(&up, &id).await, 4, "the source runs on");

    let t = Instant::now();
    let restored = create(&up, json!({"image": snap, "memory_mb": 999})).await;
    let v = wait_state(&up, &restored, "running", Duration::from_secs(120)).await;
    figure("create from a microVM snapshot (REST) to running", ms(t.elapsed()));
    assert_eq!(
        (v["isolation"].as_str(), v["memory_mb"].as_u64(), v["snapshot"].as_str()),
        (Some("microvm"), Some(256), Some(snap.as_str()))
    );
    assert_eq!(
        count(&up, &restored).await,
        4,
        "the restored guest continues from the snapshot's memory"
    );
    assert_eq!(count(&up, &id).await, 5, "and the two go their own ways");
    assert_eq!(
        exec(&up, &restored, "cat", &["/home/user/mark"]).await,
        "before-snapshot\n"
    );
    // Its agent was re-keyed: the source's token no longer opens it.
    let r = up
        .client
        .post(format!(
            "http://{}/sandboxes/{restored}/process.Process/Start",
            up.edge_door().await
        ))
        .header("x-opendsec-edge-key", up.edge_key())
        .header("x-access-token", agent_token(&up, &id))
        .header("content-type", "application/connect+json")
        .body(up::connect_frame(br#"{"process":{"cmd":"true"}}"#))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status().as_u16(),
        401,
        "the restored guest refuses its source's token"
    );

    // A paused VM whose snapshot was damaged cannot come back: after a few tries it is
    // reported failed, saying why, and the others are unharmed.
    let (s, _) = up
        .send(Method::POST, &format!("/v1/sandboxes/{restored}/pause"), None)
        .await;
    assert_eq!(s, 200);
    wait_state(&up, &restored, "paused", Duration::from_secs(60)).await;
    std::fs::write(
        up.data_dir().join("edge/vms/vms").join(&restored).join("state"),
        b"not a migration stream",
    )
    .unwrap();
    let (s, _) = up
        .send(Method::POST, &format!("/v1/sandboxes/{restored}/resume"), None)
        .await;
    assert_eq!(s, 200);
    let deadline = Instant::now() + Duration::from_secs(60);
    let failed = loop {
        let (_, v) = up.send(Method::GET, &format!("/v1/sandboxes/{restored}"), None).await;
        if v["state"] == "failed" {
            break v;
        }
        assert!(
            Instant::now() < deadline,
            "a VM with a damaged snapshot was not reported failed: {v}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eprintln!("a damaged snapshot: {}", failed["reason"]);
    assert!(
        failed["reason"].as_str().unwrap().contains("could not be restored"),
        "{failed}"
    );
    assert!(qemu_pid(&restored).is_none());
    assert_eq!(count(&up, &id).await, 6, "the source is unharmed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_of_a_microvm_gives_copies_with_its_memory_that_share_pages_and_diverge() {
    let _one = SERIAL.lock().await;
    let up = start().await;
    let parent = create_vm(&up, json!({})).await;
    wait_state(&up, &parent, "running", Duration::from_secs(180)).await;
    start_counter(&up, &parent).await;
    assert_eq!(count(&up, &parent).await, 2);
    let parent_pid = qemu_pid(&parent).unwrap();
    let (one_rss, one_pss) = rss_pss_kb(parent_pid);

    let t = Instant::now();
    let (s, v) = up
        .send(
            Method::POST,
            &format!("/v1/sandboxes/{parent}/fork"),
            Some(json!({"count": 4})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let copies: Vec<String> = v["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(copies.len(), 4);
    for c in &copies {
        let v = wait_state(&up, c, "running", Duration::from_secs(120)).await;
        assert_eq!(
            (v["isolation"].as_str(), v["fork_of"].as_str()),
            (Some("microvm"), Some(parent.as_str()))
        );
    }
    figure("fork x4 (REST) to all copies running", ms(t.elapsed()));
    // Every copy starts with the parent's memory: its next count is 3.
    for c in &copies {
        assert_eq!(count(&up, c).await, 3, "copy {c} starts from the parent's memory");
    }
    figure(
        "fork x4 (REST) to all copies answered from the parent's memory",
        ms(t.elapsed()),
    );
    // Each copy's random numbers are its own: the edge reseeded every copy's kernel
    // generator when it re-keyed its agent, so no two copies (nor the parent) draw the
    // same /dev/urandom bytes or seed Python's `random` alike.
    let mut urandom = std::collections::BTreeSet::new();
    let mut python = std::collections::BTreeSet::new();
    for vm in copies.iter().chain([&parent]) {
        let bytes = exec(&up, vm, "sh", &["-c", "head -c 16 /dev/urandom | od -An -tx1"]).await;
        let seed = exec(
            &up,
            vm,
            "python3",
            &["-c", "import random; print(random.getrandbits(64))"],
        )
        .await;
        assert!(
            urandom.insert(bytes.clone()),
            "{vm} drew /dev/urandom bytes another VM drew: {bytes}"
        );
        assert!(
            python.insert(seed.clone()),
            "{vm}'s Python random seed is another VM's: {seed}"
        );
    }
    // Then each goes its own way; the parent ran on all along, in the same process.
    assert_eq!(count(&up, &copies[0]).await, 4);
    assert_eq!(count(&up, &copies[0]).await, 5);
    assert_eq!(count(&up, &copies[1]).await, 4);
    assert_eq!(count(&up, &parent).await, 3);
    assert_eq!(
        qemu_pid(&parent),
        Some(parent_pid),
        "the parent keeps running in its QEMU"
    );
    exec(&up, &copies[2], "sh", &["-c", "echo mine > /home/user/who"]).await;
    assert_eq!(
        exec(
            &up,
            &copies[3],
            "sh",
            &["-c", "cat /home/user/who 2>/dev/null || echo none"]
        )
        .await,
        "none\n"
    );

    // Copies on one node share the parent's frozen RAM: they cost far less than 4 VMs.
    let (mut rss_sum, mut pss_sum) = (0, 0);
    for c in &copies {
        let (r, p) = rss_pss_kb(qemu_pid(c).unwrap());
        rss_sum += r;
        pss_sum += p;
    }
    figure(
        "one microVM (the parent before the fork): RSS / PSS",
        format!("{} / {} MiB", one_rss / 1024, one_pss / 1024),
    );
    figure(
        "fork x4: copies' RSS sum (shared pages counted in each)",
        format!("{} MiB", rss_sum / 1024),
    );
    figure(
        "fork x4: copies' PSS sum (shared pages counted once)",
        format!(
            "{} MiB = {:.2}x one VM",
            pss_sum / 1024,
            pss_sum as f64 / one_rss as f64
        ),
    );
    assert!(
        pss_sum < 2 * one_rss,
        "4 copies should cost well below 4 VMs: PSS sum {pss_sum} KiB, one VM {one_rss} KiB"
    );

    // A paused parent forks too (its copy is restored from a snapshot of it); the parent
    // stays paused.
    let (s, _) = up
        .send(Method::POST, &format!("/v1/sandboxes/{parent}/pause"), None)
        .await;
    assert_eq!(s, 200);
    wait_state(&up, &parent, "paused", Duration::from_secs(60)).await;
    let (s, v) = up
        .send(
            Method::POST,
            &format!("/v1/sandboxes/{parent}/fork"),
            Some(json!({"count": 1})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    let late = v["sandboxes"][0]["id"].as_str().unwrap().to_string();
    wait_state(&up, &late, "running", Duration::from_secs(120)).await;
    assert_eq!(
        count(&up, &late).await,
        4,
        "the copy of the paused parent has its memory"
    );
    assert_eq!(
        wait_state(&up, &parent, "paused", Duration::from_secs(5)).await["state"],
        "paused"
    );
    assert!(qemu_pid(&parent).is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_pause_pauses_ten_sandboxes_of_both_kinds_in_one_call_and_all_continue_after_resume() {
    let _one = SERIAL.lock().await;
    let up = start().await;
    let task = format!("rollout-{}", std::process::id());
    let labels = json!({"task": task});
    let mut ids = Vec::new();
    for _ in 0..3 {
        ids.push((create_vm(&up, json!({"labels": labels})).await, true));
    }
    for _ in 0..7 {
        ids.push((
            create(
                &up,
                json!({"image": "busybox", "memory_mb": 64, "labels": labels, "timeout_seconds": 900}),
            )
            .await,
            false,
        ));
    }
    // Another task's sandbox is left alone.
    let bystander = create(
        &up,
        json!({"image": "busybox", "memory_mb": 64, "labels": {"task": "other"}}),
    )
    .await;
    for (id, _) in &ids {
        wait_state(&up, id, "running", Duration::from_secs(240)).await;
    }
    let b = wait_state(&up, &bystander, "running", Duration::from_secs(60)).await;
    // A container has no VMM: neither it nor its metrics name one.
    assert!(b.get("runtime").is_none(), "{b}");
    let (s, m) = up
        .send(Method::GET, &format!("/v1/sandboxes/{bystander}/metrics"), None)
        .await;
    assert_eq!(s, 200, "{m}");
    assert!(m.get("vmm").is_none() && m.get("accelerator").is_none(), "{m}");
    assert_eq!(m["mem_total"], json!(64u64 << 20), "{m}");
    // A counter in each sandbox, in a shell's memory, written out every 100 ms.
    // (Renamed into place: a reader never sees a half-written file.)
    let counter = "sh -c 'n=0; while :; do n=$((n+1)); echo $n > $HOME/n.new; mv $HOME/n.new $HOME/n; sleep 0.1; done' >/dev/null 2>&1 </dev/null &";
    for (id, _) in &ids {
        exec(&up, id, "sh", &["-c", counter]).await;
    }
    let read = |id: String| {
        let up = &up;
        async move {
            let out = exec(up, &id, "sh", &["-c", "cat $HOME/n"]).await;
            out.trim()
                .parse::<u64>()
                .unwrap_or_else(|_| panic!("the counter file of {id} holds {out:?}"))
        }
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut at_pause = Vec::new();
    for (id, _) in &ids {
        let n = read(id.clone()).await;
        assert!(n > 0, "the counter of {id} runs");
        at_pause.push(n);
    }

    let t = Instant::now();
    let (s, v) = up.send(Method::POST, &format!("/v1/tasks/{task}/pause"), None).await;
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["changed"].as_array().unwrap().len(), 10, "{v}");
    for (id, _) in &ids {
        wait_state(&up, id, "paused", Duration::from_secs(120)).await;
    }
    figure(
        "task pause of 10 sandboxes (3 microVMs, 7 containers): call to all paused",
        ms(t.elapsed()),
    );
    for (id, vm) in &ids {
        if *vm {
            assert!(qemu_pid(id).is_none(), "paused microVM {id} has no QEMU");
        }
    }
    let (_, b) = up.send(Method::GET, &format!("/v1/sandboxes/{bystander}"), None).await;
    assert_eq!(b["state"], "running", "another task's sandbox runs on");
    let (_, audit) = up.send(Method::GET, "/v1/audit?action=task.pause", None).await;
    assert_eq!(
        audit["records"].as_array().unwrap().len(),
        1,
        "one call, one audit record: {audit}"
    );

    let t = Instant::now();
    let (s, v) = up.send(Method::POST, &format!("/v1/tasks/{task}/resume"), None).await;
    assert_eq!(s, 200, "{v}");
    for (id, _) in &ids {
        wait_state(&up, id, "running", Duration::from_secs(120)).await;
    }
    figure("task resume of 10 sandboxes: call to all running", ms(t.elapsed()));
    let mut after = Vec::new();
    for (id, _) in &ids {
        after.push(read(id.clone()).await);
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for (i, (id, vm)) in ids.iter().enumerate() {
        let later = read(id.clone()).await;
        assert!(
            after[i] >= at_pause[i],
            "{id} ({}) lost its count: {} before the pause, {} after",
            if *vm { "microVM" } else { "container" },
            at_pause[i],
            after[i]
        );
        assert!(
            later > after[i],
            "{id} ({}) does not count on after the resume: {} then {later}",
            if *vm { "microVM" } else { "container" },
            after[i]
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_microvm_outlives_kill_9_of_its_edge_and_the_restarted_edge_adopts_it() {
    let _one = SERIAL.lock().await;
    let mut up = start().await;
    let id = create_vm(&up, json!({})).await;
    wait_state(&up, &id, "running", Duration::from_secs(180)).await;
    start_counter(&up, &id).await;
    assert_eq!(count(&up, &id).await, 2);
    let pid = qemu_pid(&id).unwrap();

    up.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(qemu_pid(&id), Some(pid), "the VM runs on without its edge");
    let t = Instant::now();
    up.restart().await;
    assert_eq!(
        wait_state(&up, &id, "running", Duration::from_secs(60)).await["isolation"],
        "microvm"
    );
    assert_eq!(
        count(&up, &id).await,
        3,
        "the same guest, its memory intact, answers through the restarted edge"
    );
    figure("restart of opendsec up to exec in the adopted microVM", ms(t.elapsed()));
    assert_eq!(qemu_pid(&id), Some(pid), "adopted, not restarted");
    // And the restarted edge steers it: pause and resume.
    let (s, _) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
    assert_eq!(s, 200);
    wait_state(&up, &id, "paused", Duration::from_secs(60)).await;
    let (s, _) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None).await;
    assert_eq!(s, 200);
    wait_state(&up, &id, "running", Duration::from_secs(60)).await;
    assert_eq!(count(&up, &id).await, 4);
}
