//! What every command's decision starts from: the resolved caller (`Who`) and the
//! `Scope` a family's function decides in, with the checks they share (is the project
//! in the caller's subtree, is the sandbox live, is the caller the root project's).

use crate::inflight::InFlight;
use crate::placement::Rng;
use crate::validate;
use crate::{Caller, Ctx, Rejection, RejectionKind as K};
use opendsec_projections::{Right, Sandbox, State};
use std::collections::BTreeSet;

/// The resolved caller: its scope (a project subtree), rights and expiry.
pub(super) struct Who {
    pub token: Option<String>,
    pub project: String,
    pub rights: BTreeSet<Right>,
    pub expires_at_ms: Option<u64>,
}

impl Who {
    pub fn require(&self, right: Right) -> Result<(), Rejection> {
        if self.rights.contains(&right) {
            Ok(())
        } else {
            Err(Rejection::new(
                K::Forbidden,
                format!("the caller lacks the right {}", right.as_str()),
            ))
        }
    }
    pub fn is_system(&self) -> bool {
        self.token.is_none()
    }
}

/// Resolves `ctx.caller` against the token view and the tokens being revoked.
pub(super) fn resolve(state: &State, inflight: &InFlight, ctx: &Ctx) -> Result<Who, Rejection> {
    match &ctx.caller {
        Caller::System => Ok(Who {
            token: None,
            project: state.root_project().map(|p| p.id.clone()).unwrap_or_default(),
            rights: Right::ALL.into_iter().collect(),
            expires_at_ms: None,
        }),
        Caller::Token(id) => {
            let unauth = |why: &str| Rejection::new(K::Unauthenticated, format!("token {id} {why}"));
            let t = state.iam.tokens.get(id).ok_or_else(|| unauth("is unknown"))?;
            if t.revoked.is_some() || inflight.token_being_revoked(id) {
                return Err(unauth("is revoked"));
            }
            if t.expires_at_ms.is_some_and(|e| ctx.time_ms >= e) {
                return Err(unauth("has expired"));
            }
            Ok(Who {
                token: Some(id.clone()),
                project: t.project.clone(),
                rights: t.rights.clone(),
                expires_at_ms: t.expires_at_ms,
            })
        }
    }
}

/// Everything one command is decided in: the applied state, the in-flight overlay, the
/// request's context, its resolved caller and the edges that refused it at admission.
pub(super) struct Scope<'a> {
    pub state: &'a State,
    pub inflight: &'a InFlight,
    pub ctx: &'a Ctx,
    pub who: Who,
    pub refused_by: &'a BTreeSet<String>,
}

impl Scope<'_> {
    /// The decision's random choices all come from the request's seed, so a replay of
    /// the same command against the same state chooses the same ids and edges.
    pub fn rng(&self) -> Rng {
        Rng::new(self.ctx.seed)
    }

    /// Checks that `project` exists and lies in the caller's subtree.
    pub fn project_in_scope(&self, field: &str, project: &str) -> Result<(), Rejection> {
        validate::id(field, project)?;
        if !self.state.iam.projects.contains_key(project) {
            return Err(not_found(field, "project", project));
        }
        if !self.state.within(project, &self.who.project) {
            return Err(Rejection::field(
                K::Forbidden,
                field,
                format!("project {project} is outside the caller's project {}", self.who.project),
            ));
        }
        Ok(())
    }

    /// The live sandbox `id` of the caller's subtree, once the caller holds `right`.
    pub fn live_sandbox(&self, id: &str, right: Right) -> Result<&Sandbox, Rejection> {
        validate::id("sandbox", id)?;
        let s = self
            .state
            .sandboxes
            .sandboxes
            .get(id)
            .ok_or_else(|| not_found("sandbox", "sandbox", id))?;
        self.who.require(right)?;
        if !self.state.within(&s.project, &self.who.project) {
            return Err(Rejection::field(
                K::Forbidden,
                "sandbox",
                format!("sandbox {id} is outside the caller's project"),
            ));
        }
        if !s.is_live() {
            return Err(Rejection::field(
                K::Conflict,
                "sandbox",
                format!("sandbox {id} has ended"),
            ));
        }
        Ok(s)
    }

    /// Edges and the control plane serve the whole cluster: only the root project's
    /// principals manage them.
    pub fn require_root(&self) -> Result<(), Rejection> {
        if self.who.is_system() || self.state.root_project().is_some_and(|r| r.id == self.who.project) {
            Ok(())
        } else {
            Err(Rejection::new(
                K::Forbidden,
                "edges are managed by the root project's principals only",
            ))
        }
    }

    /// Whether the caller acts for `edge`: the token that registered it (or the system,
    /// or anyone for an edge registered before edges were bound to their tokens). Every
    /// edge's report, and its registration again, goes through here, so a stolen edge
    /// token speaks for its own edge only.
    pub fn acts_for_edge(&self, field: &str, edge: &str) -> Result<(), Rejection> {
        let owner = self.state.placement.edges.get(edge).and_then(|e| e.token.as_deref());
        match (owner, self.who.token.as_deref()) {
            (None, _) | (_, None) => Ok(()),
            (Some(o), Some(t)) if o == t => Ok(()),
            _ => Err(Rejection::field(
                K::Forbidden,
                field,
                format!("edge {edge} is registered by another token: only its own token acts for it"),
            )),
        }
    }

    /// The time `seconds` from now in ms, or 0 (never) for none or zero.
    pub fn expiry(&self, seconds: Option<u64>) -> u64 {
        match seconds {
            Some(s) if s > 0 => self.ctx.time_ms.saturating_add(s.saturating_mul(1000)),
            _ => 0,
        }
    }
}

pub(super) fn not_found(field: &str, what: &str, id: &str) -> Rejection {
    Rejection::field(K::NotFound, field, format!("{what} {id} does not exist"))
}

pub(super) fn hex32(field: &str, v: &str) -> Result<Vec<u8>, Rejection> {
    match hex::decode(v) {
        Ok(b) if b.len() == 32 => Ok(b),
        _ => Err(Rejection::field(
            K::Invalid,
            field,
            format!("{field} must be 64 hex digits (a SHA-256)"),
        )),
    }
}
