//! The text `nft -f` takes: the edge's table ([`base_script`]), a sandbox's chain and
//! sets ([`sandbox_script`]), a machine's namespace ([`machine_script`]), removals and
//! learned addresses, and the names of everything in the table.

use super::*;

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
