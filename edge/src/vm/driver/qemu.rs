//! QEMU processes: their command line (`-M microvm`, or `q35` from `machine.rs`), their
//! start under `opendsec-vm-shim` (detached, never the edge's child), QMP (one connection
//! per operation), their end as the shim records it, and the migration stream helpers
//! (streams go through fds passed with `getfd`, so QEMU opens no files).

use super::*;

impl Inner {
    pub(super) fn qemu_argv(&self, dir: &Path, record: &VmRecord, start: QemuStart) -> Vec<String> {
        let mem = format!("{}K", guest_ram_kb(record.memory_mb, record.ram_trimmed));
        let (mem_path, share) = match &record.ram {
            RamMode::Shared | RamMode::InStream => (dir.join("ram"), "on"),
            RamMode::Private { base } => (base.clone(), "off"),
        };
        let mut append = String::from("console=ttyS0 panic=-1 quiet random.trust_cpu=on");
        if let Some(khz) = record.tsc_khz {
            append.push_str(&format!(" tsc_early_khz={khz}"));
        }
        let (accel, cpu) = match record.accel {
            Accel::Kvm => ("kvm", "host"),
            // A bounded translation cache: TCG would otherwise grow it up to 1 GiB.
            Accel::Tcg => ("tcg,tb-size=64", "max"),
        };
        let mut argv: Vec<String> = vec![
            self.qemu.to_string_lossy().into(),
            "-name".into(),
            format!("opendsec-{}", record.id),
            "-accel".into(),
            accel.into(),
            "-cpu".into(),
            cpu.into(),
            "-smp".into(),
            record.vcpus.to_string(),
            "-m".into(),
            mem.clone(),
            "-object".into(),
            format!(
                "memory-backend-file,id=ram0,size={mem},mem-path={},share={share}",
                mem_path.display()
            ),
            "-nodefaults".into(),
            "-no-user-config".into(),
            "-display".into(),
            "none".into(),
            "-no-reboot".into(),
            "-serial".into(),
            "stdio".into(),
            "-qmp".into(),
            format!("unix:{},server=on,wait=off", dir.join("run/qmp.sock").display()),
            // No new privileges, no programs, no resource changes, no obsolete syscalls.
            "-sandbox".into(),
            "on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into(),
        ];
        if record.machine == Machine::Q35 {
            argv.extend(q35_args(dir, crate::vm::shim::TAP_FD_PLACEHOLDER, net::GUEST_MAC));
        } else {
            argv.extend(self.microvm_args(dir, record, append));
        }
        match start {
            QemuStart::Boot => {}
            QemuStart::Restore => argv.extend(["-incoming".into(), "defer".into()]),
            // -S: the guest never runs, even once the incoming state is loaded.
            QemuStart::Receive => argv.extend(["-S".into(), "-incoming".into(), "defer".into()]),
        }
        argv
    }

    /// A microVM's machine, kernel, initrd and devices.
    pub(super) fn microvm_args(&self, dir: &Path, record: &VmRecord, append: String) -> Vec<String> {
        vec![
            "-M".into(),
            "microvm,memory-backend=ram0".into(),
            "-kernel".into(),
            record.vmlinux.to_string_lossy().into(),
            "-initrd".into(),
            dir.join("initrd").to_string_lossy().into(),
            "-append".into(),
            append,
            "-drive".into(),
            format!(
                "id=root,file={},format=raw,if=none,readonly=on",
                record.root_disk.display()
            ),
            "-device".into(),
            "virtio-blk-device,drive=root,serial=opendsec-root".into(),
            "-drive".into(),
            format!(
                "id=rw,file={},format=raw,if=none,discard=unmap",
                dir.join("rw.img").display()
            ),
            "-device".into(),
            "virtio-blk-device,drive=rw,serial=opendsec-rw".into(),
            "-netdev".into(),
            format!("tap,id=net0,fd={},vhost=off", crate::vm::shim::TAP_FD_PLACEHOLDER),
            "-device".into(),
            format!("virtio-net-device,netdev=net0,mac={}", net::GUEST_MAC),
        ]
    }

    /// Starts QEMU for `record` under a shim and connects to its QMP socket. The record
    /// is saved with the new pid.
    pub(super) fn start_qemu(&self, dir: &Path, record: &mut VmRecord, incoming: bool) -> Result<(i32, Qmp), VmError> {
        let start = if incoming { QemuStart::Restore } else { QemuStart::Boot };
        let pid = self.spawn_qemu(dir, record, start, &self.vm_cgroup(&record.id))?;
        record.pid = Some(pid);
        record.pid_start = process_start(pid);
        record.state = VmState::Running;
        self.save(record)?;
        Ok((pid, self.connect_started(dir, record, pid)?))
    }

    /// Starts QEMU for `record` in `dir` under a shim, in `cgroup` (made for this run,
    /// boosted: see `cgroup.rs`); returns its pid.
    pub(super) fn spawn_qemu(
        &self,
        dir: &Path,
        record: &VmRecord,
        start: QemuStart,
        cgroup: &crate::cgroups::Cgroup,
    ) -> Result<i32, VmError> {
        let socket = dir.join("run/qmp.sock");
        if socket.as_os_str().len() > 100 {
            return Err(VmError::Invalid(format!(
                "{} is too long for a unix socket",
                socket.display()
            )));
        }
        for stale in ["exit.json", "qemu.pid", "run/qmp.sock"] {
            let _ = fs::remove_file(dir.join(stale));
        }
        let launch = Launch {
            argv: self.qemu_argv(dir, record, start),
            uid: record.uid,
            gid: record.uid,
            groups: record.groups.clone(),
            netns: Some(net::netns_path(&record.netns)),
            tap: Some(net::TAP.into()),
            workdir: dir.to_path_buf(),
            console_log: dir.join("console.log"),
            console_cap_bytes: self.cfg.console_cap_bytes,
            pid_file: dir.join("qemu.pid"),
            exit_file: dir.join("exit.json"),
            keeper: false,
            cgroups: self.prepare_cgroup(cgroup, record)?,
        };
        let launch_file = dir.join("launch.json");
        write_json_atomic(&launch_file, &launch)?;
        crate::vm::shim::spawn(&self.cfg.shim, &launch_file)
    }

    /// Connects to the QMP socket of QEMU `pid` just started in `dir`; kills it if
    /// that fails.
    pub(super) fn connect_started(&self, dir: &Path, record: &VmRecord, pid: i32) -> Result<Qmp, VmError> {
        let socket = dir.join("run/qmp.sock");
        let alive = || process_start(pid).is_some() && exit_record(dir, pid).is_none();
        match Qmp::connect_until(&socket, Instant::now() + QEMU_START_TIMEOUT, &alive) {
            Ok(qmp) => Ok(qmp),
            Err(e) => {
                // SAFETY: the pid is the QEMU we just started (its shim reaps it).
                unsafe { libc::kill(pid, libc::SIGKILL) };
                let pidfd = pidfd_open(pid);
                if let Some(fd) = &pidfd {
                    wait_pidfd(fd, Duration::from_secs(5));
                }
                Err(VmError::Qemu {
                    id: record.id.clone(),
                    message: format!("no QMP ({e}); console: {}", console_tail(dir, 1500)),
                })
            }
        }
    }

    /// The QEMU process of `record`, if it still runs (and is the one we started).
    pub(super) fn live_pid(&self, record: &VmRecord) -> Option<i32> {
        let pid = record.pid?;
        match (process_start(pid), record.pid_start) {
            (Some(now), Some(then)) if now == then => Some(pid),
            (Some(_), None) => Some(pid),
            _ => None,
        }
    }

    pub(super) fn qmp(&self, record: &VmRecord) -> Result<Qmp, VmError> {
        let socket = self.vm_dir(&record.id).join("run/qmp.sock");
        Ok(Qmp::connect(&socket, QMP_TIMEOUT)?)
    }
}

/// The shim's record of how QEMU process `pid` of the VM in `dir` ended.
pub(super) fn exit_record(dir: &Path, pid: i32) -> Option<ExitInfo> {
    read_json::<ExitInfo>(&dir.join("exit.json"))
        .ok()
        .filter(|e| e.pid == pid)
}

/// Waits until QEMU `pid` has ended and its shim has recorded it (so that nothing of
/// that run writes into the VM's directory afterwards).
pub(super) fn wait_ended(dir: &Path, pid: i32, pidfd: &OwnedFd, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    if !wait_pidfd(pidfd, timeout) {
        return false;
    }
    while exit_record(dir, pid).is_none() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

/// The last `max` bytes of the VM's console, on one line.
pub(super) fn console_tail(dir: &Path, max: usize) -> String {
    let text = fs::read(dir.join("console.log")).unwrap_or_default();
    let text = String::from_utf8_lossy(&text[text.len().saturating_sub(max)..]).into_owned();
    text.trim().replace("\r\n", " | ").replace('\n', " | ")
}

/// Sends the migration stream to `dest` (a new file, root's) and waits for it.
pub(super) fn migrate_to_file(qmp: &mut Qmp, dest: &Path) -> Result<u64, VmError> {
    let file = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(dest)
        .map_err(io_err(format!("creating {}", dest.display())))?;
    qmp.execute_with_fd("getfd", json!({"fdname": "snapshot"}), file.as_raw_fd())?;
    qmp.execute("migrate", json!({"uri": "fd:snapshot"}))?;
    wait_migration(qmp, "the snapshot")?;
    file.sync_all().map_err(io_err(format!("syncing {}", dest.display())))?;
    Ok(file.metadata().map(|m| m.len()).unwrap_or(0))
}

pub(super) fn wait_migration(qmp: &mut Qmp, what: &str) -> Result<(), VmError> {
    let deadline = Instant::now() + MIGRATION_TIMEOUT;
    loop {
        let info = qmp.execute("query-migrate", json!({}))?;
        match info["status"].as_str() {
            Some("completed") => return Ok(()),
            Some("failed") | Some("cancelled") => {
                return Err(VmError::Qmp(QmpError::Command {
                    command: "migrate".into(),
                    class: "failed".into(),
                    desc: format!("{what}: {}", info["error-desc"].as_str().unwrap_or("migration failed")),
                }));
            }
            _ if Instant::now() > deadline => {
                return Err(VmError::Timeout {
                    what: what.into(),
                    seconds: MIGRATION_TIMEOUT.as_secs(),
                });
            }
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Sets up a stop-and-copy migration: shared RAM in or out of the stream, and never a
/// pause before switch-over (a live copy interrupted by a crash may have left it on).
pub(super) fn set_ignore_shared(qmp: &mut Qmp, on: bool) -> Result<(), VmError> {
    qmp.execute(
        "migrate-set-capabilities",
        json!({"capabilities": [
            {"capability": "x-ignore-shared", "state": on},
            {"capability": "pause-before-switchover", "state": false},
        ]}),
    )?;
    Ok(())
}

/// Writes back a file's dirty pages and drops it from the page cache.
pub(super) fn release_page_cache(path: &Path) -> Result<(), VmError> {
    let file = fs::File::open(path).map_err(io_err(format!("opening {}", path.display())))?;
    file.sync_data()
        .map_err(io_err(format!("syncing {}", path.display())))?;
    // SAFETY: advice on an fd we own.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    Ok(())
}

/// Loads the snapshot `state` into a QEMU started with `-incoming defer`, then runs it.
pub(super) fn restore(qmp: &mut Qmp, state: &Path, ignore_shared: bool) -> Result<(), VmError> {
    set_ignore_shared(qmp, ignore_shared)?;
    let file = fs::File::open(state).map_err(io_err(format!("opening {}", state.display())))?;
    qmp.execute_with_fd("getfd", json!({"fdname": "snapshot"}), file.as_raw_fd())?;
    qmp.execute("migrate-incoming", json!({"uri": "fd:snapshot"}))?;
    wait_migration(qmp, "the restore")?;
    let status = qmp.execute("query-status", json!({}))?;
    if status["status"] != "running" {
        qmp.execute("cont", json!({}))?;
    }
    Ok(())
}

/// Sends SIGKILL to the process behind `pidfd` (never to a recycled pid).
pub(super) fn sigkill(pidfd: &OwnedFd) {
    // SAFETY: signalling through a pidfd we own.
    unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, 0, 0) };
}

/// Waits until the process behind `pidfd` has ended.
pub(super) fn wait_pidfd(pidfd: &OwnedFd, timeout: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: polling one fd we own.
    unsafe { libc::poll(&mut pfd, 1, timeout.as_millis().min(i32::MAX as u128) as i32) > 0 }
}
