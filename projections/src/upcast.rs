//! Upcasters lift an event payload written under an older schema version to the
//! current one, one version step at a time (`vN -> vN+1`), so old logs always decode.
//!
//! Adding schema version N+1: freeze the old .proto as `proto/.../vN/`, bump
//! [`CURRENT_SCHEMA_VERSION`], add one `Step` per changed event type below, and add a
//! golden log of version N to `replay-tests/golden/`. Types that did not change
//! between two versions need no step: their bytes are valid as they are.

use crate::schema::{CURRENT_SCHEMA_VERSION, DecodeError};

/// One migration of one event type from `from_version` to `from_version + 1`.
pub struct Step {
    pub event_type: &'static str,
    pub from_version: u32,
    pub lift: fn(&[u8]) -> Result<Vec<u8>, DecodeError>,
}

/// Every migration this project has ever needed, oldest first.
/// Schema version 1 is the first version written, so there is none yet.
pub const STEPS: &[Step] = &[];

/// Lifts `payload` of `event_type` written at `version` to the current version.
pub fn to_current(event_type: &str, version: u32, payload: &[u8]) -> Result<Vec<u8>, DecodeError> {
    lift_with(STEPS, event_type, version, payload)
}

/// The chain walk itself, over an explicit step table (tests pass their own).
pub fn lift_with(steps: &[Step], event_type: &str, version: u32, payload: &[u8]) -> Result<Vec<u8>, DecodeError> {
    if version == 0 {
        return Err(DecodeError::Malformed {
            ty: event_type.to_string(),
            reason: "schema version 0 was never written".into(),
        });
    }
    let mut bytes = payload.to_vec();
    for v in version..CURRENT_SCHEMA_VERSION {
        if let Some(step) = steps.iter().find(|s| s.event_type == event_type && s.from_version == v) {
            bytes = (step.lift)(&bytes)?;
        }
    }
    Ok(bytes)
}
