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
    // The guest reaches nothing but its /30: no route anywhere else.
    let routes = exec(&vm, "sh", &["-c", "cat /proc/net/route | wc -l"]);
    assert_eq!(
        routes.stdout_text().trim(),
        "2",
        "one header line and the /30: {routes:?}"
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
        config: Default::default(),
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
