//! DNS, both ends, with `hickory-proto` (the version the edge's proxy uses):
//!
//! - [`serve`]: the internet's authoritative server of `*.test` (the edge's upstream):
//!   `pkgs.test` is [`TARGET`], `iperf.test` is [`IPERF`], and every name under
//!   [`DNS_ZONE`] has an A record of its own in 11.1.0.0/16 (`n<k>.dns.test` is the
//!   k-th address, any other name a hash), so each new name asked through the proxy
//!   brings the sandbox's learned set an address it does not hold yet. AAAA questions
//!   get an empty answer, unknown names NXDOMAIN.
//! - [`query_a`]: one UDP A query from the calling thread's namespace, timed from just
//!   before the send to the answer's arrival.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, Query, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{Name, RData, Record, RecordType};

use super::internet::{IPERF, TARGET};

/// The zone whose names each get an address of their own.
pub const DNS_ZONE: &str = "dns.test";

/// The A record of `name` (`None`: no such name).
pub(super) fn address_of(name: &str) -> Option<Ipv4Addr> {
    let name = name.trim_end_matches('.').to_ascii_lowercase();
    match name.as_str() {
        "pkgs.test" => Some(TARGET),
        "iperf.test" => Some(IPERF),
        n => {
            let label = n.strip_suffix(&format!(".{DNS_ZONE}"))?;
            let k = match label.strip_prefix('n').and_then(|k| k.parse::<u32>().ok()) {
                Some(k) => k + 1,
                // FNV-1a: any other name, a stable address.
                None => label
                    .bytes()
                    .fold(0x811c9dc5u32, |h, b| (h ^ b as u32).wrapping_mul(0x01000193)),
            };
            Some(Ipv4Addr::new(11, 1, (k >> 8) as u8, k as u8))
        }
    }
}

/// Answers queries on `sock` until `stop` (read timeouts of 100 ms let it see `stop`).
pub(super) fn serve(sock: UdpSocket, stop: Arc<AtomicBool>) {
    let _ = sock.set_read_timeout(Some(Duration::from_millis(100)));
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
        match address_of(&query.name.to_ascii()) {
            None => m.metadata.response_code = ResponseCode::NXDomain,
            Some(a) if query.query_type == RecordType::A => {
                m.add_answer(Record::from_rdata(query.name.clone(), 60, RData::A(A(a))));
            }
            Some(_) => {}
        }
        if let Ok(bytes) = m.to_vec() {
            let _ = sock.send_to(&bytes, peer);
        }
    }
}

static NEXT_ID: AtomicU16 = AtomicU16::new(1);

/// What one query got.
pub(super) struct Answer {
    /// From just before the send to the answer's arrival.
    pub(super) took: Duration,
    pub(super) code: ResponseCode,
    pub(super) addresses: Vec<Ipv4Addr>,
}

/// One A query for `name` to `server` over UDP from the calling thread's namespace
/// (a fresh socket each time, as a stub resolver does); waits at most `within`.
pub(super) fn query_a(server: SocketAddr, name: &str, within: Duration) -> Result<Answer, String> {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let mut m = Message::new(id, MessageType::Query, OpCode::Query);
    m.metadata.recursion_desired = true;
    m.add_query(Query::query(
        Name::from_ascii(name).map_err(|e| format!("{name}: {e}"))?,
        RecordType::A,
    ));
    let bytes = m.to_vec().map_err(|e| e.to_string())?;
    let sock = UdpSocket::bind("0.0.0.0:0").map_err(|e| format!("bind: {e}"))?;
    sock.connect(server).map_err(|e| format!("connect {server}: {e}"))?;
    let mut buf = [0u8; 1500];
    let t0 = Instant::now();
    sock.send(&bytes).map_err(|e| format!("send to {server}: {e}"))?;
    loop {
        let left = within.saturating_sub(t0.elapsed());
        if left.is_zero() {
            return Err(format!("no answer from {server} for {name} within {within:?}"));
        }
        sock.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
        let n = match sock.recv(&mut buf) {
            Ok(n) => n,
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(format!("recv from {server}: {e}")),
        };
        let took = t0.elapsed();
        let Ok(r) = Message::from_vec(&buf[..n]) else {
            continue;
        };
        if r.metadata.id != id {
            continue;
        }
        return Ok(Answer {
            took,
            code: r.metadata.response_code,
            addresses: r
                .answers
                .iter()
                .filter_map(|rec| match rec.data.ip_addr() {
                    Some(std::net::IpAddr::V4(a)) => Some(a),
                    _ => None,
                })
                .collect(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_of_the_zone_has_an_address_of_its_own() {
        assert_eq!(address_of("n0.dns.test."), Some(Ipv4Addr::new(11, 1, 0, 1)));
        assert_eq!(address_of("n300.dns.test"), Some(Ipv4Addr::new(11, 1, 1, 45)));
        assert_eq!(address_of("pkgs.test"), Some(TARGET));
        assert!(address_of("again.dns.test").is_some());
        assert_eq!(address_of("other.example"), None);
    }
}
