//! Mutual TLS between components. A [`Trust`] is one component's certificate and key (its
//! identity), the cluster CA it trusts, and the rustls configurations made from them:
//! as a server it asks every client for a certificate of the CA (a client without one
//! gets a session whose identity is `None`, and each protocol decides what that may do:
//! only an edge's join); as a client it checks the chain to the CA and that the server
//! is who the caller expects ([`Expect`]), not a host name: components are reached at
//! addresses, and are named by the identity in their certificate.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite};

use crate::{Ca, Error, Identity, Issued, Role};

/// Whom a client accepts at the other end.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expect {
    /// Any component of this role (any control node, when an edge reaches the cluster).
    Role(Role),
    /// This one (edge `e2`, when the gateway proxies to it).
    Exactly(Identity),
}

impl Expect {
    pub fn accepts(&self, id: &Identity) -> bool {
        match self {
            Expect::Role(r) => id.role == *r,
            Expect::Exactly(x) => x == id,
        }
    }
}

impl std::fmt::Display for Expect {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Expect::Role(r) => write!(f, "a {} component", r.as_str()),
            Expect::Exactly(id) => write!(f, "{id}"),
        }
    }
}

/// This component's certificate, swapped whole when it is renewed: connections opened
/// after present the new one, open ones keep theirs.
#[derive(Debug)]
struct Current(RwLock<Arc<CertifiedKey>>);

impl Current {
    fn get(&self) -> Arc<CertifiedKey> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.get())
    }
}

impl rustls::client::ResolvesClientCert for Current {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.get())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The client's check of a server: the chain to the cluster CA (by the same webpki
/// verification the server applies to clients: every component's certificate is for
/// both uses), then the identity in it.
#[derive(Debug)]
struct PeerVerifier {
    chain: Arc<dyn ClientCertVerifier>,
    expect: Expect,
}

#[derive(Debug)]
struct WrongPeer(String);

impl std::fmt::Display for WrongPeer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WrongPeer {}

fn wrong_peer(why: String) -> rustls::Error {
    rustls::Error::InvalidCertificate(rustls::CertificateError::Other(rustls::OtherError(Arc::new(
        WrongPeer(why),
    ))))
}

impl ServerCertVerifier for PeerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.chain.verify_client_cert(end_entity, intermediates, now)?;
        match Identity::of_certificate(end_entity) {
            Some(id) if self.expect.accepts(&id) => Ok(ServerCertVerified::assertion()),
            Some(id) => Err(wrong_peer(format!("the peer is {id}, not {}", self.expect))),
            None => Err(wrong_peer("the peer's certificate names no OpenDsec component".into())),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.chain.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.chain.supported_verify_schemes()
    }
}

/// One component's place in the cluster's trust: see the module's documentation.
pub struct Trust {
    identity: Identity,
    ca_pem: String,
    provider: Arc<CryptoProvider>,
    chain: Arc<dyn ClientCertVerifier>,
    current: Arc<Current>,
    /// Control nodes hold the CA: they issue their own certificates and edges'.
    issuer: Option<Arc<Ca>>,
    server: Arc<ServerConfig>,
    clients: Mutex<HashMap<Expect, Arc<ClientConfig>>>,
}

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trust")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

/// The cluster CA's certificates (PEM) as rustls's trust anchors.
fn roots(ca_pem: &str) -> Result<Arc<RootCertStore>, Error> {
    let mut roots = RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut ca_pem.as_bytes()) {
        roots
            .add(c.map_err(|e| Error::Pem(e.to_string()))?)
            .map_err(|e| Error::Pem(e.to_string()))?;
    }
    if roots.is_empty() {
        return Err(Error::Pem("the CA file holds no certificate".into()));
    }
    Ok(Arc::new(roots))
}

fn certified(provider: &CryptoProvider, issued: &Issued) -> Result<CertifiedKey, Error> {
    let chain = rustls_pemfile::certs(&mut issued.cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| Error::Pem(e.to_string()))?;
    if chain.is_empty() {
        return Err(Error::Pem("no certificate".into()));
    }
    let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut issued.key_pem.as_bytes())
        .map_err(|e| Error::Pem(e.to_string()))?
        .ok_or_else(|| Error::Pem("no private key".into()))?;
    let signing = provider
        .key_provider
        .load_private_key(key)
        .map_err(|e| Error::Pem(e.to_string()))?;
    Ok(CertifiedKey::new(chain, signing))
}

impl Trust {
    /// `identity`'s trust from its certificate and key (`issued`), trusting the CA in
    /// `ca_pem`. The certificate must name `identity` and chain to the CA.
    pub fn new(identity: Identity, ca_pem: &str, issued: &Issued, issuer: Option<Ca>) -> Result<Trust, Error> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = WebPkiClientVerifier::builder_with_provider(roots(ca_pem)?, provider.clone())
            .allow_unauthenticated()
            .build()
            .map_err(|e| Error::Tls(e.to_string()))?;
        let key = certified(&provider, issued)?;
        Self::check(&chain, &key, &identity)?;
        let current = Arc::new(Current(RwLock::new(Arc::new(key))));
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| Error::Tls(e.to_string()))?
            .with_client_cert_verifier(chain.clone())
            .with_cert_resolver(current.clone());
        Ok(Trust {
            identity,
            ca_pem: ca_pem.to_string(),
            provider,
            chain,
            current,
            issuer: issuer.map(Arc::new),
            server: Arc::new(server),
            clients: Mutex::new(HashMap::new()),
        })
    }

    /// A control-host component's trust: a fresh certificate for `identity` from `ca`,
    /// which it keeps to issue more (edges' at join, its own on rotation).
    pub fn issued_by(ca: Ca, identity: Identity) -> Result<Trust, Error> {
        let issued = ca.issue(&identity)?;
        let pem = ca.cert_pem().to_string();
        Trust::new(identity, &pem, &issued, Some(ca))
    }

    /// Same CA and issuer, another identity (the gateway beside its control node).
    pub fn sibling(&self, identity: Identity) -> Result<Trust, Error> {
        let ca = self.issuer.as_ref().ok_or(Error::NotIssuer)?;
        let issued = ca.issue(&identity)?;
        Trust::new(identity, &self.ca_pem, &issued, None)
    }

    /// Like [`Self::sibling`], and holding the same CA so that it can renew its own
    /// certificate ([`Self::reissue`]): for a component in the process that holds the CA
    /// anyway (the edge embedded in `opendsec up`), which has no one else to ask.
    pub fn renewing_sibling(&self, identity: Identity) -> Result<Trust, Error> {
        let ca = self.issuer.as_ref().ok_or(Error::NotIssuer)?;
        let issued = ca.issue(&identity)?;
        let mut trust = Trust::new(identity, &self.ca_pem, &issued, None)?;
        trust.issuer = Some(ca.clone());
        Ok(trust)
    }

    fn check(chain: &Arc<dyn ClientCertVerifier>, key: &CertifiedKey, identity: &Identity) -> Result<(), Error> {
        let ee = key.end_entity_cert().map_err(|e| Error::Tls(e.to_string()))?;
        chain
            .verify_client_cert(ee, &key.cert[1..], UnixTime::now())
            .map_err(|e| Error::Tls(format!("the certificate does not chain to the cluster CA: {e}")))?;
        match Identity::of_certificate(ee) {
            Some(id) if &id == identity => Ok(()),
            Some(id) => Err(Error::Tls(format!("the certificate is for {id}, not {identity}"))),
            None => Err(Error::Tls("the certificate names no OpenDsec component".into())),
        }
    }

    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// The cluster CA (PEM) this component trusts.
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The CA, on a control host.
    pub fn issuer(&self) -> Option<&Ca> {
        self.issuer.as_deref()
    }

    /// When the current certificate stops being valid.
    pub fn not_after(&self) -> Option<std::time::SystemTime> {
        self.validity().map(|(_, to)| to)
    }

    /// When the current certificate was issued (its validity starts a little before).
    pub fn issued_at(&self) -> Option<std::time::SystemTime> {
        let back = std::time::Duration::from_secs(crate::ca::BACKDATE_MINUTES as u64 * 60);
        self.validity().map(|(from, _)| from + back)
    }

    fn validity(&self) -> Option<(std::time::SystemTime, std::time::SystemTime)> {
        use x509_parser::prelude::{FromDer, X509Certificate};
        let current = self.current.get();
        let (_, cert) = X509Certificate::from_der(current.end_entity_cert().ok()?).ok()?;
        let at = |secs: i64| std::time::UNIX_EPOCH + std::time::Duration::from_secs(secs.max(0) as u64);
        Some((
            at(cert.validity().not_before.timestamp()),
            at(cert.validity().not_after.timestamp()),
        ))
    }

    /// Presents `issued` from now on (a renewed certificate, checked like the first).
    pub fn install(&self, issued: &Issued) -> Result<(), Error> {
        let key = certified(&self.provider, issued)?;
        Self::check(&self.chain, &key, &self.identity)?;
        *self.current.0.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(key);
        Ok(())
    }

    /// A fresh key and certificate from the CA this component holds, presented from now
    /// on (rotation on a control host).
    pub fn reissue(&self) -> Result<(), Error> {
        let ca = self.issuer.as_ref().ok_or(Error::NotIssuer)?;
        self.install(&ca.issue(&self.identity)?)
    }

    /// The server side, for any listener of this component.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.server.clone()
    }

    /// The client side, towards a peer that must be `expect`.
    pub fn client_config(&self, expect: &Expect) -> Arc<ClientConfig> {
        let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
        clients
            .entry(expect.clone())
            .or_insert_with(|| {
                let verifier = Arc::new(PeerVerifier {
                    chain: self.chain.clone(),
                    expect: expect.clone(),
                });
                let mut cfg = ClientConfig::builder_with_provider(self.provider.clone())
                    .with_protocol_versions(&[&rustls::version::TLS13])
                    .expect("TLS 1.3 is supported by the ring provider")
                    .dangerous()
                    .with_custom_certificate_verifier(verifier)
                    .with_client_cert_resolver(self.current.clone());
                // Peers are named by the identity in their certificate, not by a host name.
                cfg.enable_sni = false;
                Arc::new(cfg)
            })
            .clone()
    }

    /// Opens TLS over `io` to a peer that must be `expect`.
    pub async fn connect<IO>(&self, io: IO, expect: &Expect) -> std::io::Result<tokio_rustls::client::TlsStream<IO>>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let connector = tokio_rustls::TlsConnector::from(self.client_config(expect));
        connector.connect(peer_name(), io).await
    }

    /// Accepts TLS on `io`; the identity is the client's, if it presented a certificate
    /// of the CA (else `None`: only a protocol that serves strangers may go on).
    pub async fn accept<IO>(&self, io: IO) -> std::io::Result<(tokio_rustls::server::TlsStream<IO>, Option<Identity>)>
    where
        IO: AsyncRead + AsyncWrite + Unpin,
    {
        let tls = tokio_rustls::TlsAcceptor::from(self.server.clone()).accept(io).await?;
        let id = peer_identity(tls.get_ref().1);
        Ok((tls, id))
    }
}

/// The name a client gives rustls; never checked (see [`PeerVerifier`]) nor sent (no SNI).
pub fn peer_name() -> ServerName<'static> {
    ServerName::try_from("peer.opendsec.invalid").expect("a valid DNS name")
}

/// The identity in a session's client certificate (verified by the handshake), if any.
pub fn peer_identity(conn: &rustls::CommonState) -> Option<Identity> {
    conn.peer_certificates()?
        .first()
        .and_then(|c| Identity::of_certificate(c))
}

/// A client with no certificate of its own (an edge that has not joined yet), checking
/// that the server is `expect` under the CA in `ca_pem`.
pub fn stranger_config(ca_pem: &str, expect: Expect) -> Result<Arc<ClientConfig>, Error> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let chain = WebPkiClientVerifier::builder_with_provider(roots(ca_pem)?, provider.clone())
        .build()
        .map_err(|e| Error::Tls(e.to_string()))?;
    let mut cfg = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| Error::Tls(e.to_string()))?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PeerVerifier { chain, expect }))
        .with_no_client_auth();
    cfg.enable_sni = false;
    Ok(Arc::new(cfg))
}

/// A connector for tonic channels on the peer port: TCP (Nagle off), then mutual TLS
/// to a peer that must be `expect`. Every gRPC client of the peer port (Raft, the read
/// index, edges' slice) connects through one of these.
pub fn tls_connector(
    trust: Arc<Trust>,
    expect: Expect,
) -> impl tower::Service<
    http::Uri,
    Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    config_connector(trust.client_config(&expect))
}

/// As [`tls_connector`], with a client configuration of the caller's (a joining edge's,
/// which has no certificate yet: [`stranger_config`]).
pub fn config_connector(
    config: Arc<ClientConfig>,
) -> impl tower::Service<
    http::Uri,
    Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |uri: http::Uri| {
        let config = config.clone();
        async move {
            let host = uri
                .host()
                .unwrap_or_default()
                .trim_start_matches('[')
                .trim_end_matches(']');
            let port = uri.port_u16().unwrap_or(80);
            let tcp = tokio::net::TcpStream::connect((host, port)).await?;
            let _ = tcp.set_nodelay(true);
            let tls = tokio_rustls::TlsConnector::from(config)
                .connect(peer_name(), tcp)
                .await?;
            Ok(hyper_util::rt::TokioIo::new(tls))
        }
    })
}
