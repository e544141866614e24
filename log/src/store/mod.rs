//! redb-backed Raft storage: vote, committed id, live log, archive and snapshot.
//!
//! One redb file holds everything, beside a fixed-size append journal (`journal.rs`), and
//! one thread (`opendsec-log-writer`) makes every write of the Raft log and its metadata, in
//! the order openraft asked for them. The pipeline:
//!
//! - `append` encodes the entries, puts them in the in-memory **tail** (so they are readable
//!   at once, as openraft requires: replication to the followers starts from there while the
//!   local fsync is still running) and queues them to the writer. It never waits for the disk:
//!   openraft's core awaits `append`, and a core blocked on an fsync could neither replicate,
//!   nor count acknowledgements, nor apply.
//! - The writer takes every operation queued so far (appends, truncation, vote, committed id,
//!   purge) and performs them in order. A batch of appends only (the common case) becomes
//!   durable by one write and one `fdatasync` of its entries in the journal, with no redb
//!   transaction: the entries stay in the tail (unwritten, so never evicted) and in the
//!   journal's `pending` list. Any other batch is **one** durable write transaction: the
//!   journal's pending entries first, then the batch's operations; it *retires* the
//!   journal, which starts over. Only then does the writer report the appends flushed and
//!   answer the waiting calls. Appends arriving during a sync share the next one (group
//!   commit). A durable commit also comes when a batch does not fit in the journal's
//!   remaining space, when the writer has been idle for 100 ms with records in the
//!   journal, and on close. At open, the journal's live records go into redb (see
//!   `journal.rs` for the format and recovery).
//! - `save_committed` only queues the id: a later transaction writes the newest one, at most
//!   every 100 ms and only with a durable commit (or after 100 ms without other writes, or
//!   on close). Losing it in a crash is allowed by openraft (a restarted node re-applies
//!   less at start); it is never ahead of the entries it covers, since those were queued
//!   before it.
//! - `save_vote`, `truncate_after` and `purge` wait until the writer has committed them
//!   durably. (Truncation must be: a journal write after a non-durable truncation would,
//!   after a crash, replay onto the untruncated log.)
//! - The tail keeps the newest entries (all not yet written, plus written ones up to a byte
//!   budget) so replication and apply rarely read redb. Reads take the tail's part first,
//!   then open a redb read transaction for what precedes it: an entry leaves the tail only
//!   after a committed transaction holds it, so it is always found in one of the two.
//!
//! - **Inline appends** ([`Store::set_inline`]): where nothing needs the core while an
//!   append's fsync runs, the hand-off to the writer thread and back (two thread wake-ups)
//!   is most of the overhead of a lone write, so an append of one entry that finds the
//!   writer idle with nothing queued commits its batch itself, on the core's thread, and
//!   reports it flushed. Order is kept: the writer's queue is empty and the writer waits
//!   while an inline batch runs ([`Flow`]). Batches of several entries (concurrent writes)
//!   queue as before (group commit). Two cases ([`Inline`]):
//!   - a node that is its cluster's only member (no replication to overlap with the
//!     fsync), when every earlier flush was handled by the core (committed);
//!   - a follower (its core only appends what the leader sends and acknowledges it once
//!     durable), unless the append comes right after an inline one ended: then it waited
//!     in the core's queue during that fsync, and so may others; they go to the writer,
//!     which lets them share its fsyncs. (A leader never: its core replicates meanwhile.)
//!
//! Purge moves entries into the `archive` table (application payloads only) in the same write
//! transaction that removes them from the live log; see `LogNode::read_entries`.

mod raft_storage;
mod snapshot_file;
mod tail;
#[cfg(test)]
mod tests;
mod writer;

use std::collections::VecDeque;
use std::fmt::Debug;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, mpsc};
use std::time::{Duration, Instant};

use openraft::EntryPayload;
use redb::{Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};

use crate::journal::{self, Journal};
use crate::typ::{Entry, LogId, SnapshotMeta};
use crate::{LogError, decode, encode};

use tail::Tail;
pub(crate) use writer::Inline;
use writer::{Flow, Op, Queue, writer};

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const LOGS: TableDefinition<u64, &[u8]> = TableDefinition::new("logs");
const ARCHIVE: TableDefinition<u64, &[u8]> = TableDefinition::new("archive");
/// Where versions before the snapshot file kept the snapshot (read if there is no file).
const SNAPSHOT: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshot");

const K_VOTE: &str = "vote";
const K_COMMITTED: &str = "committed";
const K_PURGED: &str = "last_purged";
const K_FLOOR: &str = "archive_floor";
/// The newest journal generation a durable commit made redundant (see `journal.rs`).
const K_JOURNAL_RETIRED: &str = "journal_retired";
const K_SNAP_META: &str = "meta";
const K_SNAP_DATA: &str = "data";

/// Encoded bytes of already-written entries the tail keeps for readers (entries not yet
/// written are always kept).
const TAIL_BYTES: usize = 16 << 20;
/// At most this many queued operations go into one write transaction.
const MAX_BATCH_OPS: usize = 8192;
/// Log entries a purge moves to the archive per write transaction: a purge after a snapshot
/// (thousands of entries, tens of ms) must not hold back the appends queued meanwhile.
const PURGE_CHUNK: usize = 500;
/// The committed id is written at most this often (each write costs redb a page per commit,
/// ~12% of the bytes of a one-entry commit), or after this long without other writes.
const COMMITTED_EVERY: Duration = Duration::from_millis(100);
/// A follower's append this soon after an inline batch ended was queued behind it.
const QUEUED_WITHIN_US: u64 = 100;
/// On a runtime with one worker thread, an inline commit stalls every task of the node
/// for its fsync: it is done only for an append this long after the one before (a node
/// with one write at a time in flight; busier ones hand appends to the writer).
const SPARSE_AFTER_US: u64 = 500;

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "log store is closed")
}

/// Counters of the storage work done so far (diagnostics and benchmarks; see
/// [`crate::LogNode::io_stats`]). Times are in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoStats {
    /// `append` calls and the entries they carried.
    pub appends: u64,
    pub appended_entries: u64,
    /// Time openraft's core spent inside `append` (it awaits it).
    pub append_us: u64,
    /// Appends committed on the caller's thread (see [`Store::set_inline`]).
    pub inline_appends: u64,
    /// Write transactions (all durable: fsync'd), and their total time.
    pub durable_commits: u64,
    pub durable_commit_us: u64,
    /// Journal writes (one write and one fdatasync each), and their total time.
    pub journal_syncs: u64,
    pub journal_sync_us: u64,
    /// `save_committed` calls and the time openraft's core spent in them.
    pub save_committed: u64,
    pub save_committed_us: u64,
    /// Log reads (replication, apply) and their total time.
    pub log_reads: u64,
    pub log_read_us: u64,
    /// Reads that had to open a redb read transaction (the rest came from the tail).
    pub log_reads_db: u64,
}

#[derive(Default)]
struct Counters {
    appends: AtomicU64,
    appended_entries: AtomicU64,
    append_us: AtomicU64,
    durable_commits: AtomicU64,
    durable_commit_us: AtomicU64,
    journal_syncs: AtomicU64,
    journal_sync_us: AtomicU64,
    save_committed: AtomicU64,
    save_committed_us: AtomicU64,
    log_reads: AtomicU64,
    log_read_us: AtomicU64,
    log_reads_db: AtomicU64,
    inline_appends: AtomicU64,
}

fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Ordering::Relaxed);
}

fn us_since(t: Instant) -> u64 {
    t.elapsed().as_micros() as u64
}

/// Shared storage handle (cheap to clone). Implements openraft's log storage traits and
/// keeps the snapshot and the archive.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
}

struct Inner {
    counters: Counters,
    /// `None` once [`Store::close`] ran (the file is released for a restart in-process).
    db: RwLock<Option<Database>>,
    /// The data directory (the snapshot file lives here, see `snapshot_file.rs`).
    dir: PathBuf,
    archive_retention: Option<u64>,
    tail: Mutex<Tail>,
    /// Byte budget of written entries in the tail ([`TAIL_BYTES`]).
    tail_bytes: usize,
    /// The writer thread's queue.
    queue: Mutex<Queue>,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// When appends may be committed on the caller's thread ([`Inline`] as a u8).
    inline: AtomicU8,
    /// When the store was opened: the clock of `inline_end_us`.
    opened: Instant,
    /// When the newest inline batch ended (µs since `opened`).
    inline_end_us: AtomicU64,
    /// When the newest one-entry append was offered to `try_inline` (µs since `opened`).
    last_single_us: AtomicU64,
    /// Who writes now (shared with the writer thread).
    flow: Arc<(Mutex<Flow>, Condvar)>,
    /// A lone node's newest committed id not yet written (see `save_committed`), and when
    /// an inline batch last wrote one.
    committed: Mutex<Option<Vec<u8>>>,
    committed_inline_at: Mutex<Instant>,
    /// The newest entry index reported flushed (+1; 0: none), and the newest committed
    /// index openraft saved (+1) while inline appends are on. Flushed beyond committed means
    /// the core has a flush notification it has not handled yet.
    flushed_upto: AtomicU64,
    committed_upto: AtomicU64,
    /// Where append-only batches become durable (held while a batch runs).
    journal: Mutex<Journal>,
    /// The newest purge asked for (see [`Store::purge_soon`]): the log's state reports it
    /// as purged while the writer is still moving its entries to the archive.
    purge_asked: Mutex<Option<LogId>>,
}

impl Store {
    /// Open (or create) `<dir>/log.redb` and start the writer thread.
    pub(crate) fn open(dir: &Path, archive_retention: Option<u64>) -> Result<Self, LogError> {
        Self::open_with(dir, archive_retention, TAIL_BYTES, journal::CAPACITY)
    }

    fn open_with(
        dir: &Path,
        archive_retention: Option<u64>,
        tail_bytes: usize,
        journal_capacity: u64,
    ) -> Result<Self, LogError> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("log.redb");
        let db = Database::create(&path).map_err(|e| LogError::Storage(format!("{}: {e}", path.display())))?;
        let journal_file = journal::open_file(dir, journal_capacity)
            .map_err(|e| LogError::Storage(format!("{}: {e}", dir.join(journal::FILE).display())))?;
        // The journal's live records (appends acknowledged as durable that redb does not
        // hold yet: they waited in memory for the next durable commit) go into redb now,
        // durably, and their generation is retired with them.
        let live = {
            let txn = db.begin_write().map_err(redb::Error::from)?;
            let mut meta = txn.open_table(META).map_err(redb::Error::from)?;
            let retired: u64 = match meta.get(K_JOURNAL_RETIRED).map_err(redb::Error::from)? {
                Some(v) => decode(v.value())?,
                None => 0,
            };
            let live = retired + 1;
            let records = journal::recover(&journal_file, live)?;
            let mut logs = txn.open_table(LOGS).map_err(redb::Error::from)?;
            if let Some((last, _)) = records.last() {
                journal::entries(&records)?;
                for (index, bytes) in &records {
                    logs.insert(*index, bytes.as_slice()).map_err(redb::Error::from)?;
                }
                // An append always ends the log: nothing after it survives it.
                logs.retain_in(last + 1.., |_, _| false).map_err(redb::Error::from)?;
                tracing::info!(
                    entries = records.len(),
                    first = records[0].0,
                    last,
                    "log: recovered appends from the journal"
                );
            }
            meta.insert(K_JOURNAL_RETIRED, encode(&live)?.as_slice())
                .map_err(redb::Error::from)?;
            drop((meta, logs));
            txn.open_table(ARCHIVE).map_err(redb::Error::from)?;
            txn.open_table(SNAPSHOT).map_err(redb::Error::from)?;
            txn.commit().map_err(redb::Error::from)?;
            live
        };
        let (tx, rx) = mpsc::channel::<Op>();
        let flow = Arc::new((Mutex::new(Flow::default()), Condvar::new()));
        let writer_flow = flow.clone();
        let inner = Arc::new(Inner {
            counters: Counters::default(),
            db: RwLock::new(Some(db)),
            dir: dir.to_path_buf(),
            archive_retention,
            tail: Mutex::new(Tail::default()),
            tail_bytes,
            queue: Mutex::new(Queue {
                tx: Some(tx),
                held: Vec::new(),
                release_scheduled: false,
            }),
            writer: Mutex::new(None),
            inline: AtomicU8::new(Inline::Off as u8),
            opened: Instant::now(),
            inline_end_us: AtomicU64::new(0),
            last_single_us: AtomicU64::new(0),
            flow,
            committed: Mutex::new(None),
            committed_inline_at: Mutex::new(Instant::now()),
            flushed_upto: AtomicU64::new(0),
            committed_upto: AtomicU64::new(0),
            journal: Mutex::new(Journal::new(journal_file, journal_capacity, live + 1)),
            purge_asked: Mutex::new(None),
        });
        let weak = Arc::downgrade(&inner);
        let handle = std::thread::Builder::new()
            .name("opendsec-log-writer".into())
            .spawn(move || writer(weak, rx, writer_flow))?;
        *lock(&inner.writer) = Some(handle);
        Ok(Store { inner })
    }

    /// The storage counters so far.
    pub fn io_stats(&self) -> IoStats {
        let c = &self.inner.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        IoStats {
            appends: g(&c.appends),
            appended_entries: g(&c.appended_entries),
            append_us: g(&c.append_us),
            inline_appends: g(&c.inline_appends),
            durable_commits: g(&c.durable_commits),
            durable_commit_us: g(&c.durable_commit_us),
            journal_syncs: g(&c.journal_syncs),
            journal_sync_us: g(&c.journal_sync_us),
            save_committed: g(&c.save_committed),
            save_committed_us: g(&c.save_committed_us),
            log_reads: g(&c.log_reads),
            log_read_us: g(&c.log_read_us),
            log_reads_db: g(&c.log_reads_db),
        }
    }

    /// Release the database file (after the Raft node stopped). Further operations fail.
    pub(crate) fn close(&self) {
        // Let the writer finish what is queued (it writes a pending committed id on exit).
        {
            let mut q = lock(&self.inner.queue);
            q.release();
            q.tx.take();
        }
        if let Some(h) = lock(&self.inner.writer).take()
            && h.thread().id() != std::thread::current().id()
        {
            let _ = h.join();
        }
        // One last durable transaction: what the journal holds goes into redb, and the
        // journal is retired.
        let committed = lock(&self.inner.committed).take();
        self.run_batch(Vec::new(), committed, &mut VecDeque::new());
        if let Ok(mut g) = self.inner.db.write() {
            g.take();
        }
    }

    fn tail(&self) -> MutexGuard<'_, Tail> {
        lock(&self.inner.tail)
    }
}

impl Store {
    fn with_db<R>(&self, f: impl FnOnce(&Database) -> Result<R, redb::Error>) -> io::Result<R> {
        let g = self.inner.db.read().map_err(io_err)?;
        let db = g.as_ref().ok_or_else(closed)?;
        f(db).map_err(io_err)
    }

    /// Run `f` in one write transaction with the given durability.
    fn write<R>(
        &self,
        durability: Durability,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<R, redb::Error>,
    ) -> io::Result<R> {
        self.with_db(|db| {
            let mut txn = db.begin_write()?;
            txn.set_durability(durability)?;
            let r = f(&txn)?;
            txn.commit()?;
            Ok(r)
        })
    }

    fn get_meta<T: serde::de::DeserializeOwned>(&self, key: &str) -> io::Result<Option<T>> {
        let bytes = self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(META)?;
            Ok(t.get(key)?.map(|v| v.value().to_vec()))
        })?;
        bytes.map(|b| decode(&b)).transpose()
    }

    /// Log entries with index in `start..=end` (`end` `None`: to the last), from the tail
    /// and, for what precedes the tail, from redb.
    fn read_log(&self, start: u64, end: Option<u64>) -> io::Result<Vec<Entry>> {
        let t = Instant::now();
        // The tail first: an entry evicted from it after this point is already committed in
        // redb, so the read transaction opened below sees it.
        let (tail_first, cached) = self.tail().range(start, end);
        // What precedes the tail (everything when it is empty) is read from redb.
        let db_range = match tail_first {
            None => Some(end),
            Some(0) => None,
            Some(f) => {
                let e = end.map_or(f - 1, |e| e.min(f - 1));
                (start <= e).then_some(Some(e))
            }
        };
        let mut out = Vec::new();
        if let Some(db_end) = db_range {
            add(&self.inner.counters.log_reads_db, 1);
            let raw = self.with_db(|db| {
                let txn = db.begin_read()?;
                let tbl = txn.open_table(LOGS)?;
                let mut raw = Vec::new();
                let it = match db_end {
                    Some(e) => tbl.range(start..=e)?,
                    None => tbl.range(start..)?,
                };
                for kv in it {
                    let (_, v) = kv?;
                    raw.push(v.value().to_vec());
                }
                Ok(raw)
            })?;
            out.reserve(raw.len() + cached.len());
            for b in &raw {
                out.push(decode::<Entry>(b)?);
            }
        }
        out.extend(cached);
        add(&self.inner.counters.log_reads, 1);
        add(&self.inner.counters.log_read_us, us_since(t));
        Ok(out)
    }

    // ---------------------------------------------------------------- snapshot

    /// Durably store a snapshot, replacing the previous one (off the async executor).
    pub(crate) async fn save_snapshot(&self, meta: &SnapshotMeta, data: Vec<u8>) -> io::Result<()> {
        let (this, meta) = (self.clone(), meta.clone());
        tokio::task::spawn_blocking(move || this.save_snapshot_now(&meta, &data))
            .await
            .map_err(io_err)?
    }

    /// Durably store a snapshot, replacing the previous one, on this thread (a blocking
    /// one: it writes and syncs the whole snapshot). It goes to its own file, never into
    /// redb's write transaction (see `snapshot_file.rs`); a snapshot a version before
    /// this one kept in redb is dropped once the file holds a newer one.
    pub(crate) fn save_snapshot_now(&self, meta: &SnapshotMeta, data: &[u8]) -> io::Result<()> {
        snapshot_file::write(&self.inner.dir, &encode(meta)?, data)?;
        let in_redb = self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(SNAPSHOT)?;
            Ok(t.get(K_SNAP_META)?.is_some())
        })?;
        if in_redb {
            self.write(Durability::Immediate, |txn| {
                let mut t = txn.open_table(SNAPSHOT)?;
                t.remove(K_SNAP_META)?;
                t.remove(K_SNAP_DATA)?;
                Ok(())
            })?;
        }
        Ok(())
    }

    /// The stored snapshot's metadata, if any.
    pub(crate) fn snapshot_meta(&self) -> io::Result<Option<SnapshotMeta>> {
        if let Some(m) = snapshot_file::read_meta(&self.inner.dir)? {
            return decode(&m).map(Some);
        }
        let b = self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(SNAPSHOT)?;
            Ok(t.get(K_SNAP_META)?.map(|v| v.value().to_vec()))
        })?;
        b.map(|b| decode(&b)).transpose()
    }

    /// The stored snapshot (metadata and application bytes), if any: from its file, or
    /// from redb where an earlier version kept it.
    pub(crate) fn load_snapshot(&self) -> io::Result<Option<(SnapshotMeta, Vec<u8>)>> {
        let r = match snapshot_file::read(&self.inner.dir)? {
            Some(found) => Some(found),
            None => self.with_db(|db| {
                let txn = db.begin_read()?;
                let t = txn.open_table(SNAPSHOT)?;
                let m = t.get(K_SNAP_META)?.map(|v| v.value().to_vec());
                let d = t.get(K_SNAP_DATA)?.map(|v| v.value().to_vec());
                Ok(m.zip(d))
            })?,
        };
        match r {
            None => Ok(None),
            Some((m, d)) => Ok(Some((decode(&m)?, d))),
        }
    }

    // ---------------------------------------------------------------- archive

    /// The first index from which this node's history is complete (archive + live log).
    /// Entries before it were dropped by archive retention, or never stored here because this
    /// node caught up through a snapshot.
    pub fn first_available_index(&self) -> io::Result<u64> {
        Ok(self.get_meta::<u64>(K_FLOOR)?.unwrap_or(0).max(1))
    }

    /// How many entries the archive holds.
    pub fn archived_count(&self) -> io::Result<u64> {
        self.with_db(|db| Ok(db.begin_read()?.open_table(ARCHIVE)?.len()?))
    }

    /// How many entries the live Raft log holds.
    pub fn live_count(&self) -> io::Result<u64> {
        self.with_db(|db| Ok(db.begin_read()?.open_table(LOGS)?.len()?))
    }

    /// Application payloads with index in `from..=to`, archive first then live log, in index
    /// order; blank and membership entries are skipped. The caller caps `to` at the applied
    /// index so that only committed entries are returned.
    pub(crate) fn read_entries(&self, from: u64, to: u64) -> Result<Vec<(u64, Vec<u8>)>, LogError> {
        let floor = self.get_meta::<u64>(K_FLOOR)?.unwrap_or(0);
        if from < floor {
            return Err(LogError::NotAvailable {
                requested: from,
                first_available: floor,
            });
        }
        if from > to {
            return Ok(Vec::new());
        }
        // The tail first (see `read_log`), then one read transaction for the rest.
        let (tail_first, cached) = self.tail().range(from, Some(to));
        let live_end = tail_first.map_or(Some(to), |f| f.checked_sub(1).map(|f| f.min(to)));
        let (archived, live) = self.with_db(|db| {
            let txn = db.begin_read()?;
            let mut archived = Vec::new();
            for kv in txn.open_table(ARCHIVE)?.range(from..=to)? {
                let (k, v) = kv?;
                archived.push((k.value(), v.value().to_vec()));
            }
            let mut live = Vec::new();
            if let Some(e) = live_end.filter(|e| from <= *e) {
                for kv in txn.open_table(LOGS)?.range(from..=e)? {
                    let (_, v) = kv?;
                    live.push(v.value().to_vec());
                }
            }
            Ok((archived, live))
        })?;
        let mut out = archived;
        let mut last = out.last().map(|(i, _)| *i);
        let mut push = |e: Entry| {
            if let EntryPayload::Normal(p) = e.payload {
                let idx = e.log_id.index();
                if last.is_none_or(|l| idx > l) {
                    out.push((idx, p.0));
                    last = Some(idx);
                }
            }
        };
        for b in live {
            push(decode(&b)?);
        }
        for e in cached {
            push(e);
        }
        Ok(out)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
