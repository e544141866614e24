//! openraft's log storage traits on [`Store`]: reads from the tail and redb, appends
//! handed to the writer (see the parent module).

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::Ordering;
use std::time::Instant;

use openraft::storage::{IOFlushed, LogState, RaftLogStorage};
use openraft::{OptionalSend, RaftLogReader};
use redb::{ReadableDatabase, ReadableTable};

use crate::TypeConfig;
use crate::typ::{Entry, LogId, Vote};

use super::*;

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
        let done: Option<LogId> = self.get_meta(K_PURGED)?;
        let asked = *lock(&self.inner.purge_asked);
        let last_purged_log_id = done.max(asked);
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
            last_log_id: last_log_id.max(last_purged_log_id),
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

    /// Returns once the purge is queued, not done: moving a snapshot's worth of entries
    /// to the archive (100,000 at the default interval, hundreds of chunks) takes
    /// seconds, and openraft's core waits for this call, answering no peer meanwhile. The
    /// writer moves them oldest first, so the log never has a hole; a crash part way
    /// leaves some purged entries live, which the next purge takes.
    async fn purge(&mut self, log_id: LogId) -> Result<(), io::Error> {
        drop(self.purge_soon(log_id));
        Ok(())
    }
}
