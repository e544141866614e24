//! Specification: a container sandbox's network egress is default deny, and its policy
//! (`network` at create, `PUT /v1/sandboxes/{id}/network` while it runs) is enforced by
//! its edge with nftables and the edge's DNS proxy.
//!
//! Each test builds its own internet in network namespaces (`support/internet.rs`):
//! `pkgs.test`, `api.pkgs.test` and `other.test` on public-looking addresses with HTTP on
//! ports 80 and 8080 and a stream on 9000, an authoritative DNS server for `*.test`, the
//! metadata address and a private-network host. `opendsec up` runs in that internet's
//! edge namespace, so no packet leaves the test's namespaces whatever a sandbox tries.
//! Sandboxes are `busybox` (wget, nslookup, nc), driven through the REST API.
//!
//! Needs root, crun or runc, nftables, iproute2 and nsenter, and the static agent
//! (`./ops/test.sh`).

#[path = "support/internet.rs"]
mod internet;
#[path = "support/up.rs"]
mod up;

use internet::{
    HTTP_PROXY, HTTP_PROXY_PORT, Internet, METADATA, OTHER, PKGS, PKGS_API, PKGS_V6, PRIVATE, PROXY_PASSWORD,
    PROXY_USER, SOCKS_PORT, SOCKS_PROXY, TLS_PROXY, TLS_PROXY_NAME, TLS_PROXY_PORT,
};
use serde_json::{Value, json};
use std::time::{Duration, Instant};
use up::Up;

async fn start() -> (Up, Internet) {
    let inet = Internet::start();
    let up = Up::start_in_netns(&inet.edge_ns, inet.mgmt, &internet::DNS.to_string()).await;
    (up, inet)
}

/// Creates a busybox sandbox with `network` (`Value::Null`: none said) and waits until
/// it runs.
async fn sandbox(up: &Up, network: Value) -> String {
    sandbox_of(up, json!({"image": "busybox"}), network).await
}

/// Creates a sandbox of `body` with `network` and waits until it runs.
async fn sandbox_of(up: &Up, mut body: Value, network: Value) -> String {
    if !network.is_null() {
        body["network"] = network;
    }
    let (s, v) = up.send(reqwest::Method::POST, "/v1/sandboxes", Some(body)).await;
    assert_eq!(s, 201, "{v}");
    let id = v["sandbox"]["id"].as_str().unwrap().to_string();
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let (_, v) = up
            .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
            .await;
        match v["state"].as_str() {
            Some("running") => return id,
            Some(s @ ("failed" | "exited" | "killed")) => panic!("sandbox {id} is {s}: {v}"),
            _ => {}
        }
        assert!(Instant::now() < deadline, "sandbox {id} not running: {v}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `sh -c cmd` in the sandbox: (stdout and stderr, exit code).
async fn sh(up: &Up, id: &str, cmd: &str) -> (String, i64) {
    up.exec(id, "/bin/sh", &["-c", &format!("{cmd} 2>&1")])
        .await
        .unwrap_or_else(|e| panic!("exec `{cmd}` in {id}: {e}"))
}

/// GET `url` from the sandbox (3 s to connect and answer): the body, or `None`. (Not
/// `wget -T`: busybox 1.35's crashes.)
async fn get(up: &Up, id: &str, url: &str) -> Option<String> {
    let (out, code) = sh(up, id, &format!("timeout 3 wget -q -O- {url}")).await;
    (code == 0).then_some(out)
}

/// `url` answers from `answered_by` (tried three times: a guest under TCG on a busy
/// machine may be slow to answer once).
async fn reaches(up: &Up, id: &str, url: &str, answered_by: &str) {
    let mut body = None;
    for _ in 0..3 {
        body = get(up, id, url).await;
        if body.as_deref().is_some_and(|b| b.contains(answered_by)) {
            return;
        }
    }
    assert!(
        body.as_deref().is_some_and(|b| b.contains(answered_by)),
        "{url} from {id}: expected an answer from {answered_by}, got {body:?}"
    );
}

async fn blocked(up: &Up, id: &str, url: &str) {
    let body = get(up, id, url).await;
    assert_eq!(body, None, "{url} from {id} must be blocked");
}

/// The DNS proxy refuses `name` to the sandbox (asked up to three times: a slow guest's
/// nslookup may give up before any answer).
async fn refused(up: &Up, id: &str, name: &str) {
    let mut said = String::new();
    for _ in 0..3 {
        said = lookup(up, id, name).await;
        if said.contains("REFUSED") {
            return;
        }
    }
    panic!("{name} from {id}: expected REFUSED, got {said}");
}

/// What `nslookup name` says in the sandbox.
async fn lookup(up: &Up, id: &str, name: &str) -> String {
    sh(up, id, &format!("timeout 10 nslookup {name}")).await.0
}

async fn set_network(up: &Up, id: &str, network: Value) -> (u16, Value) {
    up.send(
        reqwest::Method::PUT,
        &format!("/v1/sandboxes/{id}/network"),
        Some(network),
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_that_says_nothing_has_a_link_but_reaches_nothing_and_resolves_no_name() {
    let (up, _inet) = start().await;
    let id = sandbox(&up, Value::Null).await;
    let (addrs, _) = sh(
        &up,
        &id,
        "ip -4 addr show eth0; cat /etc/resolv.conf; ls /sys/class/net",
    )
    .await;
    assert!(addrs.contains("inet 10.231."), "a link with its own address: {addrs}");
    assert!(
        addrs.contains("nameserver 10.231."),
        "its resolver is the edge's DNS proxy: {addrs}"
    );
    assert!(
        !addrs.contains("mgmt0") && !addrs.contains("up0"),
        "its /sys shows its own interfaces, not the host's: {addrs}"
    );
    blocked(&up, &id, &format!("http://{PKGS}/")).await;
    blocked(&up, &id, &format!("http://[{PKGS_V6}]/")).await;
    let dns = lookup(&up, &id, "pkgs.test").await;
    assert!(dns.contains("REFUSED"), "the proxy refuses every name: {dns}");
    let (s, v) = up
        .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert_eq!(s, 200);
    assert!(
        v["network"]["allow_out"].as_array().is_none_or(|a| a.is_empty()),
        "it shows the default, deny: {v}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn allow_rules_open_a_domain_a_wildcard_a_cidr_or_one_port_and_nothing_else() {
    let (up, _inet) = start().await;
    let domain = sandbox(&up, json!({"allow_out": ["pkgs.test"]})).await;
    let wildcard = sandbox(&up, json!({"allow_out": ["*.pkgs.test"]})).await;
    let cidr = sandbox(&up, json!({"allow_out": ["11.0.0.16/28"]})).await;
    let port = sandbox(&up, json!({"allow_out": ["pkgs.test:8080"]})).await;

    // A domain: its name resolves and its addresses answer, on any port; no other name.
    reaches(&up, &domain, "http://pkgs.test/", &format!("{PKGS} 80")).await;
    reaches(&up, &domain, "http://pkgs.test:8080/", &format!("{PKGS} 8080")).await;
    refused(&up, &domain, "other.test").await;
    blocked(&up, &domain, &format!("http://{OTHER}/")).await;
    blocked(&up, &domain, &format!("http://{PKGS_API}/")).await;

    // A wildcard: names under it, not others.
    reaches(&up, &wildcard, "http://api.pkgs.test/", &format!("{PKGS_API} 80")).await;
    refused(&up, &wildcard, "other.test").await;
    blocked(&up, &wildcard, &format!("http://{OTHER}/")).await;

    // A CIDR: its addresses, by address; nothing outside it.
    reaches(&up, &cidr, &format!("http://{OTHER}/"), &format!("{OTHER} 80")).await;
    blocked(&up, &cidr, &format!("http://{PKGS}/")).await;

    // A port: that port of that name only.
    reaches(&up, &port, "http://pkgs.test:8080/", &format!("{PKGS} 8080")).await;
    blocked(&up, &port, "http://pkgs.test/").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_public_internet_never_includes_private_metadata_host_or_other_sandboxes_and_an_allow_beats_a_deny() {
    let (up, inet) = start().await;
    let open = sandbox(
        &up,
        json!({"allow_internet_access": true, "deny_out": ["other.test", "11.0.0.20"], "allow_out": ["11.0.0.20:8080"]}),
    )
    .await;
    let peer = sandbox(&up, json!({"allow_internet_access": true})).await;

    reaches(&up, &open, "http://pkgs.test/", &format!("{PKGS} 80")).await;
    reaches(
        &up,
        &open,
        &format!("http://{PKGS_API}:8080/"),
        &format!("{PKGS_API} 8080"),
    )
    .await;
    // Denied by name and by address; the allow of one port beats the deny.
    refused(&up, &open, "other.test").await;
    blocked(&up, &open, &format!("http://{OTHER}/")).await;
    reaches(&up, &open, &format!("http://{OTHER}:8080/"), &format!("{OTHER} 8080")).await;

    // Never part of "the internet": the metadata address, a private network, the host's
    // own services (the API on its management address, the gateway), another sandbox.
    blocked(&up, &open, &format!("http://{METADATA}/")).await;
    blocked(&up, &open, &format!("http://{PRIVATE}/")).await;
    blocked(&up, &open, &format!("http://{}/v1/health", up.http)).await;
    let (peer_ip, _) = sh(
        &up,
        &peer,
        "ip -4 -o addr show eth0 | sed 's/.*inet \\([0-9.]*\\).*/\\1/'",
    )
    .await;
    let peer_ip = peer_ip.trim().to_string();
    assert!(peer_ip.starts_with("10.231."), "{peer_ip}");
    let (gw, _) = sh(&up, &open, "ip route | sed -n 's/default via \\([0-9.]*\\).*/\\1/p'").await;
    let api_port = up.http.rsplit(':').next().unwrap().to_string();
    blocked(&up, &open, &format!("http://{}:{api_port}/v1/health", gw.trim())).await;
    let _ = up
        .exec(&peer, "/bin/sh", &["-c", "(echo hi | nc -l -p 8080 &) ; sleep 0.2"])
        .await;
    blocked(&up, &open, &format!("http://{peer_ip}:8080/")).await;
    // DNS rebinding: a name answering with a private address is refused.
    refused(&up, &open, "rebind.test").await;
    drop(inet);
}

#[tokio::test(flavor = "multi_thread")]
async fn its_metrics_count_its_traffic_and_show_what_its_policy_refused() {
    let (up, _inet) = start().await;
    let id = sandbox(&up, json!({"allow_out": ["pkgs.test"]})).await;
    reaches(&up, &id, "http://pkgs.test/", &format!("{PKGS} 80")).await;
    blocked(&up, &id, &format!("http://{OTHER}:8080/")).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (s, m) = up
            .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}/metrics"), None)
            .await;
        assert_eq!(s, 200, "{m}");
        let n = &m["network"];
        let refused = n["recent_drops"].as_array().into_iter().flatten().any(|d| {
            d["destination"] == OTHER.to_string()
                && d["port"] == 8080
                && d["protocol"] == "tcp"
                && d["rule"] == "default"
        });
        let counted = n["in_bytes"].as_u64() > Some(0)
            && n["out_bytes"].as_u64() > Some(0)
            && n["dropped_packets"].as_u64() > Some(0);
        if refused && counted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "metrics do not show its traffic and the refused connection: {m}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn dns_goes_only_to_the_edges_proxy() {
    let (up, _inet) = start().await;
    let id = sandbox(&up, json!({"allow_out": ["pkgs.test"]})).await;
    let direct = lookup(&up, &id, &format!("pkgs.test {}", internet::DNS)).await;
    assert!(
        !direct.contains(&PKGS.to_string()),
        "DNS to a resolver other than the proxy is dropped: {direct}"
    );
    let proxied = lookup(&up, &id, "pkgs.test").await;
    assert!(proxied.contains(&PKGS.to_string()), "{proxied}");
    assert!(
        proxied.contains(&PKGS_V6.to_string()),
        "AAAA answers come through too: {proxied}"
    );
    // IPv6: the name's learned IPv6 address answers.
    reaches(&up, &id, &format!("http://[{PKGS_V6}]/"), &format!("{PKGS_V6} 80")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_policy_changed_while_the_sandbox_runs_takes_effect_on_open_connections_both_ways() {
    let (up, _inet) = start().await;
    let id = sandbox(&up, json!({"allow_out": ["pkgs.test"]})).await;
    // A long-lived connection: a line every 50 ms into /tmp/stream.
    let _ = up
        .exec(
            &id,
            "/bin/sh",
            &["-c", "(nc pkgs.test 9000 > /tmp/stream 2>/dev/null &); sleep 0.5"],
        )
        .await;
    let before = lines(&up, &id).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(lines(&up, &id).await > before, "the stream flows");

    // Taken away: new connections fail, and the open one stops.
    let (s, v) = set_network(&up, &id, json!({"allow_out": []})).await;
    assert_eq!(s, 200, "{v}");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let a = lines(&up, &id).await;
        tokio::time::sleep(Duration::from_millis(400)).await;
        let b = lines(&up, &id).await;
        if a == b {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the open connection still flows after the policy took it away"
        );
    }
    blocked(&up, &id, &format!("http://{PKGS}/")).await;

    // Given back: it answers again.
    let (s, v) = set_network(&up, &id, json!({"allow_out": ["11.0.0.10"]})).await;
    assert_eq!(s, 200, "{v}");
    let deadline = Instant::now() + Duration::from_secs(5);
    while get(&up, &id, &format!("http://{PKGS}/")).await.is_none() {
        assert!(Instant::now() < deadline, "the new policy was not applied");
    }
    let (s, v) = up
        .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}/network"), None)
        .await;
    assert_eq!(s, 200);
    assert_eq!(v["allow_out"], json!(["11.0.0.10"]), "{v}");
}

/// A microVM's guest routes through its tap; the edge gives its namespace the same link
/// and chain as a container's (IPv4), and its DNS goes to the same proxy.
#[tokio::test(flavor = "multi_thread")]
async fn a_microvm_reaches_what_its_policy_allows_and_nothing_else() {
    a_machine_reaches_what_its_policy_allows_and_nothing_else("microvm").await;
}

/// A full VM boots the same init from its own disk: the same link out.
#[tokio::test(flavor = "multi_thread")]
async fn a_full_vm_reaches_what_its_policy_allows_and_nothing_else() {
    a_machine_reaches_what_its_policy_allows_and_nothing_else("vm").await;
}

/// One guest under TCG at a time: two on a 2-core machine make every timeout a guess.
static ONE_MACHINE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn a_machine_reaches_what_its_policy_allows_and_nothing_else(isolation: &str) {
    let _one = ONE_MACHINE_AT_A_TIME.lock().await;
    let (up, inet) = start().await;
    let body = json!({"image": "busybox", "isolation": isolation, "memory_mb": 256});
    let id = sandbox_of(&up, body, json!({"allow_out": ["pkgs.test"]})).await;
    reaches(&up, &id, "http://pkgs.test/", &format!("{PKGS} 80")).await;
    refused(&up, &id, "other.test").await;
    blocked(&up, &id, &format!("http://{OTHER}/")).await;
    blocked(&up, &id, &format!("http://{METADATA}/")).await;
    let (s, v) = set_network(&up, &id, json!({"allow_out": ["11.0.0.20"]})).await;
    assert_eq!(s, 200, "{v}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&up, &id, &format!("http://{OTHER}/")).await.is_none() {
        assert!(
            Instant::now() < deadline,
            "the new policy was not applied to the {isolation}"
        );
    }
    blocked(&up, &id, &format!("http://{PKGS}/")).await;
    // Paused (a microVM's VMM ends) and resumed: the same link, the same policy.
    for (action, state) in [("pause", "paused"), ("resume", "running")] {
        let (s, v) = up
            .send(reqwest::Method::POST, &format!("/v1/sandboxes/{id}/{action}"), None)
            .await;
        assert!(s < 300, "{action}: {s} {v}");
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let (_, v) = up
                .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
                .await;
            if v["state"] == state {
                break;
            }
            assert!(Instant::now() < deadline, "not {state} after {action}: {v}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    reaches(&up, &id, &format!("http://{OTHER}/"), &format!("{OTHER} 80")).await;
    blocked(&up, &id, &format!("http://{PKGS}/")).await;
    // Through an upstream proxy, as a container's.
    inet.start_proxies();
    let proxied = json!({"allow_out": ["11.0.0.20"], "egress_proxy": {"address": format!("{SOCKS_PROXY}:{SOCKS_PORT}"),
        "username": PROXY_USER, "password": PROXY_PASSWORD}});
    let (s, v) = set_network(&up, &id, proxied).await;
    assert_eq!(s, 200, "{v}");
    reaches(
        &up,
        &id,
        &format!("http://{OTHER}/"),
        &format!("{OTHER} 80 for {SOCKS_PROXY}"),
    )
    .await;
    blocked(&up, &id, &format!("http://{PKGS}/")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_keeps_its_network_and_policy_across_an_edge_restart_and_loses_it_when_it_ends() {
    let (mut up, _inet) = start().await;
    let id = sandbox(&up, json!({"allow_out": ["pkgs.test"]})).await;
    reaches(&up, &id, "http://pkgs.test/", &format!("{PKGS} 80")).await;
    up.kill9();
    up.restart().await;
    reaches(&up, &id, "http://pkgs.test/", &format!("{PKGS} 80")).await;
    blocked(&up, &id, &format!("http://{OTHER}/")).await;
    let (s, _) = up
        .send(reqwest::Method::DELETE, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert!(s == 200 || s == 204, "{s}");
    // Its addresses, namespace and chain go with it.
    let deadline = Instant::now() + Duration::from_secs(10);
    while holds_addresses(&id) {
        assert!(Instant::now() < deadline, "the sandbox's network outlived it");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandboxs_own_socks5_proxy_carries_what_its_policy_allows_and_nothing_else() {
    let (up, inet) = start().await;
    inet.start_proxies();
    let proxy = json!({"address": format!("{SOCKS_PROXY}:{SOCKS_PORT}"), "username": PROXY_USER,
        "password": PROXY_PASSWORD});
    let id = sandbox(
        &up,
        json!({"allow_out": ["pkgs.test", "*.pkgs.test"], "egress_proxy": proxy}),
    )
    .await;
    // The proxy connects on: the server sees the proxy as its client. By name: the
    // proxy resolved it (its resolver is the test DNS server).
    reaches(&up, &id, "http://pkgs.test/", &format!("{PKGS} 80 for {SOCKS_PROXY}")).await;
    reaches(
        &up,
        &id,
        "http://api.pkgs.test:8080/",
        &format!("{PKGS_API} 8080 for {SOCKS_PROXY}"),
    )
    .await;
    // Filtering comes first: what the policy does not allow goes nowhere, proxy or not.
    blocked(&up, &id, &format!("http://{OTHER}/")).await;
    refused(&up, &id, "other.test").await;
    // The proxy's password is never shown back.
    let (s, shown) = up
        .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}/network"), None)
        .await;
    assert_eq!(s, 200, "{shown}");
    assert_eq!(
        shown["egress_proxy"],
        json!({"address": format!("socks5://{SOCKS_PROXY}:{SOCKS_PORT}"), "username": PROXY_USER})
    );
    let (_, info) = up
        .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await;
    assert!(!info.to_string().contains(PROXY_PASSWORD), "{info}");
    // A wrong password: the proxy refuses, the sandbox's connection is reset, and its
    // sampled drops say so.
    let wrong = json!({"allow_out": ["pkgs.test"], "egress_proxy": {"address": format!("{SOCKS_PROXY}:{SOCKS_PORT}"),
        "username": PROXY_USER, "password": "wrong"}});
    let (s, v) = set_network(&up, &id, wrong).await;
    assert_eq!(s, 200, "{v}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let answered = get(&up, &id, "http://pkgs.test/").await;
        let (_, m) = up
            .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}/metrics"), None)
            .await;
        let noted = m["network"]["recent_drops"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|d| d["destination"] == PKGS.to_string() && d["port"] == 80 && d["rule"] == "egress_proxy");
        if answered.is_none() && noted {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a proxy that refuses: expected no answer and a drop, got {answered:?} and {m}"
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Over TLS (stunnel in front of the same proxy), trusting the test's CA for its name.
    let tls = json!({"allow_out": ["pkgs.test"], "egress_proxy": {"address": format!("{TLS_PROXY}:{TLS_PROXY_PORT}"),
        "username": PROXY_USER, "password": PROXY_PASSWORD,
        "tls": {"enabled": true, "server_name": TLS_PROXY_NAME, "ca_cert": inet.proxy_ca()}}});
    let (s, v) = set_network(&up, &id, tls).await;
    assert_eq!(s, 200, "{v}");
    reaches(&up, &id, "http://pkgs.test/", &format!("{PKGS} 80 for {SOCKS_PROXY}")).await;
    // A certificate the sandbox's settings do not trust: nothing goes through.
    let untrusted = json!({"allow_out": ["pkgs.test"], "egress_proxy": {"address": format!("{TLS_PROXY}:{TLS_PROXY_PORT}"),
        "username": PROXY_USER, "password": PROXY_PASSWORD, "tls": {"enabled": true, "server_name": TLS_PROXY_NAME}}});
    let (s, v) = set_network(&up, &id, untrusted).await;
    assert_eq!(s, 200, "{v}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&up, &id, "http://pkgs.test/").await.is_some() {
        assert!(
            Instant::now() < deadline,
            "a proxy with an untrusted certificate carried a connection"
        );
    }
    // No proxy any more: straight out, through the edge's NAT.
    let (s, v) = set_network(&up, &id, json!({"allow_out": ["pkgs.test"]})).await;
    assert_eq!(s, 200, "{v}");
    reaches(&up, &id, "http://pkgs.test/", &format!("{PKGS} 80 for 10.200.0.2")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_edges_own_proxy_carries_every_sandboxs_public_tcp_and_reaches_a_sandboxs_own_proxy() {
    let inet = Internet::start();
    inet.start_proxies();
    let url = format!("http://{PROXY_USER}:{PROXY_PASSWORD}@{HTTP_PROXY}:{HTTP_PROXY_PORT}");
    let up = Up::start_in_netns_env(
        &inet.edge_ns,
        inet.mgmt,
        &internet::DNS.to_string(),
        &[("OPENDSEC_EGRESS_PROXY", url.as_str())],
    )
    .await;
    let open = sandbox(&up, json!({"allow_internet_access": true})).await;
    reaches(&up, &open, "http://pkgs.test/", &format!("{PKGS} 80 for {HTTP_PROXY}")).await;
    reaches(
        &up,
        &open,
        &format!("http://{OTHER}:8080/"),
        &format!("{OTHER} 8080 for {HTTP_PROXY}"),
    )
    .await;
    // Still only what the policy allows.
    blocked(&up, &open, &format!("http://{PRIVATE}/")).await;
    // A sandbox's own proxy is reached through the edge's: the server's client is the
    // sandbox's proxy, which the edge's proxy connected to.
    let own = sandbox(
        &up,
        json!({"allow_out": ["pkgs.test"], "egress_proxy": {"address": format!("socks5://{SOCKS_PROXY}:{SOCKS_PORT}"),
            "username": PROXY_USER, "password": PROXY_PASSWORD}}),
    )
    .await;
    reaches(&up, &own, "http://pkgs.test/", &format!("{PKGS} 80 for {SOCKS_PROXY}")).await;
    // The proxy is for TCP: DNS still answers through the edge's DNS proxy.
    assert!(lookup(&up, &own, "pkgs.test").await.contains(&PKGS.to_string()));
}

#[tokio::test(flavor = "multi_thread")]
async fn where_the_sites_dns_knows_no_public_names_the_edges_proxy_resolves_them() {
    let inet = Internet::start();
    inet.start_proxies();
    let url = format!("socks5://{PROXY_USER}:{PROXY_PASSWORD}@{SOCKS_PROXY}:{SOCKS_PORT}");
    let up = Up::start_in_netns_env(
        &inet.edge_ns,
        inet.mgmt,
        &internet::DNS.to_string(),
        &[("OPENDSEC_EGRESS_PROXY", url.as_str())],
    )
    .await;
    let id = sandbox(&up, json!({"allow_out": ["pkgs.offline:80"]})).await;
    // The site's resolver refuses the name: the sandbox is answered a stand-in address,
    // and the relay asks the proxy for the name, which it resolves itself.
    let said = lookup(&up, &id, "pkgs.offline").await;
    assert!(
        said.contains("198.18.") || said.contains("198.19."),
        "a stand-in: {said}"
    );
    reaches(
        &up,
        &id,
        "http://pkgs.offline/",
        &format!("{PKGS} 80 for {SOCKS_PROXY}"),
    )
    .await;
    // Only on the port its policy names; a name it does not allow gets nothing.
    blocked(&up, &id, "http://pkgs.offline:8080/").await;
    refused(&up, &id, "other.offline").await;
    // A live update that takes the name away takes its stand-in too.
    let (s, v) = set_network(&up, &id, json!({"allow_out": ["other.test"]})).await;
    assert_eq!(s, 200, "{v}");
    let standin = said
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .find(|a| a.starts_with("198.1"))
        .expect("the stand-in's address")
        .to_string();
    let deadline = Instant::now() + Duration::from_secs(10);
    while get(&up, &id, &format!("http://{standin}/")).await.is_some() {
        assert!(Instant::now() < deadline, "the stand-in outlived its name's allow rule");
    }
    refused(&up, &id, "pkgs.offline").await;
}

/// Whether some edge on this host still records addresses for `owner`.
fn holds_addresses(owner: &str) -> bool {
    let needle = format!("\"owner\":\"{owner}\"");
    std::fs::read_dir(std::path::Path::new(opendsec_edge::net::DEFAULT_STATE_DIR).join("edges"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().is_dir())
        .flat_map(|e| std::fs::read_dir(e.path()).into_iter().flatten().flatten())
        .any(|f| std::fs::read_to_string(f.path()).is_ok_and(|t| t.contains(&needle)))
}

/// Lines the stream in sandbox `id` has written to /tmp/stream so far.
async fn lines(up: &Up, id: &str) -> u64 {
    sh(up, id, "wc -l < /tmp/stream").await.0.trim().parse().unwrap_or(0)
}
