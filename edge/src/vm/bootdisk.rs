//! A full VM's disk: a whole PC disk made from an image, so that the firmware boots it
//! like a real machine. Built once per image and recipe, cached in the image store as
//! `vmdisks/<image>-<key>.qcow2` beside its manifest `<image>-<key>.json`; every VM's
//! disk is a qcow2 overlay backed by it ([`create_overlay`]), never a copy.
//!
//! The layout: an MBR (syslinux's `mbr.bin` boot code, one active Linux partition at
//! 1 MiB) and an ext4 partition holding the image's merged layers plus `/boot`: Debian's
//! kernel (the bzImage of the package the microVM path uses), our full-VM initramfs and
//! extlinux (`extlinux.conf`, `ldlinux.sys` and `ldlinux.c32`). SeaBIOS runs the MBR,
//! which chains to extlinux's boot sector, which loads the kernel and initramfs and
//! passes the command line the configuration gives (`root=UUID=` of the partition).
//!
//! How it is made, without a partitioned loop device (this host's kernel does not scan
//! partitions of loop devices): `mkfs.ext4 -E offset=1MiB -d <merged layers>` writes the
//! file system straight into the raw disk file, a loop device over the partition's byte
//! range is mounted in a private mount namespace of one builder thread (so the mount
//! never appears on the host) for `/boot` and `extlinux --install`, the MBR is written,
//! and `qemu-img convert` stores the result as qcow2 (zero blocks left out).
//!
//! The key hashes everything the disk is made of: the layers, the kernel, the initramfs
//! (which carries the agent), extlinux's version and MBR, the command line and the
//! layout; a changed input is a new key, so a changed image or agent rebuilds.
//!
//! Root file system: the image's files plus [`FREE_SPACE_MB`] free; when `spec.disk_mb` is
//! larger, the overlay is made that large and the guest's `init.sh` grows into it before the
//! agent starts (`opendsec-agent grow-partition`, then `grow-fs`; best effort).
//!
//! **Architecture Invariant:** a boot disk's key hashes every input it is made of; a
//! changed input is a new disk, and a published disk is never rewritten (overlays name
//! it). A full VM's snapshot is refused when its boot disk is gone: a rebuilt disk is
//! another file system under the same overlay.

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::disks::with_merged_layers;
use super::initramfs::GuestBoot;
use super::{VmError, find_tool, io_err, lock_file, read_json, require_tool, write_json_atomic};
use crate::images::{Image, ImageStore};

/// Bumped when the way boot disks are made changes.
const BOOT_DISK_VERSION: u32 = 1;
/// Where the partition starts: 1 MiB, as partitioning tools align it.
const PARTITION_START_LBA: u64 = 2048;
const SECTOR: u64 = 512;
/// Free space every full VM's root file system has beyond its image's files. The disk
/// is sparse (qcow2 stores no zeros), so room costs nothing until it is written.
pub const FREE_SPACE_MB: u64 = 2048;
/// Where Debian's packages put syslinux's MBR boot code.
const MBR_BIN: &[&str] = &["/usr/lib/EXTLINUX/mbr.bin", "/usr/lib/syslinux/mbr/mbr.bin"];

fn build_err(message: impl Into<String>) -> VmError {
    VmError::Build {
        what: "a full VM's boot disk".into(),
        message: message.into(),
    }
}

/// What a boot disk was made of (`<image>-<key>.json` beside it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BootDiskManifest {
    pub key: String,
    pub image: String,
    pub layers: Vec<String>,
    /// `<release> (<package> <version>)`.
    pub kernel: String,
    pub initramfs: PathBuf,
    /// `extlinux --version`'s first line.
    pub bootloader: String,
    /// The command line extlinux passes to the kernel.
    pub cmdline: String,
    /// The root file system's UUID (`root=UUID=` on the command line).
    pub root_uuid: String,
    /// The partition, in 512-byte sectors.
    pub partition_start: u64,
    pub partition_sectors: u64,
    /// The qcow2 file.
    pub disk: PathBuf,
    pub virtual_bytes: u64,
    pub build_ms: u64,
}

/// The cached boot disk of `image` for the guest `boot`, built first if needed.
/// `tsc_khz` (the host's TSC frequency) goes on the kernel command line: without it a
/// guest under TCG sometimes hangs calibrating its clock.
pub fn ensure_boot_disk(
    store: &ImageStore,
    image: &Image,
    boot: &GuestBoot,
    tsc_khz: Option<u64>,
    progress: &dyn Fn(&str),
) -> Result<BootDiskManifest, VmError> {
    let extlinux = require_tool("extlinux", "extlinux")?;
    let mbr = MBR_BIN.iter().map(Path::new).find(|p| p.is_file()).ok_or_else(|| {
        VmError::Prerequisite(
            "syslinux's mbr.bin is missing: install the extlinux package (apt-get install extlinux syslinux-common)"
                .into(),
        )
    })?;
    let mbr_code = fs::read(mbr).map_err(io_err(format!("reading {}", mbr.display())))?;
    if mbr_code.len() > 440 {
        return Err(build_err(format!(
            "{} is {} bytes; an MBR has room for 440",
            mbr.display(),
            mbr_code.len()
        )));
    }
    let bootloader = extlinux_version(&extlinux)?;
    let kernel = &boot.kernel;
    // The configuration's template is part of the recipe (the command line, which holds
    // the UUID derived from this hash, is the only thing left out).
    let conf_template = BootFiles {
        vmlinuz: PathBuf::new(),
        initramfs: PathBuf::new(),
        release: kernel.release.clone(),
        cmdline: String::new(),
    }
    .extlinux_conf();
    let recipe = format!(
        "boot disk v{BOOT_DISK_VERSION}\nimage {}\nlayers {}\nkernel {}\ninitramfs {}\nbootloader {bootloader}\nmbr {}\ntsc {tsc_khz:?}\nfree {FREE_SPACE_MB}\n{conf_template}",
        image.name,
        image.layers.join(" "),
        kernel.dir.display(),
        boot.fullvm_initramfs.display(),
        hex::encode(Sha256::digest(&mbr_code)),
    );
    let hash = hex::encode(Sha256::digest(recipe.as_bytes()));
    let key = hash[..16].to_string();
    let dir = store.root().join("vmdisks");
    fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let disk = dir.join(format!("{}-{key}.qcow2", image.file_stem()));
    let manifest_path = dir.join(format!("{}-{key}.json", image.file_stem()));
    let cached = || -> Option<BootDiskManifest> {
        let m: BootDiskManifest = read_json(&manifest_path).ok()?;
        (m.key == key && disk.is_file()).then_some(m)
    };
    if let Some(m) = cached() {
        return Ok(m);
    }
    let _lock = lock_file(&store.root().join("locks").join(format!("bootdisk-{key}.lock")))?;
    if let Some(m) = cached() {
        return Ok(m);
    }
    let started = Instant::now();
    let qemu_img = require_tool("qemu-img", "qemu-utils")?;
    let mkfs = require_tool("mkfs.ext4", "e2fsprogs")?;
    let layers = store.layer_dirs(image)?;
    let root_uuid = uuid_from(&hash);
    let mut cmdline = format!("root=UUID={root_uuid} rw console=ttyS0 panic=-1 quiet random.trust_cpu=on");
    if let Some(khz) = tsc_khz {
        cmdline.push_str(&format!(" tsc_early_khz={khz}"));
    }
    let scratch = store
        .root()
        .join("tmp")
        .join(format!("bootdisk-{key}.{}", std::process::id()));
    let _ = fs::remove_dir_all(&scratch);
    fs::create_dir_all(&scratch).map_err(io_err(format!("creating {}", scratch.display())))?;
    let raw = scratch.join("disk.raw");
    let built = (|| {
        let content: u64 = layers.iter().map(|l| tree_bytes(l)).sum();
        let inodes: u64 = layers.iter().map(|l| tree_inodes(l)).sum();
        let fs_mb = (content + content / 4).div_ceil(1 << 20) + 256 + FREE_SPACE_MB;
        let fs_bytes = fs_mb << 20;
        let partition_sectors = fs_bytes / SECTOR;
        let disk_bytes = (PARTITION_START_LBA * SECTOR) + fs_bytes;
        progress(&format!(
            "boot disk for {}: {} MiB of files in {} layer(s), a {fs_mb} MiB ext4 partition",
            image.name,
            content >> 20,
            layers.len()
        ));
        let file = fs::File::create(&raw).map_err(io_err(format!("creating {}", raw.display())))?;
        file.set_len(disk_bytes)
            .map_err(io_err(format!("sizing {}", raw.display())))?;
        drop(file);
        let boot_files = BootFiles {
            vmlinuz: kernel.vmlinuz(),
            initramfs: boot.fullvm_initramfs.clone(),
            release: kernel.release.clone(),
            cmdline: cmdline.clone(),
        };
        if !boot_files.vmlinuz.is_file() {
            return Err(build_err(format!(
                "the guest kernel {} has no vmlinuz",
                kernel.dir.display()
            )));
        }
        let mnt = scratch.join("mnt");
        progress("mkfs.ext4 -d (the image's files into the partition), extlinux --install");
        with_merged_layers(&layers, &scratch, |merged| {
            run(
                Command::new(&mkfs)
                    .args(["-q", "-F", "-t", "ext4", "-L", "opendsec-root", "-m", "0"])
                    .arg("-U")
                    .arg(&root_uuid)
                    .arg("-N")
                    .arg((inodes * 2 + 65_536).to_string())
                    .arg("-E")
                    .arg(format!(
                        "offset={},lazy_itable_init=0,lazy_journal_init=0",
                        PARTITION_START_LBA * SECTOR
                    ))
                    .arg("-d")
                    .arg(merged)
                    .arg(&raw)
                    .arg(format!("{}k", fs_bytes >> 10)),
                "mkfs.ext4",
            )?;
            install_boot_files(&raw, fs_bytes, &mnt, &extlinux, &boot_files)
        })?;
        write_mbr(&raw, &mbr_code, &hash, partition_sectors)?;
        progress("qemu-img convert (raw to qcow2)");
        let tmp = dir.join(format!(".{key}.{}.qcow2.tmp", std::process::id()));
        let converted = run(
            Command::new(&qemu_img)
                .args(["convert", "-q", "-f", "raw", "-O", "qcow2"])
                .arg(&raw)
                .arg(&tmp),
            "qemu-img convert",
        )
        .and_then(|()| {
            // QEMU runs as each VM's uid and reads its base through the overlay.
            fs::set_permissions(&tmp, fs::Permissions::from_mode(0o644))
                .map_err(io_err(format!("chmod {}", tmp.display())))?;
            fs::rename(&tmp, &disk).map_err(io_err(format!("publishing {}", disk.display())))
        });
        if converted.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        converted?;
        let manifest = BootDiskManifest {
            key: key.clone(),
            image: image.name.clone(),
            layers: image.layers.clone(),
            kernel: format!("{} ({} {})", kernel.release, kernel.package, kernel.version),
            initramfs: boot.fullvm_initramfs.clone(),
            bootloader: bootloader.clone(),
            cmdline: cmdline.clone(),
            root_uuid: root_uuid.clone(),
            partition_start: PARTITION_START_LBA,
            partition_sectors,
            disk: disk.clone(),
            virtual_bytes: disk_bytes,
            build_ms: started.elapsed().as_millis() as u64,
        };
        write_json_atomic(&manifest_path, &manifest)?;
        Ok(manifest)
    })();
    let _ = fs::remove_dir_all(&scratch);
    if built.is_ok() {
        progress(&format!("boot disk {} ready", disk.display()));
    }
    built
}

/// Creates `dest`, a qcow2 overlay whose backing file is the boot disk `base`: a VM's
/// whole disk, holding only the blocks that VM wrote, of at least `min_bytes` (the
/// guest's init grows the root partition and file system into what the base lacks).
pub(crate) fn create_overlay(base: &Path, dest: &Path, min_bytes: u64) -> Result<(), VmError> {
    let qemu_img = require_tool("qemu-img", "qemu-utils")?;
    let base_bytes = qcow2_virtual_size(base)?;
    let mut cmd = Command::new(&qemu_img);
    cmd.args(["create", "-q", "-f", "qcow2", "-F", "qcow2", "-b"])
        .arg(base)
        .arg(dest);
    if min_bytes > base_bytes {
        cmd.arg(min_bytes.div_ceil(1 << 20).to_string() + "M");
    }
    run(&mut cmd, "qemu-img create")
}

/// The disk size a qcow2 image presents (its header's `size`, at byte 24, big-endian).
pub(crate) fn qcow2_virtual_size(path: &Path) -> Result<u64, VmError> {
    let mut header = [0u8; 32];
    fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut header))
        .map_err(io_err(&format!("reading the qcow2 header of {}", path.display())))?;
    if &header[..4] != b"QFI\xfb" {
        return Err(VmError::Invalid(format!("{} is not a qcow2 image", path.display())));
    }
    Ok(u64::from_be_bytes(header[24..32].try_into().expect("8 bytes")))
}

/// What goes into `/boot`.
struct BootFiles {
    vmlinuz: PathBuf,
    initramfs: PathBuf,
    release: String,
    cmdline: String,
}

impl BootFiles {
    fn extlinux_conf(&self) -> String {
        let release = &self.release;
        format!(
            "# Written by OpenDsec's boot disk builder (edge/src/vm/bootdisk.rs).\n\
             SERIAL 0 115200\n\
             DEFAULT opendsec\n\
             PROMPT 0\n\
             TIMEOUT 0\n\
             LABEL opendsec\n\
             \x20 LINUX /boot/vmlinuz-{release}\n\
             \x20 INITRD /boot/initrd.img-{release}\n\
             \x20 APPEND {cmdline}\n",
            cmdline = self.cmdline,
        )
    }
}

/// Mounts the partition of `raw` (in the calling thread's private mount namespace),
/// puts the kernel, initramfs and extlinux in `/boot`, and makes sure the boot sector
/// knows where its partition starts.
fn install_boot_files(
    raw: &Path,
    fs_bytes: u64,
    mnt: &Path,
    extlinux: &Path,
    files: &BootFiles,
) -> Result<(), VmError> {
    let offset = PARTITION_START_LBA * SECTOR;
    let (dev, dev_file) = crate::container::attach_loop(raw, offset, fs_bytes)
        .map_err(|e| build_err(format!("a loop device over the partition: {e}")))?;
    fs::create_dir_all(mnt).map_err(io_err(format!("creating {}", mnt.display())))?;
    mount(Some(&dev), mnt, Some("ext4"), MsFlags::MS_NOATIME, None::<&str>)
        .map_err(|e| build_err(format!("mounting {} at {}: {e}", dev.display(), mnt.display())))?;
    let installed = (|| {
        let boot = mnt.join("boot");
        let conf_dir = boot.join("extlinux");
        fs::create_dir_all(&conf_dir).map_err(io_err(format!("creating {}", conf_dir.display())))?;
        let release = &files.release;
        for (source, name, mode) in [
            (&files.vmlinuz, format!("vmlinuz-{release}"), 0o644),
            (&files.initramfs, format!("initrd.img-{release}"), 0o600),
        ] {
            let dest = boot.join(name);
            fs::copy(source, &dest).map_err(io_err(format!("copying {}", source.display())))?;
            fs::set_permissions(&dest, fs::Permissions::from_mode(mode))
                .map_err(io_err(format!("chmod {}", dest.display())))?;
        }
        fs::write(conf_dir.join("extlinux.conf"), files.extlinux_conf()).map_err(io_err("writing extlinux.conf"))?;
        run(
            Command::new(extlinux).arg("--install").arg(&conf_dir),
            "extlinux --install",
        )
    })();
    let unmounted =
        umount2(mnt, MntFlags::empty()).map_err(|e| build_err(format!("unmounting {}: {e}", mnt.display())));
    drop(dev_file);
    installed?;
    unmounted?;
    fix_hidden_sectors(raw)
}

/// extlinux's boot sector loads `ldlinux.sys` by sectors counted from the partition's
/// start, which it records in the BPB's hidden-sectors field (offset 0x1C) from what the
/// device says. A loop device over the partition usually reports its offset; where it
/// does not, the field would say 0 and the firmware would load the wrong sectors.
fn fix_hidden_sectors(raw: &Path) -> Result<(), VmError> {
    let mut file = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(raw)
        .map_err(io_err(format!("opening {}", raw.display())))?;
    let at = PARTITION_START_LBA * SECTOR;
    let mut sector = [0u8; 512];
    file.seek(SeekFrom::Start(at))
        .and_then(|_| file.read_exact(&mut sector))
        .map_err(io_err("reading the partition's boot sector"))?;
    if sector[510..512] != [0x55, 0xAA] {
        return Err(build_err("extlinux wrote no boot sector"));
    }
    let hidden = u32::from_le_bytes(sector[0x1C..0x20].try_into().expect("4 bytes"));
    if u64::from(hidden) != PARTITION_START_LBA {
        file.seek(SeekFrom::Start(at + 0x1C))
            .and_then(|_| file.write_all(&(PARTITION_START_LBA as u32).to_le_bytes()))
            .map_err(io_err("writing the boot sector's hidden sectors"))?;
    }
    file.sync_all().map_err(io_err(format!("syncing {}", raw.display())))
}

/// The MBR: syslinux's boot code (it boots the active partition), a disk signature,
/// one active Linux partition (CHS fields saying "use LBA") and the boot signature.
pub(crate) fn mbr_sector(code: &[u8], signature: u32, partition_sectors: u64) -> [u8; 512] {
    let mut mbr = [0u8; 512];
    mbr[..code.len()].copy_from_slice(code);
    mbr[440..444].copy_from_slice(&signature.to_le_bytes());
    let entry = &mut mbr[446..462];
    entry[0] = 0x80; // active
    entry[1..4].copy_from_slice(&[0xFE, 0xFF, 0xFF]);
    entry[4] = 0x83; // Linux
    entry[5..8].copy_from_slice(&[0xFE, 0xFF, 0xFF]);
    entry[8..12].copy_from_slice(&(PARTITION_START_LBA as u32).to_le_bytes());
    entry[12..16].copy_from_slice(&(partition_sectors as u32).to_le_bytes());
    mbr[510] = 0x55;
    mbr[511] = 0xAA;
    mbr
}

fn write_mbr(raw: &Path, code: &[u8], hash: &str, partition_sectors: u64) -> Result<(), VmError> {
    if partition_sectors > u64::from(u32::MAX) {
        return Err(build_err("the partition is too large for an MBR"));
    }
    let signature = u32::from_str_radix(&hash[..8], 16).expect("hex digits");
    let mbr = mbr_sector(code, signature, partition_sectors);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .open(raw)
        .map_err(io_err(format!("opening {}", raw.display())))?;
    file.write_all(&mbr)
        .and_then(|()| file.sync_all())
        .map_err(io_err("writing the MBR"))
}

/// A UUID (version 4 layout) from a hex digest, so one recipe always gives one UUID.
fn uuid_from(hex: &str) -> String {
    let mut b = hex::decode(&hex[..32]).expect("hex digits");
    b[6] = (b[6] & 0x0F) | 0x40;
    b[8] = (b[8] & 0x3F) | 0x80;
    let h = hex::encode(b);
    format!("{}-{}-{}-{}-{}", &h[..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

fn extlinux_version(extlinux: &Path) -> Result<String, VmError> {
    let out = Command::new(extlinux)
        .arg("--version")
        .env_clear()
        .stdin(Stdio::null())
        .output()
        .map_err(io_err("running extlinux --version"))?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    text.lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .map(str::to_string)
        .ok_or_else(|| build_err("extlinux --version said nothing"))
}

fn run(command: &mut Command, what: &str) -> Result<(), VmError> {
    let out = command
        .env_clear()
        .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(Stdio::null())
        .output()
        .map_err(io_err(format!("running {what}")))?;
    if !out.status.success() {
        return Err(build_err(format!(
            "{what} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Bytes the files under `dir` take on disk (a bound for the file system's size).
fn tree_bytes(dir: &Path) -> u64 {
    walk(dir, &mut |m| m.blocks() * 512 + 256)
}

/// Files and directories under `dir`.
fn tree_inodes(dir: &Path) -> u64 {
    walk(dir, &mut |_| 1)
}

fn walk(dir: &Path, f: &mut dyn FnMut(&fs::Metadata) -> u64) -> u64 {
    let Ok(entries) = fs::read_dir(dir) else {
        return 0;
    };
    let mut total = 0;
    for entry in entries.filter_map(Result::ok) {
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        total += f(&meta);
        if meta.is_dir() {
            total += walk(&entry.path(), f);
        }
    }
    total
}

/// Whether the tools a boot disk needs are installed (for tests that say what they skip).
pub fn host_can_build_boot_disks() -> bool {
    find_tool("extlinux").is_some() && find_tool("qemu-img").is_some() && MBR_BIN.iter().any(|p| Path::new(p).is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mbr_boots_one_active_linux_partition_at_one_mib() {
        let code = [0xEBu8; 440];
        let mbr = mbr_sector(&code, 0x0d5e_c035, 4_000_000);
        assert_eq!(&mbr[..440], &code[..]);
        assert_eq!(&mbr[440..444], &0x0d5e_c035u32.to_le_bytes());
        assert_eq!(mbr[446], 0x80, "active");
        assert_eq!(mbr[450], 0x83, "Linux");
        assert_eq!(u32::from_le_bytes(mbr[454..458].try_into().unwrap()), 2048);
        assert_eq!(u32::from_le_bytes(mbr[458..462].try_into().unwrap()), 4_000_000);
        assert_eq!(&mbr[462..510], &[0u8; 48][..], "no other partition");
        assert_eq!(&mbr[510..], &[0x55, 0xAA]);
    }

    #[test]
    fn one_recipe_gives_one_uuid() {
        let hash = hex::encode(Sha256::digest(b"recipe"));
        let uuid = uuid_from(&hash);
        assert_eq!(uuid, uuid_from(&hash));
        assert_eq!(uuid.len(), 36);
        assert_eq!(&uuid[14..15], "4");
        assert_ne!(uuid, uuid_from(&hex::encode(Sha256::digest(b"other"))));
    }

    #[test]
    fn extlinux_is_told_the_kernel_initramfs_and_command_line() {
        let files = BootFiles {
            vmlinuz: PathBuf::from("/k"),
            initramfs: PathBuf::from("/i"),
            release: "6.1.0-57-amd64".into(),
            cmdline: "root=UUID=x rw console=ttyS0".into(),
        };
        let conf = files.extlinux_conf();
        assert!(conf.contains("SERIAL 0 115200\n"), "{conf}");
        assert!(conf.contains("  LINUX /boot/vmlinuz-6.1.0-57-amd64\n"), "{conf}");
        assert!(conf.contains("  INITRD /boot/initrd.img-6.1.0-57-amd64\n"), "{conf}");
        assert!(conf.contains("  APPEND root=UUID=x rw console=ttyS0\n"), "{conf}");
    }
}
