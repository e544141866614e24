//! What the DNS proxy and the proxy relay ask of the network: the names a sandbox
//! resolved, stand-in addresses where a proxy carries its TCP, and refusals to record.

use super::*;

impl Network {
    /// The edge's own upstream proxy.
    pub fn edge_proxy(&self) -> Option<&opendsec_commands::network::EgressProxy> {
        self.edge_proxy.as_ref()
    }

    /// Whether a proxy may carry slot `slot`'s TCP (what makes the names it resolves worth
    /// keeping).
    pub(super) fn proxied(&self, policy: &Policy) -> bool {
        self.edge_proxy.is_some() || policy.egress_proxy.is_some()
    }

    /// Keeps that the DNS proxy answered slot `slot` `name` for each of `addrs` (with
    /// their TTLs), where a proxy may carry its connections.
    pub fn learn_names(&self, slot: u32, policy: &Policy, name: &str, addrs: &[(IpAddr, u64)]) {
        if !self.proxied(policy) || addrs.is_empty() {
            return;
        }
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        let now = Instant::now();
        let mut all = self.names.lock().expect("names lock");
        let of_slot = all.entry(slot).or_default();
        if of_slot.len() >= NAMES_KEPT {
            of_slot.retain(|_, (_, until)| *until > now);
            if of_slot.len() >= NAMES_KEPT {
                of_slot.clear();
            }
        }
        for (ip, ttl) in addrs {
            of_slot.insert(*ip, (name.clone(), now + Duration::from_secs(*ttl)));
        }
    }

    /// The stand-in address of `name` for slot `slot` (made and let through its chain
    /// now if it has none), where a proxy carries its TCP; `None`: no proxy, or no more
    /// stand-ins for it ([`NAMES_KEPT`]), or its set cannot take it.
    pub async fn standin_for(&self, slot: u32, policy: &Policy, name: &str) -> Option<Ipv4Addr> {
        if !self.proxied(policy) {
            return None;
        }
        let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
        let (base, len) = rules::STANDINS;
        let made = {
            let mut all = self.standins.lock().expect("standins lock");
            let s = all.entry(slot).or_default();
            if let Some(a) = s.by_name.get(&name) {
                return Some(*a);
            }
            if s.by_addr.len() >= NAMES_KEPT {
                return None;
            }
            let room = (1u32 << (32 - len)) - 2;
            let a = Ipv4Addr::from(u32::from(base) + 1 + s.next % room);
            s.next += 1;
            s.by_name.insert(name.clone(), a);
            s.by_addr.insert(a, name.clone());
            a
        };
        let script = format!(
            "add element inet {} {} {{ {made} }}\n",
            self.table,
            rules::standin_set(slot)
        );
        if let Err(e) = nft::apply_async(&script).await {
            tracing::warn!(slot, %name, error = %e, "DNS: cannot let a stand-in address through");
            if let Some(s) = self.standins.lock().expect("standins lock").get_mut(&slot) {
                s.by_name.remove(&name);
                s.by_addr.remove(&made);
            }
            return None;
        }
        Some(made)
    }

    /// Slot `slot`'s stand-ins that `policy` still allows the names of (the others are
    /// forgotten): what its set holds under it; `None` where no proxy carries its TCP.
    pub(super) fn standins_kept(&self, slot: u32, policy: &Policy) -> Option<Vec<Ipv4Addr>> {
        let mut all = self.standins.lock().expect("standins lock");
        if !self.proxied(policy) {
            all.remove(&slot);
            return None;
        }
        let s = all.entry(slot).or_default();
        s.by_name.retain(|n, _| policy.allows_name(n));
        let kept: std::collections::HashSet<Ipv4Addr> = s.by_name.values().copied().collect();
        s.by_addr.retain(|a, _| kept.contains(a));
        let mut addrs: Vec<Ipv4Addr> = kept.into_iter().collect();
        addrs.sort();
        Some(addrs)
    }

    /// Whether `ip` is a stand-in address (it stands for a name: never reached as itself).
    pub fn is_standin(ip: IpAddr) -> bool {
        let (base, len) = rules::STANDINS;
        opendsec_commands::network::contains(IpAddr::V4(base), len, ip)
    }

    /// The name the DNS proxy last answered slot `slot` for `ip`, while its answer holds
    /// (a stand-in's for as long as the sandbox's policy allows it).
    pub fn name_of(&self, slot: u32, ip: IpAddr) -> Option<String> {
        if let IpAddr::V4(a) = ip
            && Self::is_standin(ip)
        {
            let all = self.standins.lock().expect("standins lock");
            return all.get(&slot)?.by_addr.get(&a).cloned();
        }
        let all = self.names.lock().expect("names lock");
        let (name, until) = all.get(&slot)?.get(&ip)?;
        (*until > Instant::now()).then(|| name.clone())
    }

    /// A connection of slot `slot` to `dest` that the relay did not carry, among its drops:
    /// `rule` `egress_proxy` (its proxy did not), or as its chain would name it.
    pub fn note_refused(&self, slot: u32, dest: SocketAddr, rule: &str) {
        self.drops.note(
            slot,
            drops::Drop {
                at_ms: opendsec_edge_api::now_ms(),
                protocol: "tcp".into(),
                destination: dest.ip(),
                port: Some(dest.port()),
                rule: rule.into(),
                packets: 1,
            },
        );
    }
}
