//! Placement by power-of-k choices: sample k edges that have room, take the one
//! with the most free memory. The seed comes from the command context and the
//! candidates and the choice are recorded in `SandboxCreated`, so a replay never
//! has to choose again.

use opendsec_projections::Usage;

/// How many edges each placement samples.
pub const DEFAULT_K: usize = 2;

/// splitmix64: small, fast, and the same on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// An edge that could take the sandbox, with what it has free (after in-flight reservations).
#[derive(Clone, Debug)]
pub struct Candidate {
    pub edge: String,
    pub ordinal: u32,
    pub free: Usage,
}

/// Samples up to `k` distinct candidates and picks the one with the most free memory
/// (then CPU, then the lowest ordinal). Returns (sampled, chosen index into sampled).
pub fn place_power_of_k(candidates: &[Candidate], k: usize, rng: &mut Rng) -> Option<(Vec<Candidate>, usize)> {
    if candidates.is_empty() {
        return None;
    }
    let mut pool: Vec<&Candidate> = candidates.iter().collect();
    let mut sampled = Vec::new();
    while sampled.len() < k.max(1) && !pool.is_empty() {
        let i = rng.below(pool.len());
        sampled.push(pool.swap_remove(i).clone());
    }
    let best = (0..sampled.len()).max_by(|&a, &b| {
        let (x, y) = (&sampled[a], &sampled[b]);
        x.free
            .memory_mb
            .cmp(&y.free.memory_mb)
            .then(x.free.cpu_millis.cmp(&y.free.cpu_millis))
            .then(y.ordinal.cmp(&x.ordinal))
    })?;
    Some((sampled, best))
}

/// A sandbox id: 16 random hex digits, then the edge's ordinal as 4 hex digits, so
/// that routing a request to the sandbox's edge needs no lookup (invariant 4).
pub fn sandbox_id(rng: &mut Rng, edge_ordinal: u32) -> String {
    format!("{:016x}{:04x}", rng.next_u64(), edge_ordinal & 0xffff)
}

pub use opendsec_projections::edge_ordinal_of;

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(edge: &str, ordinal: u32, mem: u64) -> Candidate {
        Candidate {
            edge: edge.into(),
            ordinal,
            free: Usage {
                sandboxes: 10,
                cpu_millis: 1000,
                memory_mb: mem,
                metadata_bytes: 0,
            },
        }
    }

    #[test]
    fn picks_the_sampled_edge_with_most_free_memory() {
        let cands = [cand("a", 0, 100), cand("b", 1, 900)];
        let (sampled, best) = place_power_of_k(&cands, 2, &mut Rng::new(7)).unwrap();
        assert_eq!(sampled.len(), 2);
        assert_eq!(sampled[best].edge, "b");
    }

    #[test]
    fn the_same_seed_places_the_same_way() {
        let cands: Vec<_> = (0..10).map(|i| cand(&format!("e{i}"), i, 100 * i as u64)).collect();
        let a = place_power_of_k(&cands, 2, &mut Rng::new(42)).unwrap();
        let b = place_power_of_k(&cands, 2, &mut Rng::new(42)).unwrap();
        assert_eq!(a.0[a.1].edge, b.0[b.1].edge);
    }

    #[test]
    fn a_sandbox_id_names_its_edge() {
        let id = sandbox_id(&mut Rng::new(1), 0x2a);
        assert_eq!(id.len(), 20);
        assert_eq!(edge_ordinal_of(&id), Some(0x2a));
        assert_eq!(edge_ordinal_of("not-an-id"), None);
    }
}
