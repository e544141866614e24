//! OpenDsec's projections: the meaning of the event schema.
//!
//! `schema` defines the events and their versioned envelope, `upcast` lifts old
//! versions, `views` are the read models, `state` folds log batches into them,
//! `lifecycle` is the one definition of a sandbox's state transitions (the edges fold
//! through it too) and `replay` rebuilds the views at any past point. Architecture invariant: nothing here
//! does IO, reads a clock or draws a random number; the same log always yields
//! byte-identical views.

pub mod diff;
pub mod lifecycle;
pub mod replay;
pub mod schema;
pub mod state;
pub mod upcast;
pub mod views;

pub use lifecycle::Lifecycle;
pub use schema::{Event, pb};
pub use state::{
    MAX_PROJECT_DEPTH, Outcome, REQUEST_WINDOW_MAX, REQUEST_WINDOW_MS, Requests, RequestsDelta, Retention, SeenRequest,
    State, VIEW_NAMES,
};
pub use views::*;
