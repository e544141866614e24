//! What the OCI image format says, whatever the bytes come from: references and the names
//! of their records, manifests and indexes (and the linux/amd64 choice), image configs
//! and the run settings they give, and the limits every source is held to.
//! `registry.rs` and `import.rs` fetch; `layers.rs` installs what [`plan_image`] planned.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use oci_client::Reference;
use oci_spec::image::{Arch, Descriptor, ImageConfiguration, ImageIndex, ImageManifest, MediaType, Os};
use serde::Deserialize;
use sha2::{Digest as _, Sha256};

use super::layers::LayerPlan;
use super::{ImageConfig, ImageError, canonical_name, validate_name};

/// A manifest or index larger than this is refused. Real ones are a few KiB (an index
/// of every platform of a busy image is about 10 KiB); more is an attack on memory.
pub(super) const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// An image config larger than this is refused: configs carry env, labels and history,
/// tens of KiB in practice.
pub(super) const MAX_CONFIG_BYTES: u64 = 8 << 20;
/// An image with more layers is refused. Docker's own limit is 127 layers (plus the
/// container's); overlayfs stacks at most 500 lower dirs, and each costs a mount fd.
pub(super) const MAX_LAYERS: usize = 128;
/// A compressed layer blob larger than this is refused before it is fetched (the
/// unpacked limits are in `unpack.rs`).
pub(super) const MAX_LAYER_BLOB_BYTES: u64 = 64 << 30;

/// `PATH` for images whose config sets none (what Docker gives such containers).
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// The E2B convention our sandboxes follow where an image names no user or directory.
const DEFAULT_USER: &str = "user";
const DEFAULT_WORKDIR: &str = "/home/user";

const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
const DOCKER_LAYER_GZIP: &str = "application/vnd.docker.image.rootfs.diff.tar.gzip";
const DOCKER_LAYER_TAR: &str = "application/vnd.docker.image.rootfs.diff.tar";

/// The media types a registry is asked for (one manifest, or an index to choose from).
pub(super) const MANIFEST_MEDIA_TYPES: &[&str] = &[
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    DOCKER_MANIFEST,
    DOCKER_MANIFEST_LIST,
];

/// See [`super::ImageStore::is_reference`].
pub(super) fn is_reference(name: &str) -> bool {
    if name.contains("@sha256:") {
        return true;
    }
    match name.split_once('/') {
        Some((first, _)) => {
            let host_like = first.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '[');
            host_like && (first.contains('.') || first.contains(':') || first == "localhost")
        }
        None => false,
    }
}

/// Parses a registry reference (a tag defaults to `latest`); only sha256 digests.
pub(super) fn parse_reference(name: &str) -> Result<Reference, ImageError> {
    let invalid = |reason: String| ImageError::InvalidReference {
        reference: name.to_string(),
        reason,
    };
    if !is_reference(name) {
        return Err(invalid(
            "not a registry reference: name its registry (`docker.io/library/ubuntu:22.04`, `localhost:5000/app`)"
                .into(),
        ));
    }
    let reference = Reference::try_from(name).map_err(|e| invalid(e.to_string()))?;
    if reference.digest().is_some_and(|d| !d.starts_with("sha256:")) {
        return Err(invalid("only sha256 digests are supported".into()));
    }
    Ok(reference)
}

/// The canonical name of image `name` and its record's file name in `images/`: a store
/// name as itself, a reference in its canonical form, escaped (see the module doc of
/// `images`).
pub(super) fn record_file(name: &str) -> Result<(String, String), ImageError> {
    if !is_reference(name) {
        let name = canonical_name(name);
        validate_name(name)?;
        return Ok((name.to_string(), format!("{name}.json")));
    }
    let canonical = parse_reference(name)?.whole();
    let mut file = String::with_capacity(canonical.len() + 16);
    for b in canonical.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.') {
            file.push(b as char);
        } else {
            let _ = write!(file, "%{b:02X}");
        }
    }
    file.push_str(".json");
    if file.len() > 255 {
        return Err(ImageError::InvalidReference {
            reference: name.to_string(),
            reason: "too long: its record's file name would pass 255 bytes".into(),
        });
    }
    Ok((canonical, file))
}

/// Whether a registry host (`host[:port]`) is this machine's loopback: such registries
/// are spoken to over plain HTTP without being named insecure, as Docker does.
pub(super) fn is_loopback_registry(registry: &str) -> bool {
    let host = if let Some(rest) = registry.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        match registry.rsplit_once(':') {
            Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
            _ => registry,
        }
    };
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
        || host.parse::<std::net::Ipv6Addr>().is_ok_and(|ip| ip.is_loopback())
}

/// `sha256:<hex>` of `bytes`.
pub(super) fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Fails unless `bytes` hash to `expected` (`sha256:<hex>`).
pub(super) fn verify_digest(what: impl Into<String>, expected: &str, bytes: &[u8]) -> Result<(), ImageError> {
    let actual = sha256_digest(bytes);
    if actual == expected {
        Ok(())
    } else {
        Err(ImageError::DigestMismatch {
            what: what.into(),
            expected: expected.to_string(),
            actual,
        })
    }
}

/// The hex of a `sha256:<64 lowercase hex>` digest; anything else is refused.
pub(super) fn sha256_hex<'a>(image: &str, what: &str, digest: &'a str) -> Result<&'a str, ImageError> {
    match digest.strip_prefix("sha256:") {
        Some(hex) if hex.len() == 64 && hex.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) => Ok(hex),
        _ => Err(ImageError::BadImage {
            image: image.to_string(),
            reason: format!("{what} has digest {digest:?}: only sha256 digests are supported"),
        }),
    }
}

/// A manifest as a registry or layout serves it: one image, or an index of several.
pub(super) enum Manifest {
    Image(Box<ImageManifest>),
    Index(Box<ImageIndex>),
}

/// Parses a manifest or an index (after its digest was checked).
pub(super) fn parse_manifest(image: &str, bytes: &[u8]) -> Result<Manifest, ImageError> {
    let bad = |reason: String| ImageError::BadImage {
        image: image.to_string(),
        reason,
    };
    if bytes.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(bad(format!(
            "its manifest has {} bytes, over the limit of {MAX_MANIFEST_BYTES}",
            bytes.len()
        )));
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Probe {
        schema_version: Option<u32>,
        media_type: Option<String>,
        manifests: Option<serde::de::IgnoredAny>,
    }
    let probe: Probe = serde_json::from_slice(bytes).map_err(|e| bad(format!("its manifest is not JSON: {e}")))?;
    if probe.schema_version != Some(2) {
        return Err(bad(format!(
            "manifest schema version {:?}: only version 2 is supported",
            probe.schema_version
        )));
    }
    let is_index = match probe.media_type.as_deref() {
        Some("application/vnd.oci.image.index.v1+json" | DOCKER_MANIFEST_LIST) => true,
        Some("application/vnd.oci.image.manifest.v1+json" | DOCKER_MANIFEST) => false,
        Some(other) => return Err(bad(format!("unsupported manifest media type {other}"))),
        None => probe.manifests.is_some(),
    };
    if is_index {
        serde_json::from_slice(bytes)
            .map(|i| Manifest::Index(Box::new(i)))
            .map_err(|e| bad(format!("malformed index: {e}")))
    } else {
        serde_json::from_slice(bytes)
            .map(|m| Manifest::Image(Box::new(m)))
            .map_err(|e| bad(format!("malformed manifest: {e}")))
    }
}

/// The linux/amd64 image of an index (the edge's platform).
pub(super) fn select_platform<'a>(image: &str, index: &'a ImageIndex) -> Result<&'a Descriptor, ImageError> {
    let is_ours = |d: &&Descriptor| {
        d.platform()
            .as_ref()
            .is_some_and(|p| *p.os() == Os::Linux && *p.architecture() == Arch::Amd64)
    };
    if let Some(found) = index.manifests().iter().find(is_ours) {
        return Ok(found);
    }
    let have: Vec<String> = index
        .manifests()
        .iter()
        .filter_map(|d| {
            d.platform()
                .as_ref()
                .map(|p| format!("{}/{}", p.os(), p.architecture()))
        })
        .collect();
    Err(ImageError::BadImage {
        image: image.to_string(),
        reason: format!("no linux/amd64 image in its index (it has: {})", have.join(", ")),
    })
}

/// Checks an image manifest against the limits and what we can unpack.
pub(super) fn check_manifest(image: &str, manifest: &ImageManifest) -> Result<(), ImageError> {
    let bad = |reason: String| ImageError::BadImage {
        image: image.to_string(),
        reason,
    };
    let layers = manifest.layers();
    if layers.is_empty() {
        return Err(bad("it has no layers".into()));
    }
    if layers.len() > MAX_LAYERS {
        return Err(bad(format!(
            "it has {} layers, over the limit of {MAX_LAYERS}",
            layers.len()
        )));
    }
    let config = manifest.config();
    match config.media_type() {
        MediaType::ImageConfig => {}
        MediaType::Other(t) if t == DOCKER_CONFIG => {}
        other => return Err(bad(format!("not a container image (its config is {other})"))),
    }
    sha256_hex(image, "its config", config.digest().as_ref())?;
    if config.size() > MAX_CONFIG_BYTES {
        return Err(bad(format!(
            "its config has {} bytes, over the limit of {MAX_CONFIG_BYTES}",
            config.size()
        )));
    }
    for layer in layers {
        let ok = match layer.media_type() {
            MediaType::ImageLayer
            | MediaType::ImageLayerGzip
            | MediaType::ImageLayerZstd
            | MediaType::ImageLayerNonDistributable
            | MediaType::ImageLayerNonDistributableGzip
            | MediaType::ImageLayerNonDistributableZstd => true,
            MediaType::Other(t) => t == DOCKER_LAYER_GZIP || t == DOCKER_LAYER_TAR,
            _ => false,
        };
        if !ok {
            return Err(bad(format!(
                "layer {} has media type {}, not a layer tar",
                layer.digest(),
                layer.media_type()
            )));
        }
        sha256_hex(image, "a layer", layer.digest().as_ref())?;
        if layer.size() > MAX_LAYER_BLOB_BYTES {
            return Err(bad(format!(
                "layer {} has {} bytes, over the limit of {MAX_LAYER_BLOB_BYTES}",
                layer.digest(),
                layer.size()
            )));
        }
    }
    Ok(())
}

/// Reads an image config (after its digest was checked): the run settings, and each
/// layer's diff_id beside the blob the manifest names for it. `blobs` are the layers'
/// (digest, size) pairs, bottom first.
pub(super) fn plan_image(
    image: &str,
    config_bytes: &[u8],
    blobs: &[(String, u64)],
) -> Result<(ImageConfig, Vec<LayerPlan>), ImageError> {
    let bad = |reason: String| ImageError::BadImage {
        image: image.to_string(),
        reason,
    };
    if config_bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(bad(format!(
            "its config has {} bytes, over the limit of {MAX_CONFIG_BYTES}",
            config_bytes.len()
        )));
    }
    let config: ImageConfiguration =
        serde_json::from_slice(config_bytes).map_err(|e| bad(format!("malformed image config: {e}")))?;
    if *config.os() != Os::Linux || *config.architecture() != Arch::Amd64 {
        return Err(bad(format!(
            "it is built for {}/{}; this edge runs linux/amd64",
            config.os(),
            config.architecture()
        )));
    }
    let diff_ids = config.rootfs().diff_ids();
    if diff_ids.len() != blobs.len() {
        return Err(bad(format!(
            "its config lists {} layer diff_ids for {} layers",
            diff_ids.len(),
            blobs.len()
        )));
    }
    if blobs.len() > MAX_LAYERS {
        return Err(bad(format!(
            "it has {} layers, over the limit of {MAX_LAYERS}",
            blobs.len()
        )));
    }
    let mut layers = Vec::with_capacity(blobs.len());
    for ((blob, size), diff_id) in blobs.iter().zip(diff_ids) {
        sha256_hex(image, "a layer's diff_id", diff_id)?;
        layers.push(LayerPlan {
            blob: blob.clone(),
            size: *size,
            diff_id: diff_id.clone(),
        });
    }
    Ok((run_config(&config), layers))
}

/// The image config's run settings in the store's terms: Env (with a `PATH` if it has
/// none), WorkingDir (else `/home/user`), User (else `user`), Entrypoint, Cmd,
/// ExposedPorts and labels.
fn run_config(config: &ImageConfiguration) -> ImageConfig {
    let run = config.config().clone().unwrap_or_default();
    let mut env = run.env().clone().unwrap_or_default();
    if !env.iter().any(|e| e.starts_with("PATH=")) {
        env.insert(0, DEFAULT_PATH.to_string());
    }
    let non_empty =
        |s: &Option<String>, default: &str| s.as_deref().filter(|s| !s.is_empty()).unwrap_or(default).to_string();
    let mut exposed_ports = run.exposed_ports().clone().unwrap_or_default();
    exposed_ports.sort();
    ImageConfig {
        env,
        user: non_empty(run.user(), DEFAULT_USER),
        workdir: non_empty(run.working_dir(), DEFAULT_WORKDIR),
        shell: "/bin/sh".into(),
        start: None,
        entrypoint: run.entrypoint().clone().unwrap_or_default(),
        cmd: run.cmd().clone().unwrap_or_default(),
        exposed_ports,
        labels: run
            .labels()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect::<BTreeMap<_, _>>(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_are_names_with_a_registry_host_or_a_digest() {
        for yes in [
            "localhost/app",
            "localhost:5000/app:v1",
            "127.0.0.1:5000/a/b",
            "registry.example/app",
            "docker.io/library/ubuntu:22.04",
            "app@sha256:0123",
        ] {
            assert!(is_reference(yes), "{yes}");
        }
        for no in [
            "base",
            "code-interpreter-v1",
            "base:latest",
            "ubuntu:22.04",
            "library/ubuntu",
            "other:v2",
            "../etc",
        ] {
            assert!(!is_reference(no), "{no}");
        }
    }

    #[test]
    fn record_files_of_references_are_canonical_escaped_and_never_a_store_name() {
        let (name, file) = record_file("localhost:5000/app").unwrap();
        assert_eq!(name, "localhost:5000/app:latest");
        assert_eq!(file, "localhost%3A5000%2Fapp%3Alatest.json");
        assert_eq!(record_file("localhost:5000/app:latest").unwrap().1, file);
        // Different references never share a file, even when they differ only in
        // characters that are escaped.
        let a = record_file("registry.example/a/b:c").unwrap().1;
        let b = record_file("registry.example/a-b:c").unwrap().1;
        assert_ne!(a, b);
        let digest = format!("registry.example/app@sha256:{}", "a".repeat(64));
        let (name, file) = record_file(&digest).unwrap();
        assert_eq!(name, digest);
        assert!(file.contains("%40sha256%3A"), "{file}");
        assert!(!file.contains('/'));
        // Store names keep their files.
        assert_eq!(record_file("base:latest").unwrap(), ("base".into(), "base.json".into()));
        for invalid in ["../etc", "a/b", ".hidden"] {
            assert!(
                matches!(record_file(invalid), Err(ImageError::InvalidName(_))),
                "{invalid}"
            );
        }
        assert!(matches!(
            record_file("localhost:5000/UPPER"),
            Err(ImageError::InvalidReference { .. })
        ));
    }

    #[test]
    fn loopback_registries_are_localhost_127_8_and_ipv6_loopback() {
        for yes in ["localhost:5000", "localhost", "127.0.0.1:80", "127.3.4.5", "[::1]:5000"] {
            assert!(is_loopback_registry(yes), "{yes}");
        }
        for no in [
            "registry.example:5000",
            "10.0.0.1:5000",
            "localhost.example",
            "[fe80::1]:5000",
        ] {
            assert!(!is_loopback_registry(no), "{no}");
        }
    }

    #[test]
    fn an_image_config_gives_env_workdir_user_entrypoint_cmd_ports_and_labels() {
        let config = br#"{"architecture":"amd64","os":"linux",
            "config":{"Env":["A=1"],"WorkingDir":"/srv","User":"1000:1000",
                      "Entrypoint":["/bin/app"],"Cmd":["--serve"],
                      "ExposedPorts":{"9090/tcp":{},"8080/tcp":{}},"Labels":{"k":"v"}},
            "rootfs":{"type":"layers","diff_ids":["sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]}}"#;
        let (run, layers) = plan_image("t", config, &[(format!("sha256:{}", "b".repeat(64)), 10)]).unwrap();
        assert_eq!(run.env, [DEFAULT_PATH, "A=1"]);
        assert_eq!((run.workdir.as_str(), run.user.as_str()), ("/srv", "1000:1000"));
        assert_eq!(
            (run.entrypoint, run.cmd),
            (vec!["/bin/app".into()], vec!["--serve".into()])
        );
        assert_eq!(run.exposed_ports, ["8080/tcp", "9090/tcp"]);
        assert_eq!(run.labels.get("k").map(String::as_str), Some("v"));
        assert_eq!(layers[0].diff_id, format!("sha256:{}", "a".repeat(64)));

        let bare = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":["sha256:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"]}}"#;
        let (run, _) = plan_image("t", bare, &[(format!("sha256:{}", "b".repeat(64)), 10)]).unwrap();
        assert_eq!((run.workdir.as_str(), run.user.as_str()), ("/home/user", "user"));
        assert!(run.entrypoint.is_empty() && run.cmd.is_empty() && run.labels.is_empty());

        let arm = br#"{"architecture":"arm64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
        let err = plan_image("t", arm, &[]).unwrap_err().to_string();
        assert!(err.contains("linux/arm64"), "{err}");
        let short = br#"{"architecture":"amd64","os":"linux","rootfs":{"type":"layers","diff_ids":[]}}"#;
        let err = plan_image("t", short, &[(format!("sha256:{}", "b".repeat(64)), 1)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("0 layer diff_ids for 1 layers"), "{err}");
    }
}
