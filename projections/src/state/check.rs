//! Apply-time validation: a batch is checked whole against the applied state before
//! any of it is folded in (invariant 2); a batch that conflicts changes nothing but the
//! audit view.

use super::*;

/// Changes earlier events of the same batch make, seen by the checks of later ones.
#[derive(Default)]
struct Pending {
    usage: BTreeMap<String, Usage>,
    edge_usage: BTreeMap<String, Usage>,
    sandbox_ids: BTreeSet<String>,
    /// Projects created earlier in the batch (bootstrap issues a token in its new root).
    projects: BTreeSet<String>,
    /// (project, idempotency key) of sandboxes created earlier in the batch.
    idempotency_keys: BTreeSet<(String, String)>,
}

impl State {
    pub(super) fn check_all(&self, events: &[Event]) -> Result<(), String> {
        let mut pending = Pending::default();
        for ev in events {
            self.check(ev, &mut pending)?;
        }
        Ok(())
    }

    pub(super) fn sandbox(&self, id: &str) -> Result<&Sandbox, String> {
        self.sandboxes
            .sandboxes
            .get(id)
            .ok_or_else(|| format!("sandbox {id} does not exist"))
    }

    pub(super) fn template_build(&self, template: &str, build: &str) -> Result<&TemplateBuild, String> {
        self.images
            .templates
            .get(template)
            .ok_or_else(|| format!("template {template} does not exist"))?
            .builds
            .get(build)
            .ok_or_else(|| format!("build {build} of template {template} does not exist"))
    }

    fn check(&self, ev: &Event, pending: &mut Pending) -> Result<(), String> {
        match ev {
            Event::ProjectCreated(e) => {
                if self.iam.projects.contains_key(&e.id) || !pending.projects.insert(e.id.clone()) {
                    return Err(format!("project {} already exists", e.id));
                }
                if !e.parent.is_empty() && self.ancestry(&e.parent).len() >= MAX_PROJECT_DEPTH {
                    return Err(format!("projects nest at most {MAX_PROJECT_DEPTH} deep"));
                }
                if e.parent.is_empty() {
                    if self.root_project().is_some() {
                        return Err("a root project already exists".into());
                    }
                } else {
                    let parent = self
                        .iam
                        .projects
                        .get(&e.parent)
                        .ok_or_else(|| format!("parent project {} does not exist", e.parent))?;
                    let taken = parent
                        .children
                        .iter()
                        .any(|c| self.iam.projects.get(c).is_some_and(|p| p.name == e.name));
                    if taken {
                        return Err(format!("project {} already has a child named {}", e.parent, e.name));
                    }
                }
            }
            Event::ProjectDeleted(e) => {
                let p = self
                    .iam
                    .projects
                    .get(&e.id)
                    .ok_or_else(|| format!("project {} does not exist", e.id))?;
                if p.parent.is_none() {
                    return Err("the root project cannot be deleted".into());
                }
                if !p.children.is_empty() {
                    return Err(format!("project {} still has child projects", e.id));
                }
                if self.quota.usage.get(&e.id).is_some_and(|u| u.sandboxes > 0) {
                    return Err(format!("project {} still has live sandboxes", e.id));
                }
            }
            Event::ProjectRateLimitsSet(e) => {
                let p = self
                    .iam
                    .projects
                    .get(&e.project)
                    .ok_or_else(|| format!("project {} does not exist", e.project))?;
                if let Some(parent) = p.parent.as_deref() {
                    let bound = self.effective_rates(parent);
                    for (what, mine, theirs) in [
                        ("writes_per_second", e.writes_per_second, bound.writes_per_second),
                        (
                            "token_writes_per_second",
                            e.token_writes_per_second,
                            bound.token_writes_per_second,
                        ),
                    ] {
                        if let Some(theirs) = theirs
                            && mine > theirs
                        {
                            return Err(format!("{what} is above the parent project's {theirs}"));
                        }
                    }
                }
            }
            Event::ProjectNetworkSet(e) => {
                let p = self
                    .iam
                    .projects
                    .get(&e.project)
                    .ok_or_else(|| format!("project {} does not exist", e.project))?;
                let ceiling =
                    Egress::parse(&e.ceiling).ok_or_else(|| format!("unknown egress ceiling {:?}", e.ceiling))?;
                if let Some(parent) = p.parent.as_deref()
                    && ceiling > self.egress_ceiling(parent)
                {
                    return Err(format!(
                        "egress ceiling {} is above the parent project's {}",
                        ceiling.as_str(),
                        self.egress_ceiling(parent).as_str()
                    ));
                }
            }
            Event::QuotaSet(e) => {
                let p = self
                    .iam
                    .projects
                    .get(&e.project)
                    .ok_or_else(|| format!("project {} does not exist", e.project))?;
                let limits = limits_from_pb(e.limits.as_ref());
                let bound = self.bound_for_child_of(p.parent.as_deref());
                if let Some((res, mine, theirs)) = limits.exceeds(&bound) {
                    let mine = if mine == u64::MAX {
                        "unlimited".to_string()
                    } else {
                        mine.to_string()
                    };
                    return Err(format!("{res} limit {mine} exceeds the parent's limit {theirs}"));
                }
                if let Some((c, res, _)) = self.descendant_limit_above(&e.project, &limits) {
                    return Err(format!("{res} limit is below that of child project {c}"));
                }
                let used = self.quota.usage.get(&e.project).copied().unwrap_or_default();
                if let Some((res, limit)) = limits.exceeded_by(&used) {
                    return Err(format!("{res} limit {limit} is below current usage"));
                }
            }
            Event::TokenIssued(e) => {
                if self.iam.tokens.contains_key(&e.id) {
                    return Err(format!("token {} already exists", e.id));
                }
                if !self.iam.projects.contains_key(&e.project) && !pending.projects.contains(&e.project) {
                    return Err(format!("project {} does not exist", e.project));
                }
            }
            Event::TokenRevoked(e) => {
                if !self.iam.tokens.contains_key(&e.id) {
                    return Err(format!("token {} does not exist", e.id));
                }
            }
            Event::EdgeRegistered(e) => match self.placement.edges.get(&e.id) {
                Some(old) if old.ordinal != e.ordinal => {
                    return Err(format!("edge {} keeps ordinal {}", e.id, old.ordinal));
                }
                None if e.ordinal != self.placement.next_ordinal => {
                    return Err(format!(
                        "edge ordinal {} was taken; next is {}",
                        e.ordinal, self.placement.next_ordinal
                    ));
                }
                _ => {}
            },
            Event::EdgeDeregistered(e) => {
                if !self.placement.edges.contains_key(&e.id) {
                    return Err(format!("edge {} is not registered", e.id));
                }
            }
            Event::SandboxCreated(e) => {
                if self.sandboxes.sandboxes.contains_key(&e.id) || !pending.sandbox_ids.insert(e.id.clone()) {
                    return Err(format!("sandbox id {} is taken", e.id));
                }
                if !self.iam.projects.contains_key(&e.project) {
                    return Err(format!("project {} does not exist", e.project));
                }
                let isolation = Isolation::from_event(&e.isolation)
                    .ok_or_else(|| format!("isolation {:?} is unknown", e.isolation))?;
                CpuClass::from_event(&e.cpu_class).ok_or_else(|| format!("cpu class {:?} is unknown", e.cpu_class))?;
                if !e.idempotency_key.is_empty()
                    && (self
                        .sandboxes
                        .by_idempotency_key(&e.project, &e.idempotency_key)
                        .is_some()
                        || !pending
                            .idempotency_keys
                            .insert((e.project.clone(), e.idempotency_key.clone())))
                {
                    return Err(format!(
                        "a live sandbox of project {} already has idempotency key {}",
                        e.project, e.idempotency_key
                    ));
                }
                if !e.snapshot.is_empty() {
                    match self.snapshots.snapshots.get(&e.snapshot) {
                        Some(x) if x.state == SnapshotState::Ready => {
                            // A microVM's snapshot holds a whole machine: only a microVM starts
                            // from it; a file-system snapshot is a container's layer.
                            if x.isolation != isolation {
                                return Err(format!(
                                    "snapshot {} is of a {}, the sandbox a {}",
                                    e.snapshot,
                                    x.isolation.as_str(),
                                    isolation.as_str()
                                ));
                            }
                        }
                        _ => return Err(format!("snapshot {} is not ready", e.snapshot)),
                    }
                }
                let u = created_usage(e);
                let reserved = pending.edge_usage.get(&e.edge).copied().unwrap_or_default();
                self.check_edge(&e.edge, &u, &reserved)?;
                let overlay = |p: &str| pending.usage.get(p).copied().unwrap_or_default();
                self.check_quota(&e.project, &u, &overlay)?;
                pending.edge_usage.entry(e.edge.clone()).or_default().add(&u);
                for p in self.ancestry(&e.project) {
                    pending.usage.entry(p.id.clone()).or_default().add(&u);
                }
            }
            Event::SnapshotRequested(e) => {
                if self.snapshots.snapshots.contains_key(&e.id) {
                    return Err(format!("snapshot id {} is taken", e.id));
                }
                if Isolation::from_event(&e.isolation).is_none() {
                    return Err(format!("isolation {:?} is unknown", e.isolation));
                }
                if !self.sandbox(&e.sandbox)?.is_live() {
                    return Err(format!("sandbox {} is no longer running", e.sandbox));
                }
            }
            Event::ImageRequested(e) => {
                if !self.iam.projects.contains_key(&e.project) {
                    return Err(format!("project {} does not exist", e.project));
                }
                if let Some(x) = self.images.images.get(&e.name)
                    && x.project != e.project
                {
                    return Err(format!("image name {} is taken by another project", e.name));
                }
                if !e.source_sandbox.is_empty() && !self.sandbox(&e.source_sandbox)?.is_live() {
                    return Err(format!("sandbox {} is no longer running", e.source_sandbox));
                }
                if e.imported && !(e.reference.is_empty() && e.source_sandbox.is_empty()) {
                    return Err(format!("imported image {} names a reference or a sandbox", e.name));
                }
            }
            Event::TemplateBuildRequested(e) => {
                if !self.iam.projects.contains_key(&e.project) {
                    return Err(format!("project {} does not exist", e.project));
                }
                if let Some(t) = self.images.templates.get(&e.template_id) {
                    if t.project != e.project {
                        return Err(format!("template {} belongs to another project", e.template_id));
                    }
                    if t.builds.contains_key(&e.build_id) {
                        return Err(format!("build {} already exists", e.build_id));
                    }
                }
                if !e.name.is_empty()
                    && let Some(t) = self.images.template_named(&e.name)
                    && t.id != e.template_id
                {
                    return Err(format!("template name {} is taken", e.name));
                }
            }
            Event::TemplateBuildStarted(e) => {
                if self.template_build(&e.template_id, &e.build_id)?.status != BuildStatus::Waiting {
                    return Err(format!("build {} has started already", e.build_id));
                }
            }
            Event::TemplateBuildFinished(e) => {
                if matches!(
                    self.template_build(&e.template_id, &e.build_id)?.status,
                    BuildStatus::Ready | BuildStatus::Error
                ) {
                    return Err(format!("build {} has ended already", e.build_id));
                }
            }
            Event::TemplateTagsSet(e) => {
                if !e.build_id.is_empty() {
                    self.template_build(&e.template_id, &e.build_id)?;
                } else if !self.images.templates.contains_key(&e.template_id) {
                    return Err(format!("template {} does not exist", e.template_id));
                }
            }
            Event::TemplateDeleted(e) => {
                if !self.images.templates.contains_key(&e.template_id) {
                    return Err(format!("template {} does not exist", e.template_id));
                }
            }
            Event::RetentionSet(e) => {
                if let Some((field, why)) = Retention::invalid(e) {
                    return Err(format!("{field}: {why}"));
                }
            }
            Event::SandboxLabelsSet(e) => {
                let s = self.sandbox(&e.id)?;
                // Labels that grow count against the quota like a create's.
                let grows = labels_growth(&s.labels, &e.labels);
                if s.is_live() && grows.metadata_bytes > 0 {
                    let overlay = |p: &str| pending.usage.get(p).copied().unwrap_or_default();
                    self.check_quota(&s.project, &grows, &overlay)?;
                    for p in self.ancestry(&s.project) {
                        pending.usage.entry(p.id.clone()).or_default().add(&grows);
                    }
                }
            }
            Event::SandboxForkRequested(e) => {
                let s = self.sandbox(&e.id)?;
                if !s.is_live() {
                    return Err(format!("sandbox {} is no longer running", e.id));
                }
            }
            other => {
                if let Some(id) = other.sandbox_id() {
                    self.sandbox(id)?;
                }
            }
        }
        Ok(())
    }
}
