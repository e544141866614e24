//! Network policy: what a sandbox may reach, as asked at create (`opts.network`) or
//! replaced whole by `SetSandboxNetwork`, both as JSON.
//!
//! The JSON is an object of `allow_out` and `deny_out` (E2B's `allowOut`, `denyOut`:
//! lists of rules, see `validate::rule`), `allow_internet_access` (true: the public
//! internet; false or absent: nothing but what `allow_out` names) and `dns_servers`
//! (addresses), `egress_proxy` (E2B's `egressProxy`: an upstream SOCKS5 or HTTP proxy that
//! the sandbox's allowed TCP goes through, see [`EgressProxy`]). E2B's non-empty `rules`
//! (header injection) are refused; its settings of traffic into the sandbox (`allowPublicTraffic`,
//! `maskRequestHost`, `httpsPorts`) are kept as asked. Every rule is checked here, and a bad one
//! is a 400 naming it (`network.allow_out[2]`); at most `NETWORK_RULES_MAX` rules.
//!
//! Meaning ([`Policy::allows_addr`], [`Policy::allows_name`]), shared with the edge that
//! enforces it: default deny; an allow beats a deny (E2B's precedence); the public
//! internet never includes private, loopback, link-local (so 169.254.169.254) or other
//! special addresses: those open only to a CIDR rule inside them that names them.
//! The event keeps the JSON as asked, so logs written before this module replay as they
//! were (an empty network is the default: deny).

use super::Decided;
use super::scope::Scope;
use crate::validate;
pub use crate::validate::{NETWORK_RULES_MAX, Protocol, Rule, Target};
use crate::{Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::{Egress, Event, Right};
use serde_json::Value;
use std::net::IpAddr;

/// A sandbox's egress policy, checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Policy {
    pub allow_internet: bool,
    pub allow_out: Vec<Rule>,
    pub deny_out: Vec<Rule>,
    pub dns_servers: Vec<IpAddr>,
    /// Where the sandbox's allowed TCP goes, after its rules judged it: an upstream proxy.
    pub egress_proxy: Option<EgressProxy>,
}

/// How an upstream proxy is spoken to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyKind {
    /// SOCKS5 (RFC 1928; user and password by RFC 1929): E2B's, and the default.
    Socks5,
    /// HTTP `CONNECT` (user and password as `Proxy-Authorization: Basic`).
    Http,
}

/// An upstream proxy (E2B's `egressProxy`): `{"address": "[socks5://|http://]host:port",
/// "username"?, "password"?, "tls"?: {"enabled": true, "serverName"?, "caCert"?}}`.
/// A sandbox's TCP that its rules allow is carried by the edge to the proxy, which
/// connects on (told the name the sandbox resolved, where the edge's DNS proxy answered
/// it, so the proxy resolves it itself). The proxy is reached from the edge host, so its
/// address is checked as a sandbox's would be: never loopback, link-local (the metadata
/// service), multicast or unspecified; a private address only where an `allow_out`
/// block names it (which needs the project's ceiling `any`). The password and CA
/// certificate are never shown back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EgressProxy {
    pub kind: ProxyKind,
    /// A DNS name (lower case) or an address.
    pub host: String,
    pub port: u16,
    pub username: Option<String>,
    pub password: Option<String>,
    /// TLS to the proxy (`None`: plain TCP).
    pub tls: Option<ProxyTls>,
}

/// TLS to an upstream proxy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProxyTls {
    /// The name its certificate must carry (absent: its host).
    pub server_name: Option<String>,
    /// PEM certificates to trust (absent: the edge host's trusted roots).
    pub ca_cert: Option<String>,
}

/// At most this many bytes in a proxy's user name and password, each (SOCKS5's bound).
pub const PROXY_CREDENTIAL_MAX: usize = 255;

impl EgressProxy {
    /// `host:port` (an IPv6 host in brackets).
    pub fn authority(&self) -> String {
        if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        }
    }

    /// Its address as written: `socks5://host:port` or `http://host:port`.
    pub fn address(&self) -> String {
        let scheme = match self.kind {
            ProxyKind::Socks5 => "socks5",
            ProxyKind::Http => "http",
        };
        format!("{scheme}://{}", self.authority())
    }

    /// Its address, if a literal one.
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.parse().ok()
    }

    /// As JSON; `secrets`: with its password and CA certificate (what is logged), else
    /// without (what is shown).
    pub fn to_json(&self, secrets: bool) -> Value {
        let mut o = serde_json::Map::new();
        o.insert("address".into(), Value::String(self.address()));
        if let Some(u) = &self.username {
            o.insert("username".into(), Value::String(u.clone()));
        }
        if secrets && let Some(p) = &self.password {
            o.insert("password".into(), Value::String(p.clone()));
        }
        if let Some(t) = &self.tls {
            let mut tls = serde_json::Map::new();
            tls.insert("enabled".into(), Value::Bool(true));
            if let Some(n) = &t.server_name {
                tls.insert("server_name".into(), Value::String(n.clone()));
            }
            if secrets && let Some(c) = &t.ca_cert {
                tls.insert("ca_cert".into(), Value::String(c.clone()));
            }
            o.insert("tls".into(), Value::Object(tls));
        }
        Value::Object(o)
    }
}

/// Whether a proxy may never be at `ip`, whatever the rules: the edge host's own
/// loopback, link-local (the metadata service) and other addresses that are no one's.
fn never_a_proxy(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            a.is_loopback()
                || a.is_link_local()
                || a.is_unspecified()
                || a.is_multicast()
                || a.is_broadcast()
                || a.octets()[0] == 0
        }
        IpAddr::V6(a) => match a.to_ipv4_mapped() {
            Some(v4) => never_a_proxy(IpAddr::V4(v4)),
            None => a.is_loopback() || a.is_unspecified() || a.is_multicast() || (a.segments()[0] & 0xffc0) == 0xfe80,
        },
    }
}

fn string_field<'a>(
    o: &'a serde_json::Map<String, Value>,
    names: [&str; 2],
    field: &str,
) -> Result<Option<&'a str>, Rejection> {
    match names.iter().find_map(|n| o.get(*n)) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(_) => Err(invalid(field, format!("{field} must be a string"))),
    }
}

/// Checks an egress proxy's settings (`field`: `network.egress_proxy`).
fn egress_proxy(field: &str, v: &Value) -> Result<EgressProxy, Rejection> {
    let Value::Object(o) = v else {
        return Err(invalid(
            field,
            format!("{field} must be an object with an address (\"host:port\")"),
        ));
    };
    for k in o.keys() {
        if !matches!(k.as_str(), "address" | "username" | "password" | "tls") {
            let f = format!("{field}.{k}");
            return Err(invalid(
                &f,
                format!("{f} is not a proxy setting (address, username, password, tls)"),
            ));
        }
    }
    let fa = format!("{field}.address");
    let address = string_field(o, ["address", "address"], &fa)?.ok_or_else(|| {
        invalid(
            &fa,
            format!("{fa} is required: \"host:port\", optionally after socks5:// or http://"),
        )
    })?;
    let (kind, rest) = match address.split_once("://") {
        None => (ProxyKind::Socks5, address),
        Some(("socks5" | "socks5h", r)) => (ProxyKind::Socks5, r),
        Some(("http", r)) => (ProxyKind::Http, r),
        Some((other, _)) => {
            return Err(invalid(
                &fa,
                format!("{fa}: a proxy is socks5:// or http://, not {other}://"),
            ));
        }
    };
    let bad = || {
        invalid(
            &fa,
            format!("{fa}: {address:?} is not host:port (e.g. proxy.example.com:1080 or [2001:db8::1]:1080)"),
        )
    };
    let (host, port) = match rest.strip_prefix('[') {
        Some(r) => {
            let (h, p) = r.split_once("]:").ok_or_else(bad)?;
            h.parse::<std::net::Ipv6Addr>().map_err(|_| bad())?;
            (h, p)
        }
        None => match rest.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h, p),
            _ => return Err(bad()), // an IPv6 host goes in brackets
        },
    };
    let port: u16 = port.parse().ok().filter(|p| *p > 0).ok_or_else(bad)?;
    let host = match host.parse::<IpAddr>() {
        Ok(ip) => {
            if never_a_proxy(ip) {
                return Err(invalid(
                    &fa,
                    format!(
                        "{fa}: a proxy cannot be at {ip} (loopback, link-local, multicast or unspecified: the edge host's own, or no one's)"
                    ),
                ));
            }
            ip.to_string()
        }
        Err(_) => validate::host_name(&fa, host, 1)?,
    };
    let username = string_field(o, ["username", "username"], &format!("{field}.username"))?;
    let password = string_field(o, ["password", "password"], &format!("{field}.password"))?;
    for (name, v) in [("username", username), ("password", password)] {
        if v.is_some_and(|v| v.len() > PROXY_CREDENTIAL_MAX) {
            let f = format!("{field}.{name}");
            return Err(invalid(&f, format!("{f} is over {PROXY_CREDENTIAL_MAX} bytes")));
        }
    }
    if username == Some("") {
        let f = format!("{field}.username");
        return Err(invalid(
            &f,
            format!("{f} must not be empty (leave it out for a proxy without one)"),
        ));
    }
    if password.is_some() && username.is_none() {
        let f = format!("{field}.password");
        return Err(invalid(&f, format!("{f} needs a username")));
    }
    let tls = match o.get("tls") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => None,
        Some(Value::Bool(true)) => Some(ProxyTls::default()),
        Some(Value::Object(t)) => {
            let ft = format!("{field}.tls");
            let enabled = match t.get("enabled") {
                Some(Value::Bool(b)) => *b,
                None | Some(Value::Null) => true,
                Some(_) => {
                    return Err(invalid(
                        &format!("{ft}.enabled"),
                        format!("{ft}.enabled must be true or false"),
                    ));
                }
            };
            for k in t.keys() {
                if !matches!(
                    k.as_str(),
                    "enabled" | "serverName" | "server_name" | "caCert" | "ca_cert"
                ) {
                    let f = format!("{ft}.{k}");
                    return Err(invalid(
                        &f,
                        format!("{f} is not a TLS setting (enabled, server_name, ca_cert)"),
                    ));
                }
            }
            let fs = format!("{ft}.server_name");
            let server_name = string_field(t, ["serverName", "server_name"], &fs)?;
            let fc = format!("{ft}.ca_cert");
            let ca_cert = string_field(t, ["caCert", "ca_cert"], &fc)?;
            if !enabled {
                if server_name.is_some() || ca_cert.is_some() {
                    return Err(invalid(
                        &ft,
                        format!("{ft}: with enabled false no other TLS setting may be set"),
                    ));
                }
                None
            } else {
                let server_name = match server_name {
                    None => None,
                    Some(n) if n.parse::<IpAddr>().is_ok() => Some(n.to_string()),
                    Some(n) => Some(validate::host_name(&fs, n, 1)?),
                };
                if ca_cert.is_some_and(|c| !c.contains("-----BEGIN CERTIFICATE-----")) {
                    return Err(invalid(
                        &fc,
                        format!("{fc} must hold PEM certificates (-----BEGIN CERTIFICATE-----)"),
                    ));
                }
                Some(ProxyTls {
                    server_name,
                    ca_cert: ca_cert.map(str::to_string),
                })
            }
        }
        Some(_) => {
            let ft = format!("{field}.tls");
            return Err(invalid(&ft, format!("{ft} must be true, false or an object")));
        }
    };
    Ok(EgressProxy {
        kind,
        host,
        port,
        username: username.map(str::to_string),
        password: password.map(str::to_string),
        tls,
    })
}

fn invalid(field: &str, msg: String) -> Rejection {
    Rejection::field(K::Invalid, field, msg)
}

/// Checks network settings as JSON; `field` names them in a refusal (`network`).
pub fn parse(field: &str, json: &str) -> Result<Policy, Rejection> {
    if json.len() > validate::LIMITS.network_len {
        return Err(invalid(
            field,
            format!("network settings are over {} bytes", validate::LIMITS.network_len),
        ));
    }
    let v: Value = serde_json::from_str(json).map_err(|_| invalid(field, "network settings must be JSON".into()))?;
    let Value::Object(o) = v else {
        return Err(invalid(field, format!("{field} must be an object")));
    };
    let mut p = Policy::default();
    let mut count = 0usize;
    for (k, v) in &o {
        match k.as_str() {
            "allow_out" | "allowOut" | "deny_out" | "denyOut" => {
                let name = if k.starts_with("allow") {
                    "allow_out"
                } else {
                    "deny_out"
                };
                let f = format!("{field}.{name}");
                let list = match v {
                    Value::Null => continue,
                    Value::Array(a) => a,
                    _ => return Err(invalid(&f, format!("{f} must be a list of rules"))),
                };
                count += list.len();
                if count > NETWORK_RULES_MAX {
                    return Err(invalid(
                        &f,
                        format!("a network policy holds at most {NETWORK_RULES_MAX} rules"),
                    ));
                }
                let rules = list
                    .iter()
                    .enumerate()
                    .map(|(i, r)| validate::rule(&format!("{f}[{i}]"), r))
                    .collect::<Result<Vec<_>, _>>()?;
                if name == "allow_out" {
                    p.allow_out.extend(rules);
                } else {
                    p.deny_out.extend(rules);
                }
            }
            "allow_internet_access" | "allowInternetAccess" => match v {
                Value::Null => {}
                Value::Bool(b) => p.allow_internet = *b,
                _ => {
                    let f = format!("{field}.allow_internet_access");
                    return Err(invalid(&f, format!("{f} must be true or false")));
                }
            },
            "dns_servers" | "dnsServers" => {
                let f = format!("{field}.dns_servers");
                let list = match v {
                    Value::Null => continue,
                    Value::Array(a) if a.len() <= 10 => a,
                    _ => return Err(invalid(&f, format!("{f} must be a list of at most 10 addresses"))),
                };
                for (i, s) in list.iter().enumerate() {
                    let fi = format!("{f}[{i}]");
                    let ip = s
                        .as_str()
                        .and_then(|s| s.parse::<IpAddr>().ok())
                        .ok_or_else(|| invalid(&fi, format!("{fi} must be an IPv4 or IPv6 address")))?;
                    p.dns_servers.push(ip);
                }
            }
            "egress_proxy" | "egressProxy" if v.is_null() => {}
            "egress_proxy" | "egressProxy" => {
                p.egress_proxy = Some(egress_proxy(&format!("{field}.egress_proxy"), v)?);
            }
            // Settings of traffic into the sandbox (E2B's), kept as asked: not egress.
            "allowPublicTraffic" | "allow_public_traffic" if matches!(v, Value::Null | Value::Bool(_)) => {}
            "maskRequestHost" | "mask_request_host" if matches!(v, Value::Null | Value::String(_)) => {}
            "httpsPorts" | "https_ports"
                if v.is_null()
                    || v.as_array()
                        .is_some_and(|a| a.iter().all(|p| p.as_u64().is_some_and(|p| (1..=65535).contains(&p)))) => {}
            // E2B's per-host request rules (header injection): only an empty set is accepted.
            "rules" if matches!(v, Value::Null) || v.as_object().is_some_and(|r| r.is_empty()) => {}
            other => {
                let f = format!("{field}.{other}");
                return Err(invalid(
                    &f,
                    format!(
                        "{f} is not a network setting (allow_out, deny_out, allow_internet_access, dns_servers, egress_proxy)"
                    ),
                ));
            }
        }
    }
    if let Some(ip) = p.egress_proxy.as_ref().and_then(EgressProxy::ip)
        && is_special(ip)
        && !p.names_block_of(ip)
    {
        let f = format!("{field}.egress_proxy.address");
        return Err(invalid(
            &f,
            format!(
                "{f}: {ip} is a private address: a proxy there must also be named in allow_out (a block holding it, which needs the project's egress ceiling any)"
            ),
        ));
    }
    Ok(p)
}

/// Whether `ip` is outside the public internet: private, loopback, link-local (the
/// cloud metadata service's 169.254.169.254 too), unspecified, multicast, shared (CGN),
/// benchmarking, documentation or reserved, or an IPv6 unique-local, link-local,
/// site-local or mapped form of one of those.
pub fn is_special(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            let [x, y, ..] = a.octets();
            a.is_private()
                || a.is_loopback()
                || a.is_link_local()
                || a.is_unspecified()
                || a.is_multicast()
                || a.is_broadcast()
                || a.is_documentation()
                || x == 0
                || x >= 240
                || (x == 100 && (64..128).contains(&y))
                || (x == 198 && (18..20).contains(&y))
                || (x == 192 && y == 0 && a.octets()[2] == 0)
        }
        IpAddr::V6(a) => {
            if let Some(v4) = a.to_ipv4_mapped() {
                return is_special(IpAddr::V4(v4));
            }
            let s = a.segments()[0];
            a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (s & 0xfe00) == 0xfc00
                || (s & 0xffc0) == 0xfe80
                || (s & 0xffc0) == 0xfec0
                || s == 0x2001 && a.segments()[1] == 0x0db8
                || s == 0x0064 // NAT64 well-known prefix
        }
    }
}

fn bits(ip: IpAddr) -> (u128, u8) {
    match ip {
        IpAddr::V4(a) => (u32::from(a) as u128, 32),
        IpAddr::V6(a) => (u128::from(a), 128),
    }
}

/// Whether block `net/prefix` holds `ip`.
pub fn contains(net: IpAddr, prefix: u8, ip: IpAddr) -> bool {
    let ((n, w), (x, w2)) = (bits(net), bits(ip));
    if w != w2 {
        return false;
    }
    let shift = w - prefix;
    shift as u32 >= 128 || (n >> shift) == (x >> shift)
}

fn covers(rule: &Rule, port: u16, proto: Protocol) -> bool {
    let proto_ok = rule.protocol == Protocol::Any || proto == Protocol::Any || rule.protocol == proto;
    let port_ok = rule.ports.is_empty() || rule.ports.iter().any(|(lo, hi)| (*lo..=*hi).contains(&port));
    proto_ok && port_ok
}

/// Whether a rule's name matches `name` (exactly, or below it for `*.`).
fn name_matches(rule: &Rule, name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    match &rule.target {
        Target::Domain {
            name: n,
            wildcard: false,
        } => *n == name,
        Target::Domain {
            name: n,
            wildcard: true,
        } => name.strip_suffix(n.as_str()).is_some_and(|h| h.ends_with('.')),
        Target::Cidr { .. } => false,
    }
}

/// Whether an address rule holds `ip`; a special address only to a rule whose block
/// lies inside special space (it names it: 0.0.0.0/0 does not).
fn addr_matches(rule: &Rule, ip: IpAddr) -> bool {
    match rule.target {
        Target::Cidr { addr, prefix } => {
            contains(addr, prefix, ip) && (!is_special(ip) || is_special(addr) && prefix >= 8)
        }
        Target::Domain { .. } => false,
    }
}

impl Policy {
    /// Whether the sandbox may reach `ip` on `port` over `proto` (by address; a name's
    /// resolved addresses are added by the edge's DNS proxy under `allows_name`).
    pub fn allows_addr(&self, ip: IpAddr, port: u16, proto: Protocol) -> bool {
        let allowed = self
            .allow_out
            .iter()
            .any(|r| addr_matches(r, ip) && covers(r, port, proto));
        if allowed {
            return true; // an allow beats a deny
        }
        let denied = self
            .deny_out
            .iter()
            .any(|r| addr_matches(r, ip) && covers(r, port, proto));
        self.allow_internet && !is_special(ip) && !denied
    }

    /// Whether an allow rule's block names `ip` (in special space: explicitly), on TCP.
    /// What a proxy at a private address needs.
    pub fn names_block_of(&self, ip: IpAddr) -> bool {
        self.allow_out
            .iter()
            .any(|r| addr_matches(r, ip) && (r.protocol != Protocol::Udp))
    }

    /// Whether the edge may carry this sandbox's traffic to a proxy at `ip` (its
    /// name resolved on the edge): never the host's own or no one's addresses, a private
    /// one only where an allow rule's block names it.
    pub fn proxy_reachable_at(&self, ip: IpAddr) -> bool {
        !never_a_proxy(ip) && (!is_special(ip) || self.names_block_of(ip))
    }

    /// Whether the sandbox may reach `name` on `port` over `proto` (an allow rule naming
    /// it and the port, or the public internet without a deny rule that names both; never
    /// DNS or DNS over TLS through the internet rule). What a connection to a name alone
    /// (a proxy resolves it) is judged by.
    pub fn allows_name_on(&self, name: &str, port: u16, proto: Protocol) -> bool {
        if self
            .allow_out
            .iter()
            .any(|r| name_matches(r, name) && covers(r, port, proto))
        {
            return true;
        }
        self.allow_internet
            && !matches!(port, 53 | 853)
            && !self
                .deny_out
                .iter()
                .any(|r| name_matches(r, name) && covers(r, port, proto))
    }

    /// Whether the sandbox may resolve and then reach `name` (on some port).
    pub fn allows_name(&self, name: &str) -> bool {
        if self.allow_out.iter().any(|r| name_matches(r, name)) {
            return true;
        }
        self.allow_internet
            && !self
                .deny_out
                .iter()
                .any(|r| name_matches(r, name) && r.ports.is_empty())
    }
}

/// A rule's target as written: `pkgs.example.com`, `*.example.com`, `10.0.0.0/8`,
/// `2001:db8::/32`, or a lone address.
fn target_text(t: &Target) -> String {
    match t {
        Target::Domain { name, wildcard: false } => name.clone(),
        Target::Domain { name, wildcard: true } => format!("*.{name}"),
        Target::Cidr { addr, prefix } if *prefix == if addr.is_ipv4() { 32 } else { 128 } => addr.to_string(),
        Target::Cidr { addr, prefix } => format!("{addr}/{prefix}"),
    }
}

/// A rule as `parse` reads it back: a string where one says it all (`TARGET` or
/// `TARGET:PORT` for any transport), else an object.
fn rule_json(r: &Rule) -> Value {
    let to = target_text(&r.target);
    match (r.ports.as_slice(), r.protocol) {
        ([], Protocol::Any) => Value::String(to),
        ([(lo, hi)], Protocol::Any) if lo == hi => Value::String(match r.target {
            Target::Cidr {
                addr: IpAddr::V6(_), ..
            } => format!("[{to}]:{lo}"),
            _ => format!("{to}:{lo}"),
        }),
        (ports, protocol) => serde_json::json!({
            "to": to,
            "ports": ports
                .iter()
                .map(|(lo, hi)| if lo == hi { Value::from(*lo) } else { Value::from(format!("{lo}-{hi}")) })
                .collect::<Vec<_>>(),
            "protocol": match protocol {
                Protocol::Any => "any",
                Protocol::Tcp => "tcp",
                Protocol::Udp => "udp",
            },
        }),
    }
}

impl Policy {
    /// The policy as canonical JSON (`allow_internet_access`, `allow_out`, `deny_out`,
    /// `dns_servers`), which [`parse`] reads back to the same policy: what the REST API
    /// and the CLI show, whichever spelling (E2B's camelCase included) it was set in.
    /// With `egress_proxy` (null: none) whole, its password and CA certificate
    /// included: what a command may carry. [`Policy::shown_json`] is what users see.
    pub fn to_json(&self) -> Value {
        self.json(true)
    }

    /// [`Policy::to_json`] without the proxy's password and CA certificate: what the
    /// API and the CLI show.
    pub fn shown_json(&self) -> Value {
        self.json(false)
    }

    fn json(&self, secrets: bool) -> Value {
        serde_json::json!({
            "allow_internet_access": self.allow_internet,
            "allow_out": self.allow_out.iter().map(rule_json).collect::<Vec<_>>(),
            "deny_out": self.deny_out.iter().map(rule_json).collect::<Vec<_>>(),
            "dns_servers": self.dns_servers.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            "egress_proxy": self.egress_proxy.as_ref().map(|p| p.to_json(secrets)),
        })
    }

    /// The policy of a sandbox whose logged network settings are `json` (empty: none,
    /// which is deny). Settings that no longer parse (never logged: every write is
    /// checked) read as deny.
    pub fn of_logged(json: Option<&str>) -> Policy {
        json.filter(|j| !j.trim().is_empty())
            .and_then(|j| parse("network", j).ok())
            .unwrap_or_default()
    }
}

impl Policy {
    /// The least egress ceiling that holds this policy, with the field that needs it
    /// (`field` names the policy): `None` for a policy that allows nothing, `Any` for one
    /// whose allow rule names a private (special) block.
    pub fn needs(&self, field: &str) -> (Egress, String) {
        if let Some(i) = self
            .allow_out
            .iter()
            .position(|r| matches!(r.target, Target::Cidr { addr, prefix } if is_special(addr) && prefix >= 8))
        {
            return (Egress::Any, format!("{field}.allow_out[{i}]"));
        }
        if self.allow_internet {
            return (Egress::Public, format!("{field}.allow_internet_access"));
        }
        if self.egress_proxy.is_some() {
            return (Egress::Public, format!("{field}.egress_proxy"));
        }
        if !self.allow_out.is_empty() {
            return (Egress::Public, format!("{field}.allow_out[0]"));
        }
        (Egress::None, field.to_string())
    }
}

/// Checks network settings and that `project`'s egress ceiling holds them (a 403 naming
/// the rule that goes beyond it).
pub(super) fn within_ceiling(s: &Scope, project: &str, field: &str, json: &str) -> Result<Policy, Rejection> {
    let p = parse(field, json)?;
    let ceiling = s.state.egress_ceiling(project);
    let (need, at) = p.needs(field);
    if need > ceiling {
        return Err(Rejection::field(
            K::Forbidden,
            &at,
            format!(
                "{at} needs egress {:?}, above project {project}'s ceiling {:?} (set by the project's owner)",
                need.as_str(),
                ceiling.as_str()
            ),
        ));
    }
    Ok(p)
}

/// `SetProjectNetwork`: a project's egress ceiling and default policy.
pub(super) fn set_project(
    s: &Scope,
    project: &str,
    ceiling: Egress,
    default_network: Option<&str>,
) -> Result<Decided, Rejection> {
    let policy = default_network.map(|d| parse("default_network", d)).transpose()?;
    s.project_in_scope("project", project)?;
    s.who.require(Right::QuotaWrite)?;
    let p = &s.state.iam.projects[project];
    let current = s.state.egress_ceiling(project);
    // A caller may lower its own project's ceiling (and set its default), not raise it.
    if project == s.who.project && p.parent.is_some() && !s.who.is_system() && ceiling > current {
        return Err(Rejection::field(
            K::Forbidden,
            "ceiling",
            "a caller cannot raise its own project's egress ceiling; ask a parent project's admin",
        ));
    }
    if let Some(parent) = p.parent.as_deref() {
        let bound = s.state.egress_ceiling(parent);
        if ceiling > bound {
            return Err(Rejection::field(
                K::Forbidden,
                "ceiling",
                format!(
                    "egress ceiling {:?} is above the parent project's {:?}",
                    ceiling.as_str(),
                    bound.as_str()
                ),
            ));
        }
    }
    if let Some(policy) = &policy {
        let (need, at) = policy.needs("default_network");
        if need > ceiling {
            return Err(Rejection::field(
                K::Invalid,
                &at,
                format!(
                    "{at} needs egress {:?}, above the ceiling {:?}",
                    need.as_str(),
                    ceiling.as_str()
                ),
            ));
        }
    }
    Ok(Decided::one(
        project,
        project,
        Event::ProjectNetworkSet(pb::ProjectNetworkSet {
            project: project.to_string(),
            ceiling: ceiling.as_str().to_string(),
            default_network: default_network.unwrap_or_default().to_string(),
        }),
    ))
}

/// `SetSandboxNetwork`: replaces the sandbox's whole network policy.
pub(super) fn set(s: &Scope, sandbox: &str, network: &str) -> Result<Decided, Rejection> {
    parse("network", network)?;
    let x = s.live_sandbox(sandbox, Right::SandboxWrite)?;
    within_ceiling(s, &x.project, "network", network)?;
    Ok(Decided::one(
        &x.project,
        sandbox,
        Event::SandboxNetworkSet(pb::SandboxNetworkSet {
            id: sandbox.to_string(),
            network: network.to_string(),
        }),
    ))
}
