//! The guest's initramfs, built by our own cpio writer: busybox (the `busybox` image's
//! static binary), the kernel's modules with their load order, `init.sh` and the agent.
//! It is shared by every VM of a kernel, agent and init script (keyed by their hashes,
//! under `<image store>/initramfs/<key>.cpio`, uncompressed: unpacking under TCG is
//! cheaper than decompressing). A VM's own files (the agent's token, environment and
//! start command, and `vm.conf`) are a second small archive appended to a copy of it:
//! the token never appears on the kernel command line, which every guest user can read.
//! A full VM (`q35`) boots its own variant (the PCI modules, `/opendsec/machine` saying
//! `q35`) from its disk; its files are the same small archive, on a disk of their own
//! ([`write_config_disk`]).

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::cpio::CpioWriter;
use super::kernel::{GuestKernel, ensure_kernel};
use super::machine::Machine;
use super::{AGENT_PORT, GUEST_IP, HOST_IP, VmError, file_sha256, io_err};
use crate::images::{ImageStore, StartSpec};

/// The guest's init script (part of the initramfs key).
pub(crate) const INIT_SCRIPT: &str = include_str!("init.sh");

/// Bumped when the archive's layout changes.
const LAYOUT_VERSION: u32 = 1;

/// The busybox applets `init.sh` uses.
const APPLETS: &[&str] = &[
    "sh",
    "mount",
    "umount",
    "insmod",
    "mkdir",
    "cp",
    "cat",
    "chmod",
    "usleep",
    "ip",
    "hostname",
    "switch_root",
    "reboot",
    "echo",
    "ls",
    "cpio",
    "findfs",
];

/// What a guest boots: the kernel and the shared initramfs.
#[derive(Clone, Debug)]
pub struct GuestBoot {
    pub kernel: GuestKernel,
    pub initramfs: PathBuf,
    /// The initramfs a full VM's bootloader loads (its disk carries a copy).
    pub fullvm_initramfs: PathBuf,
}

/// The kernel (built if needed) and the initramfs for `agent` (built if needed).
pub fn ensure_guest_boot(store: &ImageStore, agent: &Path, progress: &dyn Fn(&str)) -> Result<GuestBoot, VmError> {
    let kernel = ensure_kernel(store, progress)?;
    let busybox_image = store.ensure("busybox", &|p| progress(&format!("busybox image: {}", p.message)))?;
    let busybox = store
        .layer_dirs(&busybox_image)?
        .last()
        .expect("an image has a layer")
        .join("bin/busybox");
    if !agent.is_file() {
        return Err(VmError::Prerequisite(format!(
            "the static agent {} is missing: build it with edge/agent/build-static.sh",
            agent.display()
        )));
    }
    let busybox_sha = file_sha256(&busybox)?;
    let agent_sha = file_sha256(agent)?;
    let dir = store.root().join("initramfs");
    fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let build = |machine: Machine| -> Result<PathBuf, VmError> {
        let mut digest = Sha256::new();
        digest.update(format!("layout {LAYOUT_VERSION}\nkernel {}\n", kernel.dir.display()));
        digest.update(format!("busybox {busybox_sha}\n"));
        digest.update(format!("agent {agent_sha}\n"));
        digest.update(format!("machine {}\n", machine.as_str()));
        digest.update(INIT_SCRIPT);
        let key = &hex::encode(digest.finalize())[..16];
        let path = dir.join(format!("{}-{key}.cpio", kernel.release));
        if !path.is_file() {
            progress(&format!("writing the initramfs {}", path.display()));
            // Concurrent builders write the same bytes; the rename publishes one of them.
            let tmp = dir.join(format!(".{key}.{}.tmp", std::process::id()));
            let result = write_initramfs(&tmp, &kernel, machine, &busybox, agent)
                .and_then(|()| fs::rename(&tmp, &path).map_err(io_err(format!("publishing {}", path.display()))));
            if result.is_err() {
                let _ = fs::remove_file(&tmp);
            }
            result?;
        }
        Ok(path)
    };
    let initramfs = build(Machine::Microvm)?;
    let fullvm_initramfs = build(Machine::Q35)?;
    Ok(GuestBoot {
        kernel,
        initramfs,
        fullvm_initramfs,
    })
}

fn write_initramfs(
    dest: &Path,
    kernel: &GuestKernel,
    machine: Machine,
    busybox: &Path,
    agent: &Path,
) -> Result<(), VmError> {
    let context = format!("writing {}", dest.display());
    let file = fs::File::create(dest).map_err(io_err(context.clone()))?;
    let mut w = CpioWriter::new(BufWriter::new(file));
    let add_file = |w: &mut CpioWriter<BufWriter<fs::File>>, path: &str, mode: u32, source: &Path| {
        let mut f = fs::File::open(source).map_err(io_err(format!("reading {}", source.display())))?;
        let len = f
            .metadata()
            .map_err(io_err(format!("reading {}", source.display())))?
            .len();
        w.file_from(path, mode, len, &mut f)
            .map_err(io_err(format!("adding {} to the initramfs", source.display())))
    };
    let io = |r: std::io::Result<()>| r.map_err(io_err(context.clone()));
    for dir in [
        "bin",
        "dev",
        "proc",
        "sys",
        "ro",
        "rw",
        "newroot",
        "lib",
        "lib/modules",
        "opendsec",
    ] {
        io(w.dir(dir, 0o755))?;
    }
    io(w.char_device("dev/console", 0o600, 5, 1))?;
    io(w.dir("opendsec/config", 0o700))?;
    add_file(&mut w, "bin/busybox", 0o755, busybox)?;
    for applet in APPLETS {
        io(w.symlink(&format!("bin/{applet}"), "busybox"))?;
    }
    let modules = match machine {
        Machine::Microvm => &kernel.modules,
        Machine::Q35 => &kernel.fullvm_modules,
    };
    if modules.is_empty() {
        return Err(VmError::Build {
            what: "the initramfs".into(),
            message: format!(
                "the guest kernel in {} names no modules for a {} machine",
                kernel.dir.display(),
                machine.as_str()
            ),
        });
    }
    for (name, path) in modules.iter().zip(kernel.paths_of(modules)) {
        add_file(&mut w, &format!("lib/modules/{name}.ko"), 0o644, &path)?;
    }
    let order = modules.join("\n") + "\n";
    io(w.file("lib/modules/load-order", 0o644, order.as_bytes()))?;
    if machine != Machine::Microvm {
        io(w.file("opendsec/machine", 0o644, machine.as_str().as_bytes()))?;
    }
    io(w.file("init", 0o755, INIT_SCRIPT.as_bytes()))?;
    add_file(&mut w, "opendsec/agent", 0o700, agent)?;
    let mut out = w.finish().map_err(io_err(context.clone()))?;
    out.flush().map_err(io_err(context.clone()))?;
    out.into_inner()
        .map_err(|e| VmError::io(context.clone(), e.into_error()))?
        .sync_all()
        .map_err(io_err(context))
}

/// What one guest's agent is told at boot.
#[derive(Clone, Debug)]
pub(crate) struct GuestConfig {
    pub hostname: String,
    pub access_token: String,
    pub env: BTreeMap<String, String>,
    pub start: Option<StartSpec>,
    /// The image's WorkingDir ("" for none): where processes naming no directory start.
    pub workdir: String,
    /// The image's User by name (`ImageConfig::account`): who they run as.
    pub user: Option<String>,
}

impl GuestConfig {
    /// What the guest of VM `spec` is configured with.
    pub(crate) fn of(spec: &super::VmSpec) -> GuestConfig {
        GuestConfig {
            hostname: spec.id.clone(),
            access_token: spec.access_token.clone(),
            env: spec.env.clone(),
            start: spec.image.config.start.clone(),
            workdir: spec.image.config.workdir.clone(),
            user: spec.image.config.account().map(str::to_string),
        }
    }
}

/// Writes `dest`: the shared initramfs followed by an archive of this VM's files.
pub(crate) fn write_vm_initrd(boot: &GuestBoot, dest: &Path, config: &GuestConfig) -> Result<(), VmError> {
    let context = format!("writing {}", dest.display());
    fs::copy(&boot.initramfs, dest).map_err(io_err(context.clone()))?;
    let file = fs::OpenOptions::new()
        .append(true)
        .open(dest)
        .map_err(io_err(context.clone()))?;
    write_config_archive(file, dest, config)
}

/// The size a full VM's configuration disk is rounded up to (a whole number of sectors;
/// one size for every VM of a similar configuration, so a restored machine's disk
/// looks as its source's did).
const CONFIG_DISK_ALIGN: u64 = 64 << 10;

/// Writes `dest`: a full VM's configuration disk, the archive of this VM's files that a
/// microVM's initrd ends with, zero-padded to a multiple of [`CONFIG_DISK_ALIGN`]. Its
/// init unpacks it (cpio stops at the archive's trailer).
pub(crate) fn write_config_disk(dest: &Path, config: &GuestConfig) -> Result<(), VmError> {
    let context = format!("writing {}", dest.display());
    let file = fs::File::create(dest).map_err(io_err(context.clone()))?;
    write_config_archive(file.try_clone().map_err(io_err(context.clone()))?, dest, config)?;
    let len = file.metadata().map_err(io_err(context.clone()))?.len();
    file.set_len(len.div_ceil(CONFIG_DISK_ALIGN).max(1) * CONFIG_DISK_ALIGN)
        .map_err(io_err(context.clone()))?;
    file.sync_all().map_err(io_err(context))
}

/// Appends the archive of one VM's files (`vm.conf` and the agent's configuration) to
/// `file` (the end of `dest`).
fn write_config_archive(file: fs::File, dest: &Path, config: &GuestConfig) -> Result<(), VmError> {
    let context = format!("writing {}", dest.display());
    let mut w = CpioWriter::new(BufWriter::new(file));
    let io = |r: std::io::Result<()>| r.map_err(io_err(context.clone()));
    let [a, b, c, d] = GUEST_IP;
    let [h1, h2, h3, h4] = HOST_IP;
    let conf = format!(
        "GUEST_IP={a}.{b}.{c}.{d}\nGUEST_PREFIX=30\nHOST_IP={h1}.{h2}.{h3}.{h4}\nAGENT_PORT={AGENT_PORT}\nGUEST_HOSTNAME={}\n",
        shell_word(&config.hostname)
    );
    io(w.file("opendsec/vm.conf", 0o644, conf.as_bytes()))?;
    io(w.file("opendsec/config/token", 0o600, config.access_token.as_bytes()))?;
    let env = serde_json::to_vec(&config.env).expect("a map serialises");
    io(w.file("opendsec/config/env.json", 0o600, &env))?;
    if let Some(start) = &config.start {
        let start = serde_json::to_vec(start).expect("a start spec serialises");
        io(w.file("opendsec/config/start.json", 0o600, &start))?;
    }
    if config.workdir.starts_with('/') {
        io(w.file("opendsec/config/workdir", 0o600, config.workdir.as_bytes()))?;
    }
    if let Some(user) = &config.user {
        io(w.file("opendsec/config/user", 0o600, user.as_bytes()))?;
    }
    let mut out = w.finish().map_err(io_err(context.clone()))?;
    out.flush().map_err(io_err(context))
}

/// A host name as one safe shell word (letters, digits, '-').
fn shell_word(s: &str) -> String {
    let word: String = s
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(63)
        .collect();
    if word.is_empty() { "sandbox".into() } else { word }
}
