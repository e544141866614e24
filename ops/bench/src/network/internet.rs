//! The benchmark's own internet, in network namespaces of its own (as the spec tests'
//! `server/tests/support/internet.rs`): no packet of it leaves them.
//!
//! - `odb-<id>-edge`, where `opendsec up` runs: `mgmt0` toward the bench's namespace
//!   (a /30 of 10.203/16: the API, peer port and edge proxy listen on [`Internet::mgmt`]),
//!   `up0` its default route to the internet, and `rawh0`, the raw path's veth.
//! - `odb-<id>-net`, the internet: public-looking addresses on its loopback, served from
//!   threads of the bench (bound there) and one iperf3 process:
//!   [`TARGET`]`:`[`CONNECT_PORT`] accepts and drops connections (the policy probe's
//!   connects), [`TARGET`]`:`[`ECHO_PORT`] echoes (the probe's open connection),
//!   [`DNS`]`:53` is the authoritative server of `*.test` (`super::dns`), and
//!   [`IPERF`]`:`[`IPERF_PORT`] is `iperf3 -s`.
//! - `odb-<id>-raw`, the raw path: a plain namespace whose `eth0` is the other end of
//!   `rawh0`, routed through the edge's namespace and masqueraded there onto `up0` by a
//!   table of the bench's (`ip odbench_raw`), as the edge does for its sandboxes, but
//!   without OpenDsec's table in its way.
//!
//! Drop (or [`emergency_teardown`] from a signal handler) stops the servers, kills
//! iperf3 and deletes the three namespaces (every link and table in them goes too).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::netns::{ip, ip_in, path, run_in};

/// `pkgs.test`: the policy probe's target.
pub const TARGET: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 10);
/// Accepts connections and drops them at once.
pub const CONNECT_PORT: u16 = 80;
/// Echoes what it is sent.
pub const ECHO_PORT: u16 = 7000;
/// `iperf.test`: the iperf3 server.
pub const IPERF: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 30);
pub const IPERF_PORT: u16 = 5201;
/// The authoritative DNS server of `*.test` (`opendsec up --upstream-dns`).
pub const DNS: Ipv4Addr = Ipv4Addr::new(11, 0, 0, 53);
/// The raw path's link: the edge's end and the raw namespace's.
const RAW_GW: Ipv4Addr = Ipv4Addr::new(10, 232, 0, 1);
const RAW_ADDR: Ipv4Addr = Ipv4Addr::new(10, 232, 0, 2);
/// The bench's masquerading table in the edge's namespace.
const RAW_TABLE: &str = "odbench_raw";

pub struct Internet {
    pub edge_ns: String,
    pub net_ns: String,
    pub raw_ns: String,
    /// The edge namespace's address on the management link.
    pub mgmt: Ipv4Addr,
    stop: Arc<AtomicBool>,
    /// `iperf3 -s`'s pid, and the thread that started it and waits for it.
    iperf: Option<(i32, std::thread::JoinHandle<()>)>,
}

/// What [`teardown`] removes; also kept in a static for a signal handler.
#[derive(Clone)]
struct Made {
    namespaces: Vec<String>,
    iperf_pid: Option<i32>,
}

static LIVE: Mutex<Option<Made>> = Mutex::new(None);

fn teardown(m: &Made) {
    if let Some(pid) = m.iperf_pid {
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    for ns in &m.namespaces {
        let _ = ip(&["netns", "delete", ns]);
    }
}

/// For a signal handler: removes the live internet, if any (after `opendsec up` went).
pub fn emergency_teardown() {
    let m = LIVE.lock().ok().and_then(|mut g| g.take());
    if let Some(m) = m {
        eprintln!("interrupted: removing the benchmark's network namespaces");
        teardown(&m);
    }
}

impl Internet {
    /// Builds the three namespaces, their links and routes, and starts the servers.
    pub fn start() -> Result<Internet, String> {
        let id = std::process::id() & 0xffff;
        let mut inet = Internet {
            edge_ns: format!("odb-{id:x}-edge"),
            net_ns: format!("odb-{id:x}-net"),
            raw_ns: format!("odb-{id:x}-raw"),
            mgmt: Ipv4Addr::UNSPECIFIED,
            stop: Arc::new(AtomicBool::new(false)),
            iperf: None,
        };
        inet.publish();
        let k = (id % 16384) * 4;
        let (hi, lo) = ((k >> 8) as u8, (k & 0xff) as u8);
        let host_side = Ipv4Addr::new(10, 203, hi, lo + 1);
        inet.mgmt = Ipv4Addr::new(10, 203, hi, lo + 2);
        let host_if = format!("odbm{id:x}");
        let (edge, net, raw) = (inet.edge_ns.clone(), inet.net_ns.clone(), inet.raw_ns.clone());
        for ns in [&edge, &net, &raw] {
            let _ = ip(&["netns", "delete", ns]);
            ip(&["netns", "add", ns])?;
            ip_in(ns, &["link", "set", "lo", "up"])?;
        }
        // The management link: the bench's namespace <-> the edge's (deleted with it).
        let _ = ip(&["link", "delete", &host_if]);
        ip(&[
            "link", "add", &host_if, "type", "veth", "peer", "name", "mgmt0", "netns", &edge,
        ])?;
        ip(&["addr", "add", &format!("{host_side}/30"), "dev", &host_if])?;
        ip(&["link", "set", &host_if, "up"])?;
        ip_in(&edge, &["addr", "add", &format!("{}/30", inet.mgmt), "dev", "mgmt0"])?;
        ip_in(&edge, &["link", "set", "mgmt0", "up"])?;
        // The uplink: the edge's default route, to the internet.
        ip_in(
            &edge,
            &[
                "link", "add", "up0", "type", "veth", "peer", "name", "down0", "netns", &net,
            ],
        )?;
        ip_in(&edge, &["addr", "add", "10.200.0.2/24", "dev", "up0"])?;
        ip_in(&edge, &["link", "set", "up0", "up"])?;
        ip_in(&edge, &["route", "add", "default", "via", "10.200.0.1"])?;
        ip_in(&net, &["addr", "add", "10.200.0.1/24", "dev", "down0"])?;
        ip_in(&net, &["link", "set", "down0", "up"])?;
        for a in [TARGET, IPERF, DNS] {
            ip_in(&net, &["addr", "add", &format!("{a}/32"), "dev", "lo"])?;
        }
        // The raw path: a plain namespace behind the edge's, masqueraded onto up0.
        ip_in(
            &edge,
            &[
                "link", "add", "rawh0", "type", "veth", "peer", "name", "eth0", "netns", &raw,
            ],
        )?;
        ip_in(&edge, &["addr", "add", &format!("{RAW_GW}/30"), "dev", "rawh0"])?;
        ip_in(&edge, &["link", "set", "rawh0", "up"])?;
        ip_in(&raw, &["addr", "add", &format!("{RAW_ADDR}/30"), "dev", "eth0"])?;
        ip_in(&raw, &["link", "set", "eth0", "up"])?;
        ip_in(&raw, &["route", "add", "default", "via", &RAW_GW.to_string()])?;
        run_in(&edge, || {
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(|e| format!("ip_forward: {e}"))
        })??;
        nft_in(
            &edge,
            &format!(
                "table ip {RAW_TABLE} {{\n  chain postrouting {{\n    type nat hook postrouting priority srcnat; policy accept;\n    \
                 ip saddr {RAW_ADDR}/32 oifname \"up0\" masquerade\n  }}\n}}\n"
            ),
        )?;
        inet.start_servers()?;
        Ok(inet)
    }

    /// Records what exists so far for [`emergency_teardown`].
    fn publish(&self) {
        if let Ok(mut g) = LIVE.lock() {
            *g = Some(self.made());
        }
    }

    fn made(&self) -> Made {
        Made {
            namespaces: vec![self.edge_ns.clone(), self.net_ns.clone(), self.raw_ns.clone()],
            iperf_pid: self.iperf.as_ref().map(|(pid, _)| *pid),
        }
    }

    fn start_servers(&mut self) -> Result<(), String> {
        let (connect, echo, dns) = run_in(&self.net_ns, || -> Result<_, String> {
            let bind = |port: u16| {
                let l = TcpListener::bind(SocketAddrV4::new(TARGET, port))
                    .map_err(|e| format!("bind {TARGET}:{port}: {e}"))?;
                l.set_nonblocking(true).map_err(|e| e.to_string())?;
                Ok::<_, String>(l)
            };
            let dns = UdpSocket::bind(SocketAddrV4::new(DNS, 53)).map_err(|e| format!("bind {DNS}:53: {e}"))?;
            Ok((bind(CONNECT_PORT)?, bind(ECHO_PORT)?, dns))
        })??;
        let stop = self.stop.clone();
        std::thread::spawn(move || accept_and_drop(connect, stop));
        let stop = self.stop.clone();
        std::thread::spawn(move || serve_echo(echo, stop));
        let stop = self.stop.clone();
        std::thread::spawn(move || super::dns::serve(dns, stop));
        // iperf3: nsenter joins the internet's namespace and execs it. Started from a
        // thread of its own that waits for it: PR_SET_PDEATHSIG follows the thread that
        // spawned the child (a blocking-pool thread would end and take iperf3 along).
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={}", path(&self.net_ns)))
            .args([
                "--",
                "iperf3",
                "-s",
                "-B",
                &IPERF.to_string(),
                "-p",
                &IPERF_PORT.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || match cmd.spawn() {
            Ok(mut child) => {
                let _ = tx.send(Ok(child.id() as i32));
                let _ = child.wait();
            }
            Err(e) => {
                let _ = tx.send(Err(format!("start iperf3 -s: {e}")));
            }
        });
        let pid = rx.recv().map_err(|e| format!("start iperf3 -s: {e}"))??;
        self.iperf = Some((pid, waiter));
        self.publish();
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.iperf_listens() {
            if self.iperf.as_ref().is_some_and(|(_, w)| w.is_finished()) {
                return Err("iperf3 -s exited".into());
            }
            if Instant::now() > deadline {
                return Err("iperf3 -s does not listen after 10 s".into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Whether iperf3 listens (asked of `ss`: a probe connection would be taken for a test).
    fn iperf_listens(&self) -> bool {
        Command::new("ip")
            .args(["netns", "exec", &self.net_ns, "ss", "-Hltn"])
            .arg(format!("sport = :{IPERF_PORT}"))
            .output()
            .is_ok_and(|o| !o.stdout.is_empty())
    }
}

impl Drop for Internet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let made = self.made();
        teardown(&made);
        if let Some((_, waiter)) = self.iperf.take() {
            let _ = waiter.join();
        }
        if let Ok(mut g) = LIVE.lock() {
            *g = None;
        }
    }
}

/// `nft -f -` with `script`, inside namespace `ns`.
fn nft_in(ns: &str, script: &str) -> Result<(), String> {
    let mut child = Command::new("nsenter")
        .arg(format!("--net={}", path(ns)))
        .args(["--", "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("run nft: {e}"))?;
    child
        .stdin
        .take()
        .expect("piped stdin")
        .write_all(script.as_bytes())
        .map_err(|e| format!("nft: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("nft: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("nft in {ns}: {}", String::from_utf8_lossy(&out.stderr).trim()))
    }
}

/// Accepts every connection and drops it at once, until `stop`. Never a thread per
/// connection: the probe opens about a thousand a second.
fn accept_and_drop(l: TcpListener, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match l.accept() {
            Ok((s, _)) => drop(s),
            Err(_) => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

/// Echoes each connection's bytes back (a thread each) until the peer goes, 30 s of
/// silence, or `stop`.
fn serve_echo(l: TcpListener, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::Relaxed) {
        match l.accept() {
            Ok((mut s, _)) => {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let _ = s.set_nonblocking(false);
                    let _ = s.set_nodelay(true);
                    let _ = s.set_read_timeout(Some(Duration::from_secs(30)));
                    let mut buf = [0u8; 4096];
                    while !stop.load(Ordering::Relaxed) {
                        match s.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => {
                                if s.write_all(&buf[..n]).is_err() {
                                    return;
                                }
                            }
                        }
                    }
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// A TCP connection from the current thread's namespace, for probes.
pub(super) fn connect(addr: SocketAddrV4, within: Duration) -> Result<TcpStream, String> {
    TcpStream::connect_timeout(&addr.into(), within).map_err(|e| format!("connect {addr}: {e}"))
}
