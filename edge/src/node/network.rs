//! The node's side of sandbox networking (`crate::net`): a container sandbox (or warm
//! container) gets its namespace, link and a chain that drops everything before its
//! container exists; its policy is applied before its PID 1 starts (a cold create applies
//! it before `create`, a warm claim after the hand-over and before `start`); each round
//! applies the policy of every sandbox whose logged policy (`SandboxNetworkSet`) differs
//! from what its chain enforces; removing a sandbox removes its network. Edges started
//! without sandbox networking (`--no-sandbox-network`) give containers an empty
//! namespace (only `lo`), as before.

use super::{Edge, EdgeError};
use crate::container::{BindMount, SandboxSpec};
use std::collections::BTreeSet;

impl Edge {
    /// Gives `spec` (sandbox or warm container `owner`) its network: namespace, link,
    /// `/etc/resolv.conf` naming the DNS proxy and `/etc/hosts` naming `owner`; then
    /// applies `policy` when it is a sandbox's (`Some`; a warm container keeps the chain
    /// that drops everything). On error nothing of it is left.
    pub(super) fn attach_network(
        &self,
        owner: &str,
        spec: &mut SandboxSpec,
        policy: Option<Option<&str>>,
    ) -> Result<(), EdgeError> {
        let Some(net) = &self.net else {
            return Ok(());
        };
        let t = std::time::Instant::now();
        let a = net.attach(owner, owner)?;
        let attached = t.elapsed();
        if let Some(policy) = policy
            && let Err(e) = net.apply(owner, policy)
        {
            net.detach(owner);
            return Err(e.into());
        }
        tracing::debug!(%owner, ?attached, applied = ?(t.elapsed() - attached), "network attached");
        spec.netns = Some(a.netns);
        spec.sysfs = Some(a.sysfs);
        spec.binds.push(BindMount {
            host_path: a.resolv_conf,
            container_path: "/etc/resolv.conf".into(),
        });
        spec.binds.push(BindMount {
            host_path: a.hosts,
            container_path: "/etc/hosts".into(),
        });
        Ok(())
    }

    /// Gives machine sandbox `d` (a microVM or full VM, made, its QEMU running in its
    /// namespace) its link out, under its policy. Both boot our init, which routes the
    /// guest through its tap (`vm/init.sh`).
    pub(super) fn attach_machine_network(&self, d: &crate::desired::DesiredSandbox) -> Result<(), EdgeError> {
        let Some(net) = &self.net else {
            return Ok(());
        };
        let channel = crate::vm::agent_channel_at(&self.cfg.data_dir.join("vms"), &d.id)
            .ok_or_else(|| EdgeError::Store(format!("microVM {} has no record to attach its network to", d.id)))?;
        let [a, b, c, e] = crate::vm::HOST_IP;
        net.attach_machine(
            &d.id,
            &channel.netns,
            crate::vm::TAP,
            std::net::Ipv4Addr::new(a, b, c, e),
        )?;
        if let Err(e) = net.apply(&d.id, d.network.as_deref()) {
            net.detach(&d.id);
            return Err(e.into());
        }
        Ok(())
    }

    /// Warm container `wid`'s network becomes sandbox `id`'s, under `policy`.
    pub(super) fn hand_over_network(&self, wid: &str, id: &str, policy: Option<&str>) -> Result<(), EdgeError> {
        let Some(net) = &self.net else {
            return Ok(());
        };
        let t = std::time::Instant::now();
        net.hand_over(wid, id)?;
        let handed = t.elapsed();
        net.apply(id, policy)?;
        tracing::debug!(sandbox = %id, ?handed, applied = ?(t.elapsed() - handed), "network handed over");
        Ok(())
    }

    /// Removes ended sandbox `owner`'s network beside the loop, once no create is under
    /// way (as warm containers are made): its teardown never takes a core from a create.
    /// One thread does them all, in turn.
    pub(super) fn detach_network_when_quiet(self: &std::sync::Arc<Self>, owner: String) {
        if self.net.is_none() {
            return;
        }
        let mut queue = self.detach_queue.lock().expect("detach queue lock");
        let owner = match queue.as_ref() {
            Some(tx) => match tx.send(owner) {
                Ok(()) => return,
                // The thread ended (it failed to start before, or panicked): a new one.
                Err(std::sync::mpsc::SendError(owner)) => owner,
            },
            None => owner,
        };
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let _ = tx.send(owner);
        // Weak: the thread ends with the edge.
        let edge = std::sync::Arc::downgrade(self);
        let spawned = std::thread::Builder::new().name("net-detach".into()).spawn(move || {
            for owner in rx {
                let Some(edge) = edge.upgrade() else { return };
                edge.wait_quiet();
                edge.detach_network(&owner);
            }
        });
        match spawned {
            Ok(_) => *queue = Some(tx),
            Err(e) => tracing::warn!(error = %e, "cannot start the network teardown thread"),
        }
    }

    /// Removes `owner`'s network (none: nothing).
    pub(super) fn detach_network(&self, owner: &str) {
        if let Some(net) = &self.net {
            net.detach(owner);
        }
    }

    /// Every sandbox whose chain enforces another policy than the log's (changed by
    /// `SandboxNetworkSet`, or not yet applied by this run after a restart), with the
    /// log's. Sandboxes being created apply their own. Only locks: a round with nothing
    /// to apply costs no blocking task.
    pub(super) fn stale_networks(&self, creating: &BTreeSet<String>) -> Vec<(String, Option<String>)> {
        let Some(net) = &self.net else {
            return Vec::new();
        };
        let slice = self.slice.lock().expect("slice lock");
        net.applied()
            .into_iter()
            .filter(|(owner, _)| !creating.contains(owner))
            .filter_map(|(owner, applied)| {
                let d = slice.sandboxes.get(&owner)?;
                (!d.is_terminal() && applied.as_ref() != Some(&d.network)).then(|| (owner, d.network.clone()))
            })
            .collect()
    }

    /// Applies `stale` (from [`Edge::stale_networks`]); a failure is retried next round.
    pub(super) fn apply_networks(&self, stale: Vec<(String, Option<String>)>) {
        let Some(net) = &self.net else {
            return;
        };
        for (owner, policy) in stale {
            match net.apply(&owner, policy.as_deref()) {
                Ok(()) => {
                    tracing::info!(sandbox = %owner, policy = policy.as_deref().unwrap_or("deny"), "network policy applied")
                }
                Err(e) => {
                    tracing::error!(sandbox = %owner, error = %e, "cannot apply the network policy; retried next round")
                }
            }
        }
    }
}
