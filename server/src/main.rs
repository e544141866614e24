//! `opendsec`: the server binary. It only wires the crates together, so that the
//! embedded single-node `opendsec up` and a three-node cluster run the same code.

mod telemetry;

use clap::{Parser, Subcommand};
use opendsec_control::pb::{control_client::ControlClient, BootstrapRequest};
use opendsec_control::{format_token, new_cluster_key, new_token_secret, ControlConfig, ControlNode};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "opendsec", version, about = "OpenDsec server: control plane, gateway (and, later, edge) in one binary")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
    /// File holding the cluster key (created if missing). Defaults to <data-dir>/cluster.key.
    #[arg(long)]
    cluster_key_file: Option<PathBuf>,
    /// Raft snapshot and log compaction (into the archive) every this many entries.
    #[arg(long, default_value_t = 10_000)]
    snapshot_every: u64,
    /// Replay checkpoint every this many entries.
    #[arg(long, default_value_t = 10_000)]
    checkpoint_every: u64,
    /// Archived entries to keep (default: all, forever).
    #[arg(long)]
    archive_retention: Option<u64>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the embedded single-node OpenDsec (one control node and the gateway).
    Up {
        #[command(flatten)]
        node: NodeArgs,
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
        #[arg(long)]
        cluster_key_file: Option<PathBuf>,
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

fn write_private(path: &Path, content: &str) -> Result<(), String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    f.write_all(content.as_bytes()).map_err(|e| format!("cannot write {}: {e}", path.display()))
}

fn parse_members(s: &str) -> Result<BTreeMap<u64, String>, String> {
    s.split(',')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (id, addr) = p.split_once('=').ok_or_else(|| format!("member `{p}` is not id=host:port"))?;
            let id: u64 = id.parse().map_err(|_| format!("member id `{id}` is not a number"))?;
            Ok((id, addr.to_string()))
        })
        .collect()
}

async fn run_node(id: u64, args: NodeArgs, init: Option<BTreeMap<u64, String>>) -> Result<(), String> {
    let key = read_or_create_key(&key_file(&args.data_dir, &args.cluster_key_file))?;
    let advertise = args.advertise_peer.clone().unwrap_or_else(|| args.peer_listen.clone());
    let mut cfg = ControlConfig::new(id, &args.data_dir, advertise, key);
    cfg.snapshot_every = args.snapshot_every;
    cfg.checkpoint_every = args.checkpoint_every;
    cfg.archive_retention = args.archive_retention;
    let peer = tokio::net::TcpListener::bind(&args.peer_listen).await.map_err(|e| format!("cannot listen on {}: {e}", args.peer_listen))?;
    let http = tokio::net::TcpListener::bind(&args.listen).await.map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
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
    let app = opendsec_gateway::router(node.clone());
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
    shutdown_signal().await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    let _ = tokio::time::timeout(Duration::from_secs(5), http_task).await;
    let _ = tokio::time::timeout(Duration::from_secs(5), peer_task).await;
    node.shutdown().await;
    Ok(())
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

async fn init(peer: String, data_dir: PathBuf, key_file_arg: Option<PathBuf>, project_name: String, url: String, token_file: Option<PathBuf>) -> Result<(), String> {
    let path = key_file(&data_dir, &key_file_arg);
    let key = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read the cluster key at {}: {e}; start the node first (`opendsec up`) or pass --cluster-key-file", path.display()))?;
    let (secret, hash) = new_token_secret();
    let req = BootstrapRequest {
        cluster_key: key.trim().to_string(),
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
        let mut client = match ControlClient::connect(format!("http://{addr}")).await {
            Ok(c) => c,
            Err(e) => {
                last = format!("no control node answers at {addr} ({e}); is `opendsec up` running?");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let reply = match client.bootstrap(req.clone()).await {
            Ok(r) => r.into_inner(),
            Err(s) if s.code() == tonic::Code::PermissionDenied => return Err(format!("bootstrap refused: {}", s.message())),
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
                println!("OpenDsec is initialised: root project {}, admin token below (shown once).", s.decided.project);
                println!();
                println!("export OPENDSEC_URL={url}");
                println!("export OPENDSEC_TOKEN={token}");
                println!();
                println!("Then try: opendsecctl whoami; opendsecctl project create team-a");
                return Ok(());
            }
            Err(opendsec_control::SubmitError::Rejected { rejection, .. }) if rejection.kind == opendsec_commands::RejectionKind::Conflict => {
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

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let _telemetry = telemetry::init();
    let result = match cli.cmd {
        Cmd::Up { node } => {
            let peer = node.advertise_peer.clone().unwrap_or_else(|| node.peer_listen.clone());
            run_node(1, node, Some(BTreeMap::from([(1, peer)]))).await
        }
        Cmd::Control { id, node, init_members } => match init_members.as_deref().map(parse_members).transpose() {
            Ok(init) => run_node(id, node, init).await,
            Err(e) => Err(e),
        },
        Cmd::Init { peer, data_dir, cluster_key_file, project_name, url, token_file } => {
            init(peer, data_dir, cluster_key_file, project_name, url, token_file).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
