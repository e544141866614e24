//! An edge's identity: its certificate from the cluster CA (naming it, `edge/<name>`),
//! the key of that certificate (made here, never sent), the CA it trusts, and its own
//! edge key. Kept in `<data-dir>/tls/` (`ca.crt`; `edge.pem`, the certificate and its
//! key in one file, replaced whole, 0600) and `<data-dir>/edge.key`.
//!
//! A new edge joins: it makes its key and a certificate request, calls the control
//! plane's `EdgeSlice.Join` over TLS without a certificate of its own (checking that the
//! server is a control node under the CA the operator gave it), and gets the signed
//! certificate and its edge key back; its token registers it, once. Later starts read
//! the files. [`renew`] replaces the certificate (rotation, or a third of its life left).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use opendsec_edge_api::pb::edge_slice_client::EdgeSliceClient;
use opendsec_edge_api::pb::{JoinRequest, RegisterRequest, RenewRequest};
use opendsec_trust::{Expect, Identity, Issued, Role, Trust};

/// Why the edge has no identity.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error(
        "this edge has not joined yet and no CA certificate was given: copy the cluster's ca.crt \
         (<control data-dir>/tls/ca.crt) here and pass --ca-cert"
    )]
    NoCa,
    #[error("{0}")]
    Trust(#[from] opendsec_trust::Error),
    #[error("joining the cluster at {0}: {1}")]
    Join(String, String),
    #[error("{path}: {why}", path = .0.display(), why = .1)]
    File(PathBuf, String),
}

struct Files {
    ca: PathBuf,
    /// The certificate, then its key: one file, so that a crash never pairs a new key
    /// with an old certificate.
    pem: PathBuf,
    edge_key: PathBuf,
}

fn files(data_dir: &Path) -> Files {
    let tls = data_dir.join("tls");
    Files {
        ca: tls.join("ca.crt"),
        pem: tls.join("edge.pem"),
        edge_key: data_dir.join("edge.key"),
    }
}

fn both(issued: &Issued) -> String {
    format!("{}{}", issued.cert_pem, issued.key_pem)
}

fn read(p: &Path) -> Result<String, IdentityError> {
    std::fs::read_to_string(p).map_err(|e| IdentityError::File(p.to_path_buf(), e.to_string()))
}

/// The edge's identity: from its files, or by joining with `token` (its first start).
/// `ca_pem`: the CA the operator gave it (needed to join; afterwards the saved one).
pub async fn load_or_join(
    data_dir: &Path,
    name: &str,
    control: &str,
    token: &str,
    ca_pem: Option<&str>,
    registration: RegisterRequest,
) -> Result<(Arc<Trust>, String), IdentityError> {
    let f = files(data_dir);
    let id = Identity::edge(name);
    if f.pem.exists() && f.ca.exists() && f.edge_key.exists() {
        let pem = read(&f.pem)?;
        let issued = Issued {
            cert_pem: pem.clone(),
            key_pem: pem,
        };
        let trust = Trust::new(id, &read(&f.ca)?, &issued, None)?;
        return Ok((Arc::new(trust), read(&f.edge_key)?.trim().to_string()));
    }
    let ca_pem = ca_pem.ok_or(IdentityError::NoCa)?;
    let (key_pem, csr_pem) = opendsec_trust::request(&id)?;
    let config = opendsec_trust::stranger_config(ca_pem, Expect::Role(Role::Control))?;
    let (mut client, req) = call(
        control,
        config,
        token,
        JoinRequest {
            registration: Some(registration),
            csr_pem,
        },
    )?;
    let reply = client
        .join(req)
        .await
        .map_err(|s| IdentityError::Join(control.into(), s.message().to_string()))?
        .into_inner();
    let issued = Issued {
        cert_pem: reply.cert_pem,
        key_pem,
    };
    // Checked before anything is saved: the certificate names this edge under the CA.
    let trust = Trust::new(id, &reply.ca_pem, &issued, None)?;
    let dir = data_dir.join("tls");
    std::fs::create_dir_all(&dir).map_err(|e| IdentityError::File(dir.clone(), e.to_string()))?;
    opendsec_trust::write_private(&f.ca, &reply.ca_pem)?;
    opendsec_trust::write_private(&f.edge_key, &reply.edge_key)?;
    // The certificate last: its presence says the identity is whole.
    opendsec_trust::write_private(&f.pem, &both(&issued))?;
    tracing::info!(edge = %name, ordinal = reply.ordinal, "joined the cluster: certificate issued");
    Ok((Arc::new(trust), reply.edge_key))
}

/// A slice client of the control node at `control` over TLS as `config` says, and
/// `body` as a request carrying the edge's `token`.
fn call<T>(
    control: &str,
    config: Arc<rustls::ClientConfig>,
    token: &str,
    body: T,
) -> Result<(EdgeSliceClient<tonic::transport::Channel>, tonic::Request<T>), IdentityError> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{control}"))
        .map_err(|e| IdentityError::Join(control.into(), e.to_string()))?
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect_with_connector_lazy(opendsec_trust::config_connector(config));
    let mut req = tonic::Request::new(body);
    let auth = format!("Bearer {token}")
        .parse()
        .map_err(|_| IdentityError::Join(control.into(), "the edge token is not valid ASCII".into()))?;
    req.metadata_mut().insert("authorization", auth);
    Ok((EdgeSliceClient::new(channel), req))
}

/// Whether a certificate rotation at `rotated_at_ms` (a heartbeat reply's; 0: none)
/// came after `trust`'s certificate was issued: then the edge renews it.
pub fn must_renew(trust: &Trust, rotated_at_ms: u64) -> bool {
    let Some(issued) = trust.issued_at() else {
        return true;
    };
    let issued_ms = issued
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    rotated_at_ms > issued_ms
}

/// A fresh key and certificate for this edge from the control plane (its current
/// certificate proves who asks), saved and presented from now on.
pub async fn renew(trust: &Trust, data_dir: &Path, control: &str, token: &str) -> Result<(), IdentityError> {
    let name = trust.identity().name.clone();
    let (key_pem, csr_pem) = opendsec_trust::request(trust.identity())?;
    let config = trust.client_config(&Expect::Role(Role::Control));
    let (mut client, req) = call(
        control,
        config,
        token,
        RenewRequest {
            edge: name.clone(),
            csr_pem,
        },
    )?;
    let reply = client
        .renew(req)
        .await
        .map_err(|s| IdentityError::Join(control.into(), s.message().to_string()))?
        .into_inner();
    let issued = Issued {
        cert_pem: reply.cert_pem,
        key_pem,
    };
    trust.install(&issued)?;
    opendsec_trust::write_private(&files(data_dir).pem, &both(&issued))?;
    tracing::info!(edge = %name, "certificate renewed");
    Ok(())
}
