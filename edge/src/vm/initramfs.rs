//! The guest's initramfs, built by our own cpio writer: busybox (the `busybox` image's
//! static binary), the kernel's modules with their load order, `init.sh` and the agent.
//! It is shared by every VM of a kernel, agent and init script (keyed by their hashes,
//! under `<image store>/initramfs/<key>.cpio`, uncompressed: unpacking under TCG is
//! cheaper than decompressing). A VM's own files (the agent's token, environment and
//! start command, and `vm.conf`) are a second small archive appended to a copy of it:
//! the token never appears on the kernel command line, which every guest user can read.

use std::collections::BTreeMap;
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::cpio::CpioWriter;
use super::kernel::{GuestKernel, ensure_kernel};
use super::{AGENT_PORT, GUEST_IP, VmError, file_sha256, io_err};
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
];

/// What a guest boots: the kernel and the shared initramfs.
#[derive(Clone, Debug)]
pub struct GuestBoot {
    pub kernel: GuestKernel,
    pub initramfs: PathBuf,
}

/// The kernel (built if needed) and the initramfs for `agent` (built if needed).
pub fn ensure_guest_boot(
    store: &ImageStore,
    agent: &Path,
    progress: &dyn Fn(&str),
) -> Result<GuestBoot, VmError> {
    let kernel = ensure_kernel(store, progress)?;
    let busybox_image = store.ensure("busybox", &|p| {
        progress(&format!("busybox image: {}", p.message))
    })?;
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
    let mut digest = Sha256::new();
    digest.update(format!(
        "layout {LAYOUT_VERSION}\nkernel {}\n",
        kernel.dir.display()
    ));
    digest.update(format!("busybox {}\n", file_sha256(&busybox)?));
    digest.update(format!("agent {}\n", file_sha256(agent)?));
    digest.update(INIT_SCRIPT);
    let key = &hex::encode(digest.finalize())[..16];
    let dir = store.root().join("initramfs");
    fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let path = dir.join(format!("{}-{key}.cpio", kernel.release));
    if !path.is_file() {
        progress(&format!("writing the initramfs {}", path.display()));
        // Concurrent builders write the same bytes; the rename publishes one of them.
        let tmp = dir.join(format!(".{key}.{}.tmp", std::process::id()));
        let result = write_initramfs(&tmp, &kernel, &busybox, agent).and_then(|()| {
            fs::rename(&tmp, &path).map_err(io_err(format!("publishing {}", path.display())))
        });
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        result?;
    }
    Ok(GuestBoot {
        kernel,
        initramfs: path,
    })
}

fn write_initramfs(
    dest: &Path,
    kernel: &GuestKernel,
    busybox: &Path,
    agent: &Path,
) -> Result<(), VmError> {
    let context = format!("writing {}", dest.display());
    let file = fs::File::create(dest).map_err(io_err(context.clone()))?;
    let mut w = CpioWriter::new(BufWriter::new(file));
    let add_file =
        |w: &mut CpioWriter<BufWriter<fs::File>>, path: &str, mode: u32, source: &Path| {
            let mut f =
                fs::File::open(source).map_err(io_err(format!("reading {}", source.display())))?;
            let len = f
                .metadata()
                .map_err(io_err(format!("reading {}", source.display())))?
                .len();
            w.file_from(path, mode, len, &mut f).map_err(io_err(format!(
                "adding {} to the initramfs",
                source.display()
            )))
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
    for (name, path) in kernel.modules.iter().zip(kernel.module_paths()) {
        add_file(&mut w, &format!("lib/modules/{name}.ko"), 0o644, &path)?;
    }
    let order = kernel.modules.join("\n") + "\n";
    io(w.file("lib/modules/load-order", 0o644, order.as_bytes()))?;
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
}

/// Writes `dest`: the shared initramfs followed by an archive of this VM's files.
pub(crate) fn write_vm_initrd(
    boot: &GuestBoot,
    dest: &Path,
    config: &GuestConfig,
) -> Result<(), VmError> {
    let context = format!("writing {}", dest.display());
    fs::copy(&boot.initramfs, dest).map_err(io_err(context.clone()))?;
    let file = fs::OpenOptions::new()
        .append(true)
        .open(dest)
        .map_err(io_err(context.clone()))?;
    let mut w = CpioWriter::new(BufWriter::new(file));
    let io = |r: std::io::Result<()>| r.map_err(io_err(context.clone()));
    let [a, b, c, d] = GUEST_IP;
    let conf = format!(
        "GUEST_IP={a}.{b}.{c}.{d}\nGUEST_PREFIX=30\nAGENT_PORT={AGENT_PORT}\nGUEST_HOSTNAME={}\n",
        shell_word(&config.hostname)
    );
    io(w.file("opendsec/vm.conf", 0o644, conf.as_bytes()))?;
    io(w.file(
        "opendsec/config/token",
        0o600,
        config.access_token.as_bytes(),
    ))?;
    let env = serde_json::to_vec(&config.env).expect("a map serialises");
    io(w.file("opendsec/config/env.json", 0o600, &env))?;
    if let Some(start) = &config.start {
        let start = serde_json::to_vec(start).expect("a start spec serialises");
        io(w.file("opendsec/config/start.json", 0o600, &start))?;
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
    if word.is_empty() {
        "sandbox".into()
    } else {
        word
    }
}
