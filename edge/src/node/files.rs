//! The file-system tools the node copies sandbox state with: a layer archived and
//! unpacked with everything overlayfs needs (owners, xattrs, whiteouts, sparse files),
//! a tree copied whole, and the sizes reported for snapshots and transfers.
//!
//! What a sandbox wrote keeps the sandbox's own ids (see `container/idmap.rs`), so a
//! copy on the host would make a setuid-root file planted by sandbox root a setuid-root
//! file of the host. Every copy and unpacked archive is therefore stripped of setuid and
//! setgid bits and file capabilities before it is published ([`strip_privileges`]); inside
//! sandboxes they grant nothing anyway (no_new_privs).

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
    strip_privileges(&tmp)?;
    std::fs::rename(&tmp, dest)?;
    Ok(())
}

/// Removes setuid and setgid bits and file capabilities (`security.capability`) from every
/// file under `dir`, never following symlinks. Returns how many files it changed.
pub(super) fn strip_privileges(dir: &std::path::Path) -> Result<u64, EdgeError> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;
    let mut changed = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let path = e.path();
            let meta = std::fs::symlink_metadata(&path)?;
            if meta.is_dir() {
                stack.push(path);
                continue;
            }
            if !meta.is_file() {
                continue;
            }
            let mut touched = false;
            let mode = meta.permissions().mode();
            if mode & 0o6000 != 0 {
                std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode & !0o6000))?;
                touched = true;
            }
            let c = std::ffi::CString::new(path.as_os_str().as_bytes())
                .map_err(|_| EdgeError::Store(format!("{} has a NUL byte", path.display())))?;
            // SAFETY: lremovexattr with valid C strings; ENODATA means there was none.
            if unsafe { libc::lremovexattr(c.as_ptr(), c"security.capability".as_ptr()) } == 0 {
                touched = true;
            } else {
                let err = std::io::Error::last_os_error();
                if !matches!(err.raw_os_error(), Some(libc::ENODATA) | Some(libc::EOPNOTSUPP)) {
                    return Err(EdgeError::Store(format!(
                        "clearing capabilities of {}: {err}",
                        path.display()
                    )));
                }
            }
            changed += touched as u64;
        }
    }
    Ok(changed)
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
    if let Err(e) = strip_privileges(&tmp) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, dest)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn copies_lose_setuid_setgid_and_file_capabilities_and_keep_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let from = dir.path().join("from");
        std::fs::create_dir_all(from.join("bin")).unwrap();
        let planted = from.join("bin/rootshell");
        std::fs::write(&planted, b"#!/bin/sh\n").unwrap();
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o6755)).unwrap();
        let capped = from.join("bin/capped");
        std::fs::write(&capped, b"x").unwrap();
        // A file capability (v2, cap_setuid in the permitted set), as setcap would write it.
        let mut cap = [0u8; 20];
        cap[0..4].copy_from_slice(&0x0200_0000u32.to_le_bytes());
        cap[4..8].copy_from_slice(&(1u32 << 7).to_le_bytes());
        let c = std::ffi::CString::new(capped.to_str().unwrap()).unwrap();
        let set = unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                c"security.capability".as_ptr(),
                cap.as_ptr().cast(),
                cap.len(),
                0,
            )
        };
        assert_eq!(set, 0, "setting a file capability: {}", std::io::Error::last_os_error());
        std::fs::write(from.join("plain"), b"data").unwrap();
        std::fs::set_permissions(from.join("plain"), std::fs::Permissions::from_mode(0o640)).unwrap();

        let dest = dir.path().join("dest");
        copy_tree(&from, &dest).unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&dest.join("bin/rootshell")), 0o755);
        assert_eq!(mode(&dest.join("plain")), 0o640);
        let c = std::ffi::CString::new(dest.join("bin/capped").to_str().unwrap()).unwrap();
        let n = unsafe { libc::lgetxattr(c.as_ptr(), c"security.capability".as_ptr(), std::ptr::null_mut(), 0) };
        assert_eq!(n, -1, "the capability was copied");
        assert_eq!(std::fs::read(dest.join("plain")).unwrap(), b"data");
    }
}
