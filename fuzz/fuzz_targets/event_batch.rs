//! Event and batch decoding, and folding: every log entry is decoded as a `Batch`, its
//! envelopes as events (`Event::from_envelope`, through the upcasters), and the batches
//! are folded in order into one fresh `State`, whose views are then serialised. None of
//! it may panic, whatever the bytes: a follower folds what its log holds.
//!
//! Input: log entries in the golden-log framing (`opendsec_fuzz::log_entries`).
#![no_main]

use libfuzzer_sys::fuzz_target;
use opendsec_projections::schema::{self, Event};
use opendsec_projections::state::{State, VIEW_NAMES};

fuzz_target!(|data: &[u8]| {
    let mut state = State::new();
    for (index, entry) in opendsec_fuzz::log_entries(data) {
        match schema::decode_batch(entry) {
            Ok(batch) => {
                for envelope in &batch.events {
                    let _ = Event::from_envelope(envelope);
                }
                let _ = schema::batch_events(&batch);
                state.apply_batch(index, &batch);
            }
            // The fold's own path for an entry that does not decode.
            Err(_) => {
                state.apply_encoded(index, entry);
            }
        }
    }
    let _ = state.hash();
    for view in VIEW_NAMES {
        let _ = state.view_json(view);
    }
});
