//! The driver layer's choice of VMM: QEMU (`-M microvm`, KVM or TCG) or Firecracker
//! (KVM only). A driver picks one for the VMs it creates; each VM records its own, so
//! VMs of both kinds live side by side under one driver (a snapshot restores with the
//! VMM that took it).

use serde::{Deserialize, Serialize};

use super::VmError;
use super::accel::AccelVerdict;
use super::firecracker::FirecrackerTools;

/// The virtual machine monitor a VM runs under.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vmm {
    /// The default of records written before there was a choice.
    #[default]
    Qemu,
    Firecracker,
}

impl Vmm {
    pub fn as_str(self) -> &'static str {
        match self {
            Vmm::Qemu => "qemu",
            Vmm::Firecracker => "firecracker",
        }
    }
}

/// What a driver's configuration asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VmmChoice {
    /// Firecracker where KVM is usable and firecracker + jailer are installed, else QEMU.
    #[default]
    Auto,
    Qemu,
    Firecracker,
}

/// The VMM a driver gives new VMs, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmmVerdict {
    pub vmm: Vmm,
    pub reason: String,
}

/// Decides the VMM for new VMs. `tools` is the outcome of looking for Firecracker.
pub fn choose_vmm(
    choice: VmmChoice,
    accel: &AccelVerdict,
    tools: &Result<FirecrackerTools, VmError>,
) -> Result<VmmVerdict, VmError> {
    let verdict = |vmm, reason: String| Ok(VmmVerdict { vmm, reason });
    match (choice, tools) {
        (VmmChoice::Qemu, _) => verdict(Vmm::Qemu, "qemu chosen by the configuration".into()),
        (VmmChoice::Firecracker, Err(e)) => Err(VmError::Prerequisite(e.to_string())),
        (VmmChoice::Firecracker, Ok(t)) => verdict(
            Vmm::Firecracker,
            format!(
                "firecracker v{} chosen by the configuration{}",
                t.version,
                if accel.kvm_usable() {
                    String::new()
                } else {
                    format!(" although guests will not run at hardware speed ({})", accel.reason)
                }
            ),
        ),
        (VmmChoice::Auto, _) if !accel.kvm_usable() => verdict(
            Vmm::Qemu,
            format!("qemu, since Firecracker needs KVM: {}", accel.reason),
        ),
        (VmmChoice::Auto, Err(e)) => verdict(Vmm::Qemu, format!("qemu, since {e}")),
        (VmmChoice::Auto, Ok(t)) => verdict(
            Vmm::Firecracker,
            format!("firecracker v{}: KVM is usable ({})", t.version, accel.reason),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::vm::Accel;
    use std::path::PathBuf;

    fn accel(kvm: bool) -> AccelVerdict {
        AccelVerdict {
            accel: if kvm { Accel::Kvm } else { Accel::Tcg },
            reason: if kvm { "probe ok".into() } else { "PVM".into() },
            probe_ms: None,
        }
    }

    fn tools() -> Result<FirecrackerTools, VmError> {
        Ok(FirecrackerTools {
            firecracker: PathBuf::from("/usr/local/bin/firecracker"),
            jailer: PathBuf::from("/usr/local/bin/jailer"),
            version: "1.12.1".into(),
        })
    }

    fn missing() -> Result<FirecrackerTools, VmError> {
        Err(VmError::Prerequisite(
            "firecracker is missing: run ./ops/test.sh".into(),
        ))
    }

    #[test]
    fn auto_picks_firecracker_only_with_usable_kvm_and_both_binaries() {
        let pick = |kvm, t| choose_vmm(VmmChoice::Auto, &accel(kvm), &t).unwrap();
        assert_eq!(pick(true, tools()).vmm, Vmm::Firecracker);
        let no_kvm = pick(false, tools());
        assert_eq!(no_kvm.vmm, Vmm::Qemu);
        assert!(no_kvm.reason.contains("PVM"), "{}", no_kvm.reason);
        let no_binaries = pick(true, missing());
        assert_eq!(no_binaries.vmm, Vmm::Qemu);
        assert!(no_binaries.reason.contains("ops/test.sh"), "{}", no_binaries.reason);
    }

    #[test]
    fn a_forced_firecracker_without_its_binaries_is_an_error_that_says_what_to_do() {
        let err = choose_vmm(VmmChoice::Firecracker, &accel(true), &missing()).unwrap_err();
        assert!(err.to_string().contains("ops/test.sh"), "{err}");
        let ok = choose_vmm(VmmChoice::Firecracker, &accel(false), &tools()).unwrap();
        assert_eq!(ok.vmm, Vmm::Firecracker);
        assert!(ok.reason.contains("not run at hardware speed"), "{}", ok.reason);
    }

    #[test]
    fn records_without_a_vmm_are_qemu() {
        assert_eq!(Vmm::default(), Vmm::Qemu);
        assert_eq!(serde_json::to_string(&Vmm::Firecracker).unwrap(), "\"firecracker\"");
    }
}
