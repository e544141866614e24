//! Templates (E2B's template builds): a project's named recipe whose builds each pack an
//! image from a sandbox that ran the build's steps. The steps are run by whoever asked
//! (the gateway's builder, as the caller); the log holds the template, its builds' states
//! and tags, so any node answers status and names. A template's name, `name:tag` or id
//! means, at create, the image of the build it names ([`image_for`]).

use super::Decided;
use super::scope::{Scope, not_found};
use crate::images::{check_name, is_builtin};
use crate::validate::{self, LIMITS};
use crate::{Rejection, RejectionKind as K};
use opendsec_projections::pb;
use opendsec_projections::{BuildStatus, DEFAULT_TEMPLATE_TAG, Event, Right, Template};

/// At most this many tags on one template.
pub const MAX_TAGS: usize = 64;
/// The longest start or ready command.
const MAX_COMMAND: usize = 16 * 1024;

/// The image a build of template `template_id` packs.
pub fn build_image(template_id: &str, build_id: &str) -> String {
    format!("tpl-{template_id}-{}", build_id.replace('-', ""))
}

/// `RequestTemplateBuild`.
pub(super) fn request(
    s: &Scope,
    project: &str,
    name: Option<&str>,
    tags: &[String],
    cpu_count: u32,
    memory_mb: u32,
) -> Result<Decided, Rejection> {
    s.project_in_scope("project", project)?;
    s.who.require(Right::SandboxWrite)?;
    if let Some(n) = name {
        check_template_name(n)?;
    }
    check_tags("tags", tags)?;
    validate::amount("cpuCount", cpu_count as u64, 256)?;
    validate::amount("memoryMB", memory_mb as u64, LIMITS.memory_mb)?;
    let existing = match name {
        Some(n) => match s.state.images.template_named(n) {
            Some(t) if t.project == project => Some(t),
            Some(_) => {
                return Err(Rejection::field(
                    K::Conflict,
                    "name",
                    format!("template name {n} is taken by another project"),
                ));
            }
            None => {
                name_is_free(s, n, "name")?;
                None
            }
        },
        None => None,
    };
    let mut rng = s.rng();
    let template_id = match existing {
        Some(t) => t.id.clone(),
        None => {
            const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
            (0..20)
                .map(|_| ALPHABET[(rng.next_u64() % ALPHABET.len() as u64) as usize] as char)
                .collect()
        }
    };
    let build_id = uuid_v4(rng.next_u64(), rng.next_u64());
    let tags = if tags.is_empty() {
        vec![DEFAULT_TEMPLATE_TAG.to_string()]
    } else {
        tags.to_vec()
    };
    Ok(Decided::one(
        project,
        &template_id,
        Event::TemplateBuildRequested(pb::TemplateBuildRequested {
            template_id: template_id.clone(),
            build_id,
            project: project.to_string(),
            name: name.unwrap_or_default().to_string(),
            tags,
            cpu_count,
            memory_mb,
        }),
    ))
}

/// What `StartTemplateBuild` says of a build.
pub(super) struct Start<'a> {
    pub from: &'a str,
    pub start_cmd: Option<&'a str>,
    pub ready_cmd: Option<&'a str>,
    pub steps: u32,
    pub runner: &'a str,
}

/// `StartTemplateBuild`.
pub(super) fn start(s: &Scope, template: &str, build: &str, st: Start<'_>) -> Result<Decided, Rejection> {
    let Start {
        from,
        start_cmd,
        ready_cmd,
        steps,
        runner,
    } = st;
    let t = template_in_scope(s, template)?;
    let b = t.builds.get(build).ok_or_else(|| not_found("build", "build", build))?;
    if b.status != BuildStatus::Waiting {
        return Err(Rejection::field(
            K::Conflict,
            "build",
            format!("build {build} of template {template} has started already"),
        ));
    }
    if from.is_empty() {
        return Err(Rejection::field(
            K::Invalid,
            "fromImage",
            "a build starts from an image or a template",
        ));
    }
    validate::text("fromImage", from, LIMITS.image_len)?;
    for (field, cmd) in [("startCmd", start_cmd), ("readyCmd", ready_cmd)] {
        if let Some(c) = cmd {
            validate::text(field, c, MAX_COMMAND)?;
        }
    }
    validate::amount("steps", steps as u64, 10_000)?;
    validate::text("runner", runner, 128)?;
    Ok(Decided::one(
        &t.project,
        &t.id,
        Event::TemplateBuildStarted(pb::TemplateBuildStarted {
            template_id: t.id.clone(),
            build_id: build.to_string(),
            image: build_image(&t.id, build),
            from: from.to_string(),
            start_cmd: start_cmd.unwrap_or_default().to_string(),
            ready_cmd: ready_cmd.unwrap_or_default().to_string(),
            steps,
            runner: runner.to_string(),
        }),
    ))
}

/// `FinishTemplateBuild`: a build said ready has its image ready.
pub(super) fn finish(
    s: &Scope,
    template: &str,
    build: &str,
    error: Option<&str>,
    error_step: Option<&str>,
) -> Result<Decided, Rejection> {
    let t = template_in_scope(s, template)?;
    let b = t.builds.get(build).ok_or_else(|| not_found("build", "build", build))?;
    if matches!(b.status, BuildStatus::Ready | BuildStatus::Error) {
        return Err(Rejection::field(
            K::Conflict,
            "build",
            format!("build {build} of template {template} has ended already"),
        ));
    }
    if let Some(e) = error {
        validate::text("error", e, LIMITS.reason_len)?;
    }
    if let Some(st) = error_step {
        validate::text("error_step", st, 64)?;
    }
    if error.is_none() {
        let ready = b
            .image
            .as_ref()
            .and_then(|i| s.state.images.images.get(i))
            .is_some_and(|i| i.state == opendsec_projections::ImageState::Ready);
        if !ready {
            return Err(Rejection::field(
                K::Conflict,
                "build",
                format!("build {build} has no ready image yet"),
            ));
        }
    }
    Ok(Decided::one(
        &t.project,
        &t.id,
        Event::TemplateBuildFinished(pb::TemplateBuildFinished {
            template_id: t.id.clone(),
            build_id: build.to_string(),
            error: error
                .map(|e| if e.is_empty() { "the build failed" } else { e })
                .unwrap_or_default()
                .to_string(),
            error_step: error_step.unwrap_or_default().to_string(),
        }),
    ))
}

/// `SetTemplateTags`.
pub(super) fn set_tags(s: &Scope, template: &str, build: Option<&str>, tags: &[String]) -> Result<Decided, Rejection> {
    let t = template_in_scope(s, template)?;
    if tags.is_empty() {
        return Err(Rejection::field(K::Invalid, "tags", "name at least one tag"));
    }
    check_tags("tags", tags)?;
    if let Some(b) = build {
        let status = t.builds.get(b).map(|x| x.status);
        if status != Some(BuildStatus::Ready) {
            return Err(Rejection::field(
                K::Conflict,
                "target",
                format!("build {b} of template {template} is not ready: only a ready build is tagged"),
            ));
        }
        let mut all: std::collections::BTreeSet<&str> = t.tags.keys().map(String::as_str).collect();
        all.extend(tags.iter().map(String::as_str));
        if all.len() > MAX_TAGS {
            return Err(Rejection::field(
                K::Invalid,
                "tags",
                format!("a template has at most {MAX_TAGS} tags"),
            ));
        }
    }
    Ok(Decided::one(
        &t.project,
        &t.id,
        Event::TemplateTagsSet(pb::TemplateTagsSet {
            template_id: t.id.clone(),
            build_id: build.unwrap_or_default().to_string(),
            tags: tags.to_vec(),
        }),
    ))
}

/// `DeleteTemplate`: the template, then its builds' images.
pub(super) fn delete(s: &Scope, template: &str) -> Result<Decided, Rejection> {
    let t = template_in_scope(s, template)?;
    let mut events = vec![Event::TemplateDeleted(pb::TemplateDeleted {
        template_id: t.id.clone(),
    })];
    for b in t.builds.values() {
        if let Some(x) = b.image.as_ref().and_then(|i| s.state.images.images.get(i)) {
            events.push(Event::ImageDeleted(pb::ImageDeleted {
                name: x.name.clone(),
                edge: x.edge.clone(),
            }));
        }
    }
    Ok(Decided {
        events,
        project: t.project.clone(),
        target: t.id.clone(),
    })
}

/// The image a create of `project` means by `asked` when it names a template of the
/// project or an ancestor (`name`, `name:tag` or the template's id): the ready build the
/// tag names (the default tag, else the newest ready build). `None`: not a template.
pub(super) fn image_for(s: &Scope, project: &str, asked: &str) -> Result<Option<String>, Rejection> {
    let (name, tag) = match asked.split_once(':') {
        Some((n, t)) => (n, Some(t)),
        None => (asked, None),
    };
    let Some(t) = s
        .state
        .images
        .template_named(name)
        .filter(|t| s.state.within(project, &t.project))
    else {
        return Ok(None);
    };
    match t.build_for(tag) {
        Some(b) => Ok(b.image.clone()),
        None => Err(Rejection::field(
            K::Conflict,
            "image",
            match tag {
                Some(tag) => format!("template {name} has no ready build tagged {tag}"),
                None => format!("template {name} has no ready build yet: wait for its build to finish"),
            },
        )),
    }
}

/// A name an image may take: no template has it (nor a template's id).
pub(super) fn not_a_template(s: &Scope, name: &str, field: &str) -> Result<(), Rejection> {
    if s.state.images.template_named(name).is_some() {
        return Err(Rejection::field(
            K::Conflict,
            field,
            format!("{name} is a template's name"),
        ));
    }
    Ok(())
}

/// A name a new template may take: no template or image has it.
fn name_is_free(s: &Scope, name: &str, field: &str) -> Result<(), Rejection> {
    not_a_template(s, name, field)?;
    if s.state.images.images.contains_key(name) {
        return Err(Rejection::field(
            K::Conflict,
            field,
            format!("{name} is an image's name"),
        ));
    }
    Ok(())
}

/// The template named `template` (name or id) in the caller's subtree, once the caller
/// holds sandbox:write.
fn template_in_scope<'a>(s: &Scope<'a>, template: &str) -> Result<&'a Template, Rejection> {
    validate::text("template", template, LIMITS.image_len)?;
    let t = s
        .state
        .images
        .template_named(template)
        .ok_or_else(|| not_found("template", "template", template))?;
    s.who.require(Right::SandboxWrite)?;
    if !s.state.within(&t.project, &s.who.project) {
        return Err(Rejection::field(
            K::Forbidden,
            "template",
            format!("template {template} is outside the caller's project"),
        ));
    }
    Ok(t)
}

/// A template's name: an image name without a tag or registry.
fn check_template_name(name: &str) -> Result<(), Rejection> {
    if name.contains(':') || name.contains('/') {
        return Err(Rejection::field(
            K::Invalid,
            "name",
            format!("template name {name:?} must not hold ':' or '/' (a tag goes in tags)"),
        ));
    }
    if is_builtin(name) {
        return Err(Rejection::field(
            K::Invalid,
            "name",
            format!("{name:?} is a built-in image"),
        ));
    }
    check_name(name).map_err(|e| Rejection::field(K::Invalid, "name", e.replace("image name", "template name")))
}

fn check_tags(field: &str, tags: &[String]) -> Result<(), Rejection> {
    if tags.len() > MAX_TAGS {
        return Err(Rejection::field(K::Invalid, field, format!("at most {MAX_TAGS} tags")));
    }
    for t in tags {
        let ok = !t.is_empty()
            && t.len() <= 128
            && t.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !ok {
            return Err(Rejection::field(
                K::Invalid,
                field,
                format!("tag {t:?} must be 1 to 128 letters, digits, '.', '_' or '-'"),
            ));
        }
    }
    Ok(())
}

/// A version-4 UUID from 128 random bits (E2B's SDK parses build ids as UUIDs).
fn uuid_v4(hi: u64, lo: u64) -> String {
    let bytes = ((hi as u128) << 64 | lo as u128).to_be_bytes();
    uuid::Builder::from_random_bytes(bytes).into_uuid().to_string()
}
