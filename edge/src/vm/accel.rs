//! Which accelerator guests get, decided honestly: `/dev/kvm` counts as usable only if a
//! probe guest (our kernel and initramfs, told by `opendsec.probe=1` to stop as soon as
//! it reaches user space) gets there under `-accel kvm` within a bound that hardware
//! virtualisation meets many times over. A paravirtual KVM such as PVM (`kvm_pvm`) runs
//! only guests built for it: a stock kernel crawls through the instruction emulator and
//! never arrives, so the verdict there is "not usable" and guests run under TCG.
//!
//! Also here: the host's TSC frequency, which guests get as `tsc_early_khz=` (under TCG
//! the guest's TSC is the host's; without it about one boot in six hangs calibrating).
//!
//! **Architecture Invariant:** KVM is used only when a probe guest reached user space under
//! `-accel kvm` within a bound (8 s); `/dev/kvm` alone proves nothing. The verdict and its
//! reason are reported (in the edge's log and in each VM's runtime).

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use super::VmError;
use super::initramfs::GuestBoot;

/// The marker `init.sh` prints in probe mode.
const PROBE_MARKER: &[u8] = b"@@OPENDSEC_PROBE_USERSPACE";

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Accel {
    Kvm,
    Tcg,
}

impl Accel {
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }
}

/// The outcome of [`detect_accel`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AccelVerdict {
    pub accel: Accel,
    /// Why: what was found and measured.
    pub reason: String,
    /// How long the probe guest took to reach user space under KVM, when it did.
    pub probe_ms: Option<u64>,
}

impl AccelVerdict {
    pub fn kvm_usable(&self) -> bool {
        self.accel == Accel::Kvm
    }
}

/// `_IO(KVMIO, 0x00)`.
const KVM_GET_API_VERSION: libc::c_ulong = 0xAE00;

/// Decides between KVM and TCG for guests of `boot`, booting a probe guest under KVM
/// when `/dev/kvm` answers. `bound` is how long the probe may take (hardware KVM needs
/// well under a second for this kernel; TCG needs several).
pub fn detect_accel(qemu: &Path, boot: &GuestBoot, bound: Duration) -> Result<AccelVerdict, VmError> {
    let tcg = |reason: String| AccelVerdict {
        accel: Accel::Tcg,
        reason,
        probe_ms: None,
    };
    let dev = Path::new("/dev/kvm");
    if !dev.exists() {
        return Ok(tcg("KVM not usable: there is no /dev/kvm".into()));
    }
    let kvm = match std::fs::OpenOptions::new().read(true).write(true).open(dev) {
        Ok(f) => f,
        Err(e) => return Ok(tcg(format!("KVM not usable: opening /dev/kvm: {e}"))),
    };
    // SAFETY: an argument-less ioctl on an fd we own.
    let api = unsafe { libc::ioctl(kvm.as_raw_fd(), KVM_GET_API_VERSION as _, 0) };
    drop(kvm);
    if api != 12 {
        return Ok(tcg(format!(
            "KVM not usable: /dev/kvm reports API version {api}, not 12"
        )));
    }
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    let flavour = if pvm {
        " (PVM: the kvm_pvm module provides /dev/kvm; it runs only guests built with CONFIG_PVM_GUEST)"
    } else {
        ""
    };

    let start = Instant::now();
    let mut child = Command::new(qemu)
        .args([
            "-M", "microvm", "-accel", "kvm", "-cpu", "host", "-m", "128", "-smp", "1",
        ])
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
        .arg(boot.kernel.vmlinux())
        .arg("-initrd")
        .arg(&boot.initramfs)
        .args(["-append", "console=ttyS0 panic=-1 quiet opendsec.probe=1"])
        .env_clear()
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| VmError::Prerequisite(format!("cannot run {}: {e}", qemu.display())))?;
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match stdout.read(&mut buf) {
                Ok(0) | Err(_) => return (seen, None),
                Ok(n) => {
                    seen.extend_from_slice(&buf[..n]);
                    if seen.windows(PROBE_MARKER.len()).any(|w| w == PROBE_MARKER) {
                        return (seen, Some(Instant::now()));
                    }
                }
            }
        }
    });
    let deadline = start + bound;
    while !reader.is_finished() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    let _ = child.wait();
    let (seen, reached) = reader.join().unwrap_or_default();
    let mut err_text = String::new();
    let _ = stderr.read_to_string(&mut err_text);
    if let Some(at) = reached {
        let ms = at.duration_since(start).as_millis() as u64;
        if at <= deadline {
            return Ok(AccelVerdict {
                accel: Accel::Kvm,
                reason: format!("KVM usable: a probe guest reached user space in {ms} ms under -accel kvm{flavour}"),
                probe_ms: Some(ms),
            });
        }
    }
    let said = String::from_utf8_lossy(&seen).to_string() + &err_text;
    let said: String = said
        .trim()
        .chars()
        .rev()
        .take(300)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let detail = if said.is_empty() {
        "it printed nothing".to_string()
    } else {
        format!("its last output: {}", said.replace('\n', " | "))
    };
    Ok(tcg(format!(
        "KVM not usable{}: a probe guest did not reach user space within {} ms under -accel kvm ({detail}){flavour}",
        if pvm { " (PVM)" } else { "" },
        bound.as_millis()
    )))
}

/// The host's TSC frequency in kHz and where it was read: the hypervisor's timing leaf
/// (CPUID 0x40000010), the crystal clock leaf (0x15), else `cpu MHz` of /proc/cpuinfo.
pub fn host_tsc_khz() -> Option<(u64, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::__cpuid;
        // CPUID is always available on x86_64 (hence a safe function).
        let hv = __cpuid(0x4000_0000);
        if hv.eax >= 0x4000_0010 {
            let timing = __cpuid(0x4000_0010);
            if timing.eax > 0 {
                return Some((timing.eax as u64, "CPUID 0x40000010"));
            }
        }
        let max = __cpuid(0).eax;
        if max >= 0x15 {
            let leaf = __cpuid(0x15);
            if leaf.eax != 0 && leaf.ebx != 0 && leaf.ecx != 0 {
                let hz = leaf.ecx as u64 * leaf.ebx as u64 / leaf.eax as u64;
                return Some((hz / 1000, "CPUID 0x15"));
            }
        }
    }
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("cpu MHz"))?
        .trim_start_matches([' ', '\t', ':'])
        .trim()
        .parse()
        .ok()?;
    Some(((mhz * 1000.0).round() as u64, "/proc/cpuinfo"))
}
