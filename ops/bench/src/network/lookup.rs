//! DNS proxy answer latency beside a direct query: UDP A queries (`super::dns::query_a`,
//! a fresh socket each, timed from the send to the answer) sent from the sandbox's
//! namespace to the edge's proxy on the gateway, port 53, under the policy
//! `{"allow_out": ["*.dns.test"]}`, beside the same query sent from the edge's
//! namespace straight to the internet's DNS server (the proxy's upstream).
//!
//! The proxy asks the upstream every time (it keeps no cache) and, before it answers,
//! adds the answer's addresses to the sandbox's learned set in one nftables transaction
//! (in-process, through libnftables); the
//! first answer for a name adds an address the set does not hold, a repeated one only
//! refreshes its timeout. So each round asks four things, interleaved: a name never
//! asked before (`n<k>.dns.test`, an address of its own) through the proxy, the same
//! name directly, one name asked every round (`again.dns.test`) through the proxy, and
//! a name the policy does not allow (`pkgs.test`), which the proxy refuses without
//! asking anyone or touching nftables: its own share of the answer time. One warm-up round is
//! not counted; every answer must carry the zone's address (the refusal: REFUSED).

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use hickory_proto::op::ResponseCode;
use serde_json::json;

use super::dns::{Answer, DNS_ZONE, address_of, query_a};
use super::internet::DNS;
use super::netns::run_in_async;
use super::sandbox::Probe;
use crate::sandboxes::UpGuard;

/// A name of the zone the DNS policy does not allow.
const REFUSED_NAME: &str = "pkgs.test";

/// How long one query may wait for its answer.
const WITHIN: Duration = Duration::from_secs(3);

#[derive(Default)]
pub(super) struct Lookups {
    /// Through the proxy, a name's first answer.
    pub(super) first: Vec<Duration>,
    /// Through the proxy, a name asked every round.
    pub(super) repeated: Vec<Duration>,
    /// From the edge's namespace to the upstream, the first-answer names.
    pub(super) direct: Vec<Duration>,
    /// Through the proxy, a name the policy refuses.
    pub(super) refused: Vec<Duration>,
    pub(super) errors: Vec<String>,
}

/// The policy the queries run under.
pub(super) fn policy() -> serde_json::Value {
    json!({"allow_out": [format!("*.{DNS_ZONE}")]})
}

/// One query from namespace `ns`, checked: it must answer `name`'s address in the zone.
async fn ask(ns: &str, server: SocketAddr, name: String) -> Result<Duration, String> {
    let n = name.clone();
    let a: Answer = run_in_async(ns, move || query_a(server, &n, WITHIN)).await??;
    let want = address_of(&name);
    if name == REFUSED_NAME {
        return match a.code {
            ResponseCode::Refused => Ok(a.took),
            code => Err(format!("{name} via {server}: {code:?}, expected REFUSED")),
        };
    }
    if a.addresses.len() != 1 || want != a.addresses.first().copied() {
        return Err(format!(
            "{name} via {server}: {:?} {:?}, expected {want:?}",
            a.code, a.addresses
        ));
    }
    Ok(a.took)
}

/// Sets the DNS policy, waits until the proxy answers under it, then `runs` rounds
/// (after one warm-up).
pub(super) async fn measure(up: &UpGuard, probe: &Probe, edge_ns: &str, runs: usize) -> Lookups {
    let mut l = Lookups::default();
    if let Err(e) = probe.set_policy(up, &policy()).await {
        l.errors.push(e);
        return l;
    }
    let again = format!("again.{DNS_ZONE}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(e) = ask(&probe.netns, probe.proxy, again.clone()).await {
        if Instant::now() > deadline {
            l.errors
                .push(format!("the proxy did not answer under the new policy: {e}"));
            return l;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let direct = SocketAddr::new(DNS.into(), 53);
    for k in 0..=runs {
        let fresh = format!("n{k}.{DNS_ZONE}");
        let round = async {
            let first = ask(&probe.netns, probe.proxy, fresh.clone()).await?;
            let d = ask(edge_ns, direct, fresh.clone()).await?;
            let repeated = ask(&probe.netns, probe.proxy, again.clone()).await?;
            let refused = ask(&probe.netns, probe.proxy, REFUSED_NAME.to_string()).await?;
            Ok::<_, String>((first, d, repeated, refused))
        };
        match round.await {
            Ok(_) if k == 0 => {}
            Ok((first, d, repeated, refused)) => {
                l.first.push(first);
                l.direct.push(d);
                l.repeated.push(repeated);
                l.refused.push(refused);
            }
            Err(e) => {
                l.errors.push(format!("round {k}: {e}"));
                if l.errors.len() > 5 {
                    break;
                }
            }
        }
    }
    l.first.sort_unstable();
    l.repeated.sort_unstable();
    l.direct.sort_unstable();
    l.refused.sort_unstable();
    l
}
