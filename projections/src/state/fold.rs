//! The folds: one checked event into every view it changes.

use super::*;

impl State {
    pub(super) fn apply_event(&mut self, index: u64, t: u64, ev: &Event) {
        match ev {
            // Recorded for the audit view; Raft's configuration entries carry the change.
            Event::ClusterMembershipChangeRequested(_) => {}
            Event::RetentionSet(e) => self.retention = Retention::from_event(e),
            Event::ProjectCreated(e) => {
                let parent = (!e.parent.is_empty()).then(|| e.parent.clone());
                if let Some(p) = parent.as_ref().and_then(|p| self.iam.projects.get_mut(p)) {
                    p.children.insert(e.id.clone());
                }
                self.iam.projects.insert(
                    e.id.clone(),
                    Project {
                        id: e.id.clone(),
                        name: e.name.clone(),
                        parent,
                        children: BTreeSet::new(),
                        created_at_ms: t,
                    },
                );
            }
            Event::ProjectDeleted(e) => {
                if let Some(p) = self.iam.projects.remove(&e.id)
                    && let Some(parent) = p.parent.as_ref().and_then(|id| self.iam.projects.get_mut(id))
                {
                    parent.children.remove(&e.id);
                }
                self.quota.limits.remove(&e.id);
                self.quota.usage.remove(&e.id);
                self.quota.network.remove(&e.id);
                self.quota.rates.remove(&e.id);
            }
            Event::ProjectRateLimitsSet(e) => {
                let rates = Rates {
                    writes_per_second: (e.writes_per_second > 0).then_some(e.writes_per_second),
                    token_writes_per_second: (e.token_writes_per_second > 0).then_some(e.token_writes_per_second),
                };
                if rates == Rates::default() {
                    self.quota.rates.remove(&e.project);
                } else {
                    self.quota.rates.insert(e.project.clone(), rates);
                }
            }
            Event::ProjectNetworkSet(e) => {
                self.quota.network.insert(
                    e.project.clone(),
                    ProjectNetwork {
                        ceiling: Egress::parse(&e.ceiling).unwrap_or_default(),
                        default_network: (!e.default_network.is_empty()).then(|| e.default_network.clone()),
                    },
                );
            }
            Event::QuotaSet(e) => {
                self.quota
                    .limits
                    .insert(e.project.clone(), limits_from_pb(e.limits.as_ref()));
            }
            Event::TokenIssued(e) => {
                let rights = e.rights.iter().filter_map(|r| Right::parse(r)).collect();
                self.iam.tokens.insert(
                    e.id.clone(),
                    Token {
                        id: e.id.clone(),
                        project: e.project.clone(),
                        name: e.name.clone(),
                        rights,
                        secret_sha256: hex::encode(&e.secret_sha256),
                        expires_at_ms: (e.expires_at_ms != 0).then_some(e.expires_at_ms),
                        issued_by: (!e.issued_by.is_empty()).then(|| e.issued_by.clone()),
                        issued_at_ms: t,
                        revoked: None,
                    },
                );
            }
            Event::TokenRevoked(e) => {
                if let Some(tok) = self.iam.tokens.get_mut(&e.id)
                    && tok.revoked.is_none()
                {
                    tok.revoked = Some(Revocation {
                        at_ms: t,
                        reason: e.reason.clone(),
                    });
                }
            }
            Event::EdgeRegistered(e) => {
                let capacity = usage_from_pb(e.capacity.as_ref());
                let labels = e.labels.clone();
                match self.placement.edges.get_mut(&e.id) {
                    Some(edge) => {
                        edge.address = e.address.clone();
                        edge.capacity = capacity;
                        edge.labels = labels;
                        edge.deregistered = false;
                        if !e.token.is_empty() {
                            edge.token = Some(e.token.clone());
                        }
                    }
                    None => {
                        self.placement.next_ordinal = e.ordinal + 1;
                        self.placement.edges.insert(
                            e.id.clone(),
                            Edge {
                                id: e.id.clone(),
                                ordinal: e.ordinal,
                                address: e.address.clone(),
                                capacity,
                                assigned: Usage::default(),
                                labels,
                                registered_at_ms: t,
                                deregistered: false,
                                token: (!e.token.is_empty()).then(|| e.token.clone()),
                            },
                        );
                    }
                }
            }
            Event::EdgeDeregistered(e) => {
                if let Some(edge) = self.placement.edges.get_mut(&e.id) {
                    edge.deregistered = true;
                }
            }
            Event::SandboxCreated(e) => {
                let born = Lifecycle::created(e.expires_at_ms);
                let s = Sandbox {
                    id: e.id.clone(),
                    project: e.project.clone(),
                    edge: e.edge.clone(),
                    image: e.image.clone(),
                    cpu_millis: e.cpu_millis,
                    memory_mb: e.memory_mb,
                    labels: e.labels.clone(),
                    expires_at_ms: born.expires_at_ms,
                    fork_of: (!e.fork_of.is_empty()).then(|| e.fork_of.clone()),
                    created_at_ms: t,
                    updated_at_ms: t,
                    desired: born.desired,
                    observed: born.observed,
                    exit_code: None,
                    oom_killed: false,
                    reason: None,
                    released: false,
                    index,
                    env: e.env.clone(),
                    auto_pause: e.auto_pause,
                    auto_resume: e.auto_resume,
                    snapshot: (!e.snapshot.is_empty()).then(|| e.snapshot.clone()),
                    template: (!e.template.is_empty()).then(|| e.template.clone()),
                    network: (!e.network.is_empty()).then(|| e.network.clone()),
                    isolation: Isolation::from_event(&e.isolation).unwrap_or_default(),
                    idempotency_key: (!e.idempotency_key.is_empty()).then(|| e.idempotency_key.clone()),
                    source_edge: (!e.source_edge.is_empty()).then(|| e.source_edge.clone()),
                    transfer: (!e.transfer.is_empty()).then(|| e.transfer.clone()),
                    runtime: None,
                    oom_kills: 0,
                    last_oom_command: None,
                    cpu_class: CpuClass::from_event(&e.cpu_class).unwrap_or_default(),
                    image_source: (!e.image_source.is_empty()).then(|| e.image_source.clone()),
                    auto_pause_filesystem: e.auto_pause_filesystem,
                    pause_filesystem: born.filesystem,
                };
                let u = s.usage();
                if let Some(edge) = self.placement.edges.get_mut(&e.edge) {
                    edge.assigned.add(&u);
                }
                let ancestors: Vec<String> = self.ancestry(&e.project).iter().map(|p| p.id.clone()).collect();
                for p in ancestors {
                    self.quota.usage.entry(p).or_default().add(&u);
                }
                self.sandboxes.sandboxes.insert(e.id.clone(), s);
            }
            Event::SandboxPauseRequested(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxResumeRequested(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxKillRequested(e) => {
                self.touch(&e.id, index, t, |s| {
                    advance(s, ev);
                    if s.reason.is_none() {
                        s.reason = Some(e.reason.clone());
                    }
                });
                self.release(&e.id);
            }
            Event::SandboxTimeoutSet(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxLabelsSet(e) => {
                let before = self.sandboxes.sandboxes.get(&e.id).map(|s| (s.usage(), s.is_live()));
                self.touch(&e.id, index, t, |s| s.labels = e.labels.clone());
                if let Some((before, true)) = before {
                    self.reweigh(&e.id, &before);
                }
            }
            Event::SandboxNetworkSet(e) => self.touch(&e.id, index, t, |s| {
                s.network = (!e.network.is_empty()).then(|| e.network.clone())
            }),
            Event::SandboxTimedOut(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SnapshotRequested(e) => {
                self.snapshots.snapshots.insert(
                    e.id.clone(),
                    Snapshot {
                        id: e.id.clone(),
                        sandbox: e.sandbox.clone(),
                        project: e.project.clone(),
                        edge: e.edge.clone(),
                        name: e.name.clone(),
                        image: e.image.clone(),
                        parent: (!e.parent.is_empty()).then(|| e.parent.clone()),
                        state: SnapshotState::Pending,
                        size_bytes: 0,
                        reason: None,
                        created_at_ms: t,
                        index,
                        isolation: Isolation::from_event(&e.isolation).unwrap_or_default(),
                    },
                );
            }
            Event::SnapshotReady(e) => {
                if let Some(x) = self.snapshots.snapshots.get_mut(&e.id) {
                    x.state = SnapshotState::Ready;
                    x.size_bytes = e.size_bytes;
                    x.index = index;
                }
            }
            Event::SnapshotFailed(e) => {
                if let Some(x) = self.snapshots.snapshots.get_mut(&e.id) {
                    x.state = SnapshotState::Failed;
                    x.reason = Some(e.reason.clone());
                    x.index = index;
                }
            }
            Event::SnapshotDeleted(e) => {
                self.snapshots.snapshots.remove(&e.id);
            }
            Event::ImageRequested(e) => {
                self.images.images.insert(
                    e.name.clone(),
                    Image {
                        name: e.name.clone(),
                        project: e.project.clone(),
                        reference: e.reference.clone(),
                        edge: e.edge.clone(),
                        source_sandbox: (!e.source_sandbox.is_empty()).then(|| e.source_sandbox.clone()),
                        scrub: e.scrub.clone(),
                        config: ConfigOverride::from_event(e.config.as_ref()),
                        imported: e.imported,
                        state: ImageState::Pending,
                        digest: None,
                        size_bytes: 0,
                        layers: 0,
                        reason: None,
                        created_at_ms: t,
                        index,
                    },
                );
            }
            Event::ImageReady(e) => {
                // A report from an edge the name has since moved from is stale.
                if let Some(x) = self.images.images.get_mut(&e.name).filter(|x| x.edge == e.edge) {
                    x.state = ImageState::Ready;
                    x.digest = Some(e.digest.clone());
                    x.size_bytes = e.size_bytes;
                    x.layers = e.layers;
                    x.reason = None;
                    x.index = index;
                }
            }
            Event::ImageFailed(e) => {
                if let Some(x) = self.images.images.get_mut(&e.name).filter(|x| x.edge == e.edge) {
                    x.state = ImageState::Failed;
                    x.reason = Some(e.reason.clone());
                    x.index = index;
                }
            }
            Event::ImageDeleted(e) => {
                self.images.images.remove(&e.name);
            }
            Event::TemplateBuildRequested(e) => {
                let template = self
                    .images
                    .templates
                    .entry(e.template_id.clone())
                    .or_insert_with(|| Template {
                        id: e.template_id.clone(),
                        project: e.project.clone(),
                        name: None,
                        cpu_count: 0,
                        memory_mb: 0,
                        builds: BTreeMap::new(),
                        tags: BTreeMap::new(),
                        created_at_ms: t,
                        index,
                    });
                if !e.name.is_empty() {
                    template.name = Some(e.name.clone());
                }
                template.cpu_count = e.cpu_count;
                template.memory_mb = e.memory_mb;
                template.index = index;
                template.builds.insert(
                    e.build_id.clone(),
                    TemplateBuild {
                        id: e.build_id.clone(),
                        status: BuildStatus::Waiting,
                        tags: e.tags.clone(),
                        image: None,
                        from: None,
                        start_cmd: None,
                        ready_cmd: None,
                        steps: 0,
                        runner: String::new(),
                        error: None,
                        error_step: None,
                        created_at_ms: t,
                        finished_at_ms: 0,
                        index,
                    },
                );
            }
            Event::TemplateBuildStarted(e) => {
                let some = |v: &String| (!v.is_empty()).then(|| v.clone());
                if let Some(b) = self.template_build_mut(&e.template_id, &e.build_id) {
                    b.status = BuildStatus::Building;
                    b.image = some(&e.image);
                    b.from = some(&e.from);
                    b.start_cmd = some(&e.start_cmd);
                    b.ready_cmd = some(&e.ready_cmd);
                    b.steps = e.steps;
                    b.runner = e.runner.clone();
                    b.index = index;
                }
            }
            Event::TemplateBuildFinished(e) => {
                let Some(template) = self.images.templates.get_mut(&e.template_id) else {
                    return;
                };
                let Some(b) = template.builds.get_mut(&e.build_id) else {
                    return;
                };
                b.finished_at_ms = t;
                b.index = index;
                if e.error.is_empty() {
                    b.status = BuildStatus::Ready;
                    for tag in b.tags.clone() {
                        template.tags.insert(tag, e.build_id.clone());
                    }
                } else {
                    b.status = BuildStatus::Error;
                    b.error = Some(e.error.clone());
                    b.error_step = (!e.error_step.is_empty()).then(|| e.error_step.clone());
                }
                template.index = index;
            }
            Event::TemplateTagsSet(e) => {
                if let Some(template) = self.images.templates.get_mut(&e.template_id) {
                    for tag in &e.tags {
                        if e.build_id.is_empty() {
                            template.tags.remove(tag);
                        } else {
                            template.tags.insert(tag.clone(), e.build_id.clone());
                        }
                    }
                    template.index = index;
                }
            }
            Event::TemplateDeleted(e) => {
                self.images.templates.remove(&e.template_id);
            }
            Event::SandboxForkRequested(e) => self.touch(&e.id, index, t, |_| {}),
            Event::SandboxReady(e) => self.touch(&e.id, index, t, |s| {
                if advance(s, ev) && !e.vmm.is_empty() {
                    s.runtime = Some(Runtime {
                        vmm: e.vmm.clone(),
                        accelerator: e.accelerator.clone(),
                    });
                }
            }),
            Event::SandboxOomKilled(e) => self.touch(&e.id, index, t, |s| {
                // Reports may repeat after an edge restart: the count only grows.
                if e.kills > s.oom_kills {
                    s.oom_kills = e.kills;
                    s.last_oom_command = (!e.command.is_empty()).then(|| e.command.clone());
                }
            }),
            Event::SandboxPaused(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxResumed(e) => self.touch(&e.id, index, t, |s| {
                advance(s, ev);
            }),
            Event::SandboxFailed(e) => {
                self.touch(&e.id, index, t, |s| {
                    advance(s, ev);
                    s.reason = Some(e.reason.clone());
                });
                self.release(&e.id);
            }
            Event::SandboxExited(e) => {
                self.touch(&e.id, index, t, |s| {
                    advance(s, ev);
                    s.exit_code = Some(e.exit_code);
                    s.oom_killed = e.oom_killed;
                    if !e.reason.is_empty() {
                        s.reason = Some(e.reason.clone());
                    }
                });
                self.release(&e.id);
            }
        }
    }

    fn touch(&mut self, id: &str, index: u64, t: u64, f: impl FnOnce(&mut Sandbox)) {
        if let Some(s) = self.sandboxes.sandboxes.get_mut(id) {
            f(s);
            s.index = index;
            s.updated_at_ms = t;
        }
    }

    /// Moves a live sandbox's share of its project's quota and its edge's capacity from
    /// `before` to what it takes now (its labels changed).
    fn reweigh(&mut self, id: &str, before: &Usage) {
        let Some(s) = self.sandboxes.sandboxes.get(id) else {
            return;
        };
        let (now, edge, project) = (s.usage(), s.edge.clone(), s.project.clone());
        let ancestors: Vec<String> = self.ancestry(&project).iter().map(|p| p.id.clone()).collect();
        if let Some(e) = self.placement.edges.get_mut(&edge) {
            e.assigned.sub(before);
            e.assigned.add(&now);
        }
        for p in ancestors {
            let u = self.quota.usage.entry(p).or_default();
            u.sub(before);
            u.add(&now);
        }
    }

    /// Gives a sandbox's quota and edge capacity back, once.
    fn release(&mut self, id: &str) {
        let Some(s) = self.sandboxes.sandboxes.get_mut(id) else {
            return;
        };
        if s.released {
            return;
        }
        s.released = true;
        let (u, edge, project) = (s.usage(), s.edge.clone(), s.project.clone());
        // Nothing runs with its environment any more: its values (often secrets) leave
        // the state, which keeps only what the views show of an ended sandbox.
        s.env.clear();
        if let Some(e) = self.placement.edges.get_mut(&edge) {
            e.assigned.sub(&u);
        }
        let ancestors: Vec<String> = self.ancestry(&project).iter().map(|p| p.id.clone()).collect();
        for p in ancestors {
            self.quota.usage.entry(p).or_default().sub(&u);
        }
    }

    fn template_build_mut(&mut self, template: &str, build: &str) -> Option<&mut TemplateBuild> {
        self.images.templates.get_mut(template)?.builds.get_mut(build)
    }
}

/// Moves a sandbox along its lifecycle; whether `ev` was a transition it took.
fn advance(s: &mut Sandbox, ev: &Event) -> bool {
    let now = Lifecycle {
        desired: s.desired,
        observed: s.observed,
        expires_at_ms: s.expires_at_ms,
        filesystem: s.pause_filesystem,
    };
    let Some(next) = now.next(ev) else {
        return false;
    };
    debug_assert_eq!(
        now.is_released(),
        s.released,
        "sandbox {}: released is the lifecycle's",
        s.id
    );
    s.desired = next.desired;
    s.observed = next.observed;
    s.expires_at_ms = next.expires_at_ms;
    s.pause_filesystem = next.filesystem;
    true
}
