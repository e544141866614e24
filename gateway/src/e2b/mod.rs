//! E2B compatibility: the E2B control API (v1 and v2 paths) mapped onto OpenDsec
//! commands, and the routing of per-sandbox traffic (envd, the code interpreter, any
//! port) by `E2b-Sandbox-Id`/`E2b-Sandbox-Port` headers or by a `{port}-{id}.{domain}`
//! host name — all on the gateway's one port.
//!
//! Authentication: the control API takes an E2B API key (`X-API-KEY: e2b_…`, an
//! ordinary token of its project) or an OpenDsec bearer token. Sandbox traffic carries
//! no API key: the agent checks the sandbox's access token (`X-Access-Token`, or a
//! signed URL), and the gateway checks the traffic token where E2B asks for it.
//! Both tokens are derived from the cluster key (`opendsec_control::sandbox_token`).
//!
//! Error bodies are E2B's: `{"code": <status>, "message": …}`.

pub(crate) mod api;
mod body;
mod builder;
mod lifecycle;
mod listing;
mod snapshots;
pub mod templates;
mod traffic;

pub use api::routes;
pub use traffic::route_sandbox_traffic;

/// The envd protocol version the agent implements (every feature switch of the SDK up
/// to it is served; see the agent's ENVD_VERSION).
pub const ENVD_VERSION: &str = "0.6.4";
/// What E2B calls the client id; one value for the whole cluster.
pub const CLIENT_ID: &str = "opendsec";
/// E2B's envd port.
pub const ENVD_PORT: u16 = 49983;
/// E2B's code-interpreter port.
pub const CODE_INTERPRETER_PORT: u16 = 49999;

/// Settings of the E2B surface.
#[derive(Clone, Debug, Default)]
pub struct E2bSettings {
    /// The domain sandboxes are reached under (`{port}-{id}.{domain}`), with its port if
    /// not 443, e.g. `e2b.example.internal:7443`. Reported to SDKs as `domain`.
    pub domain: Option<String>,
    /// The size of every sandbox's writable disk, reported as `diskSizeMB`.
    pub disk_size_mb: u64,
    /// Where the files template builds upload are kept (default: a directory of this
    /// process under the system's temporary directory).
    pub template_files: Option<std::path::PathBuf>,
}

impl E2bSettings {
    /// The domain's host part (without a port), lower-cased.
    pub fn domain_host(&self) -> Option<String> {
        let d = self.domain.as_deref()?;
        let host = match d.rsplit_once(':') {
            Some((h, p)) if p.chars().all(|c| c.is_ascii_digit()) => h,
            _ => d,
        };
        Some(host.to_ascii_lowercase())
    }
}
