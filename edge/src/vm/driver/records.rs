//! A VM's directory and its record (`vm.json`, the truth about the VM, written
//! atomically after the step it records), and the uids handed to VMs: one per VM,
//! recorded per machine in the image store's `vm-uids/<uid>` (the owning directory; a uid
//! whose owner is gone is free again), so the VMs of two drivers never share one.

use super::*;

impl Inner {
    /// Writes the VM's `initrd`: for a microVM the initramfs with its configuration
    /// appended, for a full VM its configuration disk.
    pub(super) fn write_guest_config(&self, machine: Machine, dir: &Path, spec: &VmSpec) -> Result<(), VmError> {
        let config = GuestConfig::of(spec);
        let dest = dir.join("initrd");
        match machine {
            Machine::Microvm => write_vm_initrd(&self.boot, &dest, &config),
            Machine::Q35 => write_config_disk(&dest, &config),
        }
    }

    /// The record of a VM about to boot for the first time under `vmm`: its accelerator
    /// is the driver's for QEMU (RAM trimmed under TCG, see [`TCG_RAM_TRIM_KB`]); a
    /// Firecracker VM runs only where KVM does.
    pub(super) fn fresh_record(
        &self,
        spec: &VmSpec,
        uid: u32,
        netns: &str,
        root_disk: PathBuf,
        vmm: Vmm,
        machine: Machine,
    ) -> VmRecord {
        let (accel, tsc_khz) = match vmm {
            Vmm::Qemu => (self.accel.accel, self.tsc_khz.map(|(k, _)| k)),
            Vmm::Firecracker => (Accel::Kvm, None),
        };
        VmRecord {
            id: spec.id.clone(),
            image: spec.image.name.clone(),
            layers: spec.image.layers.clone(),
            memory_mb: spec.memory_mb,
            vcpus: spec.vcpus,
            disk_mb: spec.disk_mb,
            uid,
            groups: Vec::new(),
            netns: netns.to_string(),
            vmlinux: self.boot.kernel.vmlinux(),
            root_disk,
            accel,
            tsc_khz,
            ram_trimmed: vmm == Vmm::Qemu && accel == Accel::Tcg,
            ram: RamMode::Shared,
            state: VmState::Running,
            pid: None,
            pid_start: None,
            forked_from: None,
            vmm,
            machine,
            fc: Default::default(),
            cpu_millis: spec.cpu_millis,
            stored: false,
        }
    }

    /// Makes a new VM's directory; an existing one means the id is taken.
    pub(super) fn create_vm_dir(&self, id: &str) -> Result<PathBuf, VmError> {
        let dir = self.vm_dir(id);
        match fs::create_dir(&dir) {
            Ok(()) => Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(VmError::Exists(id.to_string())),
            Err(e) => Err(VmError::io(format!("creating {}", dir.display()), e)),
        }
    }

    pub(super) fn vm_dir(&self, id: &str) -> PathBuf {
        self.cfg.root.join("vms").join(id)
    }

    pub(super) fn record(&self, id: &str) -> Result<VmRecord, VmError> {
        let path = self.vm_dir(id).join("vm.json");
        if !path.is_file() {
            return Err(VmError::NotFound(id.into()));
        }
        read_json(&path)
    }

    pub(super) fn save(&self, record: &VmRecord) -> Result<(), VmError> {
        write_json_atomic(&self.vm_dir(&record.id).join("vm.json"), record)
    }

    pub(super) fn uid_registry(&self) -> PathBuf {
        self.cfg
            .uid_registry
            .clone()
            .unwrap_or_else(|| self.cfg.store.root().join("vm-uids"))
    }

    /// Claims the lowest free uid of the range: a file per uid in the registry, holding
    /// the VM directory that owns it. A uid whose owner's directory is gone (its driver's
    /// data was removed without deleting the VM) is free again.
    pub(super) fn allocate_uid(&self, id: &str) -> Result<u32, VmError> {
        self.allocate_uid_for(&self.vm_dir(id))
    }

    /// Like [`Inner::allocate_uid`] for any directory of the driver that needs an id of
    /// its own (a shared RAM base's group); free again once `owner` is gone.
    pub(super) fn allocate_uid_for(&self, owner: &Path) -> Result<u32, VmError> {
        let Some(base) = self.cfg.uid_base else {
            return Ok(0);
        };
        let dir = self.uid_registry();
        fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))
            .map_err(io_err(format!("chmod {}", dir.display())))?;
        let _lock = lock_file(&dir.join(".lock"))?;
        for n in 0..UID_SLOTS {
            let uid = base + n;
            let path = dir.join(uid.to_string());
            let claim = || fs::OpenOptions::new().write(true).create_new(true).open(&path);
            let file = match claim() {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    let holder = fs::read_to_string(&path).unwrap_or_default();
                    // Older records hold a bare VM id: those are never taken for stale.
                    let stale = holder.starts_with('/') && !Path::new(holder.trim()).exists();
                    if !stale {
                        continue;
                    }
                    let _ = fs::remove_file(&path);
                    claim().map_err(|e| VmError::io("allocating a uid", e))?
                }
                Err(e) => return Err(VmError::io("allocating a uid", e)),
            };
            use std::io::Write;
            let mut file = file;
            file.write_all(owner.to_string_lossy().as_bytes())
                .map_err(io_err("recording a uid"))?;
            return Ok(uid);
        }
        Err(VmError::Invalid("no free uid left in the VM range".into()))
    }

    pub(super) fn release_uid(&self, uid: u32) {
        if uid == 0 {
            return;
        }
        let path = self.uid_registry().join(uid.to_string());
        let Ok(_lock) = lock_file(&self.uid_registry().join(".lock")) else {
            return;
        };
        // Only our own claim: a uid reclaimed by another driver stays its.
        let holder = fs::read_to_string(&path).unwrap_or_default();
        if !holder.starts_with('/') || Path::new(holder.trim()).starts_with(&self.cfg.root) {
            let _ = fs::remove_file(&path);
        }
    }

    /// The VM dir (root's, traversable) and `run/` (the VM uid's, for the QMP socket).
    pub(super) fn prepare_dir(&self, dir: &Path, uid: u32) -> Result<(), VmError> {
        fs::set_permissions(dir, fs::Permissions::from_mode(0o711))
            .map_err(io_err(format!("chmod {}", dir.display())))?;
        let run = dir.join("run");
        fs::create_dir_all(&run).map_err(io_err(format!("creating {}", run.display())))?;
        give(&run, uid, uid, 0o700)
    }

    /// Removes what a VM that never became whole had: its QEMU (if started), cgroup,
    /// namespace, uid and directory.
    pub(super) fn discard(&self, dir: &Path, netns: Option<&str>, uid: Option<u32>) {
        if let Some(pid) = fs::read_to_string(dir.join("qemu.pid"))
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            // Only if that pid is still a QEMU of this directory.
            let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(&*dir.to_string_lossy())
                && let Some(pidfd) = pidfd_open(pid)
            {
                sigkill(&pidfd);
                wait_pidfd(&pidfd, Duration::from_secs(10));
            }
        }
        if let Some(cgroup) = self.cgroup_of_dir(dir) {
            let _ = cgroup.remove();
        }
        if let Some(netns) = netns {
            let _ = net::delete(netns);
        }
        if let Some(uid) = uid {
            self.release_uid(uid);
        }
        // A retry covers a file that appeared while the tree was being removed.
        if fs::remove_dir_all(dir).is_err() {
            let _ = fs::remove_dir_all(dir);
        }
    }
}
