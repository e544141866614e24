//! Runs one template build on this node, as the caller who started it: a container
//! sandbox of the build's base (`fromImage` or `fromTemplate`), each step in it through
//! its agent (RUN as a login shell, COPY by unpacking the uploaded archive with the
//! image's own `tar`, ENV/WORKDIR/USER kept for the steps after them and for the image),
//! the start command started and the ready command awaited, then `PackSandbox` with the
//! config the steps set, and the build reported ready or failed (with the step E2B's SDK
//! points at: `base`, the step's number from 1, or `finalize`). The sandbox is killed
//! however the build ends. Output lines go to the build's log.

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode, Uri, header};
use base64::Engine;
use opendsec_commands::{Command, SandboxOptions};
use opendsec_control::{Principal, SandboxTokenKind};
use opendsec_projections::{ConfigOverride, ImageState, Observed, Template};
use serde_json::{Map, Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use super::api::{E2bError, R, submit};
use crate::AppState;

/// How long a build's sandbox may take to start (a pull of its base included).
const START_WAIT: Duration = Duration::from_secs(30 * 60);
/// How long its image may take to pack.
const PACK_WAIT: Duration = Duration::from_secs(30 * 60);
/// How long the ready command may take to succeed.
const READY_WAIT: Duration = Duration::from_secs(10 * 60);
/// A build's sandbox lives at most this long.
const SANDBOX_SECONDS: u64 = 6 * 3600;
/// The user steps run as until a USER step says otherwise (E2B's).
const DEFAULT_USER: &str = "user";
/// Where E2B's default base image points.
const E2B_BASE: &str = "e2bdev/base";
/// The most bytes of one output line kept in the log.
const MAX_LINE: usize = 4096;

/// One step, as E2B's SDK sends it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    Run {
        cmd: String,
        user: Option<String>,
    },
    Copy {
        src: String,
        dest: String,
        owner: String,
        mode: String,
        hash: String,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

/// A build's start body (`TemplateBuildStartV2`), checked.
#[derive(Clone, Debug)]
pub struct Plan {
    /// What the build's sandbox is created from (an image name or reference, or a
    /// template's `name[:tag]`).
    pub from: String,
    pub steps: Vec<Step>,
    pub start_cmd: Option<String>,
    pub ready_cmd: Option<String>,
}

fn strings(v: &Value, field: &str) -> R<Vec<String>> {
    match v {
        Value::Null => Ok(vec![]),
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| E2bError::bad(format!("{field} must be a list of strings")))
            })
            .collect(),
        _ => Err(E2bError::bad(format!("{field} must be a list of strings"))),
    }
}

impl Plan {
    pub fn parse(st: &AppState, who: &Principal, m: &Map<String, Value>) -> R<Plan> {
        let text = |k: &str| -> R<Option<String>> {
            match m.get(k) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(_) => Err(E2bError::bad(format!("{k} must be a string"))),
            }
        };
        if m.get("fromImageRegistry").is_some_and(|v| !v.is_null()) {
            return Err(E2bError::bad(
                "fromImageRegistry: per-build registry credentials are not supported; the edges pull with \
                 their own (opendsec edge --registry-auth <docker config.json>)",
            ));
        }
        let from = match (text("fromImage")?, text("fromTemplate")?) {
            (Some(_), Some(_)) => return Err(E2bError::bad("give fromImage or fromTemplate, not both")),
            (Some(image), None) => image_name(st, who, &image),
            (None, Some(t)) => t,
            (None, None) => "base".to_string(),
        };
        let raw = match m.get("steps") {
            None | Some(Value::Null) => vec![],
            Some(Value::Array(a)) => a.clone(),
            Some(_) => return Err(E2bError::bad("steps must be a list")),
        };
        let mut steps = Vec::with_capacity(raw.len());
        for (n, s) in raw.iter().enumerate() {
            let field = format!("steps[{n}]");
            let ty = s.get("type").and_then(Value::as_str).unwrap_or_default();
            let args = strings(s.get("args").unwrap_or(&Value::Null), &format!("{field}.args"))?;
            let arity = |ok: bool, what: &str| -> R<()> {
                if ok {
                    Ok(())
                } else {
                    Err(E2bError::bad(format!("{field}: {ty} takes {what}")))
                }
            };
            steps.push(match ty {
                "RUN" => {
                    arity(
                        (1..=2).contains(&args.len()) && !args[0].trim().is_empty(),
                        "a command and maybe a user",
                    )?;
                    Step::Run {
                        cmd: args[0].clone(),
                        user: args.get(1).filter(|u| !u.is_empty()).cloned(),
                    }
                }
                "COPY" => {
                    arity(
                        args.len() >= 2 && !args[1].is_empty(),
                        "a source, a destination, an owner and a mode",
                    )?;
                    let hash = s
                        .get("filesHash")
                        .and_then(Value::as_str)
                        .ok_or_else(|| E2bError::bad(format!("{field}: COPY needs its filesHash")))?
                        .to_string();
                    let mode = args.get(3).cloned().unwrap_or_default();
                    if !mode.is_empty() && (mode.len() > 4 || !mode.bytes().all(|b| (b'0'..=b'7').contains(&b))) {
                        return Err(E2bError::bad(format!(
                            "{field}: mode {mode:?} must be octal, e.g. 0755"
                        )));
                    }
                    Step::Copy {
                        src: args[0].clone(),
                        dest: args[1].clone(),
                        owner: args.get(2).cloned().unwrap_or_default(),
                        mode,
                        hash,
                    }
                }
                "ENV" => {
                    arity(!args.is_empty() && args.len() % 2 == 0, "names and values in pairs")?;
                    let pairs: Vec<(String, String)> = args.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
                    let env: BTreeMap<String, String> = pairs.iter().cloned().collect();
                    opendsec_commands::validate::env(&format!("{field}.args"), &env)
                        .map_err(|r| E2bError::bad(r.message))?;
                    Step::Env(pairs)
                }
                "WORKDIR" => {
                    arity(args.len() == 1 && !args[0].is_empty(), "one path")?;
                    Step::Workdir(args[0].clone())
                }
                "USER" => {
                    arity(args.len() == 1 && !args[0].is_empty(), "one user")?;
                    Step::User(args[0].clone())
                }
                other => {
                    return Err(E2bError::bad(format!(
                        "{field}: step type {other:?} is not one of RUN, COPY, ENV, WORKDIR, USER"
                    )));
                }
            });
        }
        Ok(Plan {
            from,
            steps,
            start_cmd: text("startCmd")?,
            ready_cmd: text("readyCmd")?,
        })
    }
}

/// What `fromImage` names here: E2B's base is `base`; a name this cluster knows (built
/// in, registered, a template) or a reference naming its registry as it is; any other
/// name is Docker Hub's, as Docker reads it.
fn image_name(st: &AppState, who: &Principal, image: &str) -> String {
    if image == E2B_BASE || image.starts_with("e2bdev/base:") {
        return "base".into();
    }
    let (name, _) = image.split_once(':').unwrap_or((image, ""));
    let known = opendsec_commands::images::is_builtin(image)
        || opendsec_commands::images::names_a_registry(image)
        || st.node.read(|s| {
            s.images.images.contains_key(image)
                || s.images
                    .template_named(name)
                    .is_some_and(|t| s.within(&who.project, &t.project))
        });
    if known {
        image.to_string()
    } else if image.contains('/') {
        format!("docker.io/{image}")
    } else {
        format!("docker.io/library/{image}")
    }
}

/// A started build.
pub struct Run {
    pub template: Template,
    pub build: String,
    pub image: String,
    pub who: Principal,
    pub plan: Plan,
}

/// Why a build failed, and at which step (as E2B's SDK reads `reason.step`).
struct Failure {
    message: String,
    step: String,
}

fn at(step: impl Into<String>) -> impl FnOnce(String) -> Failure {
    let step = step.into();
    move |message| Failure { message, step }
}

/// Runs the build to its end and reports it; never panics the gateway.
pub async fn run(st: AppState, r: Run) {
    let mut sandbox = None;
    let result = build(&st, &r, &mut sandbox).await;
    if let Some(id) = &sandbox {
        let kill = Command::KillSandbox { sandbox: id.clone() };
        if let Err(e) = submit(&st, &r.who, &HeaderMap::new(), kill).await {
            tracing::warn!(sandbox = %id, error = %e.message, "a template build's sandbox was not killed");
        }
    }
    let (error, error_step) = match result {
        Ok(()) => {
            st.builds.log(
                &r.build,
                "info",
                Some("finalize"),
                format!("build ready: image {}", r.image),
            );
            (None, None)
        }
        Err(f) => {
            st.builds
                .log(&r.build, "error", Some(&f.step), format!("build failed: {}", f.message));
            (Some(f.message), Some(f.step))
        }
    };
    let finish = Command::FinishTemplateBuild {
        template: r.template.id.clone(),
        build: r.build.clone(),
        error: error.map(|e| fit(&e, 1000)),
        error_step,
    };
    if let Err(e) = submit(&st, &r.who, &HeaderMap::new(), finish).await {
        tracing::warn!(build = %r.build, error = %e.message, "a template build's end was not recorded");
    }
}

/// `s` cut to at most `max` bytes at a character boundary.
fn fit(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// The state the steps build up.
struct Context {
    env: BTreeMap<String, String>,
    workdir: Option<String>,
    user: String,
    user_set: bool,
}

impl Context {
    /// `path` against the working directory (a relative path without one is under `/`).
    fn absolute(&self, path: &str) -> String {
        if path.starts_with('/') {
            return path.to_string();
        }
        let base = self.workdir.as_deref().unwrap_or("/");
        let joined = format!("{}/{}", base.trim_end_matches('/'), path.trim_start_matches("./"));
        if path.ends_with('/') && !joined.ends_with('/') {
            format!("{joined}/")
        } else {
            joined
        }
    }
}

async fn build(st: &AppState, r: &Run, sandbox: &mut Option<String>) -> Result<(), Failure> {
    let log = |level: &'static str, step: &str, m: String| st.builds.log(&r.build, level, Some(step), m);
    let none = HeaderMap::new();
    log("info", "base", format!("starting a sandbox of {}", r.plan.from));
    let size = |given: u32, default: u64, per: u64| if given > 0 { given as u64 * per } else { default };
    // A build reaches the public internet (pip, npm, apt, as E2B's builds do) where its
    // project's ceiling allows it; under a ceiling of none it reaches nothing, and steps
    // that need the network fail with their own errors.
    let internet = st.node.read(|s| s.egress_ceiling(&r.template.project)) != opendsec_projections::Egress::None;
    let create = Command::CreateSandbox {
        project: r.template.project.clone(),
        image: r.plan.from.clone(),
        cpu_millis: size(r.template.cpu_count, crate::routes::sandboxes::DEFAULT_CPU_MILLIS, 1000),
        memory_mb: size(r.template.memory_mb, crate::routes::sandboxes::DEFAULT_MEMORY_MB, 1),
        labels: [(super::templates::BUILD_LABEL.to_string(), r.build.clone())].into(),
        timeout_seconds: Some(SANDBOX_SECONDS),
        opts: SandboxOptions {
            network: internet.then(|| r#"{"allow_internet_access":true}"#.to_string()),
            ..SandboxOptions::default()
        },
    };
    let created = submit(st, &r.who, &none, create).await.map_err(|e| Failure {
        message: format!("the build's sandbox was refused: {}", e.message),
        step: "base".into(),
    })?;
    let id = created.decided.target.clone();
    *sandbox = Some(id.clone());
    wait_running(st, &id).await.map_err(at("base"))?;
    log("info", "base", format!("sandbox {id} runs"));
    let mut cx = Context {
        env: BTreeMap::new(),
        workdir: None,
        user: DEFAULT_USER.into(),
        user_set: false,
    };
    for (n, step) in r.plan.steps.iter().enumerate() {
        let number = (n + 1).to_string();
        run_step(st, r, &id, &mut cx, step, &number)
            .await
            .map_err(at(number.clone()))?;
    }
    let start_user = cx.user.clone();
    if r.plan.start_cmd.is_some() || r.plan.ready_cmd.is_some() {
        check_start(st, r, &id, &cx, &start_user)
            .await
            .map_err(at("finalize"))?;
    }
    log("info", "finalize", format!("packing image {}", r.image));
    let config = ConfigOverride {
        env: cx.env.clone(),
        workdir: cx.workdir.clone().unwrap_or_default(),
        user: if cx.user_set { cx.user.clone() } else { String::new() },
        start_cmd: r.plan.start_cmd.clone().unwrap_or_default(),
        ready_cmd: r.plan.ready_cmd.clone().unwrap_or_default(),
    };
    let pack = Command::PackSandbox {
        sandbox: id.clone(),
        name: r.image.clone(),
        scrub: vec![],
        config: Some(config),
    };
    submit(st, &r.who, &none, pack).await.map_err(|e| Failure {
        message: format!("packing the image was refused: {}", e.message),
        step: "finalize".into(),
    })?;
    wait_image(st, &r.image).await.map_err(at("finalize"))
}

async fn run_step(st: &AppState, r: &Run, id: &str, cx: &mut Context, step: &Step, number: &str) -> Result<(), String> {
    let log = |m: String| st.builds.log(&r.build, "info", Some(number), m);
    match step {
        Step::Run { cmd, user } => {
            let user = user.clone().unwrap_or_else(|| cx.user.clone());
            log(format!("RUN {cmd} (as {user})"));
            let mut out = Lines::new(|line| st.builds.log(&r.build, "info", Some(number), line));
            let code = exec(st, id, &user, cmd, &cx.env, cx.workdir.as_deref(), &mut out).await?;
            out.flush();
            if code != 0 {
                return Err(format!("RUN {cmd}: exited with code {code}"));
            }
        }
        Step::Copy {
            src,
            dest,
            owner,
            mode,
            hash,
        } => {
            log(format!("COPY {src} {dest}"));
            let archive = st.builds.file_path(&r.template.id, hash);
            let (gzip, tops) = top_entries(&archive).await?;
            if tops.is_empty() {
                return Err(format!("COPY {src}: its archive holds no files"));
            }
            let inside = format!("/tmp/.opendsec-copy-{number}-{}", &hash[..16]);
            upload(st, id, &archive, &inside).await?;
            let owner = if owner.is_empty() {
                cx.user.clone()
            } else {
                owner.clone()
            };
            let script = copy_script(&inside, gzip, &tops, &cx.absolute(dest), &owner, mode);
            let mut out = Lines::new(|line| st.builds.log(&r.build, "info", Some(number), line));
            let code = exec(st, id, "root", &script, &BTreeMap::new(), None, &mut out).await?;
            out.flush();
            if code != 0 {
                return Err(format!(
                    "COPY {src} {dest}: failed with code {code} (the image needs tar and cp)"
                ));
            }
        }
        Step::Env(pairs) => {
            for (k, v) in pairs {
                log(format!("ENV {k}={v}"));
                cx.env.insert(k.clone(), v.clone());
            }
        }
        Step::Workdir(path) => {
            let path = cx.absolute(path);
            log(format!("WORKDIR {path}"));
            let mut out = Lines::new(|line| st.builds.log(&r.build, "info", Some(number), line));
            let code = exec(
                st,
                id,
                "root",
                &format!("mkdir -p {}", quote(&path)),
                &BTreeMap::new(),
                None,
                &mut out,
            )
            .await?;
            out.flush();
            if code != 0 {
                return Err(format!("WORKDIR {path}: could not make it (code {code})"));
            }
            cx.workdir = Some(path);
        }
        Step::User(user) => {
            log(format!("USER {user}"));
            cx.user = user.clone();
            cx.user_set = true;
        }
    }
    Ok(())
}

/// Starts the start command (left running: what the pack sees is the template as it
/// will boot) and runs the ready command until it exits 0.
async fn check_start(st: &AppState, r: &Run, id: &str, cx: &Context, user: &str) -> Result<(), String> {
    let log = |m: String| st.builds.log(&r.build, "info", Some("finalize"), m);
    let start = match &r.plan.start_cmd {
        Some(cmd) => {
            log(format!("starting: {cmd}"));
            let (st2, id2, user2, cmd2, env, cwd) = (
                st.clone(),
                id.to_string(),
                user.to_string(),
                cmd.clone(),
                cx.env.clone(),
                cx.workdir.clone(),
            );
            let build = r.build.clone();
            Some(tokio::spawn(async move {
                let mut out = Lines::new(|line| st2.builds.log(&build, "info", Some("finalize"), line));
                let r = exec(&st2, &id2, &user2, &cmd2, &env, cwd.as_deref(), &mut out).await;
                out.flush();
                r
            }))
        }
        None => None,
    };
    let Some(ready) = &r.plan.ready_cmd else {
        return Ok(());
    };
    log(format!("waiting for the ready command: {ready}"));
    let deadline = Instant::now() + READY_WAIT;
    loop {
        if let Some(s) = &start
            && s.is_finished()
        {
            return Err("the start command ended before the ready command succeeded".into());
        }
        let mut quiet = Lines::new(|_| {});
        if exec(st, id, user, ready, &cx.env, cx.workdir.as_deref(), &mut quiet).await? == 0 {
            log("ready".into());
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the ready command did not succeed within {} s",
                READY_WAIT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn wait_running(st: &AppState, id: &str) -> Result<(), String> {
    let deadline = Instant::now() + START_WAIT;
    loop {
        let x = st
            .node
            .read(|s| s.sandboxes.sandboxes.get(id).cloned())
            .ok_or_else(|| format!("sandbox {id} is gone"))?;
        match x.observed {
            Observed::Ready => return Ok(()),
            Observed::Failed | Observed::Exited => {
                return Err(format!(
                    "the build's sandbox failed to start: {}",
                    x.reason.unwrap_or_else(|| "no reason given".into())
                ));
            }
            _ if !x.is_live() => return Err(format!("the build's sandbox {id} ended")),
            _ => {}
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "the build's sandbox did not start within {} s",
                START_WAIT.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_image(st: &AppState, image: &str) -> Result<(), String> {
    let deadline = Instant::now() + PACK_WAIT;
    loop {
        let x = st
            .node
            .read(|s| s.images.images.get(image).map(|x| (x.state, x.reason.clone())));
        match x {
            Some((ImageState::Ready, _)) => return Ok(()),
            Some((ImageState::Failed, reason)) => {
                return Err(format!(
                    "packing the image failed: {}",
                    reason.unwrap_or_else(|| "no reason given".into())
                ));
            }
            None => return Err(format!("image {image} is gone")),
            Some((ImageState::Pending, _)) => {}
        }
        if Instant::now() >= deadline {
            return Err(format!("the image was not packed within {} s", PACK_WAIT.as_secs()));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A shell word.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// The shell script that puts a COPY step's files in place, as Docker's COPY does: a
/// directory's contents into `dest`; a file to `dest`, or into it when `dest` ends in
/// `/`, several sources are copied, or `dest` is a directory.
fn copy_script(archive: &str, gzip: bool, tops: &[(String, bool)], dest: &str, owner: &str, mode: &str) -> String {
    let into = dest.ends_with('/') || tops.len() > 1;
    let dest = dest.trim_end_matches('/');
    let dest = if dest.is_empty() { "/" } else { dest };
    let d = quote(dest);
    let mut s = String::from("set -e\nS=$(mktemp -d /tmp/.opendsec-copy.XXXXXX)\n");
    s += &format!("trap 'rm -rf \"$S\" {}' EXIT\n", quote(archive).replace('\'', "'\\''"));
    s += &format!("tar -x{}of {} -C \"$S\"\n", if gzip { "z" } else { "" }, quote(archive));
    let mut targets = Vec::new();
    for (name, is_dir) in tops {
        let from = format!("\"$S\"/{}", quote(name));
        let base = name.rsplit('/').next().unwrap_or(name);
        if *is_dir {
            s += &format!("mkdir -p {d}\ncp -a {from}/. {d}/\n");
            targets.push(d.clone());
        } else if into {
            s += &format!("mkdir -p {d}\ncp -a {from} {d}/\n");
            targets.push(quote(&format!("{}/{base}", dest.trim_end_matches('/'))));
        } else {
            let in_dir = quote(&format!("{}/{base}", dest.trim_end_matches('/')));
            s += &format!(
                "if [ -d {d} ]; then cp -a {from} {d}/; T={in_dir}; else mkdir -p \"$(dirname {d})\"; cp -a {from} {d}; T={d}; fi\n"
            );
            targets.push("\"$T\"".into());
        }
        let t = targets.last().expect("a target was just added");
        if !owner.is_empty() {
            s += &format!("chown -R {} {t}\n", quote(owner));
        }
        if !mode.is_empty() {
            s += &format!("chmod -R {} {t}\n", quote(mode));
        }
    }
    s
}

/// Whether the archive is gzip, and its top entries (those under no other entry): the
/// paths the COPY matched, relative to the caller's context directory.
async fn top_entries(archive: &Path) -> Result<(bool, Vec<(String, bool)>), String> {
    let path = archive.to_path_buf();
    tokio::task::spawn_blocking(move || -> Result<(bool, Vec<(String, bool)>), String> {
        use std::io::Read;
        let bad = |e: std::io::Error| format!("reading the uploaded files: {e}");
        let mut f = std::fs::File::open(&path).map_err(bad)?;
        let mut magic = [0u8; 2];
        let n = f.read(&mut magic).map_err(bad)?;
        let gzip = n == 2 && magic == [0x1f, 0x8b];
        let f = std::fs::File::open(&path).map_err(bad)?;
        let reader: Box<dyn Read> = if gzip {
            Box::new(flate2::read::GzDecoder::new(f))
        } else {
            Box::new(f)
        };
        let mut all: BTreeMap<String, bool> = BTreeMap::new();
        let mut tar = tar::Archive::new(reader);
        for entry in tar.entries().map_err(bad)? {
            let entry = entry.map_err(bad)?;
            let p = entry.path().map_err(bad)?.to_string_lossy().to_string();
            let name = p.trim_start_matches("./").trim_end_matches('/').to_string();
            if name.is_empty() || name == "." {
                continue;
            }
            if name.starts_with('/') || name.split('/').any(|c| c == "..") {
                return Err(format!("the uploaded files hold a path outside the context: {p}"));
            }
            all.insert(name, entry.header().entry_type().is_dir());
        }
        let names: BTreeSet<&str> = all.keys().map(String::as_str).collect();
        let tops = all
            .iter()
            .filter(|(name, _)| {
                let mut parent = name.as_str();
                while let Some((p, _)) = parent.rsplit_once('/') {
                    if names.contains(p) {
                        return false;
                    }
                    parent = p;
                }
                true
            })
            .map(|(n, d)| (n.clone(), *d))
            .collect();
        Ok((gzip, tops))
    })
    .await
    .map_err(|e| format!("reading the uploaded files: {e}"))?
}

/// Where the sandbox's edge is, and the headers that open its agent as `user`.
fn agent_request(st: &AppState, id: &str, user: &str, path: &str) -> Result<(String, Uri, HeaderMap), String> {
    let address = st
        .node
        .read(|s| {
            let x = s.sandboxes.sandboxes.get(id)?;
            s.placement.edges.get(&x.edge).map(|e| e.address.clone())
        })
        .ok_or_else(|| format!("the edge of sandbox {id} is not registered"))?;
    let uri: Uri = format!("/sandboxes/{id}/{path}")
        .parse()
        .map_err(|_| format!("bad agent path {path}"))?;
    let mut h = HeaderMap::new();
    let token = st.node.sandbox_token(SandboxTokenKind::Agent, id);
    h.insert(
        "x-access-token",
        HeaderValue::from_str(&token).map_err(|e| e.to_string())?,
    );
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:"));
    h.insert(
        header::AUTHORIZATION,
        HeaderValue::from_str(&format!("Basic {basic}")).map_err(|_| format!("bad user name {user:?}"))?,
    );
    Ok((address, uri, h))
}

/// Uploads the file at `from` to `to` in the sandbox (as root), streaming it.
async fn upload(st: &AppState, id: &str, from: &Path, to: &str) -> Result<(), String> {
    use http_body_util::BodyExt;
    use tokio::io::AsyncReadExt;
    let q: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("path", to)
        .finish();
    let (address, uri, headers) = agent_request(st, id, "root", &format!("files?{q}"))?;
    let file = tokio::fs::File::open(from)
        .await
        .map_err(|e| format!("reading the uploaded files: {e}"))?;
    let stream = futures::stream::unfold(file, |mut f| async move {
        let mut buf = vec![0u8; 256 * 1024];
        match f.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                buf.truncate(n);
                Some((Ok::<_, std::io::Error>(axum::body::Bytes::from(buf)), f))
            }
            Err(e) => Some((Err(e), f)),
        }
    });
    let mut req = Request::post(uri.clone())
        .body(Body::from_stream(stream))
        .map_err(|e| e.to_string())?;
    *req.headers_mut() = headers;
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    let resp = crate::edge_client::forward(st, &address, uri, req)
        .await
        .map_err(|e| format!("uploading the files: {}", e.0))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if status != StatusCode::OK {
        return Err(format!(
            "uploading the files into the sandbox: {status}: {}",
            String::from_utf8_lossy(&body)
        ));
    }
    Ok(())
}

/// Output split into lines, each handed on (cut at [`MAX_LINE`] bytes).
struct Lines<F: FnMut(String)> {
    out: F,
    partial: Vec<u8>,
}

impl<F: FnMut(String)> Lines<F> {
    fn new(out: F) -> Self {
        Lines {
            out,
            partial: Vec::new(),
        }
    }

    fn push(&mut self, data: &[u8]) {
        for &b in data {
            if b == b'\n' {
                self.emit();
            } else if self.partial.len() < MAX_LINE {
                self.partial.push(b);
            }
        }
    }

    fn emit(&mut self) {
        let line = String::from_utf8_lossy(&self.partial)
            .trim_end_matches('\r')
            .to_string();
        self.partial.clear();
        (self.out)(line);
    }

    fn flush(&mut self) {
        if !self.partial.is_empty() {
            self.emit();
        }
    }
}

/// Runs `cmd` in a login shell in the sandbox as `user`; its output (stdout and stderr
/// alike) goes to `out`. Returns the exit code.
async fn exec<F: FnMut(String)>(
    st: &AppState,
    id: &str,
    user: &str,
    cmd: &str,
    env: &BTreeMap<String, String>,
    cwd: Option<&str>,
    out: &mut Lines<F>,
) -> Result<i32, String> {
    use http_body_util::BodyExt;
    let (address, uri, headers) = agent_request(st, id, user, "process.Process/Start")?;
    let mut process = json!({"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": env});
    if let Some(c) = cwd {
        process["cwd"] = json!(c);
    }
    let msg = json!({"process": process, "stdin": false}).to_string();
    let mut frame = Vec::with_capacity(5 + msg.len());
    frame.push(0);
    frame.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    frame.extend_from_slice(msg.as_bytes());
    let mut req = Request::post(uri.clone())
        .body(Body::from(frame))
        .map_err(|e| e.to_string())?;
    *req.headers_mut() = headers;
    req.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/connect+json"),
    );
    req.headers_mut()
        .insert("connect-protocol-version", HeaderValue::from_static("1"));
    let resp = crate::edge_client::forward(st, &address, uri, req)
        .await
        .map_err(|e| format!("reaching the build's sandbox: {}", e.0))?;
    let status = resp.status();
    let mut body = resp.into_body();
    if status != StatusCode::OK {
        let bytes = body.collect().await.map(|b| b.to_bytes()).unwrap_or_default();
        return Err(format!(
            "the sandbox's agent refused the command: {status}: {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut buf: Vec<u8> = Vec::new();
    loop {
        while buf.len() >= 5 {
            let len = u32::from_be_bytes(buf[1..5].try_into().expect("4 bytes")) as usize;
            if buf.len() < 5 + len {
                break;
            }
            let flags = buf[0];
            let v: Value = serde_json::from_slice(&buf[5..5 + len])
                .map_err(|e| format!("the agent's answer does not decode: {e}"))?;
            buf.drain(..5 + len);
            if flags & 0x02 != 0 {
                return Err(match v.get("error") {
                    Some(e) => format!(
                        "the command could not run: {}",
                        e.get("message").and_then(Value::as_str).unwrap_or("unknown error")
                    ),
                    None => "the command's stream ended before it did".into(),
                });
            }
            let ev = &v["event"];
            for stream in ["stdout", "stderr", "pty"] {
                if let Some(d) = ev["data"][stream].as_str() {
                    out.push(&b64.decode(d).unwrap_or_default());
                }
            }
            if ev["end"].is_object() {
                let end = &ev["end"];
                return match end["exitCode"].as_i64() {
                    Some(c) => Ok(c as i32),
                    None if end["exited"] == json!(false) || end["error"].is_string() => Err(format!(
                        "the command ended without an exit code: {}",
                        end["status"].as_str().or(end["error"].as_str()).unwrap_or("killed")
                    )),
                    // protojson leaves a zero exit code out.
                    None => Ok(0),
                };
            }
        }
        match body.frame().await {
            Some(Ok(f)) => {
                if let Ok(d) = f.into_data() {
                    buf.extend_from_slice(&d);
                }
            }
            Some(Err(e)) => return Err(format!("the command's output was cut off: {e}")),
            None => return Err("the command's stream ended before it did".into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relative_paths_are_under_the_working_directory() {
        let mut cx = Context {
            env: BTreeMap::new(),
            workdir: None,
            user: "user".into(),
            user_set: false,
        };
        assert_eq!(cx.absolute("app"), "/app");
        cx.workdir = Some("/srv/app".into());
        assert_eq!(cx.absolute("./src/"), "/srv/app/src/");
        assert_eq!(cx.absolute("/etc/x"), "/etc/x");
    }

    #[test]
    fn copy_script_follows_dockers_copy() {
        // A directory: its contents into dest.
        let s = copy_script("/tmp/a", true, &[("app".into(), true)], "/app/", "user", "");
        assert!(s.contains("tar -xzof '/tmp/a'"), "{s}");
        assert!(s.contains("cp -a \"$S\"/'app'/. '/app'/"), "{s}");
        assert!(s.contains("chown -R 'user' '/app'"), "{s}");
        // A file to a path that ends in '/': into it.
        let s = copy_script(
            "/tmp/a",
            false,
            &[("src/index.js".into(), false)],
            "/w/src/",
            "",
            "0755",
        );
        assert!(s.contains("tar -xof"), "{s}");
        assert!(s.contains("cp -a \"$S\"/'src/index.js' '/w/src'/"), "{s}");
        assert!(s.contains("chmod -R '0755' '/w/src/index.js'"), "{s}");
        // A file to a name: to it, or into it if it is a directory.
        let s = copy_script(
            "/tmp/a",
            false,
            &[("config.json".into(), false)],
            "/etc/app/config.json",
            "",
            "",
        );
        assert!(s.contains("if [ -d '/etc/app/config.json' ]"), "{s}");
        // Quotes in names stay words.
        let s = copy_script("/tmp/a", false, &[("it's".into(), false)], "/x/", "", "");
        assert!(s.contains("'it'\\''s'"), "{s}");
    }

    #[test]
    fn lines_are_split_and_cut() {
        let mut got = Vec::new();
        let mut l = Lines::new(|x| got.push(x));
        l.push(b"one\ntw");
        l.push(b"o\r\nthree");
        l.flush();
        drop(l);
        assert_eq!(got, ["one", "two", "three"]);
        let mut got = Vec::new();
        let mut l = Lines::new(|x| got.push(x));
        l.push(&vec![b'x'; MAX_LINE + 10]);
        l.flush();
        drop(l);
        assert_eq!(got[0].len(), MAX_LINE);
    }
}
