//! A sandbox's policy as nftables rules, pure: [`Policy`] -> the lines of its chain
//! ([`chain_lines`], a small closed form that [`evaluate`] can run without a kernel) ->
//! the text `nft -f` takes ([`sandbox_script`], [`base_script`], [`remove_script`]).
//!
//! The meaning is `Policy::allows_addr` (tested against it below), in this order: the
//! allow rules accept (a CIDR rule inline, a domain rule by the addresses the DNS proxy
//! put in its set), then the deny rules drop (address blocks: a domain deny works at
//! resolution, `Policy::allows_name`), then DNS and DNS-over-TLS (53, 853) to anything
//! but the edge's proxy are dropped unless an allow rule named them, then, with
//! `allow_internet`, everything outside special space is accepted; the rest is dropped
//! and counted. Every accept marks the connection with the policy's generation, and only
//! connections of the current generation skip the rules, so a new policy judges every
//! packet of older connections once more, and cuts those it forbids.

use super::link::SANDBOX_IF;
use opendsec_commands::network::{Policy, Protocol, Rule, Target, contains, is_special};
use std::collections::BTreeSet;
use std::fmt::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

mod script;
pub use script::*;

/// The special (non-public) IPv4 blocks: exactly the addresses `is_special` names.
pub const SPECIAL_V4: &[(Ipv4Addr, u8)] = &[
    (Ipv4Addr::new(0, 0, 0, 0), 8),
    (Ipv4Addr::new(10, 0, 0, 0), 8),
    (Ipv4Addr::new(100, 64, 0, 0), 10),
    (Ipv4Addr::new(127, 0, 0, 0), 8),
    (Ipv4Addr::new(169, 254, 0, 0), 16),
    (Ipv4Addr::new(172, 16, 0, 0), 12),
    (Ipv4Addr::new(192, 0, 0, 0), 24),
    (Ipv4Addr::new(192, 0, 2, 0), 24),
    (Ipv4Addr::new(192, 168, 0, 0), 16),
    (Ipv4Addr::new(198, 18, 0, 0), 15),
    (Ipv4Addr::new(198, 51, 100, 0), 24),
    (Ipv4Addr::new(203, 0, 113, 0), 24),
    (Ipv4Addr::new(224, 0, 0, 0), 4),
    (Ipv4Addr::new(240, 0, 0, 0), 4),
];

/// The special IPv6 blocks (IPv4-mapped forms of [`SPECIAL_V4`] come beside them).
pub const SPECIAL_V6: &[(Ipv6Addr, u8)] = &[
    (Ipv6Addr::UNSPECIFIED, 128),
    (Ipv6Addr::LOCALHOST, 128),
    (Ipv6Addr::new(0x64, 0, 0, 0, 0, 0, 0, 0), 16),
    (Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 0), 32),
    (Ipv6Addr::new(0xfc00, 0, 0, 0, 0, 0, 0, 0), 7),
    (Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0), 10),
    (Ipv6Addr::new(0xfec0, 0, 0, 0, 0, 0, 0, 0), 10),
    (Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0), 8),
];

/// Ports that carry DNS (53) and DNS over TLS (853): only the edge's proxy answers them,
/// unless an allow rule names a resolver.
pub const DNS_PORTS: [u16; 2] = [53, 853];

/// Every special IPv6 block, with the IPv4-mapped forms of the IPv4 ones.
pub fn special_v6() -> Vec<(Ipv6Addr, u8)> {
    let mut all = SPECIAL_V6.to_vec();
    all.extend(SPECIAL_V4.iter().map(|(a, p)| (a.to_ipv6_mapped(), 96 + p)));
    all
}

/// Where a line sends a packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Accepted, and the connection marked with the policy's generation.
    Accept,
    Drop,
}

/// The destinations a line matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dest {
    /// A block; `public_only`: its special addresses excepted (a block that does not lie
    /// inside special space never opens it).
    Block { net: IpAddr, prefix: u8, public_only: bool },
    /// The addresses the DNS proxy learned for a domain target, in set `set` (`_4`/`_6`).
    Learned { set: String },
    /// Every address outside special space (the public internet).
    Public,
}

/// The transports and ports a line matches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ports {
    pub protocol: Protocol,
    /// Merged, sorted ranges; empty: every port (and, with `Any`, every transport).
    pub ranges: Vec<(u16, u16)>,
}

impl Ports {
    fn of(rule: &Rule) -> Ports {
        Ports {
            protocol: rule.protocol,
            ranges: merge(&rule.ports),
        }
    }

    fn covers(&self, port: u16, proto: Protocol) -> bool {
        let proto_ok = self.protocol == Protocol::Any || self.protocol == proto;
        let port_ok = self.ranges.is_empty() || self.ranges.iter().any(|(lo, hi)| (*lo..=*hi).contains(&port));
        proto_ok && port_ok
    }
}

/// One line of a sandbox's chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    pub dest: Dest,
    pub ports: Ports,
    pub verdict: Verdict,
}

/// Sorted, overlapping and touching ranges merged (nft refuses overlapping intervals).
fn merge(ports: &[(u16, u16)]) -> Vec<(u16, u16)> {
    let mut sorted = ports.to_vec();
    sorted.sort();
    let mut out: Vec<(u16, u16)> = Vec::new();
    for (lo, hi) in sorted {
        match out.last_mut() {
            Some((_, last_hi)) if lo as u32 <= *last_hi as u32 + 1 => *last_hi = (*last_hi).max(hi),
            _ => out.push((lo, hi)),
        }
    }
    out
}

/// The name of the set of addresses learned for a domain target, per family: `d<slot>_`
/// and a hash of the target, so it survives a policy update that keeps the target.
pub fn learned_set(slot: u32, name: &str, wildcard: bool, v6: bool) -> String {
    // FNV-1a: stable across builds and machines, which a std hasher is not.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in [wildcard as u8].iter().chain(name.as_bytes()) {
        h ^= *b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    format!("d{slot}_{:012x}_{}", h & 0xffff_ffff_ffff, if v6 { 6 } else { 4 })
}

/// The learned sets `policy` uses in slot `slot`'s chain (both families of each distinct
/// domain target of an allow rule).
pub fn learned_sets(slot: u32, policy: &Policy) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for r in &policy.allow_out {
        if let Target::Domain { name, wildcard } = &r.target {
            out.insert(learned_set(slot, name, *wildcard, false));
            out.insert(learned_set(slot, name, *wildcard, true));
        }
    }
    out
}

/// The lines of slot `slot`'s chain for `policy`, in order (see the module doc).
pub fn chain_lines(slot: u32, policy: &Policy) -> Vec<Line> {
    let mut lines = Vec::new();
    for r in &policy.allow_out {
        let ports = Ports::of(r);
        match &r.target {
            Target::Cidr { addr, prefix } => lines.push(Line {
                dest: Dest::Block {
                    net: *addr,
                    prefix: *prefix,
                    public_only: !(is_special(*addr) && *prefix >= 8),
                },
                ports,
                verdict: Verdict::Accept,
            }),
            Target::Domain { name, wildcard } => {
                for v6 in [false, true] {
                    lines.push(Line {
                        dest: Dest::Learned {
                            set: learned_set(slot, name, *wildcard, v6),
                        },
                        ports: ports.clone(),
                        verdict: Verdict::Accept,
                    })
                }
            }
        }
    }
    for r in &policy.deny_out {
        if let Target::Cidr { addr, prefix } = &r.target {
            lines.push(Line {
                dest: Dest::Block {
                    net: *addr,
                    prefix: *prefix,
                    public_only: !(is_special(*addr) && *prefix >= 8),
                },
                ports: Ports::of(r),
                verdict: Verdict::Drop,
            });
        }
    }
    if policy.allow_internet {
        lines.push(Line {
            dest: Dest::Public,
            ports: Ports {
                protocol: Protocol::Any,
                ranges: DNS_PORTS.iter().map(|p| (*p, *p)).collect(),
            },
            verdict: Verdict::Drop,
        });
        lines.push(Line {
            dest: Dest::Public,
            ports: Ports {
                protocol: Protocol::Any,
                ranges: vec![],
            },
            verdict: Verdict::Accept,
        });
    }
    lines
}

/// What `lines` do with a new connection to `ip:port` over `proto`, given the learned
/// sets that hold `ip` (`learned`): the chain's meaning, run without a kernel.
pub fn evaluate(lines: &[Line], ip: IpAddr, port: u16, proto: Protocol, learned: &BTreeSet<String>) -> Verdict {
    for l in lines {
        let dest = match &l.dest {
            Dest::Block {
                net,
                prefix,
                public_only,
            } => contains(*net, *prefix, ip) && !(*public_only && is_special(ip)),
            Dest::Learned { set } => learned.contains(set) && set.ends_with(if ip.is_ipv6() { "_6" } else { "_4" }),
            Dest::Public => !is_special(ip),
        };
        if dest && l.ports.covers(port, proto) {
            return l.verdict;
        }
    }
    Verdict::Drop
}

/// Whether a rule's domain matches `name` (as `Policy::allows_name` matches it).
pub fn domain_matches(name: &str, wildcard: bool, asked: &str) -> bool {
    let asked = asked.strip_suffix('.').unwrap_or(asked).to_ascii_lowercase();
    if wildcard {
        asked.strip_suffix(name).is_some_and(|h| h.ends_with('.'))
    } else {
        asked == name
    }
}

/// The learned sets of slot `slot` that an answer for `asked` goes into.
pub fn sets_for_name(slot: u32, policy: &Policy, asked: &str) -> Vec<String> {
    let mut out = BTreeSet::new();
    for r in &policy.allow_out {
        if let Target::Domain { name, wildcard } = &r.target
            && domain_matches(name, *wildcard, asked)
        {
            out.insert(learned_set(slot, name, *wildcard, false));
            out.insert(learned_set(slot, name, *wildcard, true));
        }
    }
    out.into_iter().collect()
}

/// Whether an answer's address may reach the sandbox: a public one always (the name was
/// allowed), a special one (DNS rebinding: a public name pointing inside) only when an
/// allow rule's block opens it.
pub fn answer_allowed(policy: &Policy, ip: IpAddr) -> bool {
    !is_special(ip)
        || policy.allow_out.iter().any(|r| match r.target {
            Target::Cidr { addr, prefix } => contains(addr, prefix, ip) && is_special(addr) && prefix >= 8,
            Target::Domain { .. } => false,
        })
}

#[cfg(test)]
mod standin_tests;
#[cfg(test)]
mod tests;
