//! Specification tests of the QEMU microVM driver against the real thing: QEMU
//! (`-M microvm`, TCG where KVM is not usable), Debian's kernel, our initramfs, the
//! `base` image as an EROFS disk, the static agent in the guest, taps in network
//! namespaces. They need root, the packages qemu-system-x86, erofs-utils, e2fsprogs,
//! iproute2, apt (the kernel is fetched once per machine with `apt-get download`), the
//! `base` image in the store (`opendsec-image build base`) and the static agent
//! (`edge/agent/build-static.sh`). Each figure they measure is printed as
//! `figure: <name> = <value>`; run with `--nocapture` to see them.
//!
//! Run: `cargo test -p opendsec-edge --test vm_microvm -- --test-threads=1 --nocapture`

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use opendsec_edge::images::ImageStore;

mod support;
use opendsec_edge::vm::{
    ExecOutput, MicroVmDriver, RamMode, VmConfig, VmError, VmHandle, VmSpec, VmStatus, detect_accel,
};
use support::{
    Cleanup, exec_as, exit_info, figure, ms, not_run_needs_hardware_kvm, require_root, rt, static_agent, store_dir,
    vm_spec,
};

/// The driver's state for these tests: one directory per machine, so the accelerator
/// verdict is probed once per host boot; every test removes the VMs it made.
const TEST_ROOT: &str = "/var/tmp/opendsec-vm-tests";

fn config() -> VmConfig {
    require_root("microVM");
    let store = ImageStore::open(store_dir()).expect("open the image store");
    VmConfig::new(
        TEST_ROOT,
        store,
        static_agent(),
        PathBuf::from(env!("CARGO_BIN_EXE_opendsec-vm-shim")),
    )
}

fn driver() -> MicroVmDriver {
    static DRIVER: OnceLock<MicroVmDriver> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let t = Instant::now();
            let d = MicroVmDriver::new(config(), &|m| eprintln!("[vm] {m}")).expect("the microVM driver");
            eprintln!(
                "driver ready in {} ms: kernel {}, accelerator {} ({}), tsc {:?}",
                t.elapsed().as_millis(),
                d.guest_boot().kernel.release,
                d.accel().accel.as_str(),
                d.accel().reason,
                d.tsc_khz()
            );
            d
        })
        .clone()
}

fn unique(tag: &str) -> String {
    format!("t{}-{tag}", std::process::id())
}

const TOKEN: &str = "vm-test-token";

fn spec(id: &str) -> VmSpec {
    vm_spec(
        id,
        TOKEN,
        512,
        BTreeMap::from([("GREETING".to_string(), "hello from the host".to_string())]),
    )
}

fn exec(vm: &VmHandle, cmd: &str, args: &[&str]) -> ExecOutput {
    exec_as(vm, TOKEN, cmd, args)
}

fn boot(id: &str) -> (VmHandle, Duration) {
    let t = Instant::now();
    let vm = driver()
        .create(&spec(id), &|m| eprintln!("[{id}] {m}"))
        .unwrap_or_else(|e| panic!("creating {id}: {e}"));
    vm.wait_agent(Duration::from_secs(180))
        .unwrap_or_else(|e| panic!("the agent of {id}: {e}"));
    (vm, t.elapsed())
}

fn start_counter(vm: &VmHandle) {
    support::start_counter(vm, TOKEN, Duration::from_secs(60))
}

fn count(vm: &VmHandle) -> u64 {
    support::count_as(vm, TOKEN)
}

/// A guest process that keeps rewriting 16 MiB of its memory, one page after another,
/// each pass stamping every page with the pass number, and that checks each page before
/// stamping it: page i must hold the previous pass's number. A copy of its memory taken
/// while it runs is consistent only if every page written before the copy's instant is
/// in it; a page missed by a live copy shows up as an older number and stops the
/// process with a report in /tmp/stamps.torn. /tmp/stamps.pass counts finished passes;
/// it ends once /tmp/stop exists.
const STAMPS: &str = r#"
import os, struct, sys
N = 4096
stop = "/tmp/stop"
buf = bytearray(N * 4096)
for i in range(N):
    struct.pack_into("Q", buf, i * 4096, 1)
gen = 1
while not os.path.exists(stop):
    gen += 1
    for i in range(N):
        o = i * 4096
        g = struct.unpack_from("Q", buf, o)[0]
        if g != gen - 1:
            open("/tmp/stamps.torn", "w").write("page %d holds %d, expected %d\n" % (i, g, gen - 1))
            sys.exit(1)
        struct.pack_into("Q", buf, o, gen)
    open("/tmp/stamps.tmp", "w").write(str(gen))
    os.rename("/tmp/stamps.tmp", "/tmp/stamps.pass")
"#;

/// The pass the stamping process has finished, or its report if it found a torn page.
/// Writes and syncs files on the guest's disk until /tmp/stop exists.
const DISK_WRITER: &str = "i=0; while [ ! -e /tmp/stop ]; do echo $i > /home/user/disk-$((i % 8)); \
     sync; i=$((i+1)); done; touch /tmp/disk.stopped";

/// Stops the stamping process and the disk writer, then counts the files holding a number.
const STOP_WRITERS: &str = "touch /tmp/stop; while [ ! -e /tmp/disk.stopped ]; do sleep 0.1; done; \
     cat /home/user/disk-* | grep -c '^[0-9][0-9]*$'";

fn stamps(vm: &VmHandle) -> Result<u64, String> {
    let out = exec(
        vm,
        "sh",
        &[
            "-c",
            "cat /tmp/stamps.torn 2>/dev/null || cat /tmp/stamps.pass 2>/dev/null || echo 0",
        ],
    );
    let text = out.stdout_text();
    text.trim().parse().map_err(|_| text)
}

/// Waits until `vm`'s stamping process has finished `passes` more passes, checking
/// every page each time.
fn stamps_advance(vm: &VmHandle, passes: u64) {
    let start = stamps(vm).unwrap_or_else(|torn| panic!("{}: torn memory: {torn}", vm.id()));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match stamps(vm) {
            Ok(pass) if pass >= start + passes => return,
            Ok(_) => {}
            Err(torn) => panic!("{}: torn memory: {torn}", vm.id()),
        }
        if Instant::now() > deadline {
            let ps = exec(
                vm,
                "sh",
                &["-c", "ps -eo pid,stat,wchan:24,args; cat /tmp/stamps.pass; ls -la /tmp"],
            );
            panic!("{}: the stamping process stalled: {}", vm.id(), ps.stdout_text());
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn pid_alive(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Bytes of `path` resident in the page cache (mincore over a mapping of it).
fn resident_bytes(path: &Path) -> u64 {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(path).unwrap();
    let len = file.metadata().unwrap().len() as usize;
    if len == 0 {
        return 0;
    }
    // SAFETY: a read-only shared mapping of a file we hold open, unmapped below.
    unsafe {
        let addr = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        assert_ne!(addr, libc::MAP_FAILED);
        let pages = len.div_ceil(4096);
        let mut vec = vec![0u8; pages];
        assert_eq!(libc::mincore(addr, len, vec.as_mut_ptr()), 0);
        libc::munmap(addr, len);
        vec.iter().filter(|b| **b & 1 != 0).count() as u64 * 4096
    }
}

#[test]
fn a_microvm_from_base_runs_python_through_the_agent_and_its_end_is_seen() {
    let id = unique("py");
    let t = Instant::now();
    let (vm, ready) = boot(&id);
    let _cleanup = Cleanup(vec![vm.clone()]);
    let out = exec(&vm, "python3", &["-c", "print(6*7)"]);
    let first = t.elapsed();
    assert_eq!(out.stdout_text(), "42\n", "{out:?}");
    assert_eq!(out.exit_code, 0);
    figure("cold boot to agent ready", ms(ready));
    figure("cold boot to first command (python3 -c 'print(6*7)')", ms(first));
    figure("accelerator", driver().accel().accel.as_str());

    // The sandbox's environment reaches processes; the agent wants its token.
    let env = exec(&vm, "sh", &["-c", "echo \"$GREETING\"; id -un; uname -r"]);
    assert_eq!(
        env.stdout_text(),
        format!("hello from the host\nuser\n{}\n", driver().guest_boot().kernel.release)
    );
    let refused = rt().block_on(vm.agent().unwrap().exec("wrong-token", "true", &[]));
    assert!(
        matches!(&refused, Err(VmError::Agent(m)) if m.contains("401")),
        "{refused:?}"
    );

    // QEMU runs under the VM's own uid, in a network namespace of its own.
    let VmStatus::Running { pid } = vm.status().unwrap() else {
        panic!("not running")
    };
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uid_line = status.lines().find(|l| l.starts_with("Uid:")).unwrap().to_string();
    let uid = vm.uid().unwrap();
    assert_ne!(uid, 0);
    assert!(
        uid_line.split_whitespace().skip(1).all(|u| u == uid.to_string()),
        "{uid_line}"
    );
    assert_ne!(
        std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap(),
        std::fs::read_link("/proc/self/ns/net").unwrap(),
        "QEMU must not be in the host's network namespace"
    );
    // The guest routes everything to the tap's host side (169.254.100.1, little-endian
    // 0164FEA9): its /30 and a default route there. The VM's namespace has no link out
    // of its own; the edge's `net` room adds one under the sandbox's policy.
    let routes = exec(&vm, "sh", &["-c", "tail -n +2 /proc/net/route"]).stdout_text();
    let lines: Vec<&str> = routes.lines().collect();
    assert_eq!(lines.len(), 2, "the /30 and a default route: {routes:?}");
    assert!(
        lines
            .iter()
            .any(|l| l.split_whitespace().take(3).collect::<Vec<_>>() == ["eth0", "00000000", "0164FEA9"]),
        "a default route via the tap's host side: {routes:?}"
    );

    // The guest ends itself (an immediate reboot; QEMU runs with -no-reboot): the
    // driver sees the channel gone.
    let exit_fd = vm.exit_fd().unwrap();
    let agent = vm.agent().unwrap();
    let t = Instant::now();
    // The request never gets an answer: the guest is gone before it could send one.
    std::thread::spawn(move || {
        let _ = rt().block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                agent.exec_as(TOKEN, "root", "sh", &["-c", "echo b > /proc/sysrq-trigger"]),
            )
            .await
        });
    });
    let mut pfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&exit_fd),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polling one fd we own.
    let ready = unsafe { libc::poll(&mut pfd, 1, 30_000) };
    assert_eq!(ready, 1, "QEMU did not end after the guest rebooted");
    figure("guest reboot request to QEMU exit seen (exit fd)", ms(t.elapsed()));
    let status = exit_info(&vm, Duration::from_secs(5));
    eprintln!("exit recorded: {status:?}");
    assert!(!pid_alive(pid));
}

#[test]
fn pause_ends_qemu_and_resume_keeps_the_guest_memory() {
    let id = unique("pause");
    let (vm, _) = boot(&id);
    let _cleanup = Cleanup(vec![vm.clone()]);
    start_counter(&vm);
    assert_eq!(count(&vm), 2);
    assert_eq!(count(&vm), 3);
    let VmStatus::Running { pid } = vm.status().unwrap() else {
        panic!("not running")
    };
    let before = vm.memory().unwrap();

    let pause = vm.pause().unwrap();
    assert_eq!(vm.status().unwrap(), VmStatus::Paused);
    assert!(!pid_alive(pid), "the QEMU process is gone while paused");
    let ram = std::path::Path::new(TEST_ROOT).join("vms").join(&id).join("ram");
    let resident = resident_bytes(&ram);
    figure("pause: snapshot (stop + device state)", ms(pause.snapshot));
    figure("pause: QEMU exit", ms(pause.exit));
    figure(
        "pause: RAM file written back and dropped from the page cache",
        ms(pause.release),
    );
    figure(
        "pause: device state stream",
        format!("{} KiB", pause.state_bytes / 1024),
    );
    figure(
        "running VM: QEMU RSS / PSS (of which guest RAM)",
        format!(
            "{} / {} MiB ({} MiB)",
            before.rss_kb / 1024,
            before.pss_kb / 1024,
            before.guest_ram_rss_kb / 1024
        ),
    );
    figure(
        "paused VM: memory held (no process; RAM file resident in page cache)",
        format!(
            "{} MiB (RAM data on disk {} MiB)",
            resident >> 20,
            vm.ram_file_bytes() >> 20
        ),
    );
    assert!(
        resident < 16 << 20,
        "the paused VM's RAM is not released: {resident} bytes resident"
    );

    // Bad requests leave the VM as it is.
    assert!(matches!(vm.pause(), Err(VmError::BadState { .. })));
    assert!(matches!(vm.fork(&[unique("nope")]), Err(VmError::BadState { .. })));

    let t = Instant::now();
    let resume = vm.resume().unwrap();
    let n = count(&vm);
    let first = t.elapsed();
    assert_eq!(n, 4, "the in-memory count continues after resume");
    figure("resume: QEMU spawn to QMP", ms(resume.spawn));
    figure("resume: restore (incoming migration + cont)", ms(resume.restore));
    figure("resume to first command", ms(first));
    assert!(matches!(vm.resume(), Err(VmError::BadState { .. })));

    // A second cycle, and a driver that starts afresh (an edge restart) finds the VM.
    vm.pause().unwrap();
    vm.resume().unwrap();
    let again = MicroVmDriver::new(config(), &|_| {}).unwrap();
    let adopted = again.open(&id).unwrap();
    assert!(matches!(adopted.status().unwrap(), VmStatus::Running { .. }));
    assert_eq!(count(&adopted), 5);
    assert!(matches!(again.open("no-such-vm"), Err(VmError::NotFound(_))));

    // An edge that died between `stop` and `cont` (a pause or fork under way) left the
    // guest stopped: recover continues it; a running VM needs nothing.
    assert_eq!(adopted.recover().unwrap(), None);
    let socket = Path::new(TEST_ROOT).join("vms").join(&id).join("run/qmp.sock");
    let mut qmp = opendsec_edge::vm::Qmp::connect(&socket, Duration::from_secs(10)).unwrap();
    qmp.execute("stop", serde_json::json!({})).unwrap();
    drop(qmp);
    let done = adopted.recover().unwrap();
    assert!(done.as_deref().is_some_and(|d| d.contains("continued")), "{done:?}");
    assert_eq!(count(&adopted), 6);
}

#[test]
fn fork_copies_start_from_the_source_memory_share_pages_and_diverge() {
    let id = unique("src");
    let (source, _) = boot(&id);
    let mut cleanup = Cleanup(vec![source.clone()]);
    start_counter(&source);
    assert_eq!(count(&source), 2);
    let one_vm = source.memory().unwrap();

    // Bad input is refused and harms nothing.
    assert!(matches!(source.fork(&[]), Err(VmError::Invalid(_))));
    let many: Vec<String> = (0..10_000).map(|i| format!("many-{i}")).collect();
    assert!(matches!(source.fork(&many), Err(VmError::Invalid(_))));
    assert!(matches!(
        source.fork(std::slice::from_ref(&id)),
        Err(VmError::Invalid(_))
    ));
    assert!(matches!(
        source.fork(&["bad/id".to_string()]),
        Err(VmError::InvalidId(_))
    ));
    assert_eq!(count(&source), 3);

    // The source is busy while it is copied: one process rewrites its memory page after
    // page, another writes and syncs files on its disk.
    let out = exec(&source, "setsid", &["-f", "python3", "-c", STAMPS]);
    assert_eq!(out.exit_code, 0, "{out:?}");
    stamps_advance(&source, 1);
    let out = exec(&source, "setsid", &["-f", "sh", "-c", DISK_WRITER]);
    assert_eq!(out.exit_code, 0, "{out:?}");
    let deadline = Instant::now() + Duration::from_secs(60);
    while !exec(&source, "ls", &["/home/user"]).stdout_text().contains("disk-7") {
        assert!(Instant::now() < deadline, "the disk writer never wrote");
        std::thread::sleep(Duration::from_millis(200));
    }
    // A value written into the guest's memory just before the fork.
    assert_eq!(count(&source), 4);

    let ids = vec![unique("copy-a"), unique("copy-b")];
    let t = Instant::now();
    let report = source.fork(&ids).unwrap();
    cleanup.0.extend(report.copies.iter().cloned());
    let [a, b] = [&report.copies[0], &report.copies[1]];
    figure("fork x2: source paused", ms(report.source_paused));
    figure("fork x2: call (both copies restored)", ms(report.total));
    figure("fork x2: frozen RAM copied", format!("{} MiB", report.ram_bytes >> 20));
    figure(
        "fork x2: disk written during the copy, copied again while stopped",
        format!("{} KiB", report.disk_dirty_bytes >> 10),
    );
    assert!(matches!(a.ram_mode().unwrap(), RamMode::Private { .. }));
    // The source stops only for what changed during the copy, not for the whole copy.
    assert!(
        report.source_paused < report.total / 4,
        "source paused {:?} of {:?}",
        report.source_paused,
        report.total
    );

    // Every copy starts with the source's memory: the next count is 5 everywhere.
    assert_eq!(count(a), 5);
    assert_eq!(count(b), 5);
    figure("fork x2: until both copies answered", ms(t.elapsed()));
    // Memory written while the source was being copied is whole in every copy (and in
    // the source): each checks every page of the stamped memory again.
    for vm in [a, b, &source] {
        stamps_advance(vm, 2);
    }
    // The disk written during the copy is a working file system in every copy: the
    // writer goes on in each, and each file it wrote holds a whole number.
    for vm in [a, b, &source] {
        let out = exec(vm, "sh", &["-c", STOP_WRITERS]);
        assert_eq!(out.stdout_text().trim(), "8", "{}: {out:?}", vm.id());
    }
    // Then each goes its own way, and the source runs on.
    assert_eq!(count(a), 6);
    assert_eq!(count(a), 7);
    assert_eq!(count(b), 6);
    assert_eq!(count(&source), 5);
    // The copies' disks are their own too.
    exec(a, "sh", &["-c", "echo a > /home/user/who"]);
    exec(b, "sh", &["-c", "echo b > /home/user/who"]);
    assert_eq!(exec(a, "cat", &["/home/user/who"]).stdout_text(), "a\n");
    assert_eq!(exec(b, "cat", &["/home/user/who"]).stdout_text(), "b\n");
    assert_eq!(
        exec(&source, "sh", &["-c", "cat /home/user/who 2>/dev/null || echo none"]).stdout_text(),
        "none\n"
    );

    let mem_a = a.memory().unwrap();
    let mem_b = b.memory().unwrap();
    let copies_pss = mem_a.pss_kb + mem_b.pss_kb;
    let copies_rss = mem_a.rss_kb + mem_b.rss_kb;
    figure(
        "one VM (the source before the fork): RSS / PSS",
        format!("{} / {} MiB", one_vm.rss_kb / 1024, one_vm.pss_kb / 1024),
    );
    figure(
        "fork x2: copies' RSS sum (counts shared pages twice)",
        format!("{} MiB", copies_rss / 1024),
    );
    figure(
        "fork x2: copies' PSS sum (shared pages counted once)",
        format!("{} MiB", copies_pss / 1024),
    );
    figure(
        "fork x2: copies' private memory sum",
        format!("{} MiB", (mem_a.private_kb + mem_b.private_kb) / 1024),
    );
    figure(
        "guest RAM mapping: one VM RSS vs copies' PSS sum",
        format!(
            "{} vs {} MiB",
            one_vm.guest_ram_rss_kb / 1024,
            (mem_a.guest_ram_pss_kb + mem_b.guest_ram_pss_kb) / 1024
        ),
    );
    assert!(
        copies_pss < 2 * one_vm.rss_kb * 3 / 4,
        "two copies should cost well below two VMs: PSS {copies_pss} KiB vs one VM {} KiB",
        one_vm.rss_kb
    );

    // A copy pauses (its RAM goes into the stream), resumes into a file of its own and
    // keeps its count; deleting the copies frees the fork's frozen RAM.
    let pause = a.pause().unwrap();
    figure(
        "fork copy: pause with its RAM in the stream",
        format!("{} ({} MiB)", ms(pause.snapshot), pause.state_bytes >> 20),
    );
    a.resume().unwrap();
    assert_eq!(a.ram_mode().unwrap(), RamMode::Shared);
    assert_eq!(count(a), 8);
    let forks = Path::new(TEST_ROOT).join("forks");
    let fork_dirs = |prefix: &str| {
        std::fs::read_dir(&forks)
            .unwrap()
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
            .count()
    };
    assert_eq!(fork_dirs(&id), 1, "b still maps the frozen RAM");

    // A copy forks too, live from its private pages: it keeps mapping its base.
    assert!(matches!(b.ram_mode().unwrap(), RamMode::Private { .. }));
    let grandchild = b.fork(&[unique("copy-b1")]).unwrap();
    cleanup.0.extend(grandchild.copies.iter().cloned());
    figure("fork of a fork copy: source paused", ms(grandchild.source_paused));
    assert!(matches!(b.ram_mode().unwrap(), RamMode::Private { .. }));
    assert_eq!(count(&grandchild.copies[0]), 7);
    assert_eq!(count(b), 7);
    b.delete().unwrap();
    assert_eq!(fork_dirs(&id), 0, "nobody maps the frozen RAM any more");
    assert_eq!(count(&source), 6);
}

#[test]
fn kvm_detection_reports_its_verdict_and_reason() {
    require_root("microVM");
    let d = driver();
    let qemu = ["/usr/bin/qemu-system-x86_64", "/usr/local/bin/qemu-system-x86_64"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .expect("qemu-system-x86_64 (apt-get install qemu-system-x86)");
    let t = Instant::now();
    let verdict = detect_accel(&qemu, d.guest_boot(), Duration::from_secs(8)).unwrap();
    eprintln!(
        "KVM verdict after {}: {} ({})",
        ms(t.elapsed()),
        verdict.accel.as_str(),
        verdict.reason
    );
    figure(
        "accelerator verdict",
        format!("{} - {}", verdict.accel.as_str(), verdict.reason),
    );
    if Path::new("/sys/module/kvm_pvm").exists() {
        assert!(!verdict.kvm_usable(), "PVM cannot run our stock kernel: {verdict:?}");
        assert!(verdict.reason.contains("PVM"), "{verdict:?}");
    }
    if verdict.kvm_usable() {
        assert!(verdict.probe_ms.is_some_and(|ms| ms < 8000), "{verdict:?}");
    } else {
        assert!(verdict.reason.starts_with("KVM not usable"), "{verdict:?}");
        not_run_needs_hardware_kvm("vm_microvm: the KVM probe boots a guest within 8 s", &verdict.reason);
    }
}

#[test]
fn a_root_disk_holds_the_merged_layers_of_an_image() {
    require_root("microVM");
    let tmp = tempfile::Builder::new()
        .prefix("opendsec-vmdisk")
        .tempdir_in("/var/tmp")
        .unwrap();
    let store = ImageStore::open(tmp.path()).unwrap();
    let lower = store.layer_path("lower-1");
    let upper = store.layer_path("upper-1");
    for (dir, files) in [(&lower, vec!["a", "b", "dir/x"]), (&upper, vec!["c", "dir/y"])] {
        for f in files {
            let p = dir.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, f).unwrap();
        }
    }
    // A whiteout: the upper layer deletes `b`.
    nix::sys::stat::mknod(
        &upper.join("b"),
        nix::sys::stat::SFlag::S_IFCHR,
        nix::sys::stat::Mode::from_bits_truncate(0o600),
        0,
    )
    .unwrap();
    let image = opendsec_edge::images::Image {
        name: "two-layers".into(),
        layers: vec!["lower-1".into(), "upper-1".into()],
        ..Default::default()
    };
    store.put(&image).unwrap();
    let disk = opendsec_edge::vm::build_root_disk(&store, &image, &|m| eprintln!("{m}")).unwrap();
    assert_eq!(
        opendsec_edge::vm::build_root_disk(&store, &image, &|_| panic!("built twice")).unwrap(),
        disk,
        "cached by its layers"
    );
    // Read it back on the host, in a mount namespace of its own.
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let out = std::process::Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount -t erofs -o loop,ro {} {} && cd {} && find . -type f | sort | xargs -n1 sh -c 'echo \"$0=$(cat $0)\"'",
            disk.display(),
            mnt.display(),
            mnt.display()
        ))
        .output()
        .unwrap();
    let listing = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{listing} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(listing, "./a=a\n./c=c\n./dir/x=dir/x\n./dir/y=dir/y\n");
}

#[test]
fn a_snapshot_restores_into_a_new_vm_that_continues_and_a_corrupt_one_leaves_nothing() {
    let id = unique("snap-src");
    let (vm, _) = boot(&id);
    let mut cleanup = Cleanup(vec![vm.clone()]);
    start_counter(&vm);
    assert_eq!(count(&vm), 2);
    let dir = tempfile::Builder::new()
        .prefix("opendsec-vmsnap")
        .tempdir_in("/var/tmp")
        .unwrap();

    // A running VM stops only while its state, RAM and disk are copied.
    let snap = dir.path().join("running");
    let report = vm.snapshot_to(&snap).unwrap();
    figure("snapshot of a running VM: source paused", ms(report.source_paused));
    figure("snapshot of a running VM: data", format!("{} MiB", report.bytes >> 20));
    assert_eq!(count(&vm), 3, "the source runs on");
    assert!(
        vm.snapshot_to(&snap).is_err(),
        "an existing directory is not overwritten"
    );

    // A VM restored from it continues from the snapshot's memory, holding the source's
    // token until it is re-keyed.
    let copy_id = unique("snap-copy");
    let mut copy_spec = spec(&copy_id);
    copy_spec.access_token = "copy-token".into();
    let t = Instant::now();
    let (copy, resumed) = driver().restore_snapshot(&copy_spec, &snap, &|_| {}).unwrap();
    cleanup.0.push(copy.clone());
    figure("restore from a snapshot: restore", ms(resumed.restore));
    let agent = copy.agent().unwrap();
    copy.wait_agent(Duration::from_secs(60)).unwrap();
    let ttl = Duration::from_secs(10);
    // Each re-key carries bytes the guest reseeds its kernel's generator from.
    let seed = [0x5a_u8; 64];
    assert_eq!(agent.rekey("copy-token", "copy-token", &seed, ttl).unwrap(), 401);
    assert_eq!(agent.rekey(TOKEN, "copy-token", &seed, ttl).unwrap(), 204);
    assert_eq!(
        agent.rekey("copy-token", "copy-token", &seed, ttl).unwrap(),
        204,
        "repeatable"
    );
    assert_eq!(
        agent.rekey("copy-token", "copy-token", &[], ttl).unwrap(),
        400,
        "a re-key without entropy bytes is refused"
    );
    let counted = rt()
        .block_on(agent.exec(
            "copy-token",
            "bash",
            &["-c", "exec 3<>/dev/tcp/127.0.0.1/7777 && cat <&3"],
        ))
        .unwrap();
    assert_eq!(counted.stdout_text(), "3\n", "the copy continues from the snapshot");
    figure("restore from a snapshot to first command", ms(t.elapsed()));
    let refused = rt().block_on(agent.exec(TOKEN, "true", &[]));
    assert!(
        matches!(&refused, Err(VmError::Agent(m)) if m.contains("401")),
        "the source's token no longer opens the copy: {refused:?}"
    );

    // Restores map the snapshot's RAM privately: a second one shares its pages with
    // the first, starts from the snapshot too, and neither writes the snapshot.
    let snapshot_ram = std::fs::read(snap.join("ram")).unwrap();
    let second_id = unique("snap-copy2");
    let (second, _) = driver().restore_snapshot(&spec(&second_id), &snap, &|_| {}).unwrap();
    cleanup.0.push(second.clone());
    let (RamMode::Private { base: base_1 }, RamMode::Private { base: base_2 }) =
        (copy.ram_mode().unwrap(), second.ram_mode().unwrap())
    else {
        panic!("restores map the snapshot's RAM privately")
    };
    assert_eq!(base_1, base_2, "one base for every restore of a snapshot");
    assert_eq!(count(&second), 3, "the second restore starts from the snapshot");
    assert_eq!(count(&second), 4);
    assert_eq!(copy.ram_file_bytes(), 0, "no copy of the snapshot's RAM");
    assert!(
        std::fs::read(snap.join("ram")).unwrap() == snapshot_ram,
        "the snapshot's RAM is never written"
    );
    let memory = second.memory().unwrap();
    figure(
        "second restore of a snapshot: guest RAM RSS / PSS",
        format!(
            "{} / {} MiB",
            memory.guest_ram_rss_kb / 1024,
            memory.guest_ram_pss_kb / 1024
        ),
    );
    assert!(
        memory.guest_ram_pss_kb < memory.guest_ram_rss_kb,
        "pages shared with the first restore count by their share: {memory:?}"
    );

    // A paused VM is copied as it lies; the source resumes unharmed.
    vm.pause().unwrap();
    let paused = dir.path().join("paused");
    let report = vm.snapshot_to(&paused).unwrap();
    assert_eq!(report.source_paused, Duration::ZERO);
    vm.resume().unwrap();
    assert_eq!(count(&vm), 4);

    // A corrupt snapshot is refused and leaves no VM behind; its source is unharmed.
    std::fs::write(paused.join("state"), b"not a migration stream").unwrap();
    let bad = unique("snap-bad");
    let err = driver().restore_snapshot(&spec(&bad), &paused, &|_| {}).unwrap_err();
    eprintln!("restoring a corrupt snapshot: {err}");
    assert!(matches!(driver().open(&bad), Err(VmError::NotFound(_))));
    assert!(!Path::new(TEST_ROOT).join("vms").join(&bad).exists());
    let paused_base = {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(paused.join("ram")).unwrap();
        Path::new(TEST_ROOT)
            .join("forks")
            .join(format!("snap-{}-{}", m.dev(), m.ino()))
    };
    assert!(!paused_base.exists(), "no RAM base left behind");
    std::fs::remove_file(paused.join("snapshot.json")).unwrap();
    assert!(driver().restore_snapshot(&spec(&bad), &paused, &|_| {}).is_err());
    assert_eq!(count(&vm), 5);
}

/// CPU time (user + system, all threads) of process `pid`, from `/proc/<pid>/stat`.
fn process_cpu(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<u64> = rest.split(' ').skip(11).take(2).map(|f| f.parse().unwrap()).collect();
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_micros((fields[0] + fields[1]) * 1_000_000 / hz)
}

/// The cgroup paths of process `pid` (`/proc/<pid>/cgroup`): controller list -> path.
fn process_cgroups(pid: i32) -> BTreeMap<String, String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut f = l.splitn(3, ':');
            let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
            Some((controllers.to_string(), path.to_string()))
        })
        .collect()
}

/// The path of the cgroup that holds controller `name` for process `pid` (v1: the
/// hierarchy that lists it; v2: the unified one).
fn cgroup_of(pid: i32, name: &str) -> String {
    let all = process_cgroups(pid);
    all.iter()
        .find(|(c, _)| c.split(',').any(|c| c == name))
        .or_else(|| all.iter().find(|(c, _)| c.is_empty()))
        .map(|(_, p)| p.clone())
        .unwrap_or_else(|| panic!("no {name} cgroup for {pid}: {all:?}"))
}

/// The memory limit of the cgroup at `path`, read from the kernel's file.
fn memory_limit_file(path: &str) -> u64 {
    let v1 = Path::new("/sys/fs/cgroup/memory").join(path.trim_start_matches('/'));
    let v2 = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let text = std::fs::read_to_string(v1.join("memory.limit_in_bytes"))
        .or_else(|_| std::fs::read_to_string(v2.join("memory.max")))
        .unwrap_or_else(|e| panic!("no memory limit for {path}: {e}"));
    text.trim().parse().unwrap()
}

fn running(vm: &VmHandle) -> i32 {
    match vm.status().unwrap() {
        VmStatus::Running { pid } => pid,
        other => panic!("{} is {other:?}; console: {}", vm.id(), vm.console_tail(1500)),
    }
}

/// Every directory of `vm`'s cgroup is gone.
fn assert_no_cgroup(vm_cgroup: &opendsec_edge::cgroups::Cgroup, what: &str) {
    for dir in vm_cgroup.dirs() {
        assert!(!dir.exists(), "{what}: cgroup {} is left", dir.display());
    }
}

#[test]
fn a_microvm_is_held_to_its_cpu_millis_in_a_cgroup_of_its_own_which_forks_get_too_and_which_goes_with_it() {
    let id = unique("cg");
    let mut vm_spec = spec(&id);
    vm_spec.cpu_millis = Some(100);
    let t = Instant::now();
    let vm = driver().create(&vm_spec, &|_| {}).unwrap();
    let mut cleanup = Cleanup(vec![vm.clone()]);
    let cgroup = vm.cgroup();
    // Until the agent answers the boot runs boosted: the VM's vCPU plus one core.
    assert_eq!(cgroup.cpu_quota(), Some((Some(200_000), 100_000)));
    vm.wait_agent(Duration::from_secs(180)).unwrap();
    figure(
        "cold boot to agent ready at cpu_millis=100 (boot boosted)",
        ms(t.elapsed()),
    );

    // Its QEMU is in its own cgroup, in every hierarchy, with its limits read back.
    let pid = running(&vm);
    let path = cgroup.path();
    assert!(path.ends_with(&format!("/{id}")), "{path}");
    for controller in ["cpu", "memory"] {
        assert_eq!(cgroup_of(pid, controller), path, "{controller}");
    }
    assert_eq!(cgroup.procs(), vec![pid], "QEMU alone is in it");
    assert_eq!(
        cgroup.cpu_quota(),
        Some((Some(10_000), 100_000)),
        "a tenth of each 100 ms"
    );
    let limit = vm.memory_limit().unwrap();
    assert_eq!(memory_limit_file(&cgroup_of(pid, "memory")), limit);
    assert_eq!(
        limit,
        opendsec_edge::vm::vmm_memory_limit(256, opendsec_edge::vm::Vmm::Qemu, driver().accel().accel)
    );
    assert!(limit > 256 << 20, "the limit covers the guest's RAM and more: {limit}");
    // The IO weight, where the host has a weight file (here BFQ's, v1).
    let weight = cgroup.io_weight();
    assert!(matches!(weight, None | Some(100)), "{weight:?}");
    figure("VMM cgroup IO weight", format!("{weight:?}"));
    figure(
        "VMM cgroup memory limit (256 MiB guest)",
        format!("{} MiB", limit >> 20),
    );
    let memory = vm.memory().unwrap();
    figure(
        "QEMU overhead after boot: RSS minus guest RAM resident",
        format!("{} MiB", (memory.rss_kb - memory.guest_ram_rss_kb) / 1024),
    );

    // A fork's copy gets a cgroup of its own, with its source's quota.
    let copy_id = unique("cg-copy");
    let t = Instant::now();
    let report = vm.fork(std::slice::from_ref(&copy_id)).unwrap();
    cleanup.0.extend(report.copies.iter().cloned());
    let copy = report.copies[0].clone();
    copy.wait_agent(Duration::from_secs(60)).unwrap();
    figure("fork of a 100-millicore VM to the copy's agent ready", ms(t.elapsed()));
    let copy_pid = running(&copy);
    let copy_cgroup = copy.cgroup();
    assert_ne!(copy_cgroup.path(), path);
    assert_eq!(cgroup_of(copy_pid, "memory"), copy_cgroup.path());
    assert_eq!(copy_cgroup.procs(), vec![copy_pid]);
    assert_eq!(copy_cgroup.cpu_quota(), Some((Some(10_000), 100_000)));
    assert_eq!(
        cgroup.cpu_quota(),
        Some((Some(10_000), 100_000)),
        "the source is settled again"
    );
    assert_eq!(cgroup.procs(), vec![pid]);

    // A busy guest is held to a tenth of a core: QEMU's CPU time over 5 s. (The loop is
    // started with the quota lifted: one exec at a tenth of a core under TCG takes ~7 s.)
    vm.set_cpu_millis(None).unwrap();
    let out = exec(&vm, "setsid", &["-f", "sh", "-c", "while :; do :; done"]);
    assert_eq!(out.exit_code, 0, "{out:?}");
    vm.set_cpu_millis(Some(100)).unwrap();
    assert_eq!(cgroup.cpu_quota(), Some((Some(10_000), 100_000)));
    std::thread::sleep(Duration::from_secs(1));
    let (cpu0, usage0, throttled0) = (
        process_cpu(pid),
        cgroup.cpu_usage_usec().unwrap(),
        cgroup.cpu_throttled_periods().unwrap(),
    );
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_secs(5));
    let wall = t0.elapsed().as_secs_f64();
    let share = (process_cpu(pid) - cpu0).as_secs_f64() / wall;
    let cgroup_share = (cgroup.cpu_usage_usec().unwrap() - usage0) as f64 / 1e6 / wall;
    let throttled = cgroup.cpu_throttled_periods().unwrap() - throttled0;
    figure(
        "busy guest at cpu_millis=100: QEMU CPU share over 5 s (/proc stat; cgroup counter)",
        format!("{:.1}% ; {:.1}% of one core", share * 100.0, cgroup_share * 100.0),
    );
    figure("busy guest at cpu_millis=100: periods throttled in 5 s", throttled);
    assert!(
        (0.05..=0.20).contains(&share),
        "QEMU used {:.1}% of a core",
        share * 100.0
    );
    assert!((0.05..=0.20).contains(&cgroup_share), "{:.1}%", cgroup_share * 100.0);
    assert!(throttled > 10, "the quota held it back: {throttled} periods");

    // A VMM over its memory limit is ended by the OOM killer, and that is what the VM
    // says: the copy maps its fork's RAM privately, so each page its guest writes is
    // memory of its own. Its quota off, its guest starts filling 128 MiB of tmpfs in 3 s
    // (detached: a request whose guest vanishes is never answered); meanwhile its limit
    // goes to 32 MiB over what it uses (its translation cache grows as it runs).
    copy.set_cpu_millis(None).unwrap();
    assert_eq!(copy_cgroup.cpu_quota().unwrap().0, None);
    let fill = "sleep 3; head -c 128M /dev/zero > /dev/shm/fill";
    let out = exec(&copy, "setsid", &["-f", "sh", "-c", fill]);
    assert_eq!(out.exit_code, 0, "{out:?}");
    let usage = copy_cgroup.memory_usage().unwrap();
    copy_cgroup.set_memory_limit(usage + (32 << 20), true).unwrap();
    let ended = exit_info(&copy, Duration::from_secs(60));
    assert_eq!(ended.signal, Some(libc::SIGKILL), "{ended:?}");
    assert!(copy.oom_killed(), "the copy's cgroup counted the kill");
    assert!(!vm.oom_killed());
    assert_eq!(copy_cgroup.oom_kills(), Some(1));
    // Deleting the copy removes its cgroup; the source keeps its own.
    copy.delete().unwrap();
    assert_no_cgroup(&copy_cgroup, "a deleted copy");
    assert_eq!(cgroup.procs(), vec![pid]);

    // A paused VM has no process and no cgroup; resumed, it has both again, held.
    vm.pause().unwrap();
    assert_no_cgroup(&cgroup, "a paused VM");
    vm.resume().unwrap();
    let pid = running(&vm);
    assert_eq!(cgroup.procs(), vec![pid]);
    assert_eq!(cgroup.cpu_quota(), Some((Some(10_000), 100_000)));

    // A restarted edge finds the same cgroup and holds the VM to its quota again, even
    // if the edge that died left it boosted.
    cgroup.set_cpu_quota(None, 100_000).unwrap();
    let again = MicroVmDriver::new(config(), &|_| {}).unwrap();
    let adopted = again.open(&id).unwrap();
    adopted.recover().unwrap();
    assert_eq!(adopted.cgroup(), cgroup);
    assert_eq!(cgroup.cpu_quota(), Some((Some(10_000), 100_000)));
    assert_eq!(cgroup.procs(), vec![pid]);

    // Deleting the VM removes its cgroup from every hierarchy.
    vm.delete().unwrap();
    assert_no_cgroup(&cgroup, "a deleted VM");
}
