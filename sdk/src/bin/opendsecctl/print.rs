//! What people read: aligned tables of the API's types, and the one switch between
//! them and the API's JSON (`--output json`).

use opendsec_sdk::types::*;
use serde::Serialize;
use std::collections::BTreeMap;

use super::args::Output;

pub(crate) const SNAPSHOT_HEADERS: [&str; 7] = ["ID", "STATE", "SANDBOX", "ISOLATION", "NAME", "SIZE", "CREATED"];

pub(crate) fn snapshot_row(x: &Snapshot) -> Vec<String> {
    let state = match &x.reason {
        Some(r) if x.state == "failed" => format!("failed: {r}"),
        _ => x.state.clone(),
    };
    vec![
        x.id.clone(),
        state,
        x.sandbox.clone(),
        x.isolation.as_str().into(),
        if x.name.is_empty() { "-".into() } else { x.name.clone() },
        format!("{} MB", x.size_bytes >> 20),
        fmt_time(x.created_at_ms),
    ]
}

pub(crate) const IMAGE_HEADERS: [&str; 7] = ["NAME", "STATE", "REFERENCE", "DIGEST", "LAYERS", "SIZE", "CREATED"];

pub(crate) fn image_row(x: &Image) -> Vec<String> {
    let state = match &x.reason {
        Some(r) if x.state == "failed" => format!("failed: {r}"),
        _ => x.state.clone(),
    };
    let digest = x.digest.as_deref().map_or("-".to_string(), |d| {
        let hex = d.strip_prefix("sha256:").unwrap_or(d);
        format!("sha256:{}", &hex[..hex.len().min(12)])
    });
    vec![
        x.name.clone(),
        state,
        match &x.source_sandbox {
            Some(sandbox) => format!("packed from {sandbox} on {}", x.edge),
            None if x.imported => format!("imported on {}", x.edge),
            None => x.reference.clone(),
        },
        digest,
        x.layers.to_string(),
        format!("{} MB", x.size_bytes >> 20),
        fmt_time(x.created_at_ms),
    ]
}

pub(crate) const SANDBOX_HEADERS: [&str; 9] = [
    "ID",
    "STATE",
    "ISOLATION",
    "PROJECT",
    "EDGE",
    "IMAGE",
    "CPU/MEM",
    "LABELS",
    "EXPIRES",
];

pub(crate) fn sandbox_row(s: &Sandbox) -> Vec<String> {
    vec![
        s.id.clone(),
        s.state.clone(),
        match &s.runtime {
            // How a VM runs: e.g. `microvm (qemu, tcg)`.
            Some(r) => format!("{} ({}, {})", s.isolation.as_str(), r.vmm, r.accelerator),
            None => s.isolation.as_str().into(),
        },
        s.project.clone(),
        s.edge.clone(),
        s.image.clone(),
        format!("{}m/{}MB", s.cpu_millis, s.memory_mb),
        labels(&s.labels),
        s.expires_at_ms.map_or("never".into(), fmt_time),
    ]
}

pub(crate) const EDGE_HEADERS: [&str; 7] = [
    "ID",
    "ADDRESS",
    "SANDBOXES",
    "CPU (m)",
    "MEMORY (MB)",
    "HEARTBEAT",
    "STATE",
];

pub(crate) fn edge_row(e: &Edge) -> Vec<String> {
    vec![
        e.id.clone(),
        e.address.clone(),
        format!("{}/{}", e.assigned.sandboxes, e.capacity.sandboxes),
        format!("{}/{}", e.assigned.cpu_millis, e.capacity.cpu_millis),
        format!("{}/{}", e.assigned.memory_mb, e.capacity.memory_mb),
        e.heartbeat.as_ref().map_or("none".into(), |h| fmt_time(h.at_ms)),
        if e.deregistered {
            "deregistered".into()
        } else {
            "registered".into()
        },
    ]
}

pub(crate) fn project_row(p: &Project) -> Vec<String> {
    vec![
        p.id.clone(),
        p.name.clone(),
        p.parent.clone().unwrap_or_else(|| "-".into()),
        fmt_time(p.created_at_ms),
    ]
}

pub(crate) fn labels(l: &BTreeMap<String, String>) -> String {
    if l.is_empty() {
        return "-".into();
    }
    l.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
}

pub(crate) fn compact(v: &Option<serde_json::Value>) -> String {
    let s = v.as_ref().map_or("-".into(), |v| v.to_string());
    if s.chars().count() > 60 {
        format!("{}...", s.chars().take(57).collect::<String>())
    } else {
        s
    }
}

pub(crate) fn fmt_time(ms: u64) -> String {
    let t = time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000);
    let fmt = time::macros::format_description!("[year]-[month]-[day] [hour]:[minute]:[second]Z");
    t.ok()
        .and_then(|t| t.format(&fmt).ok())
        .unwrap_or_else(|| ms.to_string())
}

/// Aligned columns, two spaces apart.
pub(crate) fn table(headers: &[&str], rows: Vec<Vec<String>>) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            widths[i] = widths[i].max(c.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let s: Vec<String> = cells.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        s.join("  ").trim_end().to_string()
    };
    let mut out = vec![line(headers.to_vec())];
    out.extend(rows.iter().map(|r| line(r.iter().map(String::as_str).collect())));
    out.join("\n")
}

#[derive(Clone, Copy)]
pub(crate) struct Printer(pub(crate) Output);

impl Printer {
    pub(crate) fn show<T: Serialize>(&self, v: &T, human: impl FnOnce(&T) -> String) {
        match self.0 {
            Output::Json => println!("{}", serde_json::to_string_pretty(v).expect("API types serialise")),
            Output::Table => println!("{}", human(v)),
        }
    }
}

/// An egress policy, one line a part.
pub(crate) fn network(p: &opendsec_sdk::types::NetworkPolicy) -> String {
    if p.is_deny() {
        return "egress: none (nothing is allowed)".to_string();
    }
    let rules = |rs: &[serde_json::Value]| {
        rs.iter()
            .map(|r| r.as_str().map_or_else(|| r.to_string(), str::to_string))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let mut lines = vec![format!(
        "internet:  {}",
        if p.allow_internet_access {
            "yes (public addresses)"
        } else {
            "no"
        }
    )];
    if !p.allow_out.is_empty() {
        lines.push(format!("allow out: {}", rules(&p.allow_out)));
    }
    if !p.deny_out.is_empty() {
        lines.push(format!("deny out:  {}", rules(&p.deny_out)));
    }
    if !p.dns_servers.is_empty() {
        lines.push(format!("dns:       {}", p.dns_servers.join(", ")));
    }
    if let Some(proxy) = &p.egress_proxy {
        let field = |k: &str| proxy.get(k).and_then(|v| v.as_str());
        let mut text = field("address").unwrap_or("?").to_string();
        if let Some(u) = field("username") {
            text = format!("{text} as {u}");
        }
        if proxy.get("tls").is_some_and(|t| !t.is_null()) {
            text.push_str(" over TLS");
        }
        lines.push(format!("via proxy: {text} (TCP)"));
    }
    lines.join("\n")
}

/// A project's ceiling and default policy.
pub(crate) fn project_network(project: &str, n: &opendsec_sdk::types::ProjectNetwork) -> String {
    let default = match &n.default_network {
        Some(p) => network(p),
        None => "egress: none (nothing is allowed)".to_string(),
    };
    format!(
        "project {project}: egress ceiling {}\nits sandboxes' default policy:\n{default}",
        n.ceiling
    )
}
