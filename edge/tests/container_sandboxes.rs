//! Specification tests of the container backend against the real thing: runc/crun,
//! namespaces, cgroups, overlayfs, loop-mounted ext4, the seccomp profile. They need root
//! and the packages runc, crun, busybox-static (downloaded by the image builder),
//! debootstrap and e2fsprogs; the agent's test also needs the static agent
//! (`OPENDSEC_TEST_AGENT`, or `edge/agent/build-static.sh`). A missing prerequisite fails
//! the test with what to install or build.

mod support;

use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use opendsec_edge::container::{
    BindMount, ContainerBackend, ContainerConfig, ContainerError, Limits, RuntimeChoice, SandboxSpec, SandboxStatus,
    is_mounted,
};
use opendsec_edge::images::{Image, ImageStore};
use opendsec_edge::vm::AgentChannel;

/// Images are built once per machine and shared by the tests (as on an edge).
const TEST_STORE: &str = "/var/tmp/opendsec-test-images";

fn require_prerequisites() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "the container tests need root");
    for (bin, package) in [
        ("runc", "runc"),
        ("crun", "crun"),
        ("mkfs.ext4", "e2fsprogs"),
        ("apt-get", "apt"),
        ("dpkg-deb", "dpkg"),
        ("lxcfs", "lxcfs"),
    ] {
        let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
            .iter()
            .any(|d| Path::new(d).join(bin).is_file());
        assert!(
            found,
            "{bin} is missing: install the {package} package (apt-get install {package})"
        );
    }
    assert!(
        Path::new("/dev/loop-control").exists(),
        "no /dev/loop-control: the loop module is needed"
    );
}

fn store() -> ImageStore {
    ImageStore::open(TEST_STORE).expect("open the test image store")
}

fn image(name: &str) -> Image {
    require_prerequisites();
    store()
        .ensure(name, &|p| eprintln!("[{name}] {}: {}", p.phase, p.message))
        .expect("build image")
}

fn unique_id(tag: &str) -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    format!("t{}-{}-{}", std::process::id(), tag, N.fetch_add(1, Ordering::SeqCst))
}

struct TestBackend {
    backend: ContainerBackend,
    _tmp: tempfile::TempDir,
}

/// A failed assertion must not leave sandboxes (mounts, loop devices, cgroups) behind.
impl Drop for TestBackend {
    fn drop(&mut self) {
        for handle in self.backend.list().unwrap_or_default() {
            let _ = self.backend.delete(&handle.id);
        }
    }
}

impl std::ops::Deref for TestBackend {
    type Target = ContainerBackend;
    fn deref(&self) -> &ContainerBackend {
        &self.backend
    }
}

fn config_in(root: &Path, runtime: RuntimeChoice) -> ContainerConfig {
    ContainerConfig {
        sandboxes_root: root.join("sandboxes"),
        runtime_root: root.join("runtime"),
        runtime,
        shim: PathBuf::from(env!("CARGO_BIN_EXE_opendsec-shim")),
        cgroup_parent: "opendsec-test".into(),
        log_cap_bytes: 1 << 20,
        warm_disks: 0,
        warm_disk_bytes: 64 << 20,
        user_namespaces: true,
        // The machine's lxcfs, as an edge's (started by the first backend that finds none).
        lxcfs: ContainerConfig::default().lxcfs,
        // Loaded where the kernel has AppArmor, as an edge's.
        apparmor: Some(root.join("apparmor")),
    }
}

/// `Auto` can be overridden with OPENDSEC_TEST_RUNTIME=crun|runc to run the suite on one runtime.
fn backend(runtime: RuntimeChoice) -> TestBackend {
    require_prerequisites();
    let runtime = match (runtime, std::env::var("OPENDSEC_TEST_RUNTIME")) {
        (RuntimeChoice::Auto, Ok(name)) => name.parse().expect("OPENDSEC_TEST_RUNTIME is auto, crun or runc"),
        (choice, _) => choice,
    };
    let tmp = tempfile::Builder::new()
        .prefix("opendsec-ct")
        .tempdir_in("/var/tmp")
        .unwrap();
    let backend = ContainerBackend::new(config_in(tmp.path(), runtime)).expect("backend");
    TestBackend { backend, _tmp: tmp }
}

fn busybox_spec(id: &str, script: &str) -> SandboxSpec {
    let img = image("busybox");
    let mut spec =
        SandboxSpec::from_image(id, &store(), &img, vec!["/bin/sh".into(), "-c".into(), script.into()]).unwrap();
    spec.limits = Limits {
        memory_bytes: 128 << 20,
        cpu_millis: 1000,
        pids: 128,
        io_weight: Some(100),
        disk_bytes: 64 << 20,
        best_effort: false,
    };
    spec
}

fn run_to_exit(b: &ContainerBackend, spec: &SandboxSpec) -> (opendsec_edge::container::ExitInfo, String) {
    b.create(spec).expect("create");
    let exit = b
        .wait(&spec.id, Duration::from_secs(30))
        .unwrap()
        .expect("exits within 30 s");
    let log = String::from_utf8_lossy(&b.read_log(&spec.id, 1 << 20).unwrap()).into_owned();
    b.delete(&spec.id).expect("delete");
    (exit, log)
}

fn assert_gone(b: &ContainerBackend, id: &str) {
    let dir = b.config().sandboxes_root.join(id);
    assert!(!dir.exists(), "{} still exists", dir.display());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mountinfo.contains(&*dir.to_string_lossy()),
        "mounts left under {}:\n{mountinfo}",
        dir.display()
    );
    for ctrl in ["memory", "pids", "cpu", "cpuset", "freezer"] {
        let cg = Path::new("/sys/fs/cgroup").join(ctrl).join("opendsec-test").join(id);
        assert!(!cg.exists(), "cgroup {} left behind", cg.display());
    }
}

fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn echo_hi_as_pid1_exits_zero_with_own_hostname_and_user_on_crun_and_runc() {
    for runtime in [RuntimeChoice::Crun, RuntimeChoice::Runc] {
        let b = backend(runtime);
        let id = unique_id("echo");
        let mut spec = busybox_spec(&id, "echo hi; hostname; id -u; echo pid=$$");
        spec.process.user = (1000, 1000);
        let (exit, log) = run_to_exit(&b, &spec);
        assert_eq!(exit.exit_code, 0, "{runtime:?}: {log}");
        assert!(!exit.oom_killed);
        assert_eq!(log, format!("hi\n{id}\n1000\npid=1\n"), "{runtime:?}");
        assert_gone(&b, &id);
    }
}

fn cgroup_file(controller: &str, id: &str, file: &str) -> PathBuf {
    Path::new("/sys/fs/cgroup")
        .join(controller)
        .join("opendsec-test")
        .join(id)
        .join(file)
}

fn counter(b: &ContainerBackend, id: &str) -> Option<u64> {
    let dir = b.get(id).unwrap().dir;
    std::fs::read_to_string(dir.join("rootfs/tmp/c"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Reads field `key` of `/proc/<pid>/status` on the host.
fn host_status(pid: i32, key: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")).map(|v| v.trim().to_string()))
        .unwrap()
}

#[test]
fn root_inside_is_an_unprivileged_id_range_of_its_own_outside_and_layers_keep_their_owners_on_crun_and_runc() {
    for runtime in [RuntimeChoice::Crun, RuntimeChoice::Runc] {
        user_namespace_of_its_own(&backend(runtime));
    }
}

fn user_namespace_of_its_own(b: &ContainerBackend) {
    let (x, y) = (unique_id("usx"), unique_id("usy"));
    let script = "cat /proc/self/uid_map; touch /etc/made-by-root; chown 1000:1000 /etc/made-by-root; \
        ls -ln /bin/busybox; echo mountinfo:; cat /proc/self/mountinfo; sleep 1000";
    for id in [&x, &y] {
        b.create(&busybox_spec(id, script)).unwrap();
    }
    let log_of = |id: &str| {
        wait_until("the script ran", Duration::from_secs(20), || {
            String::from_utf8_lossy(&b.read_log(id, 1 << 20).unwrap()).contains("mountinfo:")
        });
        std::thread::sleep(Duration::from_millis(200));
        String::from_utf8_lossy(&b.read_log(id, 1 << 20).unwrap()).into_owned()
    };
    let base_of = |log: &str| -> u64 {
        let map: Vec<u64> = log
            .lines()
            .next()
            .unwrap()
            .split_whitespace()
            .map(|n| n.parse().unwrap())
            .collect();
        assert_eq!((map[0], map[2]), (0, 65536), "{log}");
        map[1]
    };
    let (lx, ly) = (log_of(&x), log_of(&y));
    let (bx, by) = (base_of(&lx), base_of(&ly));
    assert!(bx >= 1 << 30 && by >= 1 << 30, "ranges above every host id: {bx} {by}");
    assert_ne!(bx, by, "each sandbox has its own range");
    // The image's files show their own owners inside (root), though the layer is shared
    // and was never chowned.
    assert!(
        lx.contains(" 0        0 ") || lx.contains(" 0 0 "),
        "busybox is root's inside: {lx}"
    );
    // Outside, the sandbox's root is the first id of its range, with no privilege there.
    let pid = b.state(&x).unwrap().init_pid.unwrap();
    assert_eq!(
        host_status(pid, "Uid").split_whitespace().next().unwrap(),
        bx.to_string()
    );
    // What root and `user` wrote is stored with the sandbox's own ids, so snapshots and
    // forks carry it to any other range unchanged.
    let upper = b.config().sandboxes_root.join(&x).join("disk/upper/etc/made-by-root");
    let meta = std::fs::metadata(&upper).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!((meta.uid(), meta.gid()), (1000, 1000));
    // No host path shows in the mount table.
    let sandboxes_root = b.config().sandboxes_root.display().to_string();
    let mountinfo = lx.split("mountinfo:").nth(1).unwrap();
    assert!(
        !mountinfo.contains(&sandboxes_root),
        "host paths in mountinfo:\n{mountinfo}"
    );
    assert!(!mountinfo.contains("/var/"), "host paths in mountinfo:\n{mountinfo}");
    assert!(mountinfo.contains("lowerdir=/proc/self/fd/"), "{mountinfo}");
    for id in [&x, &y] {
        b.delete(id).unwrap();
        assert_gone(b, id);
    }
}

#[test]
fn isolation_processes_network_proc_capabilities_seccomp_devices() {
    let b = backend(RuntimeChoice::Auto);
    let id = unique_id("iso");
    let script = "echo ps:; ps -o pid,comm; \
        echo net: $(ls /sys/class/net); \
        echo kpagecgroup=$(cat /proc/kpagecgroup 2>/dev/null | wc -c); \
        echo kcore=$(cat /proc/kcore 2>/dev/null | wc -c); \
        echo core_pattern=$(cat /proc/sys/kernel/core_pattern 2>/dev/null | wc -c); \
        grep -E '^(CapEff|Seccomp|NoNewPrivs):' /proc/self/status; \
        unshare -U true 2>/dev/null; echo unshare=$?; \
        mount -t tmpfs none /mnt 2>/dev/null; echo mount=$?; \
        echo sysrq > /proc/sysrq-trigger 2>/dev/null; echo sysrq=$?; \
        echo 1 > /proc/sys/kernel/panic 2>/dev/null; echo procsys=$?; \
        echo dev: $(ls /dev); \
        test -e /work; echo hostpath=$?";
    let (exit, log) = run_to_exit(&b, &busybox_spec(&id, script));
    assert_eq!(exit.exit_code, 0, "{log}");
    let ps: Vec<&str> = log
        .lines()
        .skip_while(|l| *l != "ps:")
        .skip(2)
        .take_while(|l| !l.starts_with("net:"))
        .collect();
    assert!(
        ps.len() <= 2 && ps.iter().all(|l| l.ends_with(" sh") || l.ends_with(" ps")),
        "foreign processes visible: {ps:?}\n{log}"
    );
    assert!(
        ps.iter().any(|l| l.trim_start().starts_with("1 ")),
        "sh is not PID 1: {ps:?}"
    );
    assert!(log.contains("net: lo\n"), "network interfaces other than lo:\n{log}");
    assert!(
        log.contains("kpagecgroup=0\n") && log.contains("kcore=0\n") && log.contains("core_pattern=0\n"),
        "host-revealing files are masked: {log}"
    );
    let cap_eff = log
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap();
    for (bit, name) in [
        (21, "SYS_ADMIN"),
        (12, "NET_ADMIN"),
        (19, "SYS_PTRACE"),
        (16, "SYS_MODULE"),
        (17, "SYS_RAWIO"),
        (27, "MKNOD"),
        (13, "NET_RAW"),
    ] {
        assert_eq!(cap_eff & (1 << bit), 0, "{name} is effective: {cap_eff:x}");
    }
    for want in ["Seccomp:\t2", "NoNewPrivs:\t1", "unshare=1", "hostpath=1"] {
        assert!(log.contains(want), "expected {want:?} in:\n{log}");
    }
    assert!(
        !log.contains("sysrq=0") && !log.contains("procsys=0") && !log.contains("mount=0"),
        "{log}"
    );
    let devs: Vec<&str> = log
        .lines()
        .find_map(|l| l.strip_prefix("dev: "))
        .unwrap()
        .split(' ')
        .collect();
    let allowed = [
        "core", "fd", "full", "mqueue", "null", "ptmx", "pts", "random", "shm", "stderr", "stdin", "stdout", "tty",
        "urandom", "zero",
    ];
    assert!(devs.iter().all(|d| allowed.contains(d)), "unexpected devices: {devs:?}");
}

#[test]
fn fork_bomb_is_stopped_by_the_pids_limit_and_another_sandbox_stays_responsive() {
    let b = backend(RuntimeChoice::Auto);
    let bomb = unique_id("bomb");
    let mut spec = busybox_spec(&bomb, "bomb() { bomb | bomb & }; bomb; sleep 1000");
    spec.limits.pids = 64;
    spec.limits.cpu_millis = 500;
    b.create(&spec).unwrap();
    // The limit is reached and refusals counted.
    let events = cgroup_file("pids", &bomb, "pids.events");
    wait_until("the pids limit to refuse forks", Duration::from_secs(10), || {
        std::fs::read_to_string(&events)
            .unwrap_or_default()
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
            > 0
    });
    let current: u64 = std::fs::read_to_string(cgroup_file("pids", &bomb, "pids.current"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(current <= 64, "pids.current = {current}");
    // Meanwhile another sandbox starts and answers promptly.
    let start = Instant::now();
    let other = unique_id("bystander");
    let (exit, log) = run_to_exit(&b, &busybox_spec(&other, "echo alive"));
    assert_eq!((exit.exit_code, log.as_str()), (0, "alive\n"));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "bystander took {:?}",
        start.elapsed()
    );
    b.delete(&bomb).unwrap();
    assert_gone(&b, &bomb);
}

#[test]
fn exceeding_the_memory_limit_kills_only_that_sandbox_and_records_oom() {
    let b = backend(RuntimeChoice::Auto);
    let bystander = unique_id("calm");
    b.create(&busybox_spec(&bystander, "sleep 1000")).unwrap();
    let hog = unique_id("hog");
    let mut spec = busybox_spec(&hog, "");
    spec.process.args = ["/bin/dd", "if=/dev/zero", "of=/dev/null", "bs=256M", "count=1"]
        .map(String::from)
        .to_vec();
    spec.limits.memory_bytes = 32 << 20;
    let (exit, log) = run_to_exit(&b, &spec);
    assert!(exit.oom_killed, "no OOM recorded: {exit:?} {log}");
    assert_eq!((exit.signal, exit.exit_code), (Some(9), 137), "{log}");
    assert_eq!(b.state(&bystander).unwrap().status, SandboxStatus::Running);
    b.delete(&bystander).unwrap();
    assert_gone(&b, &bystander);
}

#[test]
fn writes_stop_at_the_sandbox_disk_limit_and_the_host_is_unaffected() {
    let b = backend(RuntimeChoice::Auto);
    let id = unique_id("fill");
    let mut spec = busybox_spec(
        &id,
        "yes > /home/user/fill; echo yes=$?; dd if=/dev/zero of=/tmp/more bs=1M count=100 2>/dev/null; echo dd=$?; ls -l /home/user/fill",
    );
    spec.process.user = (1000, 1000);
    spec.limits.disk_bytes = 64 << 20;
    b.create(&spec).unwrap();
    let exit = b.wait(&id, Duration::from_secs(60)).unwrap().expect("exits");
    let log = String::from_utf8_lossy(&b.read_log(&id, 1 << 16).unwrap()).into_owned();
    let dir = b.get(&id).unwrap().dir;
    // Everything the sandbox wrote landed in disk.img: the host side of the sandbox (its
    // directory, without the mounts) holds at most the disk size. (Free space of the
    // host file system is not compared: other work on the machine moves it.)
    let allocated: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| !["disk", "rootfs"].contains(&&*e.file_name().to_string_lossy()))
        .map(|e| e.metadata().unwrap().blocks() * 512)
        .sum();
    assert_eq!(exit.exit_code, 0, "{log}");
    assert!(
        log.contains("yes=1") && log.contains("dd=1"),
        "writes did not fail at the limit:\n{log}"
    );
    let size: u64 = log
        .lines()
        .last()
        .unwrap()
        .split_whitespace()
        .nth(4)
        .unwrap()
        .parse()
        .unwrap();
    assert!(size > 40 << 20 && size <= 64 << 20, "file size {size}");
    assert!(
        allocated <= 65 << 20,
        "the sandbox uses {allocated} bytes of the host's disk"
    );
    b.delete(&id).unwrap();
    assert_gone(&b, &id);
}

#[test]
fn pause_freezes_and_resume_thaws() {
    let b = backend(RuntimeChoice::Auto);
    let id = unique_id("pause");
    b.create(&busybox_spec(
        &id,
        "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; usleep 10000; done",
    ))
    .unwrap();
    wait_until("the counter to start", Duration::from_secs(5), || {
        counter(&b, &id).is_some_and(|c| c > 2)
    });
    b.pause(&id).unwrap();
    assert_eq!(b.state(&id).unwrap().status, SandboxStatus::Paused);
    let frozen = counter(&b, &id).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(counter(&b, &id).unwrap(), frozen, "the counter advanced while paused");
    b.resume(&id).unwrap();
    assert_eq!(b.state(&id).unwrap().status, SandboxStatus::Running);
    wait_until("the counter to advance after resume", Duration::from_secs(5), || {
        counter(&b, &id).is_some_and(|c| c > frozen + 2)
    });
    // Deleting a paused sandbox works too.
    b.pause(&id).unwrap();
    b.delete(&id).unwrap();
    assert_gone(&b, &id);
}

#[test]
fn pid1_gets_extra_fds_and_read_only_host_binds() {
    let b = backend(RuntimeChoice::Auto);
    let tmp = tempfile::tempdir().unwrap();
    let agent = tmp.path().join("agent");
    std::fs::write(&agent, "#!/bin/sh\necho agent-here\n").unwrap();
    std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let listener = std::os::unix::net::UnixListener::bind(tmp.path().join("agent.sock")).unwrap();
    let id = unique_id("fds");
    let mut spec = busybox_spec(
        &id,
        "readlink /proc/self/fd/3; /.opendsec/agent; \
        (echo x > /.opendsec/agent) 2>/dev/null && echo WRITABLE || echo read-only; ls /proc/self/fd | wc -l",
    );
    spec.binds.push(BindMount {
        host_path: agent.clone(),
        container_path: "/.opendsec/agent".into(),
    });
    spec.extra_fds.push(listener.as_raw_fd());
    let (exit, log) = run_to_exit(&b, &spec);
    assert_eq!(exit.exit_code, 0, "{log}");
    let lines: Vec<&str> = log.lines().collect();
    assert!(lines[0].starts_with("socket:["), "fd 3 is not the socket: {log}");
    assert_eq!(&lines[1..3], &["agent-here", "read-only"], "{log}");
    // 0, 1, 2, 3 and the one `ls` opens for the directory: nothing else leaked in.
    assert_eq!(lines[3].trim(), "5", "unexpected fds in the sandbox: {log}");
    assert_eq!(std::fs::read_to_string(&agent).unwrap(), "#!/bin/sh\necho agent-here\n");
}

#[test]
fn pid1_output_is_capped() {
    require_prerequisites();
    let tmp = tempfile::Builder::new()
        .prefix("opendsec-ct")
        .tempdir_in("/var/tmp")
        .unwrap();
    let mut config = config_in(tmp.path(), RuntimeChoice::Auto);
    config.log_cap_bytes = 64 << 10;
    let b = ContainerBackend::new(config).unwrap();
    let id = unique_id("log");
    b.create(&busybox_spec(&id, "yes | head -c 3000000; echo END")).unwrap();
    b.wait(&id, Duration::from_secs(30)).unwrap().expect("exits");
    let dir = b.get(&id).unwrap().dir;
    let total: u64 = ["output.log", "output.log.1"]
        .iter()
        .map(|f| std::fs::metadata(dir.join(f)).map(|m| m.len()).unwrap_or(0))
        .sum();
    assert!(total <= 128 << 10, "output logs hold {total} bytes");
    assert!(String::from_utf8_lossy(&b.read_log(&id, 16).unwrap()).ends_with("y\nEND\n"));
    b.delete(&id).unwrap();
}

#[test]
fn bad_requests_are_refused_and_leave_nothing() {
    let b = backend(RuntimeChoice::Auto);
    let mut spec = busybox_spec("../escape", "true");
    assert!(matches!(b.create(&spec), Err(ContainerError::Invalid(_))));
    spec.id = unique_id("bad");
    spec.limits.memory_bytes = 0;
    assert!(matches!(b.create(&spec), Err(ContainerError::Invalid(_))));
    let mut spec = busybox_spec(&unique_id("bad"), "true");
    spec.layers = vec!["/nonexistent/layer".into()];
    assert!(matches!(b.create(&spec), Err(ContainerError::Invalid(_))));
    // A program that does not exist: the runtime's error comes back, nothing is left.
    let mut spec = busybox_spec(&unique_id("bad"), "true");
    spec.process.args = vec!["/no/such/program".into()];
    let err = b.create(&spec).unwrap_err();
    assert!(matches!(err, ContainerError::Shim { .. }), "{err}");
    assert_gone(&b, &spec.id);
    // The same id twice.
    let spec = busybox_spec(&unique_id("dup"), "sleep 100");
    b.create(&spec).unwrap();
    assert!(matches!(b.create(&spec), Err(ContainerError::AlreadyExists(_))));
    b.delete(&spec.id).unwrap();
    assert!(b.list().unwrap().is_empty());
}

const HELPER_ENV: &str = "OPENDSEC_TEST_CREATOR_ROOT";

/// The creator process of the test below (the test binary run again with
/// [`HELPER_ENV`] set): it creates a sandbox, says so, and waits to be killed.
fn act_as_creator(root: &std::ffi::OsStr) -> ! {
    let id = std::env::var("OPENDSEC_TEST_CREATOR_ID").unwrap();
    let b = ContainerBackend::new(config_in(Path::new(root), RuntimeChoice::Auto)).unwrap();
    b.create(&busybox_spec(
        &id,
        "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; usleep 10000; done",
    ))
    .unwrap();
    println!("CREATED");
    use std::io::Write;
    let _ = std::io::stdout().flush();
    std::thread::sleep(Duration::from_secs(600));
    std::process::exit(0)
}

#[test]
fn a_sandbox_survives_the_death_of_its_creator_and_is_readopted() {
    if let Some(root) = std::env::var_os(HELPER_ENV) {
        act_as_creator(&root);
    }
    require_prerequisites();
    image("busybox");
    let tmp = tempfile::Builder::new()
        .prefix("opendsec-ct")
        .tempdir_in("/var/tmp")
        .unwrap();
    let id = unique_id("orphan");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_sandbox_survives_the_death_of_its_creator_and_is_readopted",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(HELPER_ENV, tmp.path())
        .env("OPENDSEC_TEST_CREATOR_ID", &id)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while !String::from_utf8_lossy(&seen).contains("CREATED") {
        let n = out.read(&mut buf).unwrap();
        assert!(n > 0, "the creator exited early: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    // kill -9 the creator (the "edge").
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    child.wait().unwrap();

    // A new backend over the same directories ("the restarted edge") finds it running.
    let b = ContainerBackend::new(config_in(tmp.path(), RuntimeChoice::Auto)).unwrap();
    let listed: Vec<String> = b.list().unwrap().into_iter().map(|h| h.id).collect();
    assert_eq!(listed, vec![id.clone()]);
    let state = b.state(&id).unwrap();
    assert_eq!(state.status, SandboxStatus::Running);
    let before = counter(&b, &id).unwrap_or(0);
    wait_until("the orphaned sandbox to keep counting", Duration::from_secs(5), || {
        counter(&b, &id).is_some_and(|c| c > before + 2)
    });
    // Its shim is not a child of anyone we know: its parent is init (or a subreaper).
    let shim_pid: i32 = std::fs::read_to_string(b.get(&id).unwrap().dir.join("shim.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let ppid = std::fs::read_to_string(format!("/proc/{shim_pid}/stat"))
        .unwrap()
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<i32>()
        .unwrap();
    assert_ne!(ppid as u32, std::process::id());

    b.kill(&id, libc::SIGTERM).unwrap();
    // sh as PID 1 ignores SIGTERM (no handler in a pid namespace): it keeps running.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(b.state(&id).unwrap().status, SandboxStatus::Running);
    b.delete(&id).unwrap();
    assert_gone(&b, &id);
    assert!(b.list().unwrap().is_empty());
}

#[test]
fn base_image_runs_python_as_user() {
    require_prerequisites();
    let found = ["/usr/sbin", "/usr/bin"]
        .iter()
        .any(|d| Path::new(d).join("debootstrap").is_file());
    assert!(found, "debootstrap is missing: install the debootstrap package");
    let start = Instant::now();
    let img = image("base");
    eprintln!("base image ready in {:?}", start.elapsed());
    let b = backend(RuntimeChoice::Auto);
    let id = unique_id("base");
    let mut spec = SandboxSpec::from_image(
        &id,
        &store(),
        &img,
        vec![
            "/bin/bash".into(),
            "-c".into(),
            "python3 -c 'print(6*7)'; id -un; pwd".into(),
        ],
    )
    .unwrap();
    spec.process.user = (1000, 1000);
    let (exit, log) = run_to_exit(&b, &spec);
    assert_eq!(exit.exit_code, 0, "{log}");
    assert_eq!(log, "42\nuser\n/home/user\n");
    assert_gone(&b, &id);
}

#[test]
fn warm_disks_are_made_ahead_used_by_creates_still_bound_writes_and_leave_nothing() {
    require_prerequisites();
    let tmp = tempfile::Builder::new()
        .prefix("opendsec-warm")
        .tempdir_in("/var/tmp")
        .unwrap();
    let root = tmp.path().join("sandboxes");
    let warm_dirs = || -> Vec<PathBuf> {
        std::fs::read_dir(&root)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with(".warm-"))
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default()
    };
    // A killed edge left a mounted warm disk: the next backend tears it down first.
    let mut cfg = config_in(tmp.path(), RuntimeChoice::Auto);
    cfg.warm_disks = 2;
    {
        let b = ContainerBackend::new(cfg.clone()).unwrap();
        wait_until("two warm disks", Duration::from_secs(30), || b.warm_disks_ready() == 2);
        // Dropped without drain, as a kill -9 would.
    }
    let left = warm_dirs();
    assert!(
        !left.is_empty() && left.iter().all(|d| is_mounted(&d.join("disk"))),
        "{left:?}"
    );
    let b = ContainerBackend::new(cfg).unwrap();
    for d in &left {
        assert!(
            !d.exists(),
            "a warm disk left by the last edge is torn down: {}",
            d.display()
        );
    }
    wait_until("two warm disks", Duration::from_secs(30), || b.warm_disks_ready() == 2);

    // A create takes one (its directory is the warm disk renamed) and the pool refills;
    // writes are still bounded by the disk's size.
    let id = unique_id("warm");
    let spec = busybox_spec(&id, "yes > /home/user/fill; echo yes=$?; df -k / | tail -1");
    b.create(&spec).unwrap();
    let exit = b.wait(&id, Duration::from_secs(60)).unwrap().expect("exits");
    let log = String::from_utf8_lossy(&b.read_log(&id, 1 << 16).unwrap()).into_owned();
    assert_eq!(exit.exit_code, 0, "{log}");
    assert!(
        log.contains("yes=1"),
        "writes did not stop at the warm disk's limit:\n{log}"
    );
    wait_until("the pool refilled", Duration::from_secs(30), || {
        b.warm_disks_ready() == 2
    });
    b.delete(&id).unwrap();
    assert_gone(&b, &id);

    // A sandbox asking for another size makes its own disk.
    let id = unique_id("cold");
    let mut spec = busybox_spec(&id, "true");
    spec.limits.disk_bytes = 32 << 20;
    run_to_exit(&b, &spec);
    assert_gone(&b, &id);
    assert_eq!(b.warm_disks_ready(), 2);

    // Drained (an edge that stops): no warm disk, no mount left.
    b.drain_warm_disks();
    assert!(warm_dirs().is_empty(), "{:?}", warm_dirs());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mountinfo.contains(&*root.to_string_lossy()),
        "mounts left under {}:\n{mountinfo}",
        root.display()
    );
}

/// The cgroup directories of runtime id `rid` (v1 controllers, or the v2 group).
fn cgroup_dirs(rid: &str) -> Vec<PathBuf> {
    ["memory", "pids", "cpu", "cpuset", "freezer", ""]
        .iter()
        .map(|c| Path::new("/sys/fs/cgroup").join(c).join("opendsec-test").join(rid))
        .filter(|p| p.exists())
        .collect()
}

fn memory_limit(rid: &str) -> u64 {
    let v1 = cgroup_file("memory", rid, "memory.limit_in_bytes");
    let v2 = Path::new("/sys/fs/cgroup/opendsec-test").join(rid).join("memory.max");
    std::fs::read_to_string(if v1.exists() { v1 } else { v2 })
        .expect("memory limit")
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_warm_container_waits_unstarted_then_runs_as_the_sandbox_that_claims_it_with_its_id_and_limits() {
    use opendsec_edge::container::warm::{Claim, WARM_ID_PREFIX};
    for runtime in [RuntimeChoice::Crun, RuntimeChoice::Runc] {
        let b = backend(runtime);
        let warm = format!("{WARM_ID_PREFIX}{}", unique_id("w"));
        let spec = busybox_spec(&warm, "echo started; hostname; nproc; sleep 2");
        b.create_unstarted(&spec).unwrap();
        let warm_dir = b.config().sandboxes_root.join(format!(".{warm}"));
        assert!(
            warm_dir.join("rootfs/bin/sh").exists(),
            "{runtime:?}: its root file system is mounted"
        );
        assert_eq!(b.unstarted(), vec![warm.clone()]);
        assert!(b.list().unwrap().is_empty(), "a warm container is no sandbox");
        std::thread::sleep(Duration::from_millis(200));
        let out = std::fs::read(warm_dir.join("output.log")).unwrap_or_default();
        assert!(
            out.is_empty(),
            "{runtime:?}: PID 1 ran its program before start: {out:?}"
        );

        // Claimed with other memory and CPU limits and labels: two CPUs where the host
        // has them (made with one: the claim sets its cpuset).
        let id = unique_id("claimed");
        let host_cpus = std::thread::available_parallelism().unwrap().get();
        let cpus = host_cpus.min(2);
        let limits = Limits {
            memory_bytes: 96 << 20,
            cpu_millis: if cpus == 2 { 1500 } else { 500 },
            ..spec.limits.clone()
        };
        let labels = [("task".to_string(), "t1".to_string())].into();
        let h = b
            .claim(
                &warm,
                &Claim {
                    id: &id,
                    limits: &limits,
                    labels: &labels,
                    started: false,
                },
            )
            .unwrap();
        assert_eq!(h.dir, b.config().sandboxes_root.join(&id));
        assert!(!warm_dir.exists() && b.unstarted().is_empty());
        let rec = b.get(&id).unwrap().record;
        assert_eq!(
            (rec.runtime_id(), &rec.labels, rec.limits.memory_bytes),
            (warm.as_str(), &labels, 96 << 20)
        );
        assert_eq!(
            memory_limit(&warm),
            96 << 20,
            "{runtime:?}: the claim's memory limit is the cgroup's"
        );
        let cpuset = ["cpuset/opendsec-test", "opendsec-test"]
            .iter()
            .map(|d| Path::new("/sys/fs/cgroup").join(d).join(&warm).join("cpuset.cpus"))
            .find_map(|f| std::fs::read_to_string(f).ok())
            .expect("the container's cpuset");
        let cpuset_cpus = opendsec_edge::container::cpus::parse(&cpuset).len();
        assert_eq!(
            cpuset_cpus, cpus,
            "{runtime:?}: the claim's CPUs are the cgroup's: {cpuset}"
        );
        if let Some(set) = &rec.cpus {
            assert_eq!(set.as_str(), cpuset.trim(), "{runtime:?}: recorded as it is");
        }
        assert_eq!(b.state(&id).unwrap().status, SandboxStatus::Running);
        let exit = b.wait(&id, Duration::from_secs(30)).unwrap().expect("exits");
        let log = String::from_utf8_lossy(&b.read_log(&id, 1 << 16).unwrap()).into_owned();
        assert_eq!(
            (exit.exit_code, log.as_str()),
            (0, format!("started\n{id}\n{cpus}\n").as_str()),
            "{runtime:?}: the hostname is the sandbox's id, nproc its CPUs"
        );
        b.delete(&id).unwrap();
        assert_gone(&b, &id);
        assert!(
            cgroup_dirs(&warm).is_empty(),
            "{runtime:?}: cgroups left: {:?}",
            cgroup_dirs(&warm)
        );
        assert!(
            b.runtime().run(&["state", &warm]).is_err(),
            "{runtime:?}: the runtime forgot it"
        );
    }
}

#[test]
fn a_warm_container_started_ahead_keeps_its_running_pid_1_when_claimed_and_takes_the_sandboxs_name_and_limits() {
    use opendsec_edge::container::warm::{Claim, WARM_ID_PREFIX};
    let b = backend(RuntimeChoice::Crun);
    let warm = format!("{WARM_ID_PREFIX}{}", unique_id("s"));
    // PID 1 prints its hostname every 50 ms.
    let spec = busybox_spec(&warm, "while true; do hostname; sleep 0.05; done");
    b.create_unstarted(&spec).unwrap();
    b.start_unstarted(&warm).unwrap();
    let warm_dir = b.config().sandboxes_root.join(format!(".{warm}"));
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !String::from_utf8_lossy(&std::fs::read(warm_dir.join("output.log")).unwrap_or_default()).contains(&warm) {
        assert!(
            std::time::Instant::now() < deadline,
            "PID 1 started ahead runs before any claim"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pid = std::fs::read_to_string(warm_dir.join("init.pid")).unwrap();
    let used = b.unstarted_memory(&warm).expect("its cgroup's memory is read");
    assert!(used < 64 << 20, "a shell loop uses little: {used}");

    let id = unique_id("ahead");
    let limits = Limits {
        memory_bytes: 80 << 20,
        ..spec.limits.clone()
    };
    let claim = Claim {
        id: &id,
        limits: &limits,
        labels: &Default::default(),
        started: true,
    };
    b.claim(&warm, &claim).unwrap();
    let dir = b.config().sandboxes_root.join(&id);
    assert_eq!(
        std::fs::read_to_string(dir.join("init.pid")).unwrap(),
        pid,
        "the same PID 1 runs on"
    );
    assert_eq!(
        memory_limit(&warm),
        80 << 20,
        "the claim's memory limit is the cgroup's"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let log = String::from_utf8_lossy(&b.read_log(&id, 1 << 16).unwrap()).into_owned();
        if log.contains(&format!("\n{id}\n")) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the hostname is the sandbox's id: {log:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(b.state(&id).unwrap().status, SandboxStatus::Running);
    b.delete(&id).unwrap();
    assert_gone(&b, &id);
}

#[test]
fn a_warm_container_that_cannot_be_claimed_or_is_discarded_leaves_nothing() {
    use opendsec_edge::container::warm::{Claim, WARM_ID_PREFIX};
    let b = backend(RuntimeChoice::Auto);
    assert!(matches!(
        b.create_unstarted(&busybox_spec("notwarm", "true")),
        Err(ContainerError::Invalid(_))
    ));

    // Another pids limit than it was made with: refused, and the warm container is gone.
    let warm = format!("{WARM_ID_PREFIX}{}", unique_id("w"));
    let spec = busybox_spec(&warm, "true");
    b.create_unstarted(&spec).unwrap();
    let id = unique_id("refused");
    let limits = Limits {
        pids: 7,
        ..spec.limits.clone()
    };
    let err = b
        .claim(
            &warm,
            &Claim {
                id: &id,
                limits: &limits,
                labels: &Default::default(),
                started: false,
            },
        )
        .unwrap_err();
    assert!(err.to_string().contains("pids"), "{err}");
    assert!(b.unstarted().is_empty() && cgroup_dirs(&warm).is_empty());
    assert_gone(&b, &id);

    // Discarded unclaimed (an edge that stops).
    let warm = format!("{WARM_ID_PREFIX}{}", unique_id("w"));
    b.create_unstarted(&busybox_spec(&warm, "true")).unwrap();
    let dir = b.config().sandboxes_root.join(format!(".{warm}"));
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(mountinfo.contains(&*dir.to_string_lossy()));
    b.discard_unstarted(&warm);
    assert!(!dir.exists() && b.unstarted().is_empty() && cgroup_dirs(&warm).is_empty());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mountinfo.contains(&*dir.to_string_lossy()),
        "mounts left under {}",
        dir.display()
    );
}

/// Probes the seccomp profile from inside a sandbox (python3, as root): one `name=result`
/// line per check, the result `ok` or the errno's name. `eperm_*` must fail with EPERM,
/// `ok_*` must succeed; the others are checked one by one.
const SECCOMP_PROBE: &str = r#"
import ctypes, errno, os, socket, struct, subprocess, sys

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.syscall.argtypes = [ctypes.c_long] + [ctypes.c_ulong] * 6
M64 = (1 << 64) - 1
HIGH = 1 << 32


def sc(nr, *args):
    args = [a & M64 for a in args] + [0] * (6 - len(args))
    ctypes.set_errno(0)
    r = libc.syscall(nr, *args)
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))


def report(name, result):
    print(f"{name}={result}", flush=True)


# Refused. Where the kernel itself would fail the call, the arguments make it fail with
# another errno than EPERM, so EPERM is the filter's (init_module, kexec_load, mount...
# fail with EPERM or ENOSYS either way without the capability or the kernel feature).
me = os.getpid()
for name, nr, args in [
    ("io_uring_setup", 425, (1, 0)), ("io_uring_enter", 426, (-1, 0, 0, 0, 0, 0)),
    ("io_uring_register", 427, (-1, 0, 0, 0)), ("userfaultfd", 323, (0xffffffff,)),
    ("keyctl", 250, (0xffff, 0, 0, 0, 0)), ("add_key", 248, (0, 0, 0, 0, 0)),
    ("request_key", 249, (0, 0, 0, 0)), ("perf_event_open", 298, (0, 0, -1, -1, 0)),
    ("bpf", 321, (9999, 0, 0)), ("init_module", 175, (0, 0, 0)), ("finit_module", 313, (-1, 0, 0)),
    ("delete_module", 176, (0, 0)), ("kexec_load", 246, (0, 0, 0, 0)),
    ("kexec_file_load", 320, (-1, -1, 0, 0, 0)), ("mount", 165, (0, 0, 0, 0, 0)),
    ("umount2", 166, (0, 0)), ("fsopen", 430, (0, 0)), ("fsconfig", 431, (-1, 0, 0, 0, 0)),
    ("fsmount", 432, (-1, 0, 0)), ("fspick", 433, (-1, 0, 0)), ("move_mount", 429, (-1, 0, -1, 0, 0)),
    ("open_tree", 428, (-1, 0, 0)), ("mount_setattr", 442, (-1, 0, 0xffffffff, 0, 0)),
    ("pivot_root", 155, (0, 0)), ("setns", 308, (-1, 0)), ("ptrace", 101, (0x4206, 999999, 0, 0)),
    ("process_vm_readv", 310, (999999, 0, 0, 0, 0, 1)), ("process_vm_writev", 311, (999999, 0, 0, 0, 0, 1)),
    ("kcmp", 312, (me, me, 0, 0, 0)), ("pidfd_getfd", 438, (-1, 0, 0)),
    ("name_to_handle_at", 303, (-1, 0, 0, 0, 0xffffffff)), ("open_by_handle_at", 304, (-1, 0, 0)),
    ("swapon", 167, (0, 0)), ("swapoff", 168, (0,)), ("reboot", 169, (0, 0, 0, 0)), ("acct", 163, (0,)),
    ("quotactl", 179, (0, 0, 0, 0)), ("lookup_dcookie", 212, (0, 0, 0)), ("iopl", 172, (3,)),
    ("ioperm", 173, (0, 1, 1)), ("uselib", 134, (0,)), ("vhangup", 153, ()), ("modify_ldt", 154, (0, 0, 0)),
    ("syslog", 103, (10, 0, 0)), ("personality_READ_IMPLIES_EXEC", 135, (0x0400000,)),
    ("personality_ADDR_NO_RANDOMIZE", 135, (0x0040000,)), ("unshare_NEWUSER", 272, (0x10000000,)),
    ("socket_VSOCK", 41, (40, 1, 0)), ("socket_VSOCK_high_bits", 41, (40 | HIGH, 1, 0)),
    ("socket_ALG", 41, (38, 5, 0)), ("socket_PACKET", 41, (17, 3, 0)), ("socketpair_INET", 53, (2, 1, 0, 0)),
]:
    report(f"eperm_{name}", sc(nr, *args))
# Each namespace flag: with CLONE_THREAD but not CLONE_SIGHAND (clone) or an invalid bit
# (unshare), the kernel would say EINVAL.
CLONE_THREAD, CLONE_FILES = 0x10000, 0x400
for flag, bit in [("NEWNS", 0x20000), ("NEWCGROUP", 0x2000000), ("NEWUTS", 0x4000000), ("NEWIPC", 0x8000000),
                  ("NEWUSER", 0x10000000), ("NEWPID", 0x20000000), ("NEWNET", 0x40000000), ("NEWTIME", 0x80)]:
    report(f"eperm_clone_{flag}", sc(56, bit | CLONE_THREAD, 0, 0, 0, 0))
    report(f"eperm_unshare_{flag}", sc(272, bit | 1))
report("clone3", sc(435, 0, 0))
report("clone_reaches_the_kernel", sc(56, CLONE_THREAD, 0, 0, 0, 0))
report("unshare_reaches_the_kernel", sc(272, 1))
report("ok_unshare_CLONE_FILES", sc(272, CLONE_FILES))
for name, value in [("query", 0xffffffff), ("query_sign_extended", M64), ("linux", 0)]:
    report(f"ok_personality_{name}", sc(135, value))
for name, family, kind in [("INET", 2, 1), ("INET_high_bits", 2 | HIGH, 1), ("INET6", 10, 1), ("UNIX", 1, 1),
                           ("NETLINK", 16, 3)]:
    report(f"ok_socket_{name}", sc(41, family, kind | 0x80000, 0))
pair = (ctypes.c_int * 2)()
report("ok_socketpair_UNIX", sc(53, 1, 1, 0, ctypes.addressof(pair)))

# ioctl: /dev/null is no terminal, so a request that reaches the kernel gets ENOTTY.
TIOCSTI, TIOCLINUX, TIOCSETD, TCGETS, TIOCGWINSZ, TIOCSWINSZ, TIOCSCTTY, FIONREAD = (
    0x5412, 0x541C, 0x5423, 0x5401, 0x5413, 0x5414, 0x540E, 0x541B)
null = os.open("/dev/null", os.O_RDWR)
buf = ctypes.create_string_buffer(64)
for name, request in [("TIOCSTI", TIOCSTI), ("TIOCSTI_high_bits", TIOCSTI | HIGH),
                      ("TIOCSTI_sign_extended", TIOCSTI | 0xffffffff00000000), ("TIOCLINUX", TIOCLINUX),
                      ("TIOCSETD", TIOCSETD)]:
    report(f"eperm_ioctl_{name}", sc(16, null, request, ctypes.addressof(buf)))
for name, request in [("TCGETS", TCGETS), ("TIOCGPTN_sign_extended", 0xffffffff80045430),
                      ("TIOCSTI_plus_one", TIOCSTI + 1)]:
    report(f"ioctl_reaches_the_kernel_{name}", sc(16, null, request, ctypes.addressof(buf)))
master, slave = os.openpty()
report("eperm_ioctl_pty_TIOCSTI", sc(16, slave, TIOCSTI, ctypes.addressof(ctypes.c_char(b"x"))))
report("ok_ioctl_pty_TIOCGWINSZ", sc(16, slave, TIOCGWINSZ, ctypes.addressof(buf)))
size = ctypes.create_string_buffer(struct.pack("HHHH", 30, 100, 0, 0))
report("ok_ioctl_pty_TIOCSWINSZ", sc(16, master, TIOCSWINSZ, ctypes.addressof(size)))
report("ok_ioctl_pty_TCGETS", sc(16, slave, TCGETS, ctypes.addressof(buf)))
pid = os.fork()
if pid == 0:
    os.setsid()
    os._exit(0 if libc.ioctl(slave, TIOCSCTTY, 0) == 0 else 1)
report("ok_ioctl_pty_TIOCSCTTY_after_setsid", "ok" if os.waitpid(pid, 0)[1] == 0 else "failed")
r, w = os.pipe()
os.write(w, b"abc")
n = ctypes.c_int(0)
result = sc(16, r, FIONREAD, ctypes.addressof(n))
report("ok_ioctl_pipe_FIONREAD", result if result != "ok" or n.value == 3 else f"read {n.value}")

# The 32-bit x86 ABI: getpid through `int 0x80` from a 64-bit process, in a child.
code = ("import ctypes, mmap; m = mmap.mmap(-1, 4096, prot=7); "
        "m.write(bytes([0xb8, 20, 0, 0, 0, 0xcd, 0x80, 0xc3])); "
        "print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))())")
p = subprocess.run([sys.executable, "-c", code], capture_output=True)
report("int80", f"signal{-p.returncode}" if p.returncode < 0 else f"exit{p.returncode}")
# The x32 ABI: getpid with the x32 bit set in the number, in a child.
code = "import ctypes; ctypes.CDLL(None).syscall(ctypes.c_long(0x40000027))"
p = subprocess.run([sys.executable, "-c", code], capture_output=True)
report("x32", f"signal{-p.returncode}" if p.returncode < 0 else f"exit{p.returncode}")


# Ordinary work.
def threads():
    import threading
    out = []
    ts = [threading.Thread(target=out.append, args=(i,)) for i in range(8)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return sorted(out) == list(range(8))


def process_pool():
    import multiprocessing
    with multiprocessing.Pool(2) as pool:
        return pool.map(abs, [-1, -2, -3]) == [1, 2, 3]


def shell_pipeline():
    p = subprocess.run("seq 1 100 | sort -rn | head -1", shell=True, capture_output=True, text=True)
    return p.stdout == "100\n"


def child_as_another_user():
    p = subprocess.run(["id", "-u"], user=1000, group=1000, extra_groups=[], capture_output=True, text=True)
    return p.stdout == "1000\n"


def tcp_on_loopback():
    import threading
    server = socket.create_server(("127.0.0.1", 0))
    t = threading.Thread(target=lambda: server.accept()[0].sendall(b"hi"))
    t.start()
    with socket.create_connection(server.getsockname()) as c:
        data = c.recv(2)
    t.join()
    return data == b"hi"


def netlink():
    names = [name for _, name in socket.if_nameindex()]
    return names == ["lo"] and len(socket.getaddrinfo("127.0.0.1", 80, flags=socket.AI_ADDRCONFIG)) > 0


def event_fds_and_memory():
    import mmap, select
    e = os.eventfd(0)
    ep = select.epoll()
    ep.register(e, select.EPOLLIN)
    os.eventfd_write(e, 1)
    mfd = os.memfd_create("probe")
    os.ftruncate(mfd, 4096)
    m = mmap.mmap(mfd, 4096)
    m[:2] = b"ok"
    return (ep.poll(1) == [(e, select.EPOLLIN)] and bytes(m[:2]) == b"ok"
            and os.pidfd_open(os.getpid()) > 0 and len(os.sched_getaffinity(0)) > 0)


def posix_spawn():
    pid = os.posix_spawn("/bin/true", ["true"], {})
    return os.waitpid(pid, 0)[1] == 0


for f in [threads, process_pool, shell_pipeline, child_as_another_user, tcp_on_loopback, netlink,
          event_fds_and_memory, posix_spawn]:
    try:
        report(f"ok_work_{f.__name__}", "ok" if f() else "wrong result")
    except Exception as e:
        report(f"ok_work_{f.__name__}", f"{type(e).__name__}: {e}".replace("\n", " "))
"#;

/// As root in a `base` sandbox: the kernel interfaces the profile refuses fail with EPERM
/// (where the kernel would answer otherwise, with arguments that make it say another
/// errno, so the EPERM is the filter's), also with junk in an argument's upper half;
/// allowed calls reach the kernel; the 32-bit ABI kills; and ordinary work runs.
#[test]
fn seccomp_refuses_kernel_interfaces_to_root_and_ordinary_work_runs_on_crun_and_runc() {
    let img = image("base");
    for runtime in [RuntimeChoice::Crun, RuntimeChoice::Runc] {
        let b = backend(runtime);
        let id = unique_id("seccomp");
        let script = "echo pipeline=$(seq 1 1000 | sort -rn | head -1); \
            ulimit -a > /dev/null && echo ulimit=ok; \
            git init -q /tmp/repo && cd /tmp/repo && echo x > f && git add f && \
            git -c user.name=t -c user.email=t@t commit -qm x && echo git=$(git rev-list --count HEAD); \
            grep -E '^Seccomp:' /proc/self/status; \
            exec python3 -B -c \"$0\"";
        let mut spec = SandboxSpec::from_image(
            &id,
            &store(),
            &img,
            vec!["/bin/bash".into(), "-c".into(), script.into(), SECCOMP_PROBE.into()],
        )
        .unwrap();
        spec.process.user = (0, 0);
        let (exit, log) = run_to_exit(&b, &spec);
        assert_eq!(exit.exit_code, 0, "{runtime:?}: {log}");
        assert!(log.contains("Seccomp:\t2\n"), "{runtime:?}: no seccomp filter: {log}");
        let results: Vec<(&str, &str)> = log.lines().filter_map(|l| l.split_once('=')).collect();
        let get = |name: &str| results.iter().find(|(n, _)| *n == name).map(|(_, r)| *r);
        let mut wrong: Vec<String> = results
            .iter()
            .filter(|(n, r)| (n.starts_with("eperm_") && *r != "EPERM") || (n.starts_with("ok_") && *r != "ok"))
            .map(|(n, r)| format!("{n} = {r}"))
            .collect();
        for (name, want) in [
            ("pipeline", "1000"),
            ("ulimit", "ok"),
            ("git", "1"),
            ("clone3", "ENOSYS"),
            ("clone_reaches_the_kernel", "EINVAL"),
            ("unshare_reaches_the_kernel", "EINVAL"),
            ("ioctl_reaches_the_kernel_TCGETS", "ENOTTY"),
            ("ioctl_reaches_the_kernel_TIOCGPTN_sign_extended", "ENOTTY"),
            ("ioctl_reaches_the_kernel_TIOCSTI_plus_one", "ENOTTY"),
            // The 32-bit x86 and x32 ABIs are not in the filter: SIGSYS.
            ("int80", "signal31"),
            ("x32", "signal31"),
            // Named by the profile's requirements, so that none can go missing.
            ("eperm_io_uring_setup", "EPERM"),
            ("eperm_userfaultfd", "EPERM"),
            ("eperm_keyctl", "EPERM"),
            ("eperm_perf_event_open", "EPERM"),
            ("eperm_bpf", "EPERM"),
            ("eperm_init_module", "EPERM"),
            ("eperm_kexec_load", "EPERM"),
            ("eperm_unshare_NEWUSER", "EPERM"),
            ("eperm_mount", "EPERM"),
            ("eperm_ptrace", "EPERM"),
            ("eperm_ioctl_TIOCSTI", "EPERM"),
            ("eperm_ioctl_TIOCSTI_high_bits", "EPERM"),
            ("ok_work_shell_pipeline", "ok"),
            ("ok_work_threads", "ok"),
        ] {
            if get(name) != Some(want) {
                wrong.push(format!("{name} = {:?}, want {want}", get(name)));
            }
        }
        let counted = |prefix: &str| results.iter().filter(|(n, _)| n.starts_with(prefix)).count();
        assert_eq!(
            (counted("eperm_"), counted("ok_")),
            (74, 23),
            "{runtime:?}: the probe stopped before its last check:\n{log}"
        );
        assert!(wrong.is_empty(), "{runtime:?}:\n{}\n\n{log}", wrong.join("\n"));
        assert_gone(&b, &id);
    }
}

/// The agent as PID 1 (as every container sandbox runs it) under the profile: it serves,
/// runs processes as root and as its default user, and they run under the filter too.
#[test]
fn the_agent_as_pid1_runs_processes_under_the_seccomp_profile_on_crun_and_runc() {
    let agent = support::static_agent();
    let img = image("base");
    let rt = support::rt();
    for runtime in [RuntimeChoice::Crun, RuntimeChoice::Runc] {
        let b = backend(runtime);
        let id = unique_id("agent");
        let port = 49983;
        let mut spec = SandboxSpec::from_image(
            &id,
            &store(),
            &img,
            vec![
                "/.opendsec/agent".into(),
                "serve".into(),
                "--listen".into(),
                format!("tcp:127.0.0.1:{port}"),
            ],
        )
        .unwrap();
        spec.binds.push(BindMount {
            host_path: agent.clone(),
            container_path: "/.opendsec/agent".into(),
        });
        b.create(&spec).expect("create");
        let dir = b.get(&id).unwrap().dir;
        let init: i32 = std::fs::read_to_string(dir.join("init.pid"))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        // The agent listens on the sandbox's own loopback: connect from inside its netns.
        let channel = AgentChannel {
            netns: format!("/proc/{init}/ns/net").into(),
            addr: ([127, 0, 0, 1], port).into(),
        };
        let log = || String::from_utf8_lossy(&b.read_log(&id, 1 << 16).unwrap_or_default()).into_owned();
        if let Err(e) = channel.wait_ready(Duration::from_secs(30), &|| {
            b.state(&id).is_ok_and(|s| s.status == SandboxStatus::Running)
        }) {
            panic!("{runtime:?}: the agent never answered: {e}\n{}", log());
        }
        let script = "grep -E '^Seccomp:' /proc/1/status; id -u; seq 3 | sort -rn | head -1; \
            python3 -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True); \
            print(l.syscall(425, 1, 0), ctypes.get_errno())'";
        let out = rt
            .block_on(channel.exec_as("", "root", "bash", &["-c", script]))
            .unwrap_or_else(|e| panic!("{runtime:?}: exec: {e}\n{}", log()));
        assert_eq!(
            (out.exit_code, out.stdout_text().as_str()),
            (0, "Seccomp:\t2\n0\n3\n-1 1\n"),
            "{runtime:?}: {out:?}\n{}",
            log()
        );
        let out = rt
            .block_on(channel.exec("", "bash", &["-c", "id -un; cd && pwd"]))
            .unwrap_or_else(|e| panic!("{runtime:?}: exec as the default user: {e}\n{}", log()));
        assert_eq!(
            (out.exit_code, out.stdout_text().as_str()),
            (0, "user\n/home/user\n"),
            "{runtime:?}: {out:?}\n{}",
            log()
        );
        // What a user's first commands see of a 512 MB, one-CPU sandbox (lxcfs's views).
        let out = rt
            .block_on(channel.exec("", "bash", &["-c", "free -m | awk '/^Mem:/{print $2}'; nproc"]))
            .unwrap_or_else(|e| panic!("{runtime:?}: exec free: {e}\n{}", log()));
        assert_eq!(
            (out.exit_code, out.stdout_text().as_str()),
            (0, "512\n1\n"),
            "{runtime:?}: {out:?}"
        );
        b.delete(&id).unwrap();
        assert_gone(&b, &id);
    }
}

/// The value after `key` on the line of `text` that starts with it.
fn field<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .map(|rest| rest.split_whitespace().next().unwrap_or(""))
}

/// The lines of `log` between `name:` and the next line ending in `:` (a section the
/// script printed).
fn section<'a>(log: &'a str, name: &str) -> Vec<&'a str> {
    log.lines()
        .skip_while(|l| *l != format!("{name}:"))
        .skip(1)
        .take_while(|l| !l.ends_with(':') || l.contains(' '))
        .collect()
}

/// Tasks on the host (the total of /proc/loadavg's 4th field).
fn host_tasks() -> u64 {
    let text = std::fs::read_to_string("/proc/loadavg").unwrap();
    text.split_whitespace()
        .nth(3)
        .unwrap()
        .split('/')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap()
}

fn host_uptime() -> f64 {
    let text = std::fs::read_to_string("/proc/uptime").unwrap();
    text.split_whitespace().next().unwrap().parse().unwrap()
}

/// A sandbox's /proc and /sys (lxcfs's views) and its affinity show its own limits, as a
/// VM of that size would: memory, `nproc`, CPUs, `/proc/uptime`, `/proc/loadavg`. (Not
/// busybox's `free`: it reads the `sysinfo` system call, which no file system can answer;
/// procps's `free`, in every Debian image, reads /proc/meminfo: see the `base` test below.)
#[test]
fn a_sandbox_sees_its_own_memory_cpus_uptime_and_load_not_the_hosts_on_crun_and_runc() {
    let host_cpus = std::thread::available_parallelism().unwrap().get();
    assert!(host_tasks() > 0 && host_uptime() > 0.0);
    // `head`, not busybox's `cat`: that one copies with sendfile, which FUSE cuts at the
    // size it cached from the last reader (up to 0.5 s), another sandbox's view perhaps.
    let script = "echo meminfo:; head -5 /proc/meminfo; \
        echo nproc:; nproc; \
        echo online:; head -n 9 /sys/devices/system/cpu/online; \
        echo cpuinfo:; grep -c ^processor /proc/cpuinfo; \
        echo stat:; grep -c '^cpu[0-9]' /proc/stat; \
        echo uptime:; head -n 9 /proc/uptime; \
        echo loadavg:; head -n 9 /proc/loadavg; \
        echo swaps:; head -n 9 /proc/swaps; \
        echo mountinfo:; cat /proc/self/mountinfo; echo end:";
    for runtime in [RuntimeChoice::Crun, RuntimeChoice::Runc] {
        let b = backend(runtime);
        // One CPU; two where the host has them (its quota then covers every CPU).
        for cpu_millis in [1000, 2000].into_iter().filter(|m| (*m as usize) <= host_cpus * 1000) {
            let cpus = (cpu_millis as usize).div_ceil(1000);
            let id = unique_id("views");
            let mut spec = busybox_spec(&id, script);
            spec.limits.cpu_millis = cpu_millis;
            spec.process.user = (1000, 1000);
            let (exit, log) = run_to_exit(&b, &spec);
            let ctx = format!("{runtime:?}, cpu_millis={cpu_millis}:\n{log}");
            assert_eq!(exit.exit_code, 0, "{ctx}");
            assert_eq!(field(&log, "MemTotal:"), Some("131072"), "MemTotal is 128 MB: {ctx}");
            assert_eq!(section(&log, "nproc"), vec![cpus.to_string()], "nproc: {ctx}");
            let online = if cpus == 1 {
                "0".to_string()
            } else {
                format!("0-{}", cpus - 1)
            };
            assert_eq!(section(&log, "online"), vec![online], "cpu/online: {ctx}");
            assert_eq!(section(&log, "cpuinfo"), vec![cpus.to_string()], "cpuinfo: {ctx}");
            assert_eq!(section(&log, "stat"), vec![cpus.to_string()], "/proc/stat: {ctx}");

            let uptime: f64 = section(&log, "uptime")[0]
                .split_whitespace()
                .next()
                .unwrap()
                .parse()
                .unwrap();
            assert!(uptime < 30.0 && uptime < host_uptime(), "a new sandbox's uptime: {ctx}");
            let loadavg = section(&log, "loadavg");
            let tasks: u64 = loadavg[0]
                .split_whitespace()
                .nth(3)
                .unwrap()
                .split('/')
                .nth(1)
                .unwrap()
                .parse()
                .unwrap();
            assert!(
                tasks < 10 && tasks < host_tasks(),
                "/proc/loadavg counts the sandbox's tasks, not the host's {}: {ctx}",
                host_tasks()
            );
            let swaps = section(&log, "swaps");
            assert_eq!(swaps.len(), 1, "no swap (only the header): {ctx}");

            let mountinfo = section(&log, "mountinfo").join("\n");
            assert!(!mountinfo.contains("/var/"), "host paths in mountinfo:\n{mountinfo}");
            for view in opendsec_edge::container::lxcfs::VIEWS {
                assert!(
                    mountinfo
                        .lines()
                        .any(|l| l.contains(&format!(" {view} {view} ")) && l.contains(" ro,")),
                    "{view} is lxcfs's, read-only: {ctx}"
                );
            }
            assert_gone(&b, &id);
        }
    }
}

/// What a new user of the `base` image tries first: `free`, `top`, `nproc`, `uptime` and
/// Python's CPU count in a 512 MB, one-CPU sandbox show 512 MB and one CPU, a new
/// machine's uptime, and its own load.
#[test]
fn the_base_images_free_top_nproc_and_python_see_the_sandboxs_limits_on_crun_and_runc() {
    let img = image("base");
    let script = "echo free:; free -m; echo nproc:; nproc; \
        echo python:; python3 -c 'import os; print(os.cpu_count(), len(os.sched_getaffinity(0)))'; \
        echo top:; top -bn1 | head -5; echo uptime:; uptime; echo end:";
    for runtime in [RuntimeChoice::Crun, RuntimeChoice::Runc] {
        let b = backend(runtime);
        let id = unique_id("basev");
        let mut spec = SandboxSpec::from_image(
            &id,
            &store(),
            &img,
            vec!["/bin/bash".into(), "-c".into(), script.into()],
        )
        .unwrap();
        spec.limits.memory_bytes = 512 << 20;
        spec.limits.cpu_millis = 1000;
        spec.process.user = (1000, 1000);
        let (exit, log) = run_to_exit(&b, &spec);
        let ctx = format!("{runtime:?}:\n{log}");
        assert_eq!(exit.exit_code, 0, "{ctx}");
        eprintln!("{runtime:?}: a 512 MB, 1000 millicore sandbox of the base image:\n{log}");
        let free = section(&log, "free");
        assert_eq!(
            free.iter().find_map(|l| field(l, "Mem:")),
            Some("512"),
            "free -m: {ctx}"
        );
        assert_eq!(section(&log, "nproc"), vec!["1"], "nproc: {ctx}");
        assert_eq!(
            section(&log, "python"),
            vec!["1 1"],
            "os.cpu_count(), sched_getaffinity: {ctx}"
        );
        let top = section(&log, "top").join("\n");
        assert!(top.contains("512.0 total"), "top shows 512 MiB: {ctx}");
        let uptime = section(&log, "uptime").join("");
        assert!(uptime.contains("up 0 min"), "uptime of a new sandbox: {ctx}");
        assert_gone(&b, &id);
    }
}

/// Ends the lxcfs a test started (by its pid) and whatever it left mounted.
struct LxcfsGuard(opendsec_edge::container::lxcfs::Lxcfs);

impl Drop for LxcfsGuard {
    fn drop(&mut self) {
        if let Some(pid) = self.0.pid() {
            // SAFETY: signalling the lxcfs this test started.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.0.alive() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = Command::new("umount")
            .arg("-l")
            .arg(self.0.mount_dir())
            .stderr(Stdio::null())
            .status();
    }
}

/// lxcfs is started detached by the first backend that finds none and re-used by the
/// next; when it dies, the next backend to look starts a new one over the dead mount, and
/// each backend binds the new views into its sandboxes that had the dead ones.
#[test]
fn lxcfs_is_started_detached_once_reused_and_restarted_after_it_dies() {
    use opendsec_edge::container::lxcfs::{Found, Lxcfs};
    use std::os::unix::fs::PermissionsExt;
    require_prerequisites();
    let tmp = tempfile::Builder::new()
        .prefix("opendsec-lxcfs")
        .tempdir_in("/var/tmp")
        .unwrap();
    // Containers' root (an unprivileged id on the host) walks to the views.
    std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let dir = tmp.path().join("lxcfs");
    let lxcfs = Lxcfs::new(&dir);
    assert!(!lxcfs.alive());
    let _guard = LxcfsGuard(Lxcfs::new(&dir));
    let mut config = config_in(tmp.path(), RuntimeChoice::Auto);
    config.lxcfs = Some(dir.clone());
    let b = TestBackend {
        backend: ContainerBackend::new(config.clone()).expect("backend"),
        _tmp: tempfile::tempdir().unwrap(),
    };
    assert!(lxcfs.alive(), "the backend started lxcfs");
    let first = lxcfs.pid().expect("lxcfs's pid file");
    // SAFETY: getsid only reads.
    let (its_session, our_session) = unsafe { (libc::getsid(first), libc::getsid(0)) };
    assert!(
        its_session > 0 && its_session != our_session,
        "lxcfs runs in a session of its own"
    );
    let stat = std::fs::read_to_string(format!("/proc/{first}/stat")).unwrap();
    let ppid: i32 = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    assert_ne!(ppid as u32, std::process::id(), "lxcfs is no child of the edge");
    assert_eq!(Lxcfs::new(&dir).ensure().unwrap(), Found::Running);
    drop(ContainerBackend::new(config).expect("a second backend"));
    assert_eq!(lxcfs.pid(), Some(first), "a second backend re-uses the running lxcfs");

    let old = unique_id("lxold");
    let reader = "while :; do head -1 /proc/meminfo 2>&1; sleep 0.05; done";
    b.create(&busybox_spec(&old, reader)).unwrap();
    let log = |id: &str| String::from_utf8_lossy(&b.read_log(id, 1 << 20).unwrap()).into_owned();
    wait_until("the old sandbox's view", Duration::from_secs(10), || {
        log(&old).contains("MemTotal:")
    });
    assert!(log(&old).contains("131072 kB"), "{}", log(&old));

    // lxcfs dies: its mount stays, dead, and the sandbox's reads fail.
    // SAFETY: killing the lxcfs this test started.
    assert_eq!(unsafe { libc::kill(first, libc::SIGKILL) }, 0);
    wait_until("lxcfs's mount to die", Duration::from_secs(5), || !lxcfs.alive());
    wait_until("the old sandbox's reads to fail", Duration::from_secs(10), || {
        log(&old).contains("not connected")
    });

    // Another edge of the machine starts a new lxcfs; this one sees a new mount when it
    // next looks (each observation), and binds its views into the sandbox that had dead ones.
    let mut other = config_in(&tmp.path().join("other"), RuntimeChoice::Auto);
    other.lxcfs = Some(dir.clone());
    drop(ContainerBackend::new(other).expect("another edge's backend"));
    assert!(lxcfs.alive());
    b.keep_views().unwrap();

    // A new sandbox sees its own memory.
    let new = unique_id("lxnew");
    let (exit, out) = run_to_exit(&b, &busybox_spec(&new, "head -1 /proc/meminfo"));
    assert_eq!(
        (exit.exit_code, out.split_whitespace().nth(1)),
        (0, Some("131072")),
        "{out}"
    );
    assert!(lxcfs.alive());
    assert_ne!(lxcfs.pid(), Some(first), "a new lxcfs serves");

    // The old sandbox has the new lxcfs's views, read-only, and still no host path.
    wait_until("the old sandbox's views to come back", Duration::from_secs(10), || {
        let text = log(&old);
        let after = text.rsplit("not connected").next().unwrap_or("");
        after.contains("MemTotal:         131072 kB")
    });
    let init = b.get(&old).unwrap().init_pid().unwrap();
    let mountinfo = std::fs::read_to_string(format!("/proc/{init}/mountinfo")).unwrap();
    assert!(!mountinfo.contains("/var/"), "host paths in mountinfo:\n{mountinfo}");
    for view in opendsec_edge::container::lxcfs::VIEWS {
        let lines: Vec<&str> = mountinfo
            .lines()
            .filter(|l| l.contains(&format!(" {view} {view} ")))
            .collect();
        assert_eq!(lines.len(), 1, "one bind of {view}:\n{mountinfo}");
        assert!(
            lines[0].contains(" ro,") && lines[0].contains("nosuid,nodev,noexec"),
            "{}",
            lines[0]
        );
    }
    b.delete(&old).unwrap();
    assert_gone(&b, &old);
}
