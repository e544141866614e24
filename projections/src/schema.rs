//! The event schema: prost types generated from `proto/`, the closed `Event` enum
//! over them, and the versioned envelope every event travels in.
//!
//! Encoding always writes [`CURRENT_SCHEMA_VERSION`]; decoding accepts every version
//! this project has ever written and lifts older payloads through [`crate::upcast`].

use prost::Message;

/// Generated protobuf types of schema version 1.
pub mod pb {
    include!(concat!(env!("OUT_DIR"), "/opendsec.events.v1.rs"));
}

pub use pb::{Batch, Denial, Envelope, Principal, Resources};

/// The schema version this binary writes.
pub const CURRENT_SCHEMA_VERSION: u32 = 1;

/// Why an envelope could not be turned into an [`Event`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    /// event type `{0}` is unknown to this binary
    #[error("event type `{0}` is unknown to this binary")]
    UnknownType(String),
    /// event `{ty}` has schema version {version}, newer than this binary's {current}
    #[error("event `{ty}` has schema version {version}, newer than this binary's {current}")]
    FromTheFuture { ty: String, version: u32, current: u32 },
    /// event `{ty}` payload is not valid protobuf: {reason}
    #[error("event `{ty}` payload is not valid protobuf: {reason}")]
    Malformed { ty: String, reason: String },
}

macro_rules! events {
    ($($variant:ident),* $(,)?) => {
        /// Every event the log can hold. One variant per message in the schema.
        // Variants hold the decoded messages as they are: an event is decoded once and
        // folded, so boxing the largest (SandboxCreated) would cost more than its size.
        #[allow(clippy::large_enum_variant)]
        #[derive(Clone, Debug, PartialEq)]
        pub enum Event { $($variant(pb::$variant),)* }

        impl Event {
            /// The type name written into the envelope (the protobuf message name).
            pub fn type_name(&self) -> &'static str {
                match self { $(Event::$variant(_) => stringify!($variant),)* }
            }

            /// Wraps the event in an envelope of the current schema version.
            pub fn to_envelope(&self) -> Envelope {
                let payload = match self { $(Event::$variant(m) => m.encode_to_vec(),)* };
                Envelope {
                    r#type: self.type_name().to_string(),
                    schema_version: CURRENT_SCHEMA_VERSION,
                    payload,
                }
            }

            fn decode_current(ty: &str, payload: &[u8]) -> Result<Event, DecodeError> {
                let malformed = |e: prost::DecodeError| DecodeError::Malformed {
                    ty: ty.to_string(),
                    reason: e.to_string(),
                };
                match ty {
                    $(stringify!($variant) => pb::$variant::decode(payload).map(Event::$variant).map_err(malformed),)*
                    other => Err(DecodeError::UnknownType(other.to_string())),
                }
            }
        }
    };
}

events!(
    ProjectCreated,
    ProjectDeleted,
    QuotaSet,
    TokenIssued,
    TokenRevoked,
    EdgeRegistered,
    EdgeDeregistered,
    SandboxCreated,
    SandboxPauseRequested,
    SandboxResumeRequested,
    SandboxKillRequested,
    SandboxTimeoutSet,
    SandboxLabelsSet,
    SandboxForkRequested,
    SandboxReady,
    SandboxPaused,
    SandboxResumed,
    SandboxFailed,
    SandboxExited,
    ClusterMembershipChangeRequested,
    SandboxTimedOut,
    SandboxNetworkSet,
    SnapshotRequested,
    SnapshotReady,
    SnapshotFailed,
    SnapshotDeleted,
    SandboxOomKilled,
    ImageRequested,
    ImageReady,
    ImageFailed,
    ImageDeleted,
    TemplateBuildRequested,
    TemplateBuildStarted,
    TemplateBuildFinished,
    TemplateTagsSet,
    TemplateDeleted,
    ProjectNetworkSet,
    ProjectRateLimitsSet,
    RetentionSet,
);

impl Event {
    /// Decodes an envelope of any schema version this project has written.
    pub fn from_envelope(env: &Envelope) -> Result<Event, DecodeError> {
        if env.schema_version > CURRENT_SCHEMA_VERSION {
            return Err(DecodeError::FromTheFuture {
                ty: env.r#type.clone(),
                version: env.schema_version,
                current: CURRENT_SCHEMA_VERSION,
            });
        }
        let payload = crate::upcast::to_current(&env.r#type, env.schema_version, &env.payload)?;
        Event::decode_current(&env.r#type, &payload)
    }

    /// The sandbox this event is about, if any (used to route events to an edge's slice).
    pub fn sandbox_id(&self) -> Option<&str> {
        Some(match self {
            Event::SandboxCreated(e) => &e.id,
            Event::SandboxPauseRequested(e) => &e.id,
            Event::SandboxResumeRequested(e) => &e.id,
            Event::SandboxKillRequested(e) => &e.id,
            Event::SandboxTimeoutSet(e) => &e.id,
            Event::SandboxLabelsSet(e) => &e.id,
            Event::SandboxForkRequested(e) => &e.id,
            Event::SandboxReady(e) => &e.id,
            Event::SandboxPaused(e) => &e.id,
            Event::SandboxResumed(e) => &e.id,
            Event::SandboxFailed(e) => &e.id,
            Event::SandboxExited(e) => &e.id,
            Event::SandboxTimedOut(e) => &e.id,
            Event::SandboxNetworkSet(e) => &e.id,
            Event::SandboxOomKilled(e) => &e.id,
            // A snapshot lives on the edge of the sandbox it was taken from.
            Event::SnapshotRequested(e) => &e.sandbox,
            Event::SnapshotReady(e) => &e.sandbox,
            Event::SnapshotFailed(e) => &e.sandbox,
            Event::SnapshotDeleted(e) => &e.sandbox,
            _ => return None,
        })
    }
}

/// Encodes a batch for the log.
pub fn encode_batch(batch: &Batch) -> Vec<u8> {
    batch.encode_to_vec()
}

/// Decodes a batch read from the log.
pub fn decode_batch(bytes: &[u8]) -> Result<Batch, DecodeError> {
    Batch::decode(bytes).map_err(|e| DecodeError::Malformed {
        ty: "Batch".into(),
        reason: e.to_string(),
    })
}

/// Decodes every event of a batch, lifting old schema versions.
pub fn batch_events(batch: &Batch) -> Result<Vec<Event>, DecodeError> {
    batch.events.iter().map(Event::from_envelope).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_round_trips_through_its_envelope() {
        let ev = Event::SandboxExited(pb::SandboxExited {
            id: "abc".into(),
            exit_code: 137,
            oom_killed: true,
            reason: "oom".into(),
        });
        let env = ev.to_envelope();
        assert_eq!(env.r#type, "SandboxExited");
        assert_eq!(env.schema_version, CURRENT_SCHEMA_VERSION);
        assert_eq!(Event::from_envelope(&env).unwrap(), ev);
    }

    #[test]
    fn an_unknown_or_future_event_is_refused_by_name() {
        let env = Envelope {
            r#type: "Teleported".into(),
            schema_version: 1,
            payload: vec![],
        };
        assert_eq!(
            Event::from_envelope(&env),
            Err(DecodeError::UnknownType("Teleported".into()))
        );
        let env = Envelope {
            r#type: "SandboxReady".into(),
            schema_version: 99,
            payload: vec![],
        };
        assert!(matches!(
            Event::from_envelope(&env),
            Err(DecodeError::FromTheFuture { version: 99, .. })
        ));
    }
}
