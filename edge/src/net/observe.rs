//! What the network tells about a sandbox: its traffic counters and recent drops.

use super::*;

impl Network {
    /// Sandbox `owner`'s traffic and its last sampled drops (`None`: no network here).
    pub fn sample(&self, owner: &str) -> Option<NetSample> {
        Some(NetSample {
            counters: self.counters(owner)?,
            recent_drops: self.recent_drops(owner),
        })
    }

    /// What sandbox `owner` last tried to reach and was refused (sampled), oldest first.
    pub fn recent_drops(&self, owner: &str) -> Vec<drops::Drop> {
        let slot = self
            .attached
            .lock()
            .expect("attached lock")
            .get(owner)
            .map(|a| a.slot.slot);
        slot.map(|s| self.drops.of(s)).unwrap_or_default()
    }

    /// Sandbox `owner`'s traffic, read at most once a second for all sandboxes.
    pub fn counters(&self, owner: &str) -> Option<NetCounters> {
        let slot = self.attached.lock().expect("attached lock").get(owner)?.slot.slot;
        let mut cache = self.counters.lock().expect("counters lock");
        let fresh = cache
            .as_ref()
            .is_some_and(|(at, _, _)| at.elapsed() < Duration::from_secs(1));
        if !fresh {
            let links: BTreeMap<String, LinkCounters> =
                link::counters(self.veth_prefix_str()).ok()?.into_iter().collect();
            let drops: BTreeMap<String, u64> = nft::counters(&self.table).ok()?.into_iter().collect();
            *cache = Some((Instant::now(), links, drops));
        }
        let (_, links, drops) = cache.as_ref()?;
        Some(NetCounters {
            link: links.get(&self.veth(slot)).copied().unwrap_or_default(),
            dropped_packets: drops.get(&rules::counter_name(slot)).copied().unwrap_or(0),
        })
    }
}
