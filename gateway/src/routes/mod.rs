//! The handlers, one module per resource. Each write builds a `Command` and goes
//! through `crate::submit`; each read checks a right and the caller's scope.

pub mod agent;
pub mod audit;
pub mod cluster;
pub mod edges;
pub mod images;
pub mod projects;
pub mod replay;
pub mod sandboxes;
pub mod snapshots;
pub mod tasks;
pub mod tokens;

pub use crate::health;

use crate::error::ApiError;
use crate::extract::Authed;
use opendsec_projections::State;

/// A project the caller may see, or why not.
pub(crate) fn visible_project<'a>(
    state: &'a State,
    who: &Authed,
    field: &str,
    id: &str,
) -> Result<&'a opendsec_projections::Project, ApiError> {
    let p = state
        .iam
        .projects
        .get(id)
        .ok_or_else(|| ApiError::not_found(field, format!("project {id} does not exist")))?;
    if !who.sees(state, id) {
        return Err(ApiError::forbidden(format!(
            "project {id} is outside this token's project {}",
            who.0.project
        )));
    }
    Ok(p)
}
