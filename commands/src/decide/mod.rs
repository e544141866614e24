//! `decide`: authorise, validate, choose, and say what happened as events.
//!
//! `decide_excluding` resolves the caller and dispatches each command to its family's
//! module (projects and quotas, tokens, edges, cluster membership, sandboxes, forks,
//! tasks, snapshots, images); each family decides in a `Scope` (state, in-flight overlay,
//! context, caller) and places sandboxes through `place`. `batch_for` turns the outcome
//! into the log entry, accepted or denied.

mod cluster;
mod edges;
mod forks;
mod images;
pub mod network;
mod place;
mod projects;
mod sandboxes;
mod scope;
mod snapshots;
mod tasks;
mod templates;
mod tokens;

use crate::inflight::InFlight;
use crate::{Caller, Command, Ctx, Rejection};
use opendsec_projections::schema::{Batch, Denial, Principal};
use opendsec_projections::{Event, State};
use scope::Scope;
use std::collections::BTreeSet;

/// A command's accepted outcome: its events and what the audit view records it against.
#[derive(Clone, Debug, PartialEq)]
pub struct Decided {
    pub events: Vec<Event>,
    pub project: String,
    pub target: String,
}

impl Decided {
    /// The sandboxes this decision creates (a create's one, a fork's copies), in order.
    pub fn created_sandboxes(&self) -> Vec<String> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::SandboxCreated(c) => Some(c.id.clone()),
                _ => None,
            })
            .collect()
    }

    /// A decision of one event.
    fn one(project: &str, target: &str, event: Event) -> Decided {
        Decided {
            events: vec![event],
            project: project.to_string(),
            target: target.to_string(),
        }
    }
}

/// Decides a command against the applied `state` plus the `inflight` overlay.
pub fn decide(state: &State, inflight: &InFlight, cmd: &Command, ctx: &Ctx) -> Result<Decided, Rejection> {
    decide_excluding(state, inflight, cmd, ctx, &BTreeSet::new())
}

/// `decide`, placing sandboxes on none of the edges in `refused_by` (edges that refused
/// them at admission); the refusals are recorded in the placement.
pub fn decide_excluding(
    state: &State,
    inflight: &InFlight,
    cmd: &Command,
    ctx: &Ctx,
    refused_by: &BTreeSet<String>,
) -> Result<Decided, Rejection> {
    // Bootstrap creates the first token: there is no caller to resolve yet.
    if let Command::Bootstrap {
        project_name,
        token_name,
        secret_sha256,
    } = cmd
    {
        return projects::bootstrap(state, inflight, ctx, project_name, token_name, secret_sha256);
    }
    let s = Scope {
        state,
        inflight,
        ctx,
        who: scope::resolve(state, inflight, ctx)?,
        refused_by,
    };
    match cmd {
        Command::Bootstrap { .. } => unreachable!("decided before the caller is resolved"),
        Command::CreateProject { name, parent } => projects::create(&s, name, parent),
        Command::DeleteProject { project } => projects::delete(&s, project),
        Command::SetQuota { project, limits } => projects::set_quota(&s, project, limits),
        Command::SetRateLimits {
            project,
            writes_per_second,
            token_writes_per_second,
        } => projects::set_rate_limits(&s, project, *writes_per_second, *token_writes_per_second),
        Command::SetProjectNetwork {
            project,
            ceiling,
            default_network,
        } => network::set_project(&s, project, *ceiling, default_network.as_deref()),
        Command::IssueToken {
            project,
            name,
            rights,
            ttl_seconds,
            secret_sha256,
        } => tokens::issue(&s, project, name, rights, *ttl_seconds, secret_sha256),
        Command::RevokeToken { token, reason } => tokens::revoke(&s, token, reason),
        Command::RegisterEdge {
            edge,
            address,
            capacity,
            labels,
        } => edges::register(&s, edge, address, capacity, labels),
        Command::DeregisterEdge { edge } => edges::deregister(&s, edge),
        Command::AddClusterMember { node_id, address } => cluster::add_member(&s, *node_id, address),
        Command::RemoveClusterMember { node_id } => cluster::remove_member(&s, *node_id),
        Command::SetRetention {
            ended_sandboxes_seconds,
            audit_seconds,
            audit_records,
        } => cluster::set_retention(&s, *ended_sandboxes_seconds, *audit_seconds, *audit_records),
        Command::CreateSandbox {
            project,
            image,
            cpu_millis,
            memory_mb,
            labels,
            timeout_seconds,
            opts,
        } => sandboxes::create(
            &s,
            sandboxes::Create {
                project,
                image,
                cpu_millis: *cpu_millis,
                memory_mb: *memory_mb,
                labels,
                timeout_seconds: *timeout_seconds,
                opts,
            },
        ),
        Command::PauseSandbox { sandbox, filesystem } => sandboxes::pause(&s, sandbox, *filesystem),
        Command::ResumeSandbox { sandbox, cold } => sandboxes::resume(&s, sandbox, *cold),
        Command::KillSandbox { sandbox } => sandboxes::kill(&s, sandbox),
        Command::SetSandboxTimeout {
            sandbox,
            timeout_seconds,
        } => sandboxes::set_timeout(&s, sandbox, *timeout_seconds),
        Command::SetSandboxLabels { sandbox, labels } => sandboxes::set_labels(&s, sandbox, labels),
        Command::SetSandboxNetwork { sandbox, network } => network::set(&s, sandbox, network),
        Command::ReportSandbox { sandbox, observation } => sandboxes::report(&s, sandbox, observation),
        Command::ForkSandbox { sandbox, count, edge } => forks::fork(&s, sandbox, *count, edge.as_deref()),
        Command::PauseTask { task } => tasks::pause(&s, task),
        Command::ResumeTask { task } => tasks::resume(&s, task),
        Command::CreateSnapshot { sandbox, name } => snapshots::create(&s, sandbox, name),
        Command::DeleteSnapshot { snapshot } => snapshots::delete(&s, snapshot),
        Command::ReportSnapshot { snapshot, result } => snapshots::report(&s, snapshot, result),
        Command::PullImage {
            project,
            name,
            reference,
            edge,
        } => images::pull(&s, project, name, reference, edge.as_deref()),
        Command::ImportImage { project, name, edge } => images::import(&s, project, name, edge.as_deref()),
        Command::PackSandbox {
            sandbox,
            name,
            scrub,
            config,
        } => images::pack(&s, sandbox, name, scrub, config.as_ref()),
        Command::DeleteImage { name } => images::delete(&s, name),
        Command::ReportImage { name, result } => images::report(&s, name, result),
        Command::RequestTemplateBuild {
            project,
            name,
            tags,
            cpu_count,
            memory_mb,
        } => templates::request(&s, project, name.as_deref(), tags, *cpu_count, *memory_mb),
        Command::StartTemplateBuild {
            template,
            build,
            from,
            start_cmd,
            ready_cmd,
            steps,
            runner,
        } => templates::start(
            &s,
            template,
            build,
            templates::Start {
                from,
                start_cmd: start_cmd.as_deref(),
                ready_cmd: ready_cmd.as_deref(),
                steps: *steps,
                runner,
            },
        ),
        Command::FinishTemplateBuild {
            template,
            build,
            error,
            error_step,
        } => templates::finish(&s, template, build, error.as_deref(), error_step.as_deref()),
        Command::SetTemplateTags { template, build, tags } => templates::set_tags(&s, template, build.as_deref(), tags),
        Command::DeleteTemplate { template } => templates::delete(&s, template),
    }
}

/// What names a request beside its id: SHA-256 of the caller and the command ("" for a
/// request without an id, which is never deduplicated). A retry (same id, same caller,
/// same command) has the same digest; an id reused for another request does not.
pub fn request_digest(cmd: &Command, ctx: &Ctx) -> String {
    use sha2::Digest;
    if ctx.request_id.is_empty() {
        return String::new();
    }
    let caller = match &ctx.caller {
        Caller::System => "system".to_string(),
        Caller::Token(id) => format!("token:{id}"),
    };
    let command = serde_json::to_vec(cmd).expect("a command serialises");
    let mut h = sha2::Sha256::new();
    h.update(caller.as_bytes());
    h.update([0]);
    h.update(&command);
    hex::encode(h.finalize())
}

/// The log entry for a decision, or `None` when the refusal is not to be logged
/// (bad input, unknown ids, failed authentication leave the log unchanged).
pub fn batch_for(cmd: &Command, ctx: &Ctx, state: &State, decided: &Result<Decided, Rejection>) -> Option<Batch> {
    let principal = match &ctx.caller {
        Caller::System => Principal {
            kind: "system".into(),
            id: String::new(),
            project: String::new(),
        },
        Caller::Token(id) => Principal {
            kind: "token".into(),
            id: id.clone(),
            project: state.iam.tokens.get(id).map(|t| t.project.clone()).unwrap_or_default(),
        },
    };
    let mut batch = Batch {
        time_ms: ctx.time_ms,
        request_id: ctx.request_id.clone(),
        principal: Some(principal),
        action: cmd.action().to_string(),
        project: String::new(),
        target: String::new(),
        events: vec![],
        denial: None,
        seed: ctx.seed,
        request_digest: request_digest(cmd, ctx),
    };
    match decided {
        Ok(d) => {
            batch.project = d.project.clone();
            batch.target = d.target.clone();
            batch.events = d.events.iter().map(Event::to_envelope).collect();
        }
        Err(r) if r.kind.is_logged() => {
            let (project, target) = audit_subject(cmd, state);
            batch.project = project;
            batch.target = target;
            batch.denial = Some(Denial {
                code: r.kind.code().into(),
                message: r.message.clone(),
                field: r.field.clone().unwrap_or_default(),
            });
        }
        Err(_) => return None,
    }
    Some(batch)
}

/// What a refused command was aimed at, for the audit view.
fn audit_subject(cmd: &Command, state: &State) -> (String, String) {
    let sandbox_project = |id: &str| {
        state
            .sandboxes
            .sandboxes
            .get(id)
            .map(|s| s.project.clone())
            .unwrap_or_default()
    };
    match cmd {
        Command::Bootstrap { project_name, .. } => (String::new(), project_name.clone()),
        Command::CreateProject { name, parent } => (parent.clone(), name.clone()),
        Command::DeleteProject { project }
        | Command::SetQuota { project, .. }
        | Command::SetProjectNetwork { project, .. }
        | Command::SetRateLimits { project, .. } => (project.clone(), project.clone()),
        Command::IssueToken { project, name, .. } => (project.clone(), name.clone()),
        Command::RevokeToken { token, .. } => (
            state
                .iam
                .tokens
                .get(token)
                .map(|t| t.project.clone())
                .unwrap_or_default(),
            token.clone(),
        ),
        Command::RegisterEdge { edge, .. } | Command::DeregisterEdge { edge } => (String::new(), edge.clone()),
        Command::AddClusterMember { node_id, .. } | Command::RemoveClusterMember { node_id } => {
            (String::new(), format!("node:{node_id}"))
        }
        Command::SetRetention { .. } => (String::new(), "retention".into()),
        Command::CreateSandbox { project, image, .. } => (project.clone(), image.clone()),
        Command::ForkSandbox { sandbox, .. }
        | Command::PauseSandbox { sandbox, .. }
        | Command::ResumeSandbox { sandbox, .. }
        | Command::KillSandbox { sandbox }
        | Command::SetSandboxTimeout { sandbox, .. }
        | Command::SetSandboxLabels { sandbox, .. }
        | Command::SetSandboxNetwork { sandbox, .. }
        | Command::CreateSnapshot { sandbox, .. }
        | Command::ReportSandbox { sandbox, .. } => (sandbox_project(sandbox), sandbox.clone()),
        Command::PauseTask { task } | Command::ResumeTask { task } => (String::new(), tasks::task_target(task)),
        Command::PackSandbox { sandbox, name, .. } => (sandbox_project(sandbox), name.clone()),
        Command::PullImage { project, name, .. } | Command::ImportImage { project, name, .. } => {
            (project.clone(), name.clone())
        }
        Command::DeleteImage { name } | Command::ReportImage { name, .. } => (
            state
                .images
                .images
                .get(name)
                .map(|x| x.project.clone())
                .unwrap_or_default(),
            name.clone(),
        ),
        Command::RequestTemplateBuild { project, name, .. } => (project.clone(), name.clone().unwrap_or_default()),
        Command::StartTemplateBuild { template, .. }
        | Command::FinishTemplateBuild { template, .. }
        | Command::SetTemplateTags { template, .. }
        | Command::DeleteTemplate { template } => (
            state
                .images
                .template_named(template)
                .map(|t| t.project.clone())
                .unwrap_or_default(),
            template.clone(),
        ),
        Command::DeleteSnapshot { snapshot } | Command::ReportSnapshot { snapshot, .. } => (
            state
                .snapshots
                .snapshots
                .get(snapshot)
                .map(|x| x.project.clone())
                .unwrap_or_default(),
            snapshot.clone(),
        ),
    }
}
