//! The guest kernel: Debian's `linux-image-amd64` (the metapackage names the real
//! `linux-image-<release>` package), fetched with `apt-get download` from the host's
//! default sources, its vmlinux taken out of the bzImage (the boot protocol header says
//! where the compressed payload is; the host's decompressor unpacks it) and the modules
//! the guest needs, with their dependencies read from each module's `.modinfo` section
//! (Debian ships no `modules.dep`: depmod runs at install time), in load order.
//!
//! Cached under `<image store>/kernels/<release>_<version>_<recipe>/` (`kernel.json`,
//! `vmlinux`, `vmlinuz` (the bzImage as shipped, which a full VM's bootloader loads),
//! `modules/<name>.ko`), published by a rename and built once per machine under
//! `<image store>/locks/kernel.lock`.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{VmError, io_err, lock_file, read_json, require_tool, write_json_atomic};
use crate::images::ImageStore;

/// The modules the guest loads (their dependencies come along): virtio over MMIO (what
/// `-M microvm` has), its block and network drivers, the file systems of the root
/// (EROFS), the writable disk (ext4) and their composition (overlay). ext4 names its
/// checksum only as a soft dependency (`crypto-crc32c`), so crc32c_generic is listed.
pub const GUEST_MODULES: &[&str] = &[
    "virtio_mmio",
    "virtio_blk",
    "virtio_net",
    "crc32c_generic",
    "ext4",
    "erofs",
    "overlay",
];

/// The modules a full VM (`-M q35`, `fullvm.rs`) loads: virtio over PCI, its block and
/// network drivers and the root partition's ext4.
pub const FULLVM_MODULES: &[&str] = &["virtio_pci", "virtio_blk", "virtio_net", "crc32c_generic", "ext4"];

/// Bumped when the layout of a kernel directory changes.
const LAYOUT_VERSION: u32 = 2;

/// The metapackage that follows Debian's current kernel.
const META_PACKAGE: &str = "linux-image-amd64";

/// A guest kernel ready to boot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestKernel {
    /// `uname -r` of the guest, e.g. `6.1.0-57-amd64`.
    pub release: String,
    /// The Debian package and version it came from.
    pub package: String,
    pub version: String,
    /// Module names in load order (dependencies first).
    pub modules: Vec<String>,
    /// A full VM's modules ([`FULLVM_MODULES`]), in load order, in the same `modules/`.
    #[serde(default)]
    pub fullvm_modules: Vec<String>,
    #[serde(skip)]
    pub dir: PathBuf,
}

impl GuestKernel {
    pub fn vmlinux(&self) -> PathBuf {
        self.dir.join("vmlinux")
    }

    /// The compressed kernel as Debian ships it (for a bootloader).
    pub fn vmlinuz(&self) -> PathBuf {
        self.dir.join("vmlinuz")
    }

    /// Paths of the module files, in load order.
    pub fn module_paths(&self) -> Vec<PathBuf> {
        self.paths_of(&self.modules)
    }

    /// Paths of the files of `modules` (names from [`GuestKernel::modules`] or
    /// [`GuestKernel::fullvm_modules`]).
    pub fn paths_of(&self, modules: &[String]) -> Vec<PathBuf> {
        modules
            .iter()
            .map(|m| self.dir.join("modules").join(format!("{m}.ko")))
            .collect()
    }

    fn load(dir: &Path) -> Result<Self, VmError> {
        let mut kernel: GuestKernel = read_json(&dir.join("kernel.json"))?;
        kernel.dir = dir.to_path_buf();
        Ok(kernel)
    }
}

fn recipe_hash() -> String {
    let mut digest = Sha256::new();
    digest.update(format!("layout {LAYOUT_VERSION}\n"));
    for m in GUEST_MODULES {
        digest.update(format!("module {m}\n"));
    }
    for m in FULLVM_MODULES {
        digest.update(format!("full VM module {m}\n"));
    }
    hex::encode(digest.finalize())[..8].to_string()
}

fn build_err(message: impl Into<String>) -> VmError {
    VmError::Build {
        what: "the guest kernel".into(),
        message: message.into(),
    }
}

/// Returns the cached guest kernel for the current candidate of `linux-image-amd64`,
/// building it first if needed. Without apt's package lists (no `apt-get update` yet,
/// or a host without apt) the newest kernel already cached is used.
pub fn ensure_kernel(store: &ImageStore, progress: &dyn Fn(&str)) -> Result<GuestKernel, VmError> {
    let root = store.root().join("kernels");
    fs::create_dir_all(&root).map_err(io_err(format!("creating {}", root.display())))?;
    let recipe = recipe_hash();
    let candidate = match candidate_package() {
        Ok(c) => c,
        Err(e) => {
            return newest_cached(&root, &recipe)?.ok_or_else(|| {
                build_err(format!(
                    "no guest kernel is cached and apt has no candidate for {META_PACKAGE}: {e} (has `apt-get update` run?)"
                ))
            });
        }
    };
    let (package, version) = candidate;
    let release = package
        .strip_prefix("linux-image-")
        .ok_or_else(|| {
            build_err(format!(
                "{META_PACKAGE} depends on {package:?}, not a linux-image-* package"
            ))
        })?
        .to_string();
    let dir = root.join(format!("{release}_{version}_{recipe}"));
    if dir.join("kernel.json").is_file() {
        return GuestKernel::load(&dir);
    }
    let _lock = lock_file(&store.root().join("locks").join("kernel.lock"))?;
    if dir.join("kernel.json").is_file() {
        progress("built by another process");
        return GuestKernel::load(&dir);
    }
    let scratch = store.root().join("tmp").join(format!("kernel-{}", std::process::id()));
    let _ = fs::remove_dir_all(&scratch);
    let staged = scratch.join("out");
    let result = (|| {
        fs::create_dir_all(staged.join("modules")).map_err(io_err("creating the kernel scratch dir"))?;
        build(&scratch, &staged, &package, &version, &release, progress)?;
        fs::rename(&staged, &dir).map_err(io_err(format!("publishing {}", dir.display())))
    })();
    let _ = fs::remove_dir_all(&scratch);
    result?;
    progress(&format!("guest kernel {release} ready in {}", dir.display()));
    GuestKernel::load(&dir)
}

fn newest_cached(root: &Path, recipe: &str) -> Result<Option<GuestKernel>, VmError> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in fs::read_dir(root).map_err(io_err(format!("listing {}", root.display())))? {
        let Ok(entry) = entry else { continue };
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.ends_with(&format!("_{recipe}")) || !path.join("kernel.json").is_file() {
            continue;
        }
        let mtime = entry
            .metadata()
            .and_then(|m| m.modified())
            .unwrap_or(std::time::UNIX_EPOCH);
        if best.as_ref().is_none_or(|(t, _)| mtime > *t) {
            best = Some((mtime, path));
        }
    }
    best.map(|(_, p)| GuestKernel::load(&p)).transpose()
}

/// Runs a host tool with a clean environment; it dies with the calling thread.
fn tool(program: &Path) -> Command {
    let mut command = Command::new(program);
    command
        .env_clear()
        .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .env("LANG", "C.UTF-8")
        .stdin(Stdio::null());
    // SAFETY: prctl is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    command
}

fn run(mut command: Command, what: &str) -> Result<Vec<u8>, VmError> {
    let out = command.output().map_err(io_err(format!("running {what}")))?;
    if !out.status.success() {
        return Err(build_err(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(out.stdout)
}

/// The package the metapackage's candidate depends on, and its version:
/// `Depends: linux-image-6.1.0-57-amd64 (= 6.1.192-3)`.
fn candidate_package() -> Result<(String, String), VmError> {
    let apt_cache = require_tool("apt-cache", "apt")?;
    let mut command = tool(&apt_cache);
    command.args(["show", "--no-all-versions", META_PACKAGE]);
    let out = run(command, "apt-cache show")?;
    let text = String::from_utf8_lossy(&out);
    parse_meta_depends(&text).ok_or_else(|| {
        build_err(format!(
            "no Depends line naming a versioned package in `apt-cache show {META_PACKAGE}`"
        ))
    })
}

pub(crate) fn parse_meta_depends(show: &str) -> Option<(String, String)> {
    let depends = show.lines().find_map(|l| l.strip_prefix("Depends:"))?;
    let first = depends.split(',').next()?.split('|').next()?.trim();
    let (name, rest) = first.split_once('(')?;
    let version = rest.trim().strip_prefix('=')?.trim().trim_end_matches(')').trim();
    let name = name.trim();
    (!name.is_empty() && !version.is_empty()).then(|| (name.to_string(), version.to_string()))
}

fn build(
    scratch: &Path,
    staged: &Path,
    package: &str,
    version: &str,
    release: &str,
    progress: &dyn Fn(&str),
) -> Result<(), VmError> {
    let apt_get = require_tool("apt-get", "apt")?;
    let dpkg_deb = require_tool("dpkg-deb", "dpkg")?;
    progress(&format!("apt-get download {package}={version}"));
    let download = scratch.join("download");
    fs::create_dir_all(&download).map_err(io_err("creating the download dir"))?;
    let mut command = tool(&apt_get);
    // As root apt wants to drop to `_apt`, which cannot write here.
    command
        .args(["-q", "-o", "APT::Sandbox::User=root", "download"])
        .arg(format!("{package}={version}"))
        .current_dir(&download);
    run(command, "apt-get download")?;
    let deb = fs::read_dir(&download)
        .map_err(io_err("listing the download dir"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .ok_or_else(|| build_err("apt-get download produced no .deb"))?;
    progress(&format!("dpkg-deb -x {}", deb.display()));
    let extracted = scratch.join("x");
    let mut command = tool(&dpkg_deb);
    command.arg("-x").arg(&deb).arg(&extracted);
    run(command, "dpkg-deb -x")?;

    progress("extracting vmlinux from the bzImage");
    let vmlinuz = extracted.join("boot").join(format!("vmlinuz-{release}"));
    let image = fs::read(&vmlinuz).map_err(io_err(format!("reading {}", vmlinuz.display())))?;
    extract_vmlinux(&image, &staged.join("vmlinux"))?;
    fs::write(staged.join("vmlinuz"), &image)
        .map_err(io_err(format!("writing {}", staged.join("vmlinuz").display())))?;

    let modules_root = extracted.join("lib/modules").join(release);
    let builtin: BTreeSet<String> = fs::read_to_string(modules_root.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| module_name(Path::new(l)))
        .collect();
    let mut index = BTreeMap::new();
    index_modules(&modules_root.join("kernel"), &mut index)?;
    progress(&format!(
        "resolving {} modules and their dependencies among {}",
        GUEST_MODULES.len(),
        index.len()
    ));
    let modules_dir = staged.join("modules");
    let mut stage = |name: &str| {
        let source = index
            .get(name)
            .ok_or_else(|| build_err(format!("module {name} is neither in the package nor built in")))?;
        let dest = modules_dir.join(format!("{name}.ko"));
        if !dest.is_file() {
            copy_module(source, &dest)?;
        }
        let bytes = fs::read(&dest).map_err(io_err(format!("reading {}", dest.display())))?;
        modinfo_depends(&bytes).map_err(|e| build_err(format!("{name}.ko: {e}")))
    };
    let order = resolve_modules(GUEST_MODULES, &builtin, &mut stage)?;
    let fullvm_order = resolve_modules(FULLVM_MODULES, &builtin, &mut stage)?;
    write_json_atomic(
        &staged.join("kernel.json"),
        &GuestKernel {
            release: release.into(),
            package: package.into(),
            version: version.into(),
            modules: order,
            fullvm_modules: fullvm_order,
            dir: PathBuf::new(),
        },
    )
}

/// `kernel/fs/ext4/ext4.ko[.xz]` -> `ext4` (module names use `_`, file names may use `-`).
fn module_name(path: &Path) -> Option<String> {
    let file = path.file_name()?.to_str()?;
    let stem = [".ko", ".ko.xz", ".ko.zst", ".ko.gz"]
        .iter()
        .find_map(|ext| file.strip_suffix(ext))?;
    Some(stem.replace('-', "_"))
}

fn index_modules(dir: &Path, index: &mut BTreeMap<String, PathBuf>) -> Result<(), VmError> {
    for entry in fs::read_dir(dir).map_err(io_err(format!("listing {}", dir.display())))? {
        let entry = entry.map_err(io_err("listing modules"))?;
        let path = entry.path();
        if entry.file_type().map(|t| t.is_dir()).unwrap_or(false) {
            index_modules(&path, index)?;
        } else if let Some(name) = module_name(&path) {
            index.insert(name, path);
        }
    }
    Ok(())
}

/// Copies a module, decompressing `.ko.xz`/`.ko.zst`/`.ko.gz` (newer Debian kernels):
/// busybox's insmod loads plain `.ko` files.
fn copy_module(source: &Path, dest: &Path) -> Result<(), VmError> {
    let name = source.to_string_lossy();
    let (tool_name, package) = if name.ends_with(".xz") {
        ("xz", "xz-utils")
    } else if name.ends_with(".zst") {
        ("zstd", "zstd")
    } else if name.ends_with(".gz") {
        ("gzip", "gzip")
    } else {
        fs::copy(source, dest).map_err(io_err(format!("copying {}", source.display())))?;
        return Ok(());
    };
    let program = require_tool(tool_name, package)?;
    let out = fs::File::create(dest).map_err(io_err(format!("creating {}", dest.display())))?;
    let mut command = tool(&program);
    command.arg("-dc").arg(source).stdout(out);
    run(command, &format!("{tool_name} -dc {}", source.display()))?;
    Ok(())
}

/// Orders `wanted` and their dependencies so that each module comes after the modules
/// it depends on; `depends(name)` makes the module available and returns its
/// `depends=` list. Built-in modules are skipped.
pub(crate) fn resolve_modules(
    wanted: &[&str],
    builtin: &BTreeSet<String>,
    mut depends: impl FnMut(&str) -> Result<Vec<String>, VmError>,
) -> Result<Vec<String>, VmError> {
    fn visit(
        name: &str,
        builtin: &BTreeSet<String>,
        depends: &mut dyn FnMut(&str) -> Result<Vec<String>, VmError>,
        done: &mut Vec<String>,
        path: &mut Vec<String>,
    ) -> Result<(), VmError> {
        if builtin.contains(name) || done.iter().any(|d| d == name) {
            return Ok(());
        }
        if path.iter().any(|p| p == name) {
            return Err(build_err(format!(
                "modules depend on each other in a cycle: {} -> {name}",
                path.join(" -> ")
            )));
        }
        path.push(name.to_string());
        for dep in depends(name)? {
            visit(&dep, builtin, depends, done, path)?;
        }
        path.pop();
        done.push(name.to_string());
        Ok(())
    }
    let mut done = Vec::new();
    for name in wanted {
        visit(name, builtin, &mut depends, &mut done, &mut Vec::new())?;
    }
    Ok(done)
}

/// The `depends=` entry of a module's `.modinfo` ELF section.
pub(crate) fn modinfo_depends(elf: &[u8]) -> Result<Vec<String>, String> {
    let section = elf_section(elf, ".modinfo")?;
    Ok(section
        .split(|b| *b == 0)
        .filter_map(|entry| std::str::from_utf8(entry).ok()?.strip_prefix("depends="))
        .flat_map(|list| list.split(','))
        .filter(|d| !d.is_empty())
        .map(|d| d.replace('-', "_"))
        .collect())
}

fn elf_section<'a>(elf: &'a [u8], wanted: &str) -> Result<&'a [u8], String> {
    let u16_at = |o: usize| -> Result<u16, String> {
        elf.get(o..o + 2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .ok_or_else(|| "truncated ELF".to_string())
    };
    let u32_at = |o: usize| -> Result<u32, String> {
        elf.get(o..o + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
            .ok_or_else(|| "truncated ELF".to_string())
    };
    let u64_at = |o: usize| -> Result<u64, String> {
        elf.get(o..o + 8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .ok_or_else(|| "truncated ELF".to_string())
    };
    if elf.get(..5) != Some(b"\x7fELF\x02") || elf.get(5) != Some(&1) {
        return Err("not a little-endian 64-bit ELF file".into());
    }
    let shoff = u64_at(0x28)? as usize;
    let shentsize = u16_at(0x3a)? as usize;
    let shnum = u16_at(0x3c)? as usize;
    let shstrndx = u16_at(0x3e)? as usize;
    let header = |i: usize| shoff + i * shentsize;
    let strtab_off = u64_at(header(shstrndx) + 24)? as usize;
    for i in 0..shnum {
        let name_off = strtab_off + u32_at(header(i))? as usize;
        let name_end = elf
            .get(name_off..)
            .and_then(|rest| rest.iter().position(|b| *b == 0))
            .ok_or("bad section name")?;
        if &elf[name_off..name_off + name_end] == wanted.as_bytes() {
            let offset = u64_at(header(i) + 24)? as usize;
            let size = u64_at(header(i) + 32)? as usize;
            return elf
                .get(offset..offset + size)
                .ok_or_else(|| format!("section {wanted} lies outside the file"));
        }
    }
    Err(format!("no {wanted} section"))
}

/// A compressed kernel payload's format, by its magic bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Compression {
    Gzip,
    Xz,
    Zstd,
    Lz4,
    Bzip2,
    Lzma,
}

impl Compression {
    pub(crate) fn detect(payload: &[u8]) -> Option<Self> {
        let starts = |m: &[u8]| payload.starts_with(m);
        Some(if starts(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if starts(b"\xfd7zXZ\x00") {
            Compression::Xz
        } else if starts(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else if starts(&[0x02, 0x21, 0x4c, 0x18]) {
            Compression::Lz4
        } else if starts(b"BZh") {
            Compression::Bzip2
        } else if starts(&[0x5d, 0x00, 0x00]) {
            Compression::Lzma
        } else {
            return None;
        })
    }

    /// The host tool (and its Debian package) and arguments that decompress to stdout.
    fn tool(self) -> (&'static str, &'static str, &'static [&'static str]) {
        match self {
            Compression::Gzip => ("gzip", "gzip", &["-dc"]),
            Compression::Xz => ("xz", "xz-utils", &["-dc"]),
            Compression::Zstd => ("zstd", "zstd", &["-dc"]),
            Compression::Lz4 => ("lz4", "lz4", &["-dc"]),
            Compression::Bzip2 => ("bzip2", "bzip2", &["-dc"]),
            Compression::Lzma => ("xz", "xz-utils", &["--format=lzma", "-dc"]),
        }
    }
}

/// Where the compressed kernel lies in a bzImage: after the real-mode setup sectors, at
/// the header's `payload_offset`, `payload_length` bytes long (boot protocol >= 2.08).
pub(crate) fn bzimage_payload(image: &[u8]) -> Result<&[u8], String> {
    if image.get(0x202..0x206) != Some(b"HdrS") {
        return Err("not a bzImage (no HdrS header)".into());
    }
    let version = u16::from_le_bytes([image[0x206], image[0x207]]);
    if version < 0x208 {
        return Err(format!("boot protocol {version:#x} has no payload fields (need 2.08)"));
    }
    let setup_sects = match image[0x1f1] {
        0 => 4,
        n => n as usize,
    };
    let word = |o: usize| u32::from_le_bytes(image[o..o + 4].try_into().expect("4 bytes")) as usize;
    let start = (setup_sects + 1) * 512 + word(0x248);
    let len = word(0x24c);
    image
        .get(start..start + len)
        .ok_or_else(|| "the payload lies outside the file".to_string())
}

fn extract_vmlinux(image: &[u8], dest: &Path) -> Result<(), VmError> {
    let payload = bzimage_payload(image).map_err(build_err)?;
    let format = Compression::detect(payload).ok_or_else(|| {
        build_err(format!(
            "unknown kernel compression (magic {:02x?})",
            &payload[..payload.len().min(6)]
        ))
    })?;
    // Every format but gzip (which records its own size) is followed by the
    // decompressed size as 4 little-endian bytes (the kernel's `size_append`).
    let (stream, expected) = match format {
        Compression::Gzip => (payload, None),
        _ if payload.len() > 4 => {
            let (s, size) = payload.split_at(payload.len() - 4);
            (s, Some(u32::from_le_bytes(size.try_into().expect("4 bytes")) as u64))
        }
        _ => return Err(build_err("the kernel payload is empty")),
    };
    let (name, package, args) = format.tool();
    let program = require_tool(name, package)?;
    let out = fs::File::create(dest).map_err(io_err(format!("creating {}", dest.display())))?;
    let mut command = tool(&program);
    command
        .args(args)
        .stdin(Stdio::piped())
        .stdout(out)
        .stderr(Stdio::piped());
    let mut child = command.spawn().map_err(io_err(format!("running {name}")))?;
    let mut stdin = child.stdin.take().expect("piped");
    let data = stream.to_vec();
    let writer = std::thread::spawn(move || stdin.write_all(&data));
    let output = child
        .wait_with_output()
        .map_err(io_err(format!("waiting for {name}")))?;
    let _ = writer.join();
    if !output.status.success() {
        return Err(build_err(format!(
            "{name} {} could not decompress the kernel: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        )));
    }
    let mut head = [0u8; 5];
    let mut file = fs::File::open(dest).map_err(io_err("reading vmlinux"))?;
    std::io::Read::read_exact(&mut file, &mut head).map_err(io_err("reading vmlinux"))?;
    if &head != b"\x7fELF\x02" {
        return Err(build_err("the decompressed kernel is not a 64-bit ELF file"));
    }
    let size = file.metadata().map_err(io_err("vmlinux size"))?.len();
    if let Some(expected) = expected
        && expected != size
    {
        return Err(build_err(format!("vmlinux is {size} bytes, the image says {expected}")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metapackage_names_its_kernel_package_and_version() {
        let show = "Package: linux-image-amd64\nVersion: 6.1.192-3\nDepends: linux-image-6.1.0-57-amd64 (= 6.1.192-3)\nDescription: x\n";
        assert_eq!(
            parse_meta_depends(show),
            Some(("linux-image-6.1.0-57-amd64".into(), "6.1.192-3".into()))
        );
        assert_eq!(parse_meta_depends("Depends: foo\n"), None);
    }

    #[test]
    fn modules_load_after_their_dependencies_and_builtins_are_skipped() {
        let deps: BTreeMap<&str, Vec<&str>> = [
            ("ext4", vec!["jbd2", "mbcache", "crc16"]),
            ("jbd2", vec![]),
            ("mbcache", vec![]),
            ("crc16", vec![]),
            ("virtio_blk", vec!["virtio", "virtio_ring"]),
            ("virtio_mmio", vec!["virtio", "virtio_ring"]),
            ("virtio", vec![]),
            ("virtio_ring", vec![]),
        ]
        .into();
        let builtin: BTreeSet<String> = ["crc16".to_string()].into();
        let order = resolve_modules(&["virtio_mmio", "virtio_blk", "ext4"], &builtin, |n| {
            Ok(deps[n].iter().map(|s| s.to_string()).collect())
        })
        .unwrap();
        assert_eq!(
            order,
            [
                "virtio",
                "virtio_ring",
                "virtio_mmio",
                "virtio_blk",
                "jbd2",
                "mbcache",
                "ext4"
            ]
        );
        let cyclic = resolve_modules(&["a"], &BTreeSet::new(), |n| {
            Ok(vec![if n == "a" { "b" } else { "a" }.to_string()])
        });
        assert!(cyclic.unwrap_err().to_string().contains("cycle"));
    }

    #[test]
    fn payload_formats_are_told_by_their_magic() {
        assert_eq!(Compression::detect(b"\xfd7zXZ\x00\x00"), Some(Compression::Xz));
        assert_eq!(
            Compression::detect(&[0x28, 0xb5, 0x2f, 0xfd, 0]),
            Some(Compression::Zstd)
        );
        assert_eq!(Compression::detect(&[0x1f, 0x8b, 8]), Some(Compression::Gzip));
        assert_eq!(Compression::detect(b"hello"), None);
        assert!(bzimage_payload(&[0u8; 1024]).unwrap_err().contains("HdrS"));
    }
}
