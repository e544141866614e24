//! TLS for the gateway's second port, so that E2B SDKs configured with only
//! `E2B_DOMAIN` reach `https://api.{domain}` and `https://{port}-{id}.{domain}`.
//!
//! The certificate covers `{domain}`, `*.{domain}`, `localhost` and 127.0.0.1. It is
//! either the operator's (PEM files) or issued by the cluster's own CA, which is made
//! once and kept under `<dir>/ca.crt` + `ca.key` (0600): users trust `ca.crt` the way
//! they trust any private CA. The leaf is re-issued at every start.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose, SanType};
use tokio::net::TcpListener;

/// Where the CA lives, and what the leaf certificate names.
pub struct TlsSettings {
    pub dir: PathBuf,
    /// Host names the certificate is for (the domain without its port).
    pub domain: String,
    /// Operator-supplied certificate chain and key (PEM), instead of the cluster CA.
    pub cert_and_key: Option<(PathBuf, PathBuf)>,
}

fn io(ctx: &str, e: impl std::fmt::Display) -> String {
    format!("{ctx}: {e}")
}

use opendsec_control::write_private;

/// The cluster CA: loaded from `dir`, or made there the first time.
fn load_or_create_ca(dir: &Path) -> Result<(rcgen::Certificate, KeyPair), String> {
    std::fs::create_dir_all(dir).map_err(|e| io(&format!("creating {}", dir.display()), e))?;
    let (crt, key) = (dir.join("ca.crt"), dir.join("ca.key"));
    let mut params = CertificateParams::default();
    params
        .distinguished_name
        .push(DnType::CommonName, "OpenDsec cluster CA");
    params.distinguished_name.push(DnType::OrganizationName, "OpenDsec");
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(1);
    params.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(3650);
    if crt.exists() && key.exists() {
        let key_pem = std::fs::read_to_string(&key).map_err(|e| io(&format!("reading {}", key.display()), e))?;
        let kp = KeyPair::from_pem(&key_pem).map_err(|e| io(&format!("parsing {}", key.display()), e))?;
        // The same name and key make an equivalent issuer: leaves it signs verify
        // against the saved ca.crt, which users already trust.
        let cert = params.self_signed(&kp).map_err(|e| io("loading the CA", e))?;
        return Ok((cert, kp));
    }
    let kp = KeyPair::generate().map_err(|e| io("generating the CA key", e))?;
    let cert = params.self_signed(&kp).map_err(|e| io("signing the CA", e))?;
    write_private(&key, &kp.serialize_pem())?;
    std::fs::write(&crt, cert.pem()).map_err(|e| io(&format!("writing {}", crt.display()), e))?;
    Ok((cert, kp))
}

/// The rustls configuration for the gateway's TLS port (HTTP/1.1).
pub fn server_config(s: &TlsSettings) -> Result<Arc<rustls::ServerConfig>, String> {
    let (chain, key) = match &s.cert_and_key {
        Some((c, k)) => {
            let chain = rustls_pemfile::certs(&mut std::io::BufReader::new(
                std::fs::File::open(c).map_err(|e| io(&format!("opening {}", c.display()), e))?,
            ))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| io(&format!("reading {}", c.display()), e))?;
            let key = rustls_pemfile::private_key(&mut std::io::BufReader::new(
                std::fs::File::open(k).map_err(|e| io(&format!("opening {}", k.display()), e))?,
            ))
            .map_err(|e| io(&format!("reading {}", k.display()), e))?
            .ok_or_else(|| format!("{} holds no private key", k.display()))?;
            (chain, key)
        }
        None => {
            let (ca, ca_key) = load_or_create_ca(&s.dir)?;
            let domain = s.domain.to_ascii_lowercase();
            let mut params = CertificateParams::new(vec![domain.clone(), format!("*.{domain}"), "localhost".into()])
                .map_err(|e| io("certificate names", e))?;
            params
                .subject_alt_names
                .push(SanType::IpAddress(std::net::IpAddr::from([127, 0, 0, 1])));
            params.distinguished_name.push(DnType::CommonName, domain.clone());
            params.not_before = time::OffsetDateTime::now_utc() - time::Duration::days(1);
            params.not_after = time::OffsetDateTime::now_utc() + time::Duration::days(365);
            let leaf_key = KeyPair::generate().map_err(|e| io("generating the server key", e))?;
            let leaf = params
                .signed_by(&leaf_key, &ca, &ca_key)
                .map_err(|e| io("signing the server certificate", e))?;
            let key = rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into());
            (vec![leaf.der().clone(), ca.der().clone()], key)
        }
    };
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| io("TLS versions", e))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| io("the server certificate", e))?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// Serves `app` over TLS on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, config: Arc<rustls::ServerConfig>, app: axum::Router) {
    let acceptor = tokio_rustls::TlsAcceptor::from(config);
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                tracing::warn!(error = %e, "TLS accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let (acceptor, app) = (acceptor.clone(), app.clone());
        tokio::spawn(async move {
            let tls = match tokio::time::timeout(std::time::Duration::from_secs(10), acceptor.accept(tcp)).await {
                Ok(Ok(t)) => t,
                Ok(Err(e)) => return tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                Err(_) => return tracing::debug!(%peer, "TLS handshake timed out"),
            };
            let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let app = app.clone();
                async move {
                    use tower::ServiceExt;
                    app.oneshot(req.map(axum::body::Body::new)).await
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .serve_connection(hyper_util::rt::TokioIo::new(tls), svc)
                .with_upgrades();
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "TLS connection ended");
            }
        });
    }
}
