//! [`VmHandle`]: what a VM is (status, files, machine, memory, its agent) and its end
//! (`kill`, `delete`), and `recover`, which brings a VM an unfinished operation left
//! behind back to a known state after a restart.

use super::*;

impl VmHandle {
    pub fn id(&self) -> &str {
        &self.id
    }

    pub(super) fn dir(&self) -> PathBuf {
        self.inner.vm_dir(&self.id)
    }

    /// Where the guest's agent listens (inside the VM's network namespace).
    pub fn agent(&self) -> Result<AgentChannel, VmError> {
        let record = self.inner.record(&self.id)?;
        Ok(AgentChannel {
            netns: net::netns_path(&record.netns),
            addr: net::agent_addr(),
        })
    }

    pub fn status(&self) -> Result<VmStatus, VmError> {
        let record = self.inner.record(&self.id)?;
        Ok(match record.state {
            VmState::Paused => VmStatus::Paused,
            VmState::Running => match self.inner.live_pid(&record) {
                Some(pid) => VmStatus::Running { pid },
                None => VmStatus::Exited(record.pid.and_then(|pid| exit_record(&self.dir(), pid))),
            },
        })
    }

    pub fn files(&self) -> Result<VmFiles, VmError> {
        let record = self.inner.record(&self.id)?;
        let dir = self.dir();
        Ok(VmFiles {
            vmlinux: record.vmlinux.clone(),
            initrd: dir.join("initrd"),
            root_disk: record.root_disk.clone(),
            rw_disk: dir.join("rw.img"),
            ram: match &record.ram {
                RamMode::Private { base } => base.clone(),
                _ => dir.join("ram"),
            },
            state: dir.join("state"),
            netns: net::netns_path(&record.netns),
            memory_mb: record.memory_mb,
            guest_ram_kb: guest_ram_kb(record.memory_mb, record.ram_trimmed),
            tsc_khz: record.tsc_khz,
            dir,
        })
    }

    /// The machine the VM is (microVM or full VM).
    pub fn machine(&self) -> Result<Machine, VmError> {
        Ok(self.inner.record(&self.id)?.machine)
    }

    /// The uid QEMU runs as.
    pub fn uid(&self) -> Result<u32, VmError> {
        Ok(self.inner.record(&self.id)?.uid)
    }

    pub fn ram_mode(&self) -> Result<RamMode, VmError> {
        Ok(self.inner.record(&self.id)?.ram)
    }

    /// A pidfd of the running QEMU process: readable once it has ended (for an event
    /// loop that marks the sandbox failed when its channel closes).
    pub fn exit_fd(&self) -> Result<OwnedFd, VmError> {
        match self.status()? {
            VmStatus::Running { pid } => pidfd_open(pid).ok_or_else(|| self.bad_state("exited", "watch its exit")),
            VmStatus::Paused => Err(self.bad_state("paused", "watch its exit")),
            VmStatus::Exited(_) => Err(self.bad_state("exited", "watch its exit")),
        }
    }

    /// The last `max` bytes of the guest's console.
    pub fn console_tail(&self, max: usize) -> String {
        console_tail(&self.dir(), max)
    }

    /// Memory of the running QEMU process.
    pub fn memory(&self) -> Result<MemoryUsage, VmError> {
        let record = self.inner.record(&self.id)?;
        let VmStatus::Running { pid } = self.status()? else {
            return Err(self.bad_state("not running", "measure its memory"));
        };
        let ram_path = match &record.ram {
            RamMode::Private { base } => base.clone(),
            _ => self.dir().join("ram"),
        };
        let text = fs::read_to_string(format!("/proc/{pid}/smaps")).map_err(io_err("reading smaps"))?;
        Ok(parse_smaps(&text, &ram_path.to_string_lossy()))
    }

    /// Bytes of guest RAM data kept on disk for this VM (its RAM file).
    pub fn ram_file_bytes(&self) -> u64 {
        allocated_bytes(&self.dir().join("ram"))
    }

    /// Waits until the guest's agent answers `/health`; from then on the VM is held to
    /// its `cpu_millis` (a cold boot runs boosted until here: see `cgroup.rs`).
    pub fn wait_agent(&self, timeout: Duration) -> Result<Duration, VmError> {
        let agent = self.agent()?;
        let me = self.clone();
        let alive = move || matches!(me.status(), Ok(VmStatus::Running { .. }));
        let waited = agent.wait_ready(timeout, &alive).map_err(|e| match e {
            VmError::Agent(m) | VmError::Timeout { what: m, .. } => {
                VmError::Agent(format!("{m}; console: {}", self.console_tail(1500)))
            }
            other => other,
        })?;
        self.settle_cpu()?;
        Ok(waited)
    }

    pub(super) fn bad_state(&self, state: &str, operation: &'static str) -> VmError {
        VmError::BadState {
            id: self.id.clone(),
            state: state.into(),
            operation,
        }
    }

    pub(super) fn running_record(&self, operation: &'static str) -> Result<(VmRecord, i32), VmError> {
        let record = self.inner.record(&self.id)?;
        if record.state == VmState::Paused {
            return Err(self.bad_state("paused", operation));
        }
        match self.inner.live_pid(&record) {
            Some(pid) => Ok((record, pid)),
            None => Err(self.bad_state("exited", operation)),
        }
    }

    /// Brings a VM back to a state the driver recognises after the edge died in the
    /// middle of an operation (call it for every VM when the edge starts): a QEMU left
    /// stopped by an unfinished pause or fork continues; an unfinished live copy is
    /// cancelled and its receiver ended; a QEMU whose snapshot was
    /// already taken (the VM is paused) is ended; a QEMU still waiting for an incoming
    /// snapshot is ended and the VM stays paused. Returns what it did, if anything.
    /// A running VM is held to its steady CPU quota afterwards (whatever boost the
    /// edge's last run left on it).
    pub fn recover(&self) -> Result<Option<String>, VmError> {
        let done = if self.on_firecracker()? {
            fc::recover(self)?
        } else {
            self.recover_qemu()?
        };
        self.settle_cpu()?;
        Ok(done)
    }

    fn recover_qemu(&self) -> Result<Option<String>, VmError> {
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let mut record = self.inner.record(&self.id)?;
        let Some(pid) = self.inner.live_pid(&record) else {
            return Ok(None);
        };
        let end = |record: &mut VmRecord| -> Result<(), VmError> {
            if let Some(pidfd) = pidfd_open(pid) {
                sigkill(&pidfd);
                wait_ended(&dir, pid, &pidfd, Duration::from_secs(10));
            }
            record.state = VmState::Paused;
            record.pid = None;
            record.pid_start = None;
            self.inner.save(record)
        };
        if record.state == VmState::Paused {
            end(&mut record)?;
            return Ok(Some("ended the QEMU of a finished snapshot".into()));
        }
        let mut qmp = self.inner.qmp(&record)?;
        let status = qmp.execute("query-status", json!({}))?;
        let status = status["status"].as_str().unwrap_or("").to_string();
        if status != "inmigrate" && precopy::migration_under_way(&mut qmp) {
            // A live copy the edge did not finish: its migration would stop the VM at
            // the switch-over with nobody to continue it.
            precopy::cancel_and_continue(&mut qmp);
            self.inner.discard_receiver(&self.id);
            return Ok(Some("cancelled an unfinished live copy".into()));
        }
        self.inner.discard_receiver(&self.id);
        match status.as_str() {
            "running" => Ok(None),
            "inmigrate" => {
                drop(qmp);
                if !dir.join("state").is_file() {
                    return Err(VmError::Corrupt {
                        path: dir.join("state"),
                        message: "a restore was under way but the snapshot is gone".into(),
                    });
                }
                end(&mut record)?;
                Ok(Some("ended an unfinished restore; the VM is paused".into()))
            }
            other => {
                qmp.execute("cont", json!({}))?;
                Ok(Some(format!("continued a VM left {other}")))
            }
        }
    }

    /// Ends the QEMU process at once (the guest gets no say); the VM stays on disk,
    /// [`VmStatus::Exited`]. A QEMU VM keeps its cgroup until it is deleted.
    pub fn kill(&self) -> Result<(), VmError> {
        if self.on_firecracker()? {
            return fc::kill(self);
        }
        let record = self.inner.record(&self.id)?;
        if let Some(pid) = self.inner.live_pid(&record)
            && let Some(pidfd) = pidfd_open(pid)
        {
            sigkill(&pidfd);
            wait_ended(&self.dir(), pid, &pidfd, Duration::from_secs(10));
        }
        Ok(())
    }

    /// Kills the VM if it runs and removes everything it had: files, cgroup, namespace,
    /// uid.
    pub fn delete(&self) -> Result<(), VmError> {
        let dir = self.dir();
        let record = self.inner.record(&self.id)?;
        let _lock = lock_file(&dir.join("lock"))?;
        self.kill()?;
        self.inner.remove_vm_cgroup(&self.id)?;
        net::delete(&record.netns)?;
        self.inner.release_uid(record.uid);
        if dir.exists() {
            fs::remove_dir_all(&dir).map_err(io_err(format!("removing {}", dir.display())))?;
        }
        self.inner.gc_forks();
        Ok(())
    }
}
