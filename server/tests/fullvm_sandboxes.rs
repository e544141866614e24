//! Specification: full VM sandboxes (`isolation: vm`) through the whole path: REST ->
//! log -> edge -> a QEMU q35 PC whose SeaBIOS boots the image's disk through extlinux
//! -> the agent in the guest, with `opendsec up` running as a real process.
//!
//! Needs what `microvm_sandboxes.rs` needs plus the full VM packages of `VM_PACKAGES` in
//! ops/lib.sh (qemu-utils, seabios, extlinux, syslinux-common). Figures are printed as
//! `figure: <name> = <value>` (`--nocapture`).
//!
//! Run: `cargo test -p opendsec --test fullvm_sandboxes -- --nocapture`

#[path = "support/up.rs"]
mod up;
#[path = "support/vms.rs"]
mod vms;

use reqwest::Method;
use serde_json::json;
use std::time::{Duration, Instant};
use up::Up;
use vms::{count, exec, figure, ms, start_counter, wait_state};

/// Each sandbox's disk (`--disk-mb`).
const DISK_MB: u64 = 4096;

/// `opendsec up`, once its edge's VM driver is ready and it registered as running full VMs.
async fn start() -> Up {
    // A disk larger than the image's (about 2.6 GiB for `base`): the guest grows into it.
    let up = vms::start_with_disk(DISK_MB).await;
    let (s, edges) = up.send(Method::GET, "/v1/edges", None).await;
    assert_eq!(s, 200, "{edges}");
    assert!(
        edges.to_string().contains("\"opendsec.io/fullvm\":\"q35\""),
        "the edge says it runs full VMs: {edges}"
    );
    up
}

/// The command line of sandbox `id`'s QEMU (started as `-name opendsec-<id>`), if one runs.
fn qemu_cmdline(id: &str) -> Option<String> {
    let needle = format!("-name\0opendsec-{id}\0");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        e.file_name().to_str()?.parse::<i32>().ok()?;
        let cmdline = String::from_utf8_lossy(&std::fs::read(e.path().join("cmdline")).ok()?).into_owned();
        cmdline.contains(&needle).then(|| cmdline.replace('\0', " "))
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_vm_through_rest_boots_base_from_its_disk_runs_python_and_pauses_with_its_memory() {
    let up = start().await;

    // Bad input is refused before anything is logged, naming the field.
    let (s, v) = up
        .send(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": "base", "isolation": "qemu"})),
        )
        .await;
    assert_eq!((s, v["field"].as_str()), (400, Some("isolation")), "{v}");
    let (s, v) = up
        .send(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": "base", "isolation": "vm", "memory_mb": 64})),
        )
        .await;
    assert_eq!((s, v["field"].as_str()), (400, Some("memory_mb")), "{v}");

    let t = Instant::now();
    let (s, v) = up
        .send(
            Method::POST,
            "/v1/sandboxes",
            Some(json!({"image": "base", "isolation": "vm", "memory_mb": 256, "timeout_seconds": 900})),
        )
        .await;
    assert_eq!(s, 201, "{v}");
    assert_eq!(v["sandbox"]["isolation"], "vm");
    let id = v["sandbox"]["id"].as_str().unwrap().to_string();
    // The first full VM of an image on a machine builds its boot disk (once).
    let v = wait_state(&up, &id, "running", Duration::from_secs(400)).await;
    let ready = t.elapsed();
    assert_eq!(
        (v["isolation"].as_str(), v["image"].as_str()),
        (Some("vm"), Some("base"))
    );
    let out = exec(&up, &id, "python3", &["-c", "print(6*7)"]).await;
    assert_eq!(out, "42\n");
    figure("full VM create (REST) to running", ms(ready));
    figure(
        "full VM create (REST) to python3 -c 'print(6*7)' answered",
        ms(t.elapsed()),
    );

    // A PC with firmware, booted from its own disk by its bootloader.
    let qemu = qemu_cmdline(&id).expect("its QEMU runs");
    assert!(qemu.contains("-M q35,memory-backend=ram0"), "{qemu}");
    assert!(qemu.contains("-sandbox on"), "{qemu}");
    let guest = exec(
        &up,
        &id,
        "sh",
        &[
            "-c",
            "cat /sys/class/dmi/id/bios_vendor /proc/cmdline; awk '$2 == \"/\" {print $1}' /proc/mounts",
        ],
    )
    .await;
    let lines: Vec<&str> = guest.lines().collect();
    assert_eq!(lines[0], "SeaBIOS", "{guest}");
    assert!(
        lines[1].starts_with("BOOT_IMAGE=/boot/vmlinuz-") && lines[1].contains("root=UUID="),
        "{guest}"
    );
    assert_eq!(lines[2], "/dev/vda1", "{guest}");

    // Its disk is the edge's size, larger than the image's: the root partition and file
    // system were grown to fill it at boot.
    let sizes = exec(
        &up,
        &id,
        "sh",
        &[
            "-c",
            "cat /sys/block/vda/size /sys/block/vda/vda1/size; df -k / | tail -1",
        ],
    )
    .await;
    let words: Vec<&str> = sizes.split_whitespace().collect();
    let (disk, part): (u64, u64) = (words[0].parse().unwrap(), words[1].parse().unwrap());
    let fs_kib: u64 = words[3].parse().unwrap();
    assert_eq!(disk * 512, DISK_MB << 20, "{sizes}");
    assert_eq!(part, disk - 2048, "the partition reaches the end of the disk: {sizes}");
    assert!(
        fs_kib > (DISK_MB << 10) * 9 / 10,
        "the root file system fills the partition: {sizes}"
    );

    // Pause and resume through REST: the QEMU ends and a new one continues the guest.
    start_counter(&up, &id).await;
    let first = count(&up, &id).await;
    let t = Instant::now();
    let (s, v) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/pause"), None).await;
    assert_eq!(s, 200, "{v}");
    wait_state(&up, &id, "paused", Duration::from_secs(60)).await;
    figure("full VM pause (REST) to paused", ms(t.elapsed()));
    assert!(qemu_cmdline(&id).is_none(), "no QEMU while paused");
    let t = Instant::now();
    let (s, v) = up.send(Method::POST, &format!("/v1/sandboxes/{id}/resume"), None).await;
    assert_eq!(s, 200, "{v}");
    wait_state(&up, &id, "running", Duration::from_secs(60)).await;
    figure("full VM resume (REST) to running", ms(t.elapsed()));
    assert_eq!(count(&up, &id).await, first + 1, "the guest's memory came back");
    figure("full VM resume (REST) to the counter's answer", ms(t.elapsed()));

    // Killing it ends its QEMU.
    let (s, _) = up.send(Method::DELETE, &format!("/v1/sandboxes/{id}"), None).await;
    assert_eq!(s, 200);
    let deadline = Instant::now() + Duration::from_secs(30);
    while qemu_cmdline(&id).is_some() {
        assert!(Instant::now() < deadline, "the QEMU of a killed sandbox still runs");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
