//! Retention: what has ended leaves the live views after a while, so that the state
//! every node holds (and every snapshot carries) stays bounded however long a cluster
//! runs. Sweeps are a pure function of log time, so every node sweeps the same entries
//! at the same index; what leaves the views stays in the log's archive, where replay
//! and time travel still read it.

use super::*;

/// An ended sandbox stays in the live views this long by default: long enough to read
/// how it ended.
pub const DEFAULT_ENDED_SANDBOXES_MS: u64 = 60 * 60 * 1000;
/// The audit view keeps records this long by default...
pub const DEFAULT_AUDIT_MS: u64 = 30 * 24 * 60 * 60 * 1000;
/// ...and at most this many (about 50 MiB in memory).
pub const DEFAULT_AUDIT_RECORDS: u64 = 200_000;
/// Log time between two sweeps.
pub const SWEEP_EVERY_MS: u64 = 1000;
/// The most an ended sandbox or an audit record can be kept in the live views: ten years.
pub const MAX_RETENTION_SECONDS: u64 = 10 * 365 * 24 * 60 * 60;
/// The fewest audit records the view keeps (it keeps at least the request window's).
pub const MIN_AUDIT_RECORDS: u64 = 1000;
/// The most audit records the view can be told to keep (each takes a few hundred bytes
/// on every node).
pub const MAX_AUDIT_RECORDS: u64 = 10_000_000;

/// How long the live views keep what has ended (`SetRetention`, by a cluster admin).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Retention {
    pub ended_sandboxes_ms: u64,
    pub audit_ms: u64,
    pub audit_records: u64,
}

impl Default for Retention {
    fn default() -> Retention {
        Retention {
            ended_sandboxes_ms: DEFAULT_ENDED_SANDBOXES_MS,
            audit_ms: DEFAULT_AUDIT_MS,
            audit_records: DEFAULT_AUDIT_RECORDS,
        }
    }
}

impl Retention {
    pub fn is_default(&self) -> bool {
        *self == Retention::default()
    }

    /// Why `e` cannot be the retention, naming the field: (field, reason).
    pub fn invalid(e: &pb::RetentionSet) -> Option<(&'static str, String)> {
        let window = REQUEST_WINDOW_MS / 1000;
        if e.ended_sandboxes_seconds > MAX_RETENTION_SECONDS {
            return Some(("ended_sandboxes_seconds", format!("at most {MAX_RETENTION_SECONDS}")));
        }
        if !(window..=MAX_RETENTION_SECONDS).contains(&e.audit_seconds) {
            return Some((
                "audit_seconds",
                format!(
                    "from {window} (retries are answered from the audit view for that long) to {MAX_RETENTION_SECONDS}"
                ),
            ));
        }
        if !(MIN_AUDIT_RECORDS..=MAX_AUDIT_RECORDS).contains(&e.audit_records) {
            return Some((
                "audit_records",
                format!("from {MIN_AUDIT_RECORDS} to {MAX_AUDIT_RECORDS}"),
            ));
        }
        None
    }

    pub fn to_event(self) -> pb::RetentionSet {
        pb::RetentionSet {
            ended_sandboxes_seconds: self.ended_sandboxes_ms / 1000,
            audit_seconds: self.audit_ms / 1000,
            audit_records: self.audit_records,
        }
    }

    pub(super) fn from_event(e: &pb::RetentionSet) -> Retention {
        Retention {
            ended_sandboxes_ms: e.ended_sandboxes_seconds.saturating_mul(1000),
            audit_ms: e.audit_seconds.saturating_mul(1000),
            audit_records: e.audit_records,
        }
    }
}

impl State {
    /// Sweeps once per [`SWEEP_EVERY_MS`] of log time, when the log's clock (last at
    /// `before`) crosses into a new period.
    pub(super) fn sweep(&mut self, before: u64) {
        if before / SWEEP_EVERY_MS == self.time_ms / SWEEP_EVERY_MS {
            return;
        }
        let now = self.time_ms;
        let ended_before = now.saturating_sub(self.retention.ended_sandboxes_ms);
        self.sandboxes
            .sandboxes
            .retain(|_, s| s.is_live() || s.updated_at_ms > ended_before);
        // A record younger than the request window answers retries of its request
        // (`AuditView::result_at`): the count bound never takes one of those.
        let records = &mut self.audit.records;
        let too_old = now.saturating_sub(self.retention.audit_ms.max(REQUEST_WINDOW_MS));
        let protected = now.saturating_sub(REQUEST_WINDOW_MS);
        let over = records.len().saturating_sub(self.retention.audit_records as usize);
        let by_age = records.partition_point(|r| r.time_ms <= too_old);
        let by_count = records[..over].partition_point(|r| r.time_ms <= protected);
        let drop = by_age.max(by_count);
        if drop > 0 {
            self.audit.swept_before = records[drop - 1].index.saturating_add(1);
            records.drain(..drop);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schema::Batch;

    /// Found by the `event_batch` fuzz target: a record at the last index a log can have
    /// is swept like any other.
    #[test]
    fn a_record_at_the_last_index_is_swept_without_overflow() {
        let mut s = State::new();
        let at = |time_ms| Batch {
            time_ms,
            ..Default::default()
        };
        s.apply_batch(u64::MAX, &at(1_000));
        assert_eq!(s.audit.records.len(), 1);
        s.apply_batch(u64::MAX, &at(1_000 + DEFAULT_AUDIT_MS + SWEEP_EVERY_MS));
        assert_eq!(s.audit.records.len(), 1, "the older record is swept, the new one kept");
        assert_eq!(s.audit.first_index(), Some(u64::MAX));
    }
}
