//! The requests remembered so that a retry is answered with its first outcome and never
//! applied twice (exactly-once writes).

use imbl::{OrdMap, OrdSet};
use serde::{Deserialize, Serialize};

/// How long (log time) a request is remembered after it was applied.
pub const REQUEST_WINDOW_MS: u64 = 15 * 60 * 1000;
/// The most requests remembered at once (the oldest are forgotten first).
pub const REQUEST_WINDOW_MAX: usize = 200_000;

/// Requests remembered for deduplication: by request id, and in the order they aged.
/// Persistent ordered maps (`imbl`): a copy costs O(1), so a replay checkpoint takes the
/// window (up to [`REQUEST_WINDOW_MAX`] requests, tens of MB encoded) without holding
/// the apply path while it is encoded; they encode as the ordered `BTreeMap`/`BTreeSet`
/// did, byte for byte.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requests {
    pub by_id: OrdMap<String, SeenRequest>,
    /// (log time, request id), oldest first.
    pub by_age: OrdSet<(u64, String)>,
}

/// One remembered request: what it was (its digest) and where its batch is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenRequest {
    pub digest: String,
    pub index: u64,
    pub time_ms: u64,
}

impl Requests {
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The index of the batch that applied request `id` with this `digest`, if it is
    /// remembered: a batch carrying both is a retry of it.
    pub fn applied(&self, id: &str, digest: &str) -> Option<u64> {
        self.by_id
            .get(id)
            .filter(|s| !digest.is_empty() && s.digest == digest)
            .map(|s| s.index)
    }

    pub(super) fn forget_before(&mut self, time_ms: u64) {
        while let Some((t, id)) = self.by_age.get_min().cloned() {
            if t >= time_ms && self.by_id.len() <= REQUEST_WINDOW_MAX {
                break;
            }
            self.by_age.remove_min();
            self.by_id.remove(&id);
        }
    }

    pub(super) fn remember(&mut self, id: &str, digest: &str, index: u64, time_ms: u64) {
        if let Some(old) = self.by_id.insert(
            id.to_string(),
            SeenRequest {
                digest: digest.to_string(),
                index,
                time_ms,
            },
        ) {
            self.by_age.remove(&(old.time_ms, id.to_string()));
        }
        self.by_age.insert((time_ms, id.to_string()));
    }
}
