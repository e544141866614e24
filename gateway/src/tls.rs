//! TLS for the gateway's second port, so that E2B SDKs configured with only
//! `E2B_DOMAIN` reach `https://api.{domain}` and `https://{port}-{id}.{domain}`.
//!
//! The certificate covers `{domain}`, `*.{domain}`, `localhost` and 127.0.0.1. It is
//! either the operator's (PEM files) or issued by the cluster's own CA, which is made
//! once and kept under `<dir>/ca.crt` + `ca.key` (0600): users trust `ca.crt` the way
//! they trust any private CA. The leaf is re-issued at every start.

use std::path::PathBuf;
use std::sync::Arc;

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
            // The cluster CA (the one the components' certificates come from).
            let ca = opendsec_trust::Ca::load_or_create(&s.dir).map_err(|e| e.to_string())?;
            let domain = s.domain.to_ascii_lowercase();
            let issued = ca
                .issue_server(
                    &[domain.clone(), format!("*.{domain}"), "localhost".into()],
                    &[std::net::IpAddr::from([127, 0, 0, 1])],
                )
                .map_err(|e| io("issuing the server certificate", e))?;
            let chain = rustls_pemfile::certs(&mut issued.cert_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| io("the server certificate", e))?;
            let key = rustls_pemfile::private_key(&mut issued.key_pem.as_bytes())
                .map_err(|e| io("the server key", e))?
                .ok_or("the server key is missing")?;
            (chain, key)
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
