//! redb-backed Raft storage: vote, committed id, live log, archive and snapshot.
//!
//! One redb file holds everything. Durability model:
//! - `append` writes the entries in a non-durable redb commit (so they are readable at once,
//!   as openraft requires) and queues openraft's flush callback to a flusher thread. The
//!   flusher takes every callback queued so far, performs one durable (fsync'ed) commit, which
//!   persists all earlier non-durable commits, and only then reports them flushed. So every
//!   append is durable before openraft is told so, and appends arriving during an fsync share
//!   the next one (group commit).
//! - `save_vote`, `purge` and snapshots are durable commits of their own.
//! - `save_committed` and `truncate_after` are non-durable; they become durable with the next
//!   durable commit (losing them in a crash is allowed by openraft).
//!
//! Purge moves entries into the `archive` table (application payloads only) in the same write
//! transaction that removes them from the live log; see `LogNode::read_entries`.

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, mpsc};
use std::time::Instant;

use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use openraft::{EntryPayload, OptionalSend, RaftLogReader};
use redb::{Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};

use crate::typ::{Entry, LogId, SnapshotMeta, Vote};
use crate::{LogError, TypeConfig, decode, encode};

const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const LOGS: TableDefinition<u64, &[u8]> = TableDefinition::new("logs");
const ARCHIVE: TableDefinition<u64, &[u8]> = TableDefinition::new("archive");
const SNAPSHOT: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshot");

const K_VOTE: &str = "vote";
const K_COMMITTED: &str = "committed";
const K_PURGED: &str = "last_purged";
const K_FLOOR: &str = "archive_floor";
const K_SNAP_META: &str = "meta";
const K_SNAP_DATA: &str = "data";

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

fn closed() -> io::Error {
    io::Error::new(io::ErrorKind::NotConnected, "log store is closed")
}

/// Shared storage handle (cheap to clone). Implements openraft's log storage traits and
/// keeps the snapshot and the archive.
#[derive(Clone)]
pub struct Store {
    inner: Arc<Inner>,
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
    /// Durable (fsync'd) commits made for appends, and their total time.
    pub durable_commits: u64,
    pub durable_commit_us: u64,
    /// Non-durable write transactions (appends, committed id, truncation).
    pub nondurable_commits: u64,
    /// `save_committed` calls and the time openraft's core spent in them.
    pub save_committed: u64,
    pub save_committed_us: u64,
    /// Log reads (replication, apply) and their total time.
    pub log_reads: u64,
    pub log_read_us: u64,
}

#[derive(Default)]
struct Counters {
    appends: AtomicU64,
    appended_entries: AtomicU64,
    append_us: AtomicU64,
    durable_commits: AtomicU64,
    durable_commit_us: AtomicU64,
    nondurable_commits: AtomicU64,
    save_committed: AtomicU64,
    save_committed_us: AtomicU64,
    log_reads: AtomicU64,
    log_read_us: AtomicU64,
}

fn add(c: &AtomicU64, v: u64) {
    c.fetch_add(v, Ordering::Relaxed);
}

fn us_since(t: Instant) -> u64 {
    t.elapsed().as_micros() as u64
}

struct Inner {
    counters: Counters,
    /// `None` once [`Store::close`] ran (the file is released for a restart in-process).
    db: RwLock<Option<Database>>,
    archive_retention: Option<u64>,
    flush_tx: std::sync::Mutex<Option<mpsc::Sender<IOFlushed<TypeConfig>>>>,
}

impl Store {
    /// Open (or create) `<dir>/log.redb` and start the flusher thread.
    pub(crate) fn open(dir: &Path, archive_retention: Option<u64>) -> Result<Self, LogError> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("log.redb");
        let db = Database::create(&path).map_err(|e| LogError::Storage(format!("{}: {e}", path.display())))?;
        {
            let txn = db.begin_write().map_err(redb::Error::from)?;
            txn.open_table(META).map_err(redb::Error::from)?;
            txn.open_table(LOGS).map_err(redb::Error::from)?;
            txn.open_table(ARCHIVE).map_err(redb::Error::from)?;
            txn.open_table(SNAPSHOT).map_err(redb::Error::from)?;
            txn.commit().map_err(redb::Error::from)?;
        }
        let (tx, rx) = mpsc::channel::<IOFlushed<TypeConfig>>();
        let inner = Arc::new(Inner {
            counters: Counters::default(),
            db: RwLock::new(Some(db)),
            archive_retention,
            flush_tx: std::sync::Mutex::new(Some(tx)),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new()
            .name("opendsec-log-flush".into())
            .spawn(move || flusher(weak, rx))?;
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
            durable_commits: g(&c.durable_commits),
            durable_commit_us: g(&c.durable_commit_us),
            nondurable_commits: g(&c.nondurable_commits),
            save_committed: g(&c.save_committed),
            save_committed_us: g(&c.save_committed_us),
            log_reads: g(&c.log_reads),
            log_read_us: g(&c.log_read_us),
        }
    }

    /// Release the database file (after the Raft node stopped). Further operations fail.
    pub(crate) fn close(&self) {
        if let Ok(mut g) = self.inner.flush_tx.lock() {
            g.take();
        }
        // Make the last non-durable commits (committed id, truncation) durable.
        if let Err(e) = self.write(Durability::Immediate, |_| Ok(())) {
            tracing::debug!("final flush on close: {e}");
        }
        if let Ok(mut g) = self.inner.db.write() {
            g.take();
        }
    }

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

    /// Same as [`Self::write`], off the async executor.
    async fn write_blocking<R: Send + 'static>(
        &self,
        durability: Durability,
        f: impl FnOnce(&redb::WriteTransaction) -> Result<R, redb::Error> + Send + 'static,
    ) -> io::Result<R> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.write(durability, f))
            .await
            .map_err(io_err)?
    }

    fn get_meta<T: serde::de::DeserializeOwned>(&self, key: &str) -> io::Result<Option<T>> {
        let bytes = self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(META)?;
            Ok(t.get(key)?.map(|v| v.value().to_vec()))
        })?;
        bytes.map(|b| decode(&b)).transpose()
    }

    async fn put_meta<T: serde::Serialize>(&self, key: &'static str, v: &T, d: Durability) -> io::Result<()> {
        let bytes = encode(v)?;
        self.write_blocking(d, move |txn| {
            txn.open_table(META)?.insert(key, bytes.as_slice())?;
            Ok(())
        })
        .await
    }

    // ---------------------------------------------------------------- snapshot

    /// Durably store a snapshot, replacing the previous one.
    pub(crate) async fn save_snapshot(&self, meta: &SnapshotMeta, data: Vec<u8>) -> io::Result<()> {
        let meta = encode(meta)?;
        self.write_blocking(Durability::Immediate, move |txn| {
            let mut t = txn.open_table(SNAPSHOT)?;
            t.insert(K_SNAP_META, meta.as_slice())?;
            t.insert(K_SNAP_DATA, data.as_slice())?;
            Ok(())
        })
        .await
    }

    /// The stored snapshot's metadata, if any.
    pub(crate) fn snapshot_meta(&self) -> io::Result<Option<SnapshotMeta>> {
        let b = self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(SNAPSHOT)?;
            Ok(t.get(K_SNAP_META)?.map(|v| v.value().to_vec()))
        })?;
        b.map(|b| decode(&b)).transpose()
    }

    /// The stored snapshot (metadata and application bytes), if any.
    pub(crate) fn load_snapshot(&self) -> io::Result<Option<(SnapshotMeta, Vec<u8>)>> {
        let r = self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(SNAPSHOT)?;
            let m = t.get(K_SNAP_META)?.map(|v| v.value().to_vec());
            let d = t.get(K_SNAP_DATA)?.map(|v| v.value().to_vec());
            Ok(m.zip(d))
        })?;
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
        let (archived, live) = self.with_db(|db| {
            let txn = db.begin_read()?;
            let mut archived = Vec::new();
            for kv in txn.open_table(ARCHIVE)?.range(from..=to)? {
                let (k, v) = kv?;
                archived.push((k.value(), v.value().to_vec()));
            }
            let mut live = Vec::new();
            for kv in txn.open_table(LOGS)?.range(from..=to)? {
                let (_, v) = kv?;
                live.push(v.value().to_vec());
            }
            Ok((archived, live))
        })?;
        let mut out = archived;
        let mut last = out.last().map(|(i, _)| *i);
        for b in live {
            let e: Entry = decode(&b)?;
            if let EntryPayload::Normal(p) = e.payload {
                let idx = e.log_id.index();
                if last.is_none_or(|l| idx > l) {
                    out.push((idx, p.0));
                    last = Some(idx);
                }
            }
        }
        Ok(out)
    }

    fn purge_sync(&self, upto: LogId) -> io::Result<()> {
        let retention = self.inner.archive_retention;
        let purged_bytes = encode(&upto)?;
        let upto_idx = upto.index();
        let prev: Option<LogId> = self.get_meta(K_PURGED)?;
        let mut expected = prev.map(|l| l.index() + 1).unwrap_or(0);
        self.write(Durability::Immediate, move |txn| {
            let mut meta = txn.open_table(META)?;
            let mut floor: u64 = match meta.get(K_FLOOR)? {
                Some(v) => postcard::from_bytes(v.value()).unwrap_or(0),
                None => 0,
            };
            let mut logs = txn.open_table(LOGS)?;
            let mut archive = txn.open_table(ARCHIVE)?;
            let mut moved = Vec::new();
            for kv in logs.range(..=upto_idx)? {
                let (k, v) = kv?;
                moved.push((k.value(), v.value().to_vec()));
            }
            for (idx, bytes) in &moved {
                if *idx != expected {
                    // A hole (entries this node never stored, e.g. it installed a snapshot):
                    // history is complete only from here on.
                    floor = floor.max(*idx);
                }
                expected = idx + 1;
                let e: Entry = postcard::from_bytes(bytes)
                    .map_err(|e| redb::Error::Corrupted(format!("log entry {idx}: {e}")))?;
                if let EntryPayload::Normal(p) = &e.payload {
                    archive.insert(*idx, p.0.as_slice())?;
                }
                logs.remove(*idx)?;
            }
            if expected <= upto_idx {
                floor = floor.max(upto_idx + 1);
            }
            if let Some(keep) = retention {
                let n = archive.len()?;
                if n > keep {
                    for _ in 0..(n - keep) {
                        match archive.pop_first()? {
                            Some((k, _)) => floor = floor.max(k.value() + 1),
                            None => break,
                        }
                    }
                }
            }
            // Archived entries below the floor can never be served contiguously: drop them.
            archive.retain_in(..floor, |_, _| false)?;
            let floor_bytes = postcard::to_stdvec(&floor).map_err(|e| redb::Error::Corrupted(e.to_string()))?;
            meta.insert(K_FLOOR, floor_bytes.as_slice())?;
            meta.insert(K_PURGED, purged_bytes.as_slice())?;
            Ok(())
        })
    }
}

/// Group-commit loop: one durable commit covers every append queued before it.
fn flusher(inner: std::sync::Weak<Inner>, rx: mpsc::Receiver<IOFlushed<TypeConfig>>) {
    while let Ok(first) = rx.recv() {
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
        }
        let res: Result<(), String> = match inner.upgrade() {
            None => Err("log store is closed".into()),
            Some(inner) => {
                let store = Store { inner };
                let t = Instant::now();
                let r = store.write(Durability::Immediate, |_| Ok(())).map_err(|e| e.to_string());
                add(&store.inner.counters.durable_commits, 1);
                add(&store.inner.counters.durable_commit_us, us_since(t));
                r
            }
        };
        for cb in batch {
            cb.io_completed(res.clone().map_err(io::Error::other));
        }
    }
}

impl RaftLogReader<TypeConfig> for Store {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, io::Error> {
        let start = match range.start_bound() {
            Bound::Included(x) => *x,
            Bound::Excluded(x) => x.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(x) => Some(*x),
            Bound::Excluded(0) => return Ok(Vec::new()),
            Bound::Excluded(x) => Some(*x - 1),
            Bound::Unbounded => None,
        };
        if end.is_some_and(|e| e < start) {
            return Ok(Vec::new());
        }
        let t = Instant::now();
        let raw = self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(LOGS)?;
            let mut out = Vec::new();
            let it = match end {
                Some(e) => t.range(start..=e)?,
                None => t.range(start..)?,
            };
            for kv in it {
                let (_, v) = kv?;
                out.push(v.value().to_vec());
            }
            Ok(out)
        })?;
        let r = raw.iter().map(|b| decode(b)).collect();
        add(&self.inner.counters.log_reads, 1);
        add(&self.inner.counters.log_read_us, us_since(t));
        r
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        self.get_meta(K_VOTE)
    }
}

impl RaftLogStorage<TypeConfig> for Store {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let last = self.with_db(|db| {
            let txn = db.begin_read()?;
            let t = txn.open_table(LOGS)?;
            Ok(t.last()?.map(|(_, v)| v.value().to_vec()))
        })?;
        let last_purged_log_id: Option<LogId> = self.get_meta(K_PURGED)?;
        let last_log_id = match last {
            Some(b) => Some(decode::<Entry>(&b)?.log_id),
            None => last_purged_log_id,
        };
        Ok(LogState {
            last_purged_log_id,
            last_log_id,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote) -> Result<(), io::Error> {
        self.put_meta(K_VOTE, vote, Durability::Immediate).await
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        let t = Instant::now();
        let r = match committed {
            Some(c) => self.put_meta(K_COMMITTED, &c, Durability::None).await,
            None => Ok(()),
        };
        add(&self.inner.counters.save_committed, 1);
        add(&self.inner.counters.save_committed_us, us_since(t));
        add(&self.inner.counters.nondurable_commits, 1);
        r
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, io::Error> {
        self.get_meta(K_COMMITTED)
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<TypeConfig>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let t = Instant::now();
        let mut batch = Vec::new();
        for e in entries {
            batch.push((e.log_id.index(), encode(&e)?));
        }
        add(&self.inner.counters.appends, 1);
        add(&self.inner.counters.appended_entries, batch.len() as u64);
        if !batch.is_empty() {
            add(&self.inner.counters.nondurable_commits, 1);
            self.write_blocking(Durability::None, move |txn| {
                let mut t = txn.open_table(LOGS)?;
                for (i, b) in &batch {
                    t.insert(*i, b.as_slice())?;
                }
                Ok(())
            })
            .await?;
        }
        let tx = self.inner.flush_tx.lock().map_err(io_err)?.clone();
        match tx {
            Some(tx) => {
                if let Err(mpsc::SendError(cb)) = tx.send(callback) {
                    cb.io_completed(Err(closed()));
                }
            }
            None => callback.io_completed(Err(closed())),
        }
        add(&self.inner.counters.append_us, us_since(t));
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let from = last_log_id.map(|l| l.index() + 1).unwrap_or(0);
        self.write_blocking(Durability::None, move |txn| {
            txn.open_table(LOGS)?.retain_in(from.., |_, _| false)?;
            Ok(())
        })
        .await
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.purge_sync(log_id))
            .await
            .map_err(io_err)?
    }
}
