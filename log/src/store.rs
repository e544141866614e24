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

use std::collections::VecDeque;
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, mpsc};
use std::time::{Duration, Instant};

use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use openraft::{EntryPayload, OptionalSend, RaftLogReader};
use redb::{Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};
use tokio::sync::oneshot;

use crate::journal::{self, Journal};
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

/// The newest entries of the log, contiguous: `entries[k]` has index `first + k` and the
/// last one is the last entry of the log. Those with index `<= written` are in a committed
/// redb transaction; the others exist only here (and in the writer's queue).
#[derive(Default)]
struct Tail {
    first: u64,
    entries: VecDeque<(Entry, usize)>,
    bytes: usize,
    written: Option<u64>,
}

impl Tail {
    fn last(&self) -> Option<&Entry> {
        self.entries.back().map(|(e, _)| e)
    }

    fn last_index(&self) -> Option<u64> {
        self.last().map(|e| e.log_id.index())
    }

    /// Drop every entry with index `>= from`.
    fn truncate_from(&mut self, from: u64) {
        while self.last_index().is_some_and(|l| l >= from) {
            if let Some((_, n)) = self.entries.pop_back() {
                self.bytes -= n;
            }
        }
        if self.written.is_some_and(|w| w >= from) {
            self.written = from.checked_sub(1);
        }
    }

    fn push(&mut self, e: Entry, n: usize) {
        let idx = e.log_id.index();
        match self.last_index() {
            Some(l) if idx == l + 1 => {}
            // Overwriting (openraft truncates first; be safe anyway).
            Some(_) if idx >= self.first && self.last_index().is_some_and(|l| idx <= l) => self.truncate_from(idx),
            // Not contiguous with the tail (e.g. after a snapshot install): start afresh.
            Some(_) => {
                self.entries.clear();
                self.bytes = 0;
            }
            None => {}
        }
        if self.entries.is_empty() {
            self.first = idx;
        }
        if self.written.is_some_and(|w| w >= idx) {
            self.written = idx.checked_sub(1);
        }
        self.entries.push_back((e, n));
        self.bytes += n;
    }

    /// Entries up to `last` are in a committed transaction.
    fn mark_written(&mut self, last: &LogId) {
        let idx = last.index();
        let same = idx >= self.first
            && self
                .entries
                .get((idx - self.first) as usize)
                .is_some_and(|(e, _)| e.log_id == *last);
        if same && self.written.is_none_or(|w| w < idx) {
            self.written = Some(idx);
        }
    }

    /// Forget entries `<= upto` (purged: they are in redb's archive now).
    fn drop_upto(&mut self, upto: u64) {
        while self.entries.front().is_some_and(|(e, _)| e.log_id.index() <= upto) {
            if let Some((_, n)) = self.entries.pop_front() {
                self.bytes -= n;
                self.first += 1;
            }
        }
    }

    /// Keep the tail within `budget` bytes, dropping only written entries.
    fn evict(&mut self, budget: usize) {
        while self.bytes > budget {
            let Some((e, _)) = self.entries.front() else { break };
            if self.written.is_none_or(|w| e.log_id.index() > w) {
                break;
            }
            if let Some((_, n)) = self.entries.pop_front() {
                self.bytes -= n;
                self.first += 1;
            }
        }
    }

    /// The tail's first index (if any) and clones of its entries in `start..=end`.
    fn range(&self, start: u64, end: Option<u64>) -> (Option<u64>, Vec<Entry>) {
        let Some(last) = self.last_index() else {
            return (None, Vec::new());
        };
        let hi = end.map_or(last, |e| e.min(last));
        let lo = start.max(self.first);
        let out = if lo <= hi {
            self.entries
                .range((lo - self.first) as usize..=(hi - self.first) as usize)
                .map(|(e, _)| e.clone())
                .collect()
        } else {
            Vec::new()
        };
        (Some(self.first), out)
    }
}

/// One operation for the writer thread.
enum Op {
    Append {
        entries: Vec<(u64, Vec<u8>)>,
        last: Option<LogId>,
        callback: IOFlushed<TypeConfig>,
    },
    Truncate {
        from: u64,
        done: oneshot::Sender<io::Result<()>>,
    },
    Vote {
        bytes: Vec<u8>,
        done: oneshot::Sender<io::Result<()>>,
    },
    Committed {
        bytes: Vec<u8>,
    },
    Purge {
        upto: LogId,
        done: oneshot::Sender<io::Result<()>>,
    },
}

impl Op {
    fn fail(self, e: &str) {
        let err = || io::Error::other(e.to_string());
        match self {
            Op::Append { callback, .. } => callback.io_completed(Err(err())),
            Op::Truncate { done, .. } | Op::Vote { done, .. } | Op::Purge { done, .. } => {
                let _ = done.send(Err(err()));
            }
            Op::Committed { .. } => {}
        }
    }
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
}

/// The writer thread's queue: its channel (`None` once closed), and a leader's appends held
/// back until the core's task yields (see `Store::enqueue`).
struct Queue {
    tx: Option<mpsc::Sender<Op>>,
    held: Vec<Op>,
    release_scheduled: bool,
}

impl Queue {
    /// Hands the held operations to the writer, in order.
    fn release(&mut self) {
        for op in self.held.drain(..) {
            match &self.tx {
                Some(tx) => {
                    if let Err(mpsc::SendError(op)) = tx.send(op) {
                        op.fail("log store is closed");
                    }
                }
                None => op.fail("log store is closed"),
            }
        }
    }
}

/// When an append may commit on the caller's thread (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Inline {
    Off = 0,
    /// The cluster's only member.
    Lone = 1,
    /// A follower.
    Follower = 2,
}

/// Operations queued and not yet taken by the writer, and whether a batch is being
/// written (by the writer, or inline by an append). An append runs inline only when
/// neither: then nothing queued before it can be committed after it.
#[derive(Default)]
struct Flow {
    queued: usize,
    busy: bool,
}

/// Waits until no batch is being written, then marks one: released (and waiters woken)
/// when dropped.
struct Busy<'a>(&'a (Mutex<Flow>, Condvar));

impl<'a> Busy<'a> {
    fn wait(flow: &'a (Mutex<Flow>, Condvar), taken: usize) -> Self {
        let mut f = lock(&flow.0);
        while f.busy {
            f = flow.1.wait(f).unwrap_or_else(|e| e.into_inner());
        }
        f.busy = true;
        f.queued = f.queued.saturating_sub(taken);
        Busy(flow)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        lock(&self.0.0).busy = false;
        self.0.1.notify_all();
    }
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
                for (index, bytes) in &records {
                    let e: Entry = decode(bytes)?;
                    if e.log_id.index() != *index {
                        return Err(LogError::Storage(format!(
                            "journal record {index} holds entry {}",
                            e.log_id.index()
                        )));
                    }
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

    /// Queue `op` for the writer; fails it at once if the store is closed.
    fn send(&self, op: Op) {
        self.enqueue(op, false);
    }

    /// Queue `op` for the writer, after what is held back. With `hold`, the writer is not
    /// woken now but once the calling task yields: a leader's core appends an entry before
    /// it hands it to replication, and the writer woken at once takes the core's CPU for
    /// its transaction (on a busy host the scheduler runs it on the waker's core), so the
    /// followers would get the entry only after that. Held, the entry goes out to the
    /// followers first and the leader's own write follows a moment later; it is not on
    /// the critical path (the followers' round trip is longer). Operations that are not
    /// held release what is, so the order holds.
    fn enqueue(&self, op: Op, hold: bool) {
        let mut q = lock(&self.inner.queue);
        let Some(tx) = q.tx.clone() else {
            op.fail("log store is closed");
            return;
        };
        // Counted before it is in the channel: the writer subtracts what it took. A
        // committed id is not counted: it covers only entries already durable, so an
        // inline append may be committed before it.
        let counted = !matches!(op, Op::Committed { .. });
        if counted {
            lock(&self.inner.flow.0).queued += 1;
        }
        if hold {
            q.held.push(op);
            if !q.release_scheduled {
                q.release_scheduled = true;
                let this = self.clone();
                tokio::spawn(async move {
                    tokio::task::yield_now().await;
                    let mut q = lock(&this.inner.queue);
                    q.release_scheduled = false;
                    q.release();
                });
            }
            return;
        }
        q.release();
        if let Err(mpsc::SendError(op)) = tx.send(op) {
            if counted {
                let mut f = lock(&self.inner.flow.0);
                f.queued = f.queued.saturating_sub(1);
            }
            op.fail("log store is closed");
        }
    }

    /// When appends may commit on the caller's thread (see the module doc). Off by default.
    pub(crate) fn set_inline(&self, mode: Inline) {
        if self.inner.inline.swap(mode as u8, Ordering::Relaxed) != mode as u8 {
            tracing::info!(?mode, "log: when appends commit inline");
        }
    }

    fn inline_mode(&self) -> Inline {
        match self.inner.inline.load(Ordering::Relaxed) {
            1 => Inline::Lone,
            2 => Inline::Follower,
            _ => Inline::Off,
        }
    }

    /// Commits `op` (an append) on this thread if inline appends are on, the runtime can
    /// lend this thread, and the writer is idle with nothing queued; else gives it back.
    fn try_inline(&self, op: Op) -> Option<Op> {
        // One entry: a write with no other in flight. Batches of several mean concurrent
        // writes, and those are served better by the writer: the core goes on collecting
        // the next batch while this one's fsync runs.
        let single = matches!(&op, Op::Append { entries, .. } if entries.len() == 1);
        let mode = self.inline_mode();
        if !single || mode == Inline::Off || lock(&self.inner.queue).tx.is_none() {
            return Some(op);
        }
        let Some(workers) = tokio::runtime::Handle::try_current()
            .ok()
            .filter(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
            .map(|h| h.metrics().num_workers())
        else {
            return Some(op);
        };
        let now = self.inner.opened.elapsed().as_micros() as u64;
        let before = self.inner.last_single_us.swap(now, Ordering::Relaxed);
        if workers < 2 && now.saturating_sub(before) < SPARSE_AFTER_US {
            return Some(op);
        }
        let flow = &*self.inner.flow;
        {
            let mut f = lock(&flow.0);
            let wait = match mode {
                // A flush the core has not handled yet (it commits what it flushed, at
                // once, on a lone node) would wait for this fsync: leave this one to the
                // writer.
                Inline::Lone => {
                    self.inner.flushed_upto.load(Ordering::Relaxed) > self.inner.committed_upto.load(Ordering::Relaxed)
                }
                // Right after an inline batch: this one waited for it in the core's queue.
                _ => now.saturating_sub(self.inner.inline_end_us.load(Ordering::Relaxed)) < QUEUED_WITHIN_US,
            };
            if f.busy || f.queued > 0 || wait {
                return Some(op);
            }
            f.busy = true;
        }
        let _busy = Busy(flow);
        // A lone node's committed id rides along at most every COMMITTED_EVERY (it costs a
        // page); a follower's goes to the writer as usual.
        let committed = if mode != Inline::Lone {
            None
        } else {
            let mut at = lock(&self.inner.committed_inline_at);
            if at.elapsed() >= COMMITTED_EVERY {
                *at = Instant::now();
                lock(&self.inner.committed).take()
            } else {
                None
            }
        };
        // Blocking this worker thread for one fsync is the point: a lone write has nothing
        // else to do meanwhile (`block_in_place` would hand the worker to another thread,
        // which costs the wake-ups this saves); the runtime's other worker steals tasks.
        self.run_batch(vec![op], committed, &mut VecDeque::new());
        self.inner
            .inline_end_us
            .store(self.inner.opened.elapsed().as_micros() as u64, Ordering::Relaxed);
        add(&self.inner.counters.inline_appends, 1);
        None
    }

    /// Queue an operation that answers on `done`, and wait for the answer.
    async fn call(&self, op: impl FnOnce(oneshot::Sender<io::Result<()>>) -> Op) -> io::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.send(op(tx));
        rx.await.map_err(|_| closed())?
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

/// Move up to `limit` live entries `<= upto` to the archive (application payloads only) and
/// record the last one moved as purged (`upto` itself once none is left), inside the writer's
/// transaction. Returns whether the purge is complete, and the index purged through.
fn purge_in(
    txn: &redb::WriteTransaction,
    upto: &LogId,
    retention: Option<u64>,
    limit: usize,
) -> Result<(bool, u64), redb::Error> {
    let corrupted = |e: postcard::Error| redb::Error::Corrupted(e.to_string());
    let upto_idx = upto.index();
    let mut meta = txn.open_table(META)?;
    let prev: Option<LogId> = match meta.get(K_PURGED)? {
        Some(v) => Some(postcard::from_bytes(v.value()).map_err(corrupted)?),
        None => None,
    };
    let mut expected = prev.map(|l| l.index() + 1).unwrap_or(0);
    let mut floor: u64 = match meta.get(K_FLOOR)? {
        Some(v) => postcard::from_bytes(v.value()).unwrap_or(0),
        None => 0,
    };
    let mut logs = txn.open_table(LOGS)?;
    let mut archive = txn.open_table(ARCHIVE)?;
    let mut moved = Vec::new();
    for kv in logs.range(..=upto_idx)?.take(limit.max(1) + 1) {
        let (k, v) = kv?;
        moved.push((k.value(), v.value().to_vec()));
    }
    // One more than the limit was read to know whether this chunk finishes the purge.
    let done = moved.len() <= limit.max(1);
    moved.truncate(limit.max(1));
    let mut last_moved = None;
    for (idx, bytes) in &moved {
        if *idx != expected {
            // A hole (entries this node never stored, e.g. it installed a snapshot):
            // history is complete only from here on.
            floor = floor.max(*idx);
        }
        expected = idx + 1;
        let e: Entry =
            postcard::from_bytes(bytes).map_err(|e| redb::Error::Corrupted(format!("log entry {idx}: {e}")))?;
        if let EntryPayload::Normal(p) = &e.payload {
            archive.insert(*idx, p.0.as_slice())?;
        }
        logs.remove(*idx)?;
        last_moved = Some(e.log_id);
    }
    let purged = if done {
        if expected <= upto_idx {
            floor = floor.max(upto_idx + 1);
        }
        *upto
    } else {
        last_moved.unwrap_or(*upto)
    };
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
    let floor_bytes = postcard::to_stdvec(&floor).map_err(corrupted)?;
    let purged_bytes = postcard::to_stdvec(&purged).map_err(corrupted)?;
    meta.insert(K_FLOOR, floor_bytes.as_slice())?;
    meta.insert(K_PURGED, purged_bytes.as_slice())?;
    Ok((done, purged.index()))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The writer thread: every queued operation so far, in order, in one write transaction.
fn writer(inner: std::sync::Weak<Inner>, rx: mpsc::Receiver<Op>, flow: Arc<(Mutex<Flow>, Condvar)>) {
    // The newest committed id not yet written (it rides on a later transaction).
    let mut committed: Option<Vec<u8>> = None;
    let mut committed_written = Instant::now();
    // Purges in progress, one chunk per transaction (see `PURGE_CHUNK`).
    let mut purges: VecDeque<Purging> = VecDeque::new();
    loop {
        // Records in the journal: retire it once idle (so that a restart has little to
        // recover and redb holds the log durably).
        let journaled = inner.upgrade().is_some_and(|i| !lock(&i.journal).is_empty());
        let first = if !purges.is_empty() {
            match rx.try_recv() {
                Ok(op) => Some(op),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => break,
            }
        } else if committed.is_some() || journaled {
            match rx.recv_timeout(COMMITTED_EVERY) {
                Ok(op) => Some(op),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
        } else {
            match rx.recv() {
                Ok(op) => Some(op),
                Err(_) => break,
            }
        };
        let idle = first.is_none();
        let mut work = Vec::new();
        let mut take = |op: Op| match op {
            Op::Committed { bytes } => committed = Some(bytes),
            Op::Purge { upto, done } => purges.push_back(Purging { upto, done }),
            op => work.push(op),
        };
        let mut counted = 0;
        if let Some(op) = first {
            counted += !matches!(op, Op::Committed { .. }) as usize;
            take(op);
            let mut n = 1;
            while n < MAX_BATCH_OPS
                && let Ok(op) = rx.try_recv()
            {
                counted += !matches!(op, Op::Committed { .. }) as usize;
                take(op);
                n += 1;
            }
        }
        if work.is_empty() && purges.is_empty() && !idle {
            // Only a committed id: wait for something to ride on (or for idleness).
            continue;
        }
        // After an inline batch that may be running; none starts until this one is done.
        let _busy = Busy::wait(&flow, counted);
        match inner.upgrade() {
            Some(inner) => {
                let due = idle || committed_written.elapsed() >= COMMITTED_EVERY;
                // A lone node's id (see `save_committed`) rides along as the others do.
                let c = if due {
                    committed.take().or_else(|| lock(&inner.committed).take())
                } else {
                    None
                };
                if c.is_some() {
                    committed_written = Instant::now();
                }
                if work.is_empty() && purges.is_empty() && c.is_none() && !(idle && journaled) {
                    continue;
                }
                Store { inner }.run_batch(work, c, &mut purges)
            }
            None => {
                for op in work {
                    op.fail("log store is closed");
                }
                return;
            }
        }
    }
    if let Some(inner) = inner.upgrade() {
        let _busy = Busy::wait(&flow, 0);
        let lone = lock(&inner.committed).take();
        let store = Store { inner };
        while !purges.is_empty() {
            store.run_batch(Vec::new(), None, &mut purges);
        }
        if let Some(c) = committed.or(lone) {
            store.run_batch(Vec::new(), Some(c), &mut purges);
        }
    } else {
        for p in purges {
            let _ = p.done.send(Err(closed()));
        }
    }
}

/// A purge the writer is working through.
struct Purging {
    upto: LogId,
    done: oneshot::Sender<io::Result<()>>,
}

/// `slot`'s table in `txn`, opened the first time it is needed.
fn opened<'s, 't, K: redb::Key + 'static, V: redb::Value + 'static>(
    slot: &'s mut Option<redb::Table<'t, K, V>>,
    txn: &'t redb::WriteTransaction,
    table: TableDefinition<K, V>,
) -> Result<&'s mut redb::Table<'t, K, V>, redb::Error> {
    match slot {
        Some(t) => Ok(t),
        None => Ok(slot.insert(txn.open_table(table)?)),
    }
}

impl Store {
    /// A batch of appends only that fits in the journal: one journal write, no redb
    /// transaction (the entries stay in the tail and in `Journal::pending` until the
    /// journal is retired). Anything else: one durable write transaction with what the
    /// journal holds, then `work` in order, the committed id and one chunk of the oldest
    /// purge in progress; it retires the journal. Then the tail is updated and every
    /// finished operation answered.
    fn run_batch(&self, mut work: Vec<Op>, committed: Option<Vec<u8>>, purges: &mut VecDeque<Purging>) {
        let retention = self.inner.archive_retention;
        let purge = purges.front().map(|p| p.upto);
        let c = &self.inner.counters;
        let mut journal = lock(&self.inner.journal);
        let appends_only = purge.is_none() && !work.is_empty() && work.iter().all(|op| matches!(op, Op::Append { .. }));
        let journaled = appends_only && {
            let (records, bytes) = work.iter().fold((0, 0), |(r, b), op| match op {
                Op::Append { entries, .. } => (
                    r + entries.len(),
                    b + entries.iter().map(|(_, e)| e.len()).sum::<usize>(),
                ),
                _ => (r, b),
            });
            journal.fits(records, bytes)
        };
        // The newest entry that went into redb from the journal.
        let mut absorbed = None;
        let res: io::Result<Option<(bool, u64)>> = if journaled {
            let t = Instant::now();
            let records = work.iter().filter_map(|op| match op {
                Op::Append { entries, .. } => Some(entries.iter().map(|(i, b)| (*i, b.as_slice()))),
                _ => None,
            });
            let r = journal.append(records.flatten());
            add(&c.journal_syncs, 1);
            add(&c.journal_sync_us, us_since(t));
            if r.is_ok() {
                for op in &mut work {
                    if let Op::Append { entries, last, .. } = op {
                        journal.pending.append(entries);
                        if last.is_some() {
                            journal.pending_last = *last;
                        }
                    }
                }
                // The committed id waits for the next transaction (unless a newer one does).
                if let Some(bytes) = committed {
                    lock(&self.inner.committed).get_or_insert(bytes);
                }
            }
            r.map(|()| None)
        } else {
            let retiring = (!journal.is_empty()).then(|| journal.generation());
            let t = Instant::now();
            let res = self.write(Durability::Immediate, |txn| {
                {
                    let mut logs = None;
                    let mut meta = None;
                    for (i, b) in &journal.pending {
                        opened(&mut logs, txn, LOGS)?.insert(*i, b.as_slice())?;
                    }
                    for op in &work {
                        match op {
                            Op::Append { entries, .. } => {
                                for (i, b) in entries {
                                    opened(&mut logs, txn, LOGS)?.insert(*i, b.as_slice())?;
                                }
                            }
                            Op::Truncate { from, .. } => {
                                opened(&mut logs, txn, LOGS)?.retain_in(*from.., |_, _| false)?;
                            }
                            Op::Vote { bytes, .. } => {
                                opened(&mut meta, txn, META)?.insert(K_VOTE, bytes.as_slice())?;
                            }
                            Op::Purge { .. } | Op::Committed { .. } => {}
                        }
                    }
                    if let Some(c) = &committed {
                        opened(&mut meta, txn, META)?.insert(K_COMMITTED, c.as_slice())?;
                    }
                    if let Some(g) = retiring {
                        let bytes = postcard::to_stdvec(&g).map_err(|e| redb::Error::Corrupted(e.to_string()))?;
                        opened(&mut meta, txn, META)?.insert(K_JOURNAL_RETIRED, bytes.as_slice())?;
                    }
                }
                match &purge {
                    Some(upto) => Ok(Some(purge_in(txn, upto, retention, PURGE_CHUNK)?)),
                    None => Ok(None),
                }
            });
            add(&c.durable_commits, 1);
            add(&c.durable_commit_us, us_since(t));
            if res.is_ok() && retiring.is_some() {
                absorbed = journal.pending_last;
                journal.retired();
            }
            res
        };
        drop(journal);
        if let Ok(step) = &res {
            let mut tail = self.tail();
            if let Some(l) = &absorbed {
                tail.mark_written(l);
            }
            for op in &work {
                if let Op::Append { last: Some(last), .. } = op {
                    if !journaled {
                        tail.mark_written(last);
                    }
                    self.inner.flushed_upto.fetch_max(last.index() + 1, Ordering::Relaxed);
                }
            }
            if let Some((_, through)) = step {
                tail.drop_upto(*through);
            }
            tail.evict(self.inner.tail_bytes);
        }
        let err = res.as_ref().err().map(|e| e.to_string());
        let result = || match &err {
            None => Ok(()),
            Some(e) => Err(io::Error::other(e.clone())),
        };
        // A purge is answered when its last chunk is in, or at its first failure.
        if (matches!(res, Ok(Some((true, _)))) || (err.is_some() && purge.is_some()))
            && let Some(p) = purges.pop_front()
        {
            let _ = p.done.send(result());
        }
        // openraft's flush notification is a watermark (the newest flushed IO id): report only
        // the last append of the batch, so the core wakes once and commits (and applies) the
        // whole batch in one step instead of once per append.
        let last_notify = work.iter().rposition(|op| {
            matches!(
                op,
                Op::Append {
                    callback: IOFlushed::Notify(_),
                    ..
                }
            )
        });
        for (k, op) in work.into_iter().enumerate() {
            match op {
                Op::Append {
                    callback: IOFlushed::Notify(_),
                    ..
                } if err.is_none() && Some(k) != last_notify => {}
                Op::Append { callback, .. } => callback.io_completed(result()),
                Op::Truncate { done, .. } | Op::Vote { done, .. } | Op::Purge { done, .. } => {
                    let _ = done.send(result());
                }
                Op::Committed { .. } => {}
            }
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
        self.read_log(start, end)
    }

    async fn read_vote(&mut self) -> Result<Option<Vote>, io::Error> {
        self.get_meta(K_VOTE)
    }
}

impl RaftLogStorage<TypeConfig> for Store {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, io::Error> {
        let last_purged_log_id: Option<LogId> = self.get_meta(K_PURGED)?;
        let cached = self.tail().last().map(|e| e.log_id);
        let last_log_id = match cached {
            Some(l) => Some(l),
            None => {
                let last = self.with_db(|db| {
                    let txn = db.begin_read()?;
                    let t = txn.open_table(LOGS)?;
                    Ok(t.last()?.map(|(_, v)| v.value().to_vec()))
                })?;
                match last {
                    Some(b) => Some(decode::<Entry>(&b)?.log_id),
                    None => last_purged_log_id,
                }
            }
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
        let bytes = encode(vote)?;
        self.call(|done| Op::Vote { bytes, done }).await
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), io::Error> {
        let t = Instant::now();
        if let Some(c) = committed {
            let bytes = encode(&c)?;
            self.inner.committed_upto.fetch_max(c.index() + 1, Ordering::Relaxed);
            if self.inline_mode() == Inline::Lone {
                // A lone node's committed entries are all durable (its own flush made them
                // committed): the id rides on the next inline batch (or any batch, or the
                // last one at close) without waking the writer.
                *lock(&self.inner.committed) = Some(bytes);
            } else {
                self.send(Op::Committed { bytes });
            }
        }
        add(&self.inner.counters.save_committed, 1);
        add(&self.inner.counters.save_committed_us, us_since(t));
        Ok(())
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
        let mut encoded = Vec::new();
        let mut staged = Vec::new();
        for e in entries {
            let b = encode(&e)?;
            encoded.push((e.log_id.index(), b));
            staged.push(e);
        }
        let last = staged.last().map(|e| e.log_id);
        {
            let mut tail = self.tail();
            for (e, (_, b)) in staged.into_iter().zip(&encoded) {
                tail.push(e, b.len());
            }
        }
        add(&self.inner.counters.appends, 1);
        add(&self.inner.counters.appended_entries, encoded.len() as u64);
        let op = Op::Append {
            entries: encoded,
            last,
            callback,
        };
        if let Some(op) = self.try_inline(op) {
            // A leader's (see `enqueue`), when there is a runtime to release it.
            let hold = self.inline_mode() == Inline::Off && tokio::runtime::Handle::try_current().is_ok();
            self.enqueue(op, hold);
        }
        add(&self.inner.counters.append_us, us_since(t));
        Ok(())
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogId>) -> Result<(), io::Error> {
        let from = last_log_id.map(|l| l.index() + 1).unwrap_or(0);
        self.tail().truncate_from(from);
        self.call(|done| Op::Truncate { from, done }).await
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        self.call(|done| Op::Purge { upto: log_id, done }).await
    }
}

#[cfg(test)]
mod tests_support {
    use openraft::entry::RaftEntry;
    use openraft::type_config::TypeConfigExt;

    use super::*;
    use crate::Payload;

    pub type Lid = openraft::impls::leader_id_adv::LeaderId<u64, u64>;

    pub fn log_id(term: u64, index: u64) -> LogId {
        LogId::new(Lid { term, node_id: 1 }, index)
    }

    pub fn entry(term: u64, index: u64, len: usize) -> Entry {
        Entry::new_normal(log_id(term, index), Payload(vec![(index % 251) as u8; len]))
    }

    pub fn indexes(v: &[Entry]) -> Vec<(u64, u64)> {
        v.iter()
            .map(|e| (e.log_id.committed_leader_id().term, e.log_id.index()))
            .collect()
    }

    pub async fn append(
        store: &mut Store,
        entries: Vec<Entry>,
    ) -> openraft::type_config::alias::OneshotReceiverOf<TypeConfig, Result<(), io::Error>> {
        let (tx, rx) = TypeConfig::oneshot();
        store.append(entries, IOFlushed::signal(tx)).await.expect("append");
        rx
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::*;
    use super::*;

    #[tokio::test]
    async fn appends_are_readable_at_once_and_durable_once_flushed() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        let rx = append(&mut store, (1..=50).map(|i| entry(1, i, 100)).collect()).await;
        // Readable before the flush is reported (the tail).
        let got = store.try_get_log_entries(1..=50).await.unwrap();
        assert_eq!(got.len(), 50);
        rx.await.unwrap().expect("flushed");
        store.save_committed(Some(log_id(1, 40))).await.unwrap();
        store.save_vote(&Vote::new_committed(1, 1)).await.unwrap();
        store.close();
        drop(store);

        let mut store = Store::open(dir.path(), None).unwrap();
        let got = store.try_get_log_entries(..).await.unwrap();
        assert_eq!(indexes(&got), (1..=50).map(|i| (1, i)).collect::<Vec<_>>());
        assert_eq!(got[9].payload, entry(1, 10, 100).payload);
        assert_eq!(store.read_committed().await.unwrap(), Some(log_id(1, 40)));
        assert_eq!(store.read_vote().await.unwrap(), Some(Vote::new_committed(1, 1)));
        assert_eq!(store.get_log_state().await.unwrap().last_log_id, Some(log_id(1, 50)));
        store.close();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn inline_appends_are_flushed_when_append_returns_and_keep_order_with_queued_operations() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        // Off by default: the writer thread commits.
        let rx = append(&mut store, vec![entry(1, 1, 100)]).await;
        rx.await.unwrap().expect("flushed");
        assert_eq!(store.io_stats().inline_appends, 0);

        store.save_committed(Some(log_id(1, 1))).await.unwrap();
        // Let the writer finish on its own first (idle: it retires the journal with the
        // committed id), so that it is not busy when the inline appends below come.
        let quiet = Instant::now() + Duration::from_secs(10);
        while store.io_stats().durable_commits == 0 && Instant::now() < quiet {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            store.io_stats().durable_commits,
            1,
            "the idle writer retired the journal"
        );
        store.set_inline(Inline::Lone);
        for i in 2..=20 {
            let mut rx = append(&mut store, vec![entry(1, i, 100)]).await;
            // Committed by `append` itself: flushed already when it returns.
            assert!(matches!(rx.try_recv(), Ok(Ok(()))), "append {i} was not flushed inline");
            // What the core does with the flush (a lone node commits it at once).
            store.save_committed(Some(log_id(1, i))).await.unwrap();
        }
        assert_eq!(store.io_stats().inline_appends, 19);
        // A flush the core has not handled yet (not committed): the next append is the
        // writer's, so that flush's commit does not wait for another fsync.
        let rx = append(&mut store, vec![entry(1, 21, 100)]).await;
        rx.await.unwrap().expect("flushed");
        let rx = append(&mut store, vec![entry(1, 22, 100)]).await;
        rx.await.unwrap().expect("flushed");
        assert_eq!(
            store.io_stats().inline_appends,
            20,
            "only the first of the two was inline"
        );
        store.save_committed(Some(log_id(1, 22))).await.unwrap();
        // A batch of several entries (concurrent writes) goes to the writer.
        let rx = append(&mut store, vec![entry(1, 23, 100), entry(1, 24, 100)]).await;
        rx.await.unwrap().expect("flushed");
        assert_eq!(store.io_stats().inline_appends, 20);

        // While a batch is being written (held here as an inline batch would be), an append
        // is queued, and the writer commits it only once that batch is done.
        let flow = store.inner.flow.clone();
        let held = Busy::wait(&flow, 0);
        let mut rx = append(&mut store, vec![entry(1, 25, 100)]).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            rx.try_recv().is_err(),
            "the writer committed while another batch was being written"
        );
        drop(held);
        rx.await.unwrap().expect("flushed");
        assert_eq!(store.io_stats().inline_appends, 20);
        store.save_vote(&Vote::new_committed(2, 1)).await.unwrap();
        store.close();
        drop(store);
        let mut store = Store::open(dir.path(), None).unwrap();
        let got = store.try_get_log_entries(..).await.unwrap();
        assert_eq!(
            indexes(&got),
            (1..=25).map(|i| (1, i)).collect::<Vec<_>>(),
            "every append is durable"
        );
        assert_eq!(store.read_vote().await.unwrap(), Some(Vote::new_committed(2, 1)));
        store.close();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_followers_appends_commit_inline_only_when_they_come_far_apart() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        store.set_inline(Inline::Follower);
        // Far apart (100 ms, many fsyncs): each commits on the caller's thread.
        for i in 1..=5 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let mut rx = append(&mut store, vec![entry(1, i, 100)]).await;
            assert!(matches!(rx.try_recv(), Ok(Ok(()))), "append {i} was not flushed inline");
        }
        assert_eq!(store.io_stats().inline_appends, 5);
        // A follower's committed id goes to the writer, as without inline appends.
        store.save_committed(Some(log_id(1, 5))).await.unwrap();
        // Right after an inline one ended (as those queued behind it in the core come): to
        // the writer.
        let just_ended = || store.inner.opened.elapsed().as_micros() as u64;
        store.inner.inline_end_us.store(just_ended(), Ordering::Relaxed);
        let rx = append(&mut store, vec![entry(1, 6, 100)]).await;
        rx.await.unwrap().expect("flushed");
        assert_eq!(
            store.io_stats().inline_appends,
            5,
            "an append queued behind an inline one went inline too"
        );
        // A burst: whatever finds the writer busy queues, and the writer shares its fsyncs.
        let mut pending = Vec::new();
        for i in 7..=45 {
            pending.push(append(&mut store, vec![entry(1, i, 100)]).await);
        }
        for rx in pending {
            rx.await.unwrap().expect("flushed");
        }
        let s = store.io_stats();
        assert!(s.durable_commits < 5 + 40, "the writer shared no fsync: {s:?}");
        store.close();
        drop(store);
        let mut store = Store::open(dir.path(), None).unwrap();
        let got = store.try_get_log_entries(..).await.unwrap();
        assert_eq!(
            indexes(&got),
            (1..=45).map(|i| (1, i)).collect::<Vec<_>>(),
            "every append is durable"
        );
        assert_eq!(store.read_committed().await.unwrap(), Some(log_id(1, 5)));
        store.close();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn with_one_worker_thread_only_sparse_appends_commit_inline() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        store.set_inline(Inline::Follower);
        // One write at a time, far apart: inline, as with more workers.
        for i in 1..=3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
            let mut rx = append(&mut store, vec![entry(1, i, 100)]).await;
            assert!(matches!(rx.try_recv(), Ok(Ok(()))), "append {i} was not flushed inline");
        }
        // Appends close together (a busy node): an inline fsync would stall the only
        // worker, so each goes to the writer, even when it finds the writer idle.
        for i in 4..=10 {
            store
                .inner
                .last_single_us
                .store(store.inner.opened.elapsed().as_micros() as u64, Ordering::Relaxed);
            let rx = append(&mut store, vec![entry(1, i, 100)]).await;
            rx.await.unwrap().expect("flushed");
        }
        assert_eq!(
            store.io_stats().inline_appends,
            3,
            "a busy one-worker node committed inline"
        );
        let got = store.try_get_log_entries(..).await.unwrap();
        assert_eq!(indexes(&got), (1..=10).map(|i| (1, i)).collect::<Vec<_>>());
        store.close();
    }

    #[tokio::test]
    async fn inline_appends_need_a_multi_thread_runtime_and_fall_back_to_the_writer() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        store.set_inline(Inline::Lone);
        let rx = append(&mut store, vec![entry(1, 1, 100)]).await;
        rx.await.unwrap().expect("flushed");
        assert_eq!(
            store.io_stats().inline_appends,
            0,
            "a current-thread runtime cannot lend its thread"
        );
        store.close();
    }

    #[tokio::test]
    async fn a_leaders_append_reaches_the_writer_once_the_appending_task_yields() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        let written = |s: &Store| {
            let st = s.io_stats();
            st.durable_commits + st.journal_syncs
        };
        // Inline appends off (a leader): held while this task runs on without yielding.
        let rx = append(&mut store, vec![entry(1, 1, 100)]).await;
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(written(&store), 0, "the writer was woken before the task yielded");
        // Readable meanwhile: replication reads it from the tail.
        assert_eq!(store.try_get_log_entries(1..=1).await.unwrap().len(), 1);
        // An operation that is not held releases it first: the order holds.
        store.save_vote(&Vote::new_committed(1, 1)).await.unwrap();
        rx.await.unwrap().expect("flushed");
        // Yielding (here: awaiting the flush) releases it.
        let rx = append(&mut store, vec![entry(1, 2, 100)]).await;
        rx.await.unwrap().expect("flushed");
        store.close();
        let mut store = Store::open(dir.path(), None).unwrap();
        assert_eq!(
            indexes(&store.try_get_log_entries(..).await.unwrap()),
            vec![(1, 1), (1, 2)]
        );
        assert_eq!(store.read_vote().await.unwrap(), Some(Vote::new_committed(1, 1)));
        store.close();
    }

    /// What a crash of the process leaves: the files as they are now, in a new directory.
    fn crash_copy(from: &Path) -> tempfile::TempDir {
        let to = tempfile::tempdir().unwrap();
        for f in ["log.redb", journal::FILE] {
            std::fs::copy(from.join(f), to.path().join(f)).unwrap();
        }
        to
    }

    async fn flushed(store: &mut Store, entries: Vec<Entry>) {
        append(store, entries).await.await.unwrap().expect("flushed");
    }

    #[tokio::test]
    async fn appends_are_durable_in_the_journal_before_redb_holds_them_durably() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        flushed(&mut store, (1..=10).map(|i| entry(1, i, 100)).collect()).await;
        flushed(&mut store, vec![entry(1, 11, 100)]).await;
        flushed(&mut store, (12..=30).map(|i| entry(1, i, 100)).collect()).await;
        let crashed = crash_copy(dir.path());
        let s = store.io_stats();
        assert_eq!(
            (s.durable_commits, s.journal_syncs),
            (0, 3),
            "three journal writes and no redb commit"
        );

        let mut again = Store::open(crashed.path(), None).unwrap();
        let got = again.try_get_log_entries(..).await.unwrap();
        assert_eq!(
            indexes(&got),
            (1..=30).map(|i| (1, i)).collect::<Vec<_>>(),
            "every flushed append survives"
        );
        assert_eq!(got[20].payload, entry(1, 21, 100).payload);
        assert_eq!(again.get_log_state().await.unwrap().last_log_id, Some(log_id(1, 30)));
        // Recovery retired that journal: a second crash right away finds the same log.
        let twice = crash_copy(crashed.path());
        let mut third = Store::open(twice.path(), None).unwrap();
        assert_eq!(third.try_get_log_entries(..).await.unwrap().len(), 30);
        for s in [store, again, third] {
            s.close();
        }
    }

    #[tokio::test]
    async fn a_truncation_commits_durably_and_retires_the_journal_so_truncated_entries_never_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        flushed(&mut store, (1..=10).map(|i| entry(1, i, 100)).collect()).await;
        store.truncate_after(Some(log_id(1, 5))).await.unwrap();
        assert_eq!(store.io_stats().durable_commits, 1);
        flushed(&mut store, vec![entry(2, 6, 100), entry(2, 7, 100)]).await;
        let crashed = crash_copy(dir.path());
        assert_eq!(
            store.io_stats().durable_commits,
            1,
            "the new entries are in the journal only"
        );

        let mut again = Store::open(crashed.path(), None).unwrap();
        let want: Vec<_> = (1..=5).map(|i| (1, i)).chain([(2, 6), (2, 7)]).collect();
        assert_eq!(indexes(&again.try_get_log_entries(..).await.unwrap()), want);
        store.close();
        again.close();
    }

    #[tokio::test]
    async fn a_torn_journal_write_loses_only_itself_and_the_journal_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        let mut end = 0;
        for i in 1..=3 {
            flushed(&mut store, vec![entry(1, i, 100)]).await;
            end += journal::HEADER + encode(&entry(1, i, 100)).unwrap().len();
        }
        let crashed = crash_copy(dir.path());
        store.close();
        // The third record's last byte never reached the disk.
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(crashed.path().join(journal::FILE))
                .unwrap();
            f.write_all_at(&[0xff], (end - 1) as u64).unwrap();
        }
        let mut again = Store::open(crashed.path(), None).unwrap();
        assert_eq!(
            indexes(&again.try_get_log_entries(..).await.unwrap()),
            vec![(1, 1), (1, 2)]
        );
        flushed(&mut again, vec![entry(2, 3, 50)]).await;
        flushed(&mut again, vec![entry(2, 4, 50)]).await;
        let twice = crash_copy(crashed.path());
        let mut third = Store::open(twice.path(), None).unwrap();
        assert_eq!(
            indexes(&third.try_get_log_entries(..).await.unwrap()),
            vec![(1, 1), (1, 2), (2, 3), (2, 4)]
        );
        again.close();
        third.close();
    }

    #[tokio::test]
    async fn a_batch_that_does_not_fit_the_journal_commits_durably_and_retires_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open_with(dir.path(), None, TAIL_BYTES, 2048).unwrap();
        for i in 1..=20 {
            flushed(&mut store, vec![entry(1, i, 200)]).await;
        }
        let s = store.io_stats();
        assert!(s.durable_commits >= 2 && s.journal_syncs >= 10, "{s:?}");
        assert_eq!(s.durable_commits + s.journal_syncs, 20);
        let crashed = crash_copy(dir.path());
        let mut again = Store::open_with(crashed.path(), None, TAIL_BYTES, 2048).unwrap();
        assert_eq!(
            indexes(&again.try_get_log_entries(..).await.unwrap()),
            (1..=20).map(|i| (1, i)).collect::<Vec<_>>()
        );
        store.close();
        again.close();
    }

    #[derive(Clone, Debug)]
    enum Step {
        /// Append this many entries (one batch) and wait until flushed.
        Append(u64),
        /// Truncate after the entry this far from the end (1: drop the last).
        Truncate(u64),
        Vote,
        /// Purge (archive) the first this many live entries.
        Purge(u64),
        /// Copy the files as they are, open the copy and go on there.
        Crash,
    }

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        prop_oneof![
            4 => (1u64..6).prop_map(Step::Append),
            1 => (1u64..4).prop_map(Step::Truncate),
            1 => Just(Step::Vote),
            1 => (1u64..8).prop_map(Step::Purge),
            2 => Just(Step::Crash),
        ]
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 24, ..Default::default() })]
        /// Whatever mix of appends, truncations, votes and purges (with a small journal,
        /// so that batches also go to durable commits, and a small tail, so that reads go
        /// to redb), the log reads back as written after every step, and a crash at any
        /// point keeps exactly the flushed log: nothing acknowledged is lost and nothing
        /// truncated comes back.
        #[test]
        fn a_crash_at_any_point_keeps_exactly_the_flushed_log(steps in proptest::collection::vec(step(), 1..40)) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async move {
                const CAP: u64 = 1500;
                const TAIL: usize = 600;
                let mut dir = tempfile::tempdir().unwrap();
                let mut store = Store::open_with(dir.path(), None, TAIL, CAP).unwrap();
                // The live log (after the purged part) and the last purged id.
                let mut live: Vec<(u64, u64)> = Vec::new();
                let mut purged: Option<LogId> = None;
                let mut term = 1;
                let mut voted = None;
                for s in steps {
                    match s {
                        Step::Append(n) => {
                            let next = live.last().map(|(_, i)| i + 1).or(purged.map(|p| p.index() + 1)).unwrap_or(1);
                            let batch: Vec<Entry> = (next..next + n).map(|i| entry(term, i, 90)).collect();
                            live.extend(batch.iter().map(|e| (term, e.log_id.index())));
                            flushed(&mut store, batch).await;
                        }
                        Step::Truncate(k) => {
                            let keep = live.len().saturating_sub(k as usize);
                            live.truncate(keep);
                            let after = live.last().map(|(t, i)| log_id(*t, *i)).or(purged);
                            store.truncate_after(after).await.unwrap();
                            // A new leader's entries follow a truncation.
                            term += 1;
                        }
                        Step::Vote => {
                            let v = Vote::new_committed(term, 1);
                            store.save_vote(&v).await.unwrap();
                            voted = Some(v);
                        }
                        Step::Purge(k) => {
                            let k = (k as usize).min(live.len());
                            if k > 0 {
                                let (t, i) = live[k - 1];
                                live.drain(..k);
                                purged = Some(log_id(t, i));
                                store.purge(log_id(t, i)).await.unwrap();
                            }
                        }
                        Step::Crash => {
                            let copy = crash_copy(dir.path());
                            store.close();
                            dir = copy;
                            store = Store::open_with(dir.path(), None, TAIL, CAP).unwrap();
                            assert_eq!(store.read_vote().await.unwrap(), voted);
                            assert_eq!(store.get_log_state().await.unwrap().last_purged_log_id, purged);
                        }
                    }
                    let got = store.try_get_log_entries(..).await.unwrap();
                    assert_eq!(indexes(&got), live, "the log after {s:?}");
                }
                store.close();
            });
        }
    }

    #[tokio::test]
    async fn an_idle_writer_retires_the_journal() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        flushed(&mut store, (1..=5).map(|i| entry(1, i, 100)).collect()).await;
        assert_eq!(store.io_stats().durable_commits, 0);
        tokio::time::sleep(COMMITTED_EVERY * 4).await;
        assert_eq!(store.io_stats().durable_commits, 1, "one durable commit once idle");
        assert!(lock(&store.inner.journal).is_empty());
        store.close();
    }

    #[tokio::test]
    async fn reads_span_redb_and_the_tail_after_eviction() {
        let dir = tempfile::tempdir().unwrap();
        // A budget of ~10 entries: most written entries leave the tail. A journal of ~30:
        // every other batch goes to redb with the one before it.
        let mut store = Store::open_with(dir.path(), None, 10 * 1100, 30 * 1100).unwrap();
        for chunk in 0..10u64 {
            let rx = append(&mut store, (1..=20).map(|i| entry(1, chunk * 20 + i, 1000)).collect()).await;
            rx.await.unwrap().expect("flushed");
        }
        {
            let tail = store.tail();
            assert!(tail.entries.len() < 30, "tail kept {} entries", tail.entries.len());
            assert_eq!(tail.last_index(), Some(200));
        }
        for (a, b) in [(1, 200), (150, 200), (185, 195), (1, 5), (199, 250)] {
            let got = store.try_get_log_entries(a..=b).await.unwrap();
            assert_eq!(
                indexes(&got),
                (a..=b.min(200)).map(|i| (1, i)).collect::<Vec<_>>(),
                "range {a}..={b}"
            );
        }
        assert_eq!(store.try_get_log_entries(180..).await.unwrap().len(), 21);
        let payloads = store.read_entries(190, 200).unwrap();
        assert_eq!(
            payloads.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            (190..=200).collect::<Vec<_>>()
        );
        store.close();
    }

    #[tokio::test]
    async fn truncation_hides_entries_at_once_and_new_ones_replace_them() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        let rx = append(&mut store, (1..=10).map(|i| entry(1, i, 10)).collect()).await;
        rx.await.unwrap().unwrap();
        // Not yet flushed appends, then a truncation in the middle of them.
        drop(append(&mut store, (11..=15).map(|i| entry(1, i, 10)).collect()).await);
        store.truncate_after(Some(log_id(1, 7))).await.unwrap();
        assert_eq!(
            indexes(&store.try_get_log_entries(1..=20).await.unwrap()),
            (1..=7).map(|i| (1, i)).collect::<Vec<_>>()
        );
        let rx = append(&mut store, (8..=9).map(|i| entry(2, i, 10)).collect()).await;
        rx.await.unwrap().unwrap();
        let want: Vec<_> = (1..=7).map(|i| (1, i)).chain([(2, 8), (2, 9)]).collect();
        assert_eq!(indexes(&store.try_get_log_entries(..).await.unwrap()), want);
        store.close();
        drop(store);
        let mut store = Store::open(dir.path(), None).unwrap();
        assert_eq!(indexes(&store.try_get_log_entries(..).await.unwrap()), want);
        assert_eq!(store.get_log_state().await.unwrap().last_log_id, Some(log_id(2, 9)));
        store.close();
    }

    #[tokio::test]
    async fn purge_archives_in_order_with_pending_appends() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        drop(append(&mut store, (1..=30).map(|i| entry(1, i, 10)).collect()).await);
        // Queued behind the (maybe unwritten) appends: it still finds them.
        store.purge(log_id(1, 20)).await.unwrap();
        assert_eq!(store.archived_count().unwrap(), 20);
        assert_eq!(store.live_count().unwrap(), 10);
        assert_eq!(store.tail().entries.front().map(|(e, _)| e.log_id.index()), Some(21));
        let all = store.read_entries(1, 30).unwrap();
        assert_eq!(
            all.iter().map(|(i, _)| *i).collect::<Vec<_>>(),
            (1..=30).collect::<Vec<_>>()
        );
        let st = store.get_log_state().await.unwrap();
        assert_eq!(
            (st.last_purged_log_id, st.last_log_id),
            (Some(log_id(1, 20)), Some(log_id(1, 30)))
        );
        store.close();
    }

    #[tokio::test]
    async fn appends_are_flushed_between_the_chunks_of_a_purge() {
        let dir = tempfile::tempdir().unwrap();
        let mut store = Store::open(dir.path(), None).unwrap();
        let n = 5 * PURGE_CHUNK as u64;
        let rx = append(&mut store, (1..=n).map(|i| entry(1, i, 50)).collect()).await;
        rx.await.unwrap().unwrap();
        let mut s2 = store.clone();
        let upto = n - 100;
        let purge = tokio::spawn(async move { s2.purge(log_id(1, upto)).await });
        let mut i = n + 1;
        let mut flushed_during = 0;
        while !purge.is_finished() {
            let rx = append(&mut store, vec![entry(1, i, 50)]).await;
            rx.await.unwrap().unwrap();
            flushed_during += u64::from(!purge.is_finished());
            i += 1;
        }
        purge.await.unwrap().unwrap();
        assert!(flushed_during >= 1, "no append was flushed while the purge ran");
        let st = store.get_log_state().await.unwrap();
        assert_eq!(st.last_purged_log_id, Some(log_id(1, upto)));
        assert_eq!(store.archived_count().unwrap(), upto);
        let all = store.read_entries(1, i - 1).unwrap();
        assert_eq!(
            all.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
            (1..i).collect::<Vec<_>>()
        );
        store.close();
        drop(store);
        let mut store = Store::open(dir.path(), None).unwrap();
        assert_eq!(
            store.get_log_state().await.unwrap().last_purged_log_id,
            Some(log_id(1, upto))
        );
        assert_eq!(store.try_get_log_entries(..).await.unwrap().len() as u64, i - 1 - upto);
        store.close();
    }

    #[test]
    fn tail_stays_contiguous() {
        let mut t = Tail::default();
        for i in 5..=9 {
            t.push(entry(1, i, 10), 10);
        }
        t.mark_written(&log_id(1, 8));
        assert_eq!(t.written, Some(8));
        // Overwrite from 7: what was written from there on no longer is.
        t.push(entry(2, 7, 10), 10);
        assert_eq!((t.first, t.last_index(), t.written), (5, Some(7), Some(6)));
        // A gap (snapshot install): start afresh.
        t.push(entry(3, 20, 10), 10);
        assert_eq!((t.first, t.last_index(), t.bytes), (20, Some(20), 10));
        // A stale mark (another log id at that index) changes nothing.
        t.mark_written(&log_id(1, 20));
        assert_eq!(t.written, Some(6));
        t.mark_written(&log_id(3, 20));
        assert_eq!(t.written, Some(20));
        t.evict(0);
        assert!(t.entries.is_empty());
        assert_eq!(t.first, 21);
        assert_eq!(t.range(1, None), (None, Vec::new()));
    }
}
