//! Making VMs: the driver prepared (guest kernel and initramfs, accelerator and VMM
//! verdicts, state directories), a VM booted cold or restored from a snapshot (its RAM
//! file hard-linked as a shared base, only the disk copied), VMs found again on disk.
//!
//! A VM restored from memory (fork copy, restore) never boots again (`-no-reboot`) and
//! QEMU loads no initrd into an incoming VM's RAM, so its initrd is the shared initramfs,
//! hard-linked; its configuration is in its memory (the edge re-keys its token).

use super::*;

impl MicroVmDriver {
    /// Prepares the driver: the guest kernel and initramfs (built once per machine),
    /// the accelerator verdict (probed once per host boot) and the state directories.
    pub fn new(cfg: VmConfig, progress: &dyn Fn(&str)) -> Result<Self, VmError> {
        let qemu = match &cfg.qemu {
            Some(q) => q.clone(),
            None => require_tool("qemu-system-x86_64", "qemu-system-x86")?,
        };
        if !Path::new("/dev/net/tun").exists() {
            return Err(VmError::Prerequisite(
                "no /dev/net/tun: the tun module is needed for the agent channel".into(),
            ));
        }
        require_tool("ip", "iproute2")?;
        for sub in ["vms", "forks"] {
            let dir = cfg.root.join(sub);
            fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        }
        // QEMU runs as other uids: they must traverse (never list) the way to their files.
        for dir in [cfg.root.clone(), cfg.root.join("vms"), cfg.root.join("forks")] {
            fs::set_permissions(&dir, fs::Permissions::from_mode(0o711))
                .map_err(io_err(format!("chmod {}", dir.display())))?;
        }
        let boot = ensure_guest_boot(&cfg.store, &cfg.agent_binary, progress)?;
        let accel = match cfg.accel {
            Some(accel) => AccelVerdict {
                accel,
                reason: format!("{} chosen by the configuration", accel.as_str()),
                probe_ms: None,
            },
            None => cached_accel(&cfg, &qemu, &boot, progress)?,
        };
        let netns_prefix = {
            use sha2::{Digest, Sha256};
            let h = Sha256::digest(cfg.root.to_string_lossy().as_bytes());
            format!("odvm-{}-", &hex::encode(h)[..6])
        };
        let firecracker = find_firecracker(cfg.firecracker.as_deref(), cfg.jailer.as_deref());
        let vmm = choose_vmm(cfg.vmm, &accel, &firecracker)?;
        let cgroups = cgroup::host_layout()?;
        let driver = Self {
            inner: Arc::new(Inner {
                tsc_khz: host_tsc_khz(),
                cfg,
                qemu,
                boot,
                accel,
                netns_prefix,
                vmm,
                firecracker: firecracker.map_err(|e| e.to_string()),
                cgroups,
            }),
        };
        driver.inner.gc_cgroups();
        Ok(driver)
    }

    pub fn accel(&self) -> &AccelVerdict {
        &self.inner.accel
    }

    pub fn guest_boot(&self) -> &GuestBoot {
        &self.inner.boot
    }

    /// The boot disk full VMs of `image` start from (built once per image and recipe).
    pub fn boot_disk(&self, image: &Image, progress: &dyn Fn(&str)) -> Result<crate::vm::BootDiskManifest, VmError> {
        let inner = &self.inner;
        ensure_boot_disk(
            &inner.cfg.store,
            image,
            &inner.boot,
            inner.tsc_khz.map(|(k, _)| k),
            progress,
        )
    }

    /// The host TSC frequency given to guests, and where it was read.
    pub fn tsc_khz(&self) -> Option<(u64, &'static str)> {
        self.inner.tsc_khz
    }

    /// Cold-boots a microVM. Returns once QEMU runs; [`VmHandle::wait_agent`] waits for
    /// the guest's agent.
    pub fn create(&self, spec: &VmSpec, progress: &dyn Fn(&str)) -> Result<VmHandle, VmError> {
        self.create_machine(spec, Machine::Microvm, progress)
    }

    /// Cold-boots a VM of `machine`: a microVM, or a full VM (`q35`) whose firmware boots
    /// the image's boot disk (built once per image) through an overlay of its own. Full
    /// VMs always run under QEMU. `spec.disk_mb` sizes a microVM's writable disk, and a
    /// full VM's whole disk when that is larger than its image's (which has
    /// [`FREE_SPACE_MB`](super::bootdisk::FREE_SPACE_MB) free): its init grows the root
    /// partition and file system to fill it.
    pub fn create_machine(
        &self,
        spec: &VmSpec,
        machine: Machine,
        progress: &dyn Fn(&str),
    ) -> Result<VmHandle, VmError> {
        validate_id(&spec.id)?;
        if spec.memory_mb < 64 || spec.vcpus == 0 || spec.disk_mb < 16 {
            return Err(VmError::Invalid(format!(
                "memory {} MiB (at least 64), {} vCPUs (at least 1), disk {} MiB (at least 16)",
                spec.memory_mb, spec.vcpus, spec.disk_mb
            )));
        }
        let inner = &self.inner;
        if inner.vmm.vmm == Vmm::Firecracker && machine.is_microvm() {
            return fc::create(self, spec, progress);
        }
        let root_disk = match machine {
            Machine::Microvm => build_root_disk(&inner.cfg.store, &spec.image, progress)?,
            Machine::Q35 => self.boot_disk(&spec.image, progress)?.disk,
        };
        let dir = inner.create_vm_dir(&spec.id)?;
        let mut claimed_uid = None;
        let netns = format!("{}{}", inner.netns_prefix, spec.id);
        let result = (|| {
            let _lock = lock_file(&dir.join("lock"))?;
            let uid = inner.allocate_uid(&spec.id)?;
            claimed_uid = Some(uid);
            let record = inner.fresh_record(spec, uid, &netns, root_disk, Vmm::Qemu, machine);
            inner.prepare_dir(&dir, uid)?;
            match machine {
                Machine::Microvm => create_rw_disk(&inner.cfg.store, spec.disk_mb, &dir.join("rw.img"))?,
                Machine::Q35 => create_overlay(&record.root_disk, &dir.join("rw.img"), spec.disk_mb << 20)?,
            }
            inner.write_guest_config(machine, &dir, spec)?;
            new_ram_file(&dir.join("ram"), spec.memory_mb)?;
            for (file, mode) in [("rw.img", 0o600), ("initrd", 0o400), ("ram", 0o600)] {
                give(&dir.join(file), uid, uid, mode)?;
            }
            net::create(&record.netns, uid)?;
            write_json_atomic(&dir.join("vm.json"), &record)?;
            let mut record = record;
            let (_pid, mut qmp) = inner.start_qemu(&dir, &mut record, false)?;
            // A cold boot runs at once (QEMU was not started with -S); make sure.
            let status = qmp.execute("query-status", json!({}))?;
            if status["status"] != "running" {
                return Err(VmError::Qemu {
                    id: spec.id.clone(),
                    message: format!("QEMU is {} after boot", status["status"]),
                });
            }
            Ok(())
        })();
        if let Err(e) = result {
            inner.discard(&dir, Some(&netns), claimed_uid);
            return Err(e);
        }
        Ok(self.handle(&spec.id))
    }

    /// A new VM `spec.id` restored from a snapshot that [`VmHandle::snapshot_to`] wrote
    /// in `snapshot`: the snapshot's machine (memory size, vCPUs, disk, kernel) with a
    /// copy of its disk and its RAM file mapped privately (copy-on-write: the snapshot's
    /// file is never written, and VMs restored from one snapshot share its pages),
    /// continuing where its source was. `spec` gives the id and the image (whose layers
    /// must be the snapshot's); the guest's memory holds the source's configuration and
    /// agent token (see [`AgentChannel::rekey`]). A snapshot that cannot be loaded leaves
    /// nothing behind.
    pub fn restore_snapshot(
        &self,
        spec: &VmSpec,
        snapshot: &Path,
        progress: &dyn Fn(&str),
    ) -> Result<(VmHandle, ResumeReport), VmError> {
        validate_id(&spec.id)?;
        let meta: SnapshotMeta = read_json(&snapshot.join(SNAPSHOT_META))?;
        let corrupt = |message: &str| VmError::Corrupt {
            path: snapshot.to_path_buf(),
            message: message.into(),
        };
        if !snapshot.join("state").is_file() || !snapshot.join("rw.img").is_file() {
            return Err(corrupt("the snapshot's state or disk is missing"));
        }
        if !meta.ram_in_stream && !snapshot.join("ram").is_file() {
            return Err(corrupt("the snapshot's RAM file is missing"));
        }
        let inner = &self.inner;
        let root_disk = if meta.root_disk.is_file() {
            meta.root_disk.clone()
        } else if meta.machine == Machine::Q35 {
            // The snapshot's disk is an overlay over exactly that file: a rebuilt boot
            // disk is another file system.
            return Err(corrupt(&format!(
                "the boot disk {} the snapshot's disk is an overlay of is gone",
                meta.root_disk.display()
            )));
        } else if spec.image.layers == meta.layers {
            build_root_disk(&inner.cfg.store, &spec.image, progress)?
        } else {
            return Err(VmError::Invalid(format!(
                "the layers of image {} changed since the snapshot was taken",
                meta.image
            )));
        };
        let dir = inner.create_vm_dir(&spec.id)?;
        let mut claimed_uid = None;
        let netns = format!("{}{}", inner.netns_prefix, spec.id);
        let prepared = (|| {
            let _lock = lock_file(&dir.join("lock"))?;
            let uid = inner.allocate_uid(&spec.id)?;
            claimed_uid = Some(uid);
            let record = VmRecord {
                id: spec.id.clone(),
                image: meta.image.clone(),
                layers: meta.layers.clone(),
                memory_mb: meta.memory_mb,
                vcpus: meta.vcpus,
                disk_mb: meta.disk_mb,
                uid,
                groups: Vec::new(),
                netns: netns.clone(),
                vmlinux: if meta.vmlinux.is_file() {
                    meta.vmlinux.clone()
                } else {
                    inner.boot.kernel.vmlinux()
                },
                root_disk,
                accel: meta.accel,
                tsc_khz: meta.tsc_khz,
                ram_trimmed: meta.ram_trimmed,
                ram: if meta.ram_in_stream {
                    RamMode::InStream
                } else {
                    RamMode::Shared
                },
                state: VmState::Paused,
                pid: None,
                pid_start: None,
                forked_from: Some(meta.source.clone()),
                vmm: meta.vmm,
                machine: meta.machine,
                fc: Default::default(),
                cpu_millis: spec.cpu_millis,
                stored: false,
            };
            inner.prepare_dir(&dir, uid)?;
            if meta.machine == Machine::Microvm {
                // A restored microVM never boots: its initramfs is never read (its token
                // is set by re-keying).
                inner.link_restored_initrd(&dir)?;
            } else {
                // A full VM's configuration disk is a device the restored machine has.
                inner.write_guest_config(meta.machine, &dir, spec)?;
                give(&dir.join("initrd"), uid, uid, 0o400)?;
            }
            fs::copy(snapshot.join("state"), dir.join("state")).map_err(io_err("copying the snapshot's state"))?;
            sparse_copy(&snapshot.join("rw.img"), &dir.join("rw.img"))?;
            give(&dir.join("rw.img"), uid, uid, 0o600)?;
            net::create(&netns, uid)?;
            if meta.ram_in_stream {
                return write_json_atomic(&dir.join("vm.json"), &record);
            }
            // The snapshot's RAM file is every restore's base, mapped privately: no copy,
            // and VMs restored from one snapshot share the pages none has written.
            let _forks = lock_file(&inner.cfg.root.join("forks.lock"))?;
            let (base, gid) = inner.snapshot_base(&snapshot.join("ram"))?;
            let record = VmRecord {
                ram: RamMode::Private { base },
                groups: vec![gid],
                ..record
            };
            write_json_atomic(&dir.join("vm.json"), &record)
        })();
        if let Err(e) = prepared {
            inner.discard(&dir, Some(&netns), claimed_uid);
            return Err(e);
        }
        let vm = self.handle(&spec.id);
        match vm.resume() {
            Ok(report) => Ok((vm, report)),
            Err(e) => {
                inner.discard(&dir, Some(&netns), claimed_uid);
                inner.gc_forks();
                Err(e)
            }
        }
    }

    /// A VM that exists on disk (after an edge restart, too).
    pub fn open(&self, id: &str) -> Result<VmHandle, VmError> {
        validate_id(id)?;
        if !self.inner.vm_dir(id).join("vm.json").is_file() {
            return Err(VmError::NotFound(id.into()));
        }
        Ok(self.handle(id))
    }

    /// Every VM on disk, sorted by id.
    pub fn list(&self) -> Result<Vec<VmHandle>, VmError> {
        let dir = self.inner.cfg.root.join("vms");
        let mut ids: Vec<String> = fs::read_dir(&dir)
            .map_err(io_err(format!("listing {}", dir.display())))?
            .filter_map(Result::ok)
            .filter(|e| e.path().join("vm.json").is_file())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        ids.sort();
        Ok(ids.into_iter().map(|id| self.handle(&id)).collect())
    }

    pub(super) fn handle(&self, id: &str) -> VmHandle {
        VmHandle {
            inner: self.inner.clone(),
            id: id.into(),
        }
    }
}
