//! `opendsec`: the server binary. It only wires the crates together, so that the
//! embedded single-node `opendsec up` and a three-node cluster run the same code.

mod edge;
mod telemetry;

/// Every allocation of the server goes through mimalloc, built without transparent huge
/// pages for its own arenas (`no_thp`, see Cargo.toml: with them each thread's first
/// allocations faulted in 2 MiB pages, ~3 MiB of RSS per concurrent create).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};
use opendsec_control::pb::{BootstrapRequest, control_client::ControlClient};
use opendsec_control::{ControlConfig, ControlNode, format_token, new_cluster_key, new_token_secret};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "opendsec",
    version,
    about = "OpenDsec server: control plane, gateway (and, later, edge) in one binary"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Threads that run the server's async work (default: one per CPU). Members of a
    /// cluster that share one host run best with their share of its CPUs each.
    #[arg(long, global = true, env = "OPENDSEC_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    worker_threads: Option<u16>,
}

#[derive(clap::Args, Clone)]
struct NodeArgs {
    /// Where the node keeps its log, archive and checkpoints.
    #[arg(long, env = "OPENDSEC_DATA_DIR", default_value = ".data/opendsec")]
    data_dir: PathBuf,
    /// The REST / E2B API address.
    #[arg(long, default_value = "127.0.0.1:7400")]
    listen: String,
    /// The peer (gRPC) address: Raft, forwarding, the edge slice API.
    #[arg(long, default_value = "127.0.0.1:7401")]
    peer_listen: String,
    /// The peer address other nodes use (defaults to --peer-listen).
    #[arg(long)]
    advertise_peer: Option<String>,
    /// File holding the cluster key (created if missing; never sent: edges' own keys
    /// derive from it). Defaults to <data-dir>/cluster.key.
    #[arg(long)]
    cluster_key_file: Option<PathBuf>,
    /// The cluster CA's directory (`ca.crt`, `ca.key`), shared by the control nodes of a
    /// cluster (`opendsec ca --dir DIR` makes it). Defaults to <data-dir>/tls, where a
    /// single node makes its own the first time.
    #[arg(long)]
    pki_dir: Option<PathBuf>,
    /// Raft snapshot and log compaction (into the archive) every this many entries (as
    /// etcd's --snapshot-count: a snapshot serialises every view, the whole audit
    /// history included, so it is taken rarely; replay uses its own checkpoints).
    #[arg(long, default_value_t = 100_000)]
    snapshot_every: u64,
    /// Replay checkpoint every this many entries.
    #[arg(long, default_value_t = 10_000)]
    checkpoint_every: u64,
    /// Archived log entries to keep (the history beyond the live log, which replay and
    /// time travel read): the newest this many. `0` keeps them all, forever.
    #[arg(long, default_value_t = 10_000_000)]
    archive_retention: u64,
    /// The domain sandboxes are reached under for E2B host-name routing
    /// (`{port}-{sandboxId}.{domain}`; the API at `api.{domain}`). Without a port of its
    /// own, SDKs are told the --tls-listen port (unless it is 443).
    #[arg(long, env = "OPENDSEC_DOMAIN")]
    domain: Option<String>,
    /// Also serve everything over TLS here (needs --domain), with a certificate for the
    /// domain and `*.domain` issued by the cluster's CA (`<data-dir>/tls/ca.crt`).
    #[arg(long)]
    tls_listen: Option<String>,
    /// Use this certificate chain (PEM) on the TLS port instead of the cluster CA's.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the embedded single-node OpenDsec: one control node, the gateway and a local edge.
    Up {
        #[command(flatten)]
        node: NodeArgs,
        #[command(flatten)]
        edge: edge::EdgeArgs,
        /// Run no local edge (control plane and gateway only).
        #[arg(long)]
        no_edge: bool,
    },
    /// Run an edge: it follows its slice of the log and runs this machine's sandboxes.
    Edge {
        /// A control node's peer address.
        #[arg(long, default_value = "127.0.0.1:7401")]
        control: String,
        /// File holding the edge's token (edge:write, root project).
        #[arg(long)]
        token_file: PathBuf,
        /// The cluster CA's certificate (a copy of a control host's `<pki-dir>/ca.crt`):
        /// a new edge checks the control plane by it when it joins with its token, which
        /// registers it and gets it its certificate and own key (kept in --data-dir).
        #[arg(long)]
        ca_cert: Option<PathBuf>,
        /// Where the edge keeps its state, sandboxes and agent sockets.
        #[arg(long, default_value = ".data/edge")]
        data_dir: PathBuf,
        #[command(flatten)]
        edge: edge::EdgeArgs,
    },
    /// Make a cluster's CA (`ca.crt`, `ca.key`) in a new directory, for every control
    /// node's --pki-dir; edges get a copy of `ca.crt` (--ca-cert).
    Ca {
        #[arg(long)]
        dir: PathBuf,
    },
    /// Run one member of a control-plane cluster.
    Control {
        /// This node's id (1, 2, 3, ...).
        #[arg(long)]
        id: u64,
        #[command(flatten)]
        node: NodeArgs,
        /// Initialise a new cluster with these members: `1=127.0.0.1:7401,2=...`. Give it to one node only.
        #[arg(long)]
        init_members: Option<String>,
    },
    /// Create the first project and an admin token on a running cluster, and print how to use them.
    Init {
        /// Control nodes' peer addresses, comma-separated; the leader among them takes it.
        #[arg(long, default_value = "127.0.0.1:7401")]
        peer: String,
        #[arg(long, env = "OPENDSEC_DATA_DIR", default_value = ".data/opendsec")]
        data_dir: PathBuf,
        /// The cluster CA's directory (defaults to <data-dir>/tls): `init` speaks to the
        /// nodes with an operator certificate it issues itself from it.
        #[arg(long)]
        pki_dir: Option<PathBuf>,
        #[arg(long, default_value = "root")]
        project_name: String,
        /// The REST URL to print in the instructions.
        #[arg(long, default_value = "http://127.0.0.1:7400")]
        url: String,
        /// Also write the token to this file (mode 0600) for opendsecctl.
        #[arg(long)]
        token_file: Option<PathBuf>,
    },
}

fn key_file(node_or_data: &Path, explicit: &Option<PathBuf>) -> PathBuf {
    explicit.clone().unwrap_or_else(|| node_or_data.join("cluster.key"))
}

fn read_or_create_key(path: &Path) -> Result<String, String> {
    if let Ok(k) = std::fs::read_to_string(path) {
        return Ok(k.trim().to_string());
    }
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let key = new_cluster_key();
    write_private(path, &key)?;
    Ok(key)
}

pub(crate) use opendsec_control::write_private;

fn parse_members(s: &str) -> Result<BTreeMap<u64, String>, String> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (id, addr) = p
                .split_once('=')
                .ok_or_else(|| format!("member `{p}` is not id=host:port"))?;
            let id: u64 = id.parse().map_err(|_| format!("member id `{id}` is not a number"))?;
            Ok((id, addr.to_string()))
        })
        .collect()
}

async fn run_node(
    id: u64,
    args: NodeArgs,
    init: Option<BTreeMap<u64, String>>,
    embedded_edge: Option<edge::EdgeArgs>,
) -> Result<(), String> {
    let key = read_or_create_key(&key_file(&args.data_dir, &args.cluster_key_file))?;
    let advertise = args.advertise_peer.clone().unwrap_or_else(|| args.peer_listen.clone());
    let pki = pki_dir(&args.data_dir, &args.pki_dir);
    let ca = match &args.pki_dir {
        // A single node (or the first): its own CA, made the first time.
        None => opendsec_trust::Ca::load_or_create(&pki),
        Some(dir) => opendsec_trust::Ca::load(dir).map_err(|e| match e {
            opendsec_trust::Error::File(..) if !opendsec_trust::ca_files(dir).0.exists() => {
                opendsec_trust::Error::Tls(format!(
                    "no CA in {}: make the cluster's once with `opendsec ca --dir {}` and give every control node that directory",
                    dir.display(),
                    dir.display()
                ))
            }
            e => e,
        }),
    }
    .map_err(|e| e.to_string())?;
    let trust = std::sync::Arc::new(
        opendsec_trust::Trust::issued_by(ca, opendsec_trust::Identity::control(id)).map_err(|e| e.to_string())?,
    );
    let mut cfg = ControlConfig::new(id, &args.data_dir, advertise.clone(), key.clone(), trust.clone());
    cfg.snapshot_every = args.snapshot_every;
    cfg.checkpoint_every = args.checkpoint_every;
    cfg.archive_retention = (args.archive_retention > 0).then_some(args.archive_retention);
    let peer = tokio::net::TcpListener::bind(&args.peer_listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.peer_listen))?;
    let http = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let node = ControlNode::open(cfg).await.map_err(|e| e.to_string())?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let peer_node = node.clone();
    let mut rx = stop_rx.clone();
    let peer_task = tokio::spawn(async move {
        opendsec_control::serve_peer(peer_node, peer, async move {
            let _ = rx.changed().await;
        })
        .await
    });
    if let Some(members) = init {
        node.initialize(members).await.map_err(|e| e.to_string())?;
    }
    tracing::info!(node = id, api = %args.listen, peer = %args.peer_listen, "opendsec control node running");
    // The domain SDKs build URLs from: with the TLS port unless that is 443 or the
    // operator named a port (e.g. a load balancer's).
    let reported_domain = match (&args.domain, &args.tls_listen) {
        (Some(d), Some(l)) if !d.contains(':') => match l.rsplit_once(':').map(|(_, p)| p) {
            Some(p) if p != "443" => Some(format!("{d}:{p}")),
            _ => Some(d.clone()),
        },
        (d, _) => d.clone(),
    };
    let e2b = opendsec_gateway::e2b::E2bSettings {
        domain: reported_domain,
        disk_size_mb: embedded_edge.as_ref().map(|e| e.disk_mb).unwrap_or(0),
        template_files: Some(args.data_dir.join("template-files")),
    };
    let app = opendsec_gateway::router_with(node.clone(), e2b);
    let tls_task = match &args.tls_listen {
        None => None,
        Some(addr) => {
            let domain = args
                .domain
                .as_deref()
                .ok_or("--tls-listen needs --domain (the name the certificate is for)")?;
            let host = domain.rsplit_once(':').map(|(h, _)| h).unwrap_or(domain).to_string();
            let settings = opendsec_gateway::tls::TlsSettings {
                dir: pki.clone(),
                domain: host,
                cert_and_key: args.tls_cert.clone().zip(args.tls_key.clone()),
            };
            let config = opendsec_gateway::tls::server_config(&settings)?;
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            tracing::info!(tls = %addr, %domain, ca = %settings.dir.join("ca.crt").display(), "serving TLS");
            Some(tokio::spawn(opendsec_gateway::tls::serve(l, config, app.clone())))
        }
    };
    let mut rx = stop_rx.clone();
    let http_task = tokio::spawn(async move {
        // Answer small requests without Nagle's delay.
        let http = axum::serve::ListenerExt::tap_io(http, |tcp| {
            let _ = tcp.set_nodelay(true);
        });
        axum::serve(http, app)
            .with_graceful_shutdown(async move {
                let _ = rx.changed().await;
            })
            .await
    });
    let (registries, network) = match &embedded_edge {
        Some(e) => (e.registries()?, e.network()?),
        None => Default::default(),
    };
    let edge_task = embedded_edge.map(|edge_args| {
        let (node, mut rx) = (node.clone(), stop_rx.clone());
        let edge_dir = args.data_dir.join("edge");
        tokio::spawn(async move {
            let token = match edge::embedded_edge_token(&node, &edge_dir).await {
                Ok(t) => t,
                Err(e) => {
                    tracing::error!(error = %e, "the embedded edge has no token; it does not start");
                    return;
                }
            };
            // The embedded edge's identity comes from its node's CA, in this process,
            // which also renews it (after a rotation, or a third of its life before it
            // expires) as a joined edge asks its control node to.
            let name = &edge_args.edge_name;
            let edge_trust = trust
                .renewing_sibling(opendsec_trust::Identity::edge(name))
                .map_err(|e| e.to_string());
            let edge_trust = match edge_trust {
                Ok(t) => std::sync::Arc::new(t),
                Err(e) => {
                    tracing::error!(error = %e, "the embedded edge has no certificate; it does not start");
                    return;
                }
            };
            let mut cfg = edge_args.config(&edge_dir, advertise, token, registries, network);
            cfg.edge_key = opendsec_control::edge_key(&key, name);
            cfg.trust = Some(edge_trust);
            if let Err(e) = opendsec_edge::node::run(cfg, async move {
                let _ = rx.changed().await;
            })
            .await
            {
                tracing::error!(error = %e, "the embedded edge stopped");
            }
        })
    });
    shutdown_signal().await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), http_task).await;
    if let Some(t) = tls_task {
        t.abort();
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), peer_task).await;
    if let Some(t) = edge_task {
        let _ = tokio::time::timeout(Duration::from_secs(5), t).await;
    }
    node.shutdown().await;
    Ok(())
}

async fn run_edge(
    control: String,
    token_file: PathBuf,
    ca_cert: Option<PathBuf>,
    data_dir: PathBuf,
    args: edge::EdgeArgs,
) -> Result<(), String> {
    let token = std::fs::read_to_string(&token_file).map_err(|e| {
        format!(
            "cannot read the edge token at {}: {e}; issue one with `opendsecctl token issue --rights edge:write`",
            token_file.display()
        )
    })?;
    let ca_pem = match &ca_cert {
        None => None,
        Some(p) => Some(
            std::fs::read_to_string(p)
                .map_err(|e| format!("cannot read the CA certificate at {}: {e}", p.display()))?,
        ),
    };
    std::fs::create_dir_all(&data_dir).map_err(|e| format!("cannot create {}: {e}", data_dir.display()))?;
    let registries = args.registries()?;
    let network = args.network()?;
    let mut cfg = args.config(&data_dir, control, token.trim().to_string(), registries, network);
    cfg.ca_pem = ca_pem;
    tracing::info!(edge = %cfg.name, proxy = %cfg.proxy_listen, "opendsec edge running");
    opendsec_edge::node::run(cfg, shutdown_signal())
        .await
        .map_err(|e| e.to_string())
}

/// `opendsec ca`: a new cluster CA in `dir`.
fn make_ca(dir: &Path) -> Result<(), String> {
    opendsec_trust::Ca::create(dir).map_err(|e| e.to_string())?;
    let (crt, key) = opendsec_trust::ca_files(dir);
    println!(
        "made the cluster CA: {} and {} (the key stays on control hosts)",
        crt.display(),
        key.display()
    );
    println!(
        "control nodes: --pki-dir {}; edges: a copy of {} as --ca-cert",
        dir.display(),
        crt.display()
    );
    Ok(())
}

fn pki_dir(data_dir: &Path, explicit: &Option<PathBuf>) -> PathBuf {
    explicit.clone().unwrap_or_else(|| data_dir.join("tls"))
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn init(
    peer: String,
    data_dir: PathBuf,
    pki_arg: Option<PathBuf>,
    project_name: String,
    url: String,
    token_file: Option<PathBuf>,
) -> Result<(), String> {
    let pki = pki_dir(&data_dir, &pki_arg);
    // A node that was just started makes its CA first thing: give it a moment.
    let mut ca = opendsec_trust::Ca::load(&pki);
    for _ in 0..100 {
        if ca.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        ca = opendsec_trust::Ca::load(&pki);
    }
    let ca = ca.map_err(|e| {
        format!("cannot load the cluster CA: {e}; start the node first (`opendsec up`) or pass --pki-dir")
    })?;
    // The nodes know this tool by a certificate it issues itself from the CA, which only
    // control hosts hold.
    let trust = std::sync::Arc::new(
        opendsec_trust::Trust::issued_by(ca, opendsec_trust::Identity::operator("init")).map_err(|e| e.to_string())?,
    );
    let (secret, hash) = new_token_secret();
    let req = BootstrapRequest {
        project_name,
        token_name: "admin".into(),
        secret_sha256: hash,
        request_id: uuid::Uuid::new_v4().to_string(),
    };
    // Bootstrapping runs on the leader: try each given node in turn until one takes it.
    let peers: Vec<&str> = peer.split(',').filter(|p| !p.is_empty()).collect();
    let mut last = String::from("no peer given");
    for attempt in 0..200 {
        let addr = peers[attempt % peers.len()];
        let endpoint = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| format!("peer address {addr}: {e}"))?;
        let control = opendsec_trust::Expect::Role(opendsec_trust::Role::Control);
        let connected = endpoint
            .connect_with_connector(opendsec_trust::tls_connector(trust.clone(), control))
            .await;
        let mut client = match connected.map(ControlClient::new) {
            Ok(c) => c,
            Err(e) => {
                last = format!("no control node answers at {addr} ({e}); is `opendsec up` running?");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let reply = match client.bootstrap(req.clone()).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::PermissionDenied => {
                return Err(format!("bootstrap refused: {}", s.message()));
            }
            Err(s) => {
                last = s.message().to_string();
                continue;
            }
        };
        match opendsec_control::peer::reply_to_result(reply) {
            Ok(s) => {
                let token = format_token(&s.decided.target, &secret);
                if let Some(f) = token_file {
                    if let Some(d) = f.parent() {
                        std::fs::create_dir_all(d).map_err(|e| e.to_string())?;
                    }
                    write_private(&f, &token)?;
                    eprintln!("admin token written to {}", f.display());
                }
                println!(
                    "OpenDsec is initialised: root project {}, admin token below (shown once).",
                    s.decided.project
                );
                println!();
                println!("export OPENDSEC_URL={url}");
                println!("export OPENDSEC_TOKEN={token}");
                println!();
                println!("Then try: opendsecctl whoami; opendsecctl project create team-a");
                return Ok(());
            }
            Err(opendsec_control::SubmitError::Rejected { rejection, .. })
                if rejection.kind == opendsec_commands::RejectionKind::Conflict =>
            {
                return Err("this cluster is already initialised; its admin token was printed then. Issue more with `opendsecctl token issue`".into());
            }
            Err(e) => {
                last = e.to_string();
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    Err(format!("bootstrap did not go through: {last}"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(cli.cmd, Cmd::Control { .. }) {
        // A control node's heap churns (requests, batches, checkpoints): with transparent
        // huge pages each fresh fault zeroes 2 MiB, which cost it ~8% of its CPU and
        // ~15% more memory. Only here: the flag is inherited by children, and `up` and
        // `edge` start the VMMs whose guest memory wants huge pages.
        if let Err(e) = nix::sys::prctl::set_thp_disable(true) {
            eprintln!("warning: cannot turn off transparent huge pages for this process: {e}");
        }
    }
    let mut runtime = tokio::runtime::Builder::new_multi_thread();
    runtime.enable_all();
    if let Some(n) = cli.worker_threads {
        runtime.worker_threads(n.into());
    }
    match runtime.build() {
        Ok(rt) => rt.block_on(serve(cli)),
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn serve(cli: Cli) -> ExitCode {
    let _telemetry = telemetry::init();
    let result = match cli.cmd {
        Cmd::Up { node, edge, no_edge } => {
            let peer = node.advertise_peer.clone().unwrap_or_else(|| node.peer_listen.clone());
            run_node(1, node, Some(BTreeMap::from([(1, peer)])), (!no_edge).then_some(edge)).await
        }
        Cmd::Edge {
            control,
            token_file,
            ca_cert,
            data_dir,
            edge,
        } => run_edge(control, token_file, ca_cert, data_dir, edge).await,
        Cmd::Ca { dir } => make_ca(&dir),
        Cmd::Control { id, node, init_members } => match init_members.as_deref().map(parse_members).transpose() {
            Ok(init) => run_node(id, node, init, None).await,
            Err(e) => Err(e),
        },
        Cmd::Init {
            peer,
            data_dir,
            pki_dir,
            project_name,
            url,
            token_file,
        } => init(peer, data_dir, pki_dir, project_name, url, token_file).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
