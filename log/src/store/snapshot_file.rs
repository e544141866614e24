//! The Raft snapshot's own file, `<dir>/snapshot`, beside `log.redb` rather than in it:
//! a snapshot is the whole state (tens of MB at the default interval), and written into
//! redb it would hold redb's one write transaction, which every log append needs, for as
//! long as its commit takes (hundreds of ms), on every node at the same index. Followers
//! would stop acknowledging and the leader would lose its lease. etcd keeps its snapshots
//! outside its database for the same reason.
//!
//! Layout: `magic "ODSS" | version u8 (1) | meta_len u32 LE | data_len u64 LE |
//! crc32 u32 LE (over meta and data) | meta | data`. It is written to a temporary file,
//! synced, and renamed over the old one (then the directory is synced), so a reader
//! finds the previous snapshot or the new one, never part of one.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

pub(crate) const FILE: &str = "snapshot";
const TEMP: &str = "snapshot.partial";
const MAGIC: &[u8; 4] = b"ODSS";
const VERSION: u8 = 1;
const HEADER: usize = 4 + 1 + 4 + 8 + 4;
/// Bytes written between syncs.
const SYNC_EVERY: usize = 4 << 20;
/// Metadata is a log id and a membership: a few hundred bytes. More is a damaged file.
const MAX_META: u32 = 1 << 20;

fn invalid(path: &Path, why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{}: {why}", path.display()))
}

fn checksum(meta: &[u8], data: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(meta);
    h.update(data);
    h.finalize()
}

/// Writes the snapshot (`meta` encoded, then the application's bytes) durably, replacing
/// the previous one whole.
pub(crate) fn write(dir: &Path, meta: &[u8], data: &[u8]) -> io::Result<()> {
    let meta_len = u32::try_from(meta.len())
        .ok()
        .filter(|n| *n <= MAX_META)
        .ok_or_else(|| invalid(dir, "snapshot metadata too large"))?;
    let temp = dir.join(TEMP);
    {
        // The whole state, tenants' `env` included: for this node's user only.
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&temp)?;
        let mut head = Vec::with_capacity(HEADER + meta.len());
        head.extend_from_slice(MAGIC);
        head.push(VERSION);
        head.extend_from_slice(&meta_len.to_le_bytes());
        head.extend_from_slice(&(data.len() as u64).to_le_bytes());
        head.extend_from_slice(&checksum(meta, data).to_le_bytes());
        head.extend_from_slice(meta);
        f.write_all(&head)?;
        // Synced a piece at a time: tens of MB of dirty pages flushed at once would queue
        // the log's own syncs (each append's) behind them for as long, on the same disk.
        for piece in data.chunks(SYNC_EVERY) {
            f.write_all(piece)?;
            f.sync_data()?;
        }
        f.sync_all()?;
    }
    std::fs::rename(&temp, dir.join(FILE))?;
    File::open(dir)?.sync_all()
}

/// The file's header, checked: (meta length, data length, checksum).
fn header(path: &Path, f: &mut File) -> io::Result<(usize, u64, u32)> {
    let mut h = [0u8; HEADER];
    f.read_exact(&mut h)
        .map_err(|_| invalid(path, "truncated snapshot header"))?;
    if &h[..4] != MAGIC {
        return Err(invalid(path, "not a snapshot file"));
    }
    if h[4] != VERSION {
        return Err(invalid(
            path,
            &format!("snapshot format {} (this build reads {VERSION})", h[4]),
        ));
    }
    let meta_len = u32::from_le_bytes(h[5..9].try_into().expect("4 bytes"));
    if meta_len > MAX_META {
        return Err(invalid(path, "snapshot metadata too large"));
    }
    let data_len = u64::from_le_bytes(h[9..17].try_into().expect("8 bytes"));
    let crc = u32::from_le_bytes(h[17..21].try_into().expect("4 bytes"));
    Ok((meta_len as usize, data_len, crc))
}

fn open(dir: &Path) -> io::Result<Option<(PathBuf, File)>> {
    let path = dir.join(FILE);
    match File::open(&path) {
        Ok(f) => Ok(Some((path, f))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// The stored snapshot's encoded metadata only, if there is a snapshot file.
pub(crate) fn read_meta(dir: &Path) -> io::Result<Option<Vec<u8>>> {
    let Some((path, mut f)) = open(dir)? else {
        return Ok(None);
    };
    let (meta_len, _, _) = header(&path, &mut f)?;
    let mut meta = vec![0u8; meta_len];
    f.read_exact(&mut meta)
        .map_err(|_| invalid(&path, "truncated snapshot"))?;
    Ok(Some(meta))
}

/// The stored snapshot (encoded metadata, application bytes), checked against its
/// checksum, if there is a snapshot file.
pub(crate) fn read(dir: &Path) -> io::Result<Option<(Vec<u8>, Vec<u8>)>> {
    let Some((path, mut f)) = open(dir)? else {
        return Ok(None);
    };
    let (meta_len, data_len, crc) = header(&path, &mut f)?;
    let on_disk = f.metadata()?.len();
    if on_disk != HEADER as u64 + meta_len as u64 + data_len {
        return Err(invalid(&path, "snapshot length does not match its header"));
    }
    let mut meta = vec![0u8; meta_len];
    f.read_exact(&mut meta)?;
    let mut data = Vec::with_capacity(data_len as usize);
    f.read_to_end(&mut data)?;
    if checksum(&meta, &data) != crc {
        return Err(invalid(&path, "snapshot checksum mismatch"));
    }
    Ok(Some((meta, data)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_reads_back_as_written_and_a_new_one_replaces_it_whole() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(read(dir.path()).unwrap(), None);
        write(dir.path(), b"meta-1", &vec![7u8; 100_000]).unwrap();
        write(dir.path(), b"meta-2", b"second").unwrap();
        assert_eq!(
            read(dir.path()).unwrap(),
            Some((b"meta-2".to_vec(), b"second".to_vec()))
        );
        assert_eq!(read_meta(dir.path()).unwrap(), Some(b"meta-2".to_vec()));
        assert!(!dir.path().join(TEMP).exists());
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.path().join(FILE)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the snapshot is for the node's user only");
    }

    #[test]
    fn a_damaged_snapshot_is_an_error_not_a_state() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), b"meta", b"application bytes").unwrap();
        let path = dir.path().join(FILE);
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let e = read(dir.path()).unwrap_err();
        assert!(e.to_string().contains("checksum"), "{e}");
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        let e = read(dir.path()).unwrap_err();
        assert!(e.to_string().contains("length"), "{e}");
        std::fs::write(&path, b"ODS").unwrap();
        let e = read(dir.path()).unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
    }
}
