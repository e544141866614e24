//! Pause, resume and snapshots. Guest RAM is a file (`memory-backend-file`). Pause:
//! `stop`, device state to `state` (`x-ignore-shared`: the RAM file is the memory),
//! `quit`, the RAM file written back and dropped from the page cache. Resume: a new QEMU
//! with `-incoming defer`. A snapshot of a running VM is a live copy (`precopy.rs`).
//!
//! A file-system-only pause ([`VmHandle::store`]) keeps the disk alone: QEMU quits
//! (flushing the disk), no device state is written, the RAM file is emptied; its resume
//! ([`VmHandle::boot_again`]) cold-boots a new QEMU on that disk. Under Firecracker the
//! process is ended and any memory snapshot dropped (`fc::forget_memory`); the resume
//! boots a new jailed Firecracker on the disks as a create does (`fc::boot_stored`).
//!
//! **Architecture Invariant:** a pause records the VM paused once its snapshot is
//! complete and before its QEMU quits; a failed pause or restore leaves the VM as it was
//! (it continues, or stays paused with its snapshot).

use super::*;

impl VmHandle {
    /// Pause: snapshot the VM and end its QEMU process, releasing its memory. With
    /// shared RAM the stream holds only device state (the RAM file is the memory); a
    /// fork copy's RAM (private pages over the fork's base) goes into the stream.
    pub fn pause(&self) -> Result<PauseReport, VmError> {
        // The snapshot is the platform's work: boosted (a failed pause runs on, settled).
        let _boost = self.boost_cpu()?;
        if self.on_firecracker()? {
            return fc::pause(self);
        }
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let (mut record, pid) = self.running_record("pause")?;
        let pidfd = pidfd_open(pid).ok_or_else(|| self.bad_state("exited", "pause"))?;
        let mut qmp = self.inner.qmp(&record)?;
        let shared = record.ram == RamMode::Shared;
        set_ignore_shared(&mut qmp, shared)?;
        let t0 = Instant::now();
        qmp.execute("stop", json!({}))?;
        let tmp = dir.join("state.new");
        let state_bytes = match migrate_to_file(&mut qmp, &tmp) {
            Ok(n) => n,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                // The VM is unharmed: let it run on.
                let _ = qmp.execute("cont", json!({}));
                return Err(e);
            }
        };
        let snapshot = t0.elapsed();
        // The snapshot is complete: from here the VM is paused, whatever happens to
        // this QEMU (a crash before it is gone leaves it for `recover` to end).
        fs::rename(&tmp, dir.join("state")).map_err(io_err("keeping the snapshot"))?;
        let old_base = match &record.ram {
            RamMode::Private { base } => Some(base.clone()),
            _ => None,
        };
        if !shared {
            record.ram = RamMode::InStream;
            record.groups.clear();
        }
        record.state = VmState::Paused;
        self.inner.save(&record)?;
        let t1 = Instant::now();
        let _ = qmp.execute("quit", json!({}));
        drop(qmp);
        if !wait_ended(&dir, pid, &pidfd, Duration::from_secs(10)) {
            sigkill(&pidfd);
            wait_ended(&dir, pid, &pidfd, Duration::from_secs(10));
        }
        let exit = t1.elapsed();
        record.pid = None;
        record.pid_start = None;
        self.inner.save(&record)?;
        // A paused VM has no process, and no cgroup.
        let _ = self.inner.remove_vm_cgroup(&self.id);
        if old_base.is_some() {
            self.inner.gc_forks();
        }
        let t2 = Instant::now();
        if shared {
            release_page_cache(&dir.join("ram"))?;
        }
        Ok(PauseReport {
            snapshot,
            exit,
            release: t2.elapsed(),
            state_bytes,
            ram_bytes: if shared { 0 } else { state_bytes },
            incremental: false,
        })
    }

    /// Takes a snapshot of the VM into `dest` (a directory that must not exist): its
    /// device state, RAM and writable disk, and [`SNAPSHOT_META`]. A running VM is
    /// copied live (see `precopy`): it stops only for the pages and disk blocks written
    /// during the copy and its device state; a paused one is copied as it lies.
    /// On failure `dest` is gone and the VM is as it was.
    pub fn snapshot_to(&self, dest: &Path) -> Result<SnapshotReport, VmError> {
        let _boost = self.boost_cpu()?;
        if self.is_stored() {
            return Err(VmError::Invalid(format!(
                "VM {} is paused with its disk only (no memory to snapshot): resume it first",
                self.id
            )));
        }
        if self.on_firecracker()? {
            return fc::snapshot_to(self, dest);
        }
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let record = self.inner.record(&self.id)?;
        create_snapshot_dir(dest)?;
        let taken = (|| match record.state {
            VmState::Running => {
                if self.inner.live_pid(&record).is_none() {
                    return Err(self.bad_state("exited", "snapshot"));
                }
                // Copied while it runs; it stops only for what changed meanwhile.
                let copied = self.inner.copy_running(&record, dest)?;
                let state_bytes = fs::metadata(dest.join("state")).map_or(0, |m| m.len());
                let bytes = state_bytes + copied.ram_bytes + copied.disk_bytes;
                Ok((copied.source_paused, bytes, copied.ram_in_stream))
            }
            VmState::Paused => {
                let mut bytes =
                    fs::copy(dir.join("state"), dest.join("state")).map_err(io_err("copying the VM's snapshot"))?;
                let in_stream = record.ram == RamMode::InStream;
                if !in_stream {
                    bytes += sparse_copy(&dir.join("ram"), &dest.join("ram"))?;
                }
                bytes += sparse_copy(&dir.join("rw.img"), &dest.join("rw.img"))?;
                Ok((Duration::ZERO, bytes, in_stream))
            }
        })();
        finish_snapshot(dest, &self.id, &record, taken)
    }

    /// Resume: a new QEMU process restores the paused VM, which continues where it was.
    /// The restore runs boosted; the VM is held to its `cpu_millis` once it runs.
    pub fn resume(&self) -> Result<ResumeReport, VmError> {
        let report = if self.on_firecracker()? {
            fc::resume(self)?
        } else {
            self.resume_qemu()?
        };
        self.settle_cpu()?;
        Ok(report)
    }

    fn resume_qemu(&self) -> Result<ResumeReport, VmError> {
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let mut record = self.inner.record(&self.id)?;
        if record.state != VmState::Paused {
            return Err(self.bad_state("running", "resume"));
        }
        let state = dir.join("state");
        if !state.is_file() {
            return Err(VmError::Corrupt {
                path: state,
                message: "a paused VM without its snapshot".into(),
            });
        }
        let from_stream = record.ram == RamMode::InStream;
        if from_stream {
            // The stream carries the RAM: it loads into a fresh shared file.
            new_ram_file(&dir.join("ram"), record.memory_mb)?;
            give(&dir.join("ram"), record.uid, record.uid, 0o600)?;
        }
        let t0 = Instant::now();
        let (pid, mut qmp) = self.inner.start_qemu(&dir, &mut record, true)?;
        let spawn = t0.elapsed();
        let t1 = Instant::now();
        let result = restore(&mut qmp, &state, !from_stream);
        if let Err(e) = result {
            // The VM stays paused, its snapshot untouched. Once this returns, nothing
            // of that QEMU run (nor its shim) writes into the VM's directory.
            drop(qmp);
            match pidfd_open(pid) {
                Some(pidfd) => {
                    sigkill(&pidfd);
                    wait_ended(&dir, pid, &pidfd, Duration::from_secs(10));
                }
                None => {
                    // Already gone: wait for its shim's record of the end.
                    let deadline = Instant::now() + Duration::from_secs(10);
                    while exit_record(&dir, pid).is_none() && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            }
            record.state = VmState::Paused;
            record.pid = None;
            record.pid_start = None;
            self.inner.save(&record)?;
            let _ = self.inner.remove_vm_cgroup(&self.id);
            return Err(VmError::Qemu {
                id: self.id.clone(),
                message: format!(
                    "restoring {}: {e}; console: {}",
                    state.display(),
                    console_tail(&dir, 800)
                ),
            });
        }
        let restore_time = t1.elapsed();
        if from_stream {
            record.ram = RamMode::Shared;
            self.inner.save(&record)?;
        }
        Ok(ResumeReport {
            spawn,
            restore: restore_time,
        })
    }

    /// A file-system-only pause: the VMM ends (QEMU stops and quits, its disk flushed;
    /// Firecracker's process is ended with its jail; the caller had the guest sync its
    /// file systems first), no device state is kept and the memory goes (QEMU's RAM file
    /// is emptied), so the paused VM holds none; the record says `stored` and its resume
    /// boots it again ([`Self::boot_again`]). A VM paused with its memory drops that
    /// snapshot. Idempotent.
    pub fn store(&self) -> Result<(), VmError> {
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let mut record = self.inner.record(&self.id)?;
        if record.stored {
            return Ok(());
        }
        let firecracker = record.vmm == Vmm::Firecracker;
        if firecracker {
            // Its jail and cgroup go with it.
            self.inner.stop_firecracker(&dir, &record)?;
        } else if let Some(pid) = self.inner.live_pid(&record) {
            if let Ok(mut qmp) = self.inner.qmp(&record) {
                let _ = qmp.execute("stop", json!({}));
                let _ = qmp.execute("quit", json!({}));
            }
            if let Some(pidfd) = pidfd_open(pid)
                && !wait_ended(&dir, pid, &pidfd, Duration::from_secs(10))
            {
                sigkill(&pidfd);
                wait_ended(&dir, pid, &pidfd, Duration::from_secs(10));
            }
        }
        let private = matches!(record.ram, RamMode::Private { .. });
        record.state = VmState::Paused;
        record.pid = None;
        record.pid_start = None;
        record.stored = true;
        record.ram = RamMode::Shared;
        record.groups.clear();
        record.fc = Default::default();
        self.inner.save(&record)?;
        // Recorded first: a crash from here leaves a stored VM with leftovers, never a
        // paused one missing its snapshot.
        let _ = fs::remove_file(dir.join("state"));
        if firecracker {
            fc::forget_memory(&dir);
        } else {
            new_ram_file(&dir.join("ram"), record.memory_mb)?;
            give(&dir.join("ram"), record.uid, record.uid, 0o600)?;
            let _ = self.inner.remove_vm_cgroup(&self.id);
        }
        if private {
            self.inner.gc_forks();
        }
        Ok(())
    }

    /// Whether the VM is paused with its disk only.
    pub fn is_stored(&self) -> bool {
        self.inner.record(&self.id).is_ok_and(|r| r.stored)
    }

    /// Boots a paused VM again from its disk (one paused with its memory drops it first,
    /// see [`Self::store`]): a new QEMU with empty memory (or a new jailed Firecracker,
    /// `fc::boot_stored`) and `spec`'s guest configuration written anew (a VM restored
    /// from a snapshot never booted its own). Returns once the VMM runs; wait for its
    /// agent with [`Self::wait_agent`].
    pub fn boot_again(&self, spec: &VmSpec) -> Result<(), VmError> {
        self.store()?;
        let dir = self.dir();
        let _lock = lock_file(&dir.join("lock"))?;
        let mut record = self.inner.record(&self.id)?;
        if record.state != VmState::Paused || !record.stored {
            return Err(self.bad_state("running", "boot again"));
        }
        // Written anew, never through a link to a file other VMs share.
        let _ = fs::remove_file(dir.join("initrd"));
        self.inner.write_guest_config(record.machine, &dir, spec)?;
        give(&dir.join("initrd"), record.uid, record.uid, 0o400)?;
        if record.vmm == Vmm::Firecracker {
            let stored = record.clone();
            record.stored = false;
            return fc::boot_stored(self, &dir, &mut record, &stored);
        }
        new_ram_file(&dir.join("ram"), record.memory_mb)?;
        give(&dir.join("ram"), record.uid, record.uid, 0o600)?;
        record.stored = false;
        let (_pid, mut qmp) = self.inner.start_qemu(&dir, &mut record, false)?;
        let status = qmp.execute("query-status", json!({}))?;
        if status["status"] != "running" {
            return Err(VmError::Qemu {
                id: self.id.clone(),
                message: format!("QEMU is {} after boot", status["status"]),
            });
        }
        Ok(())
    }
}
