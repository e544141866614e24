//! Addresses: one IPv4 and one IPv6 address per sandbox from the edge's pools, and the
//! gateway address its sandboxes route through (where its DNS proxy listens).
//!
//! Several edges may run on one host (tests do, and so may an operator), with the same
//! pools: an address is claimed host-wide by creating `<state>/claims/v4-<addr>` (and
//! `v6-<addr>`) exclusively, so no two edges ever hand out one address. What this edge
//! holds is recorded in `<state>/edges/<tag>/`: `gateway` and one `<slot>.json` per
//! sandbox (its owner: a sandbox or warm container id). `<state>` is under `/run`: it
//! lives as long as the network namespaces and veths it describes (until a reboot),
//! and outlives the edge, so a restarted edge finds every address where it was.
//!
//! A sandbox's slot is its address's offset in the IPv4 pool; its IPv6 address has the
//! same offset in the IPv6 pool.

use super::NetError;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// One sandbox's addresses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Slot {
    /// The address's offset in the IPv4 pool: names its veth, netns and chain.
    pub slot: u32,
    /// The sandbox or warm container that holds it.
    pub owner: String,
    pub v4: Ipv4Addr,
    pub v6: Option<Ipv6Addr>,
}

/// The edge's share of the host's pools.
pub struct Pool {
    v4: (Ipv4Addr, u8),
    v6: Option<(Ipv6Addr, u8)>,
    claims: PathBuf,
    own: PathBuf,
    tag: String,
    /// Where the next claim starts looking.
    cursor: AtomicU32,
}

fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> NetError {
    let context = context.into();
    move |source| NetError::Io { context, source }
}

/// Creates `path` holding `content` unless it exists: `Ok(false)` when it did.
fn create_new(path: &Path, content: &str) -> Result<bool, NetError> {
    match std::fs::OpenOptions::new().write(true).create_new(true).open(path) {
        Ok(mut f) => {
            f.write_all(content.as_bytes())
                .map_err(io(format!("writing {}", path.display())))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(io(format!("creating {}", path.display()))(e)),
    }
}

fn write_atomic(path: &Path, content: &[u8]) -> Result<(), NetError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, content).map_err(io(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io(format!("writing {}", path.display())))
}

impl Pool {
    /// The pools `v4` and `v6` as edge `tag` shares them, with its records under `state`.
    pub fn open(state: &Path, tag: &str, v4: (Ipv4Addr, u8), v6: Option<(Ipv6Addr, u8)>) -> Result<Pool, NetError> {
        if !(8..=30).contains(&v4.1) {
            return Err(NetError::Config(format!(
                "the IPv4 pool {}/{} must be between a /8 and a /30",
                v4.0, v4.1
            )));
        }
        if let Some((a, l)) = v6
            && !(8..=120).contains(&l)
        {
            return Err(NetError::Config(format!(
                "the IPv6 pool {a}/{l} must be between a /8 and a /120"
            )));
        }
        let claims = state.join("claims");
        let own = state.join("edges").join(tag);
        for d in [&claims, &own] {
            std::fs::create_dir_all(d).map_err(io(format!("creating {}", d.display())))?;
        }
        Ok(Pool {
            v4,
            v6,
            claims,
            own,
            tag: tag.to_string(),
            cursor: AtomicU32::new(2),
        })
    }

    /// Addresses in the IPv4 pool (offsets 0 and the last are never handed out).
    fn size(&self) -> u32 {
        1u32 << (32 - self.v4.1)
    }

    fn v4_at(&self, offset: u32) -> Ipv4Addr {
        let mask = u32::MAX << (32 - self.v4.1);
        Ipv4Addr::from((u32::from(self.v4.0) & mask) + offset)
    }

    fn v6_at(&self, offset: u32) -> Option<Ipv6Addr> {
        self.v6.map(|(a, l)| {
            let mask = u128::MAX << (128 - l);
            Ipv6Addr::from((u128::from(a) & mask) + offset as u128)
        })
    }

    fn claim_files(&self, offset: u32) -> (PathBuf, Option<PathBuf>) {
        (
            self.claims.join(format!("v4-{}", self.v4_at(offset))),
            self.v6_at(offset).map(|a| self.claims.join(format!("v6-{a}"))),
        )
    }

    /// Claims the addresses at `offset` host-wide: both families, or neither.
    fn try_claim(&self, offset: u32) -> Result<bool, NetError> {
        let (f4, f6) = self.claim_files(offset);
        if !create_new(&f4, &self.tag)? {
            return Ok(false);
        }
        if let Some(f6) = f6
            && !create_new(&f6, &self.tag)?
        {
            let _ = std::fs::remove_file(&f4);
            return Ok(false);
        }
        Ok(true)
    }

    fn unclaim(&self, offset: u32) {
        let (f4, f6) = self.claim_files(offset);
        for f in [Some(f4), f6].into_iter().flatten() {
            // Only this edge's own claim.
            if std::fs::read_to_string(&f).is_ok_and(|t| t == self.tag) {
                let _ = std::fs::remove_file(f);
            }
        }
    }

    /// A free offset, claimed host-wide.
    fn claim_offset(&self) -> Result<u32, NetError> {
        let size = self.size();
        let start = self.cursor.load(Ordering::Relaxed);
        for i in 0..size {
            let offset = (start + i) % size;
            if offset < 2 || offset == size - 1 {
                continue;
            }
            if self.try_claim(offset)? {
                self.cursor.store(offset + 1, Ordering::Relaxed);
                return Ok(offset);
            }
        }
        Err(NetError::Exhausted(format!(
            "every address of the pool {}/{} is taken on this host; give the edge a larger pool",
            self.v4.0, self.v4.1
        )))
    }

    /// The gateway this edge's sandboxes route through: claimed once, kept while the
    /// host runs.
    pub fn gateway(&self) -> Result<Ipv4Addr, NetError> {
        let file = self.own.join("gateway");
        if let Ok(text) = std::fs::read_to_string(&file)
            && let Ok(a) = text.trim().parse::<Ipv4Addr>()
        {
            return Ok(a);
        }
        let offset = self.claim_offset()?;
        let a = self.v4_at(offset);
        write_atomic(&file, a.to_string().as_bytes())?;
        Ok(a)
    }

    /// Gives the gateway's address back (the edge's network is removed for good).
    pub fn release_gateway(&self) {
        let file = self.own.join("gateway");
        if let Some(a) = std::fs::read_to_string(&file)
            .ok()
            .and_then(|t| t.trim().parse::<Ipv4Addr>().ok())
        {
            let offset = u32::from(a).wrapping_sub(u32::from(self.v4_at(0)));
            if offset < self.size() {
                self.unclaim(offset);
            }
        }
        let _ = std::fs::remove_file(file);
    }

    /// Claims addresses for `owner`.
    pub fn claim(&self, owner: &str) -> Result<Slot, NetError> {
        let offset = self.claim_offset()?;
        let slot = Slot {
            slot: offset,
            owner: owner.to_string(),
            v4: self.v4_at(offset),
            v6: self.v6_at(offset),
        };
        if let Err(e) = self.record(&slot) {
            self.unclaim(offset);
            return Err(e);
        }
        Ok(slot)
    }

    fn record(&self, slot: &Slot) -> Result<(), NetError> {
        let json = serde_json::to_vec(slot).map_err(|e| NetError::Config(e.to_string()))?;
        write_atomic(&self.own.join(format!("{}.json", slot.slot)), &json)
    }

    /// Slot `slot` now belongs to `owner` (a warm container claimed by a sandbox).
    pub fn hand_over(&self, slot: &Slot, owner: &str) -> Result<Slot, NetError> {
        let moved = Slot {
            owner: owner.to_string(),
            ..slot.clone()
        };
        self.record(&moved)?;
        Ok(moved)
    }

    /// Gives slot `slot`'s addresses back.
    pub fn release(&self, slot: u32) {
        let _ = std::fs::remove_file(self.own.join(format!("{slot}.json")));
        self.unclaim(slot);
    }

    /// Every slot this edge holds.
    pub fn slots(&self) -> Vec<Slot> {
        let mut out: Vec<Slot> = std::fs::read_dir(&self.own)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice(&b).ok())
            .collect();
        out.sort_by_key(|s: &Slot| s.slot);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(state: &Path, tag: &str) -> Pool {
        Pool::open(
            state,
            tag,
            (Ipv4Addr::new(10, 231, 0, 0), 29),
            Some(("fd6f:7064:7365::".parse().unwrap(), 64)),
        )
        .unwrap()
    }

    #[test]
    fn two_edges_on_one_host_never_hand_out_one_address_and_a_full_pool_says_so() {
        let state = tempfile::tempdir().unwrap();
        let (a, b) = (pool(state.path(), "aaaaaa"), pool(state.path(), "bbbbbb"));
        let gw = a.gateway().unwrap();
        assert_eq!(a.gateway().unwrap(), gw, "claimed once");
        let mut seen = vec![gw];
        for (i, p) in [&a, &b, &a, &b].into_iter().enumerate() {
            let s = p.claim(&format!("sb{i}")).unwrap();
            assert_eq!(s.v6.unwrap().segments()[7] as u32, s.slot);
            assert!(!seen.contains(&s.v4), "{s:?}");
            seen.push(s.v4);
        }
        // A /29 has 8 addresses: the first two and the last are never handed out.
        let full = b.claim("one-too-many").unwrap_err();
        assert!(full.to_string().contains("larger pool"), "{full}");
        assert_eq!(a.slots().len() + b.slots().len(), 4);

        // A slot handed over and released frees its address for anyone.
        let s = a.slots()[0].clone();
        let s = a.hand_over(&s, "sandbox-x").unwrap();
        assert_eq!(a.slots()[0].owner, "sandbox-x");
        b.release(s.slot);
        assert!(b.claim("x").is_err(), "one edge never releases another's claim");
        a.release(s.slot);
        assert_eq!(b.claim("x").unwrap().v4, s.v4);
    }

    #[test]
    fn a_restarted_edge_finds_its_gateway_and_slots_where_they_were() {
        let state = tempfile::tempdir().unwrap();
        let (gw, slot) = {
            let p = pool(state.path(), "cccccc");
            (p.gateway().unwrap(), p.claim("sb1").unwrap())
        };
        let p = pool(state.path(), "cccccc");
        assert_eq!(p.gateway().unwrap(), gw);
        assert_eq!(p.slots(), vec![slot]);
    }
}
