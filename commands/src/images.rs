//! What an image name means, decided the same way by the control plane (which refuses a
//! create naming no image) and by edges (which build, look up or pull it):
//!
//! - the project's own images, built by every edge on demand (`busybox`, `base`,
//!   `code-interpreter-v1`), under their E2B names and aliases ([`canonical_name`]);
//! - images registered with `PullImage` under a name of their own (the images view);
//! - OCI references that name their registry (`127.0.0.1:5000/python:3.12-slim`,
//!   `ghcr.io/org/env@sha256:...`): an edge that lacks one pulls it at create.
//!
//! A bare `python:3.12` is a Docker Hub shorthand only in `PullImage`, where it is
//! spelled out on purpose; at create it must be registered, so that a typo of `base`
//! is a 404 and not a pull from the internet.

/// The images every edge builds itself.
pub const BUILTIN_IMAGES: [&str; 4] = ["busybox", "base", "code-interpreter-v1", "mcp-gateway"];

/// The store's name for an image reference: E2B clients ask for templates by the names
/// the builders use, with the tag `latest` or `default` (`base:latest`), or by a few other
/// names E2B has used for the same template.
pub fn canonical_name(reference: &str) -> &str {
    const ALIASES: &[(&str, &str)] = &[("code-interpreter", "code-interpreter-v1")];
    let name = reference
        .strip_suffix(":latest")
        .or_else(|| reference.strip_suffix(":default"))
        .unwrap_or(reference);
    ALIASES
        .iter()
        .find(|(alias, _)| *alias == name)
        .map_or(name, |(_, canonical)| canonical)
}

/// Whether `name` (after [`canonical_name`]) is one of [`BUILTIN_IMAGES`].
pub fn is_builtin(name: &str) -> bool {
    BUILTIN_IMAGES.contains(&canonical_name(name))
}

/// An OCI image reference, split: `registry/repository[:tag][@digest]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    /// `host[:port]`; Docker Hub (`docker.io`) when the reference names none.
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 hex>`.
    pub digest: Option<String>,
}

impl Reference {
    /// Parses a reference as Docker does: the first component is a registry when it has
    /// a `.` or a `:` or is `localhost`; otherwise the registry is Docker Hub and a
    /// one-component repository is in `library/`. Without a tag or digest, `latest`.
    pub fn parse(s: &str) -> Result<Reference, String> {
        if s.is_empty() || s.len() > 255 {
            return Err("an image reference is 1 to 255 characters".into());
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                let hex = d
                    .strip_prefix("sha256:")
                    .ok_or_else(|| format!("digest {d:?} must be sha256:<64 hex digits>"))?;
                if hex.len() != 64 || !hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
                    return Err(format!("digest {d:?} must be sha256:<64 lowercase hex digits>"));
                }
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        let (registry, path) = match rest.split_once('/') {
            Some((first, path)) if first.contains(['.', ':']) || first == "localhost" => (first.to_string(), path),
            _ => ("docker.io".to_string(), rest),
        };
        let (path, tag) = match path.rsplit_once(':') {
            Some((p, t)) if !t.contains('/') => (p, Some(t.to_string())),
            _ => (path, None),
        };
        if let Some(t) = &tag {
            let ok = t.len() <= 128
                && t.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_')
                && t.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
            if !ok {
                return Err(format!(
                    "tag {t:?} must be 1 to 128 letters, digits, '_', '.' or '-', not starting with '.' or '-'"
                ));
            }
        }
        check_host(&registry)?;
        if path.is_empty() {
            return Err(format!("{s:?} names no repository"));
        }
        for component in path.split('/') {
            let ok = !component.is_empty()
                && component
                    .bytes()
                    .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-'))
                && component.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
                && component.bytes().last().is_some_and(|b| b.is_ascii_alphanumeric());
            if !ok {
                return Err(format!(
                    "repository component {component:?} must be lowercase letters and digits, \
                     with '.', '_' or '-' between them"
                ));
            }
        }
        let repository = if registry == "docker.io" && !path.contains('/') {
            format!("library/{path}")
        } else {
            path.to_string()
        };
        let tag = if tag.is_none() && digest.is_none() {
            Some("latest".to_string())
        } else {
            tag
        };
        Ok(Reference {
            registry,
            repository,
            tag,
            digest,
        })
    }

    /// Whether the registry is on this machine's loopback, where plain HTTP is allowed
    /// without the operator naming it (as Docker does for 127.0.0.0/8).
    pub fn is_loopback(&self) -> bool {
        let host = match self.registry.rsplit_once(':') {
            Some((h, port)) if port.bytes().all(|b| b.is_ascii_digit()) => h,
            _ => &self.registry,
        };
        host == "localhost" || host == "[::1]" || host.parse::<std::net::Ipv4Addr>().is_ok_and(|a| a.is_loopback())
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

fn check_host(registry: &str) -> Result<(), String> {
    let (host, port) = match registry.rsplit_once(':') {
        // A bare IPv6 address: refused below.
        Some((h, _)) if !h.ends_with(']') && h.contains(':') => (registry, None),
        Some((h, p)) => (h, Some(p)),
        None => (registry, None),
    };
    if let Some(p) = port
        && (p.is_empty() || p.len() > 5 || !p.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(format!("registry port {p:?} is not a number"));
    }
    let ok = host == "[::1]"
        || (!host.is_empty()
            && host.len() <= 253
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-')));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "registry {registry:?} is not a host name, an IPv4 address or [::1]"
        ))
    }
}

/// Whether `s` is an OCI reference that names its registry (so an edge may pull it at
/// create without it being registered first).
pub fn names_a_registry(s: &str) -> bool {
    s.split_once('/')
        .is_some_and(|(first, _)| first.contains(['.', ':']) || first == "localhost")
        && Reference::parse(s).is_ok()
}

/// Checks a name an image is registered under: an OCI reference that names its registry,
/// or a store name (lowercase letters, digits, '-', '_' and '.', up to 128, as E2B's
/// template aliases) that is neither a built-in image, a snapshot id, nor ends in a
/// suffix the E2B API reads as an isolation (`-vm`, `-fullvm`).
pub fn check_name(name: &str) -> Result<(), String> {
    if name.contains('/') {
        return if names_a_registry(name) {
            Ok(())
        } else {
            Reference::parse(name).and(Err(format!(
                "{name:?} has a '/' but names no registry: use registry/repository[:tag]"
            )))
        };
    }
    let ok = !name.is_empty()
        && name.len() <= 128
        && name.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && name
            .bytes()
            .all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b':'));
    if !ok {
        return Err(format!(
            "image name {name:?} must be 1 to 128 lowercase letters, digits, '-', '_', '.' or ':' \
             (or a registry reference)"
        ));
    }
    if is_builtin(name) {
        return Err(format!("{name:?} is a built-in image"));
    }
    if name.starts_with("snap-") {
        return Err(format!("{name:?} looks like a snapshot id"));
    }
    if name.ends_with("-vm") || name.ends_with("-fullvm") {
        return Err(format!(
            "{name:?} ends in -vm or -fullvm, which E2B template names use to ask for a microVM or a full VM"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(s: &str) -> String {
        Reference::parse(s)
            .map(|r| r.to_string())
            .unwrap_or_else(|e| format!("error: {e}"))
    }

    #[test]
    fn references_parse_as_docker_reads_them() {
        for (input, want) in [
            ("python:3.12-slim", "docker.io/library/python:3.12-slim"),
            ("python", "docker.io/library/python:latest"),
            ("org/env", "docker.io/org/env:latest"),
            ("127.0.0.1:5000/python:3.12-slim", "127.0.0.1:5000/python:3.12-slim"),
            ("localhost/a/b", "localhost/a/b:latest"),
            ("ghcr.io/org/env:v1", "ghcr.io/org/env:v1"),
            (
                "127.0.0.1:5000/x@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
                "127.0.0.1:5000/x@sha256:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
            ),
        ] {
            assert_eq!(parsed(input), want, "{input}");
        }
        for bad in [
            "",
            "Python",
            "a//b",
            "reg.io/x:",
            "reg.io/x:-bad",
            "x@sha256:00",
            "x@md5:00",
            "reg.io:port/x",
            "reg io/x",
            "reg.io/x/",
        ] {
            assert!(parsed(bad).starts_with("error: "), "{bad:?} parsed as {}", parsed(bad));
        }
    }

    #[test]
    fn only_loopback_registries_are_loopback() {
        for (r, want) in [
            ("127.0.0.1:5000/x", true),
            ("127.1.2.3/x", true),
            ("localhost:5000/x", true),
            ("[::1]:5000/x", true),
            ("10.0.0.1:5000/x", false),
            ("127.example.com/x", false),
            ("registry.example.com/x", false),
        ] {
            assert_eq!(Reference::parse(r).unwrap().is_loopback(), want, "{r}");
        }
    }

    #[test]
    fn a_create_may_pull_only_references_that_name_their_registry() {
        assert!(names_a_registry("127.0.0.1:5000/python:3.12-slim"));
        assert!(names_a_registry("ghcr.io/org/env"));
        assert!(names_a_registry("localhost/env"));
        assert!(!names_a_registry("python:3.12"));
        assert!(!names_a_registry("org/env"));
        assert!(!names_a_registry("base"));
        assert!(!names_a_registry("ghcr.io/Org/env"));
    }

    #[test]
    fn registered_names_are_aliases_or_references_but_never_builtins_or_isolation_suffixes() {
        for ok in ["my-env", "swe_task.42", "env:v2", "127.0.0.1:5000/python:3.12-slim"] {
            assert_eq!(check_name(ok), Ok(()), "{ok}");
        }
        for bad in [
            "base",
            "base:latest",
            "code-interpreter",
            "snap-0123456789abcdef",
            "my-vm",
            "x-fullvm",
            "My-Env",
            "-x",
            "org/env",
            "",
        ] {
            assert!(check_name(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn e2b_template_references_resolve_to_store_names() {
        for (reference, name) in [
            ("base", "base"),
            ("base:latest", "base"),
            ("code-interpreter-v1:default", "code-interpreter-v1"),
            ("code-interpreter", "code-interpreter-v1"),
            ("other:v2", "other:v2"),
        ] {
            assert_eq!(canonical_name(reference), name, "{reference}");
        }
        assert!(is_builtin("code-interpreter:latest"));
        assert!(!is_builtin("python"));
    }
}
