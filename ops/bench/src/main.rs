//! `opendsec-bench log`: append commit latency and throughput of the replicated log
//! beside a raw durable redb commit and etcd. See `opendsec_bench::targets::log_targets`.
//! `opendsec-bench sandboxes`: container sandboxes through the REST API of a real
//! `opendsec up`, beside raw `crun run`. See `opendsec_bench::sandboxes`.
//! `opendsec-bench images`: a ~500 MB OCI image through a real `opendsec up`, beside
//! `skopeo copy` + `umoci unpack` + `crun run`. See `opendsec_bench::images`.
//! `opendsec-bench network`: container sandboxes' network through a real `opendsec up`
//! in namespaces of its own, beside the raw veth path. See `opendsec_bench::network`.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use clap::{Parser, Subcommand};
use opendsec_bench::report::{self, ReplayRow, Row};
use opendsec_bench::run_load;
use opendsec_bench::targets::{SetupCtx, log_targets};

#[derive(Parser)]
#[command(name = "opendsec-bench", about = "OpenDsec benchmarks")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Append commit latency/throughput: every target at every concurrency.
    Log(LogArgs),
    /// Container sandboxes through a real `opendsec up` (needs root, crun/runc, the
    /// release binaries and the static agent): create -> first exec output beside raw
    /// `crun run`/`runc run`, pause/resume latency, concurrent-create bursts.
    Sandboxes(SandboxArgs),
    /// A ~500 MB OCI image (made from the store's `base`) through a real `opendsec up`
    /// (needs root, docker-registry, skopeo, umoci, crun, the release binaries and the
    /// static agent): cold pull + create beside `skopeo copy` + `umoci unpack` + `crun
    /// run`, warm create beside `base`, the disk many sandboxes of it take.
    Images(ImageArgs),
    /// Container sandboxes' network through a real `opendsec up` run in an internet of
    /// network namespaces of the bench's own (needs root, crun/runc, nftables, iproute2,
    /// nsenter, iperf3, the release binaries and the static agent): policy update to
    /// enforcement both ways, iperf3 through the policy beside a raw veth path, DNS
    /// proxy answers beside a direct query, create -> first output with and without
    /// sandbox networking.
    Network(NetworkArgs),
    /// Internal: removes the sandbox network a stopped edge left, in this process's
    /// network namespace (`opendsec_edge::net::forget`); the benchmarks run it under
    /// `nsenter --net` for an `opendsec up` they ran in a namespace of their own.
    #[command(name = opendsec_bench::sandboxes::FORGET_NETWORK_CMD, hide = true)]
    ForgetNetwork {
        /// The edge's data directory (`<opendsec up --data-dir>/edge`).
        edge_data_dir: PathBuf,
    },
}

/// Where a benchmark that runs `opendsec up` finds its binaries and keeps its data.
#[derive(clap::Args)]
struct UpArgs {
    /// Where `opendsec up` keeps its data (removed afterwards) [default: ./target/bench-data].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The `opendsec` executable [default: $CARGO_TARGET_DIR/release/opendsec or target/release/opendsec].
    #[arg(long)]
    opendsec_bin: Option<PathBuf>,
    /// The static `opendsec-agent` [default: opendsec-agent next to the opendsec binary].
    #[arg(long)]
    agent: Option<PathBuf>,
    /// The image store (`opendsec up --image-dir`).
    #[arg(long, env = "OPENDSEC_IMAGE_DIR", default_value = "/var/lib/opendsec/images")]
    image_dir: PathBuf,
}

#[derive(clap::Args)]
struct ImageArgs {
    /// Cold runs (each pulls the whole image three times: two ways through OpenDsec, once
    /// with the raw tools); medians are printed.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Warm create -> first output runs per image (the pulled one and base, interleaved; 0: skip).
    #[arg(long, default_value_t = 20)]
    warm_runs: usize,
    /// Sandboxes of the image run at once for the disk measurement (0: skip it).
    #[arg(long, default_value_t = 100)]
    sandboxes: usize,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    up: UpArgs,
}

#[derive(clap::Args)]
struct NetworkArgs {
    /// Policy updates each way (p50/p99), and DNS queries of each kind.
    #[arg(long, default_value_t = 50)]
    runs: usize,
    /// Create -> first output runs with sandbox networking, and as many without.
    #[arg(long, default_value_t = 20)]
    create_runs: usize,
    /// iperf3 rounds (each: sandbox and raw path, both ways; medians are printed).
    #[arg(long, default_value_t = 3)]
    iperf_rounds: usize,
    /// Seconds of each iperf3 test (`iperf3 -t`).
    #[arg(long, default_value_t = 5)]
    iperf_seconds: u32,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    #[command(flatten)]
    up: UpArgs,
}

#[derive(clap::Args)]
struct SandboxArgs {
    /// Measured create -> first output runs (and raw runtime runs).
    #[arg(long, default_value_t = 50)]
    runs: usize,
    /// Pause/resume rounds.
    #[arg(long, default_value_t = 20)]
    pause_runs: usize,
    /// Comma-separated burst sizes (concurrent creates); empty to skip.
    #[arg(long, value_delimiter = ',', default_value = "200,1000")]
    bursts: Vec<usize>,
    /// Image of every sandbox.
    #[arg(long, default_value = "busybox")]
    image: String,
    #[command(flatten)]
    up: UpArgs,
    /// Seconds a burst may take to have every sandbox running or failed.
    #[arg(long, default_value_t = 240)]
    burst_timeout: u64,
    /// Skip the raw `runc run` baseline.
    #[arg(long)]
    skip_runc: bool,
}

#[derive(clap::Args)]
struct LogArgs {
    /// Measured ops per (target, concurrency) [default: 2000 at concurrency 1, else 10000].
    #[arg(long)]
    ops: Option<usize>,
    /// Payload bytes per append.
    #[arg(long, default_value_t = 256)]
    payload: usize,
    /// Comma-separated concurrency levels.
    #[arg(long, value_delimiter = ',', default_value = "1,16,256")]
    concurrency: Vec<usize>,
    /// Where targets keep their data (same disk as the system under test)
    /// [default: ./target/bench-data].
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Skip the etcd baselines.
    #[arg(long)]
    skip_etcd: bool,
    /// Run only targets whose name contains this (repeatable).
    #[arg(long)]
    only: Vec<String>,
    /// etcd executable.
    #[arg(long, default_value = "etcd")]
    etcd_bin: String,
    /// Target options, key=value (repeatable).
    #[arg(long = "opt", value_parser = parse_kv)]
    opts: Vec<(String, String)>,
    /// Measurement rounds: every target is set up first, then each round measures every
    /// target at every concurrency (in a rotated order), and each figure is the median
    /// round's, so that a machine whose speed drifts affects all targets alike.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Encoded batches the in-process replay folds (0: skip it).
    #[arg(long, default_value_t = 200_000)]
    replay_batches: usize,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

fn parse_kv(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .ok_or_else(|| format!("expected key=value, got {s:?}"))
}

#[tokio::main]
async fn main() {
    let cli = Cli::parse();
    let code = match cli.cmd {
        Cmd::Log(a) => run_log(a).await,
        Cmd::Sandboxes(a) => run_sandboxes(a).await,
        Cmd::Images(a) => run_images(a).await,
        Cmd::Network(a) => run_network(a).await,
        Cmd::ForgetNetwork { edge_data_dir } => {
            opendsec_bench::sandboxes::forget_network_here(&edge_data_dir);
            0
        }
    };
    std::process::exit(code);
}

/// What `opendsec up` runs with, resolved: (data dir, opendsec, agent).
fn resolve_up(a: &UpArgs, subcommand: &str) -> Result<(PathBuf, PathBuf, PathBuf), String> {
    let cwd = std::env::current_dir().expect("cwd");
    let data_dir = a
        .data_dir
        .clone()
        .unwrap_or_else(|| cwd.join("target").join("bench-data"));
    let data_dir = if data_dir.is_absolute() {
        data_dir
    } else {
        cwd.join(data_dir)
    };
    let bin = match a.opendsec_bin.clone() {
        Some(b) => b,
        None => {
            let ctx = SetupCtx {
                data_dir: data_dir.clone(),
                payload_len: 0,
                etcd_bin: String::new(),
                opts: BTreeMap::new(),
            };
            opendsec_bench::opendsec::find_bin(&ctx)?
        }
    };
    let agent = a.agent.clone().unwrap_or_else(|| bin.with_file_name("opendsec-agent"));
    for (what, p) in [("opendsec", &bin), ("agent", &agent)] {
        if !p.is_file() {
            return Err(format!(
                "the {what} binary {} does not exist (ops/bench.sh {subcommand} builds it)",
                p.display()
            ));
        }
    }
    Ok((data_dir, bin, agent))
}

/// This host, for the report: cores, memory in GiB, the 1-minute load average.
fn host_info() -> (usize, f64, String) {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load1 = load.split_whitespace().next().unwrap_or("?").to_string();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let mem_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .next()
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse::<f64>().ok())
        })
        .map(|kb| kb / 1048576.0)
        .unwrap_or(0.0);
    (cores, mem_gib, load1)
}

async fn run_images(a: ImageArgs) -> i32 {
    let (data_dir, bin, agent) = match resolve_up(&a.up, "images") {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    let (cores, mem_gib, load1) = host_info();
    eprintln!(
        "opendsec-bench images: {} cold runs, {} warm runs, {} sandboxes; {cores} cores, {mem_gib:.1} GiB, load {load1}; data under {}, store {}",
        a.runs,
        a.warm_runs,
        a.sandboxes,
        data_dir.display(),
        a.up.image_dir.display()
    );
    let started = Instant::now();
    let o = opendsec_bench::images::Options {
        runs: a.runs,
        warm_runs: a.warm_runs,
        sandboxes: a.sandboxes,
        data_dir,
        opendsec_bin: bin,
        agent_bin: agent,
        image_dir: a.up.image_dir.clone(),
    };
    let r = match until_signal(
        opendsec_bench::images::run(o),
        opendsec_bench::sandboxes::emergency_teardown,
    )
    .await
    {
        Ok(r) => r,
        Err(code) => return code,
    };
    println!();
    println!(
        "images (sandboxes: memory_mb 64, cpu_millis 100, 64 MB disk; {cores} cores, {mem_gib:.1} GiB, load average {load1} at start; {:.0} s total):",
        started.elapsed().as_secs_f64()
    );
    print!("{}", r.summary());
    if let Some(p) = &a.json
        && let Err(e) = std::fs::write(p, serde_json::to_string_pretty(&r.json()).unwrap())
    {
        eprintln!("cannot write {p:?}: {e}");
        return 1;
    }
    if r.failed() { 1 } else { 0 }
}

async fn run_network(a: NetworkArgs) -> i32 {
    let (data_dir, bin, agent) = match resolve_up(&a.up, "network") {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    let (cores, mem_gib, load1) = host_info();
    eprintln!(
        "opendsec-bench network: {} policy updates each way and DNS queries, {} creates per mode, {} iperf3 round(s) of {} s; {cores} cores, {mem_gib:.1} GiB, load {load1}; data under {}, store {}",
        a.runs,
        a.create_runs,
        a.iperf_rounds,
        a.iperf_seconds,
        data_dir.display(),
        a.up.image_dir.display()
    );
    let started = Instant::now();
    let o = opendsec_bench::network::Options {
        runs: a.runs,
        create_runs: a.create_runs,
        iperf_rounds: a.iperf_rounds,
        iperf_seconds: a.iperf_seconds,
        data_dir,
        opendsec_bin: bin,
        agent_bin: agent,
        image_dir: a.up.image_dir.clone(),
    };
    let r = match until_signal(
        opendsec_bench::network::run(o),
        opendsec_bench::network::emergency_teardown,
    )
    .await
    {
        Ok(r) => r,
        Err(code) => return code,
    };
    println!();
    println!(
        "network (busybox sandboxes, opendsec up --microvm off in a namespace of its own, default --warm-sandboxes 2; {cores} cores, {mem_gib:.1} GiB, load average {load1} at start; {:.0} s total):",
        started.elapsed().as_secs_f64()
    );
    print!("{}", r.summary());
    if let Some(p) = &a.json
        && let Err(e) = std::fs::write(p, serde_json::to_string_pretty(&r.json()).unwrap())
    {
        eprintln!("cannot write {p:?}: {e}");
        return 1;
    }
    if r.failed() { 1 } else { 0 }
}

async fn run_sandboxes(a: SandboxArgs) -> i32 {
    let (data_dir, bin, agent) = match resolve_up(&a.up, "sandboxes") {
        Ok(r) => r,
        Err(e) => {
            eprintln!("{e}");
            return 2;
        }
    };
    let (cores, mem_gib, load1) = host_info();
    eprintln!(
        "opendsec-bench sandboxes: image {}, {} runs, bursts {:?}; {cores} cores, {mem_gib:.1} GiB, load {load1}; data under {}",
        a.image,
        a.runs,
        a.bursts,
        data_dir.display()
    );
    let started = Instant::now();
    let o = opendsec_bench::sandboxes::Options {
        runs: a.runs,
        pause_runs: a.pause_runs,
        bursts: a.bursts.iter().copied().filter(|n| *n > 0).collect(),
        image: a.image.clone(),
        data_dir: data_dir.clone(),
        opendsec_bin: bin,
        agent_bin: agent,
        image_dir: a.up.image_dir.clone(),
        burst_timeout: std::time::Duration::from_secs(a.burst_timeout),
        skip_runc: a.skip_runc,
    };
    let r = match until_signal(
        opendsec_bench::sandboxes::run(o),
        opendsec_bench::sandboxes::emergency_teardown,
    )
    .await
    {
        Ok(r) => r,
        Err(code) => return code,
    };
    println!();
    println!(
        "sandboxes ({}, memory_mb 64, cpu_millis 100, 64 MB disk; {cores} cores, {mem_gib:.1} GiB, load average {load1} at start; {:.0} s total):",
        a.image,
        started.elapsed().as_secs_f64()
    );
    for l in &r.lines {
        println!("  {l}");
    }
    let left = opendsec_bench::sandboxes::mounts_under(&data_dir);
    if !left.is_empty() {
        println!("  WARNING: mounts left under {}: {left:?}", data_dir.display());
        return 1;
    }
    if r.failed { 1 } else { 0 }
}

async fn run_log(a: LogArgs) -> i32 {
    let data_dir = a
        .data_dir
        .clone()
        .unwrap_or_else(|| std::env::current_dir().expect("cwd").join("target").join("bench-data"));
    if let Err(e) = std::fs::create_dir_all(&data_dir) {
        eprintln!("cannot create {data_dir:?}: {e}");
        return 2;
    }
    let ctx = SetupCtx {
        data_dir: data_dir.clone(),
        payload_len: a.payload,
        etcd_bin: a.etcd_bin.clone(),
        opts: a.opts.iter().cloned().collect::<BTreeMap<_, _>>(),
    };
    let specs: Vec<_> = log_targets()
        .into_iter()
        .filter(|s| !(a.skip_etcd && s.family.starts_with("etcd")))
        .filter(|s| a.only.is_empty() || a.only.iter().any(|o| s.name.contains(o.as_str())))
        .collect();
    eprintln!(
        "opendsec-bench log: payload {} B, concurrency {:?}, data dir {}",
        a.payload,
        a.concurrency,
        data_dir.display()
    );
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load1 = load.split_whitespace().next().unwrap_or("?").to_string();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    eprintln!("host: {cores} cores, 1-min load average {load1} at start");
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut replays = Vec::new();
    let mut failed = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    if a.replay_batches > 0 {
        let n = a.replay_batches;
        eprintln!("== replay, in process: building {n} encoded batches, then one fold from an empty state");
        match tokio::task::spawn_blocking(move || opendsec_bench::fold::run(n)).await {
            Ok(Ok(f)) => {
                let eps = f.batches as f64 / f.fold_time.as_secs_f64().max(1e-9);
                eprintln!(
                    "   folded {} batches ({:.1} MB) in {} ({} events/s); building them took {}",
                    f.batches,
                    f.bytes as f64 / 1e6,
                    report::fmt_dur(f.fold_time),
                    report::fmt_rate(eps),
                    report::fmt_dur(f.build_time)
                );
                replays.push(ReplayRow {
                    name: format!(
                        "opendsec replay::fold in process (decode+check+apply, 1 event per batch, {:.0} B/batch avg, no IO)",
                        f.bytes as f64 / f.batches.max(1) as f64
                    ),
                    events: f.batches,
                    elapsed: f.fold_time,
                    events_per_sec: eps,
                    pure_fold: true,
                    note: None,
                });
            }
            Ok(Err(e)) => failed.push(format!("in-process replay: {e}")),
            Err(e) => failed.push(format!("in-process replay panicked: {e}")),
        }
    }
    // Every target is up at once; the rounds then measure them in turn.
    let mut sessions = Vec::new();
    for spec in &specs {
        eprintln!(
            "== {} ({} member{}): setting up",
            spec.name,
            spec.members,
            if spec.members == 1 { "" } else { "s" }
        );
        match (spec.setup)(ctx.clone()).await {
            Ok(s) => {
                if let Some(n) = &s.note
                    && !notes.contains(n)
                {
                    notes.push(n.clone());
                }
                sessions.push((spec, s));
            }
            Err(e) => {
                eprintln!("   setup failed: {e}");
                failed.push(format!("{} ({} members): setup failed: {e}", spec.name, spec.members));
            }
        }
    }
    let rounds = a.rounds.max(1);
    let mut measured: BTreeMap<(usize, usize), Vec<opendsec_bench::load::LoadReport>> = BTreeMap::new();
    for round in 0..rounds {
        for &c in &a.concurrency {
            let ops = a.ops.unwrap_or(if c <= 1 { 2_000 } else { 10_000 });
            // A rotated order each round: no target always runs first or last.
            for k in 0..sessions.len() {
                let i = (k + round) % sessions.len();
                let (spec, session) = &sessions[i];
                let r = run_load(session.target.clone(), c, ops, a.payload).await;
                eprintln!(
                    "   round {}/{rounds} {} ({}) c={c}: {} ops/s, p50 {}, p99 {}, errors {}{}",
                    round + 1,
                    spec.name,
                    spec.members,
                    report::fmt_rate(r.ops_per_sec),
                    report::fmt_dur(r.p50),
                    report::fmt_dur(r.p99),
                    r.errors,
                    r.first_error
                        .as_deref()
                        .map(|e| format!(" (first: {e})"))
                        .unwrap_or_default()
                );
                measured.entry((i, c)).or_default().push(r);
            }
        }
    }
    for (i, (spec, _)) in sessions.iter().enumerate() {
        for &c in &a.concurrency {
            let Some(mut runs) = measured.remove(&(i, c)) else {
                continue;
            };
            // The median round: by p50 at concurrency 1 (latency is the figure there),
            // else by throughput.
            if c <= 1 {
                runs.sort_by_key(|r| r.p50);
            } else {
                runs.sort_by(|x, y| x.ops_per_sec.total_cmp(&y.ops_per_sec));
            }
            // Errors count over every round (the table shows errors/ops of all of them).
            let (errors, ops) = runs.iter().fold((0, 0), |(e, o), r| (e + r.errors, o + r.ops));
            let mut r = runs.swap_remove(runs.len() / 2);
            (r.errors, r.ops) = (errors, ops);
            rows.push(Row {
                target: spec.name.clone(),
                members: spec.members,
                family: spec.family.to_string(),
                report: r,
            });
        }
    }
    for (_, session) in &sessions {
        if let Some(rp) = &session.replay {
            let t0 = Instant::now();
            match rp.replay().await {
                Ok(n) => {
                    let el = t0.elapsed();
                    eprintln!("   replay {}: {n} in {}", rp.name(), report::fmt_dur(el));
                    replays.push(ReplayRow {
                        name: rp.name(),
                        events: n,
                        elapsed: el,
                        events_per_sec: n as f64 / el.as_secs_f64().max(1e-9),
                        pure_fold: false,
                        note: rp.note(n),
                    });
                }
                Err(e) => failed.push(format!("{}: replay failed: {e}", rp.name())),
            }
        }
    }
    drop(sessions); // tears the targets down (stops processes, deletes data)
    println!();
    println!(
        "payload {} B; latency = issue to durable acknowledgement; warm-up excluded; \
         each figure is the median of {} rounds (all targets up together, measured in turn); \
         {cores} cores, load average {load1} at start",
        a.payload,
        a.rounds.max(1)
    );
    print!("{}", report::table(&rows));
    println!(
        "note: the members of a cluster share this host: each runs with its share of the {cores} cores \
         ({} thread(s) each for 3 members, {} for 1), opendsec as --worker-threads, etcd as GOMAXPROCS, \
         as if each had a machine of its own",
        opendsec_bench::member_threads(3),
        opendsec_bench::member_threads(1)
    );
    for n in &notes {
        println!("note: {n}");
    }
    println!();
    println!("goals (measured here, {:.0} s total):", started.elapsed().as_secs_f64());
    print!("{}", report::goals(&rows, &replays));
    for f in &failed {
        println!("FAILED: {f}");
    }
    if let Some(p) = &a.json {
        let v = serde_json::json!({ "payload": a.payload, "rows": rows, "replay": replays, "failed": failed });
        if let Err(e) = std::fs::write(p, serde_json::to_string_pretty(&v).unwrap()) {
            eprintln!("cannot write {p:?}: {e}");
        }
    }
    if failed.is_empty() && rows.iter().all(|r| r.report.errors == 0) {
        0
    } else {
        1
    }
}

/// Runs a benchmark that starts sandboxes; on Ctrl-C or SIGTERM it tears down what the
/// run started (`teardown`) and gives the exit code to end with (130, 143).
async fn until_signal<T>(run: impl std::future::Future<Output = T>, teardown: fn()) -> Result<T, i32> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM handler");
    let code = tokio::select! {
        r = run => return Ok(r),
        _ = tokio::signal::ctrl_c() => 130,
        _ = term.recv() => 143,
    };
    teardown();
    Err(code)
}
