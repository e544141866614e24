//! A writer of cpio "newc" archives (the format the kernel unpacks into its initramfs):
//! a 110-byte ASCII header per entry, the name, the data, each padded to 4 bytes, and a
//! `TRAILER!!!` entry. Entries are owned by root with mtime 0, so the same inputs give
//! the same bytes. The kernel unpacks concatenated archives one after the other, which
//! is how a VM's own files are added to the shared initramfs.

use std::io::{self, Read, Write};

pub(crate) struct CpioWriter<W: Write> {
    out: W,
    next_ino: u32,
    written: u64,
}

const S_IFDIR: u32 = 0o040000;
const S_IFREG: u32 = 0o100000;
const S_IFLNK: u32 = 0o120000;
const S_IFCHR: u32 = 0o020000;

impl<W: Write> CpioWriter<W> {
    pub(crate) fn new(out: W) -> Self {
        Self {
            out,
            next_ino: 1,
            written: 0,
        }
    }

    pub(crate) fn dir(&mut self, path: &str, mode: u32) -> io::Result<()> {
        self.header(path, S_IFDIR | (mode & 0o7777), 2, 0)?;
        Ok(())
    }

    pub(crate) fn file(&mut self, path: &str, mode: u32, data: &[u8]) -> io::Result<()> {
        self.file_from(path, mode, data.len() as u64, &mut &data[..])
    }

    /// A regular file of `len` bytes read from `data`.
    pub(crate) fn file_from(&mut self, path: &str, mode: u32, len: u64, data: &mut dyn Read) -> io::Result<()> {
        if len > u32::MAX as u64 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{path} is too large for a newc archive"),
            ));
        }
        self.header(path, S_IFREG | (mode & 0o7777), 1, len as u32)?;
        let copied = io::copy(&mut data.take(len), &mut self.out)?;
        if copied != len {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("{path}: expected {len} bytes, read {copied}"),
            ));
        }
        self.written += len;
        self.pad()
    }

    pub(crate) fn symlink(&mut self, path: &str, target: &str) -> io::Result<()> {
        self.header(path, S_IFLNK | 0o777, 1, target.len() as u32)?;
        self.write(target.as_bytes())?;
        self.pad()
    }

    /// A character device node (the kernel needs `/dev/console` before devtmpfs is up).
    pub(crate) fn char_device(&mut self, path: &str, mode: u32, major: u32, minor: u32) -> io::Result<()> {
        self.entry(path, S_IFCHR | (mode & 0o7777), 1, 0, (major, minor))
    }

    /// Writes the trailer and returns the output.
    pub(crate) fn finish(mut self) -> io::Result<W> {
        self.header("TRAILER!!!", 0, 1, 0)?;
        self.out.flush()?;
        Ok(self.out)
    }

    fn header(&mut self, path: &str, mode: u32, nlink: u32, size: u32) -> io::Result<()> {
        self.entry(path, mode, nlink, size, (0, 0))
    }

    fn entry(
        &mut self,
        path: &str,
        mode: u32,
        nlink: u32,
        size: u32,
        (rdev_major, rdev_minor): (u32, u32),
    ) -> io::Result<()> {
        let name = path.trim_start_matches('/');
        if name.is_empty() || name.contains('\0') {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("bad archive path {path:?}"),
            ));
        }
        let ino = if name == "TRAILER!!!" { 0 } else { self.next_ino };
        self.next_ino += 1;
        let fields = [
            ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            size,
            0, // devmajor
            0, // devminor
            rdev_major,
            rdev_minor,
            name.len() as u32 + 1,
            0, // check
        ];
        let mut header = String::with_capacity(110);
        header.push_str("070701");
        for field in fields {
            header.push_str(&format!("{field:08X}"));
        }
        self.write(header.as_bytes())?;
        self.write(name.as_bytes())?;
        self.write(&[0])?;
        self.pad()
    }

    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.written += bytes.len() as u64;
        Ok(())
    }

    fn pad(&mut self) -> io::Result<()> {
        let pad = (4 - (self.written % 4) as usize) % 4;
        self.write(&[0u8; 3][..pad])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_newc_headers_with_padded_names_and_data() {
        let mut w = CpioWriter::new(Vec::new());
        w.dir("bin", 0o755).unwrap();
        w.file("/init", 0o755, b"#!/bin/sh\n").unwrap();
        w.symlink("bin/sh", "busybox").unwrap();
        let out = w.finish().unwrap();
        assert_eq!(out.len() % 4, 0);
        // First entry: "bin", a directory (040755), name size 4.
        let first = std::str::from_utf8(&out[..110]).unwrap();
        assert!(first.starts_with("070701"));
        assert_eq!(&first[14..22], "000041ED", "mode 040755");
        assert_eq!(&first[94..102], "00000004", "name size");
        assert_eq!(&out[110..114], b"bin\0");
        // The file's data follows its (padded) name.
        let init = out.windows(5).position(|w| w == b"init\0").unwrap();
        let data = init + 5 + (4 - (init + 5) % 4) % 4;
        assert_eq!(&out[data..data + 10], b"#!/bin/sh\n");
        assert!(out.windows(11).any(|w| w == b"TRAILER!!!\0"));
    }

    #[test]
    fn host_cpio_lists_what_we_wrote() {
        // The host's cpio reads our archive back.
        let cpio = crate::vm::require_tool("cpio", "cpio").unwrap();
        let mut w = CpioWriter::new(Vec::new());
        w.dir("etc", 0o755).unwrap();
        w.file("etc/hello", 0o600, b"world").unwrap();
        w.symlink("link", "etc/hello").unwrap();
        let bytes = w.finish().unwrap();
        let mut child = std::process::Command::new(cpio)
            .args(["-t", "-v", "--quiet"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child.stdin.take().unwrap().write_all(&bytes).unwrap();
        let out = child.wait_with_output().unwrap();
        let listing = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{listing}");
        assert!(listing.contains("-rw-------"), "{listing}");
        assert!(listing.contains("etc/hello"), "{listing}");
        assert!(listing.contains("link -> etc/hello"), "{listing}");
    }
}
