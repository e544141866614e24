//! Pulling from OCI and Docker registries ([`ImageStore::pull`]) with `oci-client`: the
//! manifest (an index resolved to its linux/amd64 image), the config and the layer blobs,
//! each checked against its digest and size here, whatever the client checked already.
//! Blobs are fetched from the registry only, never from URLs a manifest lists.
//!
//! Transport: HTTPS, except plain HTTP for a registry on loopback (`localhost`,
//! 127.0.0.0/8, `::1`, as Docker does) or one the operator named in
//! [`PullOptions::insecure_http_registries`] (there HTTP only, no HTTPS attempt first).
//! `pull` blocks: it runs its own current-thread runtime, so call it from a plain thread
//! (or `spawn_blocking`), not from async code.

use std::fs::File;
use std::io::Write;
use std::time::Duration;

use futures::StreamExt;
use oci_client::client::{ClientConfig, ClientProtocol};
use oci_client::errors::{DigestError, OciDistributionError};
use oci_client::{Client, Reference};

use super::layers::{ImagePlan, LayerPlan, PullProgress};
use super::oci::{self, Manifest};
use super::{Image, ImageError, ImageStore};

/// How to reach a registry.
#[derive(Clone, Debug, Default)]
pub struct PullOptions {
    pub auth: RegistryAuth,
    /// Registries (`host[:port]`, as in the reference) spoken to over plain HTTP. Loopback
    /// registries need not be named.
    pub insecure_http_registries: Vec<String>,
}

/// Credentials for a registry. Basic credentials are sent to the registry itself, or
/// exchanged for a token where it asks for bearer auth.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum RegistryAuth {
    #[default]
    Anonymous,
    Basic {
        username: String,
        password: String,
    },
}

impl std::fmt::Debug for RegistryAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RegistryAuth::Anonymous => f.write_str("Anonymous"),
            RegistryAuth::Basic { username, .. } => f
                .debug_struct("Basic")
                .field("username", username)
                .field("password", &"<redacted>")
                .finish(),
        }
    }
}

/// How long connecting to a registry may take, and how long it may send nothing.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
const READ_TIMEOUT: Duration = Duration::from_secs(120);

impl ImageStore {
    /// Pulls `reference` (`host[:port]/repo[:tag][@sha256:…]`; see
    /// [`ImageStore::is_reference`]) into the store and records it under its canonical
    /// form, which [`ImageStore::get`] then finds (as it does the reference as given).
    /// Layers already stored are not fetched again. Concurrent pulls of one reference in
    /// this process share one pull; pulls in other processes or on other machines
    /// sharing the store unpack each layer once (see `layers.rs`). Blocking.
    pub fn pull(
        &self,
        reference: &str,
        opts: &PullOptions,
        progress: &dyn Fn(&PullProgress),
    ) -> Result<Image, ImageError> {
        let parsed = oci::parse_reference(reference)?;
        let key = parsed.whole();
        self.pulls.run(&key, || self.pull_now(&parsed, opts, progress))
    }

    fn pull_now(
        &self,
        reference: &Reference,
        opts: &PullOptions,
        progress: &dyn Fn(&PullProgress),
    ) -> Result<Image, ImageError> {
        let name = reference.whole();
        let registry = reference.resolve_registry().to_string();
        let remote = Remote::new(reference, opts)?;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(super::io_err("starting the pull's runtime"))?;
        progress(&PullProgress {
            current: format!("resolving {name} at {registry}"),
            ..PullProgress::default()
        });

        // The manifest, or an index and then its linux/amd64 manifest.
        let (bytes, _) = runtime.block_on(remote.manifest(reference))?;
        let mut digest = match reference.digest() {
            Some(d) => {
                oci::verify_digest(format!("the manifest of {name}"), d, &bytes)?;
                d.to_string()
            }
            None => oci::sha256_digest(&bytes),
        };
        let manifest = match oci::parse_manifest(&name, &bytes)? {
            Manifest::Image(manifest) => manifest,
            Manifest::Index(index) => {
                let chosen = oci::select_platform(&name, &index)?;
                digest = chosen.digest().to_string();
                oci::sha256_hex(&name, "its linux/amd64 manifest", &digest)?;
                let by_digest = reference.clone_with_digest(digest.clone());
                let (bytes, _) = runtime.block_on(remote.manifest(&by_digest))?;
                oci::verify_digest(format!("the linux/amd64 manifest of {name}"), &digest, &bytes)?;
                match oci::parse_manifest(&name, &bytes)? {
                    Manifest::Image(manifest) => manifest,
                    Manifest::Index(_) => {
                        return Err(ImageError::BadImage {
                            image: name,
                            reason: "its index names another index for linux/amd64".into(),
                        });
                    }
                }
            }
        };
        oci::check_manifest(&name, &manifest)?;

        let config = manifest.config();
        let config_digest = config.digest().to_string();
        let mut config_bytes = Vec::new();
        runtime.block_on(remote.blob(reference, &config_digest, config.size(), &mut config_bytes, &|_| {}))?;
        let blobs: Vec<(String, u64)> = manifest
            .layers()
            .iter()
            .map(|l| (l.digest().to_string(), l.size()))
            .collect();
        let (config, layers) = oci::plan_image(&name, &config_bytes, &blobs)?;
        let plan = ImagePlan {
            name: name.clone(),
            reference: Some(name),
            digest: Some(digest),
            config,
            layers,
        };
        let mut fetch = |layer: &LayerPlan, file: &mut File, report: &dyn Fn(u64)| {
            runtime.block_on(remote.blob(reference, &layer.blob, layer.size, file, report))
        };
        self.install(plan, &mut fetch, progress)
    }
}

/// One registry, as one pull (or push, `push.rs`) speaks to it.
pub(super) struct Remote {
    pub(super) client: Client,
    pub(super) auth: oci_client::secrets::RegistryAuth,
    /// For errors: the registry and the reference pulled.
    registry: String,
    name: String,
    user: Option<String>,
}

impl Remote {
    pub(super) fn new(reference: &Reference, opts: &PullOptions) -> Result<Self, ImageError> {
        let registry = reference.resolve_registry().to_string();
        let protocol = match plain_http(&registry, &opts.insecure_http_registries) {
            true => ClientProtocol::HttpsExcept(vec![registry.clone()]),
            false => ClientProtocol::Https,
        };
        // The workspace's rustls provider (ring); a provider installed earlier stays.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = Client::try_from(ClientConfig {
            protocol,
            platform_resolver: None,
            connect_timeout: Some(CONNECT_TIMEOUT),
            read_timeout: Some(READ_TIMEOUT),
            ..ClientConfig::default()
        })
        .map_err(|e| ImageError::Registry {
            reference: reference.whole(),
            message: format!("cannot make an HTTP client: {e}"),
        })?;
        let (auth, user) = match &opts.auth {
            RegistryAuth::Anonymous => (oci_client::secrets::RegistryAuth::Anonymous, None),
            RegistryAuth::Basic { username, password } => (
                oci_client::secrets::RegistryAuth::Basic(username.clone(), password.clone()),
                Some(username.clone()),
            ),
        };
        Ok(Self {
            client,
            auth,
            registry,
            name: reference.whole(),
            user,
        })
    }

    /// The raw manifest (or index) `reference` names, within the size limit.
    async fn manifest(&self, reference: &Reference) -> Result<(bytes::Bytes, String), ImageError> {
        let (bytes, digest) = self
            .client
            .pull_manifest_raw(reference, &self.auth, oci::MANIFEST_MEDIA_TYPES)
            .await
            .map_err(|e| self.error(e))?;
        // oci-client reads a manifest whole; the limit is checked once it is here.
        if bytes.len() as u64 > oci::MAX_MANIFEST_BYTES {
            return Err(ImageError::BadImage {
                image: self.name.clone(),
                reason: format!(
                    "its manifest has {} bytes, over the limit of {}",
                    bytes.len(),
                    oci::MAX_MANIFEST_BYTES
                ),
            });
        }
        Ok((bytes, digest))
    }

    /// Streams blob `digest` into `out`, failing as soon as it passes `size` bytes and
    /// at the end unless it has exactly `size` bytes hashing to `digest`.
    async fn blob(
        &self,
        reference: &Reference,
        digest: &str,
        size: u64,
        out: &mut impl Write,
        report: &dyn Fn(u64),
    ) -> Result<(), ImageError> {
        use sha2::Digest as _;
        let mut stream = self
            .client
            .pull_blob_stream(reference, digest)
            .await
            .map_err(|e| self.error(e))?;
        let mut hash = sha2::Sha256::new();
        let mut received = 0u64;
        let mismatch = |actual: String| ImageError::DigestMismatch {
            what: format!("blob {digest} of {}", self.name),
            expected: digest.to_string(),
            actual,
        };
        while let Some(chunk) = stream.next().await {
            let chunk = match chunk {
                Ok(chunk) => chunk,
                // oci-client fails the stream's end when the digest does not match:
                // say so in our words.
                Err(_) if received == size => {
                    return Err(mismatch(format!("sha256:{}", hex::encode(hash.finalize()))));
                }
                Err(e) => {
                    return Err(ImageError::Registry {
                        reference: self.name.clone(),
                        message: format!("reading blob {digest} from {}: {}", self.registry, chain(&e)),
                    });
                }
            };
            received += chunk.len() as u64;
            if received > size {
                return Err(ImageError::BadImage {
                    image: self.name.clone(),
                    reason: format!("blob {digest} is longer than the {size} bytes its descriptor says"),
                });
            }
            hash.update(&chunk);
            out.write_all(&chunk)
                .map_err(super::io_err(format!("writing blob {digest}")))?;
            report(chunk.len() as u64);
        }
        if received != size {
            return Err(ImageError::BadImage {
                image: self.name.clone(),
                reason: format!("blob {digest} has {received} bytes, not the {size} its descriptor says"),
            });
        }
        let actual = format!("sha256:{}", hex::encode(hash.finalize()));
        if actual != digest {
            return Err(mismatch(actual));
        }
        Ok(())
    }

    /// Whether the registry has blob `digest` in `reference`'s repository (a failed
    /// check counts as no: the blob is sent).
    pub(super) async fn has_blob(&self, reference: &Reference, digest: &str) -> bool {
        self.client.blob_exists(reference, digest).await.unwrap_or(false)
    }

    /// An oci-client error in the store's terms, naming the registry and what to do.
    pub(super) fn error(&self, e: OciDistributionError) -> ImageError {
        let registry_error = |message: String| ImageError::Registry {
            reference: self.name.clone(),
            message,
        };
        match e {
            OciDistributionError::UnauthorizedError { .. } | OciDistributionError::AuthenticationFailure(_) => {
                let (who, hint) = match &self.user {
                    None => (
                        "anonymous access".to_string(),
                        "give a user name and password (PullOptions::auth)".to_string(),
                    ),
                    Some(user) => (
                        format!("the credentials of user {user:?}"),
                        "check the user name and password".to_string(),
                    ),
                };
                ImageError::Unauthorized {
                    registry: self.registry.clone(),
                    who,
                    hint,
                }
            }
            OciDistributionError::DigestError(DigestError::VerificationError { expected, actual }) => {
                ImageError::DigestMismatch {
                    what: format!("a manifest of {}", self.name),
                    expected,
                    actual,
                }
            }
            OciDistributionError::RegistryError { envelope, .. } => {
                let codes: Vec<String> = envelope.errors.iter().map(|e| e.to_string()).collect();
                registry_error(format!("registry {} answered: {}", self.registry, codes.join("; ")))
            }
            OciDistributionError::ServerError { code, message, .. } => registry_error(format!(
                "registry {} answered HTTP {code}: {}",
                self.registry,
                message.trim()
            )),
            OciDistributionError::RequestError(e) => {
                registry_error(format!("cannot reach registry {}: {}", self.registry, chain(&e)))
            }
            other => registry_error(format!("registry {}: {}", self.registry, chain(&other))),
        }
    }
}

/// Whether `registry` (`host[:port]`) is spoken to over plain HTTP: on loopback, or
/// named by the operator; every other registry over HTTPS.
fn plain_http(registry: &str, insecure_http_registries: &[String]) -> bool {
    oci::is_loopback_registry(registry) || insecure_http_registries.iter().any(|r| r == registry)
}

/// An error and its sources, `a: b: c` (reqwest hides the useful part, "Connection
/// refused", in a source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registries_get_https_unless_on_loopback_or_named_insecure_by_the_operator() {
        let named = vec!["registry.lan:5000".to_string()];
        assert!(plain_http("127.0.0.1:5000", &[]));
        assert!(plain_http("localhost:5000", &[]));
        assert!(plain_http("registry.lan:5000", &named));
        assert!(!plain_http("registry.lan:5000", &[]));
        assert!(!plain_http("registry.lan", &named), "another port is another registry");
        assert!(!plain_http("index.docker.io", &named));
    }

    #[test]
    fn credentials_never_show_in_debug_output() {
        let auth = RegistryAuth::Basic {
            username: "u".into(),
            password: "hunter2".into(),
        };
        let shown = format!(
            "{:?}",
            PullOptions {
                auth,
                ..PullOptions::default()
            }
        );
        assert!(shown.contains("\"u\"") && !shown.contains("hunter2"), "{shown}");
    }
}
