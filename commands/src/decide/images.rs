//! Images: registered by a project under a name, pulled by one edge (or packed by one
//! edge from a container sandbox's writable layer, or imported by one edge from a
//! tarball the caller uploads), reported by that edge, deleted by name. Which image a
//! create names is decided in `sandboxes` through [`resolve`]; a packed or imported
//! image lives only in its edge's store, so its creates prefer that edge ([`packed_edge`]).

use super::Decided;
use super::scope::{Scope, not_found};
use crate::images::{Reference, check_name, is_builtin, names_a_registry};
use crate::validate::{self, LIMITS};
use crate::{ImageResult, Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::{ConfigOverride, Event, Image, ImageState, Observed, Right};

/// `PullImage`.
pub(super) fn pull(
    s: &Scope,
    project: &str,
    name: &str,
    reference: &str,
    edge: Option<&str>,
) -> Result<Decided, Rejection> {
    let parsed = Reference::parse(reference).map_err(|e| Rejection::field(K::Invalid, "reference", e))?;
    let edge = register(s, project, name, edge, "pull")?;
    Ok(fetched(project, name, edge, parsed.to_string(), false))
}

/// `ImportImage`: the edge waits for the caller's upload of the tarball.
pub(super) fn import(s: &Scope, project: &str, name: &str, edge: Option<&str>) -> Result<Decided, Rejection> {
    let edge = register(s, project, name, edge, "import")?;
    Ok(fetched(project, name, edge, String::new(), true))
}

/// The request that `edge` fetch image `name` of `project`: pull it from `reference`, or
/// take the caller's upload (`imported`).
fn fetched(project: &str, name: &str, edge: String, reference: String, imported: bool) -> Decided {
    Decided::one(
        project,
        name,
        Event::ImageRequested(pb::ImageRequested {
            name: name.to_string(),
            project: project.to_string(),
            reference,
            edge,
            imported,
            ..Default::default()
        }),
    )
}

/// What a pull and an import check before registering image `name` in `project`; the
/// edge that is to fetch it (`edge`, or one chosen at random).
fn register(s: &Scope, project: &str, name: &str, edge: Option<&str>, verb: &str) -> Result<String, Rejection> {
    check_name(name).map_err(|e| Rejection::field(K::Invalid, "name", e))?;
    s.project_in_scope("project", project)?;
    super::templates::not_a_template(s, name, "name")?;
    s.who.require(Right::SandboxWrite)?;
    if let Some(x) = s.state.images.images.get(name)
        && x.project != project
    {
        return Err(Rejection::field(
            K::Conflict,
            "name",
            format!("image name {name} is taken by another project"),
        ));
    }
    let edges: Vec<&str> = s
        .state
        .placement
        .edges
        .values()
        .filter(|e| !e.deregistered)
        .map(|e| e.id.as_str())
        .collect();
    match edge {
        Some(asked) if edges.contains(&asked) => Ok(asked.to_string()),
        Some(asked) => Err(not_found("edge", "edge", asked)),
        None if edges.is_empty() => Err(Rejection::field(
            K::NoCapacity,
            "edge",
            format!("no edge is registered to {verb} the image: start one (opendsec edge)"),
        )),
        None => Ok(edges[(s.rng().next_u64() % edges.len() as u64) as usize].to_string()),
    }
}

/// `PackSandbox`: the sandbox's edge makes the image; it belongs to the sandbox's project.
pub(super) fn pack(
    s: &Scope,
    sandbox: &str,
    name: &str,
    scrub: &[String],
    config: Option<&ConfigOverride>,
) -> Result<Decided, Rejection> {
    check_name(name).map_err(|e| Rejection::field(K::Invalid, "name", e))?;
    validate::scrub("scrub", scrub)?;
    if let Some(c) = config {
        validate::config_override("config", c)?;
    }
    super::templates::not_a_template(s, name, "name")?;
    let src = s.live_sandbox(sandbox, Right::SandboxWrite)?;
    if src.isolation.is_machine() {
        return Err(Rejection::field(
            K::Invalid,
            "sandbox",
            format!(
                "sandbox {sandbox} is a {}: its disk is not a layer to pack; snapshot it instead \
                 (opendsecctl sandbox snapshot {sandbox}) and start sandboxes from the snapshot",
                src.isolation.noun()
            ),
        ));
    }
    if src.observed != Observed::Ready && src.observed != Observed::Paused {
        return Err(Rejection::field(
            K::Conflict,
            "sandbox",
            format!("sandbox {sandbox} is not running yet"),
        ));
    }
    if let Some(x) = s.state.images.images.get(name)
        && x.project != src.project
    {
        return Err(Rejection::field(
            K::Conflict,
            "name",
            format!("image name {name} is taken by another project"),
        ));
    }
    Ok(Decided::one(
        &src.project,
        name,
        Event::ImageRequested(pb::ImageRequested {
            name: name.to_string(),
            project: src.project.clone(),
            reference: String::new(),
            edge: src.edge.clone(),
            source_sandbox: sandbox.to_string(),
            scrub: scrub.to_vec(),
            config: config.filter(|c| !c.is_empty()).map(ConfigOverride::to_event),
            imported: false,
        }),
    ))
}

/// `DeleteImage`.
pub(super) fn delete(s: &Scope, name: &str) -> Result<Decided, Rejection> {
    let x = image_in_scope(s, name, Right::SandboxWrite)?;
    Ok(Decided::one(
        &x.project,
        name,
        Event::ImageDeleted(pb::ImageDeleted {
            name: name.to_string(),
            edge: x.edge.clone(),
        }),
    ))
}

/// `ReportImage`: what the pulling edge made of the request.
pub(super) fn report(s: &Scope, name: &str, result: &ImageResult) -> Result<Decided, Rejection> {
    let x = image_in_scope(s, name, Right::EdgeWrite)?;
    s.acts_for_edge("name", &x.edge)?;
    if x.state != ImageState::Pending {
        return Err(Rejection::field(
            K::Conflict,
            "name",
            format!("image {name} was already reported"),
        ));
    }
    let ev = match result {
        ImageResult::Ready {
            digest,
            size_bytes,
            layers,
        } => {
            let pinned = format!("x.invalid/x@{digest}");
            if Reference::parse(&pinned).is_err() {
                return Err(Rejection::field(
                    K::Invalid,
                    "result.digest",
                    "digest must be sha256:<64 lowercase hex digits>",
                ));
            }
            Event::ImageReady(pb::ImageReady {
                name: name.to_string(),
                edge: x.edge.clone(),
                digest: digest.clone(),
                size_bytes: *size_bytes,
                layers: *layers,
            })
        }
        ImageResult::Failed { reason } => {
            validate::text("result.reason", reason, LIMITS.reason_len)?;
            Event::ImageFailed(pb::ImageFailed {
                name: name.to_string(),
                edge: x.edge.clone(),
                reason: reason.clone(),
            })
        }
    };
    Ok(Decided::one(&x.project, name, ev))
}

/// The image `name` of the caller's subtree, once the caller holds `right`.
fn image_in_scope<'a>(s: &Scope<'a>, name: &str, right: Right) -> Result<&'a Image, Rejection> {
    validate::text("name", name, LIMITS.image_len)?;
    let x = s
        .state
        .images
        .images
        .get(name)
        .ok_or_else(|| not_found("name", "image", name))?;
    s.who.require(right)?;
    if !s.state.within(&x.project, &s.who.project) {
        return Err(Rejection::field(
            K::Forbidden,
            "name",
            format!("image {name} is outside the caller's project"),
        ));
    }
    Ok(x)
}

/// Where an edge fetches the image a create of `project` names, if it must: the
/// registered image's pinned reference, "" for a built-in image or a reference that names
/// its registry (the edge builds or pulls it by the name itself), or a packed image (its
/// edge holds it). An image registered by the project or an ancestor is usable once it
/// has not failed (a packed one once it is ready); any other name is 404.
pub(super) fn resolve(s: &Scope, project: &str, image: &str) -> Result<String, Rejection> {
    if let Some(x) = s.state.images.images.get(image)
        && s.state.within(project, &x.project)
    {
        let reason = || x.reason.as_deref().unwrap_or("no reason given").to_string();
        let (made, again) = if x.is_packed() {
            ("pack", "pack it again (opendsecctl sandbox pack)")
        } else if x.imported {
            ("import", "import it again (opendsecctl image import)")
        } else {
            ("pull", "pull it again (opendsecctl image pull)")
        };
        return match (x.state, x.is_local()) {
            (ImageState::Failed, _) => Err(Rejection::field(
                K::Conflict,
                "image",
                format!("image {image} failed to {made}: {}; {again}", reason()),
            )),
            (ImageState::Pending, true) => Err(Rejection::field(
                K::Conflict,
                "image",
                format!(
                    "image {image} is still being {}ed on edge {}; wait until it is ready \
                     (opendsecctl image get {image})",
                    made.trim_end_matches('e'),
                    x.edge
                ),
            )),
            (ImageState::Pending | ImageState::Ready, _) => Ok(x.source()),
        };
    }
    if is_builtin(image) || names_a_registry(image) {
        return Ok(String::new());
    }
    Err(Rejection::field(
        K::NotFound,
        "image",
        format!(
            "no image named {image}: the built-in images are {}; \
             pull others with `opendsecctl image pull <reference>`, or name a registry (host[:port]/repository[:tag])",
            crate::images::BUILTIN_IMAGES.join(", ")
        ),
    ))
}

/// The edge holding `image` when a create of `project` names a packed or imported
/// image: no other edge has it, so the create goes there while it has room (elsewhere it
/// fails, saying why).
pub(super) fn packed_edge<'a>(s: &Scope<'a>, project: &str, image: &str) -> Option<&'a str> {
    s.state
        .images
        .images
        .get(image)
        .filter(|x| x.is_local() && s.state.within(project, &x.project))
        .map(|x| x.edge.as_str())
}

/// Where an edge fetches `image` (the image under a snapshot or a fork's source) if its
/// store lacks it: the registered image's pinned reference, else "" (built by the edge,
/// pulled by its own name, or gone: the source's edge still serves its layers).
pub(super) fn source_of(state: &opendsec_projections::State, image: &str) -> String {
    state.images.images.get(image).map(Image::source).unwrap_or_default()
}
