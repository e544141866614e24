//! The append journal: where a batch of appended entries becomes durable with one
//! sequential write and one `fdatasync`, instead of a durable redb commit.
//!
//! A durable redb commit writes every page its copy-on-write B-trees touched (the log
//! table's leaf and branches, the table tree, the freed-page records, the header: about
//! eight scattered pages for one small entry) and costs ~100 µs of CPU before its fsync;
//! even a non-durable one costs ~25 µs. So the writer makes an append-only batch durable
//! here, with no redb transaction: the batch's entries as records in a preallocated file,
//! written in place and synced; they wait in memory (the store's tail for readers,
//! [`Journal::pending`] for redb). The next durable redb commit (a vote, a truncation, a
//! purge chunk, a batch that does not fit, 100 ms idle, the close) writes the pending
//! entries first, so it **retires** the journal: it records the journal's generation as
//! retired in the same transaction, and the journal starts over at offset 0 with the next
//! generation.
//!
//! Record: `len: u32 LE | crc32: u32 LE | generation: u64 LE | index: u64 LE | payload`,
//! the checksum over generation, index and payload; the payload is the encoded entry.
//!
//! Recovery (at open): the records of the one live generation (retired + 1), from offset
//! 0, while each checks out and the indexes run on by one. A torn last write fails its
//! checksum and ends the scan (it was never acknowledged); records of older generations
//! fail the generation test. What was found goes into redb with a durable commit that
//! retires that generation (see `Store::open_with`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::typ::{Entry, LogId};

/// The journal's file in the data directory.
pub(crate) const FILE: &str = "log.journal";
/// Its size: a batch that does not fit in what is left goes to a durable redb commit.
pub(crate) const CAPACITY: u64 = 1 << 20;
/// Bytes before each record's payload.
pub(crate) const HEADER: usize = 24;

pub(crate) struct Journal {
    file: File,
    capacity: u64,
    /// The generation records are written with now.
    generation: u64,
    /// Where the next record goes; 0: nothing to retire.
    offset: u64,
    /// A write or sync failed: nothing more goes here until a durable commit retires it.
    failed: bool,
    buf: Vec<u8>,
    /// The encoded entries written since the last retirement, in index order (redb gets
    /// them with the durable commit that retires this generation), and the newest id.
    pub(crate) pending: Vec<(u64, Vec<u8>)>,
    pub(crate) pending_last: Option<LogId>,
}

fn checksum(generation: u64, index: u64, payload: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&generation.to_le_bytes());
    h.update(&index.to_le_bytes());
    h.update(payload);
    h.finalize()
}

/// Opens `dir/log.journal`, creating it and writing it full of zeros (so that a later
/// sync flushes data only, never block allocation) when it is shorter than `capacity`.
pub(crate) fn open_file(dir: &Path, capacity: u64) -> io::Result<File> {
    let path = dir.join(FILE);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)?;
    let len = file.metadata()?.len();
    if len < capacity {
        let zeros = vec![0u8; 1 << 20];
        let mut at = len;
        while at < capacity {
            let n = (capacity - at).min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], at)?;
            at += n as u64;
        }
        file.sync_all()?;
        if let Some(d) = path.parent() {
            File::open(d)?.sync_all()?;
        }
    }
    Ok(file)
}

/// The records of generation `live` in `file`, in order: `(index, payload)`.
pub(crate) fn recover(file: &File, live: u64) -> io::Result<Vec<(u64, Vec<u8>)>> {
    let len = file.metadata()?.len() as usize;
    let mut data = vec![0u8; len];
    file.read_exact_at(&mut data, 0)?;
    Ok(records(&data, live))
}

/// The records of generation `live` in a journal file's contents `data` (see [`recover`]).
pub(crate) fn records(data: &[u8], live: u64) -> Vec<(u64, Vec<u8>)> {
    let mut out: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut at = 0usize;
    while at + HEADER <= data.len() {
        let h = &data[at..at + HEADER];
        let n = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
        let generation = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
        let index = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
        if generation != live || n == 0 || at + HEADER + n > data.len() {
            break;
        }
        // `checked_add`: a record at u64::MAX (a damaged file) has no successor; one of
        // index 0 after it must not pass for the next.
        if out.last().is_some_and(|(prev, _)| prev.checked_add(1) != Some(index)) {
            break;
        }
        let payload = &data[at + HEADER..at + HEADER + n];
        if checksum(generation, index, payload) != crc {
            break;
        }
        out.push((index, payload.to_vec()));
        at += HEADER + n;
    }
    out
}

/// Appends one record of `generation` to `out` (the layout in the module doc).
pub(crate) fn put_record(out: &mut Vec<u8>, generation: u64, index: u64, payload: &[u8]) -> io::Result<()> {
    let n = u32::try_from(payload.len()).map_err(|_| io::Error::other("journal record over 4 GiB"))?;
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(&checksum(generation, index, payload).to_le_bytes());
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&index.to_le_bytes());
    out.extend_from_slice(payload);
    Ok(())
}

/// The entries of recovered records, each checked to be the entry its record's index
/// says (what `Store::open` puts back into redb).
pub(crate) fn entries(records: &[(u64, Vec<u8>)]) -> Result<Vec<Entry>, crate::LogError> {
    records
        .iter()
        .map(|(index, bytes)| {
            let e: Entry = crate::decode(bytes)?;
            if e.log_id.index() != *index {
                return Err(crate::LogError::Storage(format!(
                    "journal record {index} holds entry {}",
                    e.log_id.index()
                )));
            }
            Ok(e)
        })
        .collect()
}

impl Journal {
    /// A journal over `file` writing generation `generation` from offset 0.
    pub(crate) fn new(file: File, capacity: u64, generation: u64) -> Self {
        Journal {
            file,
            capacity,
            generation,
            offset: 0,
            failed: false,
            buf: Vec::new(),
            pending: Vec::new(),
            pending_last: None,
        }
    }

    /// The generation being written (what a durable commit records as retired).
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// Whether records were written since the last retirement.
    pub(crate) fn is_empty(&self) -> bool {
        self.offset == 0 && !self.failed
    }

    /// Whether `records` entries of `payload_bytes` in all fit in what is left.
    pub(crate) fn fits(&self, records: usize, payload_bytes: usize) -> bool {
        !self.failed && self.offset + (records * HEADER + payload_bytes) as u64 <= self.capacity
    }

    /// Writes the records (contiguous indexes) with one write and syncs them. Check
    /// [`Self::fits`] first.
    pub(crate) fn append<'a>(&mut self, records: impl IntoIterator<Item = (u64, &'a [u8])>) -> io::Result<()> {
        self.buf.clear();
        for (index, payload) in records {
            put_record(&mut self.buf, self.generation, index, payload)?;
        }
        if self.failed || self.offset + self.buf.len() as u64 > self.capacity {
            return Err(io::Error::other("journal batch does not fit"));
        }
        let r = self
            .file
            .write_all_at(&self.buf, self.offset)
            .and_then(|()| self.file.sync_data());
        match r {
            Ok(()) => {
                self.offset += self.buf.len() as u64;
                Ok(())
            }
            Err(e) => {
                self.failed = true;
                Err(e)
            }
        }
    }

    /// A durable commit that recorded [`Self::generation`] as retired is done: start over.
    pub(crate) fn retired(&mut self) {
        self.generation += 1;
        self.offset = 0;
        self.failed = false;
        self.pending.clear();
        self.pending_last = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recovery_reads_the_live_generation_up_to_the_first_bad_record() {
        let dir = tempfile::tempdir().unwrap();
        let file = open_file(dir.path(), 1 << 16).unwrap();
        assert_eq!(file.metadata().unwrap().len(), 1 << 16, "preallocated");
        let mut j = Journal::new(file.try_clone().unwrap(), 1 << 16, 7);
        assert!(j.is_empty());
        j.append([(10, &b"ten"[..]), (11, &b"eleven"[..])]).unwrap();
        j.append([(12, &b"twelve"[..])]).unwrap();
        assert!(!j.is_empty());
        let got = recover(&file, 7).unwrap();
        assert_eq!(
            got,
            vec![
                (10, b"ten".to_vec()),
                (11, b"eleven".to_vec()),
                (12, b"twelve".to_vec())
            ]
        );
        assert!(
            recover(&file, 8).unwrap().is_empty(),
            "another generation's records are not live"
        );

        // A torn write: the last record's payload is damaged, so it and what follows are
        // not recovered.
        let last = (HEADER + 3) + (HEADER + 6);
        file.write_all_at(b"XX", (last + HEADER) as u64).unwrap();
        assert_eq!(recover(&file, 7).unwrap().len(), 2);

        // Retired: the next generation overwrites from the start; the older records after
        // it are not taken for its own.
        j.retired();
        assert_eq!(j.generation(), 8);
        j.append([(13, &b"thirteen"[..])]).unwrap();
        assert_eq!(recover(&file, 8).unwrap(), vec![(13, b"thirteen".to_vec())]);
        assert!(recover(&file, 7).unwrap().is_empty());
    }

    /// Found by the `journal_recovery` fuzz target: recovery panicked (an overflow) on a
    /// record after one of index u64::MAX, where a release build would have taken the
    /// wrapped index 0 for the next one.
    #[test]
    fn no_record_follows_one_at_the_last_index() {
        let mut data = Vec::new();
        put_record(&mut data, 1, u64::MAX, b"last").unwrap();
        put_record(&mut data, 1, 0, b"wrapped").unwrap();
        assert_eq!(records(&data, 1), vec![(u64::MAX, b"last".to_vec())]);
    }

    #[test]
    fn a_batch_that_does_not_fit_is_refused_and_indexes_must_run_on() {
        let dir = tempfile::tempdir().unwrap();
        let file = open_file(dir.path(), 100).unwrap();
        let mut j = Journal::new(file.try_clone().unwrap(), 100, 1);
        assert!(j.fits(2, 100 - 2 * HEADER));
        assert!(!j.fits(2, 100 - 2 * HEADER + 1));
        assert!(j.append([(1, &[0u8; 80][..])]).is_err());
        j.append([(1, &b"a"[..])]).unwrap();
        // A gap in the indexes ends recovery (the journal only ever grows by one).
        j.append([(3, &b"c"[..])]).unwrap();
        assert_eq!(recover(&file, 1).unwrap(), vec![(1, b"a".to_vec())]);
    }
}
