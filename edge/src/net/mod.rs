//! Sandbox networking on the edge: each container sandbox gets a network namespace of its
//! own joined to the host by a veth, NAT out through the host, IPv4 and IPv6, and egress
//! only where its policy (`opendsec_commands::decide::network`) allows: default deny,
//! enforced by nftables and a DNS proxy. A VM's veth goes into the VM's own namespace
//! instead (`attach_machine`: IPv4, its guest masqueraded behind it).
//!
//! The rooms, by job:
//! - `addrs.rs`: the address pools (default [`DEFAULT_POOL_V4`], [`DEFAULT_POOL_V6`]),
//!   one IPv4 and one IPv6 address per sandbox, claimed host-wide so several edges on one
//!   host never share one, recorded under `/run/opendsec/net` so a restarted edge keeps
//!   them; and the edge's gateway address.
//! - `link.rs`: a named namespace per sandbox (`/run/netns/opendsec-<tag>-<slot>`) with
//!   `eth0` (its addresses, a default route on-link via the gateway) and the host end
//!   `od<tag><slot>`, over rtnetlink.
//! - `rules.rs` (pure): a policy as the sandbox's chain, the edge's base chains.
//! - `nft.rs`: scripts applied whole by `nft -f -` (one transaction each).
//! - `drops.rs`: the last sampled drops of each sandbox (what its policy refused), from
//!   the kernel log.
//! - `dns.rs`: the DNS proxy on the gateway, which answers each sandbox only for names
//!   its policy allows and opens the answers' addresses in its learned sets.
//! - `relay.rs`: the relay that carries a sandbox's allowed TCP through an upstream proxy
//!   (its policy's `egress_proxy`, or the edge's own, [`NetConfig::egress_proxy`]).
//!
//! One table per edge, `inet opendsec_<name>_<tag>` (`tag`: a hash of the edge's name
//! and data directory, so two edges on one host never share a table, veth or
//! namespace): `prerouting` (before NAT) sends what comes from a sandbox's veth to its
//! chain (`sandboxes`, a verdict map by interface), so it is judged by the destination
//! the sandbox asked for; `proxy` redirects the TCP a proxy carries to the relay;
//! `forward` accepts what goes to a sandbox only as part of a connection it opened
//! (nothing opens connections into a sandbox: the edge reaches its agent over a Unix
//! socket); `input` lets a sandbox reach only the DNS proxy on the gateway and the relay
//! as redirected (never the edge's HTTP proxy, the peer port or any other host service);
//! `postrouting` masquerades the pools. A sandbox's chain `sb<slot>` drops
//! spoofed sources, accepts its connections of the current policy generation, then runs
//! its policy (see `rules.rs`). A policy update replaces the chain whole with a new
//! generation in one transaction: a connection the new policy forbids stops at its next
//! packet from the sandbox. Sandboxes never reach each other (pool addresses are
//! special, and nothing is let into a sandbox that it did not open).
//!
//! Lifecycle: a sandbox's (or warm container's) namespace is made before its container
//! (`attach`), with a chain that drops everything; its policy is applied before it is
//! reported running (`apply`, again on each `SandboxNetworkSet` through the reconcile
//! loop); a warm container's slot is handed to the sandbox that claims it
//! (`hand_over`); `detach` removes namespace, veth, chain, sets and addresses. At start
//! the edge takes up what an earlier run left (`adopt`): chains of sandboxes that still
//! run stay in force until their policy is applied again, everything else of its tag is
//! removed.
//!
//! **Architecture Invariant:** no packet from a sandbox leaves its veth without passing
//! its chain, and a veth with no chain drops everything: a sandbox is never open, even
//! for an instant, between its creation and its policy.
//!
//! The host: IPv4 forwarding is turned on (and IPv6 forwarding, after setting
//! `accept_ra=2` on interfaces that accept router advertisements, so they keep doing
//! so); a host firewall that drops forwarded traffic (Docker's `FORWARD` policy, for
//! one) stops sandbox egress too. Connection marks of sandbox connections are this
//! room's.

pub mod addrs;
pub mod dns;
pub mod drops;
mod host;
mod libnft;
pub mod link;
mod names;
pub mod nft;
mod observe;
pub mod relay;
pub mod rules;

pub use host::forget;
use host::*;

use addrs::{Pool, Slot};
use link::LinkCounters;
use opendsec_commands::network::{Policy, parse};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

/// The names a sandbox was answered, by address, each until its answer expires.
type AnsweredNames = HashMap<IpAddr, (String, Instant)>;

/// A sandbox's stand-in addresses, both ways (see `rules::STANDINS`).
#[derive(Default)]
struct Standins {
    by_name: HashMap<String, Ipv4Addr>,
    by_addr: HashMap<Ipv4Addr, String>,
    next: u32,
}

/// The last reading of every sandbox's link and drop counters, and when it was taken.
type CountersTaken = (Instant, BTreeMap<String, LinkCounters>, BTreeMap<String, u64>);

/// Names kept per sandbox for the proxy relay (answers expire with their TTL; past this
/// many, the expired go, and if none had, all).
const NAMES_KEPT: usize = 4096;

/// Where addresses and slots are recorded (tmpfs: as long-lived as the namespaces).
pub const DEFAULT_STATE_DIR: &str = "/run/opendsec/net";
/// The default IPv4 pool: inside 10/8, away from the blocks home routers, clouds' default
/// VPCs (172.31/16, 10.0/16, GCP's 10.128/9 regions), Kubernetes (10.96/12, 10.244/16,
/// k3s's 10.42-43/16), Docker (172.17/16 and up) and Podman (10.88/16) use. Only the
/// addresses in use are routed (one /32 per sandbox), so an overlap with a LAN costs
/// only those addresses.
pub const DEFAULT_POOL_V4: (Ipv4Addr, u8) = (Ipv4Addr::new(10, 231, 0, 0), 16);
/// The default IPv6 pool: a unique-local /64 ("odse" in its global id).
pub const DEFAULT_POOL_V6: (Ipv6Addr, u8) = (Ipv6Addr::new(0xfd6f, 0x6473, 0x6500, 0, 0, 0, 0, 0), 64);

/// How the edge networks its container sandboxes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NetConfig {
    pub pool_v4: (Ipv4Addr, u8),
    /// `None`: IPv4 only (also where the host has IPv6 turned off).
    pub pool_v6: Option<(Ipv6Addr, u8)>,
    /// The resolvers the DNS proxy asks; empty: the host's `/etc/resolv.conf` ones.
    pub upstream_dns: Vec<SocketAddr>,
    pub state_dir: PathBuf,
    /// The edge's own upstream proxy (sites whose only way out is a proxy): every
    /// sandbox's allowed TCP to public addresses goes through it, and a sandbox's own
    /// proxy is reached through it.
    pub egress_proxy: Option<opendsec_commands::network::EgressProxy>,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            pool_v4: DEFAULT_POOL_V4,
            pool_v6: Some(DEFAULT_POOL_V6),
            upstream_dns: Vec::new(),
            state_dir: DEFAULT_STATE_DIR.into(),
            egress_proxy: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("sandbox network: {0}")]
    Config(String),
    #[error("sandbox network: {0}")]
    Exhausted(String),
    #[error("sandbox network link: {0}")]
    Link(String),
    #[error("nftables: {0}")]
    Nft(String),
    #[error("sandbox network: {context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error("sandbox {0} has no network on this edge")]
    NotAttached(String),
}

impl NetError {
    pub(crate) fn io(context: impl Into<String>, source: std::io::Error) -> NetError {
        NetError::Io {
            context: context.into(),
            source,
        }
    }
}

/// What a sandbox's container is given of its network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    /// The namespace the container joins.
    pub netns: PathBuf,
    /// Bound read-only at `/etc/resolv.conf`: the proxy on the gateway.
    pub resolv_conf: PathBuf,
    /// Bound read-only at `/etc/hosts`: localhost and the sandbox's name.
    pub hosts: PathBuf,
    /// A sysfs of its namespace, bound read-only at `/sys` (see `link::mount_sysfs`).
    pub sysfs: PathBuf,
    pub slot: Slot,
}

/// What the DNS proxy knows of a sandbox.
#[derive(Clone, Debug)]
pub struct SandboxDns {
    pub slot: u32,
    pub policy: Arc<Policy>,
}

/// A sandbox's traffic: its veth's counters and what its policy dropped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetCounters {
    pub link: LinkCounters,
    /// Packets its chain dropped (connection attempts and packets its policy refuses).
    pub dropped_packets: u64,
}

/// A sandbox's network as its metrics show it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetSample {
    pub counters: NetCounters,
    /// What it last tried to reach and was refused (sampled), oldest first.
    pub recent_drops: Vec<drops::Drop>,
}

struct Attached {
    slot: Slot,
    /// The policy last applied (`None`: not known to this run yet).
    applied: Option<Option<String>>,
    sets: BTreeSet<String>,
}

/// The edge's sandbox network.
pub struct Network {
    tag: String,
    /// "od" + the tag: 7 bytes, leaving 8 digits for the slot within IFNAMSIZ.
    veth_prefix: String,
    table: String,
    gateway: Ipv4Addr,
    pool_v4: (Ipv4Addr, u8),
    pool_v6: Option<(Ipv6Addr, u8)>,
    pool: Pool,
    state_dir: PathBuf,
    files: PathBuf,
    upstream: Vec<SocketAddr>,
    attached: Mutex<BTreeMap<String, Attached>>,
    by_addr: RwLock<HashMap<IpAddr, SandboxDns>>,
    /// One sandbox's rules change at a time (generations in order).
    applying: Mutex<()>,
    generation: AtomicU32,
    counters: Mutex<Option<CountersTaken>>,
    dns_sockets: Mutex<Option<dns::Sockets>>,
    relay: Mutex<Option<relay::Listeners>>,
    relay_ports: (u16, u16),
    edge_proxy: Option<opendsec_commands::network::EgressProxy>,
    /// Per slot, the name the DNS proxy last answered each address for (what the relay
    /// asks a proxy for), with when it expires.
    names: Mutex<HashMap<u32, AnsweredNames>>,
    /// Per slot, the stand-in addresses its DNS answers hold (see `rules::STANDINS`).
    standins: Mutex<HashMap<u32, Standins>>,
    drops: Arc<drops::DropLog>,
    /// Held while this edge runs (an flock): no second edge with its tag.
    _lock: std::fs::File,
}

impl Network {
    /// Sets up the network of edge `name` (data directory `data_dir`): its table, its
    /// share of the pools, its gateway and the DNS proxy's sockets; `files` is where the
    /// files bound into sandboxes are written (a directory only the edge writes).
    pub fn open(cfg: &NetConfig, name: &str, data_dir: &Path, files: &Path) -> Result<Arc<Network>, NetError> {
        nft::binary()?;
        let tag = tag_of(name, data_dir);
        let clean: String = name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .take(32)
            .collect();
        let table = format!("opendsec_{clean}_{tag}");
        let pool_v6 = match cfg.pool_v6 {
            Some(p) if ipv6_usable() => Some(p),
            Some(_) => {
                tracing::warn!("this host has IPv6 turned off: sandboxes get IPv4 only");
                None
            }
            None => None,
        };
        let edges = cfg.state_dir.join("edges");
        std::fs::create_dir_all(&edges).map_err(|e| NetError::io(format!("creating {}", edges.display()), e))?;
        let lock_path = edges.join(format!("{tag}.lock"));
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| NetError::io(format!("opening {}", lock_path.display()), e))?;
        // SAFETY: flock on an fd we own.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            return Err(NetError::Config(format!(
                "another edge named {name} with data directory {} runs on this host",
                data_dir.display()
            )));
        }
        let pool = Pool::open(&cfg.state_dir, &tag, cfg.pool_v4, pool_v6)?;
        enable_forwarding(pool_v6.is_some())?;
        let gateway = pool.gateway()?;
        std::fs::create_dir_all(files.join("hosts"))
            .map_err(|e| NetError::io(format!("creating {}", files.display()), e))?;
        std::fs::write(files.join("resolv.conf"), format!("nameserver {gateway}\n"))
            .map_err(|e| NetError::io("writing the sandboxes' resolv.conf", e))?;
        std::fs::write(
            data_dir.join(OWNER_FILE),
            format!("{tag} {table} {}\n", files.display()),
        )
        .map_err(|e| NetError::io("writing the network's owner file", e))?;
        let upstream = if cfg.upstream_dns.is_empty() {
            dns::nameservers(&std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default())
        } else {
            cfg.upstream_dns.clone()
        };
        if upstream.is_empty() {
            tracing::warn!(
                "no upstream DNS resolver (none given, none in /etc/resolv.conf): sandboxes resolve no names"
            );
        }
        let drops = drops::DropLog::follow(&table);
        let relay = relay::Listeners::bind(gateway, pool_v6.is_some())?;
        let net = Network {
            table,
            gateway,
            pool_v4: cfg.pool_v4,
            pool_v6,
            pool,
            state_dir: cfg.state_dir.clone(),
            files: files.to_path_buf(),
            upstream,
            attached: Mutex::new(BTreeMap::new()),
            by_addr: RwLock::new(HashMap::new()),
            applying: Mutex::new(()),
            // Marks differ from the last run's, whose connections then face the rules once.
            generation: AtomicU32::new((opendsec_edge_api::now_ms() / 1000) as u32 | 1),
            counters: Mutex::new(None),
            dns_sockets: Mutex::new(Some(dns::Sockets::bind(gateway)?)),
            relay_ports: relay.ports(),
            relay: Mutex::new(Some(relay)),
            edge_proxy: cfg.egress_proxy.clone(),
            names: Mutex::new(HashMap::new()),
            standins: Mutex::new(HashMap::new()),
            drops,
            veth_prefix: format!("od{tag}"),
            tag,
            _lock: lock,
        };
        nft::apply(&rules::base_script(&net.edge_place()))?;
        tracing::info!(table = %net.table, %gateway, pool_v4 = %format!("{}/{}", net.pool_v4.0, net.pool_v4.1), ipv6 = net.pool_v6.is_some(), upstream = ?net.upstream, egress_proxy = ?net.edge_proxy.as_ref().map(|p| p.address()), "sandbox network ready");
        Ok(Arc::new(net))
    }

    fn edge_place(&self) -> rules::EdgePlace<'_> {
        rules::EdgePlace {
            table: &self.table,
            veth_prefix: self.veth_prefix_str(),
            gateway: self.gateway,
            pool_v4: self.pool_v4,
            pool_v6: self.pool_v6,
            relay_ports: self.relay_ports,
            edge_proxy: self.edge_proxy.is_some(),
        }
    }

    fn veth_prefix_str(&self) -> &str {
        &self.veth_prefix
    }

    fn veth(&self, slot: u32) -> String {
        format!("{}{slot}", self.veth_prefix_str())
    }

    fn netns_prefix(&self) -> String {
        format!("opendsec-{}-", self.tag)
    }

    fn netns(&self, slot: u32) -> String {
        format!("{}{slot}", self.netns_prefix())
    }

    /// The edge's table (`inet`).
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The gateway every sandbox routes through (and resolves names at).
    pub fn gateway(&self) -> Ipv4Addr {
        self.gateway
    }

    /// The resolvers the DNS proxy asks.
    pub fn upstream(&self) -> &[SocketAddr] {
        &self.upstream
    }

    /// The sandbox at address `ip`, as the DNS proxy sees it.
    pub fn sandbox_at(&self, ip: IpAddr) -> Option<SandboxDns> {
        let ip = match ip {
            IpAddr::V6(a) => a.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        self.by_addr.read().expect("address lock").get(&ip).cloned()
    }

    /// Serves the DNS proxy and the proxy relay until the future is dropped.
    pub async fn serve(self: Arc<Self>) {
        let sockets = self.dns_sockets.lock().expect("dns lock").take();
        let relay = self.relay.lock().expect("relay lock").take();
        let dns = async {
            if let Some(s) = sockets {
                dns::serve(self.clone(), s).await
            }
        };
        let relay = async {
            if let Some(l) = relay {
                relay::serve(self.clone(), l).await
            }
        };
        tokio::join!(dns, relay);
    }

    /// Indexes slot `slot`'s addresses (both families) under `policy`.
    fn index(&self, slot: &Slot, policy: Arc<Policy>) {
        let mut by_addr = self.by_addr.write().expect("address lock");
        for ip in std::iter::once(IpAddr::V4(slot.v4)).chain(slot.v6.map(IpAddr::V6)) {
            by_addr.insert(
                ip,
                SandboxDns {
                    slot: slot.slot,
                    policy: policy.clone(),
                },
            );
        }
    }

    fn place<'a>(&'a self, slot: &Slot, veth: &'a str) -> rules::SandboxPlace<'a> {
        rules::SandboxPlace {
            table: &self.table,
            slot: slot.slot,
            veth,
            v4: slot.v4,
            v6: slot.v6,
            standins: None,
        }
    }

    fn hosts_path(&self, slot: u32) -> PathBuf {
        self.files.join("hosts").join(slot.to_string())
    }

    fn sysfs_path(&self, slot: u32) -> PathBuf {
        self.files.join("sys").join(slot.to_string())
    }

    fn policy_path(&self, slot: u32) -> PathBuf {
        self.state_dir
            .join("edges")
            .join(&self.tag)
            .join(format!("{slot}.policy"))
    }

    /// Makes `owner`'s namespace, veth and addresses, with a chain that drops
    /// everything; `hostname` goes into its `/etc/hosts`. On error nothing is left.
    pub fn attach(&self, owner: &str, hostname: &str) -> Result<Attachment, NetError> {
        let slot = self.claim(owner)?;
        let made = self.attach_slot(&slot, hostname);
        if made.is_err() {
            self.teardown(&slot, &BTreeSet::new());
        }
        made
    }

    fn attach_slot(&self, slot: &Slot, hostname: &str) -> Result<Attachment, NetError> {
        let veth = self.veth(slot.slot);
        // The chain first: the veth is never without one.
        let script = rules::sandbox_script(&self.place(slot, &veth), &Policy::default(), 0, &BTreeSet::new());
        nft::apply(&script)?;
        let plan = link::LinkPlan {
            netns: self.netns(slot.slot),
            veth: veth.clone(),
            gateway: self.gateway,
            v4: slot.v4,
            v6: slot.v6,
        };
        let netns = link::create(&plan)?;
        let sysfs = self.sysfs_path(slot.slot);
        link::mount_sysfs(&netns, &sysfs)?;
        let hosts = self.hosts_path(slot.slot);
        std::fs::write(&hosts, hosts_text(hostname, slot)).map_err(|e| NetError::io("writing /etc/hosts", e))?;
        self.record_attached(slot);
        Ok(Attachment {
            netns,
            resolv_conf: self.files.join("resolv.conf"),
            hosts,
            sysfs,
            slot: slot.clone(),
        })
    }

    /// Gives microVM `owner` a link into its namespace `netns` (where its QEMU runs, the
    /// guest behind its tap): IPv4 only, with a chain that drops everything; inside the
    /// namespace, what the guest sends out is masqueraded to the slot's address (so its
    /// chain applies) and DNS to the tap's host side (`guest_dns`, the same in every VM
    /// namespace, so a restored or forked guest keeps its resolver) goes to the proxy.
    /// On error nothing is left.
    pub fn attach_machine(&self, owner: &str, netns: &Path, tap: &str, guest_dns: Ipv4Addr) -> Result<(), NetError> {
        let mut slot = self.claim(owner)?;
        // The guest has no IPv6 address: the VM's link carries none either.
        slot.v6 = None;
        let made = (|| {
            let veth = self.veth(slot.slot);
            nft::apply(&rules::sandbox_script(
                &self.place(&slot, &veth),
                &Policy::default(),
                0,
                &BTreeSet::new(),
            ))?;
            let plan = link::LinkPlan {
                netns: String::new(),
                veth,
                gateway: self.gateway,
                v4: slot.v4,
                v6: None,
            };
            link::join(&plan, netns)?;
            link::sysctl_in(netns, "/proc/sys/net/ipv4/ip_forward", "1")?;
            nft::apply_in(Some(netns), &rules::machine_script(tap, guest_dns, self.gateway))
        })();
        if let Err(e) = made {
            self.teardown(&slot, &BTreeSet::new());
            return Err(e);
        }
        self.record_attached(&slot);
        Ok(())
    }

    /// Addresses for `owner`, which has no network here yet.
    fn claim(&self, owner: &str) -> Result<Slot, NetError> {
        if self.attached.lock().expect("attached lock").contains_key(owner) {
            return Err(NetError::Config(format!("{owner} has a network on this edge already")));
        }
        self.pool.claim(owner)
    }

    /// `slot` is attached, under the default policy (its chain drops everything).
    fn record_attached(&self, slot: &Slot) {
        self.attached.lock().expect("attached lock").insert(
            slot.owner.clone(),
            Attached {
                slot: slot.clone(),
                applied: Some(None),
                sets: BTreeSet::new(),
            },
        );
        self.index(slot, Arc::new(Policy::default()));
    }

    /// `from`'s network now belongs to `to` (a warm container claimed by sandbox `to`),
    /// whose name its `/etc/hosts` now holds (rewritten in place: the container's bind
    /// sees it).
    pub fn hand_over(&self, from: &str, to: &str) -> Result<(), NetError> {
        let mut all = self.attached.lock().expect("attached lock");
        if all.contains_key(to) {
            return Err(NetError::Config(format!("{to} has a network on this edge already")));
        }
        let mut a = all
            .remove(from)
            .ok_or_else(|| NetError::NotAttached(from.to_string()))?;
        a.slot = self.pool.hand_over(&a.slot, to)?;
        let hosts = self.hosts_path(a.slot.slot);
        std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&hosts)
            .and_then(|mut f| std::io::Write::write_all(&mut f, hosts_text(to, &a.slot).as_bytes()))
            .map_err(|e| NetError::io(format!("rewriting {}", hosts.display()), e))?;
        all.insert(to.to_string(), a);
        Ok(())
    }

    /// Applies `network` (the policy as logged; `None`: the default, deny) to `owner`:
    /// its chain replaced whole under a new generation, in one transaction. A policy this
    /// edge cannot read (the log checked it, so a newer schema) is enforced as deny.
    pub fn apply(&self, owner: &str, network: Option<&str>) -> Result<(), NetError> {
        let _one = self.applying.lock().expect("applying lock");
        let (slot, old_sets) = {
            let all = self.attached.lock().expect("attached lock");
            let a = all.get(owner).ok_or_else(|| NetError::NotAttached(owner.to_string()))?;
            (a.slot.clone(), a.sets.clone())
        };
        let policy = match network.filter(|n| !n.is_empty()) {
            None => Policy::default(),
            Some(json) => parse("network", json).unwrap_or_else(|e| {
                tracing::error!(sandbox = %owner, error = ?e, "a network policy this edge cannot read is enforced as deny; upgrade this edge");
                Policy::default()
            }),
        };
        let standins = self.standins_kept(slot.slot, &policy);
        let mut sets = rules::learned_sets(slot.slot, &policy);
        if standins.is_some() {
            sets.insert(rules::standin_set(slot.slot));
        }
        let stale: BTreeSet<String> = old_sets.difference(&sets).cloned().collect();
        let generation = self.generation.fetch_add(1, Ordering::Relaxed).max(1);
        let veth = self.veth(slot.slot);
        let place = rules::SandboxPlace {
            standins: standins.as_deref(),
            ..self.place(&slot, &veth)
        };
        nft::apply(&rules::sandbox_script(&place, &policy, generation, &stale))?;
        let _ = std::fs::write(self.policy_path(slot.slot), network.unwrap_or_default());
        self.index(&slot, Arc::new(policy));
        if let Some(a) = self.attached.lock().expect("attached lock").get_mut(owner) {
            a.applied = Some(network.map(str::to_string).filter(|n| !n.is_empty()));
            a.sets = sets;
        }
        Ok(())
    }

    /// Every sandbox with a network here, with the policy last applied (`None`: not known
    /// to this run yet). What the reconcile loop compares with the slice.
    pub fn applied(&self) -> BTreeMap<String, Option<Option<String>>> {
        self.attached
            .lock()
            .expect("attached lock")
            .iter()
            .map(|(k, a)| (k.clone(), a.applied.clone()))
            .collect()
    }

    fn teardown(&self, slot: &Slot, sets: &BTreeSet<String>) {
        let veth = self.veth(slot.slot);
        let scripts = rules::remove_scripts(&self.table, slot.slot, &veth, sets);
        // All in one transaction where all of it is there (the usual case); else each on
        // its own, so what is there goes even where some of it is gone already.
        if nft::apply(&scripts.concat()).is_err() {
            for script in scripts {
                let _ = nft::apply(&script);
            }
        }
        link::unmount_sysfs(&self.sysfs_path(slot.slot));
        if let Err(e) = link::delete(&self.netns(slot.slot), &veth) {
            tracing::warn!(slot = slot.slot, error = %e, "cannot remove a sandbox's link");
        }
        let _ = std::fs::remove_file(self.hosts_path(slot.slot));
        let _ = std::fs::remove_file(self.policy_path(slot.slot));
        {
            let mut by_addr = self.by_addr.write().expect("address lock");
            by_addr.remove(&IpAddr::V4(slot.v4));
            if let Some(v6) = slot.v6 {
                by_addr.remove(&IpAddr::V6(v6));
            }
        }
        self.names.lock().expect("names lock").remove(&slot.slot);
        self.standins.lock().expect("standins lock").remove(&slot.slot);
        self.drops.forget(slot.slot);
        self.pool.release(slot.slot);
    }

    /// Removes `owner`'s namespace, veth, chain, sets and addresses (absent: nothing).
    pub fn detach(&self, owner: &str) {
        let a = self.attached.lock().expect("attached lock").remove(owner);
        if let Some(a) = a {
            // No apply of it starts now (it is not attached); one under way ends first. The
            // teardown itself holds no lock: other sandboxes' applies go on meanwhile.
            drop(self.applying.lock().expect("applying lock"));
            // Its sets are those of its policy; an earlier run's (adopted) are listed too.
            let mut sets = a.sets;
            if a.applied.is_none() {
                sets.extend(self.sets_of_slot(a.slot.slot));
            }
            self.teardown(&a.slot, &sets);
        }
    }

    fn sets_of_slot(&self, slot: u32) -> Vec<String> {
        let prefix = format!("d{slot}_");
        nft::names(&self.table, "set")
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.starts_with(&prefix))
            .collect()
    }

    /// Takes up what an earlier run left: the networks of `live` sandboxes keep their
    /// chain (in force until their policy is applied again) and learned sets; every
    /// other slot, namespace, veth, chain, set and counter of this edge is removed.
    pub fn adopt(&self, live: &BTreeSet<String>) {
        let slots = self.pool.slots();
        let mut kept = BTreeSet::new();
        for slot in slots {
            if live.contains(&slot.owner) {
                let applied = std::fs::read_to_string(self.policy_path(slot.slot)).ok();
                let policy = applied
                    .as_deref()
                    .filter(|n| !n.is_empty())
                    .and_then(|n| parse("network", n).ok())
                    .unwrap_or_default();
                kept.insert(slot.slot);
                self.index(&slot, Arc::new(policy.clone()));
                self.attached.lock().expect("attached lock").insert(
                    slot.owner.clone(),
                    Attached {
                        slot: slot.clone(),
                        // Applied again by the loop: the chain's generation is the last run's.
                        applied: None,
                        sets: {
                            let mut sets = rules::learned_sets(slot.slot, &policy);
                            if self.proxied(&policy) {
                                sets.insert(rules::standin_set(slot.slot));
                            }
                            sets
                        },
                    },
                );
            } else {
                let sets = self.sets_of_slot(slot.slot).into_iter().collect();
                self.teardown(&slot, &sets);
            }
        }
        let veths: BTreeSet<String> = kept.iter().map(|s| self.veth(*s)).collect();
        for l in link::links_with_prefix(self.veth_prefix_str()).unwrap_or_default() {
            if !veths.contains(&l) {
                let _ = link::delete_veth(&l);
            }
        }
        for e in std::fs::read_dir(self.files.join("sys"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let slot = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok());
            if !slot.is_some_and(|s| kept.contains(&s)) {
                link::unmount_sysfs(&e.path());
            }
        }
        let names: BTreeSet<String> = kept.iter().map(|s| self.netns(*s)).collect();
        for n in link::netns_with_prefix(&self.netns_prefix()) {
            if !names.contains(&n) {
                let _ = link::delete_netns(&n);
            }
        }
        let slot_of =
            |name: &str, prefix: &str| -> Option<u32> { name.strip_prefix(prefix)?.split('_').next()?.parse().ok() };
        let mut scripts = Vec::new();
        for chain in nft::names(&self.table, "chain").unwrap_or_default() {
            if let Some(s) = slot_of(&chain, "sb")
                && !kept.contains(&s)
            {
                scripts.push(format!("delete chain inet {} {chain}\n", self.table));
            }
        }
        for (kind, prefix) in [("set", "d"), ("counter", "drops")] {
            for name in nft::names(&self.table, kind).unwrap_or_default() {
                if let Some(s) = slot_of(&name, prefix)
                    && !kept.contains(&s)
                {
                    scripts.push(format!("delete {kind} inet {} {name}\n", self.table));
                }
            }
        }
        for s in scripts {
            let _ = nft::apply(&s);
        }
    }

    /// Removes this edge's whole table and every namespace and veth of its sandboxes
    /// (for a test's end, or an operator's; running sandboxes lose their network).
    pub fn remove_all(&self) {
        let owners: Vec<String> = self.attached.lock().expect("attached lock").keys().cloned().collect();
        for o in owners {
            self.detach(&o);
        }
        self.adopt(&BTreeSet::new());
        let _ = nft::delete_table(&self.table);
        self.pool.release_gateway();
    }
}
