//! Growing a full VM's root to its disk, run by the guest's init before the agent serves:
//! the host gives a full VM a disk larger than its image's (the edge's disk size), and
//! the image's one MBR partition and its ext4 file system are grown to fill it.
//!
//! - `opendsec-agent grow-partition /dev/vdXN`: before the root is mounted, extends MBR
//!   partition N of /dev/vdX to the end of the disk (its start unchanged) and has the
//!   kernel re-read the table. A partition that already ends at the disk's end, or is
//!   not the disk's last, is left as it is.
//! - `opendsec-agent grow-fs /mountpoint`: the mounted ext4 file system grows online to
//!   its partition's size (EXT4_IOC_RESIZE_FS).
//!
//! Both print what they did, and exit non-zero with the reason on failure (init then
//! goes on with the root as it is: a smaller disk is no reason not to boot).

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;

const SECTOR: u64 = 512;
const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
const BLKRRPART: libc::c_ulong = 0x125F;
const EXT4_IOC_RESIZE_FS: libc::c_ulong = 0x4008_6610;

/// `/dev/vda1` -> (`/dev/vda`, 1).
pub fn split_partition(dev: &str) -> Option<(String, usize)> {
    let digits = dev.len() - dev.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    if digits == 0 {
        return None;
    }
    let (disk, n) = dev.split_at(dev.len() - digits);
    let disk = disk
        .strip_suffix('p')
        .filter(|d| d.ends_with(|c: char| c.is_ascii_digit()))
        .unwrap_or(disk);
    Some((disk.to_string(), n.parse().ok()?))
}

fn size_bytes(f: &File) -> std::io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 we own.
    if unsafe { libc::ioctl(f.as_raw_fd(), BLKGETSIZE64 as _, &mut size) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

/// The new MBR for a disk of `disk_sectors` with partition `n` (1-4) grown to the end,
/// or None when there is nothing to grow. Errors when the table is not an MBR with that
/// partition.
pub fn grown_mbr(mbr: &[u8; 512], n: usize, disk_sectors: u64) -> Result<Option<[u8; 512]>, String> {
    if mbr[510..512] != [0x55, 0xAA] {
        return Err("no MBR partition table".into());
    }
    if !(1..=4).contains(&n) {
        return Err(format!("partition {n} is not a primary MBR partition"));
    }
    let entry = |k: usize| 446 + 16 * (k - 1);
    let field = |off: usize| u32::from_le_bytes(mbr[off..off + 4].try_into().expect("4 bytes")) as u64;
    let (start, len) = (field(entry(n) + 8), field(entry(n) + 12));
    if mbr[entry(n) + 4] == 0 || len == 0 {
        return Err(format!("partition {n} is empty"));
    }
    if mbr[entry(n) + 4] == 0xEE {
        return Err("a GPT disk (protective MBR)".into());
    }
    // Another partition after this one: it stays where it is.
    for k in (1..=4).filter(|&k| k != n) {
        if mbr[entry(k) + 4] != 0 && field(entry(k) + 8) > start {
            return Ok(None);
        }
    }
    let end = disk_sectors.min(start + u32::MAX as u64);
    if end <= start + len {
        return Ok(None);
    }
    let mut out = *mbr;
    out[entry(n) + 12..entry(n) + 16].copy_from_slice(&((end - start) as u32).to_le_bytes());
    Ok(Some(out))
}

pub fn grow_partition(part: &str) -> Result<String, String> {
    let (disk, n) = split_partition(part).ok_or_else(|| format!("{part} is not a partition device"))?;
    let mut f = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&disk)
        .map_err(|e| format!("opening {disk}: {e}"))?;
    let sectors = size_bytes(&f).map_err(|e| format!("the size of {disk}: {e}"))? / SECTOR;
    let mut mbr = [0u8; 512];
    f.read_exact(&mut mbr)
        .map_err(|e| format!("reading {disk}'s MBR: {e}"))?;
    let Some(grown) = grown_mbr(&mbr, n, sectors)? else {
        return Ok(format!("{part} already fills {disk}"));
    };
    f.seek(SeekFrom::Start(0))
        .and_then(|_| f.write_all(&grown))
        .and_then(|_| f.sync_all())
        .map_err(|e| format!("writing {disk}'s MBR: {e}"))?;
    // SAFETY: BLKRRPART takes no argument.
    if unsafe { libc::ioctl(f.as_raw_fd(), BLKRRPART as _, 0) } != 0 {
        return Err(format!(
            "re-reading {disk}'s partitions: {}",
            std::io::Error::last_os_error()
        ));
    }
    Ok(format!(
        "{part} grown to the end of {disk} ({} MiB)",
        (sectors * SECTOR) >> 20
    ))
}

pub fn grow_fs(mountpoint: &str, part: &str) -> Result<String, String> {
    let dev = File::open(part).map_err(|e| format!("opening {part}: {e}"))?;
    let bytes = size_bytes(&dev).map_err(|e| format!("the size of {part}: {e}"))?;
    let dir = File::open(mountpoint).map_err(|e| format!("opening {mountpoint}: {e}"))?;
    // SAFETY: statvfs fills a struct we own.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstatvfs(dir.as_raw_fd(), &mut st) } != 0 {
        return Err(format!("statvfs {mountpoint}: {}", std::io::Error::last_os_error()));
    }
    let block = st.f_frsize.max(1);
    let blocks: u64 = bytes / block;
    if blocks <= st.f_blocks {
        return Ok(format!("{mountpoint} already fills {part}"));
    }
    // SAFETY: EXT4_IOC_RESIZE_FS reads one u64 we own.
    if unsafe { libc::ioctl(dir.as_raw_fd(), EXT4_IOC_RESIZE_FS as _, &blocks) } != 0 {
        return Err(format!("growing {mountpoint}: {}", std::io::Error::last_os_error()));
    }
    Ok(format!("{mountpoint} grown to {} MiB", (blocks * block) >> 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mbr(parts: &[(u8, u32, u32)]) -> [u8; 512] {
        let mut m = [0u8; 512];
        m[510] = 0x55;
        m[511] = 0xAA;
        for (k, (ty, start, len)) in parts.iter().enumerate() {
            let e = 446 + 16 * k;
            m[e + 4] = *ty;
            m[e + 8..e + 12].copy_from_slice(&start.to_le_bytes());
            m[e + 12..e + 16].copy_from_slice(&len.to_le_bytes());
        }
        m
    }

    #[test]
    fn the_last_partition_grows_to_the_end_of_the_disk_and_nothing_else_changes() {
        let m = mbr(&[(0x83, 2048, 100_000)]);
        let g = grown_mbr(&m, 1, 1_000_000).unwrap().expect("grown");
        assert_eq!(u32::from_le_bytes(g[458..462].try_into().unwrap()), 1_000_000 - 2048);
        assert_eq!(&g[..458], &m[..458]);
        assert_eq!(&g[462..], &m[462..]);
        assert_eq!(grown_mbr(&g, 1, 1_000_000).unwrap(), None, "already at the end");
        assert_eq!(
            grown_mbr(&m, 1, 50_000).unwrap(),
            None,
            "a smaller disk shrinks nothing"
        );
    }

    #[test]
    fn a_partition_followed_by_another_a_gpt_disk_or_no_table_is_left_alone() {
        assert_eq!(
            grown_mbr(&mbr(&[(0x83, 2048, 1000), (0x82, 4096, 1000)]), 1, 1_000_000).unwrap(),
            None
        );
        assert!(
            grown_mbr(&mbr(&[(0xEE, 1, 1000)]), 1, 1_000_000)
                .unwrap_err()
                .contains("GPT")
        );
        assert!(grown_mbr(&[0u8; 512], 1, 1_000_000).unwrap_err().contains("no MBR"));
        assert!(
            grown_mbr(&mbr(&[(0x83, 2048, 1000)]), 2, 1_000_000)
                .unwrap_err()
                .contains("empty")
        );
    }

    #[test]
    fn partition_devices_name_their_disk_and_number() {
        assert_eq!(split_partition("/dev/vda1"), Some(("/dev/vda".into(), 1)));
        assert_eq!(split_partition("/dev/nvme0n1p2"), Some(("/dev/nvme0n1".into(), 2)));
        assert_eq!(split_partition("/dev/vda"), None);
    }
}
