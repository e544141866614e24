//! User-defined file metadata (envd 0.6.2): `X-Metadata-<key>: <value>`
//! headers on an upload are stored as `user.e2b.<key>` extended attributes
//! and come back in the upload's answer and in every EntryInfo. The rules
//! (printable ASCII, key length, a 4 KiB budget per file, an upload replaces
//! the file's whole set) are envd's.

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use hyper::HeaderMap;

use crate::connect::RpcError;

pub const XATTR_PREFIX: &str = "user.e2b.";
const HEADER_PREFIX: &str = "x-metadata-";
/// The kernel limits an xattr name to 255 bytes, prefix included.
const MAX_KEY: usize = 255 - XATTR_PREFIX.len();
/// What fits beside the inode in one ext4 block, names and values together.
const MAX_TOTAL: usize = 4096;

pub type Metadata = BTreeMap<String, String>;

/// The metadata an upload carries in its headers (keys lowercased), checked.
pub fn from_headers(headers: &HeaderMap) -> Result<Metadata, RpcError> {
    let mut m = Metadata::new();
    let mut total = 0;
    for (name, value) in headers {
        let Some(key) = name.as_str().strip_prefix(HEADER_PREFIX) else {
            continue;
        };
        let key = key.to_ascii_lowercase();
        let value = value.as_bytes();
        if key.is_empty() || key.len() > MAX_KEY {
            return Err(RpcError::invalid(format!(
                "metadata key {key:?} must be 1 to {MAX_KEY} bytes"
            )));
        }
        if let Some(b) = value.iter().find(|b| !(0x20..=0x7e).contains(*b)) {
            return Err(RpcError::invalid(format!(
                "metadata value for key {key:?} contains non-printable-ASCII byte 0x{b:02x}"
            )));
        }
        total += XATTR_PREFIX.len() + key.len() + value.len();
        m.insert(key, String::from_utf8_lossy(value).into_owned());
    }
    if total > MAX_TOTAL {
        return Err(RpcError::invalid(format!(
            "total metadata size {total} exceeds {MAX_TOTAL} bytes"
        )));
    }
    Ok(m)
}

fn unsupported(e: &std::io::Error) -> bool {
    e.raw_os_error() == Some(libc::ENOTSUP)
}

/// NUL-separated names as the *listxattr calls return them.
fn split_names(buf: &[u8]) -> impl Iterator<Item = &[u8]> {
    buf.split(|b| *b == 0).filter(|n| !n.is_empty())
}

fn list(call: impl Fn(*mut libc::c_char, usize) -> isize) -> std::io::Result<Vec<u8>> {
    loop {
        let n = call(std::ptr::null_mut(), 0);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut buf = vec![0u8; n as usize];
        let m = call(buf.as_mut_ptr().cast(), buf.len());
        if m >= 0 {
            buf.truncate(m as usize);
            return Ok(buf);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::ERANGE) {
            return Err(e);
        }
        // The list grew between the two calls: ask again.
    }
}

/// Replaces the open file's metadata with `m` (an upload without metadata
/// clears what an earlier upload left). A file system without user xattrs
/// keeps none, as in envd.
pub fn write(file: &std::fs::File, m: &Metadata) -> Result<(), RpcError> {
    let fd = file.as_raw_fd();
    let io = |e: std::io::Error| RpcError::io(e, "writing file metadata");
    // SAFETY: the buffer pointer and size come from `list`.
    let names = match list(|p, n| unsafe { libc::flistxattr(fd, p, n) }) {
        Ok(n) => n,
        Err(e) if unsupported(&e) => return Ok(()),
        Err(e) => return Err(io(e)),
    };
    for name in split_names(&names) {
        let Some(key) = name.strip_prefix(XATTR_PREFIX.as_bytes()) else {
            continue;
        };
        if std::str::from_utf8(key).is_ok_and(|k| m.contains_key(k)) {
            continue;
        }
        let c = CString::new(name).map_err(|_| RpcError::internal("xattr name with NUL"))?;
        // SAFETY: valid C string.
        if unsafe { libc::fremovexattr(fd, c.as_ptr()) } < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ENODATA) {
                return Err(io(e));
            }
        }
    }
    for (k, v) in m {
        let c = CString::new(format!("{XATTR_PREFIX}{k}")).map_err(|_| RpcError::invalid("metadata key with NUL"))?;
        // SAFETY: valid C string and value buffer.
        if unsafe { libc::fsetxattr(fd, c.as_ptr(), v.as_ptr().cast(), v.len(), 0) } < 0 {
            let e = std::io::Error::last_os_error();
            if unsupported(&e) {
                return Ok(());
            }
            return Err(io(e));
        }
    }
    Ok(())
}

/// The metadata of a path (following symlinks), if it has any. Entries that
/// are not UTF-8 (set inside the sandbox by other means) are skipped.
pub fn read(path: &Path) -> Option<Metadata> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: valid C string; buffer pointer and size come from `list`.
    let names = list(|p, n| unsafe { libc::listxattr(c.as_ptr(), p, n) }).ok()?;
    let mut m = Metadata::new();
    for name in split_names(&names) {
        let Some(key) = name.strip_prefix(XATTR_PREFIX.as_bytes()) else {
            continue;
        };
        let Ok(key) = std::str::from_utf8(key) else {
            continue;
        };
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        // SAFETY: valid C strings; buffer pointer and size come from `list`.
        let Ok(value) = list(|p, n| unsafe { libc::getxattr(c.as_ptr(), cname.as_ptr(), p.cast(), n) }) else {
            continue;
        };
        if let Ok(v) = String::from_utf8(value) {
            m.insert(key.to_string(), v);
        }
    }
    (!m.is_empty()).then_some(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                hyper::header::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn headers_become_lowercase_keys_and_other_headers_are_ignored() {
        let m = from_headers(&headers(&[
            ("X-Metadata-Owner", "Alice Smith"),
            ("x-metadata-build", "42"),
            ("content-type", "application/octet-stream"),
        ]))
        .unwrap();
        assert_eq!(
            m.into_iter().collect::<Vec<_>>(),
            [("build".into(), "42".into()), ("owner".into(), "Alice Smith".into())]
        );
    }

    #[test]
    fn bad_metadata_is_refused() {
        let long_key = format!("x-metadata-{}", "k".repeat(MAX_KEY + 1));
        let big = "v".repeat(1000);
        let too_big: Vec<(String, &str)> = (0..5).map(|i| (format!("x-metadata-k{i}"), big.as_str())).collect();
        let too_big: Vec<(&str, &str)> = too_big.iter().map(|(k, v)| (k.as_str(), *v)).collect();
        for h in [
            headers(&[(long_key.as_str(), "v")]),
            headers(&[("x-metadata-k", "tab\there")]),
            headers(&too_big),
        ] {
            assert!(from_headers(&h).is_err(), "{h:?}");
        }
    }
}
