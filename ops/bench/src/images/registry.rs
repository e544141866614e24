//! Debian's `docker-registry` on a free loopback port, its storage under the run's
//! directory, and `skopeo` to push an OCI layout into it. A small copy of the part of
//! `edge/tests/oci_support` the benchmark needs (start, push, stop): that module is a
//! test file of another crate, and making it a library for about sixty lines would give
//! the edge crate a test-support API to keep.

use std::net::TcpStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::sandboxes::host::free_port;

/// A running registry; dropping it kills it (it also dies with the benchmark:
/// PR_SET_PDEATHSIG). Its storage stays in `dir` for the caller to remove.
pub(super) struct Registry {
    child: Child,
    port: u16,
    dir: PathBuf,
}

impl Registry {
    pub(super) fn start(dir: &Path) -> Result<Registry, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("create {dir:?}: {e}"))?;
        let port = free_port()?;
        let config = format!(
            "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\nhttp:\n  addr: 127.0.0.1:{port}\n",
            dir.join("data").display()
        );
        let config_path = dir.join("config.yml");
        std::fs::write(&config_path, config).map_err(|e| e.to_string())?;
        let log = std::fs::File::create(dir.join("registry.log")).map_err(|e| e.to_string())?;
        let mut cmd = Command::new("docker-registry");
        cmd.arg("serve")
            .arg(&config_path)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log);
        // SAFETY: prctl is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd
            .spawn()
            .map_err(|e| format!("starting docker-registry (the docker-registry package): {e}"))?;
        let registry = Registry {
            child,
            port,
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                return Err(format!("docker-registry did not listen on {port}: {}", registry.log()));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(registry)
    }

    pub(super) fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub(super) fn log(&self) -> String {
        crate::log_tail(&self.dir.join("registry.log"), 10)
    }

    /// Pushes tag `tag` of the OCI layout `layout` as `<repo>:<tag>`; returns the reference.
    pub(super) fn push(&self, layout: &Path, tag: &str, repo: &str) -> Result<String, String> {
        let reference = format!("{}/{repo}:{tag}", self.host());
        let out = Command::new("skopeo")
            .args(["copy", "--quiet", "--insecure-policy", "--dest-tls-verify=false"])
            .arg(format!("oci:{}:{tag}", layout.display()))
            .arg(format!("docker://{reference}"))
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("running skopeo (the skopeo package): {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "skopeo copy to {reference}: {}; registry: {}",
                String::from_utf8_lossy(&out.stderr).trim(),
                self.log()
            ));
        }
        Ok(reference)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
