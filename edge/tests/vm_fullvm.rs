//! Specification tests of full VMs (`-M q35`) against the real thing: the `base` image
//! made into a whole disk (MBR, ext4 partition, extlinux, Debian's kernel, our
//! initramfs), QEMU's q35 PC with SeaBIOS booting it from a qcow2 overlay, TCG where KVM
//! is not usable, the static agent in the guest behind a tap in the VM's own network
//! namespace. They need root, the packages of `VM_PACKAGES` in ops/lib.sh (qemu-system-x86,
//! qemu-utils, seabios, extlinux, syslinux-common, e2fsprogs, iproute2, apt), the `base`
//! image in the store and the static agent (`edge/agent/build-static.sh`). Figures are
//! printed as `figure: <name> = <value>` (`--nocapture`).
//!
//! Run: `cargo test -p opendsec-edge --test vm_fullvm -- --test-threads=1 --nocapture`

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use opendsec_edge::images::{Image, ImageStore};

mod support;
use opendsec_edge::vm::{ExecOutput, Machine, MicroVmDriver, RamMode, VmConfig, VmError, VmHandle, VmSpec, VmStatus};
use support::{Cleanup, base_image, exec_as, figure, ms, require_root, rt, static_agent, store_dir, vm_spec};

/// The driver's state for these tests (its own, beside the microVM tests').
const TEST_ROOT: &str = "/var/tmp/opendsec-fullvm-tests";

fn driver() -> MicroVmDriver {
    static DRIVER: OnceLock<MicroVmDriver> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            require_root("full VM");
            assert!(
                opendsec_edge::vm::host_can_build_boot_disks(),
                "extlinux, syslinux's mbr.bin or qemu-img is missing: run ./ops/test.sh (VM_PACKAGES)"
            );
            let store = ImageStore::open(store_dir()).expect("open the image store");
            let mut cfg = VmConfig::new(
                TEST_ROOT,
                store.clone(),
                static_agent(),
                PathBuf::from(env!("CARGO_BIN_EXE_opendsec-vm-shim")),
            );
            // One accelerator verdict per machine, as edges keep it.
            cfg.accel_cache = Some(store.root().join("accel.json"));
            let t = Instant::now();
            let d = MicroVmDriver::new(cfg, &|m| eprintln!("[vm] {m}")).expect("the VM driver");
            eprintln!(
                "driver ready in {} ms: kernel {}, accelerator {} ({})",
                t.elapsed().as_millis(),
                d.guest_boot().kernel.release,
                d.accel().accel.as_str(),
                d.accel().reason,
            );
            d
        })
        .clone()
}

fn unique(tag: &str) -> String {
    format!("f{}-{tag}", std::process::id())
}

const TOKEN: &str = "fullvm-test-token";

fn spec(id: &str) -> VmSpec {
    vm_spec(
        id,
        TOKEN,
        512,
        BTreeMap::from([("GREETING".to_string(), "hello from the host".to_string())]),
    )
}

fn exec_with(vm: &VmHandle, token: &str, cmd: &str, args: &[&str]) -> ExecOutput {
    exec_as(vm, token, cmd, args)
}

fn exec(vm: &VmHandle, cmd: &str, args: &[&str]) -> ExecOutput {
    exec_with(vm, TOKEN, cmd, args)
}

fn sh(vm: &VmHandle, script: &str) -> String {
    let out = exec(vm, "sh", &["-c", script]);
    assert_eq!(out.exit_code, 0, "{script}: {out:?}");
    out.stdout_text()
}

fn start_counter(vm: &VmHandle) {
    support::start_counter(vm, TOKEN, Duration::from_secs(60))
}

fn count_with(vm: &VmHandle, token: &str) -> u64 {
    support::count_as(vm, token)
}

fn count(vm: &VmHandle) -> u64 {
    count_with(vm, TOKEN)
}

/// The backing file a qcow2 image names in its header (none: `None`).
fn qcow2_backing_file(path: &Path) -> Option<String> {
    let mut header = vec![0u8; 4096];
    let mut f = std::fs::File::open(path).unwrap();
    let n = f.read(&mut header).unwrap();
    header.truncate(n);
    assert_eq!(&header[..4], b"QFI\xfb", "{} is not qcow2", path.display());
    let offset = u64::from_be_bytes(header[8..16].try_into().unwrap()) as usize;
    let size = u32::from_be_bytes(header[16..20].try_into().unwrap()) as usize;
    (offset != 0).then(|| String::from_utf8_lossy(&header[offset..offset + size]).into_owned())
}

#[test]
fn a_full_vm_boots_base_through_seabios_and_extlinux_runs_python_and_keeps_its_memory() {
    let image = base_image();
    driver(); // prepared first, so that the figure below is the disk's alone
    // The image's boot disk: built once per image and recipe, then found in the store.
    let t = Instant::now();
    let disk = driver()
        .boot_disk(&image, &|m| eprintln!("[boot disk] {m}"))
        .expect("the boot disk of base");
    figure(
        "boot disk of base: ensure (built now, or found in the store)",
        format!("{} (a build took {} ms)", ms(t.elapsed()), disk.build_ms),
    );
    let t = Instant::now();
    let again = driver().boot_disk(&image, &|_| {}).unwrap();
    assert_eq!(again, disk, "a second call finds the same disk");
    assert!(t.elapsed() < Duration::from_secs(2), "no rebuild: {:?}", t.elapsed());
    assert_eq!(disk.layers, image.layers);
    assert!(disk.cmdline.contains(&format!("root=UUID={}", disk.root_uuid)));
    assert_eq!(qcow2_backing_file(&disk.disk), None, "the base stands alone");
    // A changed image (here: `base` whose layers became busybox's) is another disk,
    // built beside the first; the first stays as it is (overlays name it).
    let busybox = ImageStore::open(store_dir())
        .unwrap()
        .ensure("busybox", &|_| {})
        .expect("the busybox image");
    let changed = Image {
        layers: busybox.layers.clone(),
        ..image.clone()
    };
    let rebuilt = driver().boot_disk(&changed, &|_| {}).unwrap();
    assert_ne!(rebuilt.key, disk.key);
    assert_ne!(rebuilt.disk, disk.disk);
    assert_eq!(
        rebuilt.layers, busybox.layers,
        "its manifest records what it is made of"
    );
    assert!(disk.disk.is_file());
    for stale in [&rebuilt.disk, &rebuilt.disk.with_extension("json")] {
        std::fs::remove_file(stale).unwrap();
    }
    figure(
        "boot disk of base: qcow2 data / virtual size",
        format!(
            "{} / {} MiB",
            std::fs::metadata(&disk.disk).unwrap().len() >> 20,
            disk.virtual_bytes >> 20
        ),
    );

    let id = unique("boot");
    let t = Instant::now();
    let vm = driver()
        .create_machine(&spec(&id), Machine::Q35, &|m| eprintln!("[{id}] {m}"))
        .unwrap_or_else(|e| panic!("creating {id}: {e}"));
    let _cleanup = Cleanup(vec![vm.clone()]);
    let ready = vm
        .wait_agent(Duration::from_secs(240))
        .unwrap_or_else(|e| panic!("the agent of {id}: {e}"));
    let out = exec(&vm, "python3", &["-c", "print(6*7)"]);
    let first = t.elapsed();
    assert_eq!(out.stdout_text(), "42\n", "{out:?}");
    assert_eq!(out.exit_code, 0);
    figure("full VM: cold boot to agent ready", ms(ready));
    figure(
        "full VM: cold boot to first command (python3 -c 'print(6*7)')",
        ms(first),
    );
    figure("accelerator", driver().accel().accel.as_str());
    assert_eq!(vm.machine().unwrap(), Machine::Q35);

    // Its disk is an overlay of the image's boot disk, not a copy.
    let files = vm.files().unwrap();
    assert_eq!(files.root_disk, disk.disk);
    assert_eq!(
        qcow2_backing_file(&files.rw_disk).as_deref(),
        Some(&*disk.disk.to_string_lossy())
    );
    assert!(
        std::fs::metadata(&files.rw_disk).unwrap().len() < 64 << 20,
        "the overlay holds only what the VM wrote"
    );

    // It booted like a PC: SeaBIOS ran the MBR, extlinux loaded the kernel and initramfs
    // from the partition and passed its command line.
    let console = vm.console_tail(1 << 20);
    assert!(
        console.starts_with("SYSLINUX 6."),
        "the console begins with extlinux's banner (on its serial port): {console}"
    );
    let booted = console
        .split(" | ")
        .find(|l| l.contains("opendsec-init: q35, booted with:"))
        .unwrap_or_else(|| panic!("init's line is missing: {console}"));
    let release = driver().guest_boot().kernel.release.clone();
    assert!(
        booted.contains(&format!("BOOT_IMAGE=/boot/vmlinuz-{release}")),
        "extlinux names the kernel it loaded: {booted}"
    );
    assert!(booted.contains(&disk.cmdline), "{booted}");
    eprintln!("console: {booted}");
    let guest = sh(
        &vm,
        "cat /sys/class/dmi/id/bios_vendor /sys/class/dmi/id/product_name; \
         awk '$2 == \"/\" {print $1, $3}' /proc/mounts; cat /proc/cmdline; \
         echo \"$GREETING\"; id -un; uname -r",
    );
    let lines: Vec<&str> = guest.lines().collect();
    assert_eq!(lines[0], "SeaBIOS", "{guest}");
    assert!(lines[1].contains("Q35"), "{guest}");
    assert_eq!(lines[2], "/dev/vda1 ext4", "the root is the disk's partition: {guest}");
    assert!(lines[3].starts_with("BOOT_IMAGE="), "{guest}");
    assert_eq!(&lines[4..], ["hello from the host", "user", release.as_str()]);
    let refused = rt().block_on(vm.agent().unwrap().exec("wrong-token", "true", &[]));
    assert!(
        matches!(&refused, Err(VmError::Agent(m)) if m.contains("401")),
        "{refused:?}"
    );

    // QEMU runs as the VM's own uid, in a network namespace of its own, sandboxed.
    let VmStatus::Running { pid } = vm.status().unwrap() else {
        panic!("not running")
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid = vm.uid().unwrap();
    assert_ne!(uid, 0);
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert!(
        uid_line.split_whitespace().skip(1).all(|u| u == uid.to_string()),
        "{uid_line}"
    );
    assert!(
        status.lines().any(|l| l.starts_with("Seccomp:") && l.ends_with('2')),
        "-sandbox on filters QEMU's syscalls: {status}"
    );
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap(),
        std::fs::read_link("/proc/self/ns/net").unwrap()
    );
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
    assert!(cmdline.contains("-M q35,memory-backend=ram0"), "{cmdline}");
    assert!(cmdline.contains("share=on"), "guest RAM is a shared file: {cmdline}");

    // Memory (a counter in a guest process) and disk survive pause and resume.
    sh(&vm, "echo kept > /home/user/on-disk && sync");
    start_counter(&vm);
    assert_eq!(count(&vm), 2);
    let pause = vm.pause().unwrap();
    assert_eq!(vm.status().unwrap(), VmStatus::Paused);
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "QEMU is gone while paused"
    );
    figure("full VM pause: snapshot (stop + device state)", ms(pause.snapshot));
    figure("full VM pause: QEMU exit", ms(pause.exit));
    figure(
        "full VM pause: device state stream",
        format!("{} KiB", pause.state_bytes / 1024),
    );
    let t = Instant::now();
    let resume = vm.resume().unwrap();
    assert_eq!(count(&vm), 3, "the guest's memory came back");
    figure("full VM resume: QEMU spawn", ms(resume.spawn));
    figure("full VM resume: restore", ms(resume.restore));
    figure("full VM resume: to the first command's answer", ms(t.elapsed()));
    assert_eq!(sh(&vm, "cat /home/user/on-disk"), "kept\n");
}

#[test]
fn a_full_vm_forks_and_restores_from_a_snapshot_with_memory_and_disk() {
    let id = unique("src");
    let t = Instant::now();
    let source = driver()
        .create_machine(&spec(&id), Machine::Q35, &|m| eprintln!("[{id}] {m}"))
        .unwrap_or_else(|e| panic!("creating {id}: {e}"));
    let mut cleanup = Cleanup(vec![source.clone()]);
    source.wait_agent(Duration::from_secs(240)).unwrap();
    figure("full VM: cold boot to agent ready (second VM)", ms(t.elapsed()));
    sh(&source, "echo before > /home/user/mark && sync");
    start_counter(&source);
    assert_eq!(count(&source), 2);

    // Fork: the copy continues from the source's memory and disk, then they diverge.
    let copy_id = unique("copy");
    let report = source.fork(std::slice::from_ref(&copy_id)).unwrap();
    let copy = report.copies[0].clone();
    cleanup.0.push(copy.clone());
    figure("full VM fork x1: source paused", ms(report.source_paused));
    figure("full VM fork x1: call (copy restored)", ms(report.total));
    assert_eq!(copy.machine().unwrap(), Machine::Q35);
    assert!(matches!(copy.ram_mode().unwrap(), RamMode::Private { .. }));
    copy.wait_agent(Duration::from_secs(60)).unwrap();
    assert_eq!(count(&copy), 3, "the copy has the source's memory");
    assert_eq!(count(&copy), 4);
    assert_eq!(count(&source), 3, "the source runs on with its own");
    sh(&source, "echo after > /home/user/mark && sync");
    assert_eq!(sh(&copy, "cat /home/user/mark"), "before\n", "disks diverge too");
    let copy_disk = copy.files().unwrap().rw_disk;
    assert_eq!(
        qcow2_backing_file(&copy_disk),
        qcow2_backing_file(&source.files().unwrap().rw_disk),
        "the copy's disk is an overlay of the same boot disk"
    );

    // A snapshot of the running source, restored as a new VM.
    let snap = Path::new(TEST_ROOT).join(format!("snap-{id}"));
    let _ = std::fs::remove_dir_all(&snap);
    let taken = source.snapshot_to(&snap).unwrap();
    figure("full VM snapshot_to: source paused", ms(taken.source_paused));
    assert_eq!(count(&source), 4, "the source continued from 3");
    let restored_id = unique("restored");
    let mut restored_spec = spec(&restored_id);
    restored_spec.access_token = "restored-token".into();
    let (restored, report) = driver().restore_snapshot(&restored_spec, &snap, &|_| {}).unwrap();
    cleanup.0.push(restored.clone());
    let _ = std::fs::remove_dir_all(&snap);
    figure("full VM restore_snapshot: restore", ms(report.restore));
    assert_eq!(restored.machine().unwrap(), Machine::Q35);
    // The restored guest still holds its source's token (the edge re-keys it).
    assert_eq!(count_with(&restored, TOKEN), 4, "the snapshot's memory (3)");
    assert_eq!(
        exec_with(&restored, TOKEN, "cat", &["/home/user/mark"]).stdout_text(),
        "after\n"
    );
}
