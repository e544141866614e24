//! Where the node keeps a sandbox's files under its data directory (`<edge data>`):
//! `agents/<id>.sock` (the agent's socket), `sandbox-files/` (a tmpfs holding the agent
//! binary every container sees at `/.opendsec`, see `agent.rs`), `forks/<id>/<k>` (a fork's copies of its source's layers), `snapshots/<id>`,
//! `transfers/<id>` (state prepared for other edges) and `imports/<id>` (state pulled
//! from them). The container backend keeps the rest under its own root.

use super::Edge;
use std::path::PathBuf;

impl Edge {
    pub(super) fn socket_path(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("agents").join(format!("{id}.sock"))
    }

    pub(super) fn snapshots_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("snapshots")
    }

    /// State this edge prepared for other edges to pull: `transfers/<id>/` (whole once its
    /// manifest is there), or `transfers/<id>.failed` saying why it cannot be had.
    pub(super) fn transfers_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("transfers")
    }

    pub(super) fn transfer_failure(&self, id: &str) -> PathBuf {
        self.transfers_dir().join(format!("{id}.failed"))
    }

    /// State pulled from other edges: `imports/<transfer>/`, removed once every sandbox
    /// of this edge that starts from it has been created (or has ended).
    pub(super) fn imports_dir(&self) -> PathBuf {
        self.cfg.data_dir.join("imports")
    }

    /// A fork's private copy of its source's file system (its top read-only layer).
    pub(super) fn fork_layer(&self, id: &str) -> PathBuf {
        self.cfg.data_dir.join("forks").join(id)
    }
}
