//! A test's own internet, in network namespaces: no packet of a network test ever
//! leaves the test's namespaces. Two namespaces per test:
//! - the edge's ("the host", where `opendsec up` runs): `mgmt0` toward the test
//!   process's namespace (the API, the peer port and the edge's proxy listen on its
//!   address, [`Internet::api_addr`]), and `up0`, its default route (IPv4 and IPv6), to
//! - the internet: public-looking servers on its loopback ([`HOSTS`]), each serving HTTP
//!   on ports 80 and 8080 (the body names the address and port that answered, and the
//!   client's address: `hello from <addr> <port> for <client>`) and a
//!   stream on port 9000 (a line every 50 ms while the connection lasts); an
//!   authoritative DNS server for `*.test` at [`DNS`]; the metadata address
//!   (169.254.169.254) and a private-network host ([`PRIVATE`]); and, once a test asks
//!   for them ([`Internet::start_proxies`]), two real upstream proxies: microsocks
//!   (SOCKS5) at [`SOCKS_PROXY`] and tinyproxy (HTTP CONNECT) at [`HTTP_PROXY`], both
//!   with user [`PROXY_USER`] and password [`PROXY_PASSWORD`], connecting on from their
//!   own address and resolving names with the test DNS server; and stunnel at
//!   [`TLS_PROXY`], the SOCKS5 proxy over TLS.
//!
//! The edge is pointed at it with `--upstream-dns` (see `Up::start_in_netns`). Drop
//! stops the servers and removes both namespaces (every link in them goes too). The
//! host's `net.netfilter.nf_log_all_netns` is set to 1, so the edge's sampled drops are
//! logged from its namespace as they are from the host's.

#![allow(dead_code)]

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::rdata::{A, AAAA};
use hickory_proto::rr::{RData, Record, RecordType};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

/// The authoritative DNS server of `*.test` (also a "foreign resolver" to sandboxes).
pub const DNS: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 53);
/// `pkgs.test` (and its IPv6 address [`PKGS_V6`]).
pub const PKGS: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 10);
pub const PKGS_V6: Ipv6Addr = Ipv6Addr::new(0x2a0a, 0, 0, 0, 0, 0, 0, 0x10);
/// `api.pkgs.test` (under the wildcard `*.pkgs.test`).
pub const PKGS_API: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 11);
/// `other.test`.
pub const OTHER: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 20);
/// `other.test`'s IPv6 address.
pub const OTHER_V6: Ipv6Addr = Ipv6Addr::new(0x2a0a, 0, 0, 0, 0, 0, 0, 0x20);
/// A host on a private network (`rebind.test` resolves to it).
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(192, 168, 77, 7);
/// The cloud metadata address.
pub const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
/// A SOCKS5 proxy (microsocks) on port [`SOCKS_PORT`].
pub const SOCKS_PROXY: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 80);
pub const SOCKS_PORT: u16 = 1080;
/// An HTTP CONNECT proxy (tinyproxy) on port [`HTTP_PROXY_PORT`].
pub const HTTP_PROXY: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 81);
pub const HTTP_PROXY_PORT: u16 = 3128;
/// The SOCKS5 proxy behind TLS (stunnel in front of microsocks), its certificate for
/// [`TLS_PROXY_NAME`] from a CA of the test's own ([`Internet::proxy_ca`]).
pub const TLS_PROXY: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 82);
pub const TLS_PROXY_PORT: u16 = 1443;
pub const TLS_PROXY_NAME: &str = "proxy.test";
/// Names the test DNS server refuses (as a site's resolver that knows no public names),
/// and the proxies resolve from their hosts file: [`OFFLINE_HOSTS`].
pub const OFFLINE_ZONE: &str = ".offline";
pub const OFFLINE_HOSTS: &[(&str, Ipv4Addr)] = &[("pkgs.offline", PKGS)];
pub const PROXY_USER: &str = "odsec";
pub const PROXY_PASSWORD: &str = "proxy-pw";

/// The zone: names and their addresses.
pub const HOSTS: &[(&str, &[IpAddr])] = &[
    ("pkgs.test", &[IpAddr::V4(PKGS), IpAddr::V6(PKGS_V6)]),
    ("api.pkgs.test", &[IpAddr::V4(PKGS_API)]),
    ("other.test", &[IpAddr::V4(OTHER), IpAddr::V6(OTHER_V6)]),
    ("rebind.test", &[IpAddr::V4(PRIVATE)]),
];

/// Ports every server answers HTTP on.
pub const HTTP_PORTS: [u16; 2] = [80, 8080];
/// The port every server streams on.
pub const STREAM_PORT: u16 = 9000;

pub struct Internet {
    /// The edge's namespace (under /run/netns).
    pub edge_ns: String,
    /// The internet's namespace.
    pub net_ns: String,
    /// The edge namespace's address the test process reaches it at.
    pub mgmt: Ipv4Addr,
    stop: Arc<AtomicBool>,
    proxies: std::sync::Mutex<Vec<std::process::Child>>,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip (iproute2)");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `f` on a thread inside namespace `ns` (sockets it makes stay there).
pub fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let file = std::fs::File::open(format!("/run/netns/{ns}")).expect("open the namespace");
    std::thread::spawn(move || {
        // SAFETY: setns on an fd we own; it changes only this thread's namespace.
        assert_eq!(unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns");
        f()
    })
    .join()
    .expect("the namespace thread")
}

static SEQ: AtomicU32 = AtomicU32::new(0);

impl Internet {
    /// Builds both namespaces and starts the servers.
    pub fn start() -> Internet {
        std::fs::write("/proc/sys/net/netfilter/nf_log_all_netns", "1")
            .expect("set net.netfilter.nf_log_all_netns (as root)");
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let id = (std::process::id() << 4 | n) & 0xffffff;
        let edge_ns = format!("odt-{id:x}-edge");
        let net_ns = format!("odt-{id:x}-net");
        let host_if = format!("odtm{id:x}");
        // A /30 of 10.201/16 for the management link, by id.
        let k = (id % 16384) * 4;
        let mgmt = Ipv4Addr::new(10, 201, (k >> 8) as u8, (k & 0xff) as u8 + 2);
        let host_side = Ipv4Addr::new(10, 201, (k >> 8) as u8, (k & 0xff) as u8 + 1);
        for ns in [&edge_ns, &net_ns] {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
            ip(&["netns", "add", ns]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        let _ = Command::new("ip").args(["link", "delete", &host_if]).output();
        // The management link: the test process <-> the edge's namespace.
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", "mgmt0", "netns", &edge_ns,
        ]);
        ip(&["addr", "add", &format!("{host_side}/30"), "dev", &host_if]);
        ip(&["link", "set", &host_if, "up"]);
        ip(&["-n", &edge_ns, "addr", "add", &format!("{mgmt}/30"), "dev", "mgmt0"]);
        ip(&["-n", &edge_ns, "link", "set", "mgmt0", "up"]);
        // The uplink: the edge's namespace <-> the internet, its default route.
        ip(&[
            "-n", &edge_ns, "link", "add", "up0", "type", "veth", "peer", "name", "down0", "netns", &net_ns,
        ]);
        ip(&["-n", &edge_ns, "addr", "add", "10.200.0.2/24", "dev", "up0"]);
        ip(&["-n", &edge_ns, "addr", "add", "fd00:200::2/64", "dev", "up0", "nodad"]);
        ip(&["-n", &edge_ns, "link", "set", "up0", "up"]);
        ip(&["-n", &edge_ns, "route", "add", "default", "via", "10.200.0.1"]);
        ip(&["-n", &edge_ns, "-6", "route", "add", "default", "via", "fd00:200::1"]);
        ip(&["-n", &net_ns, "addr", "add", "10.200.0.1/24", "dev", "down0"]);
        ip(&["-n", &net_ns, "addr", "add", "fd00:200::1/64", "dev", "down0", "nodad"]);
        ip(&["-n", &net_ns, "link", "set", "down0", "up"]);
        let mut addrs: Vec<IpAddr> = HOSTS.iter().flat_map(|(_, a)| a.iter().copied()).collect();
        addrs.extend([
            IpAddr::V4(DNS),
            IpAddr::V4(METADATA),
            IpAddr::V4(SOCKS_PROXY),
            IpAddr::V4(HTTP_PROXY),
            IpAddr::V4(TLS_PROXY),
        ]);
        addrs.sort();
        addrs.dedup();
        for a in &addrs {
            let cidr = match a {
                IpAddr::V4(v) => format!("{v}/32"),
                IpAddr::V6(v) => format!("{v}/128"),
            };
            ip(&["-n", &net_ns, "addr", "add", &cidr, "dev", "lo"]);
        }
        let stop = Arc::new(AtomicBool::new(false));
        let inet = Internet {
            edge_ns,
            net_ns,
            mgmt,
            stop: stop.clone(),
            proxies: std::sync::Mutex::new(Vec::new()),
        };
        // Servers: bound inside the internet's namespace, served from plain threads.
        let (http, streams, dns) = in_netns(&inet.net_ns, || {
            // Dual-stack sockets: IPv4 peers too (as ::ffff:a.b.c.d).
            let http: Vec<TcpListener> = HTTP_PORTS.iter().map(|p| bind_tcp(&format!("[::]:{p}"))).collect();
            let streams = vec![bind_tcp(&format!("[::]:{STREAM_PORT}"))];
            let dns = UdpSocket::bind((DNS, 53)).expect("bind the test DNS server");
            (http, streams, dns)
        });
        for l in http {
            serve(l, stop.clone(), answer_http);
        }
        for l in streams {
            serve(l, stop.clone(), stream_lines);
        }
        let dns_stop = stop.clone();
        std::thread::spawn(move || serve_dns(dns, dns_stop));
        inet
    }

    /// `host:port` of the API in the edge's namespace, for a port chosen by the test.
    pub fn api_addr(&self, port: u16) -> String {
        format!("{}:{port}", self.mgmt)
    }

    /// Starts the SOCKS5 and HTTP proxies (microsocks, tinyproxy) and waits until both
    /// listen. They resolve names with the test DNS server (`ip netns exec` binds
    /// `/etc/netns/<ns>/resolv.conf` over theirs).
    pub fn start_proxies(&self) {
        let etc = format!("/etc/netns/{}", self.net_ns);
        std::fs::create_dir_all(&etc).expect("create /etc/netns/<ns>");
        std::fs::write(format!("{etc}/resolv.conf"), format!("nameserver {DNS}\n")).unwrap();
        let mut hosts = String::from("127.0.0.1 localhost\n");
        for (name, addr) in OFFLINE_HOSTS {
            hosts.push_str(&format!("{addr} {name}\n"));
        }
        std::fs::write(format!("{etc}/hosts"), hosts).unwrap();
        let conf = format!("{etc}/tinyproxy.conf");
        std::fs::write(
            &conf,
            format!(
                "Port {HTTP_PROXY_PORT}\nListen {HTTP_PROXY}\nBind {HTTP_PROXY}\nTimeout 60\nMaxClients 64\n\
                 LogLevel Error\nConnectPort 80\nConnectPort 8080\nConnectPort {STREAM_PORT}\nConnectPort {SOCKS_PORT}\n\
                 BasicAuth {PROXY_USER} {PROXY_PASSWORD}\n"
            ),
        )
        .unwrap();
        let run = |args: &[&str]| {
            Command::new("ip")
                .args(["netns", "exec", &self.net_ns])
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("start {} in the test internet: {e}", args[0]))
        };
        let socks = SOCKS_PROXY.to_string();
        let socks_port = SOCKS_PORT.to_string();
        let mut children = self.proxies.lock().unwrap();
        children.push(run(&[
            "microsocks",
            "-i",
            &socks,
            "-p",
            &socks_port,
            "-b",
            &socks,
            "-u",
            PROXY_USER,
            "-P",
            PROXY_PASSWORD,
        ]));
        children.push(run(&["tinyproxy", "-d", "-c", &conf]));
        // TLS in front of the SOCKS5 proxy: a certificate for proxy.test and its address
        // from a CA of the test's own (a CA's certificate is no server's: webpki refuses it).
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl").args(args).output().expect("run openssl");
            assert!(
                out.status.success(),
                "openssl {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        let key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
        let f = |name: &str| format!("{etc}/{name}");
        openssl(
            &[
                &["req", "-x509", "-days", "1", "-subj", "/CN=odsec test CA"][..],
                &key[..],
                &["-keyout", &f("ca.key"), "-out", &f("ca.crt")][..],
            ]
            .concat(),
        );
        openssl(
            &[
                &["req", "-subj", &format!("/CN={TLS_PROXY_NAME}")][..],
                &key[..],
                &["-keyout", &f("proxy.key"), "-out", &f("proxy.csr")][..],
            ]
            .concat(),
        );
        std::fs::write(
            f("proxy.ext"),
            format!("subjectAltName=DNS:{TLS_PROXY_NAME},IP:{TLS_PROXY}\nbasicConstraints=CA:FALSE\n"),
        )
        .unwrap();
        openssl(&[
            "x509",
            "-req",
            "-days",
            "1",
            "-in",
            &f("proxy.csr"),
            "-CA",
            &f("ca.crt"),
            "-CAkey",
            &f("ca.key"),
            "-CAcreateserial",
            "-extfile",
            &f("proxy.ext"),
            "-out",
            &f("proxy.crt"),
        ]);
        let pem = f("proxy.pem");
        let both = std::fs::read_to_string(format!("{etc}/proxy.crt")).unwrap()
            + &std::fs::read_to_string(format!("{etc}/proxy.key")).unwrap();
        std::fs::write(&pem, both).unwrap();
        let stunnel = format!("{etc}/stunnel.conf");
        std::fs::write(
            &stunnel,
            format!(
                "foreground = yes\npid =\n[socks]\naccept = {TLS_PROXY}:{TLS_PROXY_PORT}\n\
                 connect = {SOCKS_PROXY}:{SOCKS_PORT}\ncert = {pem}\n"
            ),
        )
        .unwrap();
        children.push(run(&["stunnel4", &stunnel]));
        let net_ns = self.net_ns.clone();
        in_netns(&net_ns, || {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            for addr in [
                SocketAddr::new(IpAddr::V4(SOCKS_PROXY), SOCKS_PORT),
                SocketAddr::new(IpAddr::V4(HTTP_PROXY), HTTP_PROXY_PORT),
                SocketAddr::new(IpAddr::V4(TLS_PROXY), TLS_PROXY_PORT),
            ] {
                while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the proxy at {addr} did not start"
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        });
    }

    /// The CA certificate of the TLS proxy's certificate, PEM.
    pub fn proxy_ca(&self) -> String {
        std::fs::read_to_string(format!("/etc/netns/{}/ca.crt", self.net_ns)).expect("the TLS proxy's CA certificate")
    }

    /// Runs `ip args` in the internet's namespace (a test may take a server away).
    pub fn ip_in_net(&self, args: &[&str]) {
        let mut all = vec!["-n", self.net_ns.as_str()];
        all.extend_from_slice(args);
        ip(&all);
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for mut c in self.proxies.lock().unwrap().drain(..) {
            let _ = c.kill();
            let _ = c.wait();
        }
        // tinyproxy runs on as its own user after forking off `ip netns exec`.
        let _ = Command::new("pkill")
            .args(["-f", &format!("/etc/netns/{}/tinyproxy.conf", self.net_ns)])
            .output();
        let _ = std::fs::remove_dir_all(format!("/etc/netns/{}", self.net_ns));
        for ns in [&self.edge_ns, &self.net_ns] {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
        }
    }
}

fn bind_tcp(addr: &str) -> TcpListener {
    let l = TcpListener::bind(addr).unwrap_or_else(|e| panic!("bind {addr} in the test internet: {e}"));
    l.set_nonblocking(true).unwrap();
    l
}

/// Accepts on `l` until `stop`, each connection on a thread of its own.
fn serve(l: TcpListener, stop: Arc<AtomicBool>, handle: fn(std::net::TcpStream, SocketAddr, Arc<AtomicBool>)) {
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            match l.accept() {
                Ok((s, _)) => {
                    let local = s.local_addr().unwrap();
                    let stop = stop.clone();
                    let _ = s.set_nonblocking(false);
                    std::thread::spawn(move || handle(s, local, stop));
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
    });
}

/// One HTTP/1.1 answer naming who answered (`<addr> <port>`), then close.
fn answer_http(mut s: std::net::TcpStream, local: SocketAddr, _stop: Arc<AtomicBool>) {
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let mut buf = [0u8; 4096];
    let mut got = Vec::new();
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut buf) {
            Ok(0) | Err(_) => return,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let ip = match local.ip() {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    };
    let peer = match s.peer_addr().map(|a| a.ip()) {
        Ok(IpAddr::V6(v6)) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(IpAddr::V6(v6)),
        Ok(v4) => v4,
        Err(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    let body = format!("hello from {ip} {} for {peer}\n", local.port());
    let _ = write!(
        s,
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
}

/// A line every 50 ms until the peer goes (or the test internet stops).
fn stream_lines(mut s: std::net::TcpStream, _local: SocketAddr, stop: Arc<AtomicBool>) {
    let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        if writeln!(s, "tick {n}").is_err() {
            return;
        }
        n += 1;
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The addresses of `name` of family `ty` (`None`: no such name).
pub fn lookup(name: &str, ty: RecordType) -> Option<Vec<IpAddr>> {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    let (_, addrs) = HOSTS.iter().find(|(n, _)| *n == name)?;
    Some(
        addrs
            .iter()
            .copied()
            .filter(|a| {
                matches!(
                    (a, ty),
                    (IpAddr::V4(_), RecordType::A) | (IpAddr::V6(_), RecordType::AAAA)
                )
            })
            .collect(),
    )
}

fn serve_dns(sock: UdpSocket, stop: Arc<AtomicBool>) {
    sock.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let mut buf = [0u8; 1500];
    while !stop.load(Ordering::Relaxed) {
        let Ok((n, peer)) = sock.recv_from(&mut buf) else {
            continue;
        };
        let Ok(q) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        let Some(query) = q.queries.first().cloned() else {
            continue;
        };
        let mut m = Message::new(q.metadata.id, MessageType::Response, OpCode::Query);
        m.metadata.authoritative = true;
        m.metadata.recursion_desired = q.metadata.recursion_desired;
        m.queries = q.queries.clone();
        let name = query.name.to_ascii();
        match lookup(&name, query.query_type) {
            // A site's resolver that knows no public names: it refuses them.
            None if name.trim_end_matches('.').ends_with(OFFLINE_ZONE) => {
                m.metadata.response_code = ResponseCode::Refused
            }
            None => m.metadata.response_code = ResponseCode::NXDomain,
            Some(addrs) => {
                for a in addrs {
                    let data = match a {
                        IpAddr::V4(v) => RData::A(A(v)),
                        IpAddr::V6(v) => RData::AAAA(AAAA(v)),
                    };
                    m.add_answer(Record::from_rdata(query.name.clone(), 60, data));
                }
            }
        }
        if let Ok(bytes) = m.to_vec() {
            let _ = sock.send_to(&bytes, peer);
        }
    }
}
