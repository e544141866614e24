//! Images: pulls, imports, packs, pushes and their progress.

use super::*;

/// `POST /v1/images`: register an image and have an edge pull it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PullImage {
    /// An OCI reference: `[registry[:port]/]repository[:tag][@sha256:digest]`. Without a
    /// registry, Docker Hub; a registry on loopback is spoken to over plain HTTP.
    pub reference: String,
    /// The name sandboxes start it by (default: the reference as given).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The project it belongs to (default: the token's); its descendants use it too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    /// The edge that pulls it (default: one chosen).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub edge: Option<String>,
}

/// `POST /v1/image-pushes`: push an image to an OCI registry.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PushImage {
    /// The image to push: one the caller's sandboxes can start from (pulled, imported,
    /// packed, or a built-in one).
    pub image: String,
    /// Where to: `registry[:port]/repository[:tag]` (a registry on loopback is spoken to
    /// over plain HTTP; credentials and other plain-HTTP registries are the edges').
    pub reference: String,
    /// An id of the caller's choosing (1 to 64 letters, digits, `-` and `_`; a random one)
    /// under which the push's progress can be read while it runs
    /// (`GET /v1/image-pushes/{id}?image=`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
}

/// A push's progress while it runs: its layers are written, then sent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ImagePushProgress {
    pub layers_done: u64,
    pub layers_total: u64,
    /// Compressed bytes sent (or found at the registry already) and in all, as the layers
    /// are written.
    pub bytes_done: u64,
    pub bytes_total: u64,
    /// The current step, for people.
    pub current: String,
}

/// What a push wrote.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ImagePushed {
    pub image: String,
    /// The reference pushed to, canonical.
    pub reference: String,
    /// The manifest's digest: `reference@digest` pulls exactly this image.
    pub digest: String,
    pub layers: u64,
    /// The compressed layers' size.
    pub bytes: u64,
    /// The edge that pushed it.
    pub edge: String,
}

/// `POST /v1/sandboxes/{id}/pack`: make an image of a container sandbox's file system (its
/// writable layer on top of its image), made and kept by the sandbox's edge.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PackSandbox {
    /// The name sandboxes (and E2B templates) start it by, in the sandbox's project.
    pub name: String,
    /// Absolute paths to leave out (a file, or a directory with all it holds), beside the
    /// residue every pack leaves out: the agent's files, what `/tmp`, `/var/tmp` and `/run`
    /// hold, shell histories, caches. At most 64.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scrub: Vec<String>,
}

/// How far a pull has come, as its edge last said (soft state, not logged).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct PullProgress {
    pub layers_total: u32,
    pub layers_done: u32,
    pub bytes_total: u64,
    pub bytes_done: u64,
    /// What the edge is doing now.
    pub phase: String,
    pub started_ms: u64,
}

/// A registered image.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Image {
    pub name: String,
    pub project: String,
    /// Where it is pulled from ("" for a packed or imported image).
    pub reference: String,
    /// The edge that pulls (or packs, or imports) it. A packed or imported image starts
    /// only there.
    pub edge: String,
    /// The sandbox it was packed from (absent for a pulled image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_sandbox: Option<String>,
    /// Imported from a tarball uploaded to its edge (absent when not).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub imported: bool,
    /// The paths its pack was asked to leave out (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub scrub: Vec<String>,
    /// pending, ready or failed.
    pub state: String,
    /// The manifest's digest, once pulled (a packed image's: its edge's image record's).
    pub digest: Option<String>,
    pub size_bytes: u64,
    pub layers: u32,
    pub reason: Option<String>,
    pub created_at_ms: u64,
    pub index: u64,
    /// While pending: how far its edge has come.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<PullProgress>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ImageWritten {
    pub index: u64,
    pub image: Image,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct ImageList {
    pub images: Vec<Image>,
    /// There is more: ask again with `page_token` set to this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_page_token: Option<String>,
}

/// What one edge's image store gave back to `POST /v1/image-store/prune`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct EdgePruned {
    pub edge: String,
    /// Layers, VM disks and scratch entries removed (0 when the edge failed).
    pub layers: u64,
    pub disks: u64,
    pub scratch: u64,
    /// Bytes of the files removed (apparent sizes).
    pub bytes: u64,
    /// Why this edge pruned nothing (unreachable, or its store refused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The answer to `POST /v1/image-store/prune`: every registered edge's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(ToSchema))]
pub struct Pruned {
    pub edges: Vec<EdgePruned>,
}
