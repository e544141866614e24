//! The state machine the Raft log applies: the projections' `State`, plus periodic
//! checkpoints of it that make replay cost proportional to the distance replayed.

use opendsec_log::StateMachine;
use opendsec_projections::State;
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use std::path::Path;
use std::sync::mpsc;
use opendsec_commands::InFlight;
use std::sync::{Arc, Mutex};

/// index -> encoded State as of that index.
const CHECKPOINTS: TableDefinition<u64, &[u8]> = TableDefinition::new("checkpoints");
/// index -> leader time of that index (to find a checkpoint by time).
const CHECKPOINT_TIMES: TableDefinition<u64, u64> = TableDefinition::new("checkpoint_times");

pub struct Fsm {
    pub state: State,
    checkpoint_every: u64,
    checkpoints: Option<mpsc::Sender<(u64, u64, Vec<u8>)>>,
    /// The leader's in-flight overlay: a batch's reservation (keyed by its seed) ends the
    /// moment the batch is applied, so nothing is counted twice (state + overlay).
    inflight: Option<Arc<Mutex<InFlight>>>,
}

impl Fsm {
    pub fn new(checkpoint_every: u64, checkpoints: Option<&Checkpoints>, inflight: Option<Arc<Mutex<InFlight>>>) -> Fsm {
        Fsm { state: State::new(), checkpoint_every: checkpoint_every.max(1), checkpoints: checkpoints.map(|c| c.writer()), inflight }
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
        if index % self.checkpoint_every == 0 {
            if let Some(tx) = &self.checkpoints {
                // Serialised here (the state must not change under it), written by a
                // background thread so the apply path never waits for a disk commit.
                let _ = tx.send((index, self.state.time_ms, self.state.to_bytes()));
            }
        }
        serde_json::to_vec(&outcome).expect("outcome serialises")
    }

    fn snapshot(&self) -> Vec<u8> {
        self.state.to_bytes()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), String> {
        self.state = State::from_bytes(snapshot)?;
        Ok(())
    }
}

/// Durable replay checkpoints in their own redb file.
#[derive(Clone)]
pub struct Checkpoints {
    db: Arc<Database>,
}

impl Checkpoints {
    pub fn open(path: &Path) -> Result<Checkpoints, redb::Error> {
        let db = Database::create(path)?;
        let tx = db.begin_write()?;
        tx.open_table(CHECKPOINTS)?;
        tx.open_table(CHECKPOINT_TIMES)?;
        tx.commit()?;
        Ok(Checkpoints { db: Arc::new(db) })
    }

    fn writer(&self) -> mpsc::Sender<(u64, u64, Vec<u8>)> {
        let (tx, rx) = mpsc::channel::<(u64, u64, Vec<u8>)>();
        let db = self.db.clone();
        std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(move || {
                for (index, time_ms, bytes) in rx {
                    if let Err(e) = write_checkpoint(&db, index, time_ms, &bytes) {
                        tracing::warn!(index, error = %e, "could not write a replay checkpoint; replay will fold from an older one");
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
        match found {
            Some(Ok((_, v))) => State::from_bytes(v.value()).map(Some),
            Some(Err(e)) => Err(e.to_string()),
            None => Ok(None),
        }
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

fn write_checkpoint(db: &Database, index: u64, time_ms: u64, bytes: &[u8]) -> Result<(), redb::Error> {
    let tx = db.begin_write()?;
    {
        let mut t = tx.open_table(CHECKPOINTS)?;
        t.insert(index, bytes)?;
        let mut times = tx.open_table(CHECKPOINT_TIMES)?;
        times.insert(index, time_ms)?;
    }
    tx.commit()?;
    Ok(())
}
