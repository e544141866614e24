//! A blocking client of Firecracker's API: HTTP/1.1 with JSON bodies over the Unix
//! socket the jailed process listens on. Firecracker answers one request at a time on a
//! keep-alive connection, with `Content-Length` on every body; a small synchronous client
//! fits the driver (which is synchronous, like its QMP client) better than an async one.
//! Requests and bodies are those of Firecracker v1.12's swagger definition.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::super::VmError;

/// How long one API request may take (snapshots of large guests write their memory).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// What a snapshot holds besides the device state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum SnapshotKind {
    /// All of guest memory.
    Full,
    /// Only the pages written since the last snapshot or load (needs dirty tracking);
    /// loadable once merged onto the memory file of that last snapshot ([`super::merge_diff`]).
    Diff,
}

/// `GET /`: what the Firecracker process is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstanceState {
    NotStarted,
    Running,
    Paused,
}

/// One connection to a Firecracker API socket.
pub struct FcApi {
    socket: PathBuf,
    conn: BufReader<UnixStream>,
}

impl std::fmt::Debug for FcApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FcApi").field("socket", &self.socket).finish()
    }
}

fn api_error(request: &str, status: Option<u16>, message: impl Into<String>) -> VmError {
    VmError::FirecrackerApi {
        request: request.into(),
        status,
        message: message.into(),
    }
}

impl FcApi {
    pub fn connect(socket: &Path) -> Result<Self, VmError> {
        let stream = UnixStream::connect(socket)
            .map_err(|e| api_error("connect", None, format!("connecting to {}: {e}", socket.display())))?;
        stream
            .set_read_timeout(Some(REQUEST_TIMEOUT))
            .and_then(|()| stream.set_write_timeout(Some(REQUEST_TIMEOUT)))
            .map_err(|e| api_error("connect", None, e.to_string()))?;
        Ok(Self {
            socket: socket.to_path_buf(),
            conn: BufReader::new(stream),
        })
    }

    /// Connects once the process has made its socket, while `alive` says it runs.
    pub fn connect_until(socket: &Path, deadline: Instant, alive: &dyn Fn() -> bool) -> Result<Self, VmError> {
        loop {
            if socket.exists()
                && let Ok(api) = Self::connect(socket)
            {
                return Ok(api);
            }
            if !alive() {
                return Err(api_error(
                    "connect",
                    None,
                    format!("the process ended before it listened on {}", socket.display()),
                ));
            }
            if Instant::now() > deadline {
                return Err(api_error(
                    "connect",
                    None,
                    format!("no API socket at {} in time", socket.display()),
                ));
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Sends one request; a 2xx answer's body (JSON, or `null` when empty) comes back,
    /// anything else is an error carrying Firecracker's `fault_message`.
    pub fn call(&mut self, method: &str, path: &str, body: Option<&Value>) -> Result<Value, VmError> {
        let request = format!("{method} {path}");
        let payload = body.map(|b| b.to_string()).unwrap_or_default();
        let mut head = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nAccept: application/json\r\n");
        if body.is_some() {
            head.push_str(&format!(
                "Content-Type: application/json\r\nContent-Length: {}\r\n",
                payload.len()
            ));
        }
        head.push_str("\r\n");
        let io = |e: std::io::Error| api_error(&request, None, format!("{e} (the process may have ended)"));
        let stream = self.conn.get_mut();
        stream.write_all(head.as_bytes()).map_err(io)?;
        stream.write_all(payload.as_bytes()).map_err(io)?;

        let mut status_line = String::new();
        if self.conn.read_line(&mut status_line).map_err(io)? == 0 {
            return Err(api_error(&request, None, "the connection closed (the process ended)"));
        }
        let status: u16 = status_line
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| api_error(&request, None, format!("bad status line {status_line:?}")))?;
        let mut length = 0usize;
        loop {
            let mut line = String::new();
            if self.conn.read_line(&mut line).map_err(io)? == 0 {
                return Err(api_error(&request, Some(status), "the connection closed mid-answer"));
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; length];
        self.conn.read_exact(&mut body).map_err(io)?;
        let value: Value = if body.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&body).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into()))
        };
        if (200..300).contains(&status) {
            return Ok(value);
        }
        let message = value["fault_message"]
            .as_str()
            .map(str::to_string)
            .unwrap_or_else(|| value.to_string());
        Err(api_error(&request, Some(status), message))
    }

    fn put(&mut self, path: &str, body: Value) -> Result<(), VmError> {
        self.call("PUT", path, Some(&body)).map(drop)
    }

    /// `PUT /boot-source`. Paths are as the jailed process sees them.
    pub fn boot_source(&mut self, kernel: &str, initrd: Option<&str>, args: &str) -> Result<(), VmError> {
        let mut body = json!({"kernel_image_path": kernel, "boot_args": args});
        if let Some(initrd) = initrd {
            body["initrd_path"] = json!(initrd);
        }
        self.put("/boot-source", body)
    }

    /// `PUT /machine-config`; `track_dirty_pages` makes Diff snapshots possible.
    pub fn machine_config(&mut self, vcpus: u32, mem_mib: u64, track_dirty_pages: bool) -> Result<(), VmError> {
        self.put(
            "/machine-config",
            json!({"vcpu_count": vcpus, "mem_size_mib": mem_mib, "smt": false,
                   "track_dirty_pages": track_dirty_pages}),
        )
    }

    /// `PUT /drives/{id}`: a virtio-blk device backed by a file.
    pub fn drive(&mut self, id: &str, path: &str, read_only: bool) -> Result<(), VmError> {
        self.put(
            &format!("/drives/{id}"),
            json!({"drive_id": id, "path_on_host": path, "is_root_device": false,
                   "is_read_only": read_only}),
        )
    }

    /// `PUT /network-interfaces/{id}`: a virtio-net device on tap `tap` of the
    /// process's network namespace.
    pub fn network_interface(&mut self, id: &str, tap: &str, guest_mac: &str) -> Result<(), VmError> {
        self.put(
            &format!("/network-interfaces/{id}"),
            json!({"iface_id": id, "host_dev_name": tap, "guest_mac": guest_mac}),
        )
    }

    /// `PUT /vsock`: a virtio-vsock device whose host side is the Unix socket `uds`.
    pub fn vsock(&mut self, guest_cid: u32, uds: &str) -> Result<(), VmError> {
        self.put("/vsock", json!({"guest_cid": guest_cid, "uds_path": uds}))
    }

    /// `PUT /actions` InstanceStart: boots the configured machine.
    pub fn start(&mut self) -> Result<(), VmError> {
        self.put("/actions", json!({"action_type": "InstanceStart"}))
    }

    /// `PATCH /vm` Paused: stops the vCPUs.
    pub fn pause(&mut self) -> Result<(), VmError> {
        self.call("PATCH", "/vm", Some(&json!({"state": "Paused"}))).map(drop)
    }

    /// `PATCH /vm` Resumed.
    pub fn resume(&mut self) -> Result<(), VmError> {
        self.call("PATCH", "/vm", Some(&json!({"state": "Resumed"}))).map(drop)
    }

    /// `PUT /snapshot/create` of a paused VM: device state to `state_path`, memory (all
    /// of it, or the dirty pages at their offsets in a sparse file) to `mem_path`.
    pub fn snapshot_create(&mut self, kind: SnapshotKind, state_path: &str, mem_path: &str) -> Result<(), VmError> {
        let kind = match kind {
            SnapshotKind::Full => "Full",
            SnapshotKind::Diff => "Diff",
        };
        self.put(
            "/snapshot/create",
            json!({"snapshot_type": kind, "snapshot_path": state_path, "mem_file_path": mem_path}),
        )
    }

    /// `PUT /snapshot/load` into a process that was configured with nothing: memory from
    /// the file `mem_path` (mapped privately: it must not change while loaded),
    /// `enable_diff` turns on dirty tracking, `resume` runs the VM at once. A failed load
    /// ends the Firecracker process.
    pub fn snapshot_load(
        &mut self,
        state_path: &str,
        mem_path: &str,
        enable_diff: bool,
        resume: bool,
    ) -> Result<(), VmError> {
        self.put(
            "/snapshot/load",
            json!({"snapshot_path": state_path,
                   "mem_backend": {"backend_type": "File", "backend_path": mem_path},
                   "enable_diff_snapshots": enable_diff, "resume_vm": resume}),
        )
    }

    /// `GET /`.
    pub fn state(&mut self) -> Result<InstanceState, VmError> {
        let info = self.call("GET", "/", None)?;
        match info["state"].as_str() {
            Some("Not started") => Ok(InstanceState::NotStarted),
            Some("Running") => Ok(InstanceState::Running),
            Some("Paused") => Ok(InstanceState::Paused),
            _ => Err(api_error(
                "GET /",
                Some(200),
                format!("unknown instance state in {info}"),
            )),
        }
    }

    /// `GET /version`: e.g. `1.12.1`.
    pub fn version(&mut self) -> Result<String, VmError> {
        let v = self.call("GET", "/version", None)?;
        v["firecracker_version"]
            .as_str()
            .map(str::to_string)
            .ok_or_else(|| api_error("GET /version", Some(200), format!("no version in {v}")))
    }
}
