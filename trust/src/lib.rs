//! Trust between OpenDsec's components (the trust issue's "identities"): the cluster CA
//! ([`Ca`], made once, held by control hosts), one certificate per control node, gateway
//! and edge naming what it is ([`Identity`], a URI in the certificate), and the
//! mutual-TLS configurations of every connection between them ([`Trust`]): the peer
//! port (Raft, forwarding, the edge slice), the edges' proxies, edge-to-edge transfers.
//!
//! Nothing here is hand-written cryptography: certificates are rcgen's, TLS and chain
//! verification rustls's (ring), parsing x509-parser's. What is ours is the naming (a
//! component is its identity, not a host name) and who may speak to whom, which the
//! protocols decide from the identity a session carries.

mod ca;
mod identity;
mod tls;

pub use ca::{Ca, Issued, LEAF_DAYS, ca_files, request};
pub use identity::{Identity, Role};
pub use tls::{Expect, Trust, config_connector, peer_identity, peer_name, stranger_config, tls_connector};

use std::path::PathBuf;

/// Why trust could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {why}", path = .0.display(), why = .1)]
    File(PathBuf, String),
    #[error("{path}: {why}", path = .0.display(), why = .1)]
    Parse(PathBuf, String),
    #[error(
        "{} already holds a CA; a new one would cut off every certificate it issued (remove it first if that is what you want)",
        .0.display()
    )]
    Exists(PathBuf),
    #[error(
        "{} is missing: control nodes hold the CA's key (copy ca.crt and ca.key from the first control host)",
        .0.display()
    )]
    NoCaKey(PathBuf),
    #[error("{0} cannot be named in a certificate")]
    Name(String),
    #[error("the certificate request cannot be read: {0}")]
    Request(String),
    #[error("PEM: {0}")]
    Pem(String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("only a control host holds the CA")]
    NotIssuer,
    #[error("certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
}

/// Writes `content` to `path`, readable by the owner only (keys, tokens, certificates),
/// whole or not at all: written beside, synced, renamed, so that a reader (`opendsec
/// init` reading what a starting node writes) never sees a created but empty file.
pub fn write_private(path: &std::path::Path, content: &str) -> Result<(), Error> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let err = |e: std::io::Error| Error::File(path.to_path_buf(), format!("cannot write: {e}"));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(content.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(err)
}

/// A throwaway CA and a trust for each identity under it (tests and benchmarks).
pub fn test_cluster(ids: &[Identity]) -> Vec<std::sync::Arc<Trust>> {
    let ca = throwaway_ca();
    let pem = ca.cert_pem().to_string();
    let mut out: Vec<std::sync::Arc<Trust>> = Vec::new();
    for id in ids {
        let issued = ca.issue(id).expect("a test certificate");
        out.push(std::sync::Arc::new(
            Trust::new(id.clone(), &pem, &issued, None).expect("a test trust"),
        ));
    }
    out
}

/// A CA made in a temporary directory that is removed at once (tests).
fn throwaway_ca() -> Ca {
    let dir = std::env::temp_dir().join(format!("opendsec-test-ca-{}-{}", std::process::id(), rand_suffix()));
    let ca = Ca::create(&dir).expect("a test CA");
    let _ = std::fs::remove_dir_all(&dir);
    ca
}

fn rand_suffix() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
        ^ N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

/// `id`'s trust under one CA shared by the whole process (tests and benchmarks: the
/// components a test starts in one process trust each other).
pub fn test_trust(id: Identity) -> std::sync::Arc<Trust> {
    static CA: std::sync::OnceLock<Ca> = std::sync::OnceLock::new();
    let ca = CA.get_or_init(throwaway_ca);
    let issued = ca.issue(&id).expect("a test certificate");
    std::sync::Arc::new(Trust::new(id, ca.cert_pem(), &issued, None).expect("a test trust"))
}
