//! The in-flight overlay: what decided-but-not-yet-applied batches will take.
//!
//! The leader decides against the applied state plus this overlay, so concurrent
//! creates do not all grab the same last quota unit. Each proposal reserves under a
//! ticket and releases it once its entry was applied (or failed to commit). Apply
//! re-validates anyway (invariant 2): the overlay only makes losses rare.

use opendsec_projections::state::created_usage;
use opendsec_projections::{Event, State, Usage};
use std::collections::{BTreeMap, BTreeSet};

#[derive(Clone, Debug, Default)]
struct Reservation {
    project_usage: Vec<(String, Usage)>,
    edge_usage: Vec<(String, Usage)>,
    sandbox_ids: Vec<String>,
    project_names: Vec<(String, String)>,
    new_edges: Vec<String>,
    revoked_tokens: Vec<String>,
}

#[derive(Debug, Default)]
pub struct InFlight {
    next_ticket: u64,
    reservations: BTreeMap<u64, Reservation>,
    project_usage: BTreeMap<String, Usage>,
    edge_usage: BTreeMap<String, Usage>,
    sandbox_ids: BTreeSet<String>,
    project_names: BTreeSet<(String, String)>,
    new_edges: BTreeSet<String>,
    revoked_tokens: BTreeSet<String>,
}

impl InFlight {
    pub fn new() -> InFlight {
        InFlight::default()
    }

    /// Usage reserved for a project's subtree by batches not yet applied.
    pub fn project_usage(&self, project: &str) -> Usage {
        self.project_usage.get(project).copied().unwrap_or_default()
    }
    pub fn edge_usage(&self, edge: &str) -> Usage {
        self.edge_usage.get(edge).copied().unwrap_or_default()
    }
    pub fn sandbox_id_taken(&self, id: &str) -> bool {
        self.sandbox_ids.contains(id)
    }
    pub fn project_name_taken(&self, parent: &str, name: &str) -> bool {
        self.project_names.contains(&(parent.to_string(), name.to_string()))
    }
    /// Edges being registered for the first time, each of which takes an ordinal.
    pub fn new_edge_count(&self) -> u32 {
        self.new_edges.len() as u32
    }
    pub fn is_new_edge(&self, edge: &str) -> bool {
        self.new_edges.contains(edge)
    }
    pub fn token_being_revoked(&self, token: &str) -> bool {
        self.revoked_tokens.contains(token)
    }
    pub fn len(&self) -> usize {
        self.reservations.len()
    }
    pub fn is_empty(&self) -> bool {
        self.reservations.is_empty()
    }

    /// Records what `events` will take once applied; returns the ticket to release.
    pub fn reserve(&mut self, state: &State, events: &[Event]) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.reserve_as(ticket, state, events)
    }

    /// `reserve` under a ticket the caller chooses (the batch's seed, so that applying
    /// the batch can release it); a ticket in use gets a fresh one instead.
    pub fn reserve_as(&mut self, ticket: u64, state: &State, events: &[Event]) -> u64 {
        let ticket = if self.reservations.contains_key(&ticket) {
            let t = self.next_ticket;
            self.next_ticket += 1;
            t
        } else {
            ticket
        };
        let mut r = Reservation::default();
        for ev in events {
            match ev {
                Event::SandboxCreated(e) => {
                    let u = created_usage(e);
                    for p in state.ancestry(&e.project) {
                        r.project_usage.push((p.id.clone(), u));
                    }
                    r.edge_usage.push((e.edge.clone(), u));
                    r.sandbox_ids.push(e.id.clone());
                }
                Event::ProjectCreated(e) => r.project_names.push((e.parent.clone(), e.name.clone())),
                Event::EdgeRegistered(e) if !state.placement.edges.contains_key(&e.id) => {
                    r.new_edges.push(e.id.clone())
                }
                Event::TokenRevoked(e) => r.revoked_tokens.push(e.id.clone()),
                _ => {}
            }
        }
        for (p, u) in &r.project_usage {
            self.project_usage.entry(p.clone()).or_default().add(u);
        }
        for (e, u) in &r.edge_usage {
            self.edge_usage.entry(e.clone()).or_default().add(u);
        }
        self.sandbox_ids.extend(r.sandbox_ids.iter().cloned());
        self.project_names.extend(r.project_names.iter().cloned());
        self.new_edges.extend(r.new_edges.iter().cloned());
        self.revoked_tokens.extend(r.revoked_tokens.iter().cloned());
        self.reservations.insert(ticket, r);
        ticket
    }

    /// Forgets a reservation: its batch was applied (and so is in the state) or was lost.
    pub fn release(&mut self, ticket: u64) {
        let Some(r) = self.reservations.remove(&ticket) else {
            return;
        };
        for (p, u) in &r.project_usage {
            if let Some(x) = self.project_usage.get_mut(p) {
                x.sub(u);
                if *x == Usage::default() {
                    self.project_usage.remove(p);
                }
            }
        }
        for (e, u) in &r.edge_usage {
            if let Some(x) = self.edge_usage.get_mut(e) {
                x.sub(u);
                if *x == Usage::default() {
                    self.edge_usage.remove(e);
                }
            }
        }
        for id in &r.sandbox_ids {
            self.sandbox_ids.remove(id);
        }
        for n in &r.project_names {
            self.project_names.remove(n);
        }
        for e in &r.new_edges {
            self.new_edges.remove(e);
        }
        for t in &r.revoked_tokens {
            self.revoked_tokens.remove(t);
        }
    }
}
