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
