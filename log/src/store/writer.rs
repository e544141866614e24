//! The writer thread and what feeds it: the queue of operations, the hand-off to the
//! thread (or an inline commit on the caller's thread), and the batch that makes a group of
//! operations durable in the journal or in one redb transaction (see the parent module).

use std::collections::VecDeque;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex, mpsc};
use std::time::Instant;

use openraft::EntryPayload;
use openraft::storage::IOFlushed;
use redb::{Durability, ReadableTable, ReadableTableMetadata, TableDefinition};
use tokio::sync::oneshot;

use crate::TypeConfig;
use crate::typ::{Entry, LogId};

use super::*;

/// One operation for the writer thread.
pub(super) enum Op {
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
    pub(super) fn fail(self, e: &str) {
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

/// The writer thread's queue: its channel (`None` once closed), and a leader's appends held
/// back until the core's task yields (see `Store::enqueue`).
pub(super) struct Queue {
    pub(super) tx: Option<mpsc::Sender<Op>>,
    pub(super) held: Vec<Op>,
    pub(super) release_scheduled: bool,
}

impl Queue {
    /// Hands the held operations to the writer, in order.
    pub(super) fn release(&mut self) {
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
pub(super) struct Flow {
    pub(super) queued: usize,
    pub(super) busy: bool,
}

/// Waits until no batch is being written, then marks one: released (and waiters woken)
/// when dropped.
pub(super) struct Busy<'a>(&'a (Mutex<Flow>, Condvar));

impl<'a> Busy<'a> {
    pub(super) fn wait(flow: &'a (Mutex<Flow>, Condvar), taken: usize) -> Self {
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
    /// Queue `op` for the writer; fails it at once if the store is closed.
    pub(super) fn send(&self, op: Op) {
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
    pub(super) fn enqueue(&self, op: Op, hold: bool) {
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

    pub(super) fn inline_mode(&self) -> Inline {
        match self.inner.inline.load(Ordering::Relaxed) {
            1 => Inline::Lone,
            2 => Inline::Follower,
            _ => Inline::Off,
        }
    }

    /// Commits `op` (an append) on this thread if inline appends are on, the runtime can
    /// lend this thread, and the writer is idle with nothing queued; else gives it back.
    pub(super) fn try_inline(&self, op: Op) -> Option<Op> {
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

    /// Queues a purge through `upto` (see `RaftLogStorage::purge`): the receiver answers
    /// once every entry through it is in the archive, or at the first failure.
    pub(crate) fn purge_soon(&self, upto: LogId) -> oneshot::Receiver<io::Result<()>> {
        {
            let mut asked = lock(&self.inner.purge_asked);
            *asked = (*asked).max(Some(upto));
        }
        let (tx, rx) = oneshot::channel();
        self.send(Op::Purge { upto, done: tx });
        rx
    }

    /// Queue an operation that answers on `done`, and wait for the answer.
    pub(super) async fn call(&self, op: impl FnOnce(oneshot::Sender<io::Result<()>>) -> Op) -> io::Result<()> {
        let (tx, rx) = oneshot::channel();
        self.send(op(tx));
        rx.await.map_err(|_| closed())?
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

/// The writer thread: every queued operation so far, in order, in one write transaction.
pub(super) fn writer(inner: std::sync::Weak<Inner>, rx: mpsc::Receiver<Op>, flow: Arc<(Mutex<Flow>, Condvar)>) {
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
pub(super) struct Purging {
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
    pub(super) fn run_batch(&self, mut work: Vec<Op>, committed: Option<Vec<u8>>, purges: &mut VecDeque<Purging>) {
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
            if let Some(e) = &err {
                tracing::error!(upto = %p.upto, error = %e, "purging the log into the archive failed; the next snapshot's purge tries again");
            }
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
