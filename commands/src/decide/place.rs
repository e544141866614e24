//! Where a decision's sandboxes go: the quota check for all of them, then one edge
//! each among those that run their isolation and have room (after in-flight
//! reservations and what this decision already placed), by power-of-k or on the edge
//! holding their source state.
//!
//! Every edge runs containers; microVMs go only to edges labelled `opendsec.io/microvm`,
//! full VMs only to edges labelled `opendsec.io/fullvm`. A sandbox that starts from state
//! (a fork's copy, a sandbox from a snapshot) goes to the edge holding that state while
//! it has room and has not refused it at admission (`Where::Prefer`), else anywhere;
//! `Where::Only` is a caller's placement hint that must be followed. Edges that refused
//! at admission (`refused_by`) are left out and recorded in the placement. A refusal
//! names the real cause: an unknown edge, no registered edge running the isolation at
//! all (with how an edge comes to offer it), or no room.

use super::scope::Scope;
use crate::placement::{Candidate, DEFAULT_K, Rng, place_power_of_k, sandbox_id};
use crate::{FULLVM_LABEL, MICROVM_LABEL, Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::{Isolation, Usage};
use std::collections::BTreeMap;

/// Where the sandboxes of one decision may go.
#[derive(Clone, Copy, Debug)]
pub(super) enum Where<'a> {
    /// Any edge with room: power-of-k.
    Anywhere,
    /// The edge holding the state they start from while it has room (and has not refused
    /// them at admission); other edges, by power-of-k, once it has not.
    Prefer(&'a str),
    /// Only this edge (the caller asked for it).
    Only(&'a str),
}

/// One placed sandbox: its id, its edge and the placement record.
pub(super) type Placed = (String, String, pb::Placement);

/// Whether edge `e` runs sandboxes of `isolation`: every edge runs containers; an edge
/// labelled `opendsec.io/microvm` runs microVMs, one labelled `opendsec.io/fullvm` full VMs.
fn runs_isolation(e: &opendsec_projections::Edge, isolation: Isolation) -> bool {
    let label = match isolation {
        Isolation::Container => return true,
        Isolation::Microvm => MICROVM_LABEL,
        Isolation::Vm => FULLVM_LABEL,
    };
    e.labels.get(label).is_some_and(|v| !v.is_empty())
}

/// Places `n` sandboxes of `usage` in `project`, checking quota against state + in-flight.
/// MicroVMs and full VMs go only to edges that run them ([`MICROVM_LABEL`], [`FULLVM_LABEL`]).
pub(super) fn place(
    s: &Scope,
    rng: &mut Rng,
    project: &str,
    usage: Usage,
    n: u32,
    to: Where<'_>,
    isolation: Isolation,
) -> Result<Vec<Placed>, Rejection> {
    let (state, inflight, refused_by) = (s.state, s.inflight, s.refused_by);
    let total = usage.times(n as u64);
    state
        .check_quota(project, &total, &|p| inflight.project_usage(p))
        .map_err(|m| Rejection::new(K::QuotaExceeded, m))?;
    let mut taken: BTreeMap<String, Usage> = Default::default();
    let mut out = Vec::new();
    for _ in 0..n {
        let cands: Vec<Candidate> = state
            .placement
            .edges
            .values()
            .filter(|e| !e.deregistered && !refused_by.contains(&e.id))
            .filter(|e| !matches!(to, Where::Only(o) if o != e.id))
            .filter(|e| runs_isolation(e, isolation))
            .filter_map(|e| {
                let mut free = e.free();
                free.sub(&inflight.edge_usage(&e.id));
                free.sub(&taken.get(&e.id).copied().unwrap_or_default());
                let fits =
                    free.sandboxes >= 1 && free.cpu_millis >= usage.cpu_millis && free.memory_mb >= usage.memory_mb;
                fits.then(|| Candidate {
                    edge: e.id.clone(),
                    ordinal: e.ordinal,
                    free,
                })
            })
            .collect();
        // The source's edge needs no transfer: it is taken whenever it can be.
        let preferred = match to {
            Where::Prefer(p) => cands.iter().find(|c| c.edge == p).map(|c| (vec![c.clone()], 0)),
            _ => None,
        };
        let (sampled, best) = preferred
            .or_else(|| place_power_of_k(&cands, DEFAULT_K, rng))
            .ok_or_else(|| no_edge_for(s, to, isolation))?;
        let chosen = &sampled[best];
        let mut id = sandbox_id(rng, chosen.ordinal);
        while state.sandboxes.sandboxes.contains_key(&id)
            || inflight.sandbox_id_taken(&id)
            || out.iter().any(|(x, _, _)| x == &id)
        {
            id = sandbox_id(rng, chosen.ordinal);
        }
        taken
            .entry(chosen.edge.clone())
            .or_default()
            .add(&Usage { sandboxes: 1, ..usage });
        let placement = pb::Placement {
            candidates: sampled.iter().map(|c| c.edge.clone()).collect(),
            chosen: chosen.edge.clone(),
            refused_by: refused_by.iter().cloned().collect(),
        };
        out.push((id, chosen.edge.clone(), placement));
    }
    Ok(out)
}

/// Why no edge could take a sandbox: the named edge is unknown; no registered edge runs
/// its isolation at all (then the cause is a missing tool on the edges' machines, and
/// the message says which and how to add it); or the edges that could have no room.
fn no_edge_for(s: &Scope, to: Where<'_>, isolation: Isolation) -> Rejection {
    let registered = || s.state.placement.edges.values().filter(|e| !e.deregistered);
    if let Where::Only(o) = to
        && !registered().any(|e| e.id == o)
    {
        return Rejection::field(K::NotFound, "edge", format!("edge {o} is not registered"));
    }
    if let Some(why) = no_edge_runs(isolation)
        && !registered().any(|e| runs_isolation(e, isolation))
    {
        return Rejection::field(K::NoCapacity, "isolation", why);
    }
    match (to, isolation) {
        (Where::Only(o), Isolation::Container) => {
            Rejection::field(K::NoCapacity, "edge", format!("edge {o} has no room for this sandbox"))
        }
        (Where::Only(o), machine) => Rejection::field(
            K::NoCapacity,
            "edge",
            format!(
                "edge {o} has no room for this {} (or runs no {}s)",
                machine.noun(),
                machine.noun()
            ),
        ),
        (_, Isolation::Container) => Rejection::new(K::NoCapacity, "no registered edge has room for this sandbox"),
        (_, machine) => Rejection::new(
            K::NoCapacity,
            format!(
                "no registered edge that runs {}s has room for this sandbox",
                machine.noun()
            ),
        ),
    }
}

/// The refusal's message when no registered edge runs `isolation`: what an edge needs
/// on its machine to offer it, and how to get there. None for containers, which every
/// edge runs.
fn no_edge_runs(isolation: Isolation) -> Option<&'static str> {
    match isolation {
        Isolation::Container => None,
        Isolation::Microvm => Some(
            "no registered edge runs microVMs: an edge offers them when QEMU is installed on its machine \
             (./ops/up.sh installs it; or apt-get install qemu-system-x86), then restart the edge",
        ),
        Isolation::Vm => Some(
            "no registered edge runs full VMs: an edge offers them when QEMU, qemu-img and extlinux are installed \
             on its machine (./ops/up.sh installs them; or apt-get install qemu-system-x86 qemu-utils extlinux \
             syslinux-common), then restart the edge",
        ),
    }
}
