//! `State` holds every view and folds log batches into them.
//!
//! Applying re-validates the batch against the applied state (invariant 2): a batch
//! decided against a stale view that now conflicts (it lost a race for the last quota
//! unit, a name, an edge's capacity) changes nothing but the audit view, where it is
//! recorded as rejected. Every check is a pure function of (state, batch), so every
//! node reaches the same verdict.

use crate::lifecycle::Lifecycle;
use crate::schema::{self, Batch, Event, pb};
use crate::views::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};

/// All projections at one log index.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct State {
    /// Index of the last batch folded in.
    pub index: u64,
    /// Leader time of the last batch folded in.
    pub time_ms: u64,
    pub iam: IamView,
    pub quota: QuotaView,
    pub placement: PlacementView,
    pub sandboxes: SandboxView,
    pub audit: AuditView,
    #[serde(default, skip_serializing_if = "SnapshotView::is_empty")]
    pub snapshots: SnapshotView,
    #[serde(default, skip_serializing_if = "ImageView::is_empty")]
    pub images: ImageView,
    /// The requests applied in the last [`REQUEST_WINDOW_MS`] of log time, so a retry
    /// of one is answered with its first outcome instead of being applied twice.
    #[serde(default, skip_serializing_if = "Requests::is_empty")]
    pub requests: Requests,
}

/// How long (log time) a request is remembered after it was applied.
pub const REQUEST_WINDOW_MS: u64 = 15 * 60 * 1000;
/// The most requests remembered at once (the oldest are forgotten first).
pub const REQUEST_WINDOW_MAX: usize = 200_000;

/// Requests remembered for deduplication: by request id, and in the order they aged.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requests {
    pub by_id: BTreeMap<String, SeenRequest>,
    /// (log time, request id), oldest first.
    pub by_age: BTreeSet<(u64, String)>,
}

/// One remembered request: what it was (its digest) and where its batch is.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeenRequest {
    pub digest: String,
    pub index: u64,
    pub time_ms: u64,
}

impl Requests {
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// The index of the batch that applied request `id` with this `digest`, if it is
    /// remembered: a batch carrying both is a retry of it.
    pub fn applied(&self, id: &str, digest: &str) -> Option<u64> {
        self.by_id
            .get(id)
            .filter(|s| !digest.is_empty() && s.digest == digest)
            .map(|s| s.index)
    }

    fn forget_before(&mut self, time_ms: u64) {
        while let Some((t, id)) = self.by_age.first().cloned() {
            if t >= time_ms && self.by_id.len() <= REQUEST_WINDOW_MAX {
                break;
            }
            self.by_age.pop_first();
            self.by_id.remove(&id);
        }
    }

    fn remember(&mut self, id: &str, digest: &str, index: u64, time_ms: u64) {
        if let Some(old) = self.by_id.insert(
            id.to_string(),
            SeenRequest {
                digest: digest.to_string(),
                index,
                time_ms,
            },
        ) {
            self.by_age.remove(&(old.time_ms, id.to_string()));
        }
        self.by_age.insert((time_ms, id.to_string()));
    }
}

/// The names of the views, as the API and the CLI call them.
pub const VIEW_NAMES: [&str; 7] = ["sandboxes", "placement", "quota", "iam", "audit", "snapshots", "images"];

/// What applying one batch did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    Applied {
        index: u64,
    },
    Denied {
        index: u64,
        code: String,
        message: String,
        field: String,
    },
    Rejected {
        index: u64,
        message: String,
    },
    /// A retry of the request applied (or denied) at `first`: not applied again.
    Duplicate {
        index: u64,
        first: u64,
    },
}

/// Changes earlier events of the same batch make, seen by the checks of later ones.
#[derive(Default)]
struct Pending {
    usage: BTreeMap<String, Usage>,
    edge_usage: BTreeMap<String, Usage>,
    sandbox_ids: BTreeSet<String>,
    /// Projects created earlier in the batch (bootstrap issues a token in its new root).
    projects: BTreeSet<String>,
    /// (project, idempotency key) of sandboxes created earlier in the batch.
    idempotency_keys: BTreeSet<(String, String)>,
}

/// How deep projects nest, the root counted: quota, usage and scope walk a project's
/// whole ancestry, so it stays short.
pub const MAX_PROJECT_DEPTH: usize = 16;

impl State {
    pub fn new() -> State {
        State::default()
    }

    /// Folds one batch at `index` into every view.
    pub fn apply_batch(&mut self, index: u64, batch: &Batch) -> Outcome {
        self.index = index;
        self.time_ms = self.time_ms.max(batch.time_ms);
        self.requests
            .forget_before(self.time_ms.saturating_sub(REQUEST_WINDOW_MS));
        let digest = &batch.request_digest;
        if let Some(first) = self.requests.applied(&batch.request_id, digest) {
            let outcome = Outcome::Duplicate { index, first };
            self.audit.records.push(audit_record(index, batch, &outcome));
            return outcome;
        }
        let outcome = match (&batch.denial, schema::batch_events(batch)) {
            (Some(d), _) => Outcome::Denied {
                index,
                code: d.code.clone(),
                message: d.message.clone(),
                field: d.field.clone(),
            },
            (None, Err(e)) => Outcome::Rejected {
                index,
                message: e.to_string(),
            },
            (None, Ok(events)) => match self.check_all(&events) {
                Err(message) => Outcome::Rejected { index, message },
                Ok(()) => {
                    for ev in &events {
                        self.apply_event(index, batch.time_ms, ev);
                    }
                    Outcome::Applied { index }
                }
            },
        };
        // A request that took effect (applied, or denied and logged) is remembered; one
        // that lost a race at apply may be decided again.
        if !digest.is_empty()
            && !batch.request_id.is_empty()
            && matches!(outcome, Outcome::Applied { .. } | Outcome::Denied { .. })
        {
            self.requests.remember(&batch.request_id, digest, index, batch.time_ms);
        }
        self.audit.records.push(audit_record(index, batch, &outcome));
        outcome
    }

    /// Decodes and applies a batch in its log encoding.
    pub fn apply_encoded(&mut self, index: u64, bytes: &[u8]) -> Outcome {
        match schema::decode_batch(bytes) {
            Ok(b) => self.apply_batch(index, &b),
            Err(e) => {
                self.index = index;
                let message = e.to_string();
                self.audit.records.push(AuditRecord {
                    index,
                    time_ms: self.time_ms,
                    principal: String::new(),
                    project: String::new(),
                    action: "undecodable".into(),
                    target: String::new(),
                    result: AuditResult::Rejected {
                        message: message.clone(),
                    },
                    request_id: String::new(),
                });
                Outcome::Rejected { index, message }
            }
        }
    }

    // ---- queries shared by decide() and the checks below ----

    /// `project` and its ancestors up to the root, nearest first (at most
    /// [`MAX_PROJECT_DEPTH`] of them: no project is made deeper).
    pub fn ancestry(&self, project: &str) -> Vec<&Project> {
        let mut out: Vec<&Project> = Vec::new();
        let mut cur = self.iam.projects.get(project);
        while let Some(p) = cur {
            // A cycle cannot be built through decide() (a parent exists before its
            // child); belt and braces, without cutting a long chain short.
            if out.iter().any(|seen| seen.id == p.id) {
                break;
            }
            out.push(p);
            cur = p.parent.as_deref().and_then(|id| self.iam.projects.get(id));
        }
        out
    }

    /// Whether `project` is `scope` or lies beneath it.
    pub fn within(&self, project: &str, scope: &str) -> bool {
        self.ancestry(project).iter().any(|p| p.id == scope)
    }

    /// The limits in force for a project: its own, tightened by every ancestor's.
    pub fn effective_limits(&self, project: &str) -> Limits {
        self.ancestry(project)
            .iter()
            .filter_map(|p| self.quota.limits.get(&p.id))
            .fold(Limits::default(), |acc, l| acc.tightest(l))
    }

    /// The egress ceiling in force for a project: its own, lowered by every ancestor's
    /// (a project whose line never set one: `Egress::Public`).
    pub fn egress_ceiling(&self, project: &str) -> Egress {
        self.ancestry(project)
            .iter()
            .filter_map(|p| self.quota.network.get(&p.id))
            .map(|n| n.ceiling)
            .min()
            .unwrap_or_default()
    }

    /// The network policy (JSON) of a project's sandboxes that name none: the nearest
    /// default set on its line, or none (deny).
    pub fn default_network(&self, project: &str) -> Option<&str> {
        self.ancestry(project)
            .iter()
            .find_map(|p| self.quota.network.get(&p.id).and_then(|n| n.default_network.as_deref()))
    }

    /// The limits a child of `parent` may be given at most.
    pub fn bound_for_child_of(&self, parent: Option<&str>) -> Limits {
        parent.map(|p| self.effective_limits(p)).unwrap_or_default()
    }

    /// Every project strictly below `project`.
    pub fn descendants(&self, project: &str) -> Vec<&Project> {
        let mut out = Vec::new();
        let mut todo: Vec<&str> = self
            .iam
            .projects
            .get(project)
            .map(|p| p.children.iter().map(String::as_str).collect())
            .unwrap_or_default();
        while let Some(id) = todo.pop() {
            if let Some(p) = self.iam.projects.get(id) {
                todo.extend(p.children.iter().map(String::as_str));
                out.push(p);
            }
        }
        out
    }

    /// The first project below `project` whose own limit on a resource is above `limits`:
    /// (that project, the resource, its limit). Limits a descendant merely inherits do not count.
    pub fn descendant_limit_above(&self, project: &str, limits: &Limits) -> Option<(String, &'static str, u64)> {
        self.descendants(project).into_iter().find_map(|d| {
            let own = self.quota.limits.get(&d.id)?;
            let own = Usage {
                sandboxes: own.sandboxes.unwrap_or(0),
                cpu_millis: own.cpu_millis.unwrap_or(0),
                memory_mb: own.memory_mb.unwrap_or(0),
            };
            let (res, _) = limits.exceeded_by(&own)?;
            let value = match res {
                "sandboxes" => own.sandboxes,
                "cpu_millis" => own.cpu_millis,
                _ => own.memory_mb,
            };
            Some((d.id.clone(), res, value))
        })
    }

    pub fn root_project(&self) -> Option<&Project> {
        self.iam.projects.values().find(|p| p.parent.is_none())
    }

    /// Checks that adding `extra` usage to `project` keeps every ancestor within its limits.
    /// `overlay` returns usage already reserved (in-flight or earlier in the batch) for a project.
    pub fn check_quota(&self, project: &str, extra: &Usage, overlay: &dyn Fn(&str) -> Usage) -> Result<(), String> {
        for p in self.ancestry(project) {
            if let Some(limits) = self.quota.limits.get(&p.id) {
                let used = self.quota.usage.get(&p.id).copied().unwrap_or_default();
                let total = used.plus(&overlay(&p.id)).plus(extra);
                if let Some((res, limit)) = limits.exceeded_by(&total) {
                    return Err(format!(
                        "quota of project {} exceeded: {res} would be {} of {limit}",
                        p.id,
                        match res {
                            "sandboxes" => total.sandboxes,
                            "cpu_millis" => total.cpu_millis,
                            _ => total.memory_mb,
                        }
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks that an edge is registered and has room for `extra`.
    pub fn check_edge(&self, edge: &str, extra: &Usage, reserved: &Usage) -> Result<(), String> {
        let e = self
            .placement
            .edges
            .get(edge)
            .filter(|e| !e.deregistered)
            .ok_or_else(|| format!("edge {edge} is not registered"))?;
        let need = e.assigned.plus(reserved).plus(extra);
        let cap = Limits {
            sandboxes: Some(e.capacity.sandboxes),
            cpu_millis: Some(e.capacity.cpu_millis),
            memory_mb: Some(e.capacity.memory_mb),
        };
        match cap.exceeded_by(&need) {
            Some((res, limit)) => Err(format!("edge {edge} has no room: {res} capacity is {limit}")),
            None => Ok(()),
        }
    }

    // ---- apply-time validation ----

    fn check_all(&self, events: &[Event]) -> Result<(), String> {
        let mut pending = Pending::default();
        for ev in events {
            self.check(ev, &mut pending)?;
        }
        Ok(())
    }

    fn sandbox(&self, id: &str) -> Result<&Sandbox, String> {
        self.sandboxes
            .sandboxes
            .get(id)
            .ok_or_else(|| format!("sandbox {id} does not exist"))
    }

    fn template_build(&self, template: &str, build: &str) -> Result<&TemplateBuild, String> {
        self.images
            .templates
            .get(template)
            .ok_or_else(|| format!("template {template} does not exist"))?
            .builds
            .get(build)
            .ok_or_else(|| format!("build {build} of template {template} does not exist"))
    }

    fn template_build_mut(&mut self, template: &str, build: &str) -> Option<&mut TemplateBuild> {
        self.images.templates.get_mut(template)?.builds.get_mut(build)
    }

    fn check(&self, ev: &Event, pending: &mut Pending) -> Result<(), String> {
        match ev {
            Event::ProjectCreated(e) => {
                if self.iam.projects.contains_key(&e.id) || !pending.projects.insert(e.id.clone()) {
                    return Err(format!("project {} already exists", e.id));
                }
                if !e.parent.is_empty() && self.ancestry(&e.parent).len() >= MAX_PROJECT_DEPTH {
                    return Err(format!("projects nest at most {MAX_PROJECT_DEPTH} deep"));
                }
                if e.parent.is_empty() {
                    if self.root_project().is_some() {
                        return Err("a root project already exists".into());
                    }
                } else {
                    let parent = self
                        .iam
                        .projects
                        .get(&e.parent)
                        .ok_or_else(|| format!("parent project {} does not exist", e.parent))?;
                    let taken = parent
                        .children
                        .iter()
                        .any(|c| self.iam.projects.get(c).is_some_and(|p| p.name == e.name));
                    if taken {
                        return Err(format!("project {} already has a child named {}", e.parent, e.name));
                    }
                }
            }
            Event::ProjectDeleted(e) => {
                let p = self
                    .iam
                    .projects
                    .get(&e.id)
                    .ok_or_else(|| format!("project {} does not exist", e.id))?;
                if p.parent.is_none() {
                    return Err("the root project cannot be deleted".into());
                }
                if !p.children.is_empty() {
                    return Err(format!("project {} still has child projects", e.id));
                }
                if self.quota.usage.get(&e.id).is_some_and(|u| u.sandboxes > 0) {
                    return Err(format!("project {} still has live sandboxes", e.id));
                }
            }
            Event::ProjectNetworkSet(e) => {
                let p = self
                    .iam
                    .projects
                    .get(&e.project)
                    .ok_or_else(|| format!("project {} does not exist", e.project))?;
                let ceiling =
                    Egress::parse(&e.ceiling).ok_or_else(|| format!("unknown egress ceiling {:?}", e.ceiling))?;
                if let Some(parent) = p.parent.as_deref()
                    && ceiling > self.egress_ceiling(parent)
                {
                    return Err(format!(
                        "egress ceiling {} is above the parent project's {}",
                        ceiling.as_str(),
                        self.egress_ceiling(parent).as_str()
                    ));
                }
            }
            Event::QuotaSet(e) => {
                let p = self
                    .iam
                    .projects
                    .get(&e.project)
                    .ok_or_else(|| format!("project {} does not exist", e.project))?;
                let limits = limits_from_pb(e.limits.as_ref());
                let bound = self.bound_for_child_of(p.parent.as_deref());
                if let Some((res, mine, theirs)) = limits.exceeds(&bound) {
                    let mine = if mine == u64::MAX {
                        "unlimited".to_string()
                    } else {
                        mine.to_string()
                    };
                    return Err(format!("{res} limit {mine} exceeds the parent's limit {theirs}"));
                }
                if let Some((c, res, _)) = self.descendant_limit_above(&e.project, &limits) {
                    return Err(format!("{res} limit is below that of child project {c}"));
                }
                let used = self.quota.usage.get(&e.project).copied().unwrap_or_default();
                if let Some((res, limit)) = limits.exceeded_by(&used) {
                    return Err(format!("{res} limit {limit} is below current usage"));
                }
            }
            Event::TokenIssued(e) => {
                if self.iam.tokens.contains_key(&e.id) {
                    return Err(format!("token {} already exists", e.id));
                }
                if !self.iam.projects.contains_key(&e.project) && !pending.projects.contains(&e.project) {
                    return Err(format!("project {} does not exist", e.project));
                }
            }
            Event::TokenRevoked(e) => {
                if !self.iam.tokens.contains_key(&e.id) {
                    return Err(format!("token {} does not exist", e.id));
                }
            }
            Event::EdgeRegistered(e) => match self.placement.edges.get(&e.id) {
                Some(old) if old.ordinal != e.ordinal => {
                    return Err(format!("edge {} keeps ordinal {}", e.id, old.ordinal));
                }
                None if e.ordinal != self.placement.next_ordinal => {
                    return Err(format!(
                        "edge ordinal {} was taken; next is {}",
                        e.ordinal, self.placement.next_ordinal
                    ));
                }
                _ => {}
            },
            Event::EdgeDeregistered(e) => {
                if !self.placement.edges.contains_key(&e.id) {
                    return Err(format!("edge {} is not registered", e.id));
                }
            }
            Event::SandboxCreated(e) => {
                if self.sandboxes.sandboxes.contains_key(&e.id) || !pending.sandbox_ids.insert(e.id.clone()) {
                    return Err(format!("sandbox id {} is taken", e.id));
                }
                if !self.iam.projects.contains_key(&e.project) {
                    return Err(format!("project {} does not exist", e.project));
                }
                let isolation = Isolation::from_event(&e.isolation)
                    .ok_or_else(|| format!("isolation {:?} is unknown", e.isolation))?;
                CpuClass::from_event(&e.cpu_class).ok_or_else(|| format!("cpu class {:?} is unknown", e.cpu_class))?;
                if !e.idempotency_key.is_empty()
                    && (self
                        .sandboxes
                        .by_idempotency_key(&e.project, &e.idempotency_key)
                        .is_some()
                        || !pending
                            .idempotency_keys
                            .insert((e.project.clone(), e.idempotency_key.clone())))
                {
                    return Err(format!(
                        "a live sandbox of project {} already has idempotency key {}",
                        e.project, e.idempotency_key
                    ));
                }
                if !e.snapshot.is_empty() {
                    match self.snapshots.snapshots.get(&e.snapshot) {
                        Some(x) if x.state == SnapshotState::Ready => {
                            // A microVM's snapshot holds a whole machine: only a microVM starts
                            // from it; a file-system snapshot is a container's layer.
                            if x.isolation != isolation {
                                return Err(format!(
                                    "snapshot {} is of a {}, the sandbox a {}",
                                    e.snapshot,
                                    x.isolation.as_str(),
                                    isolation.as_str()
                                ));
                            }
                        }
                        _ => return Err(format!("snapshot {} is not ready", e.snapshot)),
                    }
                }
                let u = Usage {
                    sandboxes: 1,
                    cpu_millis: e.cpu_millis,
                    memory_mb: e.memory_mb,
                };
                let reserved = pending.edge_usage.get(&e.edge).copied().unwrap_or_default();
                self.check_edge(&e.edge, &u, &reserved)?;
                let overlay = |p: &str| pending.usage.get(p).copied().unwrap_or_default();
                self.check_quota(&e.project, &u, &overlay)?;
                pending.edge_usage.entry(e.edge.clone()).or_default().add(&u);
                for p in self.ancestry(&e.project) {
                    pending.usage.entry(p.id.clone()).or_default().add(&u);
                }
            }
            Event::SnapshotRequested(e) => {
                if self.snapshots.snapshots.contains_key(&e.id) {
                    return Err(format!("snapshot id {} is taken", e.id));
                }
                if Isolation::from_event(&e.isolation).is_none() {
                    return Err(format!("isolation {:?} is unknown", e.isolation));
                }
                if !self.sandbox(&e.sandbox)?.is_live() {
                    return Err(format!("sandbox {} is no longer running", e.sandbox));
                }
            }
            Event::ImageRequested(e) => {
                if !self.iam.projects.contains_key(&e.project) {
                    return Err(format!("project {} does not exist", e.project));
                }
                if let Some(x) = self.images.images.get(&e.name)
                    && x.project != e.project
                {
                    return Err(format!("image name {} is taken by another project", e.name));
                }
                if !e.source_sandbox.is_empty() && !self.sandbox(&e.source_sandbox)?.is_live() {
                    return Err(format!("sandbox {} is no longer running", e.source_sandbox));
                }
            }
            Event::TemplateBuildRequested(e) => {
                if !self.iam.projects.contains_key(&e.project) {
                    return Err(format!("project {} does not exist", e.project));
                }
                if let Some(t) = self.images.templates.get(&e.template_id) {
                    if t.project != e.project {
                        return Err(format!("template {} belongs to another project", e.template_id));
                    }
                    if t.builds.contains_key(&e.build_id) {
                        return Err(format!("build {} already exists", e.build_id));
                    }
                }
                if !e.name.is_empty()
                    && let Some(t) = self.images.template_named(&e.name)
                    && t.id != e.template_id
                {
                    return Err(format!("template name {} is taken", e.name));
                }
            }
            Event::TemplateBuildStarted(e) => {
                if self.template_build(&e.template_id, &e.build_id)?.status != BuildStatus::Waiting {
                    return Err(format!("build {} has started already", e.build_id));
                }
            }
            Event::TemplateBuildFinished(e) => {
                if matches!(
                    self.template_build(&e.template_id, &e.build_id)?.status,
                    BuildStatus::Ready | BuildStatus::Error
                ) {
                    return Err(format!("build {} has ended already", e.build_id));
                }
            }
            Event::TemplateTagsSet(e) => {
                if !e.build_id.is_empty() {
                    self.template_build(&e.template_id, &e.build_id)?;
                } else if !self.images.templates.contains_key(&e.template_id) {
                    return Err(format!("template {} does not exist", e.template_id));
                }
            }
            Event::TemplateDeleted(e) => {
                if !self.images.templates.contains_key(&e.template_id) {
                    return Err(format!("template {} does not exist", e.template_id));
                }
            }
            Event::SandboxForkRequested(e) => {
                let s = self.sandbox(&e.id)?;
                if !s.is_live() {
                    return Err(format!("sandbox {} is no longer running", e.id));
                }
            }
            other => {
                if let Some(id) = other.sandbox_id() {
                    self.sandbox(id)?;
                }
            }
        }
        Ok(())
    }

    // ---- the folds ----

    fn apply_event(&mut self, index: u64, t: u64, ev: &Event) {
        match ev {
            // Recorded for the audit view; Raft's configuration entries carry the change.
            Event::ClusterMembershipChangeRequested(_) => {}
            Event::ProjectCreated(e) => {
                let parent = (!e.parent.is_empty()).then(|| e.parent.clone());
                if let Some(p) = parent.as_ref().and_then(|p| self.iam.projects.get_mut(p)) {
                    p.children.insert(e.id.clone());
                }
                self.iam.projects.insert(
                    e.id.clone(),
                    Project {
                        id: e.id.clone(),
                        name: e.name.clone(),
                        parent,
                        children: BTreeSet::new(),
                        created_at_ms: t,
                    },
                );
            }
            Event::ProjectDeleted(e) => {
                if let Some(p) = self.iam.projects.remove(&e.id)
                    && let Some(parent) = p.parent.as_ref().and_then(|id| self.iam.projects.get_mut(id))
                {
                    parent.children.remove(&e.id);
                }
                self.quota.limits.remove(&e.id);
                self.quota.usage.remove(&e.id);
                self.quota.network.remove(&e.id);
            }
            Event::ProjectNetworkSet(e) => {
                self.quota.network.insert(
                    e.project.clone(),
                    ProjectNetwork {
                        ceiling: Egress::parse(&e.ceiling).unwrap_or_default(),
                        default_network: (!e.default_network.is_empty()).then(|| e.default_network.clone()),
                    },
                );
            }
            Event::QuotaSet(e) => {
                self.quota
                    .limits
                    .insert(e.project.clone(), limits_from_pb(e.limits.as_ref()));
            }
            Event::TokenIssued(e) => {
                let rights = e.rights.iter().filter_map(|r| Right::parse(r)).collect();
                self.iam.tokens.insert(
                    e.id.clone(),
                    Token {
                        id: e.id.clone(),
                        project: e.project.clone(),
                        name: e.name.clone(),
                        rights,
                        secret_sha256: hex::encode(&e.secret_sha256),
                        expires_at_ms: (e.expires_at_ms != 0).then_some(e.expires_at_ms),
                        issued_by: (!e.issued_by.is_empty()).then(|| e.issued_by.clone()),
                        issued_at_ms: t,
                        revoked: None,
                    },
                );
            }
            Event::TokenRevoked(e) => {
                if let Some(tok) = self.iam.tokens.get_mut(&e.id)
                    && tok.revoked.is_none()
                {
                    tok.revoked = Some(Revocation {
                        at_ms: t,
                        reason: e.reason.clone(),
                    });
                }
            }
            Event::EdgeRegistered(e) => {
                let capacity = usage_from_pb(e.capacity.as_ref());
                let labels = e.labels.clone();
                match self.placement.edges.get_mut(&e.id) {
                    Some(edge) => {
                        edge.address = e.address.clone();
                        edge.capacity = capacity;
                        edge.labels = labels;
                        edge.deregistered = false;
                    }
                    None => {
                        self.placement.next_ordinal = e.ordinal + 1;
                        self.placement.edges.insert(
                            e.id.clone(),
                            Edge {
                                id: e.id.clone(),
                                ordinal: e.ordinal,
                                address: e.address.clone(),
                                capacity,
                                assigned: Usage::default(),
                                labels,
                                registered_at_ms: t,
                                deregistered: false,
                            },
                        );
                    }
                }
            }
            Event::EdgeDeregistered(e) => {
                if let Some(edge) = self.placement.edges.get_mut(&e.id) {
                    edge.deregistered = true;
                }
            }
            Event::SandboxCreated(e) => {
                let born = Lifecycle::created(e.expires_at_ms);
                let s = Sandbox {
                    id: e.id.clone(),
                    project: e.project.clone(),
                    edge: e.edge.clone(),
                    image: e.image.clone(),
                    cpu_millis: e.cpu_millis,
                    memory_mb: e.memory_mb,
                    labels: e.labels.clone(),
                    expires_at_ms: born.expires_at_ms,
                    fork_of: (!e.fork_of.is_empty()).then(|| e.fork_of.clone()),
                    created_at_ms: t,
                    updated_at_ms: t,
                    desired: born.desired,
                    observed: born.observed,
                    exit_code: None,
                    oom_killed: false,
                    reason: None,
                    released: false,
                    index,
                    env: e.env.clone(),
                    auto_pause: e.auto_pause,
                    auto_resume: e.auto_resume,
                    snapshot: (!e.snapshot.is_empty()).then(|| e.snapshot.clone()),
                    template: (!e.template.is_empty()).then(|| e.template.clone()),
                    network: (!e.network.is_empty()).then(|| e.network.clone()),
                    isolation: Isolation::from_event(&e.isolation).unwrap_or_default(),
                    idempotency_key: (!e.idempotency_key.is_empty()).then(|| e.idempotency_key.clone()),
                    source_edge: (!e.source_edge.is_empty()).then(|| e.source_edge.clone()),
                    transfer: (!e.transfer.is_empty()).then(|| e.transfer.clone()),
                    runtime: None,
                    oom_kills: 0,
                    last_oom_command: None,
                    cpu_class: CpuClass::from_event(&e.cpu_class).unwrap_or_default(),
                    image_source: (!e.image_source.is_empty()).then(|| e.image_source.clone()),
                };
                let u = s.usage();
                if let Some(edge) = self.placement.edges.get_mut(&e.edge) {
                    edge.assigned.add(&u);
                }
                let ancestors: Vec<String> = self.ancestry(&e.project).iter().map(|p| p.id.clone()).collect();
                for p in ancestors {
                    self.quota.usage.entry(p).or_default().add(&u);
                }
                self.sandboxes.sandboxes.insert(e.id.clone(), s);
            }
            Event::SandboxPauseRequested(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxResumeRequested(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxKillRequested(e) => {
                self.touch(&e.id, index, t, |s| {
                    advance(s, ev);
                    if s.reason.is_none() {
                        s.reason = Some(e.reason.clone());
                    }
                });
                self.release(&e.id);
            }
            Event::SandboxTimeoutSet(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxLabelsSet(e) => self.touch(&e.id, index, t, |s| s.labels = e.labels.clone()),
            Event::SandboxNetworkSet(e) => self.touch(&e.id, index, t, |s| {
                s.network = (!e.network.is_empty()).then(|| e.network.clone())
            }),
            Event::SandboxTimedOut(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SnapshotRequested(e) => {
                self.snapshots.snapshots.insert(
                    e.id.clone(),
                    Snapshot {
                        id: e.id.clone(),
                        sandbox: e.sandbox.clone(),
                        project: e.project.clone(),
                        edge: e.edge.clone(),
                        name: e.name.clone(),
                        image: e.image.clone(),
                        parent: (!e.parent.is_empty()).then(|| e.parent.clone()),
                        state: SnapshotState::Pending,
                        size_bytes: 0,
                        reason: None,
                        created_at_ms: t,
                        index,
                        isolation: Isolation::from_event(&e.isolation).unwrap_or_default(),
                    },
                );
            }
            Event::SnapshotReady(e) => {
                if let Some(x) = self.snapshots.snapshots.get_mut(&e.id) {
                    x.state = SnapshotState::Ready;
                    x.size_bytes = e.size_bytes;
                    x.index = index;
                }
            }
            Event::SnapshotFailed(e) => {
                if let Some(x) = self.snapshots.snapshots.get_mut(&e.id) {
                    x.state = SnapshotState::Failed;
                    x.reason = Some(e.reason.clone());
                    x.index = index;
                }
            }
            Event::SnapshotDeleted(e) => {
                self.snapshots.snapshots.remove(&e.id);
            }
            Event::ImageRequested(e) => {
                self.images.images.insert(
                    e.name.clone(),
                    Image {
                        name: e.name.clone(),
                        project: e.project.clone(),
                        reference: e.reference.clone(),
                        edge: e.edge.clone(),
                        source_sandbox: (!e.source_sandbox.is_empty()).then(|| e.source_sandbox.clone()),
                        scrub: e.scrub.clone(),
                        config: ConfigOverride::from_event(e.config.as_ref()),
                        state: ImageState::Pending,
                        digest: None,
                        size_bytes: 0,
                        layers: 0,
                        reason: None,
                        created_at_ms: t,
                        index,
                    },
                );
            }
            Event::ImageReady(e) => {
                // A report from an edge the name has since moved from is stale.
                if let Some(x) = self.images.images.get_mut(&e.name).filter(|x| x.edge == e.edge) {
                    x.state = ImageState::Ready;
                    x.digest = Some(e.digest.clone());
                    x.size_bytes = e.size_bytes;
                    x.layers = e.layers;
                    x.reason = None;
                    x.index = index;
                }
            }
            Event::ImageFailed(e) => {
                if let Some(x) = self.images.images.get_mut(&e.name).filter(|x| x.edge == e.edge) {
                    x.state = ImageState::Failed;
                    x.reason = Some(e.reason.clone());
                    x.index = index;
                }
            }
            Event::ImageDeleted(e) => {
                self.images.images.remove(&e.name);
            }
            Event::TemplateBuildRequested(e) => {
                let template = self
                    .images
                    .templates
                    .entry(e.template_id.clone())
                    .or_insert_with(|| Template {
                        id: e.template_id.clone(),
                        project: e.project.clone(),
                        name: None,
                        cpu_count: 0,
                        memory_mb: 0,
                        builds: BTreeMap::new(),
                        tags: BTreeMap::new(),
                        created_at_ms: t,
                        index,
                    });
                if !e.name.is_empty() {
                    template.name = Some(e.name.clone());
                }
                template.cpu_count = e.cpu_count;
                template.memory_mb = e.memory_mb;
                template.index = index;
                template.builds.insert(
                    e.build_id.clone(),
                    TemplateBuild {
                        id: e.build_id.clone(),
                        status: BuildStatus::Waiting,
                        tags: e.tags.clone(),
                        image: None,
                        from: None,
                        start_cmd: None,
                        ready_cmd: None,
                        steps: 0,
                        runner: String::new(),
                        error: None,
                        error_step: None,
                        created_at_ms: t,
                        finished_at_ms: 0,
                        index,
                    },
                );
            }
            Event::TemplateBuildStarted(e) => {
                let some = |v: &String| (!v.is_empty()).then(|| v.clone());
                if let Some(b) = self.template_build_mut(&e.template_id, &e.build_id) {
                    b.status = BuildStatus::Building;
                    b.image = some(&e.image);
                    b.from = some(&e.from);
                    b.start_cmd = some(&e.start_cmd);
                    b.ready_cmd = some(&e.ready_cmd);
                    b.steps = e.steps;
                    b.runner = e.runner.clone();
                    b.index = index;
                }
            }
            Event::TemplateBuildFinished(e) => {
                let Some(template) = self.images.templates.get_mut(&e.template_id) else {
                    return;
                };
                let Some(b) = template.builds.get_mut(&e.build_id) else {
                    return;
                };
                b.finished_at_ms = t;
                b.index = index;
                if e.error.is_empty() {
                    b.status = BuildStatus::Ready;
                    for tag in b.tags.clone() {
                        template.tags.insert(tag, e.build_id.clone());
                    }
                } else {
                    b.status = BuildStatus::Error;
                    b.error = Some(e.error.clone());
                    b.error_step = (!e.error_step.is_empty()).then(|| e.error_step.clone());
                }
                template.index = index;
            }
            Event::TemplateTagsSet(e) => {
                if let Some(template) = self.images.templates.get_mut(&e.template_id) {
                    for tag in &e.tags {
                        if e.build_id.is_empty() {
                            template.tags.remove(tag);
                        } else {
                            template.tags.insert(tag.clone(), e.build_id.clone());
                        }
                    }
                    template.index = index;
                }
            }
            Event::TemplateDeleted(e) => {
                self.images.templates.remove(&e.template_id);
            }
            Event::SandboxForkRequested(e) => self.touch(&e.id, index, t, |_| {}),
            Event::SandboxReady(e) => self.touch(&e.id, index, t, |s| {
                if advance(s, ev) && !e.vmm.is_empty() {
                    s.runtime = Some(Runtime {
                        vmm: e.vmm.clone(),
                        accelerator: e.accelerator.clone(),
                    });
                }
            }),
            Event::SandboxOomKilled(e) => self.touch(&e.id, index, t, |s| {
                // Reports may repeat after an edge restart: the count only grows.
                if e.kills > s.oom_kills {
                    s.oom_kills = e.kills;
                    s.last_oom_command = (!e.command.is_empty()).then(|| e.command.clone());
                }
            }),
            Event::SandboxPaused(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxResumed(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxFailed(e) => {
                self.touch(&e.id, index, t, |s| {
                    advance(s, ev);
                    s.reason = Some(e.reason.clone());
                });
                self.release(&e.id);
            }
            Event::SandboxExited(e) => {
                self.touch(&e.id, index, t, |s| {
                    advance(s, ev);
                    s.exit_code = Some(e.exit_code);
                    s.oom_killed = e.oom_killed;
                    if !e.reason.is_empty() {
                        s.reason = Some(e.reason.clone());
                    }
                });
                self.release(&e.id);
            }
        }
    }

    fn touch(&mut self, id: &str, index: u64, t: u64, f: impl FnOnce(&mut Sandbox)) {
        if let Some(s) = self.sandboxes.sandboxes.get_mut(id) {
            f(s);
            s.index = index;
            s.updated_at_ms = t;
        }
    }

    /// Gives a sandbox's quota and edge capacity back, once.
    fn release(&mut self, id: &str) {
        let Some(s) = self.sandboxes.sandboxes.get_mut(id) else {
            return;
        };
        if s.released {
            return;
        }
        s.released = true;
        let (u, edge, project) = (s.usage(), s.edge.clone(), s.project.clone());
        if let Some(e) = self.placement.edges.get_mut(&edge) {
            e.assigned.sub(&u);
        }
        let ancestors: Vec<String> = self.ancestry(&project).iter().map(|p| p.id.clone()).collect();
        for p in ancestors {
            self.quota.usage.entry(p).or_default().sub(&u);
        }
    }

    // ---- serialisation ----

    /// The whole state, deterministically encoded (Raft snapshots and checkpoints).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("state serialises: it holds only maps, strings and numbers")
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<State, String> {
        serde_json::from_slice(bytes).map_err(|e| format!("state snapshot does not decode: {e}"))
    }

    /// SHA-256 of the deterministic encoding: equal on every node that applied the same log.
    pub fn hash(&self) -> String {
        hex::encode(Sha256::digest(self.to_bytes()))
    }

    /// One view as JSON, as users see it (token secret hashes left out).
    pub fn view_json(&self, name: &str) -> Option<serde_json::Value> {
        let mut v = match name {
            "sandboxes" => serde_json::to_value(&self.sandboxes),
            "placement" => serde_json::to_value(&self.placement),
            "quota" => serde_json::to_value(&self.quota),
            "iam" => serde_json::to_value(&self.iam),
            "audit" => serde_json::to_value(&self.audit),
            "snapshots" => serde_json::to_value(&self.snapshots),
            "images" => serde_json::to_value(&self.images),
            _ => return None,
        }
        .ok()?;
        if name == "sandboxes" {
            // Environment values may be secrets: views show only their names.
            if let Some(all) = v.get_mut("sandboxes").and_then(|t| t.as_object_mut()) {
                for x in all.values_mut() {
                    if let Some(env) = x.get_mut("env").and_then(|e| e.as_object_mut()) {
                        for val in env.values_mut() {
                            *val = serde_json::Value::String("<redacted>".into());
                        }
                    }
                }
            }
        }
        if name == "iam"
            && let Some(tokens) = v.get_mut("tokens").and_then(|t| t.as_object_mut())
        {
            for t in tokens.values_mut() {
                if let Some(o) = t.as_object_mut() {
                    o.remove("secret_sha256");
                }
            }
        }
        Some(v)
    }
}

/// Moves a sandbox along its lifecycle; whether `ev` was a transition it took.
fn advance(s: &mut Sandbox, ev: &Event) -> bool {
    let now = Lifecycle {
        desired: s.desired,
        observed: s.observed,
        expires_at_ms: s.expires_at_ms,
    };
    let Some(next) = now.next(ev) else {
        return false;
    };
    debug_assert_eq!(
        now.is_released(),
        s.released,
        "sandbox {}: released is the lifecycle's",
        s.id
    );
    s.desired = next.desired;
    s.observed = next.observed;
    s.expires_at_ms = next.expires_at_ms;
    true
}

fn audit_record(index: u64, batch: &Batch, outcome: &Outcome) -> AuditRecord {
    let principal = batch
        .principal
        .as_ref()
        .map(|p| format!("{}:{}", p.kind, p.id))
        .unwrap_or_default();
    AuditRecord {
        index,
        time_ms: batch.time_ms,
        principal,
        project: batch.project.clone(),
        action: batch.action.clone(),
        target: batch.target.clone(),
        result: match outcome {
            Outcome::Applied { .. } => AuditResult::Ok,
            Outcome::Denied { code, message, .. } => AuditResult::Denied {
                code: code.clone(),
                message: message.clone(),
            },
            Outcome::Rejected { message, .. } => AuditResult::Rejected {
                message: message.clone(),
            },
            Outcome::Duplicate { first, .. } => AuditResult::Rejected {
                message: format!(
                    "a retry of request {} applied at index {first}: not applied again",
                    batch.request_id
                ),
            },
        },
        request_id: batch.request_id.clone(),
    }
}

pub fn limits_from_pb(r: Option<&pb::Resources>) -> Limits {
    let r = r.cloned().unwrap_or_default();
    Limits {
        sandboxes: r.sandboxes,
        cpu_millis: r.cpu_millis,
        memory_mb: r.memory_mb,
    }
}

pub fn limits_to_pb(l: &Limits) -> pb::Resources {
    pb::Resources {
        sandboxes: l.sandboxes,
        cpu_millis: l.cpu_millis,
        memory_mb: l.memory_mb,
    }
}

pub fn usage_from_pb(r: Option<&pb::Resources>) -> Usage {
    let r = r.cloned().unwrap_or_default();
    Usage {
        sandboxes: r.sandboxes.unwrap_or(0),
        cpu_millis: r.cpu_millis.unwrap_or(0),
        memory_mb: r.memory_mb.unwrap_or(0),
    }
}

pub fn usage_to_pb(u: &Usage) -> pb::Resources {
    pb::Resources {
        sandboxes: Some(u.sandboxes),
        cpu_millis: Some(u.cpu_millis),
        memory_mb: Some(u.memory_mb),
    }
}
