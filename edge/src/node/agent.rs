//! What a sandbox's agent is given: its command line; its configuration (access token,
//! environment, the image's start command, its CPU class and, where the edge loaded the
//! sandboxes' AppArmor profiles, the one it stacks on every process it starts: see
//! `container/apparmor.rs`) as one JSON object written into a pipe whose
//! read end is the agent's fd 4 (read once by its supervisor at boot: it never rests in
//! a file sandbox code could read or replace); and the agent binary, the only file of
//! the read-only `/.opendsec`. That directory is bound from `<edge data>/sandbox-files`,
//! a small tmpfs of the edge's own, so no host path shows in the sandbox's mountinfo and
//! `/.opendsec` is a mount point sandbox root can neither rename nor write. A template
//! with a start command is reported ready only once the agent's `/health` says its port
//! is open.

use super::{AGENT_DIR_IN_SANDBOX, AGENT_PATH_IN_SANDBOX, Edge, EdgeError, store_err};
use crate::container::{BindMount, Limits, SandboxSpec};
use crate::desired::DesiredSandbox;
use crate::proxy::AgentAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How long a template's start command may take to open its port before the sandbox fails.
pub(super) const START_TIMEOUT: Duration = Duration::from_secs(120);
/// The fd the agent reads its configuration on (after the listening socket's 3).
const CONFIG_FD: &str = "4";
/// Room in the configuration pipe: the environment (at most 256 KiB) and start command
/// fit, so the edge writes it whole before the agent runs.
const CONFIG_PIPE_BYTES: libc::c_int = 1 << 20;
/// Size of the sandbox-files tmpfs (one agent binary).
const SANDBOX_FILES_SIZE: &str = "size=64m,mode=0755";

/// A sandbox's agent ready to be created: its spec, the listening socket it gets (keep it
/// open until the container is created) and the pipe its configuration goes into.
pub(super) struct AgentLaunch {
    pub spec: SandboxSpec,
    pub listener: std::os::unix::net::UnixListener,
    pub config: ConfigPipe,
}

/// The pipe a sandbox's agent reads its configuration from: the read end is handed to
/// the container (keep it until the container is created), the write end is written once.
pub(super) struct ConfigPipe {
    pub read: OwnedFd,
    pub write: OwnedFd,
}

impl ConfigPipe {
    fn new() -> std::io::Result<Self> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: pipe2 fills the array we own; both fds are wrapped right away.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        // SAFETY: fcntl on a pipe fd we own.
        if unsafe { libc::fcntl(write.as_raw_fd(), libc::F_SETPIPE_SZ, CONFIG_PIPE_BYTES) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Self { read, write })
    }
}

/// Writes sandbox `d`'s configuration into `pipe` (its write end) and closes it.
pub(super) fn send_config(pipe: OwnedFd, config: &serde_json::Value) -> Result<(), EdgeError> {
    use std::io::Write;
    let bytes = serde_json::to_vec(config).map_err(store_err)?;
    if bytes.len() > CONFIG_PIPE_BYTES as usize {
        return Err(EdgeError::Store(format!(
            "the sandbox's configuration is {} bytes, more than the {CONFIG_PIPE_BYTES} its agent takes",
            bytes.len()
        )));
    }
    // Non-blocking: the pipe has room for it all, and a full pipe must fail, not hang.
    // SAFETY: fcntl on the fd we own.
    unsafe { libc::fcntl(pipe.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
    std::fs::File::from(pipe).write_all(&bytes)?;
    Ok(())
}

/// Mounts the edge's sandbox-files tmpfs under `data_dir` (unless an earlier run left it
/// mounted) and puts the current agent binary in it: `<tmpfs>/opendsec/agent`, the
/// directory every container sees read-only at `/.opendsec`. Returns that directory.
pub(super) fn prepare_agent_dir(data_dir: &Path, agent_binary: &Path) -> Result<PathBuf, EdgeError> {
    let root = sandbox_files(data_dir);
    std::fs::create_dir_all(&root)?;
    if !crate::container::is_mounted(&root) {
        use nix::mount::{MsFlags, mount};
        mount(
            Some("opendsec-sandbox-files"),
            &root,
            Some("tmpfs"),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(SANDBOX_FILES_SIZE),
        )
        .map_err(|e| EdgeError::Store(format!("mounting a tmpfs on {}: {e}", root.display())))?;
    }
    let dir = root.join("opendsec");
    std::fs::create_dir_all(&dir)?;
    let agent = dir.join("agent");
    let new = std::fs::read(agent_binary)
        .map_err(|e| EdgeError::Store(format!("reading the agent binary {}: {e}", agent_binary.display())))?;
    if std::fs::read(&agent).ok().as_deref() != Some(&new[..]) {
        // Replaced whole (a running sandbox keeps the binary it started with: its PID 1
        // runs its own image, never the path).
        use std::os::unix::fs::PermissionsExt;
        let tmp = dir.join(".agent.new");
        std::fs::write(&tmp, &new)?;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
        std::fs::rename(&tmp, &agent)?;
    }
    Ok(dir)
}

/// Where the edge mounts its sandbox-files tmpfs.
fn sandbox_files(data_dir: &Path) -> PathBuf {
    data_dir.join("sandbox-files")
}

/// Unmounts the sandbox-files tmpfs when the edge stops (running sandboxes keep their
/// own bind of it).
pub(super) fn release_agent_dir(data_dir: &Path) {
    let root = sandbox_files(data_dir);
    if crate::container::is_mounted(&root) {
        let _ = nix::mount::umount2(&root, nix::mount::MntFlags::MNT_DETACH);
    }
}

impl Edge {
    /// Sandbox `d`'s configuration as its agent reads it (`BootConfig` in the agent).
    fn agent_config(&self, d: &DesiredSandbox, image: &crate::images::Image) -> serde_json::Value {
        // The image's Env first, the sandbox's own variables over it.
        self.boot_config(&self.agent_token(&d.id), image.env_with(&d.env), d.cpu_class, image)
    }

    /// The agent token of sandbox (or warm container) `id`.
    pub(super) fn agent_token(&self, id: &str) -> String {
        opendsec_edge_api::sandbox_token(&self.cfg.edge_key, opendsec_edge_api::SandboxTokenKind::Agent, id)
    }

    /// The configuration of warm container `wid` started ahead of its sandbox: its own
    /// token, the image's variables and the default CPU class, until a sandbox claims it
    /// (`POST /.opendsec/claim`, see `warm.rs`).
    pub(super) fn warm_boot_config(&self, wid: &str, image: &crate::images::Image) -> serde_json::Value {
        let mut config = self.boot_config(
            &self.agent_token(wid),
            image.env_with(&Default::default()),
            opendsec_projections::CpuClass::default(),
            image,
        );
        config["warm"] = true.into();
        config
    }

    fn boot_config(
        &self,
        token: &str,
        env: std::collections::BTreeMap<String, String>,
        cpu_class: opendsec_projections::CpuClass,
        image: &crate::images::Image,
    ) -> serde_json::Value {
        let mut config = serde_json::json!({"access_token": token, "env": env, "cpu_class": cpu_class.as_str()});
        if !image.config.workdir.is_empty() {
            config["workdir"] = image.config.workdir.clone().into();
        }
        if let Some(user) = image.config.account() {
            config["user"] = user.into();
        }
        if let Some(start) = &image.config.start {
            config["start"] = serde_json::to_value(start).unwrap_or_default();
        }
        if let Some(profile) = self.containers.sandbox_profile() {
            config["apparmor_profile"] = profile.into();
        }
        config
    }

    /// Hands sandbox `d`'s agent its configuration through `pipe` (the write end).
    pub(super) fn send_agent_config(
        &self,
        d: &DesiredSandbox,
        image: &crate::images::Image,
        pipe: OwnedFd,
    ) -> Result<(), EdgeError> {
        send_config(pipe, &self.agent_config(d, image))
    }

    /// The spec of container `id` of `image` served by the agent: the agent as PID 1 on a
    /// listening socket at [`Self::socket_path`] and its configuration pipe, the agent's
    /// directory bound read-only, and `limits`. The same for a sandbox and for a warm
    /// container.
    pub(super) fn agent_spec(
        &self,
        id: &str,
        image: &crate::images::Image,
        limits: Limits,
    ) -> Result<AgentLaunch, EdgeError> {
        let sock = self.socket_path(id);
        let _ = std::fs::remove_file(&sock);
        // The socket lives outside the sandbox; the agent gets only the listening fd.
        let listener = std::os::unix::net::UnixListener::bind(&sock)?;
        let config = ConfigPipe::new()?;
        let args = vec![
            AGENT_PATH_IN_SANDBOX.into(),
            "serve".into(),
            "--listen-fd".into(),
            "3".into(),
            "--config-fd".into(),
            CONFIG_FD.into(),
        ];
        let mut spec = SandboxSpec::from_image(id.to_string(), &self.images, image, args)?;
        spec.limits = limits;
        spec.binds.push(BindMount {
            host_path: self.agent_dir.clone(),
            container_path: AGENT_DIR_IN_SANDBOX.into(),
        });
        spec.extra_fds.push(listener.as_raw_fd());
        spec.extra_fds.push(config.read.as_raw_fd());
        Ok(AgentLaunch { spec, listener, config })
    }

    /// Boots container sandbox `id` again on its kept file system (a resume after a
    /// file-system-only pause, or one that drops memory: a frozen container is stored
    /// first): a new agent on a new socket with its configuration as at its creation,
    /// then, for a template with a start command, that command's port open.
    pub(super) async fn boot_stored_container(self: &std::sync::Arc<Self>, id: &str) -> Result<(), EdgeError> {
        let d = self.in_slice(id)?;
        let sid = id.to_string();
        let dd = d.clone();
        self.blocking(move |e| {
            if !e.containers.is_stored(&sid) {
                e.containers.store(&sid)?;
            }
            let image = e.image_for(&dd)?;
            let AgentLaunch { spec, listener, config } = e.agent_spec(&sid, &image, e.limits(&dd))?;
            e.send_agent_config(&dd, &image, config.write)?;
            e.containers.restart(&sid, &spec.extra_fds)?;
            drop((listener, config.read));
            Ok(())
        })
        .await?;
        if self.has_start_command(&d.image) {
            self.wait_started(id).await.map_err(EdgeError::Store)?;
        }
        tracing::info!(sandbox = %id, "booted again on its file system");
        Ok(())
    }

    /// Waits until the agent says the sandbox is up (a template's start command has
    /// opened its port): `GET /health` answers 204.
    pub(super) async fn wait_started(&self, id: &str) -> Result<(), String> {
        let agent = AgentAddr::Unix(self.socket_path(id));
        let deadline = Instant::now() + START_TIMEOUT;
        let mut last = String::from("no answer yet");
        while Instant::now() < deadline {
            match crate::proxy::agent_health(&agent).await {
                Ok(204) | Ok(200) => return Ok(()),
                Ok(code) => last = format!("the agent answers {code}"),
                Err(e) => last = e,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!(
            "the start command did not become ready within {START_TIMEOUT:?}: {last}"
        ))
    }

    pub(super) fn has_start_command(&self, image: &str) -> bool {
        self.images
            .get(image)
            .map(|i| i.config.start.is_some())
            .unwrap_or(false)
    }
}
