//! The edge's DNS proxy: the only resolver its sandboxes reach (their `/etc/resolv.conf`
//! names the gateway; DNS to anything else is dropped). It listens on the gateway,
//! UDP and TCP port 53, and knows the asking sandbox by the query's source address
//! (its veth drops any other source). A name its policy does not allow
//! (`Policy::allows_name`) is REFUSED; an allowed one is asked of the edge's upstream
//! resolvers, over the transport the sandbox used. Before the answer goes back, each of
//! its A/AAAA addresses is added, for max(TTL, 60 s), to the learned set of every allow
//! rule whose domain matches the name asked, so the sandbox's first packet finds it
//! there; an address in special space (private, loopback, link-local, ...) is taken out
//! of the answer unless a block rule opens it (DNS rebinding), and an answer left with
//! no address is REFUSED.
//!
//! Where a proxy carries the sandbox's TCP and the upstream resolvers cannot answer an
//! allowed name (they fail, time out or refuse: a site whose DNS knows no public names),
//! an A query is answered with a stand-in address (`rules::STANDINS`) for the name, and
//! an AAAA query with no address, so the sandbox connects to the stand-in, which its
//! chain lets through to the relay, and the relay asks the proxy for the name.

use super::{NetError, Network, rules};
use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// How long an upstream resolver has to answer.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a learned address stays allowed at least, and at most.
const LEARNED_MIN_S: u64 = 60;
const LEARNED_MAX_S: u64 = 24 * 3600;
/// Queries answered at once (each may wait for an upstream and for nft).
const IN_FLIGHT: usize = 256;

/// The nameservers of a resolv.conf's text, on port 53.
pub fn nameservers(resolv_conf: &str) -> Vec<SocketAddr> {
    resolv_conf
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some("nameserver")).then(|| w.next()).flatten()
        })
        // A link-local IPv6 server's zone (`fe80::1%eth0`) cannot be kept: it is skipped.
        .filter_map(|a| a.parse::<IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}

/// A socket bound to `gateway:53` before any veth carries the address (IP_FREEBIND).
fn freebind(gateway: Ipv4Addr, ty: nix::sys::socket::SockType) -> Result<std::os::fd::OwnedFd, NetError> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockaddrIn, bind, setsockopt, socket, sockopt};
    let err = |what: &str| {
        let what = format!("{what} the DNS proxy's socket on {gateway}:53");
        move |e: nix::errno::Errno| NetError::io(what, e.into())
    };
    let fd = socket(
        AddressFamily::Inet,
        ty,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
        None,
    )
    .map_err(err("opening"))?;
    setsockopt(&fd, sockopt::IpFreebind, &true).map_err(err("setting IP_FREEBIND on"))?;
    setsockopt(&fd, sockopt::ReuseAddr, &true).map_err(err("setting SO_REUSEADDR on"))?;
    bind(
        std::os::fd::AsRawFd::as_raw_fd(&fd),
        &SockaddrIn::from(std::net::SocketAddrV4::new(gateway, 53)),
    )
    .map_err(err("binding"))?;
    Ok(fd)
}

/// The proxy's sockets on `gateway:53`.
pub struct Sockets {
    udp: std::net::UdpSocket,
    tcp: std::net::TcpListener,
}

impl Sockets {
    /// Binds UDP and TCP `gateway:53`.
    pub fn bind(gateway: Ipv4Addr) -> Result<Sockets, NetError> {
        use nix::sys::socket::SockType;
        let udp = std::net::UdpSocket::from(freebind(gateway, SockType::Datagram)?);
        let tcp_fd = freebind(gateway, SockType::Stream)?;
        nix::sys::socket::listen(&tcp_fd, nix::sys::socket::Backlog::new(128).expect("a valid backlog"))
            .map_err(|e| NetError::io("listening on the DNS proxy's TCP socket", e.into()))?;
        Ok(Sockets {
            udp,
            tcp: std::net::TcpListener::from(tcp_fd),
        })
    }
}

/// Serves the proxy on `sockets` for `net`'s sandboxes until the task is dropped.
pub async fn serve(net: Arc<Network>, sockets: Sockets) {
    let (udp, tcp) = match (UdpSocket::from_std(sockets.udp), TcpListener::from_std(sockets.tcp)) {
        (Ok(u), Ok(t)) => (Arc::new(u), t),
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "the DNS proxy cannot start: sandboxes resolve no names");
            return;
        }
    };
    let slots = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let tcp_net = net.clone();
    let tcp_task = tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = tcp.accept().await else {
                continue;
            };
            let net = tcp_net.clone();
            tokio::spawn(async move {
                let _ = serve_tcp(&net, stream, peer.ip()).await;
            });
        }
    });
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((n, peer)) = udp.recv_from(&mut buf).await else {
            continue;
        };
        let Ok(permit) = slots.clone().acquire_owned().await else {
            break;
        };
        let (net, udp, query) = (net.clone(), udp.clone(), buf[..n].to_vec());
        tokio::spawn(async move {
            if let Some(reply) = answer(&net, &query, peer.ip(), false).await {
                let _ = udp.send_to(&reply, peer).await;
            }
            drop(permit);
        });
    }
    tcp_task.abort();
}

async fn serve_tcp(net: &Network, mut stream: TcpStream, peer: IpAddr) -> std::io::Result<()> {
    loop {
        let len = match tokio::time::timeout(Duration::from_secs(10), stream.read_u16()).await {
            Ok(Ok(n)) => n as usize,
            _ => return Ok(()),
        };
        let mut query = vec![0u8; len];
        stream.read_exact(&mut query).await?;
        let Some(reply) = answer(net, &query, peer, true).await else {
            return Ok(());
        };
        stream.write_u16(reply.len() as u16).await?;
        stream.write_all(&reply).await?;
    }
}

fn reply(query: &Message, code: ResponseCode) -> Option<Vec<u8>> {
    let mut m = Message::error_msg(query.metadata.id, query.metadata.op_code, code);
    m.metadata.recursion_desired = query.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.queries = query.queries.clone();
    m.to_vec().ok()
}

/// The answer to `query` from the sandbox at `from` (`None`: nothing to send back).
pub async fn answer(net: &Network, query: &[u8], from: IpAddr, tcp: bool) -> Option<Vec<u8>> {
    let q = Message::from_vec(query).ok()?;
    if q.metadata.message_type != MessageType::Query {
        return None;
    }
    if q.metadata.op_code != OpCode::Query || q.queries.len() != 1 {
        return reply(&q, ResponseCode::NotImp);
    }
    let Some(sandbox) = net.sandbox_at(from) else {
        return reply(&q, ResponseCode::Refused);
    };
    let name = q.queries[0].name.to_ascii();
    if !sandbox.policy.allows_name(&name) {
        tracing::debug!(slot = sandbox.slot, %name, "DNS: refused by the sandbox's policy");
        return reply(&q, ResponseCode::Refused);
    }
    let asked = ask_upstream(net.upstream(), query, q.metadata.id, tcp).await;
    let resp = asked.as_deref().and_then(|raw| Message::from_vec(raw).ok());
    let failed = resp
        .as_ref()
        .is_none_or(|r| matches!(r.metadata.response_code, ResponseCode::ServFail | ResponseCode::Refused));
    if failed {
        return standin_answer(net, &q, sandbox.slot, &sandbox.policy, &name).await;
    }
    let (Some(raw), Some(mut resp)) = (asked, resp) else {
        return reply(&q, ResponseCode::ServFail);
    };
    let mut learned: Vec<(IpAddr, u64)> = Vec::new();
    let mut taken_out = 0;
    for section in [&mut resp.answers, &mut resp.additionals] {
        section.retain(|r| match r.data.ip_addr() {
            Some(ip) if rules::answer_allowed(&sandbox.policy, ip) => {
                learned.push((ip, (r.ttl as u64).clamp(LEARNED_MIN_S, LEARNED_MAX_S)));
                true
            }
            Some(ip) => {
                tracing::info!(slot = sandbox.slot, %name, %ip, "DNS: an address in special space taken out of the answer (rebinding)");
                taken_out += 1;
                false
            }
            None => true,
        });
    }
    if taken_out > 0 && learned.is_empty() {
        return reply(&q, ResponseCode::Refused);
    }
    net.learn_names(sandbox.slot, &sandbox.policy, &name, &learned);
    let sets = rules::sets_for_name(sandbox.slot, &sandbox.policy, &name);
    if !sets.is_empty() && !learned.is_empty() {
        let script = rules::learned_script(net.table(), &sets, &learned);
        if let Err(e) = super::nft::apply_async(&script).await {
            tracing::error!(slot = sandbox.slot, %name, error = %e, "DNS: cannot open the answer's addresses");
            return reply(&q, ResponseCode::ServFail);
        }
    }
    if taken_out == 0 {
        return Some(raw);
    }
    resp.to_vec().ok()
}

/// The answer to `q` for `name` when the upstream resolvers gave none: a stand-in address
/// where a proxy carries the sandbox's TCP (none for AAAA: the sandbox then connects over
/// IPv4 to the stand-in), else SERVFAIL.
async fn standin_answer(
    net: &Network,
    q: &Message,
    slot: u32,
    policy: &opendsec_commands::network::Policy,
    name: &str,
) -> Option<Vec<u8>> {
    use hickory_proto::rr::{RData, Record, RecordType, rdata::A};
    let ty = q.queries[0].query_type;
    if !matches!(ty, RecordType::A | RecordType::AAAA) {
        return reply(q, ResponseCode::ServFail);
    }
    let Some(addr) = net.standin_for(slot, policy, name).await else {
        return reply(q, ResponseCode::ServFail);
    };
    let mut m = Message::response(q.metadata.id, q.metadata.op_code);
    m.metadata.recursion_desired = q.metadata.recursion_desired;
    m.metadata.recursion_available = true;
    m.queries = q.queries.clone();
    if ty == RecordType::A {
        m.add_answer(Record::from_rdata(
            q.queries[0].name.clone(),
            STANDIN_TTL_S,
            RData::A(A(addr)),
        ));
    }
    tracing::debug!(slot, %name, %addr, "DNS: no upstream answer; a stand-in for the proxy");
    m.to_vec().ok()
}

/// How long a stand-in answer may be cached (the stand-in itself lasts as long as the
/// sandbox's policy allows its name).
const STANDIN_TTL_S: u32 = 60;

/// Asks the upstream resolvers in turn; the first answer with the query's id wins.
async fn ask_upstream(upstream: &[SocketAddr], query: &[u8], id: u16, tcp: bool) -> Option<Vec<u8>> {
    for server in upstream {
        let asked = if tcp {
            tokio::time::timeout(UPSTREAM_TIMEOUT, ask_tcp(*server, query)).await
        } else {
            tokio::time::timeout(UPSTREAM_TIMEOUT, ask_udp(*server, query)).await
        };
        match asked {
            Ok(Ok(raw)) if raw.len() >= 2 && u16::from_be_bytes([raw[0], raw[1]]) == id => return Some(raw),
            Ok(Ok(_)) => tracing::debug!(%server, "DNS: the upstream answered another id"),
            Ok(Err(e)) => tracing::debug!(%server, error = %e, "DNS: the upstream failed"),
            Err(_) => tracing::debug!(%server, "DNS: the upstream did not answer in time"),
        }
    }
    None
}

async fn ask_udp(server: SocketAddr, query: &[u8]) -> std::io::Result<Vec<u8>> {
    let local: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse().expect("an address")
    } else {
        "[::]:0".parse().expect("an address")
    };
    let sock = UdpSocket::bind(local).await?;
    sock.connect(server).await?;
    sock.send(query).await?;
    let mut buf = vec![0u8; 65535];
    let n = sock.recv(&mut buf).await?;
    buf.truncate(n);
    Ok(buf)
}

async fn ask_tcp(server: SocketAddr, query: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut s = TcpStream::connect(server).await?;
    s.write_u16(query.len() as u16).await?;
    s.write_all(query).await?;
    let len = s.read_u16().await? as usize;
    let mut buf = vec![0u8; len];
    s.read_exact(&mut buf).await?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hosts_resolvers_are_its_resolv_confs_nameservers() {
        let text = "# comment\nsearch example.com\nnameserver 10.255.255.53\nnameserver fe80::1%eth0\n\
                    nameserver 2001:4860:4860::8888\noptions ndots:1\n";
        assert_eq!(
            nameservers(text),
            vec![
                "10.255.255.53:53".parse::<SocketAddr>().unwrap(),
                "[2001:4860:4860::8888]:53".parse().unwrap()
            ]
        );
    }
}
