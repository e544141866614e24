//! Input rules shared by every command: names, labels, amounts. A breach is a
//! `RejectionKind::Invalid` naming the offending field, and nothing is logged.

use crate::{Rejection, RejectionKind};
use std::collections::BTreeMap;

/// The largest values the API accepts; anything above is a typo or an attack.
pub struct InputLimits {
    pub name_len: usize,
    pub label_count: usize,
    pub label_key_len: usize,
    pub label_value_len: usize,
    pub image_len: usize,
    pub sandboxes: u64,
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub fork_count: u32,
    pub timeout_seconds: u64,
    pub reason_len: usize,
    pub env_count: usize,
    pub env_bytes: usize,
    pub network_len: usize,
    /// Paths one pack may scrub, and the bytes of each.
    pub scrub_count: usize,
    pub scrub_path_len: usize,
}

pub const LIMITS: InputLimits = InputLimits {
    name_len: 63,
    label_count: 64,
    label_key_len: 63,
    label_value_len: 255,
    image_len: 255,
    sandboxes: 10_000_000,
    cpu_millis: 1_000_000_000,
    memory_mb: 1_000_000_000,
    fork_count: 1024,
    timeout_seconds: 366 * 24 * 3600,
    reason_len: 1024,
    env_count: 256,
    env_bytes: 256 * 1024,
    network_len: 16 * 1024,
    scrub_count: 64,
    scrub_path_len: 4096,
};

fn invalid(field: &str, msg: String) -> Rejection {
    Rejection::field(RejectionKind::Invalid, field, msg)
}

/// A name: 1-63 characters of a-z, 0-9, '-', '_' or '.', starting with a letter or digit.
pub fn name(field: &str, v: &str) -> Result<(), Rejection> {
    if v.is_empty() || v.len() > LIMITS.name_len {
        return Err(invalid(
            field,
            format!("{field} must be 1 to {} characters long", LIMITS.name_len),
        ));
    }
    let ok_first = v
        .chars()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let ok_rest = v
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '-' | '_' | '.'));
    if !ok_first || !ok_rest {
        return Err(invalid(
            field,
            format!("{field} may hold only a-z, 0-9, '-', '_' and '.', and must start with a letter or digit"),
        ));
    }
    Ok(())
}

/// An id that must be non-empty and short (its existence is checked separately).
pub fn id(field: &str, v: &str) -> Result<(), Rejection> {
    if v.is_empty() || v.len() > 128 || v.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(invalid(
            field,
            format!("{field} must be a non-empty id without spaces, at most 128 characters"),
        ));
    }
    Ok(())
}

pub fn labels(field: &str, l: &BTreeMap<String, String>) -> Result<(), Rejection> {
    if l.len() > LIMITS.label_count {
        return Err(invalid(field, format!("at most {} labels", LIMITS.label_count)));
    }
    for (k, v) in l {
        if k.is_empty() || k.len() > LIMITS.label_key_len || k.chars().any(|c| c.is_control() || c.is_whitespace()) {
            return Err(invalid(
                field,
                format!(
                    "label key {k:?} must be 1 to {} characters without spaces",
                    LIMITS.label_key_len
                ),
            ));
        }
        if v.len() > LIMITS.label_value_len || v.chars().any(|c| c.is_control()) {
            return Err(invalid(
                field,
                format!(
                    "label {k:?} has a value over {} characters or with control characters",
                    LIMITS.label_value_len
                ),
            ));
        }
    }
    Ok(())
}

/// Create options: environment names are shell-style, values bounded, no NUL anywhere.
/// Environment variables: names `[A-Za-z_][A-Za-z0-9_]*`, no NUL, within the limits.
pub fn env(field: &str, env: &BTreeMap<String, String>) -> Result<(), Rejection> {
    if env.len() > LIMITS.env_count {
        return Err(invalid(
            field,
            format!("at most {} environment variables", LIMITS.env_count),
        ));
    }
    let mut total = 0usize;
    for (k, v) in env {
        let ok = k.len() <= 255
            && k.chars().next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(invalid(
                field,
                format!("environment variable name {k:?} must match [A-Za-z_][A-Za-z0-9_]*"),
            ));
        }
        if v.contains('\0') {
            return Err(invalid(
                field,
                format!("environment variable {k} holds a NUL character"),
            ));
        }
        total += k.len() + v.len();
    }
    if total > LIMITS.env_bytes {
        return Err(invalid(
            field,
            format!("the environment is over {} bytes", LIMITS.env_bytes),
        ));
    }
    Ok(())
}

/// A packed image's config changes: variables as [`env`], an absolute working
/// directory, a user name, and start and ready commands of at most 16 KiB.
pub fn config_override(field: &str, c: &opendsec_projections::ConfigOverride) -> Result<(), Rejection> {
    env(&format!("{field}.env"), &c.env)?;
    if !c.workdir.is_empty() && (!c.workdir.starts_with('/') || c.workdir.len() > 4096 || c.workdir.contains('\0')) {
        return Err(invalid(
            &format!("{field}.workdir"),
            "the working directory is an absolute path of at most 4096 bytes".into(),
        ));
    }
    let user_ok = c.user.len() <= 64
        && c.user
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b':'));
    if !user_ok {
        return Err(invalid(
            &format!("{field}.user"),
            format!(
                "user {:?} must be a user name (or uid), as in an image's config",
                c.user
            ),
        ));
    }
    for (f, cmd) in [("start_cmd", &c.start_cmd), ("ready_cmd", &c.ready_cmd)] {
        if cmd.len() > 16 * 1024 || cmd.contains('\0') {
            return Err(invalid(
                &format!("{field}.{f}"),
                "a command is at most 16 KiB, without NUL characters".into(),
            ));
        }
    }
    Ok(())
}

pub fn options(field: &str, o: &crate::SandboxOptions) -> Result<(), Rejection> {
    env(&format!("{field}.env"), &o.env)?;
    if let Some(k) = &o.idempotency_key
        && (k.is_empty() || k.len() > 128 || !k.bytes().all(|b| b.is_ascii_graphic()))
    {
        return Err(invalid(
            &format!("{field}.idempotency_key"),
            "an idempotency key is 1 to 128 printable ASCII characters".into(),
        ));
    }
    if let Some(n) = &o.network {
        crate::decide::network::parse(&format!("{field}.network"), n)?;
    }
    Ok(())
}

/// A task name: the value of a `task` label, so non-empty and within the label rules.
pub fn task(field: &str, v: &str) -> Result<(), Rejection> {
    if v.is_empty() || v.len() > LIMITS.label_value_len || v.chars().any(|c| c.is_control()) {
        return Err(invalid(
            field,
            format!(
                "{field} must be 1 to {} characters without control characters",
                LIMITS.label_value_len
            ),
        ));
    }
    Ok(())
}

pub fn amount(field: &str, v: u64, max: u64) -> Result<(), Rejection> {
    if v > max {
        return Err(invalid(field, format!("{field} = {v} is over the maximum {max}")));
    }
    Ok(())
}

pub fn text(field: &str, v: &str, max: usize) -> Result<(), Rejection> {
    if v.len() > max || v.chars().any(|c| c.is_control() && c != '\n') {
        return Err(invalid(
            field,
            format!("{field} must be at most {max} characters, without control characters"),
        ));
    }
    Ok(())
}

/// Paths a pack leaves out: at most `scrub_count`, each absolute, at most
/// `scrub_path_len` bytes, with no empty, `.` or `..` component (so each names one place
/// in the sandbox's file system, matched exactly by the edge) and no control characters.
pub fn scrub(field: &str, paths: &[String]) -> Result<(), Rejection> {
    if paths.len() > LIMITS.scrub_count {
        return Err(invalid(
            field,
            format!("{field} lists {} paths; at most {}", paths.len(), LIMITS.scrub_count),
        ));
    }
    for p in paths {
        let ok = p.len() <= LIMITS.scrub_path_len
            && !p.chars().any(char::is_control)
            && p.strip_prefix('/')
                .is_some_and(|rest| rest.split('/').all(|c| !matches!(c, "" | "." | "..")));
        if !ok {
            return Err(invalid(
                field,
                format!(
                    "{field}: {p:?} is not an absolute path of at most {} bytes without '.', '..' or \
                     empty components (e.g. /etc/token)",
                    LIMITS.scrub_path_len
                ),
            ));
        }
    }
    Ok(())
}

/// The most rules (allow and deny together) one sandbox's network policy may hold.
pub const NETWORK_RULES_MAX: usize = 256;

/// Where an egress rule points: a DNS name (exact, or `*.` and a suffix for every name
/// below it) or an address block (a lone address is its own block, /32 or /128).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Domain { name: String, wildcard: bool },
    Cidr { addr: std::net::IpAddr, prefix: u8 },
}

/// A transport a rule covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Any,
    Tcp,
    Udp,
}

/// One egress rule: a target, the ports it covers (empty: every port) and a transport.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    pub target: Target,
    pub ports: Vec<(u16, u16)>,
    pub protocol: Protocol,
}

/// A DNS name as a rule names it: labels of a-z, 0-9 and '-' (not at either end), at most
/// 63 bytes each and 253 in all, at least two labels; letters are folded to lower case.
fn domain(field: &str, v: &str) -> Result<String, Rejection> {
    host_name(field, v, 2)
}

/// A DNS name of at least `min_labels` labels (see [`domain`]), folded to lower case.
pub(crate) fn host_name(field: &str, v: &str, min_labels: usize) -> Result<String, Rejection> {
    let name = v.strip_suffix('.').unwrap_or(v).to_ascii_lowercase();
    let labels: Vec<&str> = name.split('.').collect();
    let ok = name.len() <= 253
        && labels.len() >= min_labels
        && labels.iter().all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if !ok {
        return Err(invalid(
            field,
            format!(
                "{field}: {v:?} is not a DNS name (e.g. pkgs.example.com or *.example.com), an address or a CIDR block"
            ),
        ));
    }
    Ok(name)
}

/// A CIDR block or a lone address, IPv4 or IPv6; host bits must be zero.
fn cidr(field: &str, v: &str) -> Result<Option<Target>, Rejection> {
    let (addr, prefix) = match v.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (v, None),
    };
    let Ok(addr) = addr.parse::<std::net::IpAddr>() else {
        return Ok(None);
    };
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let prefix = match prefix {
        None => max,
        Some(p) => match p.parse::<u8>() {
            Ok(n) if n <= max => n,
            _ => return Err(invalid(field, format!("{field}: {v:?} has a prefix length over {max}"))),
        },
    };
    let bits: u128 = match addr {
        std::net::IpAddr::V4(a) => u32::from(a) as u128,
        std::net::IpAddr::V6(a) => u128::from(a),
    };
    let host = match max - prefix {
        0 => 0,
        128 => bits,
        n => bits & ((1u128 << n) - 1),
    };
    if host != 0 {
        return Err(invalid(
            field,
            format!("{field}: {v:?} has bits set below its /{prefix} prefix (write the block's first address)"),
        ));
    }
    Ok(Some(Target::Cidr { addr, prefix }))
}

/// A rule's target: an address, a CIDR block, a DNS name or `*.` and a DNS name.
pub fn target(field: &str, v: &str) -> Result<Target, Rejection> {
    if let Some(t) = cidr(field, v)? {
        return Ok(t);
    }
    if let Some(rest) = v.strip_prefix("*.") {
        return Ok(Target::Domain {
            name: domain(field, rest)?,
            wildcard: true,
        });
    }
    Ok(Target::Domain {
        name: domain(field, v)?,
        wildcard: false,
    })
}

/// A port or a range `LO-HI`, 1 to 65535.
fn port_range(field: &str, v: &str) -> Result<(u16, u16), Rejection> {
    let bad = || {
        invalid(
            field,
            format!("{field}: {v:?} is not a port (1-65535) or a range LO-HI"),
        )
    };
    let one = |s: &str| s.parse::<u16>().ok().filter(|p| *p > 0).ok_or_else(bad);
    match v.split_once('-') {
        Some((lo, hi)) => {
            let (lo, hi) = (one(lo)?, one(hi)?);
            if lo > hi {
                return Err(bad());
            }
            Ok((lo, hi))
        }
        None => one(v).map(|p| (p, p)),
    }
}

/// One rule as JSON: a string (`TARGET`, `TARGET:PORT`, `[V6]:PORT`, `CIDR:PORT`) or an
/// object `{"to": TARGET, "ports": [443, "8000-8100"], "protocol": "tcp"|"udp"|"any"}`.
pub fn rule(field: &str, v: &serde_json::Value) -> Result<Rule, Rejection> {
    use serde_json::Value;
    match v {
        Value::String(s) => {
            if s.len() > 300 {
                return Err(invalid(field, format!("{field} is over 300 bytes")));
            }
            // `[v6]:port`, `host:port`, `a.b.c.d/n:port`; a bare IPv6 address has several colons.
            let (t, port) = if let Some(rest) = s.strip_prefix('[') {
                match rest.split_once("]:") {
                    Some((a, p)) => (a, Some(p)),
                    None => (rest.strip_suffix(']').unwrap_or(rest), None),
                }
            } else if s.matches(':').count() == 1 {
                let (a, p) = s.split_once(':').expect("one colon");
                (a, Some(p))
            } else {
                (s.as_str(), None)
            };
            Ok(Rule {
                target: target(field, t)?,
                ports: port.map(|p| port_range(field, p)).transpose()?.into_iter().collect(),
                protocol: Protocol::Any,
            })
        }
        Value::Object(o) => {
            for k in o.keys() {
                if !matches!(k.as_str(), "to" | "ports" | "protocol") {
                    return Err(invalid(
                        &format!("{field}.{k}"),
                        format!("{field}.{k} is not a rule field (to, ports, protocol)"),
                    ));
                }
            }
            let to_field = format!("{field}.to");
            let Some(Value::String(to)) = o.get("to") else {
                return Err(invalid(
                    &to_field,
                    format!("{to_field} must name an address, a CIDR block or a DNS name"),
                ));
            };
            let ports_field = format!("{field}.ports");
            let ports = match o.get("ports") {
                None | Some(Value::Null) => vec![],
                Some(Value::Array(a)) if a.len() <= 64 => a
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let f = format!("{ports_field}[{i}]");
                        match p {
                            Value::Number(n) => port_range(&f, &n.to_string()),
                            Value::String(s) => port_range(&f, s),
                            _ => Err(invalid(&f, format!("{f} must be a port or a range \"LO-HI\""))),
                        }
                    })
                    .collect::<Result<_, _>>()?,
                Some(_) => {
                    return Err(invalid(
                        &ports_field,
                        format!("{ports_field} must be a list of at most 64 ports or ranges"),
                    ));
                }
            };
            let protocol = match o.get("protocol") {
                None | Some(Value::Null) => Protocol::Any,
                Some(Value::String(p)) if p == "any" => Protocol::Any,
                Some(Value::String(p)) if p == "tcp" => Protocol::Tcp,
                Some(Value::String(p)) if p == "udp" => Protocol::Udp,
                Some(_) => {
                    let f = format!("{field}.protocol");
                    return Err(invalid(&f, format!("{f} must be \"tcp\", \"udp\" or \"any\"")));
                }
            };
            Ok(Rule {
                target: target(&to_field, to)?,
                ports,
                protocol,
            })
        }
        _ => Err(invalid(field, format!("{field} must be a string or a rule object"))),
    }
}
