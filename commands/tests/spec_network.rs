//! Network policy: checked at create and at `SetSandboxNetwork`, a 400 naming the rule;
//! default deny; an allow beats a deny; the public internet never includes private,
//! loopback, link-local or metadata addresses unless a rule names them.

mod support;

use opendsec_commands::network::{self, NETWORK_RULES_MAX, Policy, Protocol};
use opendsec_commands::{Command, RejectionKind as K, SandboxOptions};
use opendsec_projections::{Egress, Event, Outcome, Right};
use std::net::IpAddr;
use support::*;

fn create_with(project: &str, network: &str) -> Command {
    let Command::CreateSandbox {
        project,
        image,
        cpu_millis,
        memory_mb,
        labels,
        timeout_seconds,
        ..
    } = create_in(project)
    else {
        unreachable!()
    };
    Command::CreateSandbox {
        project,
        image,
        cpu_millis,
        memory_mb,
        labels,
        timeout_seconds,
        opts: SandboxOptions {
            network: Some(network.into()),
            ..Default::default()
        },
    }
}

fn policy(json: &str) -> Policy {
    network::parse("network", json).unwrap_or_else(|r| panic!("{json}: {r:?}"))
}

fn refused_field(json: &str) -> String {
    let r = network::parse("network", json).expect_err(json);
    assert_eq!(r.kind, K::Invalid, "{json}");
    r.field.unwrap()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn a_policy_asked_at_create_is_in_the_event_and_the_view() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    // A private block needs the `any` ceiling, which the root's admin may set.
    w.run(&admin, set_project(&root, Egress::Any, None)).unwrap();
    let json = r#"{"allow_out":["pkgs.example.com","*.cdn.example.com:443","10.1.0.0/16"],"deny_out":["0.0.0.0/0"]}"#;
    let ran = w.run(&admin, create_with(&root, json)).unwrap();
    let [Event::SandboxCreated(c)] = ran.decided.events.as_slice() else {
        panic!("{:?}", ran.decided.events)
    };
    assert_eq!(c.network, json);
    assert_eq!(w.state.sandboxes.sandboxes[&c.id].network.as_deref(), Some(json));
}

#[test]
fn a_bad_rule_at_create_is_refused_naming_it_and_nothing_is_logged() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let before = w.log.len();
    let err = w
        .run(
            &admin,
            create_with(&root, r#"{"allowOut":["a.example.com","b.example.com","not a name"]}"#),
        )
        .unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Invalid, Some("opts.network.allow_out[2]"))
    );
    assert_eq!(w.log.len(), before, "bad input leaves the log unchanged");
}

#[test]
fn set_network_replaces_the_whole_policy_and_checks_it() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let id = w.sandbox(&admin, &root);
    assert_eq!(
        w.state.sandboxes.sandboxes[&id].network, None,
        "none asked: the default, deny"
    );
    let json = r#"{"allow_out":["pkgs.example.com"]}"#;
    w.run(
        &admin,
        Command::SetSandboxNetwork {
            sandbox: id.clone(),
            network: json.into(),
        },
    )
    .unwrap();
    assert_eq!(w.state.sandboxes.sandboxes[&id].network.as_deref(), Some(json));
    let err = w
        .run(
            &admin,
            Command::SetSandboxNetwork {
                sandbox: id.clone(),
                network: r#"{"deny_out":[{"to":"10.0.0.0/8","ports":[0]}]}"#.into(),
            },
        )
        .unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Invalid, Some("network.deny_out[0].ports[0]"))
    );
    assert_eq!(
        w.state.sandboxes.sandboxes[&id].network.as_deref(),
        Some(json),
        "unchanged"
    );
    assert_eq!(w.replayed(), w.state, "the log replays to the same view");
}

#[test]
fn rules_name_domains_wildcards_addresses_blocks_ports_and_protocols() {
    let p = policy(
        r#"{"allow_out":["Pkgs.Example.com.","*.cdn.example.com","192.0.2.7","2001:db8::/32","[2001:db8::1]:443","example.org:8000-8100",
            {"to":"198.51.100.0/24","ports":[53,"1000-2000"],"protocol":"udp"}]}"#,
    );
    assert_eq!(p.allow_out.len(), 7);
    for (bad, field) in [
        (r#"{"allow_out":["*.com.."]}"#, "network.allow_out[0]"),
        (r#"{"allow_out":["localhost"]}"#, "network.allow_out[0]"),
        (
            r#"{"allow_out":["x.example.com","-bad.example.com"]}"#,
            "network.allow_out[1]",
        ),
        (r#"{"allow_out":["10.0.0.1/8"]}"#, "network.allow_out[0]"),
        (r#"{"allow_out":["10.0.0.0/33"]}"#, "network.allow_out[0]"),
        (r#"{"allow_out":["fd00::/129"]}"#, "network.allow_out[0]"),
        (r#"{"allow_out":["example.com:0"]}"#, "network.allow_out[0]"),
        (r#"{"allow_out":["example.com:70000"]}"#, "network.allow_out[0]"),
        (r#"{"allow_out":["example.com:9-3"]}"#, "network.allow_out[0]"),
        (
            r#"{"allow_out":[{"to":"example.com","protocol":"icmp"}]}"#,
            "network.allow_out[0].protocol",
        ),
        (
            r#"{"allow_out":[{"to":"example.com","via":"x"}]}"#,
            "network.allow_out[0].via",
        ),
        (r#"{"allow_out":[{"ports":[80]}]}"#, "network.allow_out[0].to"),
        (r#"{"allow_out":[7]}"#, "network.allow_out[0]"),
        (r#"{"allow_out":"example.com"}"#, "network.allow_out"),
        (r#"{"allow_internet_access":"yes"}"#, "network.allow_internet_access"),
        (r#"{"dns_servers":["8.8.8"]}"#, "network.dns_servers[0]"),
        (r#"{"egressProxy":{"url":"http://proxy"}}"#, "network.egress_proxy.url"),
        (r#"{"egressProxy":"p:1080"}"#, "network.egress_proxy"),
        (r#"{"teleport":true}"#, "network.teleport"),
        (r#"[]"#, "network"),
        (r#"not json"#, "network"),
    ] {
        assert_eq!(refused_field(bad), field, "{bad}");
    }
}

#[test]
fn a_policy_reads_back_the_same_from_its_canonical_json_whatever_spelling_set_it() {
    // E2B's camelCase, strings and objects, ports and ranges, IPv6 with a port.
    let asked = r#"{"allowInternetAccess":true,"allowOut":["pkgs.example.com","*.cdn.example.com:443",
        {"to":"10.1.0.0/16","ports":[22,"8000-8100"],"protocol":"tcp"},"[2001:db8::1]:53","192.0.2.7"],
        "denyOut":["0.0.0.0/0"],"dnsServers":["192.0.2.53"]}"#;
    let p = policy(asked);
    let canonical = p.to_json();
    assert_eq!(
        canonical,
        serde_json::json!({
            "allow_internet_access": true,
            "allow_out": ["pkgs.example.com", "*.cdn.example.com:443",
                {"to": "10.1.0.0/16", "ports": [22, "8000-8100"], "protocol": "tcp"},
                "[2001:db8::1]:53", "192.0.2.7"],
            "deny_out": ["0.0.0.0/0"],
            "dns_servers": ["192.0.2.53"],
            "egress_proxy": null,
        })
    );
    assert_eq!(policy(&canonical.to_string()), p);
    // Nothing logged (or settings that no longer parse) is deny.
    assert_eq!(Policy::of_logged(None), Policy::default());
    assert_eq!(Policy::of_logged(Some("")), Policy::default());
    assert_eq!(Policy::of_logged(Some(asked)), p);
}

#[test]
fn a_policy_holds_a_bounded_number_of_rules() {
    let rules = |n: usize| {
        (0..n)
            .map(|i| format!("\"h{i}.example.com\""))
            .collect::<Vec<_>>()
            .join(",")
    };
    policy(&format!(r#"{{"allow_out":[{}]}}"#, rules(NETWORK_RULES_MAX)));
    let field = refused_field(&format!(
        r#"{{"allow_out":[{}],"deny_out":["10.0.0.0/8"]}}"#,
        rules(NETWORK_RULES_MAX)
    ));
    assert_eq!(field, "network.deny_out");
}

#[test]
fn nothing_is_allowed_by_default() {
    let inbound_only =
        r#"{"allowPublicTraffic":false,"maskRequestHost":"${PORT}-x.example.com","httpsPorts":[3000],"rules":{}}"#;
    for p in [
        policy("{}"),
        policy(r#"{"allow_internet_access":false}"#),
        policy(inbound_only),
    ] {
        assert!(!p.allows_addr(ip("192.0.2.1"), 443, Protocol::Tcp));
        assert!(!p.allows_addr(ip("93.184.216.34"), 443, Protocol::Tcp));
        assert!(!p.allows_addr(ip("2606:4700::1"), 443, Protocol::Tcp));
        assert!(!p.allows_name("pkgs.example.com"));
    }
}

#[test]
fn domains_match_exactly_or_below_a_wildcard() {
    let p = policy(r#"{"allow_out":["pkgs.example.com","*.cdn.example.com"]}"#);
    assert!(p.allows_name("pkgs.example.com"));
    assert!(p.allows_name("PKGS.example.com."));
    assert!(!p.allows_name("evil.pkgs.example.com"));
    assert!(!p.allows_name("example.com"));
    assert!(p.allows_name("a.cdn.example.com"));
    assert!(p.allows_name("a.b.cdn.example.com"));
    assert!(!p.allows_name("cdn.example.com"), "a wildcard is the names below it");
    assert!(!p.allows_name("xcdn.example.com"));
}

#[test]
fn blocks_ports_and_protocols_limit_an_allow() {
    let p = policy(r#"{"allow_out":["93.184.216.0/24:443",{"to":"2606:4700::/32","ports":["53"],"protocol":"udp"}]}"#);
    assert!(p.allows_addr(ip("93.184.216.34"), 443, Protocol::Tcp));
    assert!(!p.allows_addr(ip("93.184.216.34"), 80, Protocol::Tcp));
    assert!(!p.allows_addr(ip("93.184.217.1"), 443, Protocol::Tcp));
    assert!(p.allows_addr(ip("2606:4700::1111"), 53, Protocol::Udp));
    assert!(!p.allows_addr(ip("2606:4700::1111"), 53, Protocol::Tcp));
}

#[test]
fn the_public_internet_excludes_private_loopback_link_local_and_metadata_addresses() {
    let p = policy(r#"{"allow_internet_access":true,"allow_out":["0.0.0.0/0","::/0"]}"#);
    assert!(p.allows_addr(ip("93.184.216.34"), 80, Protocol::Tcp));
    assert!(p.allows_addr(ip("2606:4700::1"), 80, Protocol::Tcp));
    for special in [
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "127.0.0.1",
        "169.254.169.254",
        "100.64.0.1",
        "0.0.0.0",
        "::1",
        "fd00::1",
        "fe80::1",
        "::ffff:10.0.0.1",
        "::ffff:169.254.169.254",
    ] {
        assert!(!p.allows_addr(ip(special), 80, Protocol::Tcp), "{special}");
    }
    // Named by a rule, a private block opens.
    let q = policy(r#"{"allow_out":["10.1.0.0/16","fd00:1::/64"]}"#);
    assert!(q.allows_addr(ip("10.1.2.3"), 80, Protocol::Tcp));
    assert!(!q.allows_addr(ip("10.2.0.1"), 80, Protocol::Tcp));
    assert!(q.allows_addr(ip("fd00:1::5"), 80, Protocol::Tcp));
    assert!(!q.allows_addr(ip("169.254.169.254"), 80, Protocol::Tcp));
}

#[test]
fn an_allow_beats_a_deny() {
    // E2B's precedence: deny everything, allow one name and one block.
    let p = policy(r#"{"allowOut":["pkgs.example.com","93.184.216.34"],"denyOut":["0.0.0.0/0"]}"#);
    assert!(p.allows_name("pkgs.example.com"));
    assert!(p.allows_addr(ip("93.184.216.34"), 443, Protocol::Tcp));
    assert!(!p.allows_addr(ip("93.184.216.35"), 443, Protocol::Tcp));
    // The public internet less what is denied.
    let q = policy(r#"{"allow_internet_access":true,"deny_out":["93.184.216.0/24","tracker.example.com"]}"#);
    assert!(!q.allows_addr(ip("93.184.216.34"), 443, Protocol::Tcp));
    assert!(q.allows_addr(ip("93.184.217.1"), 443, Protocol::Tcp));
    assert!(!q.allows_name("tracker.example.com"));
    assert!(q.allows_name("other.example.com"));
}

fn set_project(project: &str, ceiling: Egress, default_network: Option<&str>) -> Command {
    Command::SetProjectNetwork {
        project: project.into(),
        ceiling,
        default_network: default_network.map(str::to_string),
    }
}

#[test]
fn a_sandbox_that_names_no_policy_gets_its_projects_default_or_deny() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let id = w.sandbox(&admin, &team);
    assert_eq!(w.state.sandboxes.sandboxes[&id].network, None, "no default set: deny");
    let default = r#"{"allow_out":["pkgs.example.com"]}"#;
    w.run(&admin, set_project(&root, Egress::Public, Some(default)))
        .unwrap();
    assert_eq!(
        w.state.default_network(&team),
        Some(default),
        "inherited from the parent"
    );
    let id = w.sandbox(&admin, &team);
    assert_eq!(w.state.sandboxes.sandboxes[&id].network.as_deref(), Some(default));
    // Its own asked policy wins over the default.
    let own = r#"{"allow_out":[]}"#;
    let ran = w.run(&admin, create_with(&team, own)).unwrap();
    assert_eq!(
        w.state.sandboxes.sandboxes[&ran.decided.target].network.as_deref(),
        Some(own)
    );
    assert_eq!(w.replayed(), w.state);
}

#[test]
fn a_sandbox_never_exceeds_its_projects_ceiling() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    assert_eq!(
        w.state.egress_ceiling(&team),
        Egress::Public,
        "unset: the public internet"
    );
    // Public: names and public blocks, not private networks.
    w.run(
        &admin,
        create_with(&team, r#"{"allow_out":["pkgs.example.com","93.184.216.0/24"]}"#),
    )
    .unwrap();
    let err = w
        .run(
            &admin,
            create_with(&team, r#"{"allow_out":["pkgs.example.com","10.1.0.0/16"]}"#),
        )
        .unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Forbidden, Some("opts.network.allow_out[1]"))
    );
    // None: nothing at all.
    w.run(&admin, set_project(&team, Egress::None, None)).unwrap();
    let err = w
        .run(&admin, create_with(&team, r#"{"allow_internet_access":true}"#))
        .unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Forbidden, Some("opts.network.allow_internet_access"))
    );
    let id = w.sandbox(&admin, &team);
    let err = w
        .run(
            &admin,
            Command::SetSandboxNetwork {
                sandbox: id,
                network: r#"{"allowOut":["pkgs.example.com"]}"#.into(),
            },
        )
        .unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Forbidden, Some("network.allow_out[0]"))
    );
    // Any (below a root that allows it): private networks a rule names.
    w.run(&admin, set_project(&root, Egress::Any, None)).unwrap();
    w.run(&admin, set_project(&team, Egress::Any, None)).unwrap();
    w.run(&admin, create_with(&team, r#"{"allow_out":["10.1.0.0/16"]}"#))
        .unwrap();
}

#[test]
fn a_child_ceiling_never_exceeds_its_parents_and_a_project_cannot_raise_its_own() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let sub = w.project(&admin, &team, "sub");
    w.run(&admin, set_project(&team, Egress::None, None)).unwrap();
    let err = w.run(&admin, set_project(&sub, Egress::Public, None)).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Forbidden, Some("ceiling")));
    assert_eq!(w.state.egress_ceiling(&sub), Egress::None, "lowered with its parent");
    // The team's own admin may lower its ceiling and set its default, not raise it.
    w.run(&admin, set_project(&team, Egress::Public, None)).unwrap();
    let team_admin = w.issue(&admin, &team, &[Right::QuotaWrite, Right::SandboxWrite], None);
    let err = w.run(&team_admin, set_project(&team, Egress::Any, None)).unwrap_err();
    assert_eq!((err.kind, err.field.as_deref()), (K::Forbidden, Some("ceiling")));
    w.run(
        &team_admin,
        set_project(&team, Egress::Public, Some(r#"{"allow_internet_access":true}"#)),
    )
    .unwrap();
    // A default beyond the ceiling asked is refused, naming it.
    let err = w
        .run(
            &team_admin,
            set_project(&team, Egress::None, Some(r#"{"allow_internet_access":true}"#)),
        )
        .unwrap_err();
    assert_eq!(
        (err.kind, err.field.as_deref()),
        (K::Invalid, Some("default_network.allow_internet_access"))
    );
    assert_eq!(w.replayed(), w.state);
}

#[test]
fn a_child_ceiling_decided_against_a_stale_parent_is_rejected_at_apply() {
    let (mut w, admin) = World::with_admin_and_edge();
    let root = w.root.clone();
    let team = w.project(&admin, &root, "team");
    let sub = w.project(&admin, &team, "sub");
    // Both decided before either is applied: the parent's lowering lands first.
    let lower = w.propose(&admin, set_project(&team, Egress::None, None), Overlay::Ignored);
    let raise = w.propose(&admin, set_project(&sub, Egress::Public, None), Overlay::Ignored);
    assert!(matches!(w.commit(lower), Some((_, Outcome::Applied { .. }))));
    assert!(matches!(w.commit(raise), Some((_, Outcome::Rejected { .. }))));
    assert_eq!(w.state.egress_ceiling(&sub), Egress::None);
    assert!(!w.state.quota.network.contains_key(&sub));
}

#[test]
fn an_egress_proxy_is_socks5_by_default_or_http_and_its_secrets_are_never_shown() {
    let p = policy(
        r#"{"allowOut":["pkgs.example.com"],"egressProxy":{"address":"Proxy.Example.com:1080","username":"u",
        "password":"pw","tls":{"enabled":true,"serverName":"proxy.example.com",
        "caCert":"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"}}}"#,
    );
    let proxy = p.egress_proxy.clone().expect("a proxy");
    assert_eq!(proxy.kind, network::ProxyKind::Socks5);
    assert_eq!(proxy.host, "proxy.example.com");
    assert_eq!(
        (proxy.port, proxy.username.as_deref(), proxy.password.as_deref()),
        (1080, Some("u"), Some("pw"))
    );
    assert_eq!(
        proxy.tls.as_ref().and_then(|t| t.server_name.as_deref()),
        Some("proxy.example.com")
    );
    // What a command carries reads back the same; what users see has no secret.
    assert_eq!(policy(&p.to_json().to_string()), p);
    let shown = p.shown_json();
    assert_eq!(
        shown["egress_proxy"],
        serde_json::json!({"address": "socks5://proxy.example.com:1080", "username": "u",
            "tls": {"enabled": true, "server_name": "proxy.example.com"}})
    );
    // HTTP CONNECT, an IPv6 host, TLS as a bare true, and a proxy on a private network
    // that an allow rule names.
    let http = policy(r#"{"allow_out":["10.9.0.0/16"],"egress_proxy":{"address":"http://10.9.0.3:3128"}}"#);
    assert_eq!(
        http.egress_proxy.as_ref().map(|p| p.kind),
        Some(network::ProxyKind::Http)
    );
    let v6 = policy(r#"{"egress_proxy":{"address":"[2a0a::7]:1080","tls":true}}"#);
    assert_eq!(
        v6.egress_proxy.as_ref().map(|p| p.authority()),
        Some("[2a0a::7]:1080".to_string())
    );
    // A policy with a proxy needs the public internet at least; one on a private network any.
    assert_eq!(v6.needs("network").0, Egress::Public);
    assert_eq!(http.needs("network").0, Egress::Any);
}

#[test]
fn a_bad_egress_proxy_is_refused_naming_the_field() {
    for (bad, field) in [
        (r#"{"egressProxy":{}}"#, "network.egress_proxy.address"),
        (r#"{"egressProxy":{"address":"proxy"}}"#, "network.egress_proxy.address"),
        (
            r#"{"egressProxy":{"address":"proxy:0"}}"#,
            "network.egress_proxy.address",
        ),
        (
            r#"{"egressProxy":{"address":"2001:db8::1:1080"}}"#,
            "network.egress_proxy.address",
        ),
        (
            r#"{"egressProxy":{"address":"ftp://proxy:21"}}"#,
            "network.egress_proxy.address",
        ),
        (
            r#"{"egressProxy":{"address":"bad_name!:1080"}}"#,
            "network.egress_proxy.address",
        ),
        // The edge host's own loopback, link-local (metadata) and no one's addresses.
        (
            r#"{"egressProxy":{"address":"127.0.0.1:1080"}}"#,
            "network.egress_proxy.address",
        ),
        (
            r#"{"egressProxy":{"address":"169.254.169.254:80"}}"#,
            "network.egress_proxy.address",
        ),
        (
            r#"{"egressProxy":{"address":"[::1]:1080"}}"#,
            "network.egress_proxy.address",
        ),
        // A private address that no allow rule names.
        (
            r#"{"egressProxy":{"address":"10.9.0.3:1080"}}"#,
            "network.egress_proxy.address",
        ),
        (
            r#"{"egressProxy":{"address":"p.example.com:1080","password":"pw"}}"#,
            "network.egress_proxy.password",
        ),
        (
            r#"{"egressProxy":{"address":"p.example.com:1080","username":""}}"#,
            "network.egress_proxy.username",
        ),
        (
            &format!(
                r#"{{"egressProxy":{{"address":"p.example.com:1080","username":"{}"}}}}"#,
                "u".repeat(256)
            ),
            "network.egress_proxy.username",
        ),
        (
            r#"{"egressProxy":{"address":"p.example.com:1080","tls":{"enabled":false,"serverName":"p"}}}"#,
            "network.egress_proxy.tls",
        ),
        (
            r#"{"egressProxy":{"address":"p.example.com:1080","tls":{"caCert":"not pem"}}}"#,
            "network.egress_proxy.tls.ca_cert",
        ),
        (
            r#"{"egressProxy":{"address":"p.example.com:1080","tls":"yes"}}"#,
            "network.egress_proxy.tls",
        ),
    ] {
        assert_eq!(refused_field(bad), field, "{bad}");
    }
}

#[test]
fn a_name_alone_is_judged_with_its_port_as_an_address_would_be() {
    let p = policy(r#"{"allow_out":["pkgs.example.com:443","*.cdn.example.com"]}"#);
    assert!(p.allows_name_on("pkgs.example.com", 443, Protocol::Tcp));
    assert!(!p.allows_name_on("pkgs.example.com", 80, Protocol::Tcp));
    assert!(p.allows_name_on("a.cdn.example.com.", 80, Protocol::Tcp));
    assert!(!p.allows_name_on("cdn.example.com", 80, Protocol::Tcp));
    let open = policy(r#"{"allow_internet_access":true,"deny_out":[{"to":"bad.example.com","ports":[22]}]}"#);
    assert!(open.allows_name_on("any.example.org", 443, Protocol::Tcp));
    assert!(!open.allows_name_on("bad.example.com", 22, Protocol::Tcp));
    assert!(open.allows_name_on("bad.example.com", 443, Protocol::Tcp));
    assert!(
        !open.allows_name_on("dns.example.org", 853, Protocol::Tcp),
        "DNS over TLS is never the internet's"
    );
    assert!(!Policy::default().allows_name_on("pkgs.example.com", 443, Protocol::Tcp));
}
