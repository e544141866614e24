//! Fork with memory: a live copy of the running source into `forks/<id>-<time>/`, then
//! each copy maps the frozen RAM with `share=off` (MAP_PRIVATE: pages shared until
//! written), so N copies cost far less than N VMs; a copy's next pause puts its RAM into
//! the stream and its resume loads it into a file of its own. RAM bases (a fork's, or a
//! snapshot's `forks/snap-<dev>-<inode>/`) carry a group of their own, which only the VMs
//! that map them carry, and are collected (the group freed) once no VM maps them.

use super::*;

impl VmHandle {
    /// A new directory for one fork's shared base: `forks/<source>-<micros>`, searchable
    /// (0711) so the copies' jailed users reach their files in it.
    pub(super) fn create_fork_dir(&self) -> Result<PathBuf, VmError> {
        let micros = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_micros())
            .unwrap_or(0);
        let fork_dir = self.inner.cfg.root.join("forks").join(format!("{}-{micros}", self.id));
        fs::create_dir_all(&fork_dir).map_err(io_err(format!("creating {}", fork_dir.display())))?;
        fs::set_permissions(&fork_dir, fs::Permissions::from_mode(0o711)).map_err(io_err("chmod fork dir"))?;
        Ok(fork_dir)
    }

    /// The ids of a fork's copies: 1 to [`MAX_FORK_COUNT`] valid ids, none given twice
    /// (nor this VM's), none of a VM that exists.
    pub(super) fn check_fork_ids(&self, new_ids: &[String]) -> Result<(), VmError> {
        if new_ids.is_empty() || new_ids.len() > MAX_FORK_COUNT {
            return Err(VmError::Invalid(format!(
                "fork count must be 1 to {MAX_FORK_COUNT}, not {}",
                new_ids.len()
            )));
        }
        for (i, id) in new_ids.iter().enumerate() {
            validate_id(id)?;
            if new_ids[..i].contains(id) || id == &self.id {
                return Err(VmError::Invalid(format!("fork id {id} is given twice")));
            }
            if self.inner.vm_dir(id).exists() {
                return Err(VmError::Exists(id.clone()));
            }
        }
        Ok(())
    }

    /// Fork with memory: a live copy of the source (see `precopy`: RAM and disk copied
    /// while it runs; it stops only for the pages and blocks written meanwhile and its
    /// device state), then each copy (one per id in `new_ids`) is a new VM restored from
    /// it, mapping the frozen RAM privately, so the copies share every page none of them
    /// has written.
    pub fn fork(&self, new_ids: &[String]) -> Result<ForkReport, VmError> {
        if self.on_firecracker()? {
            let _boost = self.boost_cpu()?;
            return fc::fork(self, new_ids);
        }
        let started = Instant::now();
        self.check_fork_ids(new_ids)?;
        // A VM whose copy cannot be live copies by stopping, which needs its RAM in a
        // shared file: a copy's private pages are first settled into a file of its own.
        let record = self.inner.record(&self.id)?;
        if !precopy::live_copy_is_exact(&record) && matches!(record.ram, RamMode::Private { .. }) {
            self.pause()?;
            self.resume()?;
        }
        // The source's copy is the platform's work: boosted, then settled again.
        let _boost = self.boost_cpu()?;
        let inner = &self.inner;
        let dir = self.dir();
        let lock = lock_file(&dir.join("lock"))?;
        let (source, _pid) = self.running_record("fork")?;
        let fork_dir = self.create_fork_dir()?;

        // Everything that does not need the source's memory is ready before the copy.
        let base = fork_dir.join("ram");
        let mut prepared: Vec<(VmRecord, PathBuf)> = Vec::new();
        let mut base_gid = None;
        let discard_all = |prepared: &[(VmRecord, PathBuf)], gid: Option<u32>| {
            for (record, copy_dir) in prepared {
                inner.discard(copy_dir, Some(&record.netns), Some(record.uid));
            }
            let _ = fs::remove_dir_all(&fork_dir);
            if let Some(gid) = gid {
                inner.release_uid(gid);
            }
        };
        let ready = (|| {
            let gid = inner.claim_base_gid(&fork_dir)?;
            base_gid = Some(gid);
            for id in new_ids {
                prepared.push(inner.prepare_copy(&source, id, &base, gid)?);
            }
            Ok::<_, VmError>(gid)
        })();
        let gid = match ready {
            Ok(gid) => gid,
            Err(e) => {
                discard_all(&prepared, base_gid);
                return Err(e);
            }
        };

        let copied = inner.copy_running(&source, &fork_dir);
        drop(lock);
        let copied = match copied {
            Ok(c) => c,
            Err(e) => {
                discard_all(&prepared, Some(gid));
                return Err(e);
            }
        };
        // Copies open the base read-write (QEMU 7.2 has no `rom=on`) and map it
        // privately: the base's group may, nobody else.
        if let Err(e) = give(&base, 0, gid, 0o660) {
            discard_all(&prepared, Some(gid));
            return Err(e);
        }

        // Start every copy's QEMU, then restore each.
        let mut qmps = Vec::new();
        let mut failure = None;
        for (record, copy_dir) in prepared.iter_mut() {
            let step = (|| {
                sparse_copy(&fork_dir.join("rw.img"), &copy_dir.join("rw.img"))?;
                give(&copy_dir.join("rw.img"), record.uid, record.uid, 0o600)?;
                fs::copy(fork_dir.join("state"), copy_dir.join("state")).map_err(io_err("copying the snapshot"))?;
                let (_pid, qmp) = inner.start_qemu(copy_dir, record, true)?;
                Ok::<_, VmError>(qmp)
            })();
            match step {
                Ok(qmp) => qmps.push(qmp),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_none() {
            for ((_, copy_dir), qmp) in prepared.iter().zip(qmps.iter_mut()) {
                if let Err(e) = restore(qmp, &copy_dir.join("state"), true) {
                    failure = Some(e);
                    break;
                }
            }
        }
        drop(qmps);
        if let Some(e) = failure {
            discard_all(&prepared, Some(gid));
            return Err(e);
        }
        for (record, copy_dir) in &prepared {
            let _ = fs::remove_file(copy_dir.join("state"));
            // Each copy restored boosted; from here it is held to its own quota.
            let settled = inner
                .record(&record.id)
                .and_then(|running| inner.set_cpu_phase(&running, CpuPhase::Steady));
            if let Err(e) = settled {
                discard_all(&prepared, Some(gid));
                return Err(e);
            }
        }
        let _ = fs::remove_file(fork_dir.join("rw.img"));
        let _ = fs::remove_file(fork_dir.join("state"));
        let copies = prepared
            .into_iter()
            .map(|(record, _)| VmHandle {
                inner: self.inner.clone(),
                id: record.id,
            })
            .collect();
        Ok(ForkReport {
            copies,
            source_paused: copied.source_paused,
            total: started.elapsed(),
            ram_bytes: copied.ram_bytes,
            disk_dirty_bytes: copied.disk_dirty_bytes,
        })
    }
}

impl Inner {
    /// Makes a fork copy's directory, uid, namespace and initrd (everything that does
    /// not need the source's memory); on failure leaves nothing behind. The copy maps
    /// `base` privately and carries its group `gid`.
    pub(super) fn prepare_copy(
        &self,
        source: &VmRecord,
        id: &str,
        base: &Path,
        gid: u32,
    ) -> Result<(VmRecord, PathBuf), VmError> {
        let copy_dir = self.create_vm_dir(id)?;
        let netns = format!("{}{}", self.netns_prefix, id);
        let mut claimed_uid = None;
        let result = (|| {
            let uid = self.allocate_uid(id)?;
            claimed_uid = Some(uid);
            let record = VmRecord {
                id: id.into(),
                uid,
                groups: vec![gid],
                netns: netns.clone(),
                ram: RamMode::Private {
                    base: base.to_path_buf(),
                },
                state: VmState::Paused,
                pid: None,
                pid_start: None,
                forked_from: Some(source.id.clone()),
                fc: Default::default(),
                ..source.clone()
            };
            self.prepare_dir(&copy_dir, uid)?;
            self.link_restored_initrd(&copy_dir)?;
            net::create(&netns, uid)?;
            Ok(record)
        })();
        match result {
            Ok(record) => Ok((record, copy_dir)),
            Err(e) => {
                self.discard(&copy_dir, Some(&netns), claimed_uid);
                Err(e)
            }
        }
    }

    /// The initrd of a VM restored from another's memory. Such a guest never boots
    /// again (`-no-reboot`: a reboot ends QEMU) and QEMU does not load an initrd into
    /// the RAM of an incoming VM, so it needs no configuration of its own: the shared
    /// initramfs, hard-linked (root's, readable by all).
    pub(super) fn link_restored_initrd(&self, dir: &Path) -> Result<(), VmError> {
        let initrd = dir.join("initrd");
        if fs::hard_link(&self.boot.initramfs, &initrd).is_ok() {
            return Ok(());
        }
        fs::copy(&self.boot.initramfs, &initrd).map_err(io_err("copying the initramfs"))?;
        fs::set_permissions(&initrd, fs::Permissions::from_mode(0o444)).map_err(io_err("chmod the initrd"))
    }

    /// A group of its own for the RAM base in `dir` (recorded in `dir/gid`): the VMs that
    /// map the base carry it, no other VM does, and it is free again once `dir` is gone.
    pub(super) fn claim_base_gid(&self, dir: &Path) -> Result<u32, VmError> {
        let gid = self.allocate_uid_for(dir)?;
        if let Err(e) = fs::write(dir.join("gid"), gid.to_string()) {
            self.release_uid(gid);
            return Err(VmError::io("recording a RAM base's group", e));
        }
        Ok(gid)
    }

    /// The RAM base of VMs restored from the snapshot RAM file `ram` (the caller holds
    /// `forks.lock`): `forks/snap-<dev>-<inode>/ram`, a hard link of it (so the name
    /// cannot be reused while the base exists), with a group of its own. Collected
    /// like a fork's base once no VM maps it.
    pub(super) fn snapshot_base(&self, ram: &Path) -> Result<(PathBuf, u32), VmError> {
        use std::os::unix::fs::MetadataExt;
        let meta = fs::metadata(ram).map_err(io_err(format!("reading {}", ram.display())))?;
        let forks = self.cfg.root.join("forks");
        let dir = forks.join(format!("snap-{}-{}", meta.dev(), meta.ino()));
        let base = dir.join("ram");
        let same_file = fs::metadata(&base).is_ok_and(|b| b.dev() == meta.dev() && b.ino() == meta.ino());
        let gid = fs::read_to_string(dir.join("gid"))
            .ok()
            .and_then(|g| g.trim().parse::<u32>().ok());
        if same_file && let Some(gid) = gid {
            return Ok((base, gid));
        }
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let (dir, linked) = if fs::hard_link(ram, &base).is_ok() {
            (dir, true)
        } else {
            // Another file system: a copy, in a directory of its own that no later
            // restore reuses (the snapshot's inode number may be reused).
            let _ = fs::remove_dir_all(&dir);
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let unique = dir.with_extension(format!("copy{nanos}"));
            fs::create_dir(&unique).map_err(io_err(format!("creating {}", unique.display())))?;
            (unique, false)
        };
        let base = dir.join("ram");
        let made = (|| {
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o711))
                .map_err(io_err(format!("chmod {}", dir.display())))?;
            if !linked {
                sparse_copy(ram, &base)?;
            }
            let gid = self.claim_base_gid(&dir)?;
            give(&base, 0, gid, 0o660)?;
            Ok::<_, VmError>((base.clone(), gid))
        })();
        if made.is_err() {
            let gid = fs::read_to_string(dir.join("gid")).ok();
            let _ = fs::remove_dir_all(&dir);
            if let Some(gid) = gid.and_then(|g| g.trim().parse::<u32>().ok()) {
                self.release_uid(gid);
            }
        }
        made
    }

    /// Removes fork directories no VM maps any more.
    pub(super) fn gc_forks(&self) {
        let Ok(_lock) = lock_file(&self.cfg.root.join("forks.lock")) else {
            return;
        };
        let mut used = std::collections::BTreeSet::new();
        if let Ok(entries) = fs::read_dir(self.cfg.root.join("vms")) {
            for entry in entries.filter_map(Result::ok) {
                if let Ok(record) = read_json::<VmRecord>(&entry.path().join("vm.json"))
                    && let RamMode::Private { base } = record.ram
                    && let Some(parent) = base.parent()
                {
                    used.insert(parent.to_path_buf());
                }
            }
        }
        if let Ok(entries) = fs::read_dir(self.cfg.root.join("forks")) {
            for entry in entries.filter_map(Result::ok) {
                let path = entry.path();
                // A fork under way has no `ram` yet or holds `state`: leave it.
                if !used.contains(&path) && path.join("ram").exists() && !path.join("state").exists() {
                    let gid = fs::read_to_string(path.join("gid"))
                        .ok()
                        .and_then(|g| g.trim().parse::<u32>().ok());
                    let _ = fs::remove_dir_all(&path);
                    if let Some(gid) = gid {
                        self.release_uid(gid);
                    }
                }
            }
        }
    }
}
