//! `decide`: authorise, validate, choose, and say what happened as events.

use crate::inflight::InFlight;
use crate::placement::{Candidate, DEFAULT_K, Rng, place_power_of_k, sandbox_id};
use crate::validate::{self, LIMITS};
use crate::{
    Caller, Command, Ctx, FULLVM_LABEL, FULLVM_MIN_MEMORY_MB, MICROVM_LABEL, MICROVM_MAX_FORK_COUNT,
    MICROVM_MIN_MEMORY_MB, Observation, Rejection, RejectionKind as K, SandboxOptions, SnapshotResult, TASK_LABEL,
};
use opendsec_projections::pb;
use opendsec_projections::schema::{Batch, Denial, Principal};
use opendsec_projections::state::{limits_to_pb, usage_to_pb};
use opendsec_projections::{Desired, Event, Isolation, Observed, Right, Sandbox, SnapshotState, State, Usage};
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
}

/// The resolved caller: its scope (a project subtree), rights and expiry.
struct Who {
    token: Option<String>,
    project: String,
    rights: BTreeSet<Right>,
    expires_at_ms: Option<u64>,
}

impl Who {
    fn require(&self, right: Right) -> Result<(), Rejection> {
        if self.rights.contains(&right) {
            Ok(())
        } else {
            Err(Rejection::new(
                K::Forbidden,
                format!("the caller lacks the right {}", right.as_str()),
            ))
        }
    }
    fn is_system(&self) -> bool {
        self.token.is_none()
    }
}

fn resolve(state: &State, inflight: &InFlight, ctx: &Ctx) -> Result<Who, Rejection> {
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

fn not_found(field: &str, what: &str, id: &str) -> Rejection {
    Rejection::field(K::NotFound, field, format!("{what} {id} does not exist"))
}

fn project_in_scope(state: &State, who: &Who, field: &str, project: &str) -> Result<(), Rejection> {
    validate::id(field, project)?;
    if !state.iam.projects.contains_key(project) {
        return Err(not_found(field, "project", project));
    }
    if !state.within(project, &who.project) {
        return Err(Rejection::field(
            K::Forbidden,
            field,
            format!("project {project} is outside the caller's project {}", who.project),
        ));
    }
    Ok(())
}

fn live_sandbox<'a>(state: &'a State, who: &Who, id: &str, right: Right) -> Result<&'a Sandbox, Rejection> {
    validate::id("sandbox", id)?;
    let s = state
        .sandboxes
        .sandboxes
        .get(id)
        .ok_or_else(|| not_found("sandbox", "sandbox", id))?;
    who.require(right)?;
    if !state.within(&s.project, &who.project) {
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

/// Edges and the control plane serve the whole cluster: only the root project's principals manage them.
fn require_root(state: &State, who: &Who) -> Result<(), Rejection> {
    if who.is_system() || state.root_project().is_some_and(|r| r.id == who.project) {
        Ok(())
    } else {
        Err(Rejection::new(
            K::Forbidden,
            "edges are managed by the root project's principals only",
        ))
    }
}

fn hex32(field: &str, v: &str) -> Result<Vec<u8>, Rejection> {
    match hex::decode(v) {
        Ok(b) if b.len() == 32 => Ok(b),
        _ => Err(Rejection::field(
            K::Invalid,
            field,
            format!("{field} must be 64 hex digits (a SHA-256)"),
        )),
    }
}

/// Whether `name` has the form of a snapshot id (`snap-` + 16 hex digits).
fn is_snapshot_id(name: &str) -> bool {
    name.strip_prefix("snap-")
        .is_some_and(|h| h.len() == 16 && h.bytes().all(|b| b.is_ascii_hexdigit()))
}

fn expiry(ctx: &Ctx, seconds: Option<u64>) -> u64 {
    match seconds {
        Some(s) if s > 0 => ctx.time_ms.saturating_add(s.saturating_mul(1000)),
        _ => 0,
    }
}

/// Where the sandboxes of one decision may go.
#[derive(Clone, Copy, Debug)]
enum Where<'a> {
    /// Any edge with room: power-of-k.
    Anywhere,
    /// The edge holding the state they start from while it has room (and has not refused
    /// them at admission); other edges, by power-of-k, once it has not.
    Prefer(&'a str),
    /// Only this edge (the caller asked for it).
    Only(&'a str),
}

/// One placed sandbox: its id, its edge and the placement record.
type Placed = (String, String, pb::Placement);

/// Whether edge `e` runs sandboxes of `isolation`: every edge runs containers; an edge
/// labelled `opendsec.io/microvm` runs microVMs, one labelled `opendsec.io/fullvm` full VMs.
fn runs_isolation(e: &opendsec_projections::Edge, isolation: Isolation) -> bool {
    let label = match isolation {
        Isolation::Container => return true,
        Isolation::Microvm => MICROVM_LABEL,
        Isolation::Vm => FULLVM_LABEL,
    };
    e.labels.get(label).is_some_and(|v| !v.is_empty())
}

/// Places `n` sandboxes of `usage` in `project`, checking quota against state + in-flight.
/// MicroVMs go only to edges that run them ([`MICROVM_LABEL`]).
#[allow(clippy::too_many_arguments)]
fn place(
    state: &State,
    inflight: &InFlight,
    rng: &mut Rng,
    project: &str,
    usage: Usage,
    n: u32,
    refused_by: &BTreeSet<String>,
    to: Where<'_>,
    isolation: Isolation,
) -> Result<Vec<Placed>, Rejection> {
    let total = Usage {
        sandboxes: n as u64,
        cpu_millis: usage.cpu_millis * n as u64,
        memory_mb: usage.memory_mb * n as u64,
    };
    state
        .check_quota(project, &total, &|p| inflight.project_usage(p))
        .map_err(|m| Rejection::new(K::QuotaExceeded, m))?;
    let mut taken: std::collections::BTreeMap<String, Usage> = Default::default();
    let mut out = Vec::new();
    for _ in 0..n {
        let cands: Vec<Candidate> = state
            .placement
            .edges
            .values()
            .filter(|e| !e.deregistered && !refused_by.contains(&e.id))
            .filter(|e| !matches!(to, Where::Only(o) if o != e.id))
            .filter(|e| runs_isolation(e, isolation))
            .filter_map(|e| {
                let mut free = e.free();
                free.sub(&inflight.edge_usage(&e.id));
                free.sub(&taken.get(&e.id).copied().unwrap_or_default());
                let fits =
                    free.sandboxes >= 1 && free.cpu_millis >= usage.cpu_millis && free.memory_mb >= usage.memory_mb;
                fits.then(|| Candidate {
                    edge: e.id.clone(),
                    ordinal: e.ordinal,
                    free,
                })
            })
            .collect();
        // The source's edge needs no transfer: it is taken whenever it can be.
        let preferred = match to {
            Where::Prefer(p) => cands.iter().find(|c| c.edge == p).map(|c| (vec![c.clone()], 0)),
            _ => None,
        };
        let (sampled, best) = preferred
            .or_else(|| place_power_of_k(&cands, DEFAULT_K, rng))
            .ok_or_else(|| match (to, isolation) {
                (Where::Only(o), _) if !state.placement.edges.get(o).is_some_and(|e| !e.deregistered) => {
                    Rejection::field(K::NotFound, "edge", format!("edge {o} is not registered"))
                }
                (Where::Only(o), Isolation::Container) => {
                    Rejection::field(K::NoCapacity, "edge", format!("edge {o} has no room for this sandbox"))
                }
                (Where::Only(o), machine) => Rejection::field(
                    K::NoCapacity,
                    "edge",
                    format!(
                        "edge {o} has no room for this {} (or runs no {}s)",
                        machine.noun(),
                        machine.noun()
                    ),
                ),
                (_, Isolation::Container) => {
                    Rejection::new(K::NoCapacity, "no registered edge has room for this sandbox")
                }
                (_, machine) => Rejection::new(
                    K::NoCapacity,
                    format!(
                        "no registered edge that runs {}s has room for this sandbox",
                        machine.noun()
                    ),
                ),
            })?;
        let chosen = &sampled[best];
        let mut id = sandbox_id(rng, chosen.ordinal);
        while state.sandboxes.sandboxes.contains_key(&id)
            || inflight.sandbox_id_taken(&id)
            || out.iter().any(|(x, _, _)| x == &id)
        {
            id = sandbox_id(rng, chosen.ordinal);
        }
        taken
            .entry(chosen.edge.clone())
            .or_default()
            .add(&Usage { sandboxes: 1, ..usage });
        let placement = pb::Placement {
            candidates: sampled.iter().map(|c| c.edge.clone()).collect(),
            chosen: chosen.edge.clone(),
            refused_by: refused_by.iter().cloned().collect(),
        };
        out.push((id, chosen.edge.clone(), placement));
    }
    Ok(out)
}

/// The id under which `source_edge` serves a fork's source state to the copies placed on
/// other edges: named after the first such copy, shared by all of them ("" when none is).
fn fork_transfer_id(placed: &[Placed], source_edge: &str) -> String {
    placed
        .iter()
        .find(|(_, edge, _)| edge != source_edge)
        .map(|(id, _, _)| format!("fork-{id}"))
        .unwrap_or_default()
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
    if let Command::Bootstrap {
        project_name,
        token_name,
        secret_sha256,
    } = cmd
    {
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
        return Ok(Decided {
            events: vec![
                Event::ProjectCreated(pb::ProjectCreated {
                    id: project.clone(),
                    name: project_name.clone(),
                    parent: String::new(),
                }),
                Event::TokenIssued(pb::TokenIssued {
                    id: token.clone(),
                    project: project.clone(),
                    name: token_name.clone(),
                    rights: Right::ALL.iter().map(|r| r.as_str().to_string()).collect(),
                    secret_sha256: hash,
                    expires_at_ms: 0,
                    issued_by: String::new(),
                }),
            ],
            project,
            target: token,
        });
    }

    let who = resolve(state, inflight, ctx)?;
    let mut rng = Rng::new(ctx.seed);
    let one = |project: &str, target: &str, ev: Event| Decided {
        events: vec![ev],
        project: project.to_string(),
        target: target.to_string(),
    };

    match cmd {
        Command::Bootstrap { .. } => unreachable!("handled above"),
        Command::CreateProject { name, parent } => {
            validate::name("name", name)?;
            project_in_scope(state, &who, "parent", parent)?;
            who.require(Right::ProjectWrite)?;
            let p = &state.iam.projects[parent];
            let taken = p
                .children
                .iter()
                .any(|c| state.iam.projects.get(c).is_some_and(|x| &x.name == name));
            if taken || inflight.project_name_taken(parent, name) {
                return Err(Rejection::field(
                    K::Conflict,
                    "name",
                    format!("project {parent} already has a child named {name}"),
                ));
            }
            let id = format!("p{:012x}", rng.next_u64() >> 16);
            Ok(one(
                parent,
                &id,
                Event::ProjectCreated(pb::ProjectCreated {
                    id: id.clone(),
                    name: name.clone(),
                    parent: parent.clone(),
                }),
            ))
        }
        Command::DeleteProject { project } => {
            project_in_scope(state, &who, "project", project)?;
            who.require(Right::ProjectWrite)?;
            if *project == who.project {
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
                || inflight.project_usage(project).sandboxes > 0;
            if live {
                return Err(Rejection::field(
                    K::Conflict,
                    "project",
                    format!("project {project} still has live sandboxes"),
                ));
            }
            Ok(one(
                project,
                project,
                Event::ProjectDeleted(pb::ProjectDeleted { id: project.clone() }),
            ))
        }
        Command::SetQuota { project, limits } => {
            for (f, v, max) in [
                ("limits.sandboxes", limits.sandboxes, LIMITS.sandboxes),
                ("limits.cpu_millis", limits.cpu_millis, LIMITS.cpu_millis),
                ("limits.memory_mb", limits.memory_mb, LIMITS.memory_mb),
            ] {
                if let Some(v) = v {
                    validate::amount(f, v, max)?;
                }
            }
            project_in_scope(state, &who, "project", project)?;
            who.require(Right::QuotaWrite)?;
            let p = &state.iam.projects[project];
            let is_root = p.parent.is_none();
            // Only the root project's admins may set the root's own limits.
            if *project == who.project && !is_root && !who.is_system() {
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
                .plus(&inflight.project_usage(project));
            if let Some((res, limit)) = limits.exceeded_by(&used) {
                return Err(Rejection::field(
                    K::Conflict,
                    &format!("limits.{res}"),
                    format!("{res} limit {limit} is below the project's current usage"),
                ));
            }
            Ok(one(
                project,
                project,
                Event::QuotaSet(pb::QuotaSet {
                    project: project.clone(),
                    limits: Some(limits_to_pb(limits)),
                }),
            ))
        }
        Command::IssueToken {
            project,
            name,
            rights,
            ttl_seconds,
            secret_sha256,
        } => {
            validate::name("name", name)?;
            let hash = hex32("secret_sha256", secret_sha256)?;
            if let Some(t) = ttl_seconds {
                validate::amount("ttl_seconds", *t, LIMITS.timeout_seconds)?;
            }
            project_in_scope(state, &who, "project", project)?;
            who.require(Right::TokenWrite)?;
            if let Some(r) = rights.iter().find(|r| !who.rights.contains(r)) {
                return Err(Rejection::field(
                    K::Forbidden,
                    "rights",
                    format!("the caller cannot grant {}: it does not hold it", r.as_str()),
                ));
            }
            let mut expires = expiry(ctx, *ttl_seconds);
            if let Some(mine) = who.expires_at_ms {
                if expires == 0 || expires > mine {
                    // A delegated token never outlives its issuer.
                    expires = mine;
                }
            }
            let id = format!("{:016x}", rng.next_u64());
            let rights: BTreeSet<Right> = rights.iter().copied().collect();
            Ok(one(
                project,
                &id,
                Event::TokenIssued(pb::TokenIssued {
                    id: id.clone(),
                    project: project.clone(),
                    name: name.clone(),
                    rights: rights.iter().map(|r| r.as_str().to_string()).collect(),
                    secret_sha256: hash,
                    expires_at_ms: expires,
                    issued_by: who.token.clone().unwrap_or_default(),
                }),
            ))
        }
        Command::RevokeToken { token, reason } => {
            validate::id("token", token)?;
            validate::text("reason", reason, LIMITS.reason_len)?;
            let t = state
                .iam
                .tokens
                .get(token)
                .ok_or_else(|| not_found("token", "token", token))?;
            who.require(Right::TokenWrite)?;
            if !state.within(&t.project, &who.project) {
                return Err(Rejection::field(
                    K::Forbidden,
                    "token",
                    format!("token {token} is outside the caller's project"),
                ));
            }
            if t.revoked.is_some() || inflight.token_being_revoked(token) {
                return Err(Rejection::field(
                    K::Conflict,
                    "token",
                    format!("token {token} is already revoked"),
                ));
            }
            Ok(one(
                &t.project,
                token,
                Event::TokenRevoked(pb::TokenRevoked {
                    id: token.clone(),
                    reason: reason.clone(),
                }),
            ))
        }
        Command::RegisterEdge {
            edge,
            address,
            capacity,
            labels,
        } => {
            validate::name("edge", edge)?;
            validate::text("address", address, 255)?;
            if address.is_empty() {
                return Err(Rejection::field(K::Invalid, "address", "address must be host:port"));
            }
            validate::labels("labels", labels)?;
            validate::amount("capacity.sandboxes", capacity.sandboxes, LIMITS.sandboxes)?;
            validate::amount("capacity.cpu_millis", capacity.cpu_millis, LIMITS.cpu_millis)?;
            validate::amount("capacity.memory_mb", capacity.memory_mb, LIMITS.memory_mb)?;
            who.require(Right::EdgeWrite)?;
            require_root(state, &who)?;
            let ordinal = match state.placement.edges.get(edge) {
                Some(e) => e.ordinal,
                None if inflight.is_new_edge(edge) => {
                    return Err(Rejection::field(
                        K::Conflict,
                        "edge",
                        format!("edge {edge} is being registered"),
                    ));
                }
                None => state.placement.next_ordinal + inflight.new_edge_count(),
            };
            if ordinal > 0xffff {
                return Err(Rejection::new(
                    K::NoCapacity,
                    "the cluster has used all 65,536 edge ordinals",
                ));
            }
            Ok(one(
                "",
                edge,
                Event::EdgeRegistered(pb::EdgeRegistered {
                    id: edge.clone(),
                    ordinal,
                    address: address.clone(),
                    capacity: Some(usage_to_pb(capacity)),
                    labels: labels.clone(),
                }),
            ))
        }
        Command::DeregisterEdge { edge } => {
            validate::id("edge", edge)?;
            if !state.placement.edges.contains_key(edge) {
                return Err(not_found("edge", "edge", edge));
            }
            who.require(Right::EdgeWrite)?;
            require_root(state, &who)?;
            Ok(one(
                "",
                edge,
                Event::EdgeDeregistered(pb::EdgeDeregistered { id: edge.clone() }),
            ))
        }
        Command::CreateSandbox {
            project,
            image,
            cpu_millis,
            memory_mb,
            labels,
            timeout_seconds,
            opts,
        } => {
            if image.is_empty() {
                return Err(Rejection::field(K::Invalid, "image", "image must name an image"));
            }
            validate::text("image", image, LIMITS.image_len)?;
            validate::amount("cpu_millis", *cpu_millis, LIMITS.cpu_millis)?;
            validate::amount("memory_mb", *memory_mb, LIMITS.memory_mb)?;
            if *cpu_millis == 0 || *memory_mb == 0 {
                return Err(Rejection::field(
                    K::Invalid,
                    if *cpu_millis == 0 { "cpu_millis" } else { "memory_mb" },
                    "a sandbox needs some CPU and memory",
                ));
            }
            validate::labels("labels", labels)?;
            if let Some(t) = timeout_seconds {
                validate::amount("timeout_seconds", *t, LIMITS.timeout_seconds)?;
            }
            validate::options("opts", opts)?;
            project_in_scope(state, &who, "project", project)?;
            who.require(Right::SandboxWrite)?;
            if let Some(key) = &opts.idempotency_key {
                if let Some(existing) = state.sandboxes.by_idempotency_key(project, key) {
                    return Err(Rejection::field(
                        K::Conflict,
                        "opts.idempotency_key",
                        format!("sandbox {} was already created with this idempotency key", existing.id),
                    ));
                }
            }
            // An image, or a snapshot of this project's subtree (then it starts on the
            // snapshot's edge, from the snapshot's file system).
            let from = match state.snapshots.snapshots.get(image) {
                Some(snap) if state.within(&snap.project, &who.project) => {
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
            let (mut cpu, mut memory) = (*cpu_millis, *memory_mb);
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
            let usage = Usage {
                sandboxes: 1,
                cpu_millis: cpu,
                memory_mb: memory,
            };
            // From a snapshot: preferably on the snapshot's edge; elsewhere it is pulled.
            let to = from.map_or(Where::Anywhere, |s| Where::Prefer(&s.edge));
            let placed = place(state, inflight, &mut rng, project, usage, 1, refused_by, to, isolation)?;
            let (id, edge, placement) = placed.into_iter().next().expect("place returns one per request");
            let source_edge = from.map(|s| s.edge.clone()).unwrap_or_default();
            let transfer = match from {
                Some(snap) if snap.edge != edge => snap.id.clone(),
                _ => String::new(),
            };
            Ok(one(
                project,
                &id,
                Event::SandboxCreated(pb::SandboxCreated {
                    id: id.clone(),
                    project: project.clone(),
                    edge,
                    image: from.map(|s| s.image.clone()).unwrap_or_else(|| image.clone()),
                    cpu_millis: cpu,
                    memory_mb: memory,
                    labels: labels.clone(),
                    expires_at_ms: expiry(ctx, *timeout_seconds),
                    fork_of: String::new(),
                    placement: Some(placement),
                    env: opts.env.clone(),
                    auto_pause: opts.auto_pause,
                    auto_resume: opts.auto_resume,
                    snapshot: from.map(|s| s.id.clone()).unwrap_or_default(),
                    template: image.clone(),
                    network: opts.network.clone().unwrap_or_default(),
                    isolation: isolation.to_event(),
                    idempotency_key: opts.idempotency_key.clone().unwrap_or_default(),
                    source_edge,
                    transfer,
                }),
            ))
        }
        Command::ForkSandbox { sandbox, count, edge } => {
            if let Some(e) = edge {
                validate::id("edge", e)?;
            }
            if *count == 0 || *count > LIMITS.fork_count {
                return Err(Rejection::field(
                    K::Invalid,
                    "count",
                    format!("count must be 1 to {}", LIMITS.fork_count),
                ));
            }
            let s = live_sandbox(state, &who, sandbox, Right::SandboxWrite)?;
            if s.isolation.is_machine() && *count > MICROVM_MAX_FORK_COUNT {
                return Err(Rejection::field(
                    K::Invalid,
                    "count",
                    format!(
                        "a {} forks into 1 to {MICROVM_MAX_FORK_COUNT} copies at a time",
                        s.isolation.noun()
                    ),
                ));
            }
            // The copies start from the source's file system (and a microVM's memory), which
            // live on its edge: copies go there while it has room; copies placed elsewhere
            // pull that state from it (`transfer`).
            let to = edge.as_deref().map_or(Where::Prefer(&s.edge), Where::Only);
            let placed = place(
                state,
                inflight,
                &mut rng,
                &s.project,
                s.usage(),
                *count,
                refused_by,
                to,
                s.isolation,
            )?;
            let transfer = fork_transfer_id(&placed, &s.edge);
            let mut events = vec![Event::SandboxForkRequested(pb::SandboxForkRequested {
                id: sandbox.clone(),
                children: placed.iter().map(|(id, _, _)| id.clone()).collect(),
            })];
            for (id, copy_edge, placement) in placed {
                let copy_transfer = if copy_edge == s.edge {
                    String::new()
                } else {
                    transfer.clone()
                };
                events.push(Event::SandboxCreated(pb::SandboxCreated {
                    id,
                    project: s.project.clone(),
                    edge: copy_edge,
                    image: s.image.clone(),
                    cpu_millis: s.cpu_millis,
                    memory_mb: s.memory_mb,
                    labels: s.labels.clone(),
                    expires_at_ms: s.expires_at_ms.unwrap_or(0),
                    fork_of: sandbox.clone(),
                    placement: Some(placement),
                    env: s.env.clone(),
                    auto_pause: s.auto_pause,
                    auto_resume: s.auto_resume,
                    snapshot: s.snapshot.clone().unwrap_or_default(),
                    template: s.template.clone().unwrap_or_default(),
                    network: s.network.clone().unwrap_or_default(),
                    isolation: s.isolation.to_event(),
                    // A copy is not the create the key named.
                    idempotency_key: String::new(),
                    source_edge: s.edge.clone(),
                    transfer: copy_transfer,
                }));
            }
            Ok(Decided {
                events,
                project: s.project.clone(),
                target: sandbox.clone(),
            })
        }
        Command::PauseSandbox { sandbox } => {
            let s = live_sandbox(state, &who, sandbox, Right::SandboxWrite)?;
            Ok(one(
                &s.project,
                sandbox,
                Event::SandboxPauseRequested(pb::SandboxPauseRequested { id: sandbox.clone() }),
            ))
        }
        Command::ResumeSandbox { sandbox } => {
            let s = live_sandbox(state, &who, sandbox, Right::SandboxWrite)?;
            Ok(one(
                &s.project,
                sandbox,
                Event::SandboxResumeRequested(pb::SandboxResumeRequested { id: sandbox.clone() }),
            ))
        }
        Command::KillSandbox { sandbox } => {
            let s = live_sandbox(state, &who, sandbox, Right::SandboxWrite)?;
            let reason = if who.is_system() { "timeout" } else { "user" };
            Ok(one(
                &s.project,
                sandbox,
                Event::SandboxKillRequested(pb::SandboxKillRequested {
                    id: sandbox.clone(),
                    reason: reason.into(),
                }),
            ))
        }
        Command::SetSandboxTimeout {
            sandbox,
            timeout_seconds,
        } => {
            validate::amount("timeout_seconds", *timeout_seconds, LIMITS.timeout_seconds)?;
            let s = live_sandbox(state, &who, sandbox, Right::SandboxWrite)?;
            let at = expiry(ctx, Some(*timeout_seconds));
            Ok(one(
                &s.project,
                sandbox,
                Event::SandboxTimeoutSet(pb::SandboxTimeoutSet {
                    id: sandbox.clone(),
                    expires_at_ms: at,
                }),
            ))
        }
        Command::SetSandboxLabels { sandbox, labels } => {
            validate::labels("labels", labels)?;
            let s = live_sandbox(state, &who, sandbox, Right::SandboxWrite)?;
            Ok(one(
                &s.project,
                sandbox,
                Event::SandboxLabelsSet(pb::SandboxLabelsSet {
                    id: sandbox.clone(),
                    labels: labels.clone(),
                }),
            ))
        }
        Command::AddClusterMember { node_id, address } => {
            if *node_id == 0 {
                return Err(Rejection::field(K::Invalid, "node_id", "node ids start at 1"));
            }
            validate::text("address", address, 255)?;
            if address.is_empty() || !address.contains(':') || address.chars().any(char::is_whitespace) {
                return Err(Rejection::field(K::Invalid, "address", "address must be host:port"));
            }
            who.require(Right::ClusterAdmin)?;
            require_root(state, &who)?;
            let ev = pb::ClusterMembershipChangeRequested {
                node_id: *node_id,
                address: address.clone(),
                change: "add".into(),
            };
            Ok(one(
                "",
                &format!("node:{node_id}"),
                Event::ClusterMembershipChangeRequested(ev),
            ))
        }
        Command::RemoveClusterMember { node_id } => {
            who.require(Right::ClusterAdmin)?;
            require_root(state, &who)?;
            let ev = pb::ClusterMembershipChangeRequested {
                node_id: *node_id,
                address: String::new(),
                change: "remove".into(),
            };
            Ok(one(
                "",
                &format!("node:{node_id}"),
                Event::ClusterMembershipChangeRequested(ev),
            ))
        }
        Command::CreateSnapshot { sandbox, name } => {
            validate::text("name", name, LIMITS.name_len)?;
            let s = live_sandbox(state, &who, sandbox, Right::SandboxWrite)?;
            if s.observed != Observed::Ready && s.observed != Observed::Paused {
                return Err(Rejection::field(
                    K::Conflict,
                    "sandbox",
                    format!("sandbox {sandbox} is not running yet"),
                ));
            }
            let mut id = format!("snap-{:016x}", rng.next_u64());
            while state.snapshots.snapshots.contains_key(&id) {
                id = format!("snap-{:016x}", rng.next_u64());
            }
            Ok(one(
                &s.project,
                &id,
                Event::SnapshotRequested(pb::SnapshotRequested {
                    id: id.clone(),
                    sandbox: sandbox.clone(),
                    project: s.project.clone(),
                    edge: s.edge.clone(),
                    name: name.clone(),
                    image: s.image.clone(),
                    // A microVM's snapshot holds its whole disk: it stands on no other.
                    parent: if s.isolation.is_machine() {
                        String::new()
                    } else {
                        s.snapshot.clone().unwrap_or_default()
                    },
                    isolation: s.isolation.to_event(),
                }),
            ))
        }
        Command::DeleteSnapshot { snapshot } => {
            validate::id("snapshot", snapshot)?;
            let x = state
                .snapshots
                .snapshots
                .get(snapshot)
                .ok_or_else(|| not_found("snapshot", "snapshot", snapshot))?;
            who.require(Right::SandboxWrite)?;
            if !state.within(&x.project, &who.project) {
                return Err(Rejection::field(
                    K::Forbidden,
                    "snapshot",
                    format!("snapshot {snapshot} is outside the caller's project"),
                ));
            }
            let in_use = state
                .snapshots
                .snapshots
                .values()
                .any(|o| o.parent.as_deref() == Some(snapshot.as_str()));
            if in_use {
                return Err(Rejection::field(
                    K::Conflict,
                    "snapshot",
                    format!("snapshot {snapshot} lies beneath another snapshot; delete that one first"),
                ));
            }
            Ok(one(
                &x.project,
                snapshot,
                Event::SnapshotDeleted(pb::SnapshotDeleted {
                    id: snapshot.clone(),
                    sandbox: x.sandbox.clone(),
                }),
            ))
        }
        Command::ReportSnapshot { snapshot, result } => {
            validate::id("snapshot", snapshot)?;
            let x = state
                .snapshots
                .snapshots
                .get(snapshot)
                .ok_or_else(|| not_found("snapshot", "snapshot", snapshot))?;
            who.require(Right::EdgeWrite)?;
            if !state.within(&x.project, &who.project) {
                return Err(Rejection::field(
                    K::Forbidden,
                    "snapshot",
                    format!("snapshot {snapshot} is outside the caller's project"),
                ));
            }
            if x.state != SnapshotState::Pending {
                return Err(Rejection::field(
                    K::Conflict,
                    "snapshot",
                    format!("snapshot {snapshot} was already reported"),
                ));
            }
            let ev = match result {
                SnapshotResult::Ready { size_bytes } => Event::SnapshotReady(pb::SnapshotReady {
                    id: snapshot.clone(),
                    sandbox: x.sandbox.clone(),
                    size_bytes: *size_bytes,
                }),
                SnapshotResult::Failed { reason } => {
                    validate::text("result.reason", reason, LIMITS.reason_len)?;
                    Event::SnapshotFailed(pb::SnapshotFailed {
                        id: snapshot.clone(),
                        sandbox: x.sandbox.clone(),
                        reason: reason.clone(),
                    })
                }
            };
            Ok(one(&x.project, snapshot, ev))
        }
        Command::SetSandboxNetwork { sandbox, network } => {
            validate::options(
                "network",
                &SandboxOptions {
                    network: Some(network.clone()),
                    ..Default::default()
                },
            )?;
            let s = live_sandbox(state, &who, sandbox, Right::SandboxWrite)?;
            Ok(one(
                &s.project,
                sandbox,
                Event::SandboxNetworkSet(pb::SandboxNetworkSet {
                    id: sandbox.clone(),
                    network: network.clone(),
                }),
            ))
        }
        Command::PauseTask { task } | Command::ResumeTask { task } => {
            validate::task("task", task)?;
            who.require(Right::SandboxWrite)?;
            let pause = matches!(cmd, Command::PauseTask { .. });
            let members: Vec<&Sandbox> = state
                .sandboxes
                .sandboxes
                .values()
                .filter(|x| x.is_live() && state.within(&x.project, &who.project))
                .filter(|x| x.labels.get(TASK_LABEL) == Some(task))
                .collect();
            if members.is_empty() {
                return Err(Rejection::field(
                    K::NotFound,
                    "task",
                    format!(
                        "no live sandbox of project {} is labelled {TASK_LABEL}={task}",
                        who.project
                    ),
                ));
            }
            // Those already where they should be are left alone: the command is idempotent.
            let events = members
                .into_iter()
                .filter_map(|x| match (pause, x.desired) {
                    (true, Desired::Running) => Some(Event::SandboxPauseRequested(pb::SandboxPauseRequested {
                        id: x.id.clone(),
                    })),
                    (false, Desired::Paused) => Some(Event::SandboxResumeRequested(pb::SandboxResumeRequested {
                        id: x.id.clone(),
                    })),
                    _ => None,
                })
                .collect();
            Ok(Decided {
                events,
                project: who.project.clone(),
                target: task_target(task),
            })
        }
        Command::ReportSandbox { sandbox, observation } => {
            validate::id("sandbox", sandbox)?;
            let s = state
                .sandboxes
                .sandboxes
                .get(sandbox)
                .ok_or_else(|| not_found("sandbox", "sandbox", sandbox))?;
            who.require(Right::EdgeWrite)?;
            if !state.within(&s.project, &who.project) {
                return Err(Rejection::field(
                    K::Forbidden,
                    "sandbox",
                    format!("sandbox {sandbox} is outside the caller's project"),
                ));
            }
            let id = sandbox.clone();
            let ev = match observation {
                Observation::Ready => Event::SandboxReady(pb::SandboxReady {
                    id,
                    ..Default::default()
                }),
                Observation::VmReady { vmm, accelerator } => {
                    if !s.isolation.is_machine() {
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
                    if !s.auto_pause {
                        return Err(Rejection::field(
                            K::Invalid,
                            "observation",
                            format!("sandbox {sandbox} does not pause at its timeout"),
                        ));
                    }
                    Event::SandboxTimedOut(pb::SandboxTimedOut { id })
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
            Ok(one(&s.project, sandbox, ev))
        }
    }
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

/// The audit target of a task command.
fn task_target(task: &str) -> String {
    format!("task:{task}")
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
        Command::DeleteProject { project } | Command::SetQuota { project, .. } => (project.clone(), project.clone()),
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
        Command::CreateSandbox { project, image, .. } => (project.clone(), image.clone()),
        Command::ForkSandbox { sandbox, .. }
        | Command::PauseSandbox { sandbox }
        | Command::ResumeSandbox { sandbox }
        | Command::KillSandbox { sandbox }
        | Command::SetSandboxTimeout { sandbox, .. }
        | Command::SetSandboxLabels { sandbox, .. }
        | Command::SetSandboxNetwork { sandbox, .. }
        | Command::CreateSnapshot { sandbox, .. }
        | Command::ReportSandbox { sandbox, .. } => (sandbox_project(sandbox), sandbox.clone()),
        Command::PauseTask { task } | Command::ResumeTask { task } => (String::new(), task_target(task)),
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
