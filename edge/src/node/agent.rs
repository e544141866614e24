//! What a sandbox's agent is given: its command line, and its per-sandbox files (token,
//! environment, the image's start command) in `<edge data>/config/<id>/`, bind-mounted
//! read-only at [`AGENT_CONFIG_IN_SANDBOX`] beside the agent binary at
//! [`AGENT_PATH_IN_SANDBOX`]. A template with a start command is reported ready only once
//! the agent's `/health` says its port is open.

use super::paths::make_private_dir;
use super::{AGENT_CONFIG_IN_SANDBOX, AGENT_PATH_IN_SANDBOX, Edge, EdgeError, store_err};
use crate::container::{BindMount, Limits, SandboxSpec};
use crate::desired::DesiredSandbox;
use crate::proxy::AgentAddr;
use std::os::fd::AsRawFd;
use std::path::Path;
use std::time::{Duration, Instant};

/// How long a template's start command may take to open its port before the sandbox fails.
const START_TIMEOUT: Duration = Duration::from_secs(120);

/// The agent's arguments after `serve --listen-fd 3` for a sandbox of `image`: where its
/// token, environment and (if the image has one) start command are.
fn agent_args(image: &crate::images::Image) -> Vec<String> {
    let mut args = vec![
        "--access-token-file".to_string(),
        format!("{AGENT_CONFIG_IN_SANDBOX}/token"),
        "--env-file".into(),
        format!("{AGENT_CONFIG_IN_SANDBOX}/env.json"),
    ];
    if image.config.start.is_some() {
        args.extend(["--start-file".into(), format!("{AGENT_CONFIG_IN_SANDBOX}/start.json")]);
    }
    args
}

impl Edge {
    /// Writes the agent's configuration: its access token, the sandbox's environment and
    /// the image's start command.
    pub(super) fn write_agent_config(&self, d: &DesiredSandbox, image: &crate::images::Image) -> Result<(), EdgeError> {
        let dir = self.config_dir(&d.id);
        let _ = std::fs::remove_dir_all(&dir);
        make_private_dir(&dir)?;
        self.write_agent_files(d, image, &dir)
    }

    /// The spec of container `id` of `image` served by the agent: the agent as PID 1 on a
    /// listening socket at [`Self::socket_path`] (returned: keep it open until the
    /// container is created), its binary and [`Self::config_dir`] bound read-only, and
    /// `limits`. The same for a sandbox and for a warm container.
    pub(super) fn agent_spec(
        &self,
        id: &str,
        image: &crate::images::Image,
        limits: Limits,
    ) -> Result<(SandboxSpec, std::os::unix::net::UnixListener), EdgeError> {
        let sock = self.socket_path(id);
        let _ = std::fs::remove_file(&sock);
        // The socket lives outside the sandbox; the agent gets only the listening fd.
        let listener = std::os::unix::net::UnixListener::bind(&sock)?;
        let mut args = vec![
            AGENT_PATH_IN_SANDBOX.into(),
            "serve".into(),
            "--listen-fd".into(),
            "3".into(),
        ];
        args.extend(agent_args(image));
        let mut spec = SandboxSpec::from_image(id.to_string(), &self.images, image, args)?;
        spec.limits = limits;
        spec.binds.push(BindMount {
            host_path: self.cfg.agent_binary.clone(),
            container_path: AGENT_PATH_IN_SANDBOX.into(),
        });
        spec.binds.push(BindMount {
            host_path: self.config_dir(id),
            container_path: AGENT_CONFIG_IN_SANDBOX.into(),
        });
        spec.extra_fds.push(listener.as_raw_fd());
        Ok((spec, listener))
    }

    /// The agent's per-sandbox files (token, environment, start command) in `dir`,
    /// readable by the agent (root in the sandbox) only.
    pub(super) fn write_agent_files(
        &self,
        d: &DesiredSandbox,
        image: &crate::images::Image,
        dir: &Path,
    ) -> Result<(), EdgeError> {
        use std::os::unix::fs::OpenOptionsExt;
        let write = |name: &str, bytes: &[u8]| -> std::io::Result<()> {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(dir.join(name))?;
            f.write_all(bytes)
        };
        let token =
            opendsec_edge_api::sandbox_token(&self.cfg.edge_key, opendsec_edge_api::SandboxTokenKind::Agent, &d.id);
        write("token", token.as_bytes())?;
        write("env.json", &serde_json::to_vec(&d.env).map_err(store_err)?)?;
        if let Some(start) = &image.config.start {
            write("start.json", &serde_json::to_vec(start).map_err(store_err)?)?;
        }
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
