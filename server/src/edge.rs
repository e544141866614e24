//! `opendsec edge` and the edge embedded in `opendsec up`: configuration from flags and
//! the host, and (for the embedded one) its own edge token, issued once and kept in the
//! data directory.

use opendsec_commands::Command;
use opendsec_control::{ControlNode, Credential, format_token, new_token_secret};
use opendsec_edge::container::{ContainerConfig, RuntimeChoice};
use opendsec_edge::node::{EdgeConfig, MicroVmEdgeConfig, RegistrySettings};
use opendsec_edge_api::pb::Capacity;
use opendsec_projections::Right;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(clap::Args, Clone, Debug)]
pub struct EdgeArgs {
    /// This edge's name, unique in the cluster.
    #[arg(long = "edge-name", default_value = "edge-1")]
    pub edge_name: String,
    /// The edge's proxy address (the gateway sends per-sandbox traffic here).
    #[arg(long = "edge-listen", default_value = "127.0.0.1:7402")]
    pub proxy_listen: String,
    /// Where images are built and cached (shared by the edges of this machine).
    #[arg(long, env = "OPENDSEC_IMAGE_DIR", default_value = "/var/lib/opendsec/images")]
    pub image_dir: PathBuf,
    /// Sandboxes this edge takes at most.
    #[arg(long = "edge-sandboxes", default_value_t = 1000)]
    pub edge_sandboxes: u64,
    /// Memory this edge offers, in MB (default: the host's).
    #[arg(long = "edge-memory-mb")]
    pub edge_memory_mb: Option<u64>,
    /// CPU this edge offers, in millicores (default: 16,000 per host CPU: CPU is shared
    /// and each sandbox's own limit caps it, so the edge overcommits it; memory it never does).
    #[arg(long = "edge-cpu-millis")]
    pub edge_cpu_millis: Option<u64>,
    /// Each sandbox's writable disk, in MB.
    #[arg(long, default_value_t = 1024)]
    pub disk_mb: u64,
    /// Writable disks kept made and mounted ahead of creates (at `--disk-mb`), so that a
    /// create only mounts its overlay. 0 keeps none.
    #[arg(long, default_value_t = 4)]
    pub warm_disks: usize,
    /// Warm containers kept per image (made ahead, started by a create), for the two
    /// images created from most recently. 0 keeps none.
    #[arg(long, default_value_t = 2)]
    pub warm_sandboxes: usize,
    /// Processes and threads per sandbox.
    #[arg(long, default_value_t = 512)]
    pub pids: u32,
    /// OCI runtime: auto, crun or runc.
    #[arg(long, default_value = "auto")]
    pub runtime: RuntimeChoice,
    /// Run containers without user namespaces of their own (root inside is root on this
    /// host). Only for kernels that cannot idmap the sandboxes' file system, which the
    /// edge otherwise refuses to start on.
    #[arg(long)]
    pub insecure_no_user_namespaces: bool,
    /// Run container sandboxes without their AppArmor profiles (sandbox code is then kept
    /// off the agent's files and process by everything but AppArmor). Only for hosts whose
    /// kernel has AppArmor but cannot load them, which the edge otherwise refuses to start
    /// on; where the kernel has no AppArmor, the edge says so and needs no flag.
    #[arg(long)]
    pub insecure_no_apparmor: bool,
    /// Container sandboxes see the host's memory, CPUs, load and uptime in /proc, not their
    /// own (no lxcfs views). Only for hosts without lxcfs or FUSE, which the edge
    /// otherwise refuses to start on.
    #[arg(long)]
    pub no_lxcfs_views: bool,
    /// The static agent binary (default: opendsec-agent next to this binary).
    #[arg(long)]
    pub agent: Option<PathBuf>,
    /// MicroVM sandboxes (QEMU): auto (when qemu-system-x86_64 and opendsec-vm-shim are
    /// installed), on or off.
    #[arg(long, value_enum, default_value_t = MicroVmChoice::Auto)]
    pub microvm: MicroVmChoice,
    /// The microVM shim (default: opendsec-vm-shim next to this binary).
    #[arg(long)]
    pub vm_shim: Option<PathBuf>,
    /// A registry (host[:port]) to pull images from over plain HTTP although it is not on
    /// loopback (registries on loopback need no flag). Repeat for several.
    #[arg(long = "insecure-registry", value_name = "HOST[:PORT]")]
    pub insecure_registries: Vec<String>,
    /// Registry credentials for image pulls: a Docker client config.json (what `docker
    /// login` writes: {"auths": {"<host>": {"auth": base64(user:password)}}}).
    #[arg(long, env = "OPENDSEC_REGISTRY_AUTH", value_name = "FILE")]
    pub registry_auth: Option<PathBuf>,
    /// Container sandboxes get no network at all (only `lo`), whatever their policy says,
    /// and the edge needs no nftables. Without it, each gets a link out through this host,
    /// default deny, its policy enforced with nftables and the edge's DNS proxy.
    #[arg(long)]
    pub no_sandbox_network: bool,
    /// The IPv4 block sandboxes' addresses come from (one /32 each, routed on this host).
    #[arg(long, default_value = "10.231.0.0/16", value_name = "CIDR")]
    pub sandbox_subnet: String,
    /// The IPv6 block sandboxes' addresses come from, or `none` for IPv4 only.
    #[arg(long, default_value = "fd6f:6473:6500::/64", value_name = "CIDR|none")]
    pub sandbox_subnet_v6: String,
    /// A resolver the DNS proxy asks for sandboxes' allowed names (IP or IP:port; repeat
    /// for several). Default: the nameservers of this host's /etc/resolv.conf.
    #[arg(long = "upstream-dns", value_name = "IP[:PORT]")]
    pub upstream_dns: Vec<String>,
    /// An upstream proxy for sites whose only way out is a proxy: every sandbox's allowed
    /// TCP to public addresses goes through it (private ones go straight), by name where
    /// the sandbox resolved one, and sandboxes' own proxies are reached through it.
    /// `socks5://[USER:PASSWORD@]HOST:PORT`, `http://...` (CONNECT) or `https://...`
    /// (CONNECT over TLS). Give credentials through the environment, not the command line.
    #[arg(
        long = "egress-proxy",
        env = "OPENDSEC_EGRESS_PROXY",
        value_name = "URL",
        hide_env_values = true
    )]
    pub egress_proxy: Option<String>,
    /// PEM certificates to trust for an https:// --egress-proxy (default: this host's roots).
    #[arg(long = "egress-proxy-ca", value_name = "FILE", requires = "egress_proxy")]
    pub egress_proxy_ca: Option<PathBuf>,
}

/// `--egress-proxy URL` (and `--egress-proxy-ca`) as the edge's proxy.
pub fn egress_proxy(
    url: &str,
    ca: Option<&std::path::Path>,
) -> Result<opendsec_commands::network::EgressProxy, String> {
    use opendsec_commands::network::{EgressProxy, ProxyKind, ProxyTls};
    // Never the URL itself in an error: it may hold a password.
    let u = url::Url::parse(url).map_err(|e| {
        format!("--egress-proxy: not a URL ({e}); give socks5://HOST:PORT, http://HOST:PORT or https://HOST:PORT")
    })?;
    let (kind, tls) = match u.scheme() {
        "socks5" | "socks5h" => (ProxyKind::Socks5, false),
        "http" => (ProxyKind::Http, false),
        "https" => (ProxyKind::Http, true),
        other => {
            return Err(format!(
                "--egress-proxy: a proxy is socks5://, http:// or https://, not {other}://"
            ));
        }
    };
    let host = match u.host() {
        Some(url::Host::Domain(d)) => d.to_string(),
        Some(url::Host::Ipv4(a)) => a.to_string(),
        Some(url::Host::Ipv6(a)) => a.to_string(),
        None => return Err("--egress-proxy: the URL names no host".into()),
    };
    let port = u
        .port()
        .or(match kind {
            ProxyKind::Socks5 => Some(1080),
            ProxyKind::Http if tls => Some(443),
            ProxyKind::Http => Some(80),
        })
        .expect("a default port");
    if u.path() != "/" && !u.path().is_empty() {
        return Err("--egress-proxy: a proxy URL has no path".into());
    }
    let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
    let username = (!u.username().is_empty()).then(|| decode(u.username()));
    let password = u.password().map(decode);
    if password.is_some() && username.is_none() {
        return Err("--egress-proxy: a password needs a user name".into());
    }
    if ca.is_some() && !tls {
        return Err("--egress-proxy-ca: only an https:// proxy is reached over TLS".into());
    }
    let ca_cert = ca
        .map(|f| std::fs::read_to_string(f).map_err(|e| format!("--egress-proxy-ca {}: {e}", f.display())))
        .transpose()?;
    Ok(EgressProxy {
        kind,
        host,
        port,
        username,
        password,
        tls: tls.then_some(ProxyTls {
            server_name: None,
            ca_cert,
        }),
    })
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum MicroVmChoice {
    Auto,
    On,
    Off,
}

/// Default CPU overcommit of an edge (see `--edge-cpu-millis`).
pub const CPU_OVERCOMMIT: u64 = 16;

fn host_memory_mb() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<u64>().ok())
        })
        .map(|kb| kb / 1024)
        .unwrap_or(1024)
}

fn sibling(name: &str) -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(|d| d.join(name)))
        .unwrap_or_else(|| PathBuf::from(name))
}

fn parse_block<A: std::str::FromStr>(flag: &str, text: &str) -> Result<(A, u8), String> {
    let bad = || format!("{flag} {text:?}: give an address block such as 10.231.0.0/16");
    let (a, len) = text.split_once('/').ok_or_else(bad)?;
    Ok((a.parse().map_err(|_| bad())?, len.parse().map_err(|_| bad())?))
}

impl EdgeArgs {
    /// The sandboxes' network the flags describe (`None`: `--no-sandbox-network`).
    pub fn network(&self) -> Result<Option<opendsec_edge::net::NetConfig>, String> {
        if self.no_sandbox_network {
            return Ok(None);
        }
        let pool_v6 = match self.sandbox_subnet_v6.as_str() {
            "none" => None,
            text => Some(parse_block("--sandbox-subnet-v6", text)?),
        };
        let upstream_dns = self
            .upstream_dns
            .iter()
            .map(|s| {
                s.parse::<std::net::SocketAddr>()
                    .or_else(|_| {
                        s.parse::<std::net::IpAddr>()
                            .map(|ip| std::net::SocketAddr::new(ip, 53))
                    })
                    .map_err(|_| format!("--upstream-dns {s:?}: give an IP address, or IP:port"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        opendsec_edge::net::nft::binary().map_err(|e| format!("{e}, or start the edge with --no-sandbox-network"))?;
        Ok(Some(opendsec_edge::net::NetConfig {
            pool_v4: parse_block("--sandbox-subnet", &self.sandbox_subnet)?,
            pool_v6,
            upstream_dns,
            egress_proxy: self
                .egress_proxy
                .as_deref()
                .map(|u| egress_proxy(u, self.egress_proxy_ca.as_deref()))
                .transpose()?,
            ..Default::default()
        }))
    }

    /// The registry settings the flags name; an unreadable credentials file is an error
    /// at start, not at the first pull.
    pub fn registries(&self) -> Result<RegistrySettings, String> {
        for r in &self.insecure_registries {
            if r.is_empty() || r.contains('/') {
                return Err(format!(
                    "--insecure-registry {r:?}: give host[:port], without a scheme or path"
                ));
            }
        }
        Ok(RegistrySettings {
            insecure: self.insecure_registries.clone(),
            auths: match &self.registry_auth {
                Some(path) => RegistrySettings::read_auth_file(path).map_err(|e| format!("--registry-auth: {e}"))?,
                None => Default::default(),
            },
        })
    }

    pub fn config(
        &self,
        data_dir: &Path,
        control_peer: String,
        token: String,
        registries: RegistrySettings,
        network: Option<opendsec_edge::net::NetConfig>,
    ) -> EdgeConfig {
        let cpus = std::thread::available_parallelism()
            .map(|n| n.get() as u64)
            .unwrap_or(1);
        let container = ContainerConfig {
            sandboxes_root: data_dir.join("sandboxes"),
            runtime_root: data_dir.join("runtime"),
            runtime: self.runtime,
            warm_disks: self.warm_disks,
            warm_disk_bytes: self.disk_mb << 20,
            user_namespaces: !self.insecure_no_user_namespaces,
            lxcfs: if self.no_lxcfs_views {
                None
            } else {
                ContainerConfig::default().lxcfs
            },
            apparmor: (!self.insecure_no_apparmor).then(|| data_dir.join("apparmor")),
            ..ContainerConfig::default()
        };
        EdgeConfig {
            name: self.edge_name.clone(),
            control_peer,
            token,
            // The edge's identity and key: set by the caller (the embedded edge), or
            // read from the data directory or got by joining (see opendsec_edge::identity).
            edge_key: String::new(),
            trust: None,
            ca_pem: None,
            data_dir: data_dir.to_path_buf(),
            proxy_listen: self.proxy_listen.clone(),
            capacity: Capacity {
                sandboxes: self.edge_sandboxes,
                cpu_millis: self.edge_cpu_millis.unwrap_or(cpus * 1000 * CPU_OVERCOMMIT),
                memory_mb: self.edge_memory_mb.unwrap_or_else(host_memory_mb),
            },
            container,
            images_dir: self.image_dir.clone(),
            // Absolute: it is bind-mounted into sandboxes by a runtime with another cwd.
            agent_binary: self
                .agent
                .clone()
                .map(|p| std::path::absolute(&p).unwrap_or(p))
                .unwrap_or_else(|| sibling("opendsec-agent")),
            disk_bytes: self.disk_mb << 20,
            pids: self.pids,
            microvm: self.microvm_config(),
            warm_sandboxes: self.warm_sandboxes,
            registries,
            network,
        }
    }

    fn microvm_config(&self) -> Option<MicroVmEdgeConfig> {
        let shim = self
            .vm_shim
            .clone()
            .map(|p| std::path::absolute(&p).unwrap_or(p))
            .unwrap_or_else(|| sibling("opendsec-vm-shim"));
        let usable = shim.is_file() && opendsec_edge::vm::host_has_qemu();
        match self.microvm {
            MicroVmChoice::Off => None,
            MicroVmChoice::Auto if !usable => {
                tracing::info!(shim = %shim.display(), "no microVMs on this edge: QEMU or the microVM shim is missing");
                None
            }
            // With `on`, a missing piece is reported by the driver when it starts.
            _ => Some(MicroVmEdgeConfig { shim }),
        }
    }
}

/// The embedded edge's token: read from `<edge dir>/edge.token`, or issued once the
/// cluster is initialised (by the system, in the root project, with edge:write only).
pub async fn embedded_edge_token(node: &ControlNode, edge_dir: &Path) -> Result<String, String> {
    let path = edge_dir.join("edge.token");
    if let Ok(t) = std::fs::read_to_string(&path) {
        return Ok(t.trim().to_string());
    }
    let root = loop {
        if let Some(r) = node.read(|s| s.root_project().map(|p| p.id.clone())) {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (secret, hash) = new_token_secret();
    let cmd = Command::IssueToken {
        project: root,
        name: "embedded-edge".into(),
        rights: vec![Right::EdgeWrite],
        ttl_seconds: None,
        secret_sha256: hash,
    };
    let issued = node
        .submit(Credential::System, uuid::Uuid::new_v4().to_string(), cmd)
        .await
        .map_err(|e| e.to_string())?;
    let token = format_token(&issued.decided.target, &secret);
    std::fs::create_dir_all(edge_dir).map_err(|e| e.to_string())?;
    crate::write_private(&path, &token)?;
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::egress_proxy;
    use opendsec_commands::network::ProxyKind;

    #[test]
    fn an_edges_proxy_url_names_its_kind_host_port_and_credentials() {
        let p = egress_proxy("socks5://mirror%40site:p%3Ass@proxy.corp:1081", None).unwrap();
        assert_eq!(
            (p.kind, p.host.as_str(), p.port),
            (ProxyKind::Socks5, "proxy.corp", 1081)
        );
        assert_eq!(
            (p.username.as_deref(), p.password.as_deref()),
            (Some("mirror@site"), Some("p:ss"))
        );
        assert!(p.tls.is_none());
        let h = egress_proxy("http://10.0.0.3", None).unwrap();
        assert_eq!((h.kind, h.port), (ProxyKind::Http, 80));
        let s = egress_proxy("https://[2001:db8::3]:8443", None).unwrap();
        assert_eq!(
            (s.kind, s.host.as_str(), s.port, s.tls.is_some()),
            (ProxyKind::Http, "2001:db8::3", 8443, true)
        );
        for bad in ["ftp://p:21", "socks5://:pw@p:1080", "not a url", "http://p:3128/path"] {
            let e = egress_proxy(bad, None).unwrap_err();
            assert!(e.starts_with("--egress-proxy"), "{bad}: {e}");
            assert!(!e.contains("pw"), "no secret in the error: {e}");
        }
        assert!(egress_proxy("http://p:3128", Some(std::path::Path::new("/nonexistent"))).is_err());
    }
}
