//! The images this edge is to make and report (pulls, packs, imports: one per name, a
//! later request of a name replacing the earlier), and those the log deleted.

use super::SliceState;
use opendsec_edge_api::pb::SliceSnapshot;
use opendsec_projections::Event;
use serde::{Deserialize, Serialize};

/// An image this edge is to pack from one of its container sandboxes (`PackSandbox`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DesiredPack {
    pub sandbox: String,
    /// The caller's paths to leave out, beside the residue every pack leaves out.
    pub scrub: Vec<String>,
    /// What the image's config changes from its parent's (a template build's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config: Option<opendsec_projections::ConfigOverride>,
}

impl SliceState {
    /// The images a slice snapshot says are still to be made here.
    pub(super) fn images_from_snapshot(&mut self, snap: &SliceSnapshot) {
        self.pulls = snap
            .pulls
            .iter()
            .filter(|p| p.source_sandbox.is_empty() && !p.imported)
            .map(|p| (p.name.clone(), p.reference.clone()))
            .collect();
        self.imports = snap
            .pulls
            .iter()
            .filter(|p| p.imported)
            .map(|p| p.name.clone())
            .collect();
        self.packs = snap
            .pulls
            .iter()
            .filter(|p| !p.source_sandbox.is_empty())
            .map(|p| {
                let pack = DesiredPack {
                    sandbox: p.source_sandbox.clone(),
                    scrub: p.scrub.clone(),
                    config: opendsec_projections::ConfigOverride::from_event(p.config.as_ref()),
                };
                (p.name.clone(), pack)
            })
            .collect();
    }

    /// Folds an image event (`ImageRequested`, `ImageReady`, `ImageFailed`,
    /// `ImageDeleted`).
    pub(super) fn apply_image_event(&mut self, ev: &Event) {
        match ev {
            Event::ImageRequested(r) => {
                // Registered again: no longer deleted.
                self.images_deleted.remove(&r.name);
                if r.edge != self.edge {
                    return;
                }
                // A second request of a name replaces the first: a pull, a pack or an import.
                self.forget_image(&r.name);
                if r.imported {
                    self.imports.insert(r.name.clone());
                } else if r.source_sandbox.is_empty() {
                    self.pulls.insert(r.name.clone(), r.reference.clone());
                } else {
                    let pack = DesiredPack {
                        sandbox: r.source_sandbox.clone(),
                        scrub: r.scrub.clone(),
                        config: opendsec_projections::ConfigOverride::from_event(r.config.as_ref()),
                    };
                    self.packs.insert(r.name.clone(), pack);
                }
            }
            Event::ImageReady(r) => self.forget_image(&r.name),
            Event::ImageFailed(r) => self.forget_image(&r.name),
            Event::ImageDeleted(r) => {
                self.images_deleted.insert(r.name.clone());
                self.forget_image(&r.name);
            }
            _ => {}
        }
    }

    /// Image `name` is no longer to be made here.
    fn forget_image(&mut self, name: &str) {
        self.pulls.remove(name);
        self.packs.remove(name);
        self.imports.remove(name);
    }
}
