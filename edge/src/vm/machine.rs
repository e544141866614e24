//! The machine a VM is. `microvm`: QEMU loads our kernel and initramfs itself and the
//! devices sit on virtio-mmio (a sandbox with `isolation: microvm`). `q35`: a full VM
//! (`isolation: vm`): a PC with SeaBIOS that boots the image's own disk through its
//! bootloader (`bootdisk.rs`), devices on virtio-pci. The VM record keeps the machine,
//! so create, pause, resume, snapshots and forks take one code path for both; only the
//! arguments below differ.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// The QEMU machine type of a VM.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Machine {
    /// `-M microvm`; the default of records written before there was a choice.
    #[default]
    Microvm,
    /// `-M q35` with SeaBIOS: a full VM booted from its disk.
    Q35,
}

impl Machine {
    pub fn as_str(self) -> &'static str {
        match self {
            Machine::Microvm => "microvm",
            Machine::Q35 => "q35",
        }
    }

    pub(crate) fn is_microvm(&self) -> bool {
        *self == Machine::Microvm
    }
}

/// The serial number of a full VM's disk (the guest finds its root by `root=UUID=`; the
/// serial names it in `/sys/block/*/serial` for diagnostics).
pub(crate) const DISK_SERIAL: &str = "opendsec-disk";
/// The serial number of a full VM's configuration disk, which its init looks for.
pub(crate) const CONFIG_SERIAL: &str = "opendsec-config";

/// A q35 VM's machine and devices: its disk (`rw.img`, a qcow2 overlay over the image's
/// boot disk) first in the firmware's boot order, its configuration disk (`initrd`, the
/// archive `write_config_disk` made), and the NIC on the tap QEMU inherits as
/// `tap_fd`. No option ROM for the NIC: the firmware boots from the disk only.
pub(crate) fn q35_args(dir: &Path, tap_fd: &str, mac: &str) -> Vec<String> {
    vec![
        "-M".into(),
        "q35,memory-backend=ram0".into(),
        "-drive".into(),
        format!(
            "id=disk,file={},format=qcow2,if=none,discard=unmap",
            dir.join("rw.img").display()
        ),
        "-device".into(),
        format!("virtio-blk-pci,drive=disk,serial={DISK_SERIAL},bootindex=0"),
        "-drive".into(),
        format!(
            "id=config,file={},format=raw,if=none,readonly=on",
            dir.join("initrd").display()
        ),
        "-device".into(),
        format!("virtio-blk-pci,drive=config,serial={CONFIG_SERIAL}"),
        "-netdev".into(),
        format!("tap,id=net0,fd={tap_fd},vhost=off"),
        "-device".into(),
        format!("virtio-net-pci,netdev=net0,mac={mac},romfile="),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_without_a_machine_are_microvms() {
        #[derive(Deserialize)]
        struct Old {
            #[serde(default)]
            machine: Machine,
        }
        let old: Old = serde_json::from_str("{}").unwrap();
        assert_eq!(old.machine, Machine::Microvm);
        assert_eq!(serde_json::to_string(&Machine::Q35).unwrap(), "\"q35\"");
    }

    #[test]
    fn a_full_vm_boots_from_its_overlay_and_reads_its_configuration_disk() {
        let args = q35_args(Path::new("/vms/a"), "3", "02:00:00:00:00:02").join(" ");
        assert!(args.contains("-M q35,memory-backend=ram0"), "{args}");
        assert!(args.contains("file=/vms/a/rw.img,format=qcow2"), "{args}");
        assert!(args.contains("bootindex=0"), "{args}");
        assert!(
            args.contains("file=/vms/a/initrd,format=raw,if=none,readonly=on"),
            "{args}"
        );
        assert!(args.contains("virtio-net-pci,netdev=net0"), "{args}");
    }
}
