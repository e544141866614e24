//! The in-memory tail of the log: the newest entries, readable at once (before their
//! fsync) so replication and apply rarely read redb; written ones are evicted past a byte
//! budget.

use std::collections::VecDeque;

use crate::typ::{Entry, LogId};

/// The newest entries of the log, contiguous: `entries[k]` has index `first + k` and the
/// last one is the last entry of the log. Those with index `<= written` are in a committed
/// redb transaction; the others exist only here (and in the writer's queue).
#[derive(Default)]
pub(super) struct Tail {
    pub(super) first: u64,
    pub(super) entries: VecDeque<(Entry, usize)>,
    pub(super) bytes: usize,
    pub(super) written: Option<u64>,
}

impl Tail {
    pub(super) fn last(&self) -> Option<&Entry> {
        self.entries.back().map(|(e, _)| e)
    }

    pub(super) fn last_index(&self) -> Option<u64> {
        self.last().map(|e| e.log_id.index())
    }

    /// Drop every entry with index `>= from`.
    pub(super) fn truncate_from(&mut self, from: u64) {
        while self.last_index().is_some_and(|l| l >= from) {
            if let Some((_, n)) = self.entries.pop_back() {
                self.bytes -= n;
            }
        }
        if self.written.is_some_and(|w| w >= from) {
            self.written = from.checked_sub(1);
        }
    }

    pub(super) fn push(&mut self, e: Entry, n: usize) {
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
    pub(super) fn mark_written(&mut self, last: &LogId) {
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
    pub(super) fn drop_upto(&mut self, upto: u64) {
        while self.entries.front().is_some_and(|(e, _)| e.log_id.index() <= upto) {
            if let Some((_, n)) = self.entries.pop_front() {
                self.bytes -= n;
                self.first += 1;
            }
        }
    }

    /// Keep the tail within `budget` bytes, dropping only written entries.
    pub(super) fn evict(&mut self, budget: usize) {
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
    pub(super) fn range(&self, start: u64, end: Option<u64>) -> (Option<u64>, Vec<Entry>) {
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
