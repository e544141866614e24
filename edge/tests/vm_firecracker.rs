//! Specification tests of the Firecracker side of the microVM driver, against the real
//! Firecracker v1.12 and its jailer (no mocks): configure and InstanceStart, pause and
//! resume, Full and Diff snapshots, loads into new jailed processes, a pause of the
//! file system only and the boot again after it, fork, kill, and
//! that nothing of a VM outlives it (process, namespace, chroot, cgroup, uid).
//!
//! What the guest does (the agent answers, memory survives) can only be checked where
//! KVM runs guests at hardware speed (`detect_accel`); elsewhere (a PVM host, where a
//! stock guest kernel never reaches user space) the test records those checks as not
//! run (`support::not_run_needs_hardware_kvm`: `./ops/test.sh` counts and names them in
//! its last lines) and still checks everything Firecracker's API does.
//!
//! Needs root, firecracker and jailer v1.12.x (`./ops/test.sh` installs them), what
//! `vm_microvm.rs` needs (QEMU for the KVM probe, the `base` image, the static agent).
//! Figures are printed as `figure: <name> = <value>`.
//!
//! Run: `cargo test -p opendsec-edge --test vm_firecracker -- --test-threads=1 --nocapture`

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use opendsec_edge::images::ImageStore;

mod support;
use opendsec_edge::vm::firecracker::{InstanceState, JailSpec, SnapshotKind, merge_diff_into_copy};
use opendsec_edge::vm::{
    Accel, ExecOutput, MicroVmDriver, VmConfig, VmError, VmHandle, VmSpec, VmStatus, Vmm, VmmChoice,
};
use support::{
    COUNTER, Cleanup, exec_as, exit_info, figure, ms, not_run_needs_hardware_kvm, require_root, static_agent,
    store_dir, vm_spec,
};

/// The driver's state for these tests (VMs, jails); every test removes what it made.
const TEST_ROOT: &str = "/var/tmp/opendsec-fc-tests";
const TOKEN: &str = "fc-test-token";

fn config() -> VmConfig {
    require_root("Firecracker");
    let store = ImageStore::open(store_dir()).expect("open the image store");
    let mut cfg = VmConfig::new(
        TEST_ROOT,
        store.clone(),
        static_agent(),
        PathBuf::from(env!("CARGO_BIN_EXE_opendsec-vm-shim")),
    );
    cfg.accel_cache = Some(store.root().join("accel.json"));
    cfg.vmm = VmmChoice::Firecracker;
    cfg
}

/// The driver, told to use Firecracker. Missing binaries fail every test here, with
/// what to do; they are never a reason to skip.
fn driver() -> MicroVmDriver {
    static DRIVER: OnceLock<MicroVmDriver> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            let d = MicroVmDriver::new(config(), &|m| eprintln!("[vm] {m}"))
                .unwrap_or_else(|e| panic!("the Firecracker driver: {e}"));
            eprintln!(
                "driver: vmm {} ({}); accelerator {} ({})",
                d.vmm().vmm.as_str(),
                d.vmm().reason,
                d.accel().accel.as_str(),
                d.accel().reason
            );
            d
        })
        .clone()
}

/// Whether the guest-side checks run; records them as not run when they cannot.
fn guest_checks(test: &str) -> bool {
    let accel = driver().accel().clone();
    if !accel.kvm_usable() {
        not_run_needs_hardware_kvm(
            &format!("vm_firecracker: the guest side of {test} (agent answers, memory survives)"),
            &accel.reason,
        );
    }
    accel.kvm_usable()
}

fn spec(id: &str) -> VmSpec {
    vm_spec(id, TOKEN, 256, BTreeMap::new())
}

fn unique(tag: &str) -> String {
    format!("f{}-{tag}", std::process::id())
}

/// Everything of a VM on the host, noted while it exists, to check it is gone later.
struct Traces {
    id: String,
    dir: PathBuf,
    netns: PathBuf,
    jail: JailSpec,
    cgroup: opendsec_edge::cgroups::Cgroup,
    pids: Vec<i32>,
}

impl Traces {
    fn of(vm: &VmHandle) -> Self {
        let files = vm.files().unwrap();
        Traces {
            id: vm.id().into(),
            dir: files.dir,
            netns: files.netns,
            jail: vm.firecracker_jail().unwrap().expect("a Firecracker VM"),
            cgroup: vm.cgroup(),
            pids: Vec::new(),
        }
    }

    fn saw(&mut self, vm: &VmHandle) -> i32 {
        let pid = running_pid(vm);
        self.pids.push(pid);
        pid
    }

    fn assert_gone(&self) {
        for pid in &self.pids {
            let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            assert!(
                !comm.trim().starts_with("firecracker"),
                "{}: Firecracker process {pid} still runs",
                self.id
            );
        }
        assert!(!self.dir.exists(), "{}: {} is left", self.id, self.dir.display());
        assert!(
            !self.netns.exists(),
            "{}: namespace {} is left",
            self.id,
            self.netns.display()
        );
        assert!(
            !self.jail.dir().exists(),
            "{}: chroot {} is left",
            self.id,
            self.jail.dir().display()
        );
        let cgroup = self.jail.cgroup_dir().unwrap();
        assert!(!cgroup.exists(), "{}: cgroup {} is left", self.id, cgroup.display());
        for dir in self.cgroup.dirs() {
            assert!(!dir.exists(), "{}: cgroup {} is left", self.id, dir.display());
        }
        let registry = ImageStore::open(store_dir()).unwrap().root().join("vm-uids");
        for entry in fs::read_dir(&registry).into_iter().flatten().flatten() {
            let owner = fs::read_to_string(entry.path()).unwrap_or_default();
            assert_ne!(
                Path::new(owner.trim()),
                self.dir,
                "{}: uid {:?} is still claimed",
                self.id,
                entry.file_name()
            );
        }
    }
}

fn running_pid(vm: &VmHandle) -> i32 {
    match vm.status().unwrap() {
        VmStatus::Running { pid } => pid,
        other => panic!(
            "{} is {other:?}, not running; console: {}",
            vm.id(),
            vm.console_tail(1500)
        ),
    }
}

fn proc_status(pid: i32, field: &str) -> String {
    fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{field}:")).map(|v| v.trim().to_string()))
        .unwrap_or_default()
}

/// The process runs jailed: the VM's uid, the default seccomp filter, the VM's chroot,
/// network namespace and cgroups (the jail's cpuset, the VM's limits).
fn assert_jailed(vm: &VmHandle, pid: i32) {
    let jail = vm.firecracker_jail().unwrap().unwrap();
    let uid = vm.uid().unwrap();
    assert_ne!(uid, 0, "VMs run as a uid of their own");
    assert_eq!(proc_status(pid, "Uid"), format!("{uid}\t{uid}\t{uid}\t{uid}"));
    assert_eq!(proc_status(pid, "Seccomp"), "2", "seccomp filter mode");
    // pivot_root in a mount namespace of its own: its `/` is the jail's root.
    let inode = |p: PathBuf| {
        fs::metadata(&p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .ino()
    };
    assert_ne!(
        inode(format!("/proc/{pid}/ns/mnt").into()),
        inode("/proc/self/ns/mnt".into())
    );
    assert_eq!(
        inode(format!("/proc/{pid}/root/api.sock").into()),
        inode(jail.api_socket())
    );
    let ns = fs::metadata(format!("/proc/{pid}/ns/net")).unwrap().ino();
    assert_eq!(
        ns,
        fs::metadata(vm.files().unwrap().netns).unwrap().ino(),
        "network namespace"
    );
    let tasks = fs::read_to_string(jail.cgroup_dir().unwrap().join("cgroup.procs")).unwrap();
    assert!(
        tasks.lines().any(|l| l.trim() == pid.to_string()),
        "pid {pid} in its cgroup: {tasks:?}"
    );
    // The VM's own cgroup (CPU, memory, IO), the same as a QEMU VM's, with its limit.
    let cgroup = vm.cgroup();
    assert!(cgroup.procs().contains(&pid), "pid {pid} in {}", cgroup.path());
    assert_eq!(cgroup.memory_limit(), Some(vm.memory_limit().unwrap()));
}

fn exec(vm: &VmHandle, cmd: &str, args: &[&str]) -> ExecOutput {
    exec_as(vm, TOKEN, cmd, args)
}

fn count(vm: &VmHandle) -> u64 {
    support::count_as(vm, TOKEN)
}

/// Guest side of a fresh VM: the agent answers, python computes, a counter starts.
fn check_fresh_guest(vm: &VmHandle) {
    let t = Instant::now();
    vm.wait_agent(Duration::from_secs(60)).unwrap();
    figure("firecracker cold boot to agent", ms(t.elapsed()));
    let out = exec(vm, "python3", &["-c", "print(6*7)"]);
    assert_eq!(out.stdout_text().trim(), "42", "{out:?}");
    let started = exec(vm, "setsid", &["-f", "python3", "-c", COUNTER]);
    assert_eq!(started.exit_code, 0, "{started:?}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while exec(vm, "bash", &["-c", "exec 3<>/dev/tcp/127.0.0.1/7777 && echo up"])
        .stdout_text()
        .trim()
        != "up"
    {
        assert!(Instant::now() < deadline, "the counter never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn files_equal(a: &Path, b: &Path) -> bool {
    let (mut fa, mut fb) = (fs::File::open(a).unwrap(), fs::File::open(b).unwrap());
    if fa.metadata().unwrap().len() != fb.metadata().unwrap().len() {
        return false;
    }
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let n = fa.read(&mut ba).unwrap();
        fb.read_exact(&mut bb[..n]).unwrap();
        if ba[..n] != bb[..n] {
            return false;
        }
        if n == 0 {
            return true;
        }
    }
}

#[test]
fn a_firecracker_vm_lives_pauses_resumes_snapshots_forks_and_leaves_nothing_behind() {
    let d = driver();
    let guest = guest_checks("the lifecycle");
    let a_id = unique("a");
    let mut cleanup = Cleanup(Vec::new());

    // Create: configure (boot source, machine, two drives, tap, vsock) and InstanceStart,
    // in a jailed process.
    let t = Instant::now();
    let a = d.create(&spec(&a_id), &|m| eprintln!("[{a_id}] {m}")).unwrap();
    cleanup.0.push(a.clone());
    figure("firecracker create (jail, configure, InstanceStart)", ms(t.elapsed()));
    assert_eq!(a.vmm().unwrap(), (Vmm::Firecracker, Accel::Kvm));
    let mut a_traces = Traces::of(&a);
    let pid = a_traces.saw(&a);
    assert_jailed(&a, pid);
    assert_eq!(a.firecracker_api().unwrap().version().unwrap(), "1.12.1");
    assert_eq!(a.firecracker_api().unwrap().state().unwrap(), InstanceState::Running);
    if guest {
        check_fresh_guest(&a);
        assert_eq!(count(&a), 2);
    }

    // Pause: a Diff of every page written since boot (the rest is zero), then the
    // process ends and its jail and cgroup go.
    let paused = a.pause().unwrap();
    figure(
        "firecracker pause (Diff since boot): vCPUs stopped to snapshot written",
        ms(paused.snapshot),
    );
    figure(
        "firecracker pause (Diff since boot): process end and jail removal",
        ms(paused.exit),
    );
    figure("firecracker pause (Diff since boot): bytes written", paused.ram_bytes);
    assert!(paused.incremental, "a cold-booted VM pauses with a Diff since boot");
    assert!(paused.ram_bytes > 0, "{paused:?}");
    assert_eq!(a.status().unwrap(), VmStatus::Paused);
    assert!(!a_traces.jail.dir().exists(), "a paused VM has no jail");
    assert!(
        !a_traces.jail.cgroup_dir().unwrap().exists(),
        "a paused VM has no cgroup"
    );

    // Resume: the snapshot loads into a new jailed process.
    let resumed = a.resume().unwrap();
    figure("firecracker resume: jailer to API socket", ms(resumed.spawn));
    figure("firecracker resume: snapshot load", ms(resumed.restore));
    let pid2 = a_traces.saw(&a);
    assert_ne!(pid, pid2, "a resumed VM is a new process");
    assert_jailed(&a, pid2);
    if guest {
        assert_eq!(count(&a), 3, "the counter survives pause and resume");
    }

    // Pause again: only the pages written since the load (a Diff), merged onto the
    // memory file; the resume loads the merged file.
    let diff_pause = a.pause().unwrap();
    figure(
        "firecracker pause (Diff): vCPUs stopped to snapshot written",
        ms(diff_pause.snapshot),
    );
    figure(
        "firecracker pause (Diff): merge onto the memory file",
        ms(diff_pause.release),
    );
    figure("firecracker pause (Diff): bytes written", diff_pause.ram_bytes);
    assert!(
        diff_pause.incremental,
        "a VM loaded from its memory file pauses with a Diff"
    );
    assert!(diff_pause.ram_bytes < paused.ram_bytes, "{diff_pause:?} vs {paused:?}");
    let resumed = a.resume().unwrap();
    figure("firecracker resume: snapshot load (merged Diff)", ms(resumed.restore));
    a_traces.saw(&a);
    if guest {
        assert_eq!(count(&a), 4, "the counter survives a Diff pause");
    }

    // A snapshot of the running VM and a fork with memory: each stops the source only
    // while a Diff (on the memory file it was loaded from, then on the snapshot's
    // memory) and its disk are written; the whole memory is put together after.
    let snaps = tempfile::tempdir_in("/var/tmp").unwrap();
    let snap = snaps.path().join("a");
    let taken = a.snapshot_to(&snap).unwrap();
    figure(
        "firecracker snapshot_to (Diff): source stopped",
        ms(taken.source_paused),
    );
    assert!(matches!(a.status().unwrap(), VmStatus::Running { .. }));
    let c_id = unique("c");
    let forked = a.fork(std::slice::from_ref(&c_id)).unwrap();
    let c = forked.copies[0].clone();
    cleanup.0.push(c.clone());
    figure("firecracker fork x1 (Diff): source stopped", ms(forked.source_paused));
    figure("firecracker fork x1: total", ms(forked.total));
    let mut c_traces = Traces::of(&c);
    let c_pid = c_traces.saw(&c);
    assert_jailed(&c, c_pid);
    assert_ne!(c.uid().unwrap(), a.uid().unwrap());
    if guest {
        assert_eq!(count(&c), 5, "the copy continues from the source's memory");
        assert_eq!(count(&a), 5, "and so does the source, on its own");
    }
    c.delete().unwrap();
    c_traces.assert_gone();

    // The memory the fork put together is what the source's next Diff is a diff of:
    // checked page for page against a Full snapshot of the paused source. (These
    // snapshots bypass the driver, so the source is only killed after.)
    let diff_base = a.files().unwrap().dir.join("diffbase");
    assert!(diff_base.is_file(), "the source keeps its next diff's base");
    let mut api = a.firecracker_api().unwrap();
    api.pause().unwrap();
    api.snapshot_create(SnapshotKind::Diff, "/t-diff.state", "/t-diff.ram")
        .unwrap();
    api.snapshot_create(SnapshotKind::Full, "/t-full.state", "/t-full.ram")
        .unwrap();
    let a_jail = a.firecracker_jail().unwrap().unwrap();
    let merged = snaps.path().join("a-merged");
    merge_diff_into_copy(&diff_base, &a_jail.host_path("/t-diff.ram"), &merged).unwrap();
    assert!(
        files_equal(&merged, &a_jail.host_path("/t-full.ram")),
        "the fork's memory + the next Diff differs from a Full snapshot of the source"
    );
    fs::remove_file(&merged).unwrap();
    drop(api);

    // Kill: the process ends at once; the VM stays on disk, exited, without a jail, and
    // its end as the shim's keeper saw it is recorded: that process, by SIGKILL.
    let killed = running_pid(&a);
    a.kill().unwrap();
    let info = exit_info(&a, Duration::from_secs(5));
    assert_eq!(
        (info.pid, info.signal, info.exit_code),
        (killed, Some(libc::SIGKILL), 128 + libc::SIGKILL),
        "{info:?}"
    );
    assert!(!a_traces.jail.dir().exists());

    // Restore the snapshot as a new VM: a Full load into a new jailed process.
    let b_id = unique("b");
    let t = Instant::now();
    let (b, report) = d.restore_snapshot(&spec(&b_id), &snap, &|_| {}).unwrap();
    cleanup.0.push(b.clone());
    figure("firecracker restore_snapshot (copy + jail + load)", ms(t.elapsed()));
    figure("firecracker restore_snapshot: snapshot load", ms(report.restore));
    assert_eq!(b.vmm().unwrap(), (Vmm::Firecracker, Accel::Kvm));
    let mut b_traces = Traces::of(&b);
    let b_pid = b_traces.saw(&b);
    assert_jailed(&b, b_pid);
    if guest {
        assert_eq!(count(&b), 5, "the restored VM continues from the snapshot");
    }

    // Firecracker's own Diff, checked page for page: with the VM paused, its memory
    // file plus a Diff snapshot merged onto it is exactly a Full snapshot's memory.
    let jail = b.firecracker_jail().unwrap().unwrap();
    let mut api = b.firecracker_api().unwrap();
    let t = Instant::now();
    api.pause().unwrap();
    figure("firecracker API: PATCH /vm Paused", ms(t.elapsed()));
    assert_eq!(api.state().unwrap(), InstanceState::Paused);
    let t = Instant::now();
    api.snapshot_create(SnapshotKind::Diff, "/t-diff.state", "/t-diff.ram")
        .unwrap();
    figure("firecracker API: Diff snapshot create", ms(t.elapsed()));
    let t = Instant::now();
    api.snapshot_create(SnapshotKind::Full, "/t-full.state", "/t-full.ram")
        .unwrap();
    figure("firecracker API: Full snapshot create (256 MiB)", ms(t.elapsed()));
    let merged = snaps.path().join("merged");
    let merge = merge_diff_into_copy(&b.files().unwrap().ram, &jail.host_path("/t-diff.ram"), &merged).unwrap();
    figure("firecracker Diff: bytes", merge.bytes);
    assert!(
        files_equal(&merged, &jail.host_path("/t-full.ram")),
        "memory file + Diff differs from a Full snapshot of the same paused VM"
    );
    let t = Instant::now();
    api.resume().unwrap();
    figure("firecracker API: PATCH /vm Resumed", ms(t.elapsed()));
    assert_eq!(api.state().unwrap(), InstanceState::Running);
    drop(api);

    // Delete: nothing of any of them is left.
    b.delete().unwrap();
    a.delete().unwrap();
    b_traces.assert_gone();
    a_traces.assert_gone();
    let forks: Vec<_> = fs::read_dir(Path::new(TEST_ROOT).join("forks"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(&a_id))
        .collect();
    assert!(forks.is_empty(), "fork bases left: {forks:?}");
}

/// A pause of the file system only (E2B's `keep_memory=False`) under Firecracker: the
/// process ends and its jail and cgroup go, no memory is kept, a snapshot is refused;
/// the VM then boots again on its disks in a new jailed process. A VM paused with its
/// memory drops it when booted again. Guest side: the files stay, the processes do not.
#[test]
fn a_firecracker_vm_paused_with_its_disk_only_boots_again_on_it() {
    let d = driver();
    let guest = guest_checks("the file-system-only pause");
    let id = unique("store");
    let mut cleanup = Cleanup(Vec::new());
    let vm = d.create(&spec(&id), &|m| eprintln!("[{id}] {m}")).unwrap();
    cleanup.0.push(vm.clone());
    let mut traces = Traces::of(&vm);
    let pid = traces.saw(&vm);
    if guest {
        check_fresh_guest(&vm);
        let wrote = exec(&vm, "sh", &["-c", "echo kept > /home/user/kept.txt && sync"]);
        assert_eq!(wrote.exit_code, 0, "{wrote:?}");
    }

    let t = Instant::now();
    vm.store().unwrap();
    figure("firecracker file-system-only pause", ms(t.elapsed()));
    assert_eq!(vm.status().unwrap(), VmStatus::Paused);
    assert!(vm.is_stored());
    assert!(!traces.jail.dir().exists(), "a stored VM has no jail");
    assert!(!traces.jail.cgroup_dir().unwrap().exists(), "a stored VM has no cgroup");
    for kept in ["state", "ram"] {
        assert!(!traces.dir.join(kept).exists(), "a stored VM keeps no {kept}");
    }
    let comm = fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    assert!(!comm.starts_with("firecracker"), "process {pid} still runs");
    let snaps = tempfile::tempdir().unwrap();
    let refused = vm.snapshot_to(&snaps.path().join("s")).unwrap_err();
    assert!(refused.to_string().contains("disk only"), "{refused}");
    vm.store().unwrap(); // again: nothing to do

    let t = Instant::now();
    vm.boot_again(&spec(&id)).unwrap();
    figure(
        "firecracker boot again: jail, configure, InstanceStart",
        ms(t.elapsed()),
    );
    assert!(!vm.is_stored());
    let pid2 = traces.saw(&vm);
    assert_ne!(pid, pid2, "booted again in a new process");
    assert_jailed(&vm, pid2);
    assert_eq!(vm.firecracker_api().unwrap().state().unwrap(), InstanceState::Running);
    if guest {
        vm.wait_agent(Duration::from_secs(60)).unwrap();
        assert_eq!(exec(&vm, "cat", &["/home/user/kept.txt"]).stdout_text(), "kept\n");
        let counter = exec(&vm, "bash", &["-c", "exec 3<>/dev/tcp/127.0.0.1/7777 && echo up"]);
        assert_ne!(counter.stdout_text().trim(), "up", "no process of before runs");
    }

    // Paused with its memory, then booted again: the memory is dropped, the disk kept.
    vm.pause().unwrap();
    assert!(traces.dir.join("state").exists());
    vm.boot_again(&spec(&id)).unwrap();
    assert!(!traces.dir.join("state").exists(), "the memory snapshot is dropped");
    let pid3 = traces.saw(&vm);
    assert_jailed(&vm, pid3);
    if guest {
        vm.wait_agent(Duration::from_secs(60)).unwrap();
        assert_eq!(exec(&vm, "cat", &["/home/user/kept.txt"]).stdout_text(), "kept\n");
    }

    vm.delete().unwrap();
    traces.assert_gone();
}

#[test]
fn a_diff_since_boot_holds_every_page_a_cold_booted_vm_wrote() {
    // What lets a cold-booted VM's first pause, snapshot or fork be a Diff: with dirty
    // pages tracked from boot, the Diff's sparse file (clean pages read as zeros) is
    // exactly the memory a Full snapshot of the same paused VM writes.
    let d = driver();
    let id = unique("z");
    let mut cleanup = Cleanup(Vec::new());
    let vm = d.create(&spec(&id), &|_| {}).unwrap();
    cleanup.0.push(vm.clone());
    std::thread::sleep(Duration::from_millis(300));
    let jail = vm.firecracker_jail().unwrap().unwrap();
    let mut api = vm.firecracker_api().unwrap();
    api.pause().unwrap();
    api.snapshot_create(SnapshotKind::Diff, "/z-diff.state", "/z-diff.ram")
        .unwrap();
    api.snapshot_create(SnapshotKind::Full, "/z-full.state", "/z-full.ram")
        .unwrap();
    let (diff, full) = (jail.host_path("/z-diff.ram"), jail.host_path("/z-full.ram"));
    let memory = vm.files().unwrap().memory_mb << 20;
    assert_eq!(fs::metadata(&full).unwrap().len(), memory);
    // Pages after the last one written may be left out of the Diff's length.
    let diff_len = fs::metadata(&diff).unwrap().len();
    assert!(diff_len <= memory, "{diff_len}");
    fs::OpenOptions::new()
        .write(true)
        .open(&diff)
        .unwrap()
        .set_len(memory)
        .unwrap();
    let written = fs::metadata(&diff).unwrap().blocks() * 512;
    figure("firecracker Diff since boot: bytes written", written);
    assert!(written > 0 && written < memory, "{written} of {memory} bytes");
    assert!(
        files_equal(&diff, &full),
        "a Diff since boot differs from a Full snapshot"
    );
    drop(api);
    vm.delete().unwrap();
}

#[test]
fn a_corrupt_snapshot_is_refused_with_a_clear_error_and_leaves_nothing_behind() {
    let d = driver();
    let source_id = unique("src");
    let source = d.create(&spec(&source_id), &|_| {}).unwrap();
    let _cleanup = Cleanup(vec![source.clone()]);
    let snaps = tempfile::tempdir_in("/var/tmp").unwrap();
    let snap = snaps.path().join("s");
    source.snapshot_to(&snap).unwrap();
    source.delete().unwrap();

    // Given a snapshot whose device state is garbage of the same size,
    let len = fs::metadata(snap.join("state")).unwrap().len() as usize;
    fs::write(snap.join("state"), vec![0x5a; len]).unwrap();
    // when a VM is restored from it,
    let id = unique("bad");
    let err = d.restore_snapshot(&spec(&id), &snap, &|_| {}).unwrap_err();
    // then the error says that Firecracker could not load it,
    let text = err.to_string();
    eprintln!("refused: {text}");
    assert!(text.contains("loading the snapshot"), "{text}");
    assert!(
        !text.contains("Permission denied"),
        "refused for its content, not access: {text}"
    );
    // and the new VM left nothing: no directory, namespace, jail, cgroup or uid.
    assert!(matches!(d.open(&id), Err(VmError::NotFound(_))));
    let probe = JailSpec {
        id: id.clone(),
        jailer: "jailer".into(),
        firecracker: d.firecracker().unwrap().firecracker.clone(),
        chroot_base: Path::new(TEST_ROOT).join("jails"),
        uid: 0,
        gid: 0,
        netns: None,
        parent_cgroup: String::new(),
        cgroup: opendsec_edge::vm::firecracker::cgroup_version(),
    };
    assert!(!probe.dir().exists(), "jail {} is left", probe.dir().display());
    let netns_left: Vec<_> = fs::read_dir("/run/netns")
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(&id))
                .collect()
        })
        .unwrap_or_default();
    assert!(netns_left.is_empty(), "namespaces left: {netns_left:?}");
    let registry = ImageStore::open(store_dir()).unwrap().root().join("vm-uids");
    let vm_dir = Path::new(TEST_ROOT).join("vms").join(&id);
    for entry in fs::read_dir(&registry).into_iter().flatten().flatten() {
        assert_ne!(
            Path::new(fs::read_to_string(entry.path()).unwrap_or_default().trim()),
            vm_dir
        );
    }
    let cgroups_left: Vec<_> = walk_cgroups(&id);
    assert!(cgroups_left.is_empty(), "cgroups left: {cgroups_left:?}");
}

/// The parent pid of `pid`, from `/proc/<pid>/stat`.
fn parent_of(pid: i32) -> i32 {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let (_, rest) = stat.rsplit_once(')').unwrap();
    rest.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[test]
fn a_firecracker_process_never_outlives_its_shim_though_the_jailer_changed_its_uid() {
    let d = driver();
    let id = unique("orphan");
    let vm = d.create(&spec(&id), &|m| eprintln!("[{id}] {m}")).unwrap();
    let _cleanup = Cleanup(vec![vm.clone()]);
    let mut traces = Traces::of(&vm);
    let pid = traces.saw(&vm);
    // Given a Firecracker running as the VM's uid (so without PDEATHSIG) under the
    // shim's keeper, PID 1 of a namespace of its own,
    assert_ne!(proc_status(pid, "Uid"), "0\t0\t0\t0");
    let keeper = parent_of(pid);
    assert_eq!(
        proc_status(pid, "NSpid").split_whitespace().last(),
        Some("2"),
        "Firecracker is the keeper's child"
    );
    assert_eq!(
        proc_status(keeper, "NSpid").split_whitespace().last(),
        Some("1"),
        "the keeper is PID 1"
    );
    let shim = parent_of(keeper);
    let comm = fs::read_to_string(format!("/proc/{shim}/comm")).unwrap();
    assert!(
        comm.starts_with("opendsec-vm-shi"),
        "the keeper's parent is the shim, not {comm:?}"
    );
    // when the shim is killed outright,
    let t = Instant::now();
    // SAFETY: a signal to a process of this test.
    assert_eq!(unsafe { libc::kill(shim, libc::SIGKILL) }, 0);
    // then Firecracker ends with it,
    while Path::new(&format!("/proc/{pid}")).exists() && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(
        !Path::new(&format!("/proc/{pid}")).exists(),
        "Firecracker {pid} outlived its shim"
    );
    figure("firecracker gone after its shim was killed", ms(t.elapsed()));
    // the driver sees the VM ended, and deleting it leaves nothing.
    assert!(matches!(vm.status().unwrap(), VmStatus::Exited(_)), "{:?}", vm.status());
    vm.delete().unwrap();
    traces.assert_gone();
}

/// Cgroup directories named `id` one level under any cpuset parent.
fn walk_cgroups(id: &str) -> Vec<PathBuf> {
    let roots = ["/sys/fs/cgroup/cpuset", "/sys/fs/cgroup"];
    let mut found = Vec::new();
    for root in roots {
        for parent in fs::read_dir(root).into_iter().flatten().flatten() {
            let candidate = parent.path().join(id);
            if candidate.is_dir() {
                found.push(candidate);
            }
        }
    }
    found
}

#[test]
fn a_driver_told_to_use_firecracker_without_its_binaries_says_how_to_install_them() {
    let mut cfg = config();
    cfg.root = PathBuf::from(TEST_ROOT).join("no-binaries");
    cfg.firecracker = Some(PathBuf::from("/nonexistent/firecracker"));
    let err = MicroVmDriver::new(cfg, &|_| {})
        .err()
        .expect("no driver without firecracker");
    let text = err.to_string();
    assert!(text.contains("firecracker is missing"), "{text}");
    assert!(text.contains("./ops/test.sh"), "{text}");
    let _ = fs::remove_dir_all(PathBuf::from(TEST_ROOT).join("no-binaries"));
}
