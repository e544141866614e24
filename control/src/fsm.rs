//! The state machine the Raft log applies: the projections' `State`, plus periodic
//! checkpoints of it that make replay cost proportional to the distance replayed.

use opendsec_commands::InFlight;
use opendsec_log::StateMachine;
use opendsec_projections::State;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

/// index -> the encoded State as of that index, without its audit records (they are
/// in [`AUDIT`]), so a checkpoint costs what changed, not the whole history.
const CHECKPOINTS: TableDefinition<u64, &[u8]> = TableDefinition::new("checkpoints_v2");
/// index -> leader time of that index (to find a checkpoint by time).
const CHECKPOINT_TIMES: TableDefinition<u64, u64> = TableDefinition::new("checkpoint_times");
/// index -> the audit record of that index (JSON), written once, shared by every
/// checkpoint at or after it.
const AUDIT: TableDefinition<u64, &[u8]> = TableDefinition::new("audit_records");
/// index -> the requests remembered as of that index (postcard), apart from the rest of the
/// state: the window is encoded by the checkpoint writer, off the apply path (see
/// [`CheckpointWork::requests`]). A row of [`CHECKPOINTS`] without one here or in
/// [`CHECKPOINT_REQUEST_DELTAS`] holds its requests itself (checkpoints written before
/// these tables).
const CHECKPOINT_REQUESTS: TableDefinition<u64, &[u8]> = TableDefinition::new("checkpoint_requests");
/// index -> what changed in the requests window since the checkpoint before it
/// (postcard [`RequestDelta`]): most checkpoints store this rather than a whole window in
/// [`CHECKPOINT_REQUESTS`] (up to 200,000 requests, tens of MB, every checkpoint: at
/// full windows it cost a loaded 3-node cluster a quarter of its writes). A window is the
/// nearest whole one at or before it with the deltas after it applied, so at most
/// [`FULL_EVERY`] - 1 deltas stand between a checkpoint and a whole window.
const CHECKPOINT_REQUEST_DELTAS: TableDefinition<u64, &[u8]> = TableDefinition::new("checkpoint_request_deltas");
/// Every this many checkpoints (and the first a writer writes) hold their whole window.
const FULL_EVERY: u32 = 16;
/// The first format: a whole State per checkpoint. Dropped at open (checkpoints are a
/// cache of what the log holds).
const CHECKPOINTS_V1: TableDefinition<u64, &[u8]> = TableDefinition::new("checkpoints");

/// A checkpoint's requests as the change since checkpoint `base`'s.
#[derive(serde::Serialize, serde::Deserialize)]
struct RequestDelta {
    base: u64,
    delta: opendsec_projections::RequestsDelta,
}

/// What the apply path hands to the checkpoint writer.
struct CheckpointWork {
    index: u64,
    time_ms: u64,
    /// The state without audit records and requests.
    core: Vec<u8>,
    /// The requests remembered: a copy of the window (O(1), a persistent map), encoded
    /// by the writer thread.
    requests: opendsec_projections::Requests,
    /// The ids of the requests remembered or forgotten since checkpoint `.0`, the one
    /// before (`None`: not known, after a restore or at start): the writer stores their
    /// fate rather than the whole window.
    changed_since: Option<(u64, Vec<String>)>,
    /// Audit records newer than the previous checkpoint's: (index, JSON).
    audit: Vec<(u64, Vec<u8>)>,
}

pub struct Fsm {
    pub state: State,
    checkpoint_every: u64,
    checkpoints: Option<mpsc::Sender<CheckpointWork>>,
    /// Audit records with an index up to this one are in the checkpoint file already.
    audit_saved: u64,
    /// The checkpoint since which the state's requests window keeps the ids it changes
    /// (`Requests::keep_changes`); `None` until the first.
    changes_since: Option<u64>,
    /// The leader's in-flight overlay: a batch's reservation (keyed by its seed) ends the
    /// moment the batch is applied, so nothing is counted twice (state + overlay).
    inflight: Option<Arc<Mutex<InFlight>>>,
}

impl Fsm {
    pub fn new(
        checkpoint_every: u64,
        checkpoints: Option<&Checkpoints>,
        inflight: Option<Arc<Mutex<InFlight>>>,
    ) -> Fsm {
        let mut state = State::new();
        if checkpoints.is_some() {
            state.requests.keep_changes();
        }
        Fsm {
            state,
            changes_since: None,
            checkpoint_every: checkpoint_every.max(1),
            audit_saved: checkpoints.map(|c| c.audit_saved).unwrap_or(0),
            checkpoints: checkpoints.map(|c| c.writer()),
            inflight,
        }
    }

    /// Serialises a checkpoint of the current state: the state without its audit
    /// records, plus the records the checkpoint file does not hold yet. Runs on the
    /// apply path (the state must not change under it), so it costs what changed since
    /// the last checkpoint plus the non-audit views, never the whole audit history.
    fn checkpoint(&mut self) -> CheckpointWork {
        let records = std::mem::take(&mut self.state.audit.records);
        let changed = self.state.requests.take_changes();
        let changed_since = self.changes_since.zip(changed);
        self.changes_since = Some(self.state.index);
        let requests = std::mem::take(&mut self.state.requests);
        let core = self.state.to_bytes();
        self.state.requests = requests.clone();
        let from = records.partition_point(|r| r.index <= self.audit_saved);
        let audit = records[from..]
            .iter()
            .map(|r| (r.index, serde_json::to_vec(r).expect("audit records serialise")))
            .collect();
        self.state.audit.records = records;
        self.audit_saved = self.audit_saved.max(self.state.index);
        CheckpointWork {
            index: self.state.index,
            time_ms: self.state.time_ms,
            core,
            requests,
            changed_since,
            audit,
        }
    }
}

impl StateMachine for Fsm {
    fn apply(&mut self, index: u64, payload: &[u8]) -> Vec<u8> {
        // Lock order everywhere: the state (held by the log while applying), then the overlay.
        let outcome = match opendsec_projections::schema::decode_batch(payload) {
            Ok(batch) => {
                let outcome = self.state.apply_batch(index, &batch);
                if let Some(inflight) = &self.inflight {
                    inflight.lock().expect("inflight lock").release(batch.seed);
                }
                outcome
            }
            Err(_) => self.state.apply_encoded(index, payload),
        };
        if index.is_multiple_of(self.checkpoint_every) && self.checkpoints.is_some() {
            // Serialised here (the state must not change under it), written by a
            // background thread so the apply path never waits for a disk commit.
            let started = std::time::Instant::now();
            let work = self.checkpoint();
            tracing::debug!(index, core_bytes = work.core.len(), audit_records = work.audit.len(), took = ?started.elapsed(), "replay checkpoint serialised");
            if let Some(tx) = &self.checkpoints {
                let _ = tx.send(work);
            }
        }
        serde_json::to_vec(&outcome).expect("outcome serialises")
    }

    fn snapshot(&self) -> Vec<u8> {
        self.state.to_bytes()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
        self.state = State::from_bytes(snapshot)?;
        // What changed since the last checkpoint is not known across a restore: the
        // next one holds its whole window.
        if self.checkpoints.is_some() {
            self.state.requests.keep_changes();
        }
        self.changes_since = None;
        // Records below what the file holds are identical (the log is the same log);
        // records past it are written by the next checkpoint.
        self.audit_saved = self.audit_saved.min(self.state.index);
        Ok(())
    }
}

/// Durable replay checkpoints in their own redb file.
#[derive(Clone)]
pub struct Checkpoints {
    db: Arc<Database>,
    /// The newest audit record in the file when it was opened.
    audit_saved: u64,
}

impl Checkpoints {
    pub fn open(path: &Path) -> Result<Checkpoints, redb::Error> {
        let db = Database::create(path)?;
        let tx = db.begin_write()?;
        // A file of the first format: its whole-state rows go, and with them the times
        // that pointed at them.
        if tx.delete_table(CHECKPOINTS_V1)? {
            tx.delete_table(CHECKPOINT_TIMES)?;
        }
        tx.open_table(CHECKPOINTS)?;
        tx.open_table(CHECKPOINT_TIMES)?;
        tx.open_table(CHECKPOINT_REQUESTS)?;
        tx.open_table(CHECKPOINT_REQUEST_DELTAS)?;
        let audit_saved = tx.open_table(AUDIT)?.last()?.map(|(k, _)| k.value()).unwrap_or(0);
        tx.commit()?;
        Ok(Checkpoints {
            db: Arc::new(db),
            audit_saved,
        })
    }

    fn writer(&self) -> mpsc::Sender<CheckpointWork> {
        let (tx, rx) = mpsc::channel::<CheckpointWork>();
        let db = self.db.clone();
        std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || {
                // The last checkpoint written, and how many deltas stand since a whole
                // window: the next stores what changed since it, when it is the one its
                // changes are counted from (else, or after a failed write, it is whole).
                let mut last: Option<(u64, u32)> = None;
                for work in rx {
                    let delta = match (last.take(), &work.changed_since) {
                        (Some((written, chain)), Some((since, ids)))
                            if written == *since && *since < work.index && chain + 1 < FULL_EVERY =>
                        {
                            Some((chain + 1, *since, work.requests.delta_of(ids)))
                        }
                        _ => None,
                    };
                    let chain = delta.as_ref().map_or(0, |(chain, _, _)| *chain);
                    let delta = delta.map(|(_, base, delta)| RequestDelta { base, delta });
                    match write_checkpoint(&db, &work, delta.as_ref()) {
                        Ok(()) => last = Some((work.index, chain)),
                        Err(e) => {
                            // The next one holds its whole window.
                            tracing::warn!(index = work.index, error = %e, "could not write a replay checkpoint; replay will fold from an older one");
                        }
                    }
                }
            })
            .expect("spawn checkpoint writer");
        tx
    }

    /// The newest checkpoint at or before `index`.
    pub fn at_or_before_index(&self, index: u64) -> Result<Option<State>, String> {
        let rx = self.db.begin_read().map_err(|e| e.to_string())?;
        let t = rx.open_table(CHECKPOINTS).map_err(|e| e.to_string())?;
        let found = t.range(..=index).map_err(|e| e.to_string())?.next_back();
        let mut state = match found {
            Some(Ok((_, v))) => State::from_bytes(v.value())?,
            Some(Err(e)) => return Err(e.to_string()),
            None => return Ok(None),
        };
        if let Some(requests) = requests_at(&rx, state.index)? {
            state.requests = requests;
        }
        let audit = rx.open_table(AUDIT).map_err(|e| e.to_string())?;
        for row in audit.range(..=state.index).map_err(|e| e.to_string())? {
            let (_, v) = row.map_err(|e| e.to_string())?;
            let record = serde_json::from_slice(v.value())
                .map_err(|e| format!("an audit record in the checkpoint file does not decode: {e}"))?;
            state.audit.records.push(record);
        }
        Ok(Some(state))
    }

    /// Removes the checkpoints no replay can start from any more, now that the log's
    /// history begins at `first_available`: a replay from a checkpoint reads the log
    /// from the entry after it, so the newest checkpoint at or before `first_available -
    /// 1` is the oldest one of use; those before it go (their state, time and requests;
    /// the audit records stay, shared with the checkpoints kept). Returns how many went.
    pub fn prune_before(&self, first_available: u64) -> Result<usize, redb::Error> {
        let Some(boundary) = first_available.checked_sub(1) else {
            return Ok(0);
        };
        let tx = self.db.begin_write()?;
        let gone = {
            let mut states = tx.open_table(CHECKPOINTS)?;
            let mut deltas = tx.open_table(CHECKPOINT_REQUEST_DELTAS)?;
            // The newest at or before the boundary that holds its whole window (one with
            // a delta needs the checkpoints its window is built from).
            let mut keep = None;
            for row in states.range(..=boundary)?.rev() {
                let index = row?.0.value();
                if deltas.get(index)?.is_none() {
                    keep = Some(index);
                    break;
                }
            }
            let Some(keep) = keep else {
                return Ok(0);
            };
            let old = states
                .range(..keep)?
                .map(|row| row.map(|(k, _)| k.value()))
                .collect::<Result<Vec<u64>, _>>()?;
            let mut times = tx.open_table(CHECKPOINT_TIMES)?;
            let mut requests = tx.open_table(CHECKPOINT_REQUESTS)?;
            for index in &old {
                states.remove(index)?;
                times.remove(index)?;
                requests.remove(index)?;
                deltas.remove(index)?;
            }
            old.len()
        };
        if gone > 0 {
            tx.commit()?;
        }
        Ok(gone)
    }

    /// The newest checkpoint whose state was reached at or before `time_ms`.
    pub fn at_or_before_time(&self, time_ms: u64) -> Result<Option<State>, String> {
        let rx = self.db.begin_read().map_err(|e| e.to_string())?;
        let times = rx.open_table(CHECKPOINT_TIMES).map_err(|e| e.to_string())?;
        let mut best = None;
        for row in times.iter().map_err(|e| e.to_string())? {
            let (k, v) = row.map_err(|e| e.to_string())?;
            if v.value() <= time_ms {
                best = Some(k.value());
            } else {
                break; // times only grow with the index
            }
        }
        match best {
            Some(i) => self.at_or_before_index(i),
            None => Ok(None),
        }
    }
}

/// The requests window of checkpoint `index`: whole, or built from the nearest whole one
/// before it and the deltas after that. `None`: a checkpoint of the first format, whose
/// state row holds its requests itself.
fn requests_at(rx: &redb::ReadTransaction, index: u64) -> Result<Option<opendsec_projections::Requests>, String> {
    let whole = rx.open_table(CHECKPOINT_REQUESTS).map_err(|e| e.to_string())?;
    let deltas = rx.open_table(CHECKPOINT_REQUEST_DELTAS).map_err(|e| e.to_string())?;
    let mut chain = Vec::new();
    let mut at = index;
    let mut requests: opendsec_projections::Requests = loop {
        if let Some(row) = whole.get(at).map_err(|e| e.to_string())? {
            break postcard::from_bytes(row.value())
                .map_err(|e| format!("a checkpoint's requests do not decode: {e}"))?;
        }
        match deltas.get(at).map_err(|e| e.to_string())? {
            Some(row) => {
                let d: RequestDelta = postcard::from_bytes(row.value())
                    .map_err(|e| format!("checkpoint {at}'s requests delta does not decode: {e}"))?;
                if d.base >= at {
                    return Err(format!(
                        "checkpoint {at}'s requests delta names a later base, {}",
                        d.base
                    ));
                }
                at = d.base;
                chain.push(d.delta);
            }
            None if chain.is_empty() => return Ok(None),
            None => return Err(format!("checkpoint {at}, a requests delta's base, is not in the file")),
        }
    };
    for delta in chain.iter().rev() {
        requests.apply(delta);
    }
    Ok(Some(requests))
}

/// Writes `work`, its requests as `delta` (what changed since the checkpoint the writer
/// wrote last) if given, else whole.
fn write_checkpoint(db: &Database, work: &CheckpointWork, delta: Option<&RequestDelta>) -> Result<(), redb::Error> {
    let tx = db.begin_write()?;
    {
        // The records first: a checkpoint row is only ever seen with its records.
        let mut audit = tx.open_table(AUDIT)?;
        for (index, record) in &work.audit {
            audit.insert(*index, record.as_slice())?;
        }
        // postcard, not JSON as the rest: the window is up to 200,000 requests, and this
        // thread shares the host's cores with the node it writes for.
        match delta {
            Some(delta) => {
                let encoded = postcard::to_stdvec(delta).expect("a requests delta serialises");
                tx.open_table(CHECKPOINT_REQUEST_DELTAS)?
                    .insert(work.index, encoded.as_slice())?;
                tx.open_table(CHECKPOINT_REQUESTS)?.remove(work.index)?;
            }
            None => {
                let requests = postcard::to_stdvec(&work.requests).expect("requests serialise");
                tx.open_table(CHECKPOINT_REQUESTS)?
                    .insert(work.index, requests.as_slice())?;
                tx.open_table(CHECKPOINT_REQUEST_DELTAS)?.remove(work.index)?;
            }
        }
        let mut t = tx.open_table(CHECKPOINTS)?;
        t.insert(work.index, work.core.as_slice())?;
        let mut times = tx.open_table(CHECKPOINT_TIMES)?;
        times.insert(work.index, work.time_ms)?;
    }
    tx.commit()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn wait_for_checkpoint(c: &Checkpoints, index: u64) -> State {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(s) = c.at_or_before_index(index).unwrap().filter(|s| s.index == index) {
                return s;
            }
            assert!(Instant::now() < deadline, "no checkpoint at {index}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Every payload here is undecodable: each still leaves an audit record, which is
    /// what checkpoints store apart from the rest of the state.
    fn apply_n(fsm: &mut Fsm, from: u64, to: u64) -> Vec<State> {
        (from..=to)
            .map(|i| {
                fsm.apply(i, format!("not a batch {i}").as_bytes());
                fsm.state.clone()
            })
            .collect()
    }

    #[test]
    fn a_checkpoint_keeps_the_requests_remembered_so_a_replay_from_it_still_answers_retries() {
        use opendsec_projections::schema::{Batch, encode_batch};
        let dir = tempfile::tempdir().unwrap();
        let c = Checkpoints::open(&dir.path().join("c.redb")).unwrap();
        let mut fsm = Fsm::new(4, Some(&c), None);
        let batch = |i: u64| Batch {
            request_id: format!("request-{i}"),
            request_digest: format!("digest-{i}"),
            time_ms: 1_000 + i,
            ..Default::default()
        };
        let mut states = Vec::new();
        for i in 1..=8u64 {
            fsm.apply(i, &encode_batch(&batch(i)));
            states.push(fsm.state.clone());
        }
        let back = wait_for_checkpoint(&c, 8);
        assert_eq!(back.requests.by_id.len(), 8);
        assert_eq!(back.to_bytes(), states[7].to_bytes());
        // Folding on from the checkpoint, a retry of request 3 is known as one.
        let mut replay = back;
        let outcome = replay.apply_batch(9, &batch(3));
        assert_eq!(outcome, opendsec_projections::Outcome::Duplicate { index: 9, first: 3 });
    }

    #[test]
    fn a_checkpoint_reads_back_as_the_state_at_its_index_audit_included() {
        let dir = tempfile::tempdir().unwrap();
        let c = Checkpoints::open(&dir.path().join("c.redb")).unwrap();
        let mut fsm = Fsm::new(4, Some(&c), None);
        let states = apply_n(&mut fsm, 1, 12);
        for k in [4u64, 8, 12] {
            let back = wait_for_checkpoint(&c, k);
            assert_eq!(back.audit.records.len(), k as usize);
            assert_eq!(back.to_bytes(), states[k as usize - 1].to_bytes(), "checkpoint {k}");
        }
        // Between checkpoints, the newest one before.
        assert_eq!(c.at_or_before_index(7).unwrap().unwrap().index, 4);
        assert!(c.at_or_before_index(3).unwrap().is_none());
    }

    #[test]
    fn each_audit_record_is_written_once_and_a_reopened_file_goes_on_from_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.redb");
        let states = {
            let c = Checkpoints::open(&path).unwrap();
            let mut fsm = Fsm::new(5, Some(&c), None);
            let s = apply_n(&mut fsm, 1, 10);
            wait_for_checkpoint(&c, 10);
            // The second checkpoint carried only the five records after the first.
            assert_eq!(fsm.audit_saved, 10);
            s
        };
        // A restarted node replays its log from the start: the records are in the file.
        // (The old writer thread lets go of the file once it has seen its sender drop.)
        let deadline = Instant::now() + Duration::from_secs(10);
        let c = loop {
            match Checkpoints::open(&path) {
                Ok(c) => break c,
                Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(5)),
                Err(e) => panic!("reopen: {e}"),
            }
        };
        assert_eq!(c.audit_saved, 10);
        let mut fsm = Fsm::new(5, Some(&c), None);
        let mut all = apply_n(&mut fsm, 1, 10);
        all.extend(apply_n(&mut fsm, 11, 15));
        assert_eq!(all[9].to_bytes(), states[9].to_bytes());
        let back = wait_for_checkpoint(&c, 15);
        assert_eq!(back.to_bytes(), all[14].to_bytes());
        assert_eq!(wait_for_checkpoint(&c, 5).to_bytes(), states[4].to_bytes());
    }

    #[test]
    fn a_restored_snapshot_behind_the_file_rewrites_the_records_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let c = Checkpoints::open(&dir.path().join("c.redb")).unwrap();
        let mut fsm = Fsm::new(3, Some(&c), None);
        let states = apply_n(&mut fsm, 1, 6);
        wait_for_checkpoint(&c, 6);
        fsm.restore(&states[1].to_bytes()).unwrap();
        assert_eq!(fsm.audit_saved, 2);
        let again = apply_n(&mut fsm, 3, 9);
        assert_eq!(wait_for_checkpoint(&c, 9).to_bytes(), again.last().unwrap().to_bytes());
    }

    #[test]
    fn checkpoints_older_than_the_retained_history_are_pruned_but_the_one_it_starts_from_stays() {
        let dir = tempfile::tempdir().unwrap();
        let c = Checkpoints::open(&dir.path().join("c.redb")).unwrap();
        // A checkpoint at every entry: whole windows at 1, 17, 33 and 49 (every
        // FULL_EVERY-th), deltas between.
        let mut fsm = Fsm::new(1, Some(&c), None);
        let states = apply_requests(&mut fsm, 1, 50);
        wait_for_checkpoint(&c, 50);
        let rows = |table| {
            let rx = c.db.begin_read().unwrap();
            let t = rx.open_table(table).unwrap();
            t.iter().unwrap().map(|r| r.unwrap().0.value()).collect::<Vec<u64>>()
        };
        assert_eq!(rows(CHECKPOINTS), (1..=50).collect::<Vec<u64>>());
        assert_eq!(rows(CHECKPOINT_REQUESTS), [1, 17, 33, 49]);

        // Nothing of the history is gone yet (it begins at 1): nothing to prune.
        assert_eq!(c.prune_before(1).unwrap(), 0);
        assert_eq!(c.prune_before(0).unwrap(), 0);
        // The log now begins at 36: a replay to 36.. starts from 35 at the earliest,
        // whose window is built from 33's; 1..32 serve nothing.
        assert_eq!(c.prune_before(36).unwrap(), 32);
        assert_eq!(rows(CHECKPOINTS), (33..=50).collect::<Vec<u64>>());
        assert_eq!(rows(CHECKPOINT_REQUESTS), [33, 49]);
        assert_eq!(
            rows(CHECKPOINT_REQUEST_DELTAS),
            (34..=48).chain([50]).collect::<Vec<u64>>()
        );
        let rx = c.db.begin_read().unwrap();
        let times = rx.open_table(CHECKPOINT_TIMES).unwrap();
        let times: Vec<u64> = times.iter().unwrap().map(|r| r.unwrap().0.value()).collect();
        assert_eq!(times, (33..=50).collect::<Vec<u64>>());
        drop(rx);
        assert_eq!(c.prune_before(36).unwrap(), 0, "once");
        // What stays reads back whole, audit records and requests included.
        for i in [33u64, 35, 48, 49, 50] {
            assert_eq!(
                c.at_or_before_index(i).unwrap().unwrap().to_bytes(),
                states[i as usize - 1].to_bytes(),
                "checkpoint {i}"
            );
        }
        assert!(c.at_or_before_index(25).unwrap().is_none());
        // History beginning right after a whole window keeps it.
        assert_eq!(c.prune_before(50).unwrap(), 16);
        assert_eq!(rows(CHECKPOINTS), [49, 50]);
        assert_eq!(
            c.at_or_before_index(50).unwrap().unwrap().to_bytes(),
            states[49].to_bytes()
        );
    }

    /// Batches each with a request of its own (remembered in the window), one in four a
    /// retry of an earlier one (and so no change to it); log time moves 1 s a batch, the
    /// window forgets what is 15 min old: a long run both adds and forgets.
    fn apply_requests(fsm: &mut Fsm, from: u64, to: u64) -> Vec<State> {
        use opendsec_projections::schema::{Batch, encode_batch};
        (from..=to)
            .map(|i| {
                let n = if i % 4 == 0 { i / 2 } else { i };
                let batch = Batch {
                    request_id: format!("request-{n}"),
                    request_digest: format!("digest-{n}"),
                    time_ms: i * 1_000,
                    ..Default::default()
                };
                fsm.apply(i, &encode_batch(&batch));
                fsm.state.clone()
            })
            .collect()
    }

    #[test]
    fn every_checkpoint_of_a_long_run_reads_back_its_window_from_the_whole_one_and_the_deltas_before_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.redb");
        let c = Checkpoints::open(&path).unwrap();
        let mut fsm = Fsm::new(50, Some(&c), None);
        // 2,000 batches over 33 minutes: the window rolls on (15 min kept).
        let states = apply_requests(&mut fsm, 1, 2_000);
        wait_for_checkpoint(&c, 2_000);
        let whole = {
            let rx = c.db.begin_read().unwrap();
            let t = rx.open_table(CHECKPOINT_REQUESTS).unwrap();
            t.iter().unwrap().map(|r| r.unwrap().0.value()).collect::<Vec<u64>>()
        };
        assert_eq!(whole, [50, 850, 1650], "one whole window in FULL_EVERY");
        let last = states.last().unwrap();
        assert!(
            last.requests.by_id.len() < 1_000 && !last.requests.by_id.contains_key("request-1"),
            "the window forgot the oldest"
        );
        for i in (50..=2_000u64).step_by(50) {
            let back = c.at_or_before_index(i + 49).unwrap().unwrap();
            assert_eq!(back.to_bytes(), states[i as usize - 1].to_bytes(), "checkpoint {i}");
        }
        // A writer started again (a restarted node) begins with a whole window.
        drop(fsm);
        let mut fsm = Fsm::new(50, Some(&c), None);
        fsm.state = states.last().unwrap().clone();
        let more = apply_requests(&mut fsm, 2_001, 2_100);
        wait_for_checkpoint(&c, 2_100);
        let rx = c.db.begin_read().unwrap();
        assert!(
            rx.open_table(CHECKPOINT_REQUESTS)
                .unwrap()
                .get(2_050)
                .unwrap()
                .is_some()
        );
        assert!(
            rx.open_table(CHECKPOINT_REQUEST_DELTAS)
                .unwrap()
                .get(2_100)
                .unwrap()
                .is_some()
        );
        drop(rx);
        assert_eq!(
            c.at_or_before_index(2_100).unwrap().unwrap().to_bytes(),
            more[99].to_bytes()
        );
    }

    #[test]
    fn a_file_of_the_first_format_is_cleared_not_misread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.redb");
        {
            let db = Database::create(&path).unwrap();
            let tx = db.begin_write().unwrap();
            tx.open_table(CHECKPOINTS_V1)
                .unwrap()
                .insert(5, b"{\"whole\":\"state\"}".as_slice())
                .unwrap();
            tx.open_table(CHECKPOINT_TIMES).unwrap().insert(5, 1).unwrap();
            tx.commit().unwrap();
        }
        let c = Checkpoints::open(&path).unwrap();
        assert!(c.at_or_before_index(10).unwrap().is_none());
        assert!(c.at_or_before_time(u64::MAX).unwrap().is_none());
    }
}
