//! Sandboxes: created from an image or a snapshot and placed on an edge; paused,
//! resumed, killed and changed while live; and what their edges report of them.
//!
//! The isolation (container by default, microVM or full VM) is chosen at create and
//! recorded in `SandboxCreated`. A machine's snapshot holds its memory: what starts from
//! it is that machine again, with its source's size, and asking for another isolation is
//! invalid; a container's file-system snapshot starts only containers. A machine needs
//! a least memory for its kernel and agent (`MICROVM_MIN_MEMORY_MB`, `FULLVM_MIN_MEMORY_MB`).

use super::Decided;
use super::place::{Where, place};
use super::scope::{Scope, not_found};
use crate::validate::{self, LIMITS};
use crate::{FULLVM_MIN_MEMORY_MB, MICROVM_MIN_MEMORY_MB, Observation, Rejection, RejectionKind as K, SandboxOptions};
use opendsec_projections::pb;
use opendsec_projections::{Event, Isolation, Right, SnapshotState, Usage, labels_growth, metadata_bytes};
use std::collections::BTreeMap;

/// What `CreateSandbox` asks for.
pub(super) struct Create<'a> {
    pub project: &'a str,
    pub image: &'a str,
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub labels: &'a BTreeMap<String, String>,
    pub timeout_seconds: Option<u64>,
    pub opts: &'a SandboxOptions,
}

/// Whether `name` has the form of a snapshot id (`snap-` + 16 hex digits).
fn is_snapshot_id(name: &str) -> bool {
    name.strip_prefix("snap-")
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// `CreateSandbox`.
pub(super) fn create(s: &Scope, c: Create<'_>) -> Result<Decided, Rejection> {
    let Create {
        project,
        image,
        cpu_millis,
        memory_mb,
        labels,
        timeout_seconds,
        opts,
    } = c;
    let state = s.state;
    if image.is_empty() {
        return Err(Rejection::field(K::Invalid, "image", "image must name an image"));
    }
    validate::text("image", image, LIMITS.image_len)?;
    validate::amount("cpu_millis", cpu_millis, LIMITS.cpu_millis)?;
    validate::amount("memory_mb", memory_mb, LIMITS.memory_mb)?;
    if cpu_millis == 0 || memory_mb == 0 {
        return Err(Rejection::field(
            K::Invalid,
            if cpu_millis == 0 { "cpu_millis" } else { "memory_mb" },
            "a sandbox needs some CPU and memory",
        ));
    }
    validate::labels("labels", labels)?;
    if let Some(t) = timeout_seconds {
        validate::amount("timeout_seconds", t, LIMITS.timeout_seconds)?;
    }
    validate::options("opts", opts)?;
    s.project_in_scope("project", project)?;
    s.who.require(Right::SandboxWrite)?;
    if let Some(key) = &opts.idempotency_key
        && let Some(existing) = state.sandboxes.by_idempotency_key(project, key)
    {
        return Err(Rejection::field(
            K::Conflict,
            "opts.idempotency_key",
            format!("sandbox {} was already created with this idempotency key", existing.id),
        ));
    }
    // An image, or a snapshot of this project's subtree (then it starts on the
    // snapshot's edge, from the snapshot's file system).
    let from = match state.snapshots.snapshots.get(image) {
        Some(snap) if state.within(&snap.project, &s.who.project) => {
            if snap.state != SnapshotState::Ready {
                return Err(Rejection::field(
                    K::Conflict,
                    "image",
                    format!("snapshot {image} is not ready yet"),
                ));
            }
            Some(snap)
        }
        // Snapshot ids are `snap-` + 16 hex digits: one that is not in the view was
        // deleted (or never taken), not an image to build.
        None if is_snapshot_id(image) => {
            return Err(Rejection::field(
                K::NotFound,
                "image",
                format!("snapshot {image} does not exist: it was deleted or never taken"),
            ));
        }
        _ => None,
    };
    // A template's name (`name[:tag]`, or its id) means the image of the build it names.
    let asked = image;
    let built = match from {
        None => super::templates::image_for(s, project, image)?,
        Some(_) => None,
    };
    let image = built.as_deref().unwrap_or(image);
    let image_source = match from {
        Some(snap) => super::images::source_of(state, &snap.image),
        None => super::images::resolve(s, project, image)?,
    };
    // A microVM's snapshot is a whole machine: what starts from it is that
    // machine again, with its size; a file-system snapshot is a container's layer.
    let snapshot_kind = from.map(|x| x.isolation);
    let isolation = match (opts.isolation, snapshot_kind) {
        (Some(asked), Some(kind)) if asked != kind => {
            let why = match kind {
                Isolation::Container => {
                    format!("snapshot {image} is a container's file system: only a container starts from it")
                }
                machine => format!(
                    "snapshot {image} holds a {0}'s memory: what starts from it is a {0}",
                    machine.noun()
                ),
            };
            return Err(Rejection::field(K::Invalid, "opts.isolation", why));
        }
        (_, Some(kind)) => kind,
        (asked, None) => asked.unwrap_or_default(),
    };
    let (mut cpu, mut memory) = (cpu_millis, memory_mb);
    if isolation.is_machine()
        && let Some(snap) = from
        && let Some(src) = state.sandboxes.sandboxes.get(&snap.sandbox)
    {
        (cpu, memory) = (src.cpu_millis, src.memory_mb);
    }
    let least = match isolation {
        Isolation::Container => 0,
        Isolation::Microvm => MICROVM_MIN_MEMORY_MB,
        Isolation::Vm => FULLVM_MIN_MEMORY_MB,
    };
    if memory < least {
        return Err(Rejection::field(
            K::Invalid,
            "memory_mb",
            format!("a {} needs at least {least} MB of memory", isolation.noun()),
        ));
    }
    // Its own policy within the project's ceiling, or the project's default (deny if none).
    let network = match &opts.network {
        Some(n) => {
            super::network::within_ceiling(s, project, "opts.network", n)?;
            n.clone()
        }
        None => state.default_network(project).unwrap_or_default().to_string(),
    };
    let usage = Usage {
        sandboxes: 1,
        cpu_millis: cpu,
        memory_mb: memory,
        metadata_bytes: metadata_bytes(&opts.env, labels),
    };
    // From a snapshot: preferably on the snapshot's edge; elsewhere it is pulled. From a
    // packed image: preferably on the edge holding it; elsewhere the create fails, saying
    // so (packed images do not move between edges yet).
    let packed = from
        .is_none()
        .then(|| super::images::packed_edge(s, project, image))
        .flatten();
    let to = match (from, packed) {
        (Some(snap), _) => Where::Prefer(&snap.edge),
        (None, Some(holder)) => Where::Prefer(holder),
        (None, None) => Where::Anywhere,
    };
    let placed = place(s, &mut s.rng(), project, usage, 1, to, isolation)?;
    let (id, edge, placement) = placed.into_iter().next().expect("place returns one per request");
    let source_edge = from
        .map(|snap| snap.edge.as_str())
        .or(packed)
        .unwrap_or_default()
        .to_string();
    let transfer = match from {
        Some(snap) if snap.edge != edge => snap.id.clone(),
        _ => String::new(),
    };
    Ok(Decided::one(
        project,
        &id,
        Event::SandboxCreated(pb::SandboxCreated {
            id: id.clone(),
            project: project.to_string(),
            edge,
            image: from.map(|snap| snap.image.clone()).unwrap_or_else(|| image.to_string()),
            cpu_millis: cpu,
            memory_mb: memory,
            labels: labels.clone(),
            expires_at_ms: s.expiry(timeout_seconds),
            fork_of: String::new(),
            placement: Some(placement),
            env: opts.env.clone(),
            auto_pause: opts.auto_pause,
            auto_pause_filesystem: opts.auto_pause && opts.auto_pause_filesystem,
            auto_resume: opts.auto_resume,
            snapshot: from.map(|snap| snap.id.clone()).unwrap_or_default(),
            template: asked.to_string(),
            network,
            isolation: isolation.to_event(),
            idempotency_key: opts.idempotency_key.clone().unwrap_or_default(),
            source_edge,
            transfer,
            cpu_class: opts.cpu_class.unwrap_or_default().to_event(),
            image_source,
        }),
    ))
}

/// `PauseSandbox`.
pub(super) fn pause(s: &Scope, sandbox: &str, filesystem: bool) -> Result<Decided, Rejection> {
    let x = s.live_sandbox(sandbox, Right::SandboxWrite)?;
    Ok(Decided::one(
        &x.project,
        sandbox,
        Event::SandboxPauseRequested(pb::SandboxPauseRequested {
            id: sandbox.to_string(),
            filesystem,
        }),
    ))
}

/// `ResumeSandbox`.
pub(super) fn resume(s: &Scope, sandbox: &str, cold: bool) -> Result<Decided, Rejection> {
    let x = s.live_sandbox(sandbox, Right::SandboxWrite)?;
    Ok(Decided::one(
        &x.project,
        sandbox,
        Event::SandboxResumeRequested(pb::SandboxResumeRequested {
            id: sandbox.to_string(),
            cold,
        }),
    ))
}

/// `KillSandbox`: by a user, or by the system at the sandbox's timeout.
pub(super) fn kill(s: &Scope, sandbox: &str) -> Result<Decided, Rejection> {
    let x = s.live_sandbox(sandbox, Right::SandboxWrite)?;
    let reason = if s.who.is_system() { "timeout" } else { "user" };
    Ok(Decided::one(
        &x.project,
        sandbox,
        Event::SandboxKillRequested(pb::SandboxKillRequested {
            id: sandbox.to_string(),
            reason: reason.into(),
        }),
    ))
}

/// `SetSandboxTimeout`.
pub(super) fn set_timeout(s: &Scope, sandbox: &str, timeout_seconds: u64) -> Result<Decided, Rejection> {
    validate::amount("timeout_seconds", timeout_seconds, LIMITS.timeout_seconds)?;
    let x = s.live_sandbox(sandbox, Right::SandboxWrite)?;
    let at = s.expiry(Some(timeout_seconds));
    Ok(Decided::one(
        &x.project,
        sandbox,
        Event::SandboxTimeoutSet(pb::SandboxTimeoutSet {
            id: sandbox.to_string(),
            expires_at_ms: at,
        }),
    ))
}

/// `SetSandboxLabels`.
pub(super) fn set_labels(s: &Scope, sandbox: &str, labels: &BTreeMap<String, String>) -> Result<Decided, Rejection> {
    validate::labels("labels", labels)?;
    let x = s.live_sandbox(sandbox, Right::SandboxWrite)?;
    let grows = labels_growth(&x.labels, labels);
    if grows.metadata_bytes > 0 {
        s.state
            .check_quota(&x.project, &grows, &|p| s.inflight.project_usage(p))
            .map_err(|m| Rejection::new(K::QuotaExceeded, m))?;
    }
    Ok(Decided::one(
        &x.project,
        sandbox,
        Event::SandboxLabelsSet(pb::SandboxLabelsSet {
            id: sandbox.to_string(),
            labels: labels.clone(),
        }),
    ))
}

/// `ReportSandbox`: what the sandbox's edge observed.
pub(super) fn report(s: &Scope, sandbox: &str, observation: &Observation) -> Result<Decided, Rejection> {
    validate::id("sandbox", sandbox)?;
    let x = s
        .state
        .sandboxes
        .sandboxes
        .get(sandbox)
        .ok_or_else(|| not_found("sandbox", "sandbox", sandbox))?;
    s.who.require(Right::EdgeWrite)?;
    if !s.state.within(&x.project, &s.who.project) {
        return Err(Rejection::field(
            K::Forbidden,
            "sandbox",
            format!("sandbox {sandbox} is outside the caller's project"),
        ));
    }
    s.acts_for_edge("sandbox", &x.edge)?;
    let id = sandbox.to_string();
    let ev = match observation {
        Observation::Ready => Event::SandboxReady(pb::SandboxReady {
            id,
            ..Default::default()
        }),
        Observation::VmReady { vmm, accelerator } => {
            if !x.isolation.is_machine() {
                return Err(Rejection::field(
                    K::Invalid,
                    "observation",
                    format!("sandbox {sandbox} is a container, not a VM"),
                ));
            }
            validate::name("observation.vmm", vmm)?;
            validate::name("observation.accelerator", accelerator)?;
            Event::SandboxReady(pb::SandboxReady {
                id,
                vmm: vmm.clone(),
                accelerator: accelerator.clone(),
            })
        }
        Observation::TimedOut => {
            if !x.auto_pause {
                return Err(Rejection::field(
                    K::Invalid,
                    "observation",
                    format!("sandbox {sandbox} does not pause at its timeout"),
                ));
            }
            Event::SandboxTimedOut(pb::SandboxTimedOut {
                id,
                filesystem: x.auto_pause_filesystem,
            })
        }
        Observation::Paused => Event::SandboxPaused(pb::SandboxPaused { id }),
        Observation::Resumed => Event::SandboxResumed(pb::SandboxResumed { id }),
        Observation::Failed { reason } => {
            validate::text("observation.reason", reason, LIMITS.reason_len)?;
            Event::SandboxFailed(pb::SandboxFailed {
                id,
                reason: reason.clone(),
            })
        }
        Observation::OomKilled { kills, command } => {
            validate::text("observation.command", command, LIMITS.reason_len)?;
            if *kills == 0 {
                return Err(Rejection::field(
                    K::Invalid,
                    "observation.kills",
                    "an OOM report counts at least one kill",
                ));
            }
            if *kills <= x.oom_kills {
                return Err(Rejection::field(
                    K::Conflict,
                    "observation.kills",
                    format!("sandbox {sandbox} already has {} OOM kills recorded", x.oom_kills),
                ));
            }
            Event::SandboxOomKilled(pb::SandboxOomKilled {
                id,
                kills: *kills,
                command: command.clone(),
            })
        }
        Observation::Exited {
            exit_code,
            oom_killed,
            reason,
        } => {
            validate::text("observation.reason", reason, LIMITS.reason_len)?;
            Event::SandboxExited(pb::SandboxExited {
                id,
                exit_code: *exit_code,
                oom_killed: *oom_killed,
                reason: reason.clone(),
            })
        }
    };
    Ok(Decided::one(&x.project, sandbox, ev))
}
