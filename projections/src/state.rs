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

mod check;
mod fold;
mod requests;
mod retention;

pub use requests::{REQUEST_WINDOW_MAX, REQUEST_WINDOW_MS, Requests, RequestsDelta, SeenRequest};
pub use retention::{
    DEFAULT_AUDIT_MS, DEFAULT_AUDIT_RECORDS, DEFAULT_ENDED_SANDBOXES_MS, MAX_AUDIT_RECORDS, MAX_RETENTION_SECONDS,
    MIN_AUDIT_RECORDS, Retention, SWEEP_EVERY_MS,
};

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
    /// How long ended sandboxes and audit records stay in these views.
    #[serde(default, skip_serializing_if = "Retention::is_default")]
    pub retention: Retention,
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
        let before = self.time_ms;
        self.time_ms = self.time_ms.max(batch.time_ms);
        self.sweep(before);
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

    /// The edge sandbox `id` is placed on: as the views say, or, for a sandbox that ended
    /// and was swept from them, as the ordinal in its id says (invariant 4).
    pub fn sandbox_edge(&self, id: &str) -> Option<&str> {
        if let Some(s) = self.sandboxes.sandboxes.get(id) {
            return Some(&s.edge);
        }
        let ord = edge_ordinal_of(id)?;
        self.placement
            .edges
            .values()
            .find(|e| e.ordinal & 0xffff == ord)
            .map(|e| e.id.as_str())
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

    /// A project's write rates in force: the least of its own and its ancestors'.
    pub fn effective_rates(&self, project: &str) -> Rates {
        self.ancestry(project)
            .iter()
            .filter_map(|p| self.quota.rates.get(&p.id))
            .fold(Rates::default(), |acc, r| acc.min(*r))
    }

    /// The subtree rates a write by a token of `project` counts against: each project on
    /// its line (itself included) that set `writes_per_second`, with that rate.
    pub fn rate_lines(&self, project: &str) -> Vec<(String, u64)> {
        self.ancestry(project)
            .iter()
            .filter_map(|p| {
                let r = self.quota.rates.get(&p.id)?.writes_per_second?;
                Some((p.id.clone(), r))
            })
            .collect()
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
                metadata_bytes: own.metadata_bytes.unwrap_or(0),
            };
            let (res, _) = limits.exceeded_by(&own)?;
            Some((d.id.clone(), res, own.get(res)))
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
                        total.get(res)
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
            metadata_bytes: None,
        };
        match cap.exceeded_by(&need) {
            Some((res, limit)) => Err(format!("edge {edge} has no room: {res} capacity is {limit}")),
            None => Ok(()),
        }
    }

    // ---- serialisation ----

    /// The whole state, deterministically encoded (Raft snapshots and checkpoints).
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("state serialises: it holds only maps, strings and numbers")
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<State, String> {
        let mut s: State = serde_json::from_slice(bytes).map_err(|e| format!("state snapshot does not decode: {e}"))?;
        s.recount_metadata();
        Ok(s)
    }

    /// Counts what live sandboxes' environments and labels take ([`Usage::metadata_bytes`],
    /// not in the encoding) into their projects' usage and their edges' assignments.
    fn recount_metadata(&mut self) {
        let live: Vec<(String, String, u64)> = self
            .sandboxes
            .sandboxes
            .values()
            .filter(|s| s.is_live())
            .map(|s| (s.project.clone(), s.edge.clone(), s.usage().metadata_bytes))
            .collect();
        for u in self.quota.usage.values_mut() {
            u.metadata_bytes = 0;
        }
        for e in self.placement.edges.values_mut() {
            e.assigned.metadata_bytes = 0;
        }
        for (project, edge, bytes) in live {
            if let Some(e) = self.placement.edges.get_mut(&edge) {
                e.assigned.metadata_bytes += bytes;
            }
            let ancestors: Vec<String> = self.ancestry(&project).iter().map(|p| p.id.clone()).collect();
            for p in ancestors {
                self.quota.usage.entry(p).or_default().metadata_bytes += bytes;
            }
        }
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
                    redact_network(x.get_mut("network"));
                    if let Some(env) = x.get_mut("env").and_then(|e| e.as_object_mut()) {
                        for val in env.values_mut() {
                            *val = serde_json::Value::String("<redacted>".into());
                        }
                    }
                }
            }
        }
        if name == "quota"
            && let Some(all) = v.get_mut("network").and_then(|t| t.as_object_mut())
        {
            for n in all.values_mut() {
                redact_network(n.get_mut("default_network"));
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

/// Network settings (JSON text) with an egress proxy's password and CA certificate
/// replaced by `<redacted>`.
fn redact_network(network: Option<&mut serde_json::Value>) {
    use serde_json::Value;
    let Some(Value::String(text)) = network else {
        return;
    };
    let Ok(Value::Object(mut o)) = serde_json::from_str::<Value>(text) else {
        return;
    };
    let mut changed = false;
    for key in ["egress_proxy", "egressProxy"] {
        let Some(Value::Object(proxy)) = o.get_mut(key) else {
            continue;
        };
        let redacted = || Value::String("<redacted>".into());
        if proxy.contains_key("password") {
            proxy.insert("password".into(), redacted());
            changed = true;
        }
        if let Some(Value::Object(tls)) = proxy.get_mut("tls") {
            for k in ["caCert", "ca_cert"] {
                if tls.contains_key(k) {
                    tls.insert(k.into(), redacted());
                    changed = true;
                }
            }
        }
    }
    if changed {
        *text = Value::Object(o).to_string();
    }
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
        metadata_bytes: r.metadata_bytes,
    }
}

pub fn limits_to_pb(l: &Limits) -> pb::Resources {
    pb::Resources {
        sandboxes: l.sandboxes,
        cpu_millis: l.cpu_millis,
        memory_mb: l.memory_mb,
        metadata_bytes: l.metadata_bytes,
    }
}

pub fn usage_from_pb(r: Option<&pb::Resources>) -> Usage {
    let r = r.cloned().unwrap_or_default();
    Usage {
        sandboxes: r.sandboxes.unwrap_or(0),
        cpu_millis: r.cpu_millis.unwrap_or(0),
        memory_mb: r.memory_mb.unwrap_or(0),
        metadata_bytes: r.metadata_bytes.unwrap_or(0),
    }
}

/// What a created sandbox takes from its project's quota and its edge's capacity (as
/// [`Sandbox::usage`] of the sandbox it becomes).
pub fn created_usage(e: &pb::SandboxCreated) -> Usage {
    Usage {
        sandboxes: 1,
        cpu_millis: e.cpu_millis,
        memory_mb: e.memory_mb,
        metadata_bytes: metadata_bytes(&e.env, &e.labels),
    }
}

pub fn usage_to_pb(u: &Usage) -> pb::Resources {
    pb::Resources {
        sandboxes: Some(u.sandboxes),
        cpu_millis: Some(u.cpu_millis),
        memory_mb: Some(u.memory_mb),
        metadata_bytes: (u.metadata_bytes > 0).then_some(u.metadata_bytes),
    }
}
