//! The relay to upstream proxies: where a sandbox's TCP goes when a proxy carries it
//! (its policy's `egress_proxy`, or the edge's own proxy for public destinations).
//!
//! The sandbox connects as usual; its chain judges the connection by the destination it
//! asked for (`prerouting`, before NAT), and the table's `proxy` chain then redirects it
//! to this relay (IPv4 on the gateway, IPv6 on any address; `input` accepts only
//! redirected connections, never direct ones). The relay reads the asked destination back
//! from conntrack (`SO_ORIGINAL_DST`), knows the sandbox by the source address (its veth
//! drops any other), and opens the same destination through the proxy: by name when the
//! edge's DNS proxy answered the sandbox that name for that address (so the proxy
//! resolves it: sites whose own DNS knows no public names), else by address. A sandbox's
//! own proxy is reached through the edge's proxy when the edge has one. A connection the
//! relay cannot carry (the proxy refuses it, or cannot be reached) is reset, and shows in
//! the sandbox's sampled drops as rule `egress_proxy`.
//!
//! A sandbox's own proxy is reached from the edge host, so where it may be is checked as
//! a sandbox's destination would be (`Policy::proxy_reachable_at`): never loopback,
//! link-local (the metadata service) or an address of the edge host itself, a private
//! address only where an allow rule's block names it. The edge's proxy is the
//! operator's, and trusted.

use super::{NetError, Network};
use opendsec_commands::network::{EgressProxy, Policy, Protocol, ProxyKind, ProxyTls};
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, OnceLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};

/// How long reaching a proxy and its handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(15);
/// Connections carried at once (each holds two sockets).
const IN_FLIGHT: usize = 4096;

/// A byte stream to a proxy or through it.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}

/// The relay's listening sockets.
pub struct Listeners {
    v4: std::net::TcpListener,
    v6: Option<std::net::TcpListener>,
}

fn listen_on(addr: SocketAddr, freebind: bool, v6only: bool) -> Result<std::net::TcpListener, NetError> {
    use nix::sys::socket::{
        AddressFamily, Backlog, SockFlag, SockType, SockaddrStorage, bind, listen, setsockopt, socket, sockopt,
    };
    let err = |what: &'static str| {
        move |e: nix::errno::Errno| NetError::io(format!("{what} the proxy relay's socket on {addr}"), e.into())
    };
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(
        family,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(err("opening"))?;
    if freebind {
        setsockopt(&fd, sockopt::IpFreebind, &true).map_err(err("setting IP_FREEBIND on"))?;
    }
    if v6only {
        setsockopt(&fd, sockopt::Ipv6V6Only, &true).map_err(err("setting IPV6_V6ONLY on"))?;
    }
    bind(std::os::fd::AsRawFd::as_raw_fd(&fd), &SockaddrStorage::from(addr)).map_err(err("binding"))?;
    listen(&fd, Backlog::new(1024).expect("a valid backlog")).map_err(err("listening on"))?;
    Ok(std::net::TcpListener::from(fd))
}

impl Listeners {
    /// Binds `gateway:0` (before any veth carries the address) and `[::]:0` (IPv6 only;
    /// none where the host has no IPv6).
    pub fn bind(gateway: std::net::Ipv4Addr, ipv6: bool) -> Result<Listeners, NetError> {
        let v4 = listen_on(SocketAddr::new(IpAddr::V4(gateway), 0), true, false)?;
        let v6 = if ipv6 {
            match listen_on(SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0), false, true) {
                Ok(l) => Some(l),
                Err(e) => {
                    tracing::warn!(error = %e, "no IPv6 proxy relay: sandboxes' IPv6 TCP through a proxy fails");
                    None
                }
            }
        } else {
            None
        };
        Ok(Listeners { v4, v6 })
    }

    /// The ports (IPv4, IPv6; the IPv4 one twice where there is no IPv6 listener).
    pub fn ports(&self) -> (u16, u16) {
        let port = |l: &std::net::TcpListener| l.local_addr().map(|a| a.port()).unwrap_or(0);
        let p4 = port(&self.v4);
        (p4, self.v6.as_ref().map(port).unwrap_or(p4))
    }
}

/// Serves the relay on `listeners` for `net`'s sandboxes until the task is dropped.
pub async fn serve(net: Arc<Network>, listeners: Listeners) {
    let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let mut tasks = Vec::new();
    for l in std::iter::once(listeners.v4).chain(listeners.v6) {
        let listener = match TcpListener::from_std(l) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "the proxy relay cannot start: TCP through proxies fails");
                continue;
            }
        };
        let (net, slots) = (net.clone(), slots.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let Ok((stream, peer)) = listener.accept().await else {
                    continue;
                };
                let Ok(permit) = slots.clone().acquire_owned().await else {
                    break;
                };
                let net = net.clone();
                tokio::spawn(async move {
                    carry(&net, stream, peer.ip()).await;
                    drop(permit);
                });
            }
        }));
    }
    for t in tasks {
        let _ = t.await;
    }
}

/// The destination a redirected connection asked for (conntrack's original tuple).
fn original_destination(stream: &TcpStream) -> std::io::Result<SocketAddr> {
    use nix::sys::socket::{getsockopt, sockopt};
    let fd = std::os::fd::AsFd::as_fd(stream);
    if stream.local_addr()?.is_ipv4() {
        let a = getsockopt(&fd, sockopt::OriginalDst)?;
        let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
        Ok(SocketAddr::new(IpAddr::V4(ip), u16::from_be(a.sin_port)))
    } else {
        let a = getsockopt(&fd, sockopt::Ip6tOriginalDst)?;
        let ip = Ipv6Addr::from(a.sin6_addr.s6_addr);
        Ok(SocketAddr::new(IpAddr::V6(ip), u16::from_be(a.sin6_port)))
    }
}

/// Where a proxy is told to connect.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Name(String, u16),
    Addr(SocketAddr),
}

impl Target {
    /// `host:port`, an IPv6 address in brackets (what HTTP CONNECT asks for).
    pub fn authority(&self) -> String {
        match self {
            Target::Name(n, p) => format!("{n}:{p}"),
            Target::Addr(a) => a.to_string(),
        }
    }
}

/// Carries one redirected connection from the sandbox at `peer` through its proxy.
async fn carry(net: &Network, mut stream: TcpStream, peer: IpAddr) {
    let Some(sandbox) = net.sandbox_at(peer) else {
        return; // not one of ours (the chains let no other in)
    };
    let Ok(dest) = original_destination(&stream) else {
        return;
    };
    let target = match net.name_of(sandbox.slot, dest.ip()) {
        Some(name) => Target::Name(name, dest.port()),
        None => Target::Addr(dest),
    };
    // A stand-in lets any TCP through the chain: its name and port are judged here.
    if Network::is_standin(dest.ip()) {
        let allowed = match &target {
            Target::Name(name, port) => sandbox.policy.allows_name_on(name, *port, Protocol::Tcp),
            Target::Addr(_) => false, // stands for nothing (any more)
        };
        if !allowed {
            net.note_refused(sandbox.slot, dest, "default");
            let zero = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            let _ = nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::Linger, &zero);
            return;
        }
    }
    let opened = tokio::time::timeout(HANDSHAKE_TIMEOUT, open(&sandbox.policy, net.edge_proxy(), &target))
        .await
        .unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the proxy did not answer in time",
            ))
        });
    let mut upstream = match opened {
        Ok(s) => s,
        Err(e) => {
            tracing::info!(slot = sandbox.slot, target = %target.authority(), error = %e, "a proxy did not carry a sandbox's connection");
            net.note_refused(sandbox.slot, dest, "egress_proxy");
            // A reset, so the sandbox's client fails at once rather than reading nothing.
            let zero = libc::linger {
                l_onoff: 1,
                l_linger: 0,
            };
            let _ = nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::Linger, &zero);
            return;
        }
    };
    let _ = tokio::io::copy_bidirectional(&mut stream, &mut upstream).await;
}

/// A stream to `target` through the sandbox's proxy (reached through the edge's, if
/// any), else through the edge's.
pub async fn open(policy: &Policy, edge: Option<&EgressProxy>, target: &Target) -> std::io::Result<Box<dyn Io>> {
    match (&policy.egress_proxy, edge) {
        (Some(own), Some(edge)) => {
            let to_own = Target::Name(own.host.clone(), own.port);
            let base = handshake(
                edge,
                secure(edge, Box::new(connect_trusted(edge).await?)).await?,
                &to_own,
            )
            .await?;
            handshake(own, secure(own, base).await?, target).await
        }
        (Some(own), None) => {
            let base: Box<dyn Io> = Box::new(connect_checked(own, policy).await?);
            handshake(own, secure(own, base).await?, target).await
        }
        (None, Some(edge)) => {
            handshake(
                edge,
                secure(edge, Box::new(connect_trusted(edge).await?)).await?,
                target,
            )
            .await
        }
        (None, None) => Err(std::io::Error::other(
            "no proxy carries this sandbox's connections any more",
        )),
    }
}

/// TCP to the edge's own proxy (the operator's: any address).
async fn connect_trusted(p: &EgressProxy) -> std::io::Result<TcpStream> {
    TcpStream::connect((p.host.as_str(), p.port)).await
}

/// The edge host's own addresses.
fn host_addresses() -> Vec<IpAddr> {
    nix::ifaddrs::getifaddrs()
        .map(|all| {
            all.filter_map(|i| {
                let a = i.address?;
                a.as_sockaddr_in()
                    .map(|s| IpAddr::V4(s.ip()))
                    .or_else(|| a.as_sockaddr_in6().map(|s| IpAddr::V6(s.ip())))
            })
            .collect()
        })
        .unwrap_or_default()
}

/// TCP to a sandbox's own proxy, at the first of its addresses that the sandbox's policy
/// lets the edge reach for it and that is not the edge host's own.
async fn connect_checked(p: &EgressProxy, policy: &Policy) -> std::io::Result<TcpStream> {
    let own = host_addresses();
    let mut last = None;
    for addr in tokio::net::lookup_host((p.host.as_str(), p.port)).await? {
        let ip = match addr.ip() {
            IpAddr::V6(a) => a.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(addr.ip()),
            v4 => v4,
        };
        if !policy.proxy_reachable_at(ip) || own.contains(&ip) {
            last = Some(std::io::Error::new(
                std::io::ErrorKind::PermissionDenied,
                format!(
                    "proxy {} is at {ip}, which the sandbox's policy does not let it reach",
                    p.host
                ),
            ));
            continue;
        }
        match TcpStream::connect(SocketAddr::new(ip, addr.port())).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other(format!("proxy {} has no address", p.host))))
}

/// The edge host's trusted roots, read once.
fn native_roots() -> Arc<rustls::RootCertStore> {
    static ROOTS: OnceLock<Arc<rustls::RootCertStore>> = OnceLock::new();
    ROOTS
        .get_or_init(|| {
            let mut roots = rustls::RootCertStore::empty();
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                tracing::warn!("no trusted roots on this host: TLS to proxies needs their CA certificate");
            }
            Arc::new(roots)
        })
        .clone()
}

fn tls_config(tls: &ProxyTls) -> std::io::Result<rustls::ClientConfig> {
    let roots = match &tls.ca_cert {
        None => native_roots(),
        Some(pem) => {
            let mut roots = rustls::RootCertStore::empty();
            for cert in rustls_pemfile::certs(&mut pem.as_bytes()) {
                roots.add(cert?).map_err(|e| {
                    std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!("the proxy's CA certificate: {e}"),
                    )
                })?;
            }
            Arc::new(roots)
        }
    };
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(std::io::Error::other)?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

/// `base` under TLS to `p` where it asks for TLS.
async fn secure(p: &EgressProxy, base: Box<dyn Io>) -> std::io::Result<Box<dyn Io>> {
    let Some(tls) = &p.tls else {
        return Ok(base);
    };
    let name = tls.server_name.clone().unwrap_or_else(|| p.host.clone());
    let name = rustls::pki_types::ServerName::try_from(name)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls_config(tls)?));
    Ok(Box::new(connector.connect(name, base).await?))
}

/// Asks proxy `p`, over `base`, for a stream to `target`.
async fn handshake(p: &EgressProxy, base: Box<dyn Io>, target: &Target) -> std::io::Result<Box<dyn Io>> {
    match p.kind {
        ProxyKind::Socks5 => socks5(p, base, target).await,
        ProxyKind::Http => http_connect(p, base, target).await,
    }
}

async fn socks5(p: &EgressProxy, base: Box<dyn Io>, target: &Target) -> std::io::Result<Box<dyn Io>> {
    use tokio_socks::tcp::Socks5Stream;
    let err = |e: tokio_socks::Error| std::io::Error::other(format!("SOCKS5 proxy {}: {e}", p.authority()));
    let stream = match (target, &p.username) {
        (Target::Name(n, port), None) => Socks5Stream::connect_with_socket(base, (n.as_str(), *port)).await,
        (Target::Addr(a), None) => Socks5Stream::connect_with_socket(base, *a).await,
        (Target::Name(n, port), Some(u)) => {
            let pw = p.password.as_deref().unwrap_or("");
            Socks5Stream::connect_with_password_and_socket(base, (n.as_str(), *port), u, pw).await
        }
        (Target::Addr(a), Some(u)) => {
            let pw = p.password.as_deref().unwrap_or("");
            Socks5Stream::connect_with_password_and_socket(base, *a, u, pw).await
        }
    }
    .map_err(err)?;
    Ok(Box::new(stream))
}

async fn http_connect(p: &EgressProxy, base: Box<dyn Io>, target: &Target) -> std::io::Result<Box<dyn Io>> {
    use base64::Engine;
    let err = |what: &str, e: &dyn std::fmt::Display| {
        std::io::Error::other(format!("HTTP proxy {}: {what}: {e}", p.authority()))
    };
    let (mut sender, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(base))
        .await
        .map_err(|e| err("handshake", &e))?;
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let authority = target.authority();
    let mut req = hyper::Request::builder()
        .method(hyper::Method::CONNECT)
        .uri(authority.as_str())
        .header(hyper::header::HOST, authority.as_str());
    if let Some(u) = &p.username {
        let pair = format!("{u}:{}", p.password.as_deref().unwrap_or(""));
        let value = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair));
        req = req.header(hyper::header::PROXY_AUTHORIZATION, value);
    }
    let req = req
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| err("request", &e))?;
    let resp = sender.send_request(req).await.map_err(|e| err("CONNECT", &e))?;
    if !resp.status().is_success() {
        return Err(err("CONNECT", &format!("answered {}", resp.status())));
    }
    let upgraded = hyper::upgrade::on(resp).await.map_err(|e| err("upgrade", &e))?;
    Ok(Box::new(hyper_util::rt::TokioIo::new(upgraded)))
}
