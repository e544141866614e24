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
        if n.len() > LIMITS.network_len {
            return Err(invalid(
                field,
                format!("network settings are over {} bytes", LIMITS.network_len),
            ));
        }
        if serde_json::from_str::<serde_json::Value>(n).is_err() {
            return Err(invalid(field, "network settings must be JSON".into()));
        }
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
