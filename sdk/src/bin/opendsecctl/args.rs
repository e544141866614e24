//! The command line's shape: every command, subcommand and flag (clap derive), with the
//! help text users read. `opendsecctl.rs` runs them.

use clap::{Args, Parser, Subcommand, ValueEnum};
use opendsec_sdk::DEFAULT_URL;
use opendsec_sdk::types::{CpuClass, Isolation};

#[derive(Parser)]
#[command(
    name = "opendsecctl",
    version,
    about = "Manage an OpenDsec cluster: projects, quotas, tokens, sandboxes, edges, audit and time travel"
)]
pub(crate) struct Cli {
    /// The API's base URL.
    #[arg(long, global = true, env = "OPENDSEC_URL", default_value = DEFAULT_URL)]
    pub(crate) url: String,
    /// Bearer token (odsec_...). Else read from OPENDSEC_TOKEN_FILE or ~/.config/opendsec/token.
    #[arg(long, global = true, env = "OPENDSEC_TOKEN", hide_env_values = true)]
    pub(crate) token: Option<String>,
    /// Aligned tables for people, or the API's JSON for scripts.
    #[arg(long, short, global = true, value_enum, default_value_t = Output::Table)]
    pub(crate) output: Output,
    #[command(subcommand)]
    pub(crate) command: Cmd,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Output {
    Table,
    Json,
}

#[derive(Subcommand)]
pub(crate) enum Cmd {
    /// Raft cluster status and membership.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Nested projects: create, list, get, delete.
    #[command(subcommand)]
    Project(ProjectCmd),
    /// A project's limits, effective limits and usage.
    #[command(subcommand)]
    Quota(QuotaCmd),
    /// Issue, list and revoke tokens.
    #[command(subcommand)]
    Token(TokenCmd),
    /// Shows the calling token: its project and rights.
    Whoami,
    /// Create, inspect and steer sandboxes.
    #[command(subcommand)]
    Sandbox(SandboxCmd),
    /// Images from OCI registries: pull, list, get, rm. Sandboxes start them by name.
    #[command(subcommand)]
    Image(ImageCmd),
    /// Snapshots of sandboxes (`sandbox snapshot` takes one): list, get, delete.
    #[command(subcommand)]
    Snapshot(SnapshotCmd),
    /// Every sandbox labelled task=<name> at once: pause, resume.
    #[command(subcommand)]
    Task(TaskCmd),
    /// The machines that run sandboxes.
    #[command(subcommand)]
    Edge(EdgeCmd),
    /// Who did what, when, to what, with what result.
    Audit(AuditArgs),
    /// Rebuilds views as they were at a past index or time, or diffs two points.
    Replay(ReplayArgs),
    /// E2B compatibility: run code written for the E2B SDK against this cluster.
    #[command(subcommand)]
    E2b(E2bCmd),
}

#[derive(Subcommand)]
pub(crate) enum E2bCmd {
    /// Issues an E2B API key for the current project (sandbox:read, sandbox:write) and
    /// prints the three `export` lines the E2B SDK needs.
    Env {
        /// The key's name.
        #[arg(long, default_value = "e2b")]
        name: String,
        /// Lifetime of the key (default: no expiry of its own).
        #[arg(long)]
        ttl_seconds: Option<u64>,
    },
}

#[derive(Subcommand)]
pub(crate) enum ClusterCmd {
    /// Leader, term, indexes, members and the state hash of the node answering.
    Status,
    /// Adds a control node (it catches up as a learner, then votes).
    AddNode {
        #[arg(long)]
        id: u64,
        /// host:port of its peer (Raft) port.
        #[arg(long)]
        addr: String,
    },
    /// Removes a control node from the cluster.
    RemoveNode {
        #[arg(long)]
        id: u64,
    },
    /// A fresh key and certificate for every control node and its gateway, without
    /// downtime (open connections keep theirs); edges renew theirs at their next heartbeat.
    RotateCerts,
    /// How long the live views keep ended sandboxes and audit records (older ones stay in
    /// the log's archive, for replay and time travel); with a flag, sets it.
    Retention {
        /// How long an ended sandbox stays listed: `0`, `90s`, `10m`, `2h`, `7d`.
        #[arg(long, value_parser = parse_keep)]
        ended_sandboxes: Option<u64>,
        /// How long the audit view keeps a record (at least 15m).
        #[arg(long, value_parser = parse_keep)]
        audit: Option<u64>,
        /// The most records the audit view keeps.
        #[arg(long)]
        audit_records: Option<u64>,
    },
}

#[derive(Subcommand)]
pub(crate) enum ProjectCmd {
    /// Creates a project under --parent.
    Create {
        name: String,
        /// Parent project id (default: the token's project).
        #[arg(long)]
        parent: Option<String>,
    },
    /// Projects in the token's subtree.
    List,
    Get {
        id: String,
    },
    /// Deletes an empty project (no children, no live sandboxes).
    Delete {
        id: String,
    },
    /// Its egress ceiling and its sandboxes' default network policy.
    #[command(subcommand)]
    Network(ProjectNetworkCmd),
    /// Its write rates (writes over them get 429 with Retry-After).
    #[command(subcommand)]
    RateLimits(RateLimitsCmd),
}

#[derive(Subcommand)]
pub(crate) enum RateLimitsCmd {
    /// Its own rates and those in force.
    Get { project: String },
    /// Sets its own rates (one left out: none of its own); never above the parent's.
    Set {
        project: String,
        /// Writes a second by all the tokens of its subtree together.
        #[arg(long)]
        writes_per_second: Option<u64>,
        /// Writes a second by each token of its subtree.
        #[arg(long)]
        token_writes_per_second: Option<u64>,
    },
}

/// A sandbox's egress policy on the command line. Nothing is allowed unless named: a rule
/// is `pkgs.example.com`, `*.example.com:443`, `10.1.0.0/16`, `[2001:db8::1]:53`, or a
/// JSON object `{"to": ..., "ports": [443, "8000-8100"], "protocol": "tcp"}`.
#[derive(Args, Clone, Default)]
pub(crate) struct NetworkArgs {
    /// A destination it may reach (an allow beats a deny); repeat for several.
    #[arg(long = "allow-out", value_name = "RULE", value_parser = parse_rule)]
    pub allow_out: Vec<serde_json::Value>,
    /// A destination taken away from --internet; repeat for several.
    #[arg(long = "deny-out", value_name = "RULE", value_parser = parse_rule)]
    pub deny_out: Vec<serde_json::Value>,
    /// The public internet (never private, loopback, link-local or metadata addresses).
    #[arg(long)]
    pub internet: bool,
    /// An upstream proxy that what it may reach over TCP goes through:
    /// `[socks5://|http://][USER@]HOST:PORT` (SOCKS5 unless http://; the password, if
    /// any, from $OPENDSEC_EGRESS_PROXY_PASSWORD, never on the command line).
    #[arg(long = "egress-proxy", value_name = "URL")]
    pub egress_proxy: Option<String>,
    /// TLS to the proxy, trusting the PEM certificates in FILE (without it: the
    /// server's trusted roots).
    #[arg(long = "egress-proxy-tls", value_name = "FILE", num_args = 0..=1, default_missing_value = "", requires = "egress_proxy")]
    pub egress_proxy_tls: Option<String>,
}

impl NetworkArgs {
    pub fn given(&self) -> bool {
        self.internet || !self.allow_out.is_empty() || !self.deny_out.is_empty() || self.egress_proxy.is_some()
    }

    pub fn policy(self) -> Result<opendsec_sdk::types::NetworkPolicy, opendsec_sdk::ApiError> {
        let egress_proxy =
            match &self.egress_proxy {
                None => None,
                Some(url) => Some(proxy_json(url, self.egress_proxy_tls.as_deref()).map_err(|message| {
                    opendsec_sdk::ApiError {
                        status: 0,
                        code: "invalid".into(),
                        message,
                        field: Some("--egress-proxy".into()),
                    }
                })?),
            };
        Ok(opendsec_sdk::types::NetworkPolicy {
            allow_internet_access: self.internet,
            allow_out: self.allow_out,
            deny_out: self.deny_out,
            dns_servers: vec![],
            egress_proxy,
        })
    }
}

/// `--egress-proxy URL` (and `--egress-proxy-tls [FILE]`) as the API's proxy object.
fn proxy_json(url: &str, tls: Option<&str>) -> Result<serde_json::Value, String> {
    let (scheme, rest) = match url.split_once("://") {
        Some((s, r)) => (Some(s), r),
        None => (None, url),
    };
    let (user, address) = match rest.rsplit_once('@') {
        Some((u, a)) => (Some(u), a),
        None => (None, rest),
    };
    if user.is_some_and(|u| u.contains(':')) {
        return Err(
            "--egress-proxy: put the password in $OPENDSEC_EGRESS_PROXY_PASSWORD, not in the URL \
             (a command line is visible to every user of this machine)"
                .to_string(),
        );
    }
    let mut o = serde_json::json!({
        "address": match scheme { Some(s) => format!("{s}://{address}"), None => address.to_string() },
    });
    if let Some(u) = user {
        o["username"] = u.into();
        if let Ok(pw) = std::env::var("OPENDSEC_EGRESS_PROXY_PASSWORD") {
            o["password"] = pw.into();
        }
    }
    match tls {
        None => {}
        Some("") => o["tls"] = serde_json::json!({"enabled": true}),
        Some(file) => {
            let pem = std::fs::read_to_string(file).map_err(|e| format!("--egress-proxy-tls: reading {file}: {e}"))?;
            o["tls"] = serde_json::json!({"enabled": true, "ca_cert": pem});
        }
    }
    Ok(o)
}

/// A rule: a JSON object as given, anything else as a string for the server to check.
pub(crate) fn parse_rule(s: &str) -> Result<serde_json::Value, String> {
    if s.trim_start().starts_with('{') {
        return serde_json::from_str(s).map_err(|e| format!("{s:?} is not a JSON rule object: {e}"));
    }
    Ok(serde_json::Value::String(s.to_string()))
}

#[derive(Subcommand)]
pub(crate) enum SandboxNetworkCmd {
    /// Its egress policy.
    Get { id: String },
    /// Replaces its whole egress policy while it runs (with no rule: it reaches nothing).
    /// Connections the new policy forbids stop.
    Set {
        id: String,
        #[command(flatten)]
        network: NetworkArgs,
    },
}

#[derive(Subcommand)]
pub(crate) enum ProjectNetworkCmd {
    /// Its egress ceiling and its sandboxes' default policy.
    Get { project: String },
    /// Sets its egress ceiling and the policy of its sandboxes that name none.
    Set {
        project: String,
        /// none, public (the default) or any (also private networks a rule names);
        /// never above the parent project's.
        #[arg(long)]
        ceiling: String,
        /// The default policy (without any of these: deny).
        #[command(flatten)]
        default: NetworkArgs,
    },
}

#[derive(Subcommand)]
pub(crate) enum QuotaCmd {
    /// Sets a project's limits; a resource left out is unlimited.
    Set {
        project: String,
        #[arg(long)]
        sandboxes: Option<u64>,
        #[arg(long)]
        cpu_millis: Option<u64>,
        #[arg(long)]
        memory_mb: Option<u64>,
        /// Bytes of environment variables and labels (names and values) its live
        /// sandboxes may hold together.
        #[arg(long)]
        metadata_bytes: Option<u64>,
    },
    /// Own limits, effective limits and usage.
    Get { project: String },
}

#[derive(Subcommand)]
pub(crate) enum TokenCmd {
    /// Issues a token; its secret is printed once.
    Issue {
        #[arg(long)]
        name: String,
        /// Project id (default: the token's project).
        #[arg(long)]
        project: Option<String>,
        /// Comma-separated, e.g. sandbox:read,sandbox:write.
        #[arg(long, value_delimiter = ',', required = true)]
        rights: Vec<String>,
        #[arg(long)]
        ttl_seconds: Option<u64>,
        /// `opendsec` (odsec_…) or `e2b` (an E2B API key, e2b_…).
        #[arg(long, default_value = "opendsec")]
        format: String,
    },
    /// Tokens of the subtree (never their secrets).
    List {
        #[arg(long)]
        project: Option<String>,
    },
    /// Revokes a token at once.
    Revoke {
        id: String,
        #[arg(long)]
        reason: Option<String>,
    },
}

#[derive(Subcommand)]
pub(crate) enum SandboxCmd {
    /// Creates a sandbox, placed on an edge with room.
    Create {
        #[arg(long)]
        image: String,
        #[arg(long)]
        project: Option<String>,
        /// Default 1000.
        #[arg(long)]
        cpu_millis: Option<u64>,
        /// Default 512.
        #[arg(long)]
        memory_mb: Option<u64>,
        /// key=value; repeat for several.
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// KEY=VALUE in the environment of every process in it; repeat for several.
        /// Shown by name only; dropped from the state once the sandbox ends.
        #[arg(long = "env", value_parser = parse_label)]
        env: Vec<(String, String)>,
        #[arg(long)]
        timeout_seconds: Option<u64>,
        /// container (the default), microvm (a QEMU microVM: its pause, snapshots and
        /// forks carry its memory) or vm (a full VM: a q35 PC booting the image as a
        /// whole disk; memory carried as a microVM's).
        #[arg(long, value_enum)]
        isolation: Option<IsolationArg>,
        /// latency-sensitive (the default: its quota at normal priority) or best-effort
        /// (SCHED_IDLE and the least CPU weight: only CPU time others leave).
        #[arg(long, value_enum)]
        cpu_class: Option<CpuClassArg>,
        /// Return as soon as the sandbox is placed (pending), instead of once it runs.
        #[arg(long, conflicts_with = "wait")]
        no_wait: bool,
        /// How long to wait for it to run at most (VMs under emulation and first pulls
        /// take long).
        #[arg(long, value_name = "SECONDS", default_value_t = 300)]
        wait_seconds: u64,
        /// Waiting is the default; `--wait [SECONDS]` is still taken (as --wait-seconds).
        #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "300", hide = true)]
        wait: Option<u64>,
        /// A call to the sandbox while it is paused gets a 409 instead of resuming it (by
        /// default the next call resumes it).
        #[arg(long)]
        no_auto_resume: bool,
        /// At its timeout, pause it instead of ending it.
        #[arg(long)]
        auto_pause: bool,
        /// At its timeout, pause it keeping only its file system (containers): its
        /// processes end; the next call boots it again.
        #[arg(long, conflicts_with = "auto_pause")]
        auto_pause_filesystem: bool,
        #[command(flatten)]
        network: NetworkArgs,
    },
    /// Live sandboxes (or those in --state).
    List {
        #[arg(long)]
        project: Option<String>,
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
        /// pending, running, pausing, paused, resuming, killed, failed or exited.
        #[arg(long)]
        state: Option<String>,
    },
    Get {
        id: String,
    },
    /// Kills it; its quota is given back.
    Kill {
        id: String,
    },
    /// The end of the sandbox's console: its PID 1 output (the agent's log, a template's
    /// start command).
    Logs {
        id: String,
        /// At most this many of the last bytes.
        #[arg(long, default_value_t = 65536)]
        max_bytes: u64,
    },
    /// One sample of its CPU, memory and disk, taken now by its edge; for a VM also its
    /// VMM and the accelerator its guest runs under. With `--since`: its history kept by
    /// the edge (a point every 5 s while it runs, the last 8 h).
    Metrics {
        id: String,
        /// The points of this last span: `90s`, `10m`, `2h` (at most 8h are kept).
        #[arg(long, value_parser = parse_span)]
        since: Option<u64>,
    },
    /// Pauses it: a container freezes with its memory, a microVM's memory is saved. With
    /// --filesystem (containers) only its file system is kept: its processes end and give
    /// their memory back, and its resume boots it again (the next call resumes it).
    Pause {
        id: String,
        #[arg(long)]
        filesystem: bool,
    },
    /// Resumes it where it was; with --cold (containers) it boots again from its file
    /// system instead, dropping the memory its pause kept.
    Resume {
        id: String,
        #[arg(long)]
        cold: bool,
    },
    /// Takes a snapshot (a container's file system; a microVM's memory, device state and
    /// disk) and waits until its edge has taken it. Start sandboxes from it with
    /// `sandbox create --image <snapshot id>`.
    Snapshot {
        id: String,
        #[arg(long)]
        name: Option<String>,
        /// Return as soon as it is logged (pending), without waiting for the edge.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the edge at most.
        #[arg(long, default_value_t = 300)]
        wait_seconds: u64,
    },
    /// Makes an image of a container sandbox: its writable layer on top of its image, made
    /// and kept by its edge, and waits until it is made. Left out: the agent's files, what
    /// /tmp, /var/tmp and /run hold, shell histories, caches, and every --scrub path.
    /// Start sandboxes (or E2B templates) from it with `sandbox create --image <NAME>`.
    Pack {
        id: String,
        /// The image's name (in the sandbox's project).
        #[arg(long)]
        name: String,
        /// An absolute path to leave out too (a file, or a directory with all it holds);
        /// repeat for several.
        #[arg(long = "scrub", value_name = "PATH")]
        scrub: Vec<String>,
        /// Return as soon as it is logged (pending), without waiting for the edge.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the edge at most.
        #[arg(long, default_value_t = 1800)]
        wait_seconds: u64,
    },
    /// Clones a live sandbox --count times (on its edge while it has room, else on others,
    /// which pull its state from its edge).
    Fork {
        id: String,
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// Place every copy on this edge.
        #[arg(long)]
        edge: Option<String>,
    },
    /// Sets the lifetime from now; 0 removes it.
    SetTimeout {
        id: String,
        seconds: u64,
    },
    /// What the sandbox may reach: `network get ID`, `network set ID --allow-out ...`.
    #[command(subcommand)]
    Network(SandboxNetworkCmd),
    /// Replaces every label.
    SetLabels {
        id: String,
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// Runs a command in the sandbox, streaming its output; exits with its exit code.
    ///
    /// The first word is the program, the rest its arguments; there is no shell
    /// unless you ask for one: `opendsecctl sandbox exec ID -- sh -c 'ls | wc -l'`.
    Exec {
        id: String,
        /// The user in the sandbox (default: the sandbox's default user).
        #[arg(long)]
        user: Option<String>,
        /// KEY=VALUE; repeat for several.
        #[arg(long = "env", value_parser = parse_label)]
        envs: Vec<(String, String)>,
        /// Working directory (default: the user's home).
        #[arg(long)]
        cwd: Option<String>,
        /// The program and its arguments (after `--`).
        #[arg(
            required = true,
            trailing_var_arg = true,
            allow_hyphen_values = true,
            value_name = "CMD"
        )]
        command: Vec<String>,
    },
    /// An interactive shell on a terminal in the sandbox (exits with the shell's code).
    Shell {
        id: String,
        #[arg(long)]
        user: Option<String>,
        /// The program to run.
        #[arg(long, default_value = "/bin/bash")]
        cmd: String,
    },
    /// Copies a file into or out of a sandbox: one side is ID:PATH, the other a local
    /// path (`-` for stdin/stdout).
    Cp {
        src: String,
        dst: String,
        #[arg(long)]
        user: Option<String>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum CpuClassArg {
    LatencySensitive,
    BestEffort,
}

impl From<CpuClassArg> for CpuClass {
    fn from(c: CpuClassArg) -> CpuClass {
        match c {
            CpuClassArg::LatencySensitive => CpuClass::LatencySensitive,
            CpuClassArg::BestEffort => CpuClass::BestEffort,
        }
    }
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum IsolationArg {
    Container,
    Microvm,
    Vm,
}

impl From<IsolationArg> for Isolation {
    fn from(i: IsolationArg) -> Isolation {
        match i {
            IsolationArg::Container => Isolation::Container,
            IsolationArg::Microvm => Isolation::Microvm,
            IsolationArg::Vm => Isolation::Vm,
        }
    }
}

#[derive(Subcommand)]
pub(crate) enum SnapshotCmd {
    /// Snapshots in your project subtree.
    List {
        /// Only those of this sandbox.
        #[arg(long)]
        sandbox: Option<String>,
    },
    Get {
        id: String,
    },
    /// Deletes it (sandboxes started from it run on).
    Delete {
        id: String,
    },
}

#[derive(Subcommand)]
pub(crate) enum ImageCmd {
    /// Registers an image and has an edge pull it, showing the pull's progress.
    /// REFERENCE is [registry[:port]/]repository[:tag][@sha256:digest]; without a
    /// registry, Docker Hub. A registry on loopback is spoken to over plain HTTP; other
    /// plain-HTTP registries, and credentials, are set on the edges (opendsec edge
    /// --insecure-registry, --registry-auth).
    Pull {
        reference: String,
        /// The name sandboxes start it by (default: REFERENCE).
        #[arg(long)]
        name: Option<String>,
        /// The project it belongs to (default: the token's); its descendants use it too.
        #[arg(long)]
        project: Option<String>,
        /// The edge that pulls it (default: one chosen).
        #[arg(long)]
        edge: Option<String>,
        /// Return once it is registered, without waiting for the pull.
        #[arg(long)]
        no_wait: bool,
        /// How long to wait for the pull.
        #[arg(long, default_value_t = 1800)]
        wait_seconds: u64,
    },
    /// Imports an image from a tarball on this machine: a docker-archive (`docker save`,
    /// `skopeo copy … docker-archive:FILE`) or an OCI image layout (`skopeo copy …
    /// oci-archive:FILE`), gzipped or not. It is uploaded to one edge (showing progress),
    /// which verifies and stores it; sandboxes start from it there, by NAME.
    Import {
        /// The tarball.
        file: std::path::PathBuf,
        /// The name sandboxes start it by.
        #[arg(long)]
        name: String,
        /// The project it belongs to (default: the token's); its descendants use it too.
        #[arg(long)]
        project: Option<String>,
        /// The edge that imports and keeps it (default: one chosen).
        #[arg(long)]
        edge: Option<String>,
    },
    /// Pushes an image (pulled, imported, packed, e.g. by `sandbox pack`, or built-in) to an
    /// OCI registry as REFERENCE, registry[:port]/repository[:tag]; prints the digest. A
    /// registry on loopback is spoken to over plain HTTP; credentials and other plain-HTTP
    /// registries are set on the edges (opendsec edge --registry-auth, --insecure-registry).
    Push {
        name: String,
        reference: String,
    },
    /// Images your sandboxes can start from (your subtree's and your ancestors').
    /// The built-in images busybox, base, code-interpreter-v1 and mcp-gateway are not listed.
    List,
    Get {
        name: String,
    },
    /// Removes an image's name: creates of it fail from then on; running sandboxes keep it.
    /// Its layers and VM disks are collected once nothing uses them.
    Rm {
        name: String,
    },
    /// Collects every edge's image store now: layers, VM disks and scratch space that no
    /// image, sandbox, snapshot, fork or warm container uses (root project, edge:write).
    Prune,
}

#[derive(Subcommand)]
pub(crate) enum TaskCmd {
    /// Pauses every running sandbox labelled task=<TASK> (containers freeze, microVMs
    /// snapshot and end their VMM), in one logged call.
    Pause { task: String },
    /// Resumes every paused sandbox labelled task=<TASK>.
    Resume { task: String },
}

#[derive(Subcommand)]
pub(crate) enum EdgeCmd {
    /// Edges with capacity, assignment and last heartbeat.
    List,
    /// Registers an edge (or updates its address, capacity and labels).
    Register {
        #[arg(long)]
        edge: String,
        #[arg(long)]
        address: String,
        #[arg(long)]
        sandboxes: u64,
        #[arg(long)]
        cpu_millis: u64,
        #[arg(long)]
        memory_mb: u64,
        #[arg(long = "label", value_parser = parse_label)]
        labels: Vec<(String, String)>,
    },
    /// Stops placing sandboxes on an edge.
    Deregister { id: String },
}

#[derive(Args)]
pub(crate) struct AuditArgs {
    /// token:<id> or a token id.
    #[arg(long)]
    pub(crate) principal: Option<String>,
    #[arg(long)]
    pub(crate) project: Option<String>,
    /// e.g. sandbox.create
    #[arg(long)]
    pub(crate) action: Option<String>,
    #[arg(long)]
    pub(crate) target: Option<String>,
    /// RFC 3339 or ms since the epoch.
    #[arg(long)]
    pub(crate) since: Option<String>,
    #[arg(long)]
    pub(crate) until: Option<String>,
    /// Records per page (default 100, at most 1000).
    #[arg(long)]
    pub(crate) limit: Option<u64>,
    /// Start after this log index (the `next` of a previous page).
    #[arg(long)]
    pub(crate) after: Option<u64>,
    /// Follow the pages to the end.
    #[arg(long)]
    pub(crate) all: bool,
}

#[derive(Args)]
pub(crate) struct ReplayArgs {
    /// A log index or an RFC 3339 time.
    #[arg(long)]
    pub(crate) to: String,
    /// sandboxes, placement, quota, iam or audit (default: all).
    #[arg(long)]
    pub(crate) view: Option<String>,
    /// List the changes from this index or time to --to.
    #[arg(long)]
    pub(crate) diff_from: Option<String>,
}

pub(crate) fn parse_label(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("{s:?} is not key=value"))
}

/// A span of time as `<n>s`, `<n>m` or `<n>h`, in milliseconds.
pub fn parse_span(v: &str) -> Result<u64, String> {
    let bad = || format!("{v:?} is not a span like 90s, 10m or 2h");
    let unit = v.chars().last().ok_or_else(bad)?;
    let per = match unit {
        's' => 1000,
        'm' => 60_000,
        'h' => 3_600_000,
        _ => return Err(bad()),
    };
    let n: u64 = v[..v.len() - 1].parse().map_err(|_| bad())?;
    n.checked_mul(per).filter(|ms| *ms > 0).ok_or_else(bad)
}

/// A retention as seconds: `0`, or a count of `s`, `m`, `h` or `d`.
pub fn parse_keep(v: &str) -> Result<u64, String> {
    if v == "0" {
        return Ok(0);
    }
    let bad = || format!("{v:?} is not a duration like 0, 90s, 10m, 2h or 7d");
    let unit = v.chars().last().ok_or_else(bad)?;
    let per = match unit {
        's' => 1,
        'm' => 60,
        'h' => 3600,
        'd' => 86_400,
        _ => return Err(bad()),
    };
    let n: u64 = v[..v.len() - 1].parse().map_err(|_| bad())?;
    n.checked_mul(per).ok_or_else(bad)
}

#[cfg(test)]
mod tests {
    use super::{parse_keep, parse_span};

    #[test]
    fn a_retention_is_zero_or_seconds_minutes_hours_or_days() {
        assert_eq!(parse_keep("0"), Ok(0));
        assert_eq!(parse_keep("90s"), Ok(90));
        assert_eq!(parse_keep("2h"), Ok(7200));
        assert_eq!(parse_keep("30d"), Ok(30 * 86_400));
        for bad in ["", "d", "10", "10w", "-1d", "1.5d", "99999999999999999d"] {
            assert!(parse_keep(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn a_span_is_seconds_minutes_or_hours() {
        assert_eq!(parse_span("90s"), Ok(90_000));
        assert_eq!(parse_span("10m"), Ok(600_000));
        assert_eq!(parse_span("2h"), Ok(7_200_000));
        for bad in ["", "m", "10", "10d", "-1m", "0s", "1.5h", "99999999999999999h"] {
            assert!(parse_span(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
