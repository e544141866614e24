//! The request messages of the envd protocol (`process.Process`,
//! `filesystem.Filesystem`) as the agent decodes them from protojson: every field
//! optional, `null` as its default, integers as numbers or strings.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::connect::RpcError;
use crate::json::{null_default, opt_u32, u32_or_zero};

// ---- process.Process ----------------------------------------------------------

#[derive(Debug, Clone, Default, Deserialize, Serialize)]
#[serde(default)]
pub struct ProcessConfig {
    #[serde(deserialize_with = "null_default")]
    pub cmd: String,
    #[serde(deserialize_with = "null_default")]
    pub args: Vec<String>,
    #[serde(deserialize_with = "null_default")]
    pub envs: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct PtySize {
    #[serde(deserialize_with = "u32_or_zero")]
    pub cols: u32,
    #[serde(deserialize_with = "u32_or_zero")]
    pub rows: u32,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Pty {
    pub size: Option<PtySize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StartRequest {
    pub process: Option<ProcessConfig>,
    pub pty: Option<Pty>,
    pub tag: Option<String>,
    pub stdin: Option<bool>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Selector {
    #[serde(deserialize_with = "opt_u32")]
    pub pid: Option<u32>,
    pub tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SelectorRequest {
    pub process: Option<Selector>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default)]
pub struct Input {
    pub stdin: Option<String>,
    pub pty: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SendInputRequest {
    pub process: Option<Selector>,
    pub input: Option<Input>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SendSignalRequest {
    pub process: Option<Selector>,
    pub signal: serde_json::Value,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct UpdateRequest {
    pub process: Option<Selector>,
    pub pty: Option<Pty>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamInputStart {
    pub process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamInputData {
    pub input: Option<Input>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamInputRequest {
    pub start: Option<StreamInputStart>,
    pub data: Option<StreamInputData>,
}

/// The signal a `SendSignal` request names: a number, or a name (`SIGKILL`,
/// `SIGNAL_SIGKILL`, or a number as a string), from 1 to 64.
pub fn parse_signal(v: &serde_json::Value) -> Result<i32, RpcError> {
    let n = match v {
        serde_json::Value::Number(n) => n.as_i64().unwrap_or(0) as i32,
        serde_json::Value::String(s) => match s.trim_start_matches("SIGNAL_") {
            "SIGKILL" => libc::SIGKILL,
            "SIGTERM" => libc::SIGTERM,
            "SIGINT" => libc::SIGINT,
            "SIGHUP" => libc::SIGHUP,
            "SIGQUIT" => libc::SIGQUIT,
            "SIGUSR1" => libc::SIGUSR1,
            "SIGUSR2" => libc::SIGUSR2,
            other => other.parse().unwrap_or(0),
        },
        _ => 0,
    };
    if n <= 0 || n > 64 {
        return Err(RpcError::invalid(format!("unsupported signal {v}")));
    }
    Ok(n)
}

// ---- filesystem.Filesystem ----------------------------------------------------

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct PathRequest {
    pub path: String,
    #[serde(deserialize_with = "u32_or_zero")]
    pub depth: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct MoveRequest {
    pub source: String,
    pub destination: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct WatchRequest {
    pub path: String,
    pub recursive: bool,
    #[serde(rename = "includeEntry", alias = "include_entry")]
    pub include_entry: bool,
    /// Watching a network file system (NFS, SMB, FUSE) must be asked for:
    /// its events may be late or missing.
    #[serde(rename = "allowNetworkMounts", alias = "allow_network_mounts")]
    pub allow_network_mounts: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct WatcherIdRequest {
    #[serde(alias = "watcher_id")]
    #[serde(rename = "watcherId")]
    pub watcher_id: String,
}
