//! From the projections' views to the API's wire types. The views are internal
//! and may change; these mappings keep the API stable (and never carry a secret hash).

use opendsec_projections::{Desired, Observed, views};
use opendsec_sdk::types as api;
use serde::Serialize;
use serde_json::{Map, Value};

/// A unit enum's serde name (`running`, `pending`).
fn word<T: Serialize>(t: &T) -> String {
    serde_json::to_value(t)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

pub fn project(p: &views::Project) -> api::Project {
    api::Project {
        id: p.id.clone(),
        name: p.name.clone(),
        parent: p.parent.clone(),
        children: p.children.iter().cloned().collect(),
        created_at_ms: p.created_at_ms,
    }
}

pub fn limits(l: &views::Limits) -> api::Limits {
    api::Limits {
        sandboxes: l.sandboxes,
        cpu_millis: l.cpu_millis,
        memory_mb: l.memory_mb,
        metadata_bytes: l.metadata_bytes,
    }
}

pub fn resources(u: &views::Usage) -> api::Resources {
    api::Resources {
        sandboxes: u.sandboxes,
        cpu_millis: u.cpu_millis,
        memory_mb: u.memory_mb,
        metadata_bytes: u.metadata_bytes,
    }
}

pub fn usage(r: &api::Resources) -> views::Usage {
    views::Usage {
        sandboxes: r.sandboxes,
        cpu_millis: r.cpu_millis,
        memory_mb: r.memory_mb,
        metadata_bytes: r.metadata_bytes,
    }
}

pub fn token(t: &views::Token) -> api::Token {
    api::Token {
        id: t.id.clone(),
        project: t.project.clone(),
        name: t.name.clone(),
        rights: t.rights.iter().map(|r| r.as_str().to_string()).collect(),
        expires_at_ms: t.expires_at_ms,
        issued_by: t.issued_by.clone(),
        issued_at_ms: t.issued_at_ms,
        revoked: t.revoked.as_ref().map(|r| api::Revocation {
            at_ms: r.at_ms,
            reason: r.reason.clone(),
        }),
    }
}

/// One word for where a sandbox is, from what was asked and what was observed.
pub fn sandbox_state(s: &views::Sandbox) -> &'static str {
    match (s.released, s.desired, s.observed) {
        (_, _, Observed::Failed) => "failed",
        (_, _, Observed::Exited) => "exited",
        (true, _, _) | (_, Desired::Killed, _) => "killed",
        (false, Desired::Paused, Observed::Paused) => "paused",
        (false, Desired::Paused, _) => "pausing",
        (false, Desired::Running, Observed::Paused) => "resuming",
        (false, Desired::Running, Observed::Pending) => "pending",
        (false, Desired::Running, Observed::Ready) => "running",
    }
}

pub const SANDBOX_STATES: [&str; 8] = [
    "pending", "running", "pausing", "paused", "resuming", "killed", "failed", "exited",
];

pub fn sandbox(s: &views::Sandbox) -> api::Sandbox {
    api::Sandbox {
        id: s.id.clone(),
        project: s.project.clone(),
        edge: s.edge.clone(),
        image: s.image.clone(),
        cpu_millis: s.cpu_millis,
        memory_mb: s.memory_mb,
        labels: s.labels.clone(),
        expires_at_ms: s.expires_at_ms,
        fork_of: s.fork_of.clone(),
        created_at_ms: s.created_at_ms,
        updated_at_ms: s.updated_at_ms,
        state: sandbox_state(s).into(),
        desired: word(&s.desired),
        observed: word(&s.observed),
        exit_code: s.exit_code,
        oom_killed: s.oom_killed,
        reason: s.reason.clone(),
        oom_kills: s.oom_kills,
        last_oom_command: s.last_oom_command.clone(),
        cpu_class: cpu_class(s.cpu_class),
        live: s.is_live(),
        auto_resume: s.auto_resume,
        auto_pause: s.auto_pause,
        auto_pause_filesystem: s.auto_pause_filesystem,
        pause_filesystem: s.pause_filesystem,
        index: s.index,
        isolation: isolation(s.isolation),
        snapshot: s.snapshot.clone(),
        source_edge: s.source_edge.clone(),
        runtime: s.runtime.as_ref().map(|r| api::SandboxRuntime {
            vmm: r.vmm.clone(),
            accelerator: r.accelerator.clone(),
        }),
        network: network(s.network.as_deref()),
    }
}

/// Said (`X-Opendsec-Warning`) when a sandbox's policy allows any egress that its edge
/// does not give: an edge started with `--no-sandbox-network` gives its sandboxes no link
/// out.
pub const EGRESS_NOT_ENFORCED: &str = "this sandbox has no network egress: its edge was started with --no-sandbox-network (it enforces no policy and gives none); its policy is kept and shown as asked";

/// Whether a sandbox on edge `edge` gets the egress its policy allows: its edge enforces
/// policies ([`opendsec_commands::EGRESS_LABEL`]).
pub fn egress_enforced(s: &opendsec_projections::State, edge: &str) -> bool {
    s.placement
        .edges
        .get(edge)
        .is_some_and(|e| e.labels.contains_key(opendsec_commands::EGRESS_LABEL))
}

/// The warning header for a sandbox whose policy allows egress it does not get, if so.
pub fn egress_warning(p: &api::NetworkPolicy, enforced: bool) -> axum::http::HeaderMap {
    let mut h = axum::http::HeaderMap::new();
    if !enforced && (p.allow_internet_access || !p.allow_out.is_empty()) {
        h.insert(
            "x-opendsec-warning",
            axum::http::HeaderValue::from_static(EGRESS_NOT_ENFORCED),
        );
    }
    h
}

/// Network settings as logged (any spelling, E2B's included; absent: deny) in the
/// canonical form the API shows.
pub fn network(logged: Option<&str>) -> api::NetworkPolicy {
    let canonical = opendsec_commands::network::Policy::of_logged(logged).shown_json();
    serde_json::from_value(canonical).expect("the canonical policy has the wire type's shape")
}

/// A policy of the API as the JSON a command carries, keeping the E2B settings of
/// traffic into the sandbox that `current` (its logged settings) holds: a REST update
/// replaces what it may reach, never who may reach it.
pub fn network_json(p: &api::NetworkPolicy, current: Option<&str>) -> String {
    let Ok(Value::Object(mut m)) = serde_json::to_value(p) else {
        unreachable!("a policy serializes to an object")
    };
    keep_inbound(current, &mut m);
    Value::Object(m).to_string()
}

/// E2B's settings of traffic into a sandbox, kept in its network JSON beside the egress
/// policy (`e2b/traffic.rs` reads them), in either spelling.
const INBOUND: [(&str, &str); 3] = [
    ("allowPublicTraffic", "allow_public_traffic"),
    ("maskRequestHost", "mask_request_host"),
    ("httpsPorts", "https_ports"),
];

/// The egress settings in both spellings, by their canonical name: a `network` an E2B
/// call names replaces each (absent: none).
const EGRESS: [(&str, &str); 4] = [
    ("allow_out", "allowOut"),
    ("deny_out", "denyOut"),
    ("dns_servers", "dnsServers"),
    ("egress_proxy", "egressProxy"),
];

fn keep_inbound(current: Option<&str>, m: &mut Map<String, Value>) {
    let Some(Ok(Value::Object(cur))) = current.map(serde_json::from_str::<Value>) else {
        return;
    };
    for (camel, snake) in INBOUND {
        if m.contains_key(camel) || m.contains_key(snake) {
            continue;
        }
        if let Some((k, v)) = cur.get_key_value(camel).or_else(|| cur.get_key_value(snake)) {
            m.insert(k.clone(), v.clone());
        }
    }
}

/// The network settings (JSON) that an E2B create or network update asks for.
/// `base` is the policy it starts from: the project's default at create, at an update
/// the sandbox's own (only its internet access carries over: an update names its rules
/// anew). `allow_internet` (E2B's `allow_internet_access`, also read inside `network`)
/// replaces the base's internet access; `network`'s egress rules replace the base's, and
/// its other settings are kept as asked (the command checks them all); the inbound
/// settings `current` holds are kept.
pub fn e2b_network(
    base: Option<&str>,
    allow_internet: Option<bool>,
    network: Option<&Map<String, Value>>,
    current: Option<&str>,
) -> String {
    let Value::Object(mut out) = opendsec_commands::network::Policy::of_logged(base).to_json() else {
        unreachable!("a canonical policy is an object")
    };
    let mut allow_internet = allow_internet;
    if let Some(n) = network {
        for (canonical, camel) in EGRESS {
            let asked = n.get(camel).or_else(|| n.get(canonical)).filter(|v| !v.is_null());
            let none = if canonical == "egress_proxy" {
                Value::Null
            } else {
                Value::Array(vec![])
            };
            out.insert(canonical.into(), asked.cloned().unwrap_or(none));
        }
        for (k, v) in n {
            let egress = EGRESS.iter().any(|(a, b)| k == a || k == b);
            match k.as_str() {
                "allow_internet_access" | "allowInternetAccess" => {
                    allow_internet = allow_internet.or(v.as_bool());
                    if !v.is_boolean() && !v.is_null() {
                        out.insert("allow_internet_access".into(), v.clone()); // refused, named
                    }
                }
                _ if egress => {}
                _ => {
                    out.insert(k.clone(), v.clone());
                }
            }
        }
    }
    if let Some(b) = allow_internet {
        out.insert("allow_internet_access".into(), Value::Bool(b));
    }
    keep_inbound(current, &mut out);
    Value::Object(out).to_string()
}

pub fn isolation(i: views::Isolation) -> api::Isolation {
    match i {
        views::Isolation::Container => api::Isolation::Container,
        views::Isolation::Microvm => api::Isolation::Microvm,
        views::Isolation::Vm => api::Isolation::Vm,
    }
}

pub fn cpu_class(c: views::CpuClass) -> api::CpuClass {
    match c {
        views::CpuClass::LatencySensitive => api::CpuClass::LatencySensitive,
        views::CpuClass::BestEffort => api::CpuClass::BestEffort,
    }
}

pub fn cpu_class_of(c: api::CpuClass) -> views::CpuClass {
    match c {
        api::CpuClass::LatencySensitive => views::CpuClass::LatencySensitive,
        api::CpuClass::BestEffort => views::CpuClass::BestEffort,
    }
}

pub fn isolation_of(i: api::Isolation) -> views::Isolation {
    match i {
        api::Isolation::Container => views::Isolation::Container,
        api::Isolation::Microvm => views::Isolation::Microvm,
        api::Isolation::Vm => views::Isolation::Vm,
    }
}

pub fn snapshot(x: &views::Snapshot) -> api::Snapshot {
    api::Snapshot {
        id: x.id.clone(),
        sandbox: x.sandbox.clone(),
        project: x.project.clone(),
        edge: x.edge.clone(),
        name: x.name.clone(),
        image: x.image.clone(),
        parent: x.parent.clone(),
        isolation: isolation(x.isolation),
        state: word(&x.state),
        size_bytes: x.size_bytes,
        reason: x.reason.clone(),
        created_at_ms: x.created_at_ms,
        index: x.index,
    }
}

pub fn image(x: &views::Image, progress: Option<&opendsec_control::PullProgress>) -> api::Image {
    api::Image {
        name: x.name.clone(),
        project: x.project.clone(),
        reference: x.reference.clone(),
        edge: x.edge.clone(),
        source_sandbox: x.source_sandbox.clone(),
        imported: x.imported,
        scrub: x.scrub.clone(),
        state: word(&x.state),
        digest: x.digest.clone(),
        size_bytes: x.size_bytes,
        layers: x.layers,
        reason: x.reason.clone(),
        created_at_ms: x.created_at_ms,
        index: x.index,
        progress: progress
            .filter(|_| x.state == views::ImageState::Pending)
            .map(|p| api::PullProgress {
                layers_total: p.layers_total,
                layers_done: p.layers_done,
                bytes_total: p.bytes_total,
                bytes_done: p.bytes_done,
                phase: p.phase.clone(),
                started_ms: p.started_ms,
            }),
    }
}

pub fn edge(e: &views::Edge, heartbeat: Option<&opendsec_control::EdgeHeartbeat>) -> api::Edge {
    api::Edge {
        id: e.id.clone(),
        ordinal: e.ordinal,
        address: e.address.clone(),
        capacity: resources(&e.capacity),
        assigned: resources(&e.assigned),
        labels: e.labels.clone(),
        registered_at_ms: e.registered_at_ms,
        deregistered: e.deregistered,
        heartbeat: heartbeat.map(|h| api::Heartbeat {
            at_ms: h.at_ms,
            running_sandboxes: h.running_sandboxes,
            cpu_millis_used: h.cpu_millis_used,
            memory_mb_used: h.memory_mb_used,
        }),
    }
}

pub fn audit_record(r: &views::AuditRecord) -> api::AuditRecord {
    let (result, code, message) = match &r.result {
        views::AuditResult::Ok => ("ok", None, None),
        views::AuditResult::Denied { code, message } => ("denied", Some(code.clone()), Some(message.clone())),
        views::AuditResult::Rejected { message } => ("rejected", None, Some(message.clone())),
    };
    api::AuditRecord {
        index: r.index,
        time_ms: r.time_ms,
        principal: r.principal.clone(),
        project: r.project.clone(),
        action: r.action.clone(),
        target: r.target.clone(),
        result: result.into(),
        code,
        message,
        request_id: r.request_id.clone(),
    }
}
