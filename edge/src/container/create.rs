//! Making a container sandbox: its directory (a warm disk claimed, or a new one), its
//! record, disk and overlay, its OCI bundle, then the shim that runs the runtime.

use super::*;

impl ContainerBackend {
    /// Creates and starts a sandbox: disk, overlay, bundle, then the shim that runs the
    /// runtime. Returns once PID 1 runs (or with the runtime's error, leaving nothing).
    pub fn create(&self, spec: &SandboxSpec) -> Result<Handle, ContainerError> {
        validate(spec)?;
        self.create_at(spec, &self.dir(&spec.id), true)
    }

    /// Creates the sandbox of `spec` in `dir`; with `start`, its PID 1 runs the program,
    /// else it waits for `<runtime> start` (a warm container).
    pub(super) fn create_at(&self, spec: &SandboxSpec, dir: &Path, start: bool) -> Result<Handle, ContainerError> {
        let dir = dir.to_path_buf();
        // A warm disk becomes the sandbox's directory (renamed, its mounts move along).
        let warm = self.pool.as_ref().and_then(|p| p.take(spec.limits.disk_bytes));
        let claimed = match &warm {
            Some(w) => disk::rename_noreplace(w, &dir).inspect_err(|_| {
                let _ = disk::Storage::in_dir(w).teardown();
                let _ = fs::remove_dir_all(w);
            }),
            None => fs::create_dir(&dir),
        };
        match claimed {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(ContainerError::AlreadyExists(spec.id.clone()));
            }
            Err(e) => return Err(ContainerError::io(format!("creating {}", dir.display()), e)),
        }
        let result = self.create_in(spec, &dir, warm.is_some(), start);
        if result.is_err() {
            let _ = self.runtime.run(&["delete", "--force", &spec.id]);
            let _ = disk::Storage::in_dir(&dir).teardown();
            let _ = fs::remove_dir_all(&dir);
        }
        result
    }

    fn create_in(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        disk_ready: bool,
        start: bool,
    ) -> Result<Handle, ContainerError> {
        // lxcfs may have died since: then a new one serves from here on.
        self.keep_views()?;
        let id_base = self.ids.as_ref().map(|r| r.allocate()).transpose()?;
        let cpus = self.cpus.allocate(spec.limits.cpu_millis);
        let result = self.create_with_ids(spec, dir, disk_ready, start, id_base, cpus.clone());
        if result.is_err() {
            if let (Some(r), Some(base)) = (&self.ids, id_base) {
                r.release(base);
            }
            if let Some(set) = &cpus {
                self.cpus.release(set);
            }
        }
        result
    }

    fn create_with_ids(
        &self,
        spec: &SandboxSpec,
        dir: &Path,
        disk_ready: bool,
        start: bool,
        id_base: Option<u32>,
        cpus: Option<String>,
    ) -> Result<Handle, ContainerError> {
        let cgroups_path = &format!("/{}/{}", self.config.cgroup_parent, spec.id);
        let record = SandboxRecord {
            id: spec.id.clone(),
            runtime_id: None,
            runtime: self.runtime.clone(),
            cgroups_path: cgroups_path.to_string(),
            limits: spec.limits.clone(),
            io_weight_applied: spec.limits.io_weight.is_some() && self.host.io_weight,
            layers: spec.layers.clone(),
            labels: spec.labels.clone(),
            extra_fds: spec.extra_fds.len(),
            log_cap_bytes: self.config.log_cap_bytes,
            created_unix_ms: now_unix_ms(),
            id_base,
            cpus,
        };
        let t0 = Instant::now();
        write_json_atomic(&dir.join("sandbox.json"), &record)?;
        disk::Storage::in_dir(dir).setup(spec.limits.disk_bytes, &spec.layers, disk_ready, id_base)?;
        let t1 = Instant::now();
        let placement = oci::Placement {
            id_base,
            cpus: record.cpus.as_deref(),
            views: self.lxcfs.as_ref(),
        };
        let oci = oci::build_spec(spec, cgroups_path, self.host, &placement)?;
        let json =
            serde_json::to_vec(&oci).map_err(|e| ContainerError::Invalid(format!("serialising config.json: {e}")))?;
        fs::write(dir.join("config.json"), json).map_err(|e| ContainerError::io("writing config.json", e))?;
        let t2 = Instant::now();
        shim::spawn(&self.config.shim, dir, &spec.id, &spec.extra_fds, !start)?;
        tracing::debug!(id = %spec.id, warm_disk = disk_ready, storage = ?(t1 - t0), spec = ?(t2 - t1), shim = ?t2.elapsed(), "sandbox created");
        Ok(Handle {
            id: spec.id.clone(),
            dir: dir.to_path_buf(),
            record,
        })
    }
}
