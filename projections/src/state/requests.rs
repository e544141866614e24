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
    /// The ids remembered or forgotten since [`Self::take_changes`] last ran, when kept
    /// ([`Self::keep_changes`]: a node writing replay checkpoints, which store what
    /// changed rather than the whole window). Not part of the state: not encoded, not
    /// compared.
    #[serde(skip)]
    changed: Changed,
}

/// See [`Requests::changed`]: `None` until kept.
#[derive(Clone, Debug, Default)]
struct Changed(Option<Vec<String>>);

impl PartialEq for Changed {
    fn eq(&self, _: &Changed) -> bool {
        true
    }
}

impl Eq for Changed {}

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
            if let Some(changed) = &mut self.changed.0 {
                changed.push(id);
            }
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
        if let Some(changed) = &mut self.changed.0 {
            changed.push(id.to_string());
        }
    }

    /// Keeps the ids of the requests remembered or forgotten from now on (see
    /// [`Self::take_changes`]).
    pub fn keep_changes(&mut self) {
        self.changed.0.get_or_insert_with(Vec::new);
    }

    /// The ids remembered or forgotten since the last call (or since
    /// [`Self::keep_changes`]), each at most once; `None` when they are not kept.
    pub fn take_changes(&mut self) -> Option<Vec<String>> {
        let mut ids = std::mem::take(self.changed.0.as_mut()?);
        ids.sort_unstable();
        ids.dedup();
        Some(ids)
    }

    /// What became of the requests `ids` in this window (remembered as what, or
    /// forgotten): with the ids [`Self::take_changes`] gave since an earlier window,
    /// what turns that window into this one.
    pub fn delta_of(&self, ids: &[String]) -> RequestsDelta {
        let mut delta = RequestsDelta::default();
        for id in ids {
            match self.by_id.get(id) {
                Some(seen) => delta.upserts.push((id.clone(), seen.clone())),
                None => delta.removed.push(id.clone()),
            }
        }
        delta
    }
}

/// What changed in a window of remembered requests between two of its states (see
/// [`Requests::delta_of`]): a replay checkpoint stores this rather than the whole
/// window (up to [`REQUEST_WINDOW_MAX`] requests) when it has the earlier state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestsDelta {
    /// Requests remembered since, or remembered again (another batch, another time).
    pub upserts: Vec<(String, SeenRequest)>,
    /// Requests forgotten since.
    pub removed: Vec<String>,
}

impl Requests {
    /// `self` with `delta` applied: the window `delta` was taken of, when `self` is the
    /// one it was taken since (see [`Self::delta_of`]).
    pub fn apply(&mut self, delta: &RequestsDelta) {
        for id in &delta.removed {
            if let Some(old) = self.by_id.remove(id) {
                self.by_age.remove(&(old.time_ms, id.clone()));
            }
        }
        for (id, seen) in &delta.upserts {
            if let Some(old) = self.by_id.insert(id.clone(), seen.clone()) {
                self.by_age.remove(&(old.time_ms, id.clone()));
            }
            self.by_age.insert((seen.time_ms, id.clone()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_changes_kept_since_an_earlier_window_turn_it_into_the_later_one_byte_for_byte() {
        let mut later = Requests::default();
        assert_eq!(later.take_changes(), None, "not kept unless asked");
        later.keep_changes();
        for (i, (id, t)) in [("a", 10), ("b", 20), ("c", 30)].into_iter().enumerate() {
            later.remember(id, &format!("digest-{id}"), i as u64 + 1, t);
        }
        later.take_changes();
        let earlier = later.clone();
        // a and b forgotten, c remembered again later, d and e new; times go back once
        // (a new leader's clock), and e is remembered then forgotten in between.
        later.remember("c", "digest-c-2", 4, 40);
        later.remember("d", "digest-d", 5, 25);
        later.remember("x", "digest-x", 6, 26);
        later.forget_before(25);
        later.by_age.remove(&(26, "x".to_string()));
        later.by_id.remove("x");
        later.remember("e", "digest-e", 7, 50);
        let ids = later.take_changes().unwrap();
        assert_eq!(ids, ["a", "b", "c", "d", "e", "x"], "each once, sorted");
        let delta = later.delta_of(&ids);
        assert_eq!(delta.removed, ["a", "b", "x"]);
        assert_eq!(
            delta.upserts.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(),
            ["c", "d", "e"]
        );
        let mut rebuilt = earlier.clone();
        rebuilt.apply(&delta);
        assert_eq!(rebuilt, later);
        assert_eq!(
            postcard::to_stdvec(&rebuilt).unwrap(),
            postcard::to_stdvec(&later).unwrap(),
            "encoded the same"
        );
        assert_eq!(later.take_changes(), Some(vec![]), "taken");
    }

    #[test]
    fn the_kept_changes_are_not_part_of_the_state() {
        let mut kept = Requests::default();
        kept.keep_changes();
        kept.remember("a", "d", 1, 1);
        let mut plain = Requests::default();
        plain.remember("a", "d", 1, 1);
        assert_eq!(kept, plain);
        assert_eq!(
            postcard::to_stdvec(&kept).unwrap(),
            postcard::to_stdvec(&plain).unwrap()
        );
        assert_eq!(
            serde_json::to_string(&kept).unwrap(),
            serde_json::to_string(&plain).unwrap()
        );
    }

    #[test]
    fn a_full_window_that_rolled_on_changes_by_what_rolled() {
        let ids: Vec<String> = (0..REQUEST_WINDOW_MAX + 1000).map(|i| format!("r{i:07}")).collect();
        let mut window = Requests::default();
        for (i, id) in ids[..REQUEST_WINDOW_MAX].iter().enumerate() {
            window.remember(id, "d", i as u64, i as u64);
        }
        window.keep_changes();
        let earlier = window.clone();
        for (i, id) in ids[REQUEST_WINDOW_MAX..].iter().enumerate() {
            let n = (REQUEST_WINDOW_MAX + i) as u64;
            window.remember(id, "d", n, n);
            window.forget_before(0);
        }
        assert_eq!(window.by_id.len(), REQUEST_WINDOW_MAX);
        let ids = window.take_changes().unwrap();
        let delta = window.delta_of(&ids);
        assert_eq!((delta.upserts.len(), delta.removed.len()), (1000, 1000));
        let mut rebuilt = earlier;
        rebuilt.apply(&delta);
        assert_eq!(rebuilt, window);
    }
}
