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

/// A sandbox's place in the edge's table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SandboxPlace<'a> {
    /// The edge's table (`inet`).
    pub table: &'a str,
    /// Its slot: its chain is `sb<slot>`, its sets `d<slot>_*`, its counter `drops<slot>`.
    pub slot: u32,
    /// Its host-side veth.
    pub veth: &'a str,
    pub v4: Ipv4Addr,
    pub v6: Option<Ipv6Addr>,
    /// Where a proxy carries its TCP: the stand-in addresses its DNS answers hold now
    /// (see [`STANDINS`]), which its chain lets through to the relay; `None`: no proxy.
    pub standins: Option<&'a [Ipv4Addr]>,
}

/// Stand-in addresses: where a proxy carries a sandbox's TCP and the edge's resolvers
/// cannot answer a name it may reach (a site whose DNS knows no public names), the DNS
/// proxy answers with one of these (the benchmarking block, special space that nothing
/// else routes), and the relay asks the proxy for the name it stands for.
pub const STANDINS: (Ipv4Addr, u8) = (Ipv4Addr::new(198, 18, 0, 0), 15);

/// The set of slot `slot`'s stand-in addresses.
pub fn standin_set(slot: u32) -> String {
    format!("d{slot}_standin_4")
}

/// The chain of slot `slot`.
pub fn chain_name(slot: u32) -> String {
    format!("sb{slot}")
}

/// The counter of what slot `slot`'s policy dropped.
pub fn counter_name(slot: u32) -> String {
    format!("drops{slot}")
}

/// What every sampled drop's kernel log line starts with (see `drops.rs`).
pub const DROP_LOG_TAG: &str = "odsec-drop";
/// Sampled drops logged per sandbox and rule at most (new connections only).
pub const DROP_LOG_RATE: &str = "5/second burst 5 packets";

/// The log prefix of drops by rule `why` (`deny_out` or `default`) in slot `slot` of
/// `table`: `odsec-drop <table> sb<slot> <why>: ` (at most 127 bytes: tables are short).
pub fn drop_log_prefix(table: &str, slot: u32, why: &str) -> String {
    format!("{DROP_LOG_TAG} {table} sb{slot} {why}: ")
}

/// How a policy refuses a packet: at once, so a refused `pip` fails in milliseconds
/// ("No route to host", ICMP administratively prohibited) rather than after its
/// connect timeout. Spoofed sources are dropped silently instead (no answer to an
/// address that did not ask).
pub const REFUSE: &str = "reject with icmpx type admin-prohibited";

/// `match counter name C` + [`REFUSE`], preceded by a rule logging a sample of what it
/// refuses: the first packet of new connections, at most [`DROP_LOG_RATE`] (a `limit`
/// in the refusing rule itself would let the rest through).
fn logged_drop(matched: &str, counter: &str, prefix: &str) -> [String; 2] {
    [
        format!("{matched}ct state new limit rate {DROP_LOG_RATE} log prefix \"{prefix}\" level info"),
        format!("{matched}counter name {counter} {REFUSE}"),
    ]
}

fn ports_text(p: &Ports) -> String {
    let list = |ranges: &[(u16, u16)]| {
        let items: Vec<String> = ranges
            .iter()
            .map(|(lo, hi)| if lo == hi { lo.to_string() } else { format!("{lo}-{hi}") })
            .collect();
        format!("{{ {} }}", items.join(", "))
    };
    match (p.protocol, p.ranges.is_empty()) {
        (Protocol::Any, true) => String::new(),
        (Protocol::Tcp, true) => "meta l4proto tcp ".into(),
        (Protocol::Udp, true) => "meta l4proto udp ".into(),
        (Protocol::Any, false) => format!("meta l4proto {{ tcp, udp }} th dport {} ", list(&p.ranges)),
        (Protocol::Tcp, false) => format!("tcp dport {} ", list(&p.ranges)),
        (Protocol::Udp, false) => format!("udp dport {} ", list(&p.ranges)),
    }
}

/// The first address of the block (nft wants a block's network address).
fn network(net: IpAddr, prefix: u8) -> IpAddr {
    match net {
        IpAddr::V4(a) => {
            let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
            IpAddr::V4(Ipv4Addr::from(u32::from(a) & mask))
        }
        IpAddr::V6(a) => {
            let mask = if prefix == 0 { 0 } else { u128::MAX << (128 - prefix) };
            IpAddr::V6(Ipv6Addr::from(u128::from(a) & mask))
        }
    }
}

/// One line as nft rule text (without `add rule <table> <chain>`): one or two rules (the
/// public internet is one per family).
fn line_text(l: &Line, generation: u32) -> Vec<String> {
    let verdict = match l.verdict {
        Verdict::Accept => format!("ct mark set {generation:#x} accept"),
        Verdict::Drop => "counter drop".to_string(),
    };
    let ports = ports_text(&l.ports);
    match &l.dest {
        Dest::Block {
            net,
            prefix,
            public_only,
        } => {
            let (fam, special) = if net.is_ipv4() {
                ("ip", "@special4")
            } else {
                ("ip6", "@special6")
            };
            let except = if *public_only {
                format!("{fam} daddr != {special} ")
            } else {
                String::new()
            };
            vec![format!(
                "{fam} daddr {}/{prefix} {except}{ports}{verdict}",
                network(*net, *prefix)
            )]
        }
        Dest::Learned { set } => {
            let fam = if set.ends_with("_6") { "ip6" } else { "ip" };
            vec![format!("{fam} daddr @{set} {ports}{verdict}")]
        }
        Dest::Public => vec![
            format!("ip daddr != @special4 {ports}{verdict}"),
            format!("ip6 daddr != @special6 {ports}{verdict}"),
        ],
    }
}

fn cidr_list<A: std::fmt::Display>(blocks: impl Iterator<Item = (A, u8)>) -> String {
    blocks.map(|(a, p)| format!("{a}/{p}")).collect::<Vec<_>>().join(", ")
}

/// The edge's addresses: its pools (masqueraded on the way out), the gateway its
/// sandboxes route through (where the DNS proxy listens) and the prefix of its veths.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EdgePlace<'a> {
    pub table: &'a str,
    /// Every host-side veth of this edge's sandboxes starts with it.
    pub veth_prefix: &'a str,
    pub gateway: Ipv4Addr,
    pub pool_v4: (Ipv4Addr, u8),
    pub pool_v6: Option<(Ipv6Addr, u8)>,
    /// The ports the edge's relay to upstream proxies listens on (IPv4 on the gateway,
    /// IPv6 on every address): what a sandbox's TCP is redirected to when a proxy
    /// carries it.
    pub relay_ports: (u16, u16),
    /// Whether the edge has a proxy of its own, which carries every sandbox's TCP to
    /// public addresses (private ones go straight).
    pub edge_proxy: bool,
}

/// The name of the set of veths whose sandbox has a proxy of its own.
pub const PROXIED_SET: &str = "proxied";

/// The edge's table with its base chains (idempotent: it keeps the sandboxes' chains,
/// sets and maps, and rewrites the rest).
/// - `prerouting` (filter, before NAT): what comes from a sandbox's veth goes to its
///   chain through the map `sandboxes` (a veth not in it yet: dropped), judged by its
///   destination as the sandbox sent it, before a proxy redirect changes it; what is
///   for the host itself (the gateway, IPv6 link-local and multicast) is left to `input`.
/// - `proxy` (NAT): a sandbox's allowed TCP that a proxy carries goes to the relay.
/// - `forward`: what goes to a sandbox is accepted only as part of a connection it opened.
/// - `input`: a sandbox reaches only the DNS proxy on the gateway, the relay (as
///   redirected, never directly), and IPv6 neighbour discovery.
/// - `postrouting`: its pools are masqueraded out.
pub fn base_script(e: &EdgePlace) -> String {
    let t = format!("inet {}", e.table);
    let veths = format!("\"{}*\"", e.veth_prefix);
    let gw = e.gateway;
    let (p4, p6) = e.relay_ports;
    let mut s = String::new();
    let _ = writeln!(s, "add table {t}");
    let _ = writeln!(s, "add set {t} special4 {{ type ipv4_addr; flags interval; }}");
    let _ = writeln!(s, "flush set {t} special4");
    let _ = writeln!(
        s,
        "add element {t} special4 {{ {} }}",
        cidr_list(SPECIAL_V4.iter().copied())
    );
    let _ = writeln!(s, "add set {t} special6 {{ type ipv6_addr; flags interval; }}");
    let _ = writeln!(s, "flush set {t} special6");
    let _ = writeln!(
        s,
        "add element {t} special6 {{ {} }}",
        cidr_list(special_v6().into_iter())
    );
    let _ = writeln!(s, "add map {t} sandboxes {{ type ifname : verdict; }}");
    let _ = writeln!(s, "add set {t} {PROXIED_SET} {{ type ifname; }}");
    let _ = writeln!(
        s,
        "add chain {t} prerouting {{ type filter hook prerouting priority mangle; policy accept; }}"
    );
    let _ = writeln!(s, "flush chain {t} prerouting");
    let _ = writeln!(s, "add rule {t} prerouting iifname {veths} ip daddr {gw} accept");
    let _ = writeln!(
        s,
        "add rule {t} prerouting iifname {veths} ip6 daddr {{ fe80::/10, ff00::/8 }} accept"
    );
    let _ = writeln!(s, "add rule {t} prerouting iifname {veths} iifname vmap @sandboxes");
    let _ = writeln!(s, "add rule {t} prerouting iifname {veths} counter drop");
    let _ = writeln!(
        s,
        "add chain {t} proxy {{ type nat hook prerouting priority dstnat; policy accept; }}"
    );
    let _ = writeln!(s, "flush chain {t} proxy");
    let _ = writeln!(
        s,
        "add rule {t} proxy iifname @{PROXIED_SET} meta l4proto tcp ip daddr != {gw} redirect to :{p4}"
    );
    let _ = writeln!(
        s,
        "add rule {t} proxy iifname @{PROXIED_SET} meta l4proto tcp ip6 daddr != {{ fe80::/10, ff00::/8 }} redirect to :{p6}"
    );
    if e.edge_proxy {
        let _ = writeln!(
            s,
            "add rule {t} proxy iifname {veths} meta l4proto tcp ip daddr != @special4 redirect to :{p4}"
        );
        let (standins, len) = STANDINS;
        let _ = writeln!(
            s,
            "add rule {t} proxy iifname {veths} meta l4proto tcp ip daddr {standins}/{len} redirect to :{p4}"
        );
        let _ = writeln!(
            s,
            "add rule {t} proxy iifname {veths} meta l4proto tcp ip6 daddr != @special6 redirect to :{p6}"
        );
    }
    let _ = writeln!(
        s,
        "add chain {t} forward {{ type filter hook forward priority filter; policy accept; }}"
    );
    let _ = writeln!(s, "flush chain {t} forward");
    let _ = writeln!(
        s,
        "add rule {t} forward oifname {veths} ct state established,related accept"
    );
    let _ = writeln!(s, "add rule {t} forward oifname {veths} counter drop");
    let _ = writeln!(
        s,
        "add chain {t} input {{ type filter hook input priority filter; policy accept; }}"
    );
    let _ = writeln!(s, "flush chain {t} input");
    let _ = writeln!(
        s,
        "add rule {t} input iifname {veths} ct state established,related accept"
    );
    let _ = writeln!(
        s,
        "add rule {t} input iifname {veths} ip daddr {gw} meta l4proto {{ tcp, udp }} th dport 53 accept"
    );
    let _ = writeln!(
        s,
        "add rule {t} input iifname {veths} ct status dnat meta l4proto tcp th dport {{ {p4}, {p6} }} accept"
    );
    let _ = writeln!(
        s,
        "add rule {t} input iifname {veths} icmpv6 type {{ nd-neighbor-solicit, nd-neighbor-advert }} accept"
    );
    let _ = writeln!(s, "add rule {t} input iifname {veths} counter drop");
    let _ = writeln!(
        s,
        "add chain {t} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}"
    );
    let _ = writeln!(s, "flush chain {t} postrouting");
    let (p4, l4) = e.pool_v4;
    let _ = writeln!(
        s,
        "add rule {t} postrouting ip saddr {}/{l4} oifname != {veths} masquerade",
        network(IpAddr::V4(p4), l4)
    );
    if let Some((p6, l6)) = e.pool_v6 {
        let _ = writeln!(
            s,
            "add rule {t} postrouting ip6 saddr {}/{l6} oifname != {veths} masquerade",
            network(IpAddr::V6(p6), l6)
        );
    }
    s
}

/// Slot `p.slot`'s chain for `policy` under `generation`, replaced whole (its learned
/// sets kept, `stale_sets` removed), and its veth pointed at it: one transaction.
pub fn sandbox_script(p: &SandboxPlace, policy: &Policy, generation: u32, stale_sets: &BTreeSet<String>) -> String {
    let t = format!("inet {}", p.table);
    let chain = chain_name(p.slot);
    let counter = counter_name(p.slot);
    let mut s = String::new();
    for set in learned_sets(p.slot, policy) {
        let ty = if set.ends_with("_6") { "ipv6_addr" } else { "ipv4_addr" };
        let _ = writeln!(s, "add set {t} {set} {{ type {ty}; flags timeout; }}");
    }
    let _ = writeln!(s, "add counter {t} {counter}");
    let _ = writeln!(s, "add chain {t} {chain}");
    let _ = writeln!(s, "flush chain {t} {chain}");
    let rule = |s: &mut String, text: &str| {
        let _ = writeln!(s, "add rule {t} {chain} {text}");
    };
    // Its own addresses only; no other family.
    rule(&mut s, &format!("ip saddr != {} counter name {counter} drop", p.v4));
    match p.v6 {
        Some(v6) => rule(&mut s, &format!("ip6 saddr != {v6} counter name {counter} drop")),
        None => rule(&mut s, &format!("meta nfproto ipv6 counter name {counter} drop")),
    }
    rule(
        &mut s,
        &format!("ct state established,related ct mark {generation:#x} accept"),
    );
    if let Some(addrs) = p.standins {
        // Only names its policy allows have stand-ins (the relay judges their ports).
        let set = standin_set(p.slot);
        let _ = writeln!(s, "add set {t} {set} {{ type ipv4_addr; }}");
        let _ = writeln!(s, "flush set {t} {set}");
        if !addrs.is_empty() {
            let list: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
            let _ = writeln!(s, "add element {t} {set} {{ {} }}", list.join(", "));
        }
        rule(
            &mut s,
            &format!("ip daddr @{set} meta l4proto tcp ct mark set {generation:#x} accept"),
        );
    }
    let denied = drop_log_prefix(p.table, p.slot, "deny_out");
    for l in chain_lines(p.slot, policy) {
        for text in line_text(&l, generation) {
            match text.strip_suffix("counter drop") {
                Some(matched) => logged_drop(matched, &counter, &denied)
                    .iter()
                    .for_each(|r| rule(&mut s, r)),
                None => rule(&mut s, &text),
            }
        }
    }
    for r in logged_drop("", &counter, &drop_log_prefix(p.table, p.slot, "default")) {
        rule(&mut s, &r);
    }
    let _ = writeln!(s, "add element {t} sandboxes {{ \"{}\" : jump {chain} }}", p.veth);
    // In the proxied set exactly when its policy names a proxy (added first, so that the
    // delete never fails).
    let _ = writeln!(s, "add element {t} {PROXIED_SET} {{ \"{}\" }}", p.veth);
    if policy.egress_proxy.is_none() {
        let _ = writeln!(s, "delete element {t} {PROXIED_SET} {{ \"{}\" }}", p.veth);
    }
    for set in stale_sets {
        let _ = writeln!(s, "delete set {t} {set}");
    }
    s
}

/// The table inside a microVM's namespace: what the guest (behind `tap`) sends out is
/// masqueraded to the namespace's link (the slot's address, which the edge's chain for
/// it judges), and its DNS to `guest_dns` (the tap's host side) goes to the edge's proxy
/// at `gateway`. Replaces any earlier one whole.
pub fn machine_script(tap: &str, guest_dns: Ipv4Addr, gateway: Ipv4Addr) -> String {
    format!(
        "table ip opendsec_vm {{}}
delete table ip opendsec_vm
table ip opendsec_vm {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname \"{tap}\" ip daddr {guest_dns} meta l4proto {{ tcp, udp }} th dport 53 dnat to {gateway}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname \"{SANDBOX_IF}\" masquerade
  }}
}}
"
    )
}

/// Everything of slot `p.slot` in the table: its map entry, chain, counter and `sets`.
/// Each is deleted in a transaction of its own (`nft` stops at the first error, and
/// some may be gone already), so the result is a list of scripts.
pub fn remove_scripts(table: &str, slot: u32, veth: &str, sets: &BTreeSet<String>) -> Vec<String> {
    let t = format!("inet {table}");
    let mut out = vec![
        format!("delete element {t} sandboxes {{ \"{veth}\" }}\n"),
        // Added first: the delete never fails, so the usual teardown stays one transaction.
        format!("add element {t} {PROXIED_SET} {{ \"{veth}\" }}\ndelete element {t} {PROXIED_SET} {{ \"{veth}\" }}\n"),
        format!("delete chain {t} {}\n", chain_name(slot)),
        format!("delete counter {t} {}\n", counter_name(slot)),
    ];
    out.extend(sets.iter().map(|set| format!("delete set {t} {set}\n")));
    out
}

/// The addresses of a DNS answer, each with its timeout in seconds, for the learned
/// sets `sets` (each address goes into the sets of its family). Adding, deleting and
/// adding again refreshes an element's timeout in one transaction (nft 1.0.6 has no
/// `destroy`, and `add` keeps an existing element's timeout).
pub fn learned_script(table: &str, sets: &[String], addrs: &[(IpAddr, u64)]) -> String {
    let t = format!("inet {table}");
    let mut s = String::new();
    for set in sets {
        let v6 = set.ends_with("_6");
        for (a, timeout_s) in addrs.iter().filter(|(a, _)| a.is_ipv6() == v6) {
            let _ = writeln!(s, "add element {t} {set} {{ {a} timeout {timeout_s}s }}");
            let _ = writeln!(s, "delete element {t} {set} {{ {a} }}");
            let _ = writeln!(s, "add element {t} {set} {{ {a} timeout {timeout_s}s }}");
        }
    }
    s
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
mod tests {
    use super::*;
    use opendsec_commands::network::parse;
    use proptest::prelude::*;

    fn policy(json: &str) -> Policy {
        parse("network", json).expect("a valid policy")
    }

    fn v4(a: u32) -> IpAddr {
        IpAddr::V4(Ipv4Addr::from(a))
    }

    fn in_blocks(ip: IpAddr) -> bool {
        match ip {
            IpAddr::V4(a) => SPECIAL_V4
                .iter()
                .any(|(n, p)| contains(IpAddr::V4(*n), *p, IpAddr::V4(a))),
            IpAddr::V6(a) => special_v6()
                .iter()
                .any(|(n, p)| contains(IpAddr::V6(*n), *p, IpAddr::V6(a))),
        }
    }

    /// Addresses near every edge of special space, and some of each special block.
    fn probes() -> Vec<IpAddr> {
        let mut out = Vec::new();
        for (n, p) in SPECIAL_V4 {
            let first = u32::from(*n);
            let last = first | (u32::MAX >> *p);
            for a in [first, last, first.wrapping_sub(1), last.wrapping_add(1), first + 1] {
                out.push(v4(a));
                out.push(IpAddr::V6(Ipv4Addr::from(a).to_ipv6_mapped()));
            }
        }
        for (n, p) in SPECIAL_V6 {
            let first = u128::from(*n);
            let last = first | (u128::MAX.checked_shr(*p as u32).unwrap_or(0));
            for a in [first, last, first.wrapping_sub(1), last.wrapping_add(1)] {
                out.push(IpAddr::V6(Ipv6Addr::from(a)));
            }
        }
        out
    }

    #[test]
    fn the_special_blocks_are_exactly_what_the_policy_calls_special() {
        for ip in probes() {
            assert_eq!(in_blocks(ip), is_special(ip), "{ip}");
        }
    }

    proptest! {
        #[test]
        fn the_special_blocks_agree_with_is_special_on_any_address(a in any::<u32>(), b in any::<u128>()) {
            prop_assert_eq!(in_blocks(v4(a)), is_special(v4(a)));
            let six = IpAddr::V6(Ipv6Addr::from(b));
            prop_assert_eq!(in_blocks(six), is_special(six));
        }
    }

    /// The chain's verdict on every probe equals `allows_addr` (DNS ports apart: see
    /// `dns_to_another_resolver_is_dropped_unless_an_allow_rule_names_it`).
    fn check_against_allows_addr(json: &str) {
        let p = policy(json);
        let lines = chain_lines(7, &p);
        let mut ips = probes();
        ips.extend(
            [
                "11.0.0.1",
                "11.0.0.80",
                "11.1.2.3",
                "8.8.8.8",
                "10.1.2.3",
                "192.168.1.1",
                "169.254.169.254",
                "2a00::1",
                "2a00:1::5",
                "fd00::1",
                "1.1.1.1",
            ]
            .map(|s| s.parse::<IpAddr>().unwrap()),
        );
        for ip in ips {
            for proto in [Protocol::Tcp, Protocol::Udp] {
                for port in [1u16, 22, 79, 80, 81, 443, 8000, 8080, 65535] {
                    let want = p.allows_addr(ip, port, proto);
                    let got = evaluate(&lines, ip, port, proto, &BTreeSet::new()) == Verdict::Accept;
                    assert_eq!(got, want, "{json}: {ip}:{port} {proto:?}");
                }
            }
        }
    }

    #[test]
    fn the_chain_means_what_allows_addr_means() {
        for json in [
            "{}",
            r#"{"allow_internet_access":true}"#,
            r#"{"allow_internet_access":true,"deny_out":["11.0.0.0/8"]}"#,
            r#"{"allow_internet_access":true,"deny_out":["11.0.0.0/8"],"allow_out":["11.0.0.80:80"]}"#,
            r#"{"allow_out":["11.0.0.0/24:80","10.0.0.0/8"],"deny_out":["0.0.0.0/0"]}"#,
            r#"{"allow_out":["0.0.0.0/0"]}"#,
            r#"{"allow_out":["::/0"],"deny_out":["2a00::/16"]}"#,
            r#"{"allow_out":["169.254.169.254"]}"#,
            r#"{"allow_out":["192.0.0.0/8"]}"#,
            r#"{"allow_out":[{"to":"11.0.0.0/8","ports":[80,"8000-8100",81],"protocol":"tcp"}]}"#,
            r#"{"allow_out":[{"to":"11.0.0.0/8","ports":["70-90",80],"protocol":"udp"}]}"#,
            r#"{"allow_internet_access":true,"deny_out":[{"to":"0.0.0.0/0","ports":[22]}]}"#,
            r#"{"allow_internet_access":true,"deny_out":["fd00::/8","8.8.8.0/24"]}"#,
        ] {
            check_against_allows_addr(json);
        }
    }

    #[test]
    fn dns_to_another_resolver_is_dropped_unless_an_allow_rule_names_it() {
        let open = policy(r#"{"allow_internet_access":true}"#);
        let lines = chain_lines(1, &open);
        let dns = "8.8.8.8".parse().unwrap();
        for port in DNS_PORTS {
            assert_eq!(
                evaluate(&lines, dns, port, Protocol::Udp, &BTreeSet::new()),
                Verdict::Drop
            );
        }
        assert_eq!(
            evaluate(&lines, dns, 443, Protocol::Tcp, &BTreeSet::new()),
            Verdict::Accept
        );
        let named = policy(r#"{"allow_internet_access":true,"allow_out":["8.8.8.8:53"]}"#);
        let lines = chain_lines(1, &named);
        assert_eq!(
            evaluate(&lines, dns, 53, Protocol::Udp, &BTreeSet::new()),
            Verdict::Accept
        );
        assert_eq!(
            evaluate(&lines, dns, 853, Protocol::Tcp, &BTreeSet::new()),
            Verdict::Drop
        );
    }

    #[test]
    fn a_domain_rule_opens_what_its_set_learned_on_its_ports_only_and_beats_a_deny() {
        let p = policy(r#"{"allow_out":["pkgs.test:443"],"deny_out":["11.0.0.0/8"]}"#);
        let lines = chain_lines(3, &p);
        let ip: IpAddr = "11.0.0.10".parse().unwrap();
        let learned = BTreeSet::from([learned_set(3, "pkgs.test", false, false)]);
        assert_eq!(evaluate(&lines, ip, 443, Protocol::Tcp, &learned), Verdict::Accept);
        assert_eq!(evaluate(&lines, ip, 80, Protocol::Tcp, &learned), Verdict::Drop);
        assert_eq!(
            evaluate(&lines, ip, 443, Protocol::Tcp, &BTreeSet::new()),
            Verdict::Drop
        );
        let six: IpAddr = "2a00::10".parse().unwrap();
        assert_eq!(
            evaluate(&lines, six, 443, Protocol::Tcp, &learned),
            Verdict::Drop,
            "another family's set"
        );
    }

    #[test]
    fn learned_sets_are_named_by_target_so_they_survive_a_change_of_ports() {
        let a = policy(r#"{"allow_out":["pkgs.test:443","*.mirror.test"]}"#);
        let b = policy(r#"{"allow_out":[{"to":"pkgs.test","ports":[80,443]}]}"#);
        let (sa, sb) = (learned_sets(2, &a), learned_sets(2, &b));
        assert_eq!(sa.len(), 4);
        assert!(sb.is_subset(&sa));
        assert_ne!(
            learned_set(2, "pkgs.test", false, false),
            learned_set(2, "pkgs.test", true, false)
        );
        assert_ne!(
            learned_set(2, "pkgs.test", false, false),
            learned_set(3, "pkgs.test", false, false)
        );
        assert_eq!(
            sets_for_name(2, &a, "a.b.Mirror.test."),
            vec![
                learned_set(2, "mirror.test", true, false),
                learned_set(2, "mirror.test", true, true)
            ]
        );
        assert!(
            sets_for_name(2, &a, "mirror.test").is_empty(),
            "a wildcard is below the name only"
        );
    }

    #[test]
    fn rebinding_a_name_into_special_space_is_refused_unless_a_block_rule_opens_it() {
        let p = policy(r#"{"allow_out":["pkgs.test","10.9.0.0/16"]}"#);
        for (ip, ok) in [
            ("11.0.0.1", true),
            ("10.9.1.1", true),
            ("10.8.1.1", false),
            ("127.0.0.1", false),
            ("169.254.169.254", false),
            ("fd00::1", false),
            ("::ffff:10.8.0.1", false),
        ] {
            assert_eq!(answer_allowed(&p, ip.parse().unwrap()), ok, "{ip}");
        }
    }

    fn place() -> SandboxPlace<'static> {
        SandboxPlace {
            table: "opendsec_e1_abc123",
            slot: 5,
            veth: "odabc1235",
            v4: Ipv4Addr::new(10, 231, 0, 5),
            v6: Some("fd6f:7064:7365::5".parse().unwrap()),
            standins: None,
        }
    }

    #[test]
    fn a_sandbox_chain_reads_as_its_policy() {
        let p = policy(
            r#"{"allow_out":[{"to":"11.0.0.0/24","ports":[80,"8000-8100"],"protocol":"tcp"},"pkgs.test:443"],
                "deny_out":["12.0.0.0/8"],"allow_internet_access":true}"#,
        );
        let stale = BTreeSet::from(["d5_000000000000_4".to_string()]);
        let text = sandbox_script(&place(), &p, 0x2a, &stale);
        let set4 = learned_set(5, "pkgs.test", false, false);
        let set6 = learned_set(5, "pkgs.test", false, true);
        let t = "inet opendsec_e1_abc123";
        // Each drop is sampled in the kernel log first (new connections, rate-limited).
        let refuse = REFUSE;
        let log = "ct state new limit rate 5/second burst 5 packets log prefix \"odsec-drop opendsec_e1_abc123 sb5 ";
        let expected = format!(
            "add set {t} {set4} {{ type ipv4_addr; flags timeout; }}
add set {t} {set6} {{ type ipv6_addr; flags timeout; }}
add counter {t} drops5
add chain {t} sb5
flush chain {t} sb5
add rule {t} sb5 ip saddr != 10.231.0.5 counter name drops5 drop
add rule {t} sb5 ip6 saddr != fd6f:7064:7365::5 counter name drops5 drop
add rule {t} sb5 ct state established,related ct mark 0x2a accept
add rule {t} sb5 ip daddr 11.0.0.0/24 ip daddr != @special4 tcp dport {{ 80, 8000-8100 }} ct mark set 0x2a accept
add rule {t} sb5 ip daddr @{set4} meta l4proto {{ tcp, udp }} th dport {{ 443 }} ct mark set 0x2a accept
add rule {t} sb5 ip6 daddr @{set6} meta l4proto {{ tcp, udp }} th dport {{ 443 }} ct mark set 0x2a accept
add rule {t} sb5 ip daddr 12.0.0.0/8 ip daddr != @special4 {log}deny_out: \" level info
add rule {t} sb5 ip daddr 12.0.0.0/8 ip daddr != @special4 counter name drops5 {refuse}
add rule {t} sb5 ip daddr != @special4 meta l4proto {{ tcp, udp }} th dport {{ 53, 853 }} {log}deny_out: \" level info
add rule {t} sb5 ip daddr != @special4 meta l4proto {{ tcp, udp }} th dport {{ 53, 853 }} counter name drops5 {refuse}
add rule {t} sb5 ip6 daddr != @special6 meta l4proto {{ tcp, udp }} th dport {{ 53, 853 }} {log}deny_out: \" level info
add rule {t} sb5 ip6 daddr != @special6 meta l4proto {{ tcp, udp }} th dport {{ 53, 853 }} counter name drops5 {refuse}
add rule {t} sb5 ip daddr != @special4 ct mark set 0x2a accept
add rule {t} sb5 ip6 daddr != @special6 ct mark set 0x2a accept
add rule {t} sb5 {log}default: \" level info
add rule {t} sb5 counter name drops5 {refuse}
add element {t} sandboxes {{ \"odabc1235\" : jump sb5 }}
add element {t} proxied {{ \"odabc1235\" }}
delete element {t} proxied {{ \"odabc1235\" }}
delete set {t} d5_000000000000_4
"
        );
        assert_eq!(text, expected);
    }

    #[test]
    fn the_default_policy_is_a_chain_that_drops_everything_and_counts_it() {
        let text = sandbox_script(&place(), &Policy::default(), 1, &BTreeSet::new());
        let rules: Vec<&str> = text.lines().filter(|l| l.starts_with("add rule")).collect();
        assert_eq!(rules.len(), 5, "{text}");
        assert!(rules.iter().all(|r| !r.contains("mark set")), "{text}");
        assert!(rules[3].contains("log prefix \"odsec-drop opendsec_e1_abc123 sb5 default: \""));
        assert!(
            rules
                .last()
                .unwrap()
                .ends_with(&format!("counter name drops5 {REFUSE}"))
        );
    }

    #[test]
    fn answers_refresh_their_elements_timeout_in_every_set_of_their_family() {
        let sets = vec!["d1_a_4".to_string(), "d1_a_6".to_string()];
        let addrs: Vec<(IpAddr, u64)> = vec![("11.0.0.1".parse().unwrap(), 60), ("2a00::1".parse().unwrap(), 60)];
        assert_eq!(
            learned_script("t", &sets, &addrs),
            "add element inet t d1_a_4 { 11.0.0.1 timeout 60s }
delete element inet t d1_a_4 { 11.0.0.1 }
add element inet t d1_a_4 { 11.0.0.1 timeout 60s }
add element inet t d1_a_6 { 2a00::1 timeout 60s }
delete element inet t d1_a_6 { 2a00::1 }
add element inet t d1_a_6 { 2a00::1 timeout 60s }
"
        );
    }
}

#[cfg(test)]
mod standin_tests {
    use super::*;

    #[test]
    fn a_proxied_sandboxs_chain_lets_its_stand_ins_through_to_the_relay_and_nothing_else() {
        let addrs = [Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(198, 18, 0, 2)];
        let place = SandboxPlace {
            table: "t",
            slot: 3,
            veth: "odx3",
            v4: Ipv4Addr::new(10, 231, 0, 3),
            v6: None,
            standins: Some(&addrs),
        };
        let text = sandbox_script(&place, &Policy::default(), 7, &BTreeSet::new());
        assert!(text.contains("add set inet t d3_standin_4 { type ipv4_addr; }\nflush set inet t d3_standin_4\n"));
        assert!(text.contains("add element inet t d3_standin_4 { 198.18.0.1, 198.18.0.2 }"));
        let accept = text
            .find("ip daddr @d3_standin_4 meta l4proto tcp ct mark set 0x7 accept")
            .unwrap();
        assert!(accept < text.find("default: ").unwrap(), "before the default refusal");
        // The stand-ins lie in special space: nothing else reaches them.
        assert!(is_special(IpAddr::V4(addrs[0])));
        let none = SandboxPlace {
            standins: None,
            ..place
        };
        assert!(!sandbox_script(&none, &Policy::default(), 7, &BTreeSet::new()).contains("standin"));
    }
}
