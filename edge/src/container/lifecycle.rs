//! A container sandbox's life once made: its state (from its directory, the shim's exit
//! record and the runtime), signals, freeze and thaw, a file-system-only pause
//! ([`ContainerBackend::store`], booted again by [`ContainerBackend::restart`]) and its
//! removal.

use super::*;

impl ContainerBackend {
    /// The exit recorded by the shim, if PID 1 has exited.
    pub fn exit_info(&self, id: &str) -> Result<Option<ExitInfo>, ContainerError> {
        exit_info_in(&self.dir(id))
    }

    pub fn state(&self, id: &str) -> Result<SandboxState, ContainerError> {
        self.state_of(&self.get(id)?)
    }

    fn state_of(&self, handle: &Handle) -> Result<SandboxState, ContainerError> {
        let id = handle.id.as_str();
        if let Some(stored) = stored_state(handle)? {
            return Ok(stored);
        }
        let exit = exit_info_in(&handle.dir)?;
        let rt = &handle.record.runtime;
        let (status, pid) = match rt.run(&["state", handle.record.runtime_id()]) {
            Ok(out) => {
                let v: serde_json::Value = serde_json::from_slice(&out).unwrap_or_default();
                let pid = v
                    .get("pid")
                    .and_then(|p| p.as_i64())
                    .filter(|p| *p > 0)
                    .map(|p| p as i32);
                let status = match v.get("status").and_then(|s| s.as_str()) {
                    Some("created") => SandboxStatus::Created,
                    Some("running") => SandboxStatus::Running,
                    Some("paused") => SandboxStatus::Paused,
                    _ => SandboxStatus::Stopped,
                };
                (status, pid)
            }
            Err(_) => (SandboxStatus::Lost, None),
        };
        // The shim's record is the authority on exit (the runtime may lag or be gone).
        let status = if exit.is_some() { SandboxStatus::Stopped } else { status };
        Ok(SandboxState {
            id: id.into(),
            status,
            init_pid: pid.or_else(|| handle.init_pid()),
            exit,
        })
    }

    /// The state without asking the runtime (no process spawned): the shim's exit
    /// record, PID 1's liveness and the cgroup freezer. For frequent polling of many
    /// sandboxes; `state` asks the runtime itself.
    pub fn quick_state(&self, id: &str) -> Result<SandboxState, ContainerError> {
        let handle = self.get(id)?;
        if let Some(stored) = stored_state(&handle)? {
            return Ok(stored);
        }
        let exit = self.exit_info(id)?;
        let pid = handle.init_pid();
        let status = if exit.is_some() {
            SandboxStatus::Stopped
        } else {
            match pid {
                Some(p) if Path::new(&format!("/proc/{p}")).exists() => {
                    if cgroup::is_frozen(&handle.record.cgroups_path) {
                        SandboxStatus::Paused
                    } else {
                        SandboxStatus::Running
                    }
                }
                // Not started yet, or gone without a record (the shim died, a reboot):
                // the runtime knows which.
                _ => return self.state(id),
            }
        };
        Ok(SandboxState {
            id: id.into(),
            status,
            init_pid: pid,
            exit,
        })
    }

    /// Sends `signal` (e.g. `libc::SIGTERM`) to PID 1.
    /// Signals PID 1. A sandbox whose PID 1 is already gone counts as signalled: the
    /// shim records its exit, and the next observation sees it.
    pub fn kill(&self, id: &str, signal: i32) -> Result<(), ContainerError> {
        let handle = self.get(id)?;
        match handle
            .record
            .runtime
            .run(&["kill", handle.record.runtime_id(), &signal.to_string()])
        {
            Ok(_) => Ok(()),
            Err(e) if e.to_string().contains("No such process") || e.to_string().contains("not running") => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Freezes every process of the sandbox (cgroup freezer, through the runtime).
    /// Freezes the container. A runtime gives up on a freeze that does not settle within
    /// its own short loop ("unable to freeze": tasks exiting with many open files, a busy
    /// host) and thaws again, so a few more tries are safe.
    pub fn pause(&self, id: &str) -> Result<(), ContainerError> {
        let r = self.get(id)?.record;
        let mut tries = 0;
        loop {
            match r.runtime.run(&["pause", r.runtime_id()]) {
                Ok(_) => return Ok(()),
                Err(e) if tries < 5 && e.to_string().contains("unable to freeze") => {
                    tries += 1;
                    tracing::debug!(sandbox = %id, tries, "the freeze did not settle; trying again");
                    std::thread::sleep(Duration::from_millis(50 * tries));
                }
                Err(e) => return Err(e),
            }
        }
    }

    pub fn resume(&self, id: &str) -> Result<(), ContainerError> {
        let r = self.get(id)?.record;
        r.runtime.run(&["resume", r.runtime_id()]).map(drop)
    }

    /// A file-system-only pause: ends every process of the sandbox (a frozen one is
    /// thawed to die) and keeps its file system, disk and overlay mounted, for
    /// [`Self::restart`]. Its memory goes with its processes and its cgroup. Idempotent.
    /// The mark is written first: an edge that dies halfway sees the sandbox still
    /// running (or frozen) and stores it again, never as exited.
    pub fn store(&self, id: &str) -> Result<(), ContainerError> {
        let h = self.get(id)?;
        let rt = &h.record.runtime;
        let rid = h.record.runtime_id();
        let mark = h.dir.join(STORED);
        if !mark.exists() {
            write_json_atomic(&mark, &now_unix_ms())?;
        }
        if exit_info_in(&h.dir)?.is_none() {
            // A frozen task cannot die: thaw first. Killing PID 1 ends its PID namespace.
            let _ = rt.run(&["resume", rid]);
            let _ = rt.run(&["kill", rid, "KILL"]);
            let shim_pid = read_pid(&h.dir.join("shim.pid"));
            let deadline = Instant::now() + Duration::from_secs(10);
            while exit_info_in(&h.dir)?.is_none() && shim_pid.is_some_and(process_alive) {
                if Instant::now() >= deadline {
                    return Err(ContainerError::Runtime {
                        runtime: rt.name(),
                        command: "kill".into(),
                        message: format!("sandbox {id} did not end within 10 s of SIGKILL"),
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if let Err(e) = rt.run(&["delete", "--force", rid]) {
            let msg = e.to_string();
            if !(msg.contains("does not exist") || msg.contains("not exist") || msg.contains("not found")) {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Boots a stored sandbox (see [`Self::store`]) again on its kept file system, with
    /// its bundle as it was created and `extra_fds` (as at its creation) for its new
    /// init. Returns once that runs. The mark goes last: an edge that dies halfway finds
    /// it stored, or running.
    pub fn restart(&self, id: &str, extra_fds: &[RawFd]) -> Result<(), ContainerError> {
        let h = self.get(id)?;
        if !h.dir.join(STORED).exists() {
            return Err(ContainerError::Invalid(format!(
                "sandbox {id} was not stored: only a sandbox paused with its file system only boots again"
            )));
        }
        if h.record.extra_fds != extra_fds.len() {
            return Err(ContainerError::Invalid(format!(
                "sandbox {id} was created with {} extra fds, not {}",
                h.record.extra_fds,
                extra_fds.len()
            )));
        }
        let _ = h.record.runtime.run(&["delete", "--force", h.record.runtime_id()]);
        for name in ["exit.json", "init.pid", "shim.pid"] {
            match fs::remove_file(h.dir.join(name)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(ContainerError::io(format!("removing {name}"), e)),
            }
        }
        shim::spawn(&self.config.shim, &h.dir, id, extra_fds, false)?;
        fs::remove_file(h.dir.join(STORED)).map_err(|e| ContainerError::io("removing the stored mark", e))
    }

    /// Whether the sandbox was stored by a file-system-only pause and not booted since
    /// (marked, and its processes are gone).
    pub fn is_stored(&self, id: &str) -> bool {
        self.get(id).is_ok_and(|h| matches!(stored_state(&h), Ok(Some(_))))
    }

    /// Waits up to `timeout` for PID 1 to exit.
    pub fn wait(&self, id: &str, timeout: Duration) -> Result<Option<ExitInfo>, ContainerError> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(exit) = self.exit_info(id)? {
                return Ok(Some(exit));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Stops (SIGKILL) and removes the sandbox: the runtime's container, its mounts,
    /// its cgroup and its directory. Idempotent for a sandbox that is already gone.
    pub fn delete(&self, id: &str) -> Result<(), ContainerError> {
        match self.get(id) {
            Ok(h) => self.delete_handle(&h),
            Err(ContainerError::NotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    pub(super) fn delete_handle(&self, handle: &Handle) -> Result<(), ContainerError> {
        let rt = &handle.record.runtime;
        let rid = handle.record.runtime_id();
        if exit_info_in(&handle.dir)?.is_none() {
            let state = self.state_of(handle)?;
            if state.status == SandboxStatus::Paused {
                // A frozen task cannot die: thaw first.
                let _ = rt.run(&["resume", rid]);
            }
            if matches!(
                state.status,
                SandboxStatus::Running | SandboxStatus::Paused | SandboxStatus::Created
            ) {
                let _ = rt.run(&["kill", rid, "KILL"]);
            }
            // Let the shim record the exit (and finish with the directory) before removing it.
            let shim_pid = read_pid(&handle.dir.join("shim.pid"));
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline
                && exit_info_in(&handle.dir)?.is_none()
                && shim_pid.is_some_and(process_alive)
            {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if let Err(e) = rt.run(&["delete", "--force", rid]) {
            let msg = e.to_string();
            if !(msg.contains("does not exist") || msg.contains("not exist") || msg.contains("not found")) {
                return Err(e);
            }
        }
        disk::Storage::in_dir(&handle.dir).teardown()?;
        fs::remove_dir_all(&handle.dir)
            .map_err(|e| ContainerError::io(format!("removing {}", handle.dir.display()), e))?;
        // Its processes are gone with it: its ids may serve another sandbox.
        if let (Some(r), Some(base)) = (&self.ids, handle.record.id_base) {
            r.release(base);
        }
        if let Some(set) = &handle.record.cpus {
            self.cpus.release(set);
        }
        Ok(())
    }
}

/// The mark of a stored sandbox (see [`ContainerBackend::store`]).
const STORED: &str = "stored";

/// A marked sandbox's state once its processes are gone: stored. Marked while PID 1 still
/// runs (a store under way, or one that died halfway), it is what it is: `None`.
fn stored_state(handle: &Handle) -> Result<Option<SandboxState>, ContainerError> {
    if !handle.dir.join(STORED).exists() {
        return Ok(None);
    }
    // The exit first: a recorded end is final, whatever process has PID 1's number now.
    let ended = exit_info_in(&handle.dir)?.is_some() || !handle.init_pid().is_some_and(process_alive);
    Ok(ended.then(|| SandboxState {
        id: handle.id.clone(),
        status: SandboxStatus::Stored,
        init_pid: None,
        exit: None,
    }))
}
