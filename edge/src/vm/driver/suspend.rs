//! Pause, resume and snapshots. Guest RAM is a file (`memory-backend-file`). Pause:
//! `stop`, device state to `state` (`x-ignore-shared`: the RAM file is the memory),
//! `quit`, the RAM file written back and dropped from the page cache. Resume: a new QEMU
//! with `-incoming defer`. A snapshot of a running VM is a live copy (`precopy.rs`).
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
}
