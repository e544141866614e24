//! Rebuilding views at a past point of the log ("time travel").
//!
//! A replay starts from the newest checkpoint at or before the target and folds
//! the batches after it, so its cost follows the distance replayed, not the
//! length of the whole log.

use crate::state::State;

/// Where a replay stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Until {
    /// Include every batch up to and including this log index.
    Index(u64),
    /// Include every batch decided at or before this time (ms since the epoch).
    Time(u64),
}

/// Folds `entries` (index, encoded batch) onto `from` until `until` is passed.
/// Returns the state and how many batches were folded.
pub fn fold<'a>(mut from: State, entries: impl IntoIterator<Item = (u64, &'a [u8])>, until: Until) -> (State, u64) {
    let mut folded = 0;
    for (index, bytes) in entries {
        if index <= from.index {
            continue;
        }
        match until {
            Until::Index(last) if index > last => break,
            Until::Time(t) => {
                // Peek at the batch's time without applying it.
                match crate::schema::decode_batch(bytes) {
                    Ok(b) if b.time_ms > t => break,
                    _ => {}
                }
            }
            _ => {}
        }
        from.apply_encoded(index, bytes);
        folded += 1;
    }
    (from, folded)
}
