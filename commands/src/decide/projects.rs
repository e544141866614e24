//! Projects and their quotas: the cluster's bootstrap (the root project and its first
//! token), child projects, and limits that never exceed a parent's or fall below usage.

use super::Decided;
use super::scope::{Scope, hex32};
use crate::inflight::InFlight;
use crate::placement::Rng;
use crate::validate::{self, LIMITS};
use crate::{Caller, Ctx, Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::state::limits_to_pb;
use opendsec_projections::{Event, Limits, Right, State};

/// `Bootstrap`: decided before any caller is resolved, since no token exists yet.
pub(super) fn bootstrap(
    state: &State,
    inflight: &InFlight,
    ctx: &Ctx,
    project_name: &str,
    token_name: &str,
    secret_sha256: &str,
) -> Result<Decided, Rejection> {
    if ctx.caller != Caller::System {
        return Err(Rejection::new(K::Forbidden, "only the system can bootstrap a cluster"));
    }
    validate::name("project_name", project_name)?;
    validate::name("token_name", token_name)?;
    let hash = hex32("secret_sha256", secret_sha256)?;
    if state.root_project().is_some() || inflight.project_name_taken("", project_name) {
        return Err(Rejection::new(K::Conflict, "the cluster is already initialised"));
    }
    let mut rng = Rng::new(ctx.seed);
    let project = format!("p{:012x}", rng.next_u64() >> 16);
    let token = format!("{:016x}", rng.next_u64());
    Ok(Decided {
        events: vec![
            Event::ProjectCreated(pb::ProjectCreated {
                id: project.clone(),
                name: project_name.to_string(),
                parent: String::new(),
            }),
            Event::TokenIssued(pb::TokenIssued {
                id: token.clone(),
                project: project.clone(),
                name: token_name.to_string(),
                rights: Right::ALL.iter().map(|r| r.as_str().to_string()).collect(),
                secret_sha256: hash,
                expires_at_ms: 0,
                issued_by: String::new(),
            }),
        ],
        project,
        target: token,
    })
}

/// `CreateProject`.
pub(super) fn create(s: &Scope, name: &str, parent: &str) -> Result<Decided, Rejection> {
    let (state, who) = (s.state, &s.who);
    validate::name("name", name)?;
    s.project_in_scope("parent", parent)?;
    who.require(Right::ProjectWrite)?;
    if state.ancestry(parent).len() >= opendsec_projections::MAX_PROJECT_DEPTH {
        return Err(Rejection::field(
            K::Invalid,
            "parent",
            format!(
                "projects nest at most {} deep: project {parent} is at the deepest level",
                opendsec_projections::MAX_PROJECT_DEPTH
            ),
        ));
    }
    let p = &state.iam.projects[parent];
    let taken = p
        .children
        .iter()
        .any(|c| state.iam.projects.get(c).is_some_and(|x| x.name == name));
    if taken || s.inflight.project_name_taken(parent, name) {
        return Err(Rejection::field(
            K::Conflict,
            "name",
            format!("project {parent} already has a child named {name}"),
        ));
    }
    let id = format!("p{:012x}", s.rng().next_u64() >> 16);
    Ok(Decided::one(
        parent,
        &id,
        Event::ProjectCreated(pb::ProjectCreated {
            id: id.clone(),
            name: name.to_string(),
            parent: parent.to_string(),
        }),
    ))
}

/// `DeleteProject`.
pub(super) fn delete(s: &Scope, project: &str) -> Result<Decided, Rejection> {
    let (state, who) = (s.state, &s.who);
    s.project_in_scope("project", project)?;
    who.require(Right::ProjectWrite)?;
    if project == who.project {
        return Err(Rejection::field(
            K::Forbidden,
            "project",
            "a caller cannot delete its own project",
        ));
    }
    let p = &state.iam.projects[project];
    if !p.children.is_empty() {
        return Err(Rejection::field(
            K::Conflict,
            "project",
            format!("project {project} still has child projects"),
        ));
    }
    let live = state.quota.usage.get(project).is_some_and(|u| u.sandboxes > 0)
        || s.inflight.project_usage(project).sandboxes > 0;
    if live {
        return Err(Rejection::field(
            K::Conflict,
            "project",
            format!("project {project} still has live sandboxes"),
        ));
    }
    Ok(Decided::one(
        project,
        project,
        Event::ProjectDeleted(pb::ProjectDeleted {
            id: project.to_string(),
        }),
    ))
}

/// The most writes a second a rate may allow.
pub const MAX_RATE: u64 = 1_000_000;

/// `SetRateLimits`.
pub(super) fn set_rate_limits(
    s: &Scope,
    project: &str,
    writes_per_second: Option<u64>,
    token_writes_per_second: Option<u64>,
) -> Result<Decided, Rejection> {
    for (f, v) in [
        ("writes_per_second", writes_per_second),
        ("token_writes_per_second", token_writes_per_second),
    ] {
        if v == Some(0) {
            return Err(Rejection::field(
                K::Invalid,
                f,
                format!("{f} must be at least 1 (leave it out for no rate of the project's own)"),
            ));
        }
        if let Some(v) = v {
            validate::amount(f, v, MAX_RATE)?;
        }
    }
    s.project_in_scope("project", project)?;
    s.who.require(Right::QuotaWrite)?;
    let p = &s.state.iam.projects[project];
    if project == s.who.project && p.parent.is_some() && !s.who.is_system() {
        return Err(Rejection::field(
            K::Forbidden,
            "project",
            "a caller cannot set its own project's rates; ask a parent project's admin",
        ));
    }
    if let Some(parent) = p.parent.as_deref() {
        let bound = s.state.effective_rates(parent);
        for (f, mine, theirs) in [
            ("writes_per_second", writes_per_second, bound.writes_per_second),
            (
                "token_writes_per_second",
                token_writes_per_second,
                bound.token_writes_per_second,
            ),
        ] {
            if let (Some(mine), Some(theirs)) = (mine, theirs)
                && mine > theirs
            {
                return Err(Rejection::field(
                    K::Invalid,
                    f,
                    format!("{f} = {mine} is above the parent project's {theirs}"),
                ));
            }
        }
    }
    Ok(Decided::one(
        project,
        project,
        Event::ProjectRateLimitsSet(pb::ProjectRateLimitsSet {
            project: project.to_string(),
            writes_per_second: writes_per_second.unwrap_or(0),
            token_writes_per_second: token_writes_per_second.unwrap_or(0),
        }),
    ))
}

/// `SetQuota`.
pub(super) fn set_quota(s: &Scope, project: &str, limits: &Limits) -> Result<Decided, Rejection> {
    let (state, who) = (s.state, &s.who);
    for (f, v, max) in [
        ("limits.sandboxes", limits.sandboxes, LIMITS.sandboxes),
        ("limits.cpu_millis", limits.cpu_millis, LIMITS.cpu_millis),
        ("limits.memory_mb", limits.memory_mb, LIMITS.memory_mb),
    ] {
        if let Some(v) = v {
            validate::amount(f, v, max)?;
        }
    }
    s.project_in_scope("project", project)?;
    who.require(Right::QuotaWrite)?;
    let p = &state.iam.projects[project];
    let is_root = p.parent.is_none();
    // Only the root project's admins may set the root's own limits.
    if project == who.project && !is_root && !who.is_system() {
        return Err(Rejection::field(
            K::Forbidden,
            "project",
            "a caller cannot raise its own project's quota; ask a parent project's admin",
        ));
    }
    let bound = state.bound_for_child_of(p.parent.as_deref());
    if let Some((res, mine, theirs)) = limits.exceeds(&bound) {
        let mine = if mine == u64::MAX {
            "unlimited".into()
        } else {
            mine.to_string()
        };
        return Err(Rejection::field(
            K::Invalid,
            &format!("limits.{res}"),
            format!("{res} limit {mine} exceeds the parent project's limit {theirs}"),
        ));
    }
    if let Some((c, res, m)) = state.descendant_limit_above(project, limits) {
        return Err(Rejection::field(
            K::Conflict,
            &format!("limits.{res}"),
            format!("child project {c} has a {res} limit of {m}, above the new limit"),
        ));
    }
    let used = state
        .quota
        .usage
        .get(project)
        .copied()
        .unwrap_or_default()
        .plus(&s.inflight.project_usage(project));
    if let Some((res, limit)) = limits.exceeded_by(&used) {
        return Err(Rejection::field(
            K::Conflict,
            &format!("limits.{res}"),
            format!("{res} limit {limit} is below the project's current usage"),
        ));
    }
    Ok(Decided::one(
        project,
        project,
        Event::QuotaSet(pb::QuotaSet {
            project: project.to_string(),
            limits: Some(limits_to_pb(limits)),
        }),
    ))
}
