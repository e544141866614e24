//! The unpacker against hostile and ordinary layers, built entry by entry.

use super::*;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

/// A tar built entry by entry (raw headers, so that hostile names stay as written).
struct Layer(tar::Builder<Vec<u8>>);

impl Layer {
    fn new() -> Self {
        Self(tar::Builder::new(Vec::new()))
    }
    fn entry(mut self, kind: tar::EntryType, path: &str, link: &str, data: &[u8], mode: u32) -> Self {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(kind);
        header.set_size(data.len() as u64);
        header.set_mode(mode);
        header.set_uid(1000);
        header.set_gid(1000);
        header.set_mtime(1_600_000_000);
        // Written raw: `set_path` refuses `..`, which is what we test.
        let name = &mut header.as_old_mut().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        if !link.is_empty() {
            header.as_old_mut().linkname[..link.len()].copy_from_slice(link.as_bytes());
        }
        header.set_cksum();
        self.0.append(&header, data).unwrap();
        self
    }
    fn file(self, path: &str, data: &[u8]) -> Self {
        self.entry(tar::EntryType::Regular, path, "", data, 0o644)
    }
    fn dir(self, path: &str) -> Self {
        self.entry(tar::EntryType::Directory, path, "", b"", 0o755)
    }
    fn bytes(self) -> Vec<u8> {
        self.0.into_inner().unwrap()
    }
}

fn unpack(tar: &[u8]) -> (tempfile::TempDir, Result<Unpacked, ImageError>) {
    let tmp = tempfile::tempdir().unwrap();
    let result = unpack_layer(
        tar,
        &tmp.path().join("layer"),
        "sha256:test",
        Limits {
            bytes: 1 << 20,
            entries: 100,
        },
    );
    (tmp, result)
}

fn refused(tar: &[u8], why: &str) {
    let (tmp, result) = unpack(tar);
    match result {
        Err(ImageError::UnsafeEntry { reason, .. }) => assert!(reason.contains(why), "{reason}"),
        other => panic!("expected a refusal ({why}), got {other:?}"),
    }
    drop(tmp);
}

#[test]
fn files_keep_modes_owners_mtimes_and_setuid_and_the_diff_id_is_the_streams_hash() {
    let tar = Layer::new()
        .dir("usr/")
        .entry(tar::EntryType::Regular, "usr/bin/sudo", "", b"#!", 0o4755)
        .file("/etc/abs", b"stripped of its slash")
        .entry(tar::EntryType::Symlink, "usr/lib64", "/usr/lib", b"", 0o777)
        .entry(tar::EntryType::Link, "usr/bin/sudo2", "usr/bin/sudo", b"", 0o644)
        .entry(tar::EntryType::Fifo, "run/fifo", "", b"", 0o600)
        .bytes();
    let (tmp, result) = unpack(&tar);
    let unpacked = result.unwrap();
    assert_eq!(
        unpacked.diff_id,
        format!("sha256:{}", hex::encode(Sha256::digest(&tar)))
    );
    let layer = tmp.path().join("layer");
    let sudo = fs::metadata(layer.join("usr/bin/sudo")).unwrap();
    assert_eq!(sudo.permissions().mode() & 0o7777, 0o4755);
    assert_eq!((sudo.uid(), sudo.gid(), sudo.mtime()), (1000, 1000, 1_600_000_000));
    assert_eq!(fs::read(layer.join("etc/abs")).unwrap(), b"stripped of its slash");
    assert_eq!(fs::read_link(layer.join("usr/lib64")).unwrap(), Path::new("/usr/lib"));
    assert_eq!(fs::metadata(layer.join("usr/bin/sudo2")).unwrap().ino(), sudo.ino());
    assert!(
        fs::symlink_metadata(layer.join("run/fifo"))
            .unwrap()
            .file_type()
            .is_fifo()
    );
    assert_eq!(fs::metadata(layer.join("usr")).unwrap().mtime(), 1_600_000_000);
}

#[test]
fn whiteouts_become_overlay_whiteouts_and_opaque_directories() {
    let tar = Layer::new()
        .file("etc/.wh.gone", b"")
        .dir("var/cache/")
        .file("var/cache/.wh..wh..opq", b"")
        .file("var/cache/kept", b"x")
        .bytes();
    let (tmp, result) = unpack(&tar);
    result.unwrap();
    let layer = tmp.path().join("layer");
    let gone = fs::symlink_metadata(layer.join("etc/gone")).unwrap();
    assert!(gone.file_type().is_char_device());
    assert_eq!(gone.rdev(), 0);
    assert!(fs::symlink_metadata(layer.join("etc/.wh.gone")).is_err());
    let c = CString::new(layer.join("var/cache").as_os_str().as_bytes()).unwrap();
    let mut value = [0u8; 4];
    // SAFETY: lgetxattr into a buffer of the given length.
    let n = unsafe {
        libc::lgetxattr(
            c.as_ptr(),
            c"trusted.overlay.opaque".as_ptr(),
            value.as_mut_ptr().cast(),
            value.len(),
        )
    };
    assert_eq!(n, 1, "no opaque mark: {}", io::Error::last_os_error());
    assert_eq!(value[0], b'y');
    assert!(layer.join("var/cache/kept").is_file());
}

#[test]
fn nothing_is_written_through_a_symlink_or_outside_the_layer() {
    let outside = tempfile::tempdir().unwrap();
    let target = outside.path().to_str().unwrap();
    refused(
        &Layer::new()
            .entry(tar::EntryType::Symlink, "a", target, b"", 0o777)
            .file("a/passwd", b"owned")
            .bytes(),
        "through the symlink a",
    );
    assert_eq!(
        fs::read_dir(outside.path()).unwrap().count(),
        0,
        "wrote outside the layer"
    );
    refused(&Layer::new().file("../x", b"x").bytes(), "`..`");
    refused(&Layer::new().file("a/../../x", b"x").bytes(), "`..`");
    refused(
        &Layer::new()
            .entry(tar::EntryType::Link, "x", "../../etc/passwd", b"", 0o644)
            .bytes(),
        "`..`",
    );
    refused(
        &Layer::new()
            .entry(tar::EntryType::Link, "x", "etc/passwd", b"", 0o644)
            .bytes(),
        "not an earlier file of this layer",
    );
    refused(
        &Layer::new()
            .entry(tar::EntryType::Char, "dev/null", "", b"", 0o666)
            .bytes(),
        "device file",
    );
    refused(
        &Layer::new()
            .entry(tar::EntryType::Block, "dev/sda", "", b"", 0o660)
            .bytes(),
        "device file",
    );
}

#[test]
fn whiteouts_of_the_layers_own_content_and_malformed_whiteouts_are_refused() {
    refused(
        &Layer::new().file("a/b", b"").file("a/.wh.b", b"").bytes(),
        "also holds",
    );
    refused(
        &Layer::new().file("a/.wh.b", b"").file("a/b", b"").bytes(),
        "also whites it out",
    );
    refused(
        &Layer::new().file("a/.wh.b", b"").file("a/b/c", b"").bytes(),
        "also whites it out",
    );
    refused(&Layer::new().file("a/.wh.", b"").bytes(), "malformed whiteout");
    refused(&Layer::new().file("a/.wh...", b"").bytes(), "malformed whiteout");
    refused(
        &Layer::new().file("a/.wh..wh.plnk", b"").bytes(),
        "unknown whiteout kind",
    );
    refused(&Layer::new().dir("a/.wh.b/").bytes(), "whiteout that is a directory");
    refused(
        &Layer::new().file(".wh.a/b", b"").bytes(),
        "whiteout name used as a directory",
    );
}

#[test]
fn capabilities_and_trusted_xattrs_are_dropped_and_user_xattrs_kept() {
    let mut builder = tar::Builder::new(Vec::new());
    let mut cap = vec![0u8; 20];
    cap[0..4].copy_from_slice(&0x0200_0000u32.to_le_bytes());
    builder
        .append_pax_extensions([
            ("SCHILY.xattr.security.capability", cap.as_slice()),
            ("SCHILY.xattr.trusted.overlay.redirect", b"/elsewhere".as_slice()),
            ("SCHILY.xattr.user.note", b"kept".as_slice()),
        ])
        .unwrap();
    let mut header = tar::Header::new_gnu();
    header.set_size(1);
    header.set_mode(0o755);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    header.set_entry_type(tar::EntryType::Regular);
    builder.append_data(&mut header, "bin/ping", &b"x"[..]).unwrap();
    let (tmp, result) = unpack(&builder.into_inner().unwrap());
    result.unwrap();
    let path = CString::new(tmp.path().join("layer/bin/ping").as_os_str().as_bytes()).unwrap();
    let get = |name: &std::ffi::CStr| {
        // SAFETY: lgetxattr asking for the size only.
        unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) }
    };
    assert_eq!(get(c"security.capability"), -1);
    assert_eq!(get(c"trusted.overlay.redirect"), -1);
    assert_eq!(get(c"user.note"), 4);
}

#[test]
fn layers_over_their_limits_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let big = Layer::new().file("big", &[7u8; 8192]).bytes();
    let err = unpack_layer(
        big.as_slice(),
        &tmp.path().join("a"),
        "sha256:test",
        Limits {
            bytes: 4096,
            entries: 10,
        },
    )
    .unwrap_err();
    assert!(matches!(err, ImageError::BadLayer { .. }), "{err}");
    let many = (0..5).fold(Layer::new(), |l, i| l.file(&format!("f{i}"), b"")).bytes();
    let err = unpack_layer(
        many.as_slice(),
        &tmp.path().join("b"),
        "sha256:test",
        Limits {
            bytes: 1 << 20,
            entries: 3,
        },
    )
    .unwrap_err();
    assert!(err.to_string().contains("more than 3 entries"), "{err}");
}

#[test]
fn gzip_zstd_and_plain_blobs_unpack_to_the_same_layer_and_diff_id() {
    use std::io::Write;
    let tar = Layer::new().file("etc/motd", b"hello").bytes();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&tar).unwrap();
    let gzipped = gz.finish().unwrap();
    let zstded = zstd::encode_all(tar.as_slice(), 3).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    for (name, blob) in [("plain", &tar), ("gzip", &gzipped), ("zstd", &zstded)] {
        let path = tmp.path().join(format!("{name}.blob"));
        fs::write(&path, blob).unwrap();
        let reader = decompress(File::open(&path).unwrap()).unwrap();
        let dest = tmp.path().join(name);
        let unpacked = unpack_layer(reader, &dest, name, Limits::for_image(0)).unwrap();
        assert_eq!(
            unpacked.diff_id,
            format!("sha256:{}", hex::encode(Sha256::digest(&tar))),
            "{name}"
        );
        assert_eq!(fs::read(dest.join("etc/motd")).unwrap(), b"hello", "{name}");
    }
}
