//! `opendsec-vm-bench`: the microVM driver's figures, each beside raw QEMU doing the same
//! on the same files (no shim, no VM uid, no seccomp sandbox, QEMU opening the tap
//! itself, started as root in the VM's network namespace). Run by `ops/vm-bench.sh`.
//!
//!   opendsec-vm-bench [--store DIR] [--root DIR] [--agent FILE] [--shim FILE]
//!                     [--rounds N] [--forks N] [--memory MIB]
//!
//! Prints one line per figure: `<operation>: opendsec <x> ms | raw qemu <y> ms`.

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use opendsec_edge::images::{DEFAULT_STORE, ImageStore};
use opendsec_edge::vm::{
    AgentChannel, GUEST_MAC, MicroVmDriver, Qmp, TAP, VmConfig, VmFiles, VmHandle, VmSpec,
    sparse_copy,
};
use serde_json::json;

const TOKEN: &str = "vm-bench-token";

struct Args {
    store: PathBuf,
    root: PathBuf,
    agent: PathBuf,
    shim: PathBuf,
    rounds: usize,
    forks: usize,
    memory_mb: u64,
}

fn parse_args() -> Args {
    let exe_dir = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    let mut args = Args {
        store: PathBuf::from(DEFAULT_STORE),
        root: PathBuf::from("/var/tmp/opendsec-vm-bench"),
        agent: PathBuf::from("target/agent-static/opendsec-agent"),
        shim: exe_dir.join("opendsec-vm-shim"),
        rounds: 5,
        forks: 2,
        memory_mb: 256,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--store" => args.store = value().into(),
            "--root" => args.root = value().into(),
            "--agent" => args.agent = value().into(),
            "--shim" => args.shim = value().into(),
            "--rounds" => args.rounds = value().parse().unwrap_or_else(|_| usage("--rounds N")),
            "--forks" => args.forks = value().parse().unwrap_or_else(|_| usage("--forks N")),
            "--memory" => {
                args.memory_mb = value().parse().unwrap_or_else(|_| usage("--memory MIB"))
            }
            other => usage(&format!("unknown flag {other}")),
        }
    }
    args
}

fn usage(problem: &str) -> ! {
    eprintln!(
        "{problem}\nusage: opendsec-vm-bench [--store DIR] [--root DIR] [--agent FILE] [--shim FILE] [--rounds N] [--forks N] [--memory MIB]"
    );
    std::process::exit(2)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn line(what: &str, ours: f64, raw: Option<f64>) {
    match raw {
        Some(raw) => println!("{what}: opendsec {ours:.0} ms | raw qemu {raw:.0} ms"),
        None => println!("{what}: opendsec {ours:.0} ms"),
    }
}

fn exec(rt: &tokio::runtime::Runtime, agent: &AgentChannel, cmd: &str, args: &[&str]) -> String {
    let out = rt
        .block_on(agent.exec(TOKEN, cmd, args))
        .unwrap_or_else(|e| fail(&format!("exec {cmd}: {e}")));
    out.stdout_text()
}

fn fail(message: &str) -> ! {
    eprintln!("opendsec-vm-bench: {message}");
    std::process::exit(1)
}

/// QEMU as a user would run it by hand on the VM's files: root, in the VM's namespace,
/// opening the tap by name.
fn raw_qemu(files: &VmFiles, rw: &Path, ram: &Path, qmp: &Path, incoming: bool) -> Child {
    let mem = format!("{}M", files.memory_mb);
    let mut append = String::from("console=ttyS0 panic=-1 quiet random.trust_cpu=on");
    if let Some(khz) = files.tsc_khz {
        append.push_str(&format!(" tsc_early_khz={khz}"));
    }
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args([
        "-M",
        "microvm,memory-backend=ram0",
        "-accel",
        "tcg,tb-size=64",
        "-cpu",
        "max",
        "-smp",
        "1",
        "-m",
        &mem,
    ])
    .arg("-object")
    .arg(format!(
        "memory-backend-file,id=ram0,size={mem},mem-path={},share=on",
        ram.display()
    ))
    .args([
        "-nodefaults",
        "-no-user-config",
        "-display",
        "none",
        "-no-reboot",
        "-serial",
        "stdio",
    ])
    .arg("-kernel")
    .arg(&files.vmlinux)
    .arg("-initrd")
    .arg(&files.initrd)
    .args(["-append", &append])
    .arg("-drive")
    .arg(format!(
        "id=root,file={},format=raw,if=none,readonly=on",
        files.root_disk.display()
    ))
    .args([
        "-device",
        "virtio-blk-device,drive=root,serial=opendsec-root",
    ])
    .arg("-drive")
    .arg(format!(
        "id=rw,file={},format=raw,if=none,discard=unmap",
        rw.display()
    ))
    .args(["-device", "virtio-blk-device,drive=rw,serial=opendsec-rw"])
    .arg("-netdev")
    .arg(format!(
        "tap,id=net0,ifname={TAP},script=no,downscript=no,vhost=off"
    ))
    .arg("-device")
    .arg(format!("virtio-net-device,netdev=net0,mac={GUEST_MAC}"))
    .arg("-qmp")
    .arg(format!("unix:{},server=on,wait=off", qmp.display()));
    if incoming {
        cmd.args(["-incoming", "defer"]);
    }
    let netns = std::fs::File::open(&files.netns).unwrap_or_else(|e| fail(&format!("netns: {e}")));
    let fd = netns.as_raw_fd();
    // SAFETY: setns is async-signal-safe; it moves only the child.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| fail(&format!("raw qemu: {e}")));
    drop(netns);
    child
}

fn raw_qmp(path: &Path, child: &Child) -> Qmp {
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid = child.id();
    Qmp::connect_until(path, deadline, &|| {
        Path::new(&format!("/proc/{pid}")).exists()
    })
    .unwrap_or_else(|e| fail(&format!("raw qemu QMP: {e}")))
}

fn stop(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn main() {
    let args = parse_args();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let store = ImageStore::open(&args.store).unwrap_or_else(|e| fail(&e.to_string()));
    let mut cfg = VmConfig::new(
        &args.root,
        store.clone(),
        args.agent.clone(),
        args.shim.clone(),
    );
    cfg.console_cap_bytes = 1 << 20;
    // The figures stand beside raw QEMU on the same files (QEMU's snapshot format): the
    // Firecracker driver's figures are printed by `tests/vm_firecracker.rs`.
    cfg.vmm = opendsec_edge::vm::VmmChoice::Qemu;
    let driver = MicroVmDriver::new(cfg, &|m| eprintln!("[driver] {m}"))
        .unwrap_or_else(|e| fail(&e.to_string()));
    let image = store
        .ensure("base", &|p| eprintln!("[base] {}", p.message))
        .unwrap_or_else(|e| fail(&e.to_string()));
    println!(
        "guest: kernel {}, {} MiB, 1 vCPU, accelerator {} ({})",
        driver.guest_boot().kernel.release,
        args.memory_mb,
        driver.accel().accel.as_str(),
        driver.accel().reason
    );
    let id = format!("bench-{}", std::process::id());
    let spec = VmSpec {
        id: id.clone(),
        image,
        memory_mb: args.memory_mb,
        vcpus: 1,
        disk_mb: 512,
        env: BTreeMap::new(),
        access_token: TOKEN.into(),
    };
    let mut vms: Vec<VmHandle> = Vec::new();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run(&rt, &driver, &spec, &args, &mut vms);
    }));
    for vm in &vms {
        let _ = vm.delete();
    }
    if result.is_err() {
        std::process::exit(1);
    }
}

fn run(
    rt: &tokio::runtime::Runtime,
    driver: &MicroVmDriver,
    spec: &VmSpec,
    args: &Args,
    vms: &mut Vec<VmHandle>,
) {
    // Cold boot, ours.
    let t = Instant::now();
    let vm = driver
        .create(spec, &|_| {})
        .unwrap_or_else(|e| fail(&e.to_string()));
    vms.push(vm.clone());
    vm.wait_agent(Duration::from_secs(300))
        .unwrap_or_else(|e| fail(&e.to_string()));
    let agent = vm.agent().unwrap();
    exec(rt, &agent, "true", &[]);
    let cold_ours = ms(t.elapsed());
    let files = vm.files().unwrap();
    let one_vm = vm.memory().unwrap();

    // Pause and resume, ours.
    let (mut snap, mut exit, mut release, mut resume_first) = (vec![], vec![], vec![], vec![]);
    for _ in 0..args.rounds {
        let p = vm.pause().unwrap_or_else(|e| fail(&e.to_string()));
        snap.push(ms(p.snapshot));
        exit.push(ms(p.exit));
        release.push(ms(p.release));
        let t = Instant::now();
        vm.resume().unwrap_or_else(|e| fail(&e.to_string()));
        exec(rt, &agent, "true", &[]);
        resume_first.push(ms(t.elapsed()));
    }
    vm.pause().unwrap_or_else(|e| fail(&e.to_string()));

    // Raw QEMU on copies of the same files while ours is paused (its tap is free).
    let scratch = files.dir.join("raw");
    std::fs::create_dir_all(&scratch).unwrap();
    let (raw_rw, raw_ram, raw_sock) = (
        scratch.join("rw.img"),
        scratch.join("ram"),
        scratch.join("qmp.sock"),
    );
    let mut raw_restore = vec![];
    for _ in 0..args.rounds {
        sparse_copy(&files.rw_disk, &raw_rw).unwrap();
        sparse_copy(&files.ram, &raw_ram).unwrap();
        // Like ours: the RAM file is not in the page cache when the restore starts.
        drop_cache(&raw_ram);
        let _ = std::fs::remove_file(&raw_sock);
        let t = Instant::now();
        let child = raw_qemu(&files, &raw_rw, &raw_ram, &raw_sock, true);
        let mut qmp = raw_qmp(&raw_sock, &child);
        qmp.execute(
            "migrate-set-capabilities",
            json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]}),
        )
        .unwrap();
        let state = std::fs::File::open(&files.state).unwrap();
        qmp.execute_with_fd("getfd", json!({"fdname": "s"}), state.as_raw_fd())
            .unwrap();
        qmp.execute("migrate-incoming", json!({"uri": "fd:s"}))
            .unwrap();
        while qmp.execute("query-migrate", json!({})).unwrap()["status"] != "completed" {
            std::thread::sleep(Duration::from_millis(1));
        }
        qmp.execute("cont", json!({})).unwrap();
        exec(rt, &agent, "true", &[]);
        raw_restore.push(ms(t.elapsed()));
        drop(qmp);
        stop(child);
    }
    // Raw cold boot: a fresh writable disk and RAM file.
    sparse_copy(&driver_template(&files), &raw_rw).unwrap();
    let f = std::fs::File::create(&raw_ram).unwrap();
    f.set_len(files.memory_mb << 20).unwrap();
    drop(f);
    let _ = std::fs::remove_file(&raw_sock);
    let t = Instant::now();
    let child = raw_qemu(&files, &raw_rw, &raw_ram, &raw_sock, false);
    agent
        .wait_ready(Duration::from_secs(300), &|| true)
        .unwrap_or_else(|e| fail(&format!("raw cold boot: {e}")));
    exec(rt, &agent, "true", &[]);
    let cold_raw = ms(t.elapsed());
    stop(child);
    let _ = std::fs::remove_dir_all(&scratch);
    vm.resume().unwrap_or_else(|e| fail(&e.to_string()));
    exec(rt, &agent, "true", &[]);

    // Fork.
    let ids: Vec<String> = (0..args.forks)
        .map(|i| format!("{}-f{i}", spec.id))
        .collect();
    let t = Instant::now();
    let report = vm.fork(&ids).unwrap_or_else(|e| fail(&e.to_string()));
    vms.extend(report.copies.iter().cloned());
    for copy in &report.copies {
        exec(rt, &copy.agent().unwrap(), "true", &[]);
    }
    let all_answered = ms(t.elapsed());
    let pss: u64 = report
        .copies
        .iter()
        .map(|c| c.memory().unwrap().pss_kb)
        .sum();

    println!("cold boot to first command: opendsec {cold_ours:.0} ms | raw qemu {cold_raw:.0} ms");
    line(
        "pause: snapshot (stop + device state), median",
        median(snap),
        None,
    );
    line("pause: QEMU exit, median", median(exit), None);
    line(
        "pause: RAM written back and dropped from the page cache, median",
        median(release),
        None,
    );
    println!(
        "resume to first command, median of {}: opendsec {:.0} ms | raw qemu {:.0} ms",
        args.rounds,
        median(resume_first),
        median(raw_restore)
    );
    line(
        &format!("fork x{}: source paused", args.forks),
        ms(report.source_paused),
        None,
    );
    line(
        &format!("fork x{}: until every copy answered", args.forks),
        all_answered,
        None,
    );
    println!(
        "fork x{}: copies' PSS {} MiB vs one VM's RSS after cold boot {} MiB ({} MiB of it guest RAM)",
        args.forks,
        pss / 1024,
        one_vm.rss_kb / 1024,
        one_vm.guest_ram_rss_kb / 1024
    );
}

/// The empty writable-disk template the driver copies for new VMs.
fn driver_template(files: &VmFiles) -> PathBuf {
    let store = files.root_disk.parent().expect("vmdisks dir");
    let size = std::fs::metadata(&files.rw_disk)
        .map(|m| m.len() >> 20)
        .unwrap_or(512);
    store.join(format!("empty-{size}M.ext4"))
}

fn drop_cache(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        let _ = f.sync_data();
        // SAFETY: advice on an fd we own.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
}
