//! Merging a Diff snapshot's memory file onto a full one. Firecracker writes a Diff's
//! dirty pages at their own offsets in a sparse file of the guest's memory size and
//! leaves every clean page a hole; the merge finds the written regions with
//! `SEEK_DATA`/`SEEK_HOLE` and writes them over the base. Firecracker's own tool for this
//! (`rebase-snap`) is not shipped with the binaries; this is the same operation.

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;

use super::super::{VmError, io_err};

/// What a merge wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiffMerge {
    /// Bytes of the diff's data regions written over the base.
    pub bytes: u64,
    /// How many separate regions those were.
    pub regions: u64,
}

/// The data regions (offset, length) of `file`, from `SEEK_DATA`/`SEEK_HOLE`.
fn data_regions(file: &File, len: u64) -> std::io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let mut regions = Vec::new();
    let mut pos: i64 = 0;
    while (pos as u64) < len {
        // SAFETY: lseek on an fd we own.
        let data = unsafe { libc::lseek(fd, pos, libc::SEEK_DATA) };
        if data < 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::ENXIO) {
                break; // only holes after pos
            }
            return Err(err);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(std::io::Error::last_os_error());
        }
        regions.push((data as u64, (hole - data) as u64));
        pos = hole;
    }
    Ok(regions)
}

/// Writes the pages of the Diff memory file `diff` over the full memory file `base`,
/// in place (no process may map `base` meanwhile). Repeating a merge changes nothing.
/// Refuses a diff whose size is not the base's, and one on a file system that does not
/// tell its holes apart (it would write zeros over every clean page).
pub fn merge_diff(base: &Path, diff: &Path) -> Result<DiffMerge, VmError> {
    let context = |what: &str| format!("merging {} onto {}: {what}", diff.display(), base.display());
    let corrupt = |message: String| VmError::Corrupt {
        path: diff.to_path_buf(),
        message,
    };
    let input = File::open(diff).map_err(io_err(context("opening the diff")))?;
    let output = OpenOptions::new()
        .write(true)
        .open(base)
        .map_err(io_err(context("opening the base")))?;
    let meta = input.metadata().map_err(io_err(context("stat")))?;
    let base_len = output.metadata().map_err(io_err(context("stat")))?.len();
    if meta.len() != base_len {
        return Err(corrupt(format!(
            "the diff is {} bytes, its base {} bytes: not a diff of this memory",
            meta.len(),
            base_len
        )));
    }
    let regions = data_regions(&input, meta.len()).map_err(io_err(context("finding its pages")))?;
    let data: u64 = regions.iter().map(|(_, l)| l).sum();
    let allocated = meta.blocks() * 512;
    // A file system without hole reporting says "all data" for a file that has holes.
    if data == meta.len() && allocated + (1 << 20) < meta.len() {
        return Err(VmError::Invalid(format!(
            "{}: the file system reports no holes in a sparse file, so the diff's pages \
             cannot be told apart: keep Diff snapshots on ext4, xfs, btrfs or tmpfs",
            diff.display()
        )));
    }
    let mut buf = vec![0u8; 1 << 20];
    for &(offset, len) in &regions {
        let mut done = 0u64;
        while done < len {
            let n = ((len - done) as usize).min(buf.len());
            input
                .read_exact_at(&mut buf[..n], offset + done)
                .map_err(io_err(context("reading")))?;
            output
                .write_all_at(&buf[..n], offset + done)
                .map_err(io_err(context("writing")))?;
            done += n as u64;
        }
    }
    output.sync_data().map_err(io_err(context("syncing")))?;
    Ok(DiffMerge {
        bytes: data,
        regions: regions.len() as u64,
    })
}

/// A sparse copy of `base` at `dest` with `diff` merged onto it (the base untouched).
pub fn merge_diff_into_copy(base: &Path, diff: &Path, dest: &Path) -> Result<DiffMerge, VmError> {
    super::super::sparse_copy(base, dest)?;
    merge_diff(dest, diff).inspect_err(|_| {
        let _ = fs::remove_file(dest);
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: usize = 4096;

    fn sparse_file(path: &Path, pages: usize, written: &[(usize, u8)]) {
        let f = File::create(path).unwrap();
        f.set_len((pages * PAGE) as u64).unwrap();
        for &(page, byte) in written {
            f.write_all_at(&[byte; PAGE], (page * PAGE) as u64).unwrap();
        }
    }

    #[test]
    fn a_merge_writes_exactly_the_diffs_pages_over_the_base() {
        let dir = tempfile::tempdir().unwrap();
        let (base, diff) = (dir.path().join("base"), dir.path().join("diff"));
        // Given a base whose every page holds 1, and a diff that dirtied pages 3 and 40.
        sparse_file(&base, 64, &(0..64).map(|p| (p, 1u8)).collect::<Vec<_>>());
        sparse_file(&diff, 64, &[(3, 7), (40, 9)]);
        // When it is merged,
        let merge = merge_diff(&base, &diff).unwrap();
        // then those pages are the diff's and every other page is the base's.
        assert_eq!(
            merge,
            DiffMerge {
                bytes: 2 * PAGE as u64,
                regions: 2
            }
        );
        let merged = fs::read(&base).unwrap();
        for page in 0..64 {
            let want = match page {
                3 => 7,
                40 => 9,
                _ => 1,
            };
            assert!(
                merged[page * PAGE..(page + 1) * PAGE].iter().all(|&b| b == want),
                "page {page}"
            );
        }
        // And merging again changes nothing.
        merge_diff(&base, &diff).unwrap();
        assert_eq!(fs::read(&base).unwrap(), merged);
    }

    #[test]
    fn a_diff_of_another_size_is_refused_and_the_base_is_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let (base, diff) = (dir.path().join("base"), dir.path().join("diff"));
        sparse_file(&base, 8, &[(0, 1)]);
        sparse_file(&diff, 16, &[(0, 2)]);
        let before = fs::read(&base).unwrap();
        let err = merge_diff(&base, &diff).unwrap_err();
        assert!(matches!(err, VmError::Corrupt { .. }), "{err}");
        assert_eq!(fs::read(&base).unwrap(), before);
    }

    #[test]
    fn a_merge_into_a_copy_leaves_the_base_as_it_was() {
        let dir = tempfile::tempdir().unwrap();
        let (base, diff, out) = (dir.path().join("base"), dir.path().join("diff"), dir.path().join("out"));
        sparse_file(&base, 8, &[(0, 1), (5, 1)]);
        sparse_file(&diff, 8, &[(5, 2)]);
        let before = fs::read(&base).unwrap();
        merge_diff_into_copy(&base, &diff, &out).unwrap();
        assert_eq!(fs::read(&base).unwrap(), before);
        let merged = fs::read(&out).unwrap();
        assert_eq!(merged[5 * PAGE], 2);
        assert_eq!(merged[0], 1);
    }
}
