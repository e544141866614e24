//! The file-system tools the node copies sandbox state with: a layer archived and
//! unpacked with everything overlayfs needs (owners, xattrs, whiteouts, sparse files),
//! a tree copied whole, and the sizes reported for snapshots and transfers.

use super::EdgeError;

/// Archives directory `dir` into `dest` with everything overlayfs needs of a layer:
/// owners, modes, xattrs (opaque-dir marks), whiteout devices, sparse files.
pub(super) fn tar_create(dir: &std::path::Path, dest: &std::path::Path) -> Result<(), EdgeError> {
    let out = std::process::Command::new("tar")
        .args([
            "--create",
            "--sparse",
            "--xattrs",
            "--xattrs-include=*",
            "--numeric-owner",
            "--file",
        ])
        .arg(dest)
        .arg("--directory")
        .arg(dir)
        .arg(".")
        .output()?;
    if !out.status.success() {
        return Err(EdgeError::Store(format!(
            "archiving {}: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// Unpacks an archive of [`tar_create`] into `dest` (made beside and renamed, so a crash
/// leaves no half layer).
pub(super) fn tar_extract(archive: &std::path::Path, dest: &std::path::Path) -> Result<(), EdgeError> {
    let tmp = dest.with_file_name(format!(
        ".tmp-{}",
        dest.file_name().and_then(|n| n.to_str()).unwrap_or("layer")
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp)?;
    let out = std::process::Command::new("tar")
        .args([
            "--extract",
            "--xattrs",
            "--xattrs-include=*",
            "--numeric-owner",
            "--same-owner",
            "--same-permissions",
            "--file",
        ])
        .arg(archive)
        .arg("--directory")
        .arg(&tmp)
        .output()?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(EdgeError::Store(format!(
            "unpacking {}: {}",
            archive.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::rename(&tmp, dest)?;
    Ok(())
}

/// Bytes used by the files under `dir` (not following symlinks).
pub(super) fn dir_size(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

/// Bytes allocated on disk by the files directly in `dir` (sparse files count their data).
pub(super) fn dir_allocated(dir: &std::path::Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.blocks() * 512)
        .sum()
}

/// Copies directory `from` to a new `dest` (through a temporary name, so `dest` exists
/// only complete). `cp -a` keeps owners, modes, xattrs (overlay's opaque-dir marks) and
/// the whiteout devices that record deletions of lower files.
pub(super) fn copy_tree(from: &std::path::Path, dest: &std::path::Path) -> Result<(), EdgeError> {
    let tmp = dest.with_file_name(format!(
        ".tmp-{}",
        dest.file_name().and_then(|n| n.to_str()).unwrap_or("copy")
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    if let Some(parent) = tmp.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let out = std::process::Command::new("cp")
        .arg("-a")
        .arg("--")
        .arg(from)
        .arg(&tmp)
        .output()?;
    if !out.status.success() {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(EdgeError::Store(format!(
            "copying {}: {}",
            from.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    std::fs::rename(&tmp, dest)?;
    Ok(())
}
