//! The sandbox's configuration: its access token, its environment (the E2B
//! `envVars` given at create), the template's start command, its CPU class and
//! the AppArmor profile it stacks on the processes it starts. A container's
//! edge hands them over a pipe (`--config-fd`, one JSON object [`BootConfig`],
//! read once by the supervisor at boot, so nothing of it rests in a file sandbox
//! code could read or replace); a VM's guest reads files (`--access-token-file`,
//! `--env-file`, `--start-file`). Either is checked once at boot; a bad one stops
//! the agent with a message naming it and the problem.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;

/// Environment variables of the whole sandbox: applied to every process the
/// agent starts, after its defaults (PATH, HOME, USER, LOGNAME) and before a
/// request's own `envs`.
pub type SandboxEnv = BTreeMap<String, String>;

fn read_json<T: serde::de::DeserializeOwned>(path: &Path, what: &str) -> Result<T, String> {
    let text = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| format!("{} is not {what}: {e}", path.display()))
}

pub fn check_env(env: &BTreeMap<String, String>, source: &str) -> Result<(), String> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(format!("{source}: {k:?} is not a valid environment variable name"));
        }
        if v.contains('\0') {
            return Err(format!("{source}: the value of {k} contains a NUL byte"));
        }
    }
    Ok(())
}

/// Reads `--env-file`: a JSON object of string names to string values.
pub fn load_env(path: &Path) -> Result<SandboxEnv, String> {
    let env: SandboxEnv = read_json(path, "a JSON object of string values")?;
    check_env(&env, &path.display().to_string())?;
    Ok(env)
}

/// The image's WorkingDir (`--workdir-file`: a VM's, written by its edge): where processes
/// that name no directory start. One absolute path; anything else is refused.
pub fn load_workdir(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let dir = text.trim_end_matches('\n');
    if !dir.starts_with('/') || dir.contains('\n') || dir.contains('\0') || dir.len() > 4096 {
        return Err(format!("{}: not one absolute path", path.display()));
    }
    Ok(dir.to_string())
}

/// The template's start command (`--start-file`), e.g. the code interpreter's
/// server. Started once at boot as an ordinary managed process tagged
/// [`START_TAG`].
#[derive(Debug, Clone, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct StartCommand {
    pub cmd: String,
    #[serde(default)]
    pub args: Vec<String>,
    #[serde(default)]
    pub envs: BTreeMap<String, String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// The user it runs as; the agent's default user when absent.
    #[serde(default)]
    pub user: Option<String>,
    /// A TCP port on 127.0.0.1 that accepts connections once it is ready;
    /// until then `/health` answers 503.
    #[serde(default)]
    pub ready_port: Option<u16>,
    /// A shell command (`/bin/bash -l -c`, as the start command's user and in its
    /// directory) run every 200 ms until it exits 0; until then `/health` answers 503.
    #[serde(default)]
    pub ready_cmd: Option<String>,
    /// It reads the sandbox's identity on its stdin: one JSON line `{"env": {...}}` (the
    /// sandbox's variables), then EOF. Written at boot, or for a warm container started
    /// ahead of its sandbox, at the claim (see `claim.rs`): a process started before the
    /// claim learns the sandbox's variables only so.
    #[serde(default)]
    pub claim_stdin: bool,
}

/// The tag of the start command's process in `process.List`.
pub const START_TAG: &str = "start";

/// Reads `--start-file`.
pub fn load_start(path: &Path) -> Result<StartCommand, String> {
    let s: StartCommand = read_json(path, "a start command object")?;
    check_start(&s, &path.display().to_string())?;
    Ok(s)
}

fn check_start(s: &StartCommand, source: &str) -> Result<(), String> {
    if s.cmd.is_empty() {
        return Err(format!("{source}: cmd is empty"));
    }
    if s.ready_port == Some(0) {
        return Err(format!("{source}: ready_port 0 is not a port"));
    }
    if s.ready_cmd.as_deref().is_some_and(|c| c.trim().is_empty()) {
        return Err(format!("{source}: ready_cmd is empty"));
    }
    check_env(&s.envs, source)
}

/// What a container's edge writes on `--config-fd`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BootConfig {
    pub access_token: String,
    #[serde(default)]
    pub env: SandboxEnv,
    #[serde(default)]
    pub start: Option<StartCommand>,
    #[serde(default, deserialize_with = "cpu_class")]
    pub cpu_class: CpuClass,
    /// The AppArmor profile stacked on every process the agent starts (see
    /// `apparmor.rs`); sent only by an edge that loaded it.
    #[serde(default)]
    pub apparmor_profile: Option<String>,
    /// Where processes start when they name no directory: the image's WorkingDir (the
    /// user's home when absent, or when the directory does not exist).
    #[serde(default)]
    pub workdir: Option<String>,
    /// The image's User: who processes naming no user run as (`user` when absent, or
    /// when the image has no such account: see [`default_user`]).
    #[serde(default)]
    pub user: Option<String>,
    /// A warm container started ahead of its sandbox: `access_token` is the edge's for the
    /// warm container, `env` the image's, and the sandbox's own come with the claim
    /// (`POST /.opendsec/claim`, see `claim.rs`).
    #[serde(default)]
    pub warm: bool,
}

/// Who processes naming no user run as: the account the image's User names
/// (`image_user`, from the configuration: a name, or a uid that `by_uid` finds the
/// account of), else `fallback` (`user`, or `--default-user`). An image User the sandbox
/// has no account for is reported and left out rather than failing every command.
pub fn default_user(
    image_user: Option<&str>,
    fallback: &str,
    exists: impl Fn(&str) -> bool,
    by_uid: impl Fn(u32) -> Option<String>,
) -> String {
    let named = |u: &str| match u.parse::<u32>() {
        Ok(uid) => by_uid(uid),
        Err(_) => exists(u).then(|| u.to_string()),
    };
    match image_user.filter(|u| !u.is_empty()) {
        Some(u) if named(u).is_some() => named(u).unwrap_or_default(),
        Some(u) => {
            eprintln!(
                "opendsec-agent: the image's user {u:?} has no account in /etc/passwd: processes run as {fallback:?}"
            );
            fallback.to_string()
        }
        None => fallback.to_string(),
    }
}

/// The image's User (`--user-file`: a VM's, written by its edge): one account name.
pub fn load_user(path: &Path) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    let name = text.trim_end_matches('\n');
    let valid = !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('-')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c));
    if !valid {
        return Err(format!("{}: not one account name", path.display()));
    }
    Ok(name.to_string())
}

/// How the sandbox's processes are scheduled (see [`apply_cpu_class`]); any other name
/// is refused when the configuration is read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum CpuClass {
    #[default]
    LatencySensitive,
    BestEffort,
}

fn cpu_class<'de, D: serde::Deserializer<'de>>(d: D) -> Result<CpuClass, D::Error> {
    match String::deserialize(d)?.as_str() {
        "latency-sensitive" => Ok(CpuClass::LatencySensitive),
        "best-effort" => Ok(CpuClass::BestEffort),
        other => Err(serde::de::Error::custom(format!(
            "cpu_class {other:?} is not latency-sensitive or best-effort"
        ))),
    }
}

/// Takes the sandbox's CPU class for this process and so for every process of the
/// sandbox (they all descend from it): `best-effort` is SCHED_IDLE, which nothing in the
/// sandbox can leave (that needs CAP_SYS_NICE or an RLIMIT_NICE it does not have);
/// `latency-sensitive` asks for a core-scheduling cookie of its own, so no other tenant's
/// thread runs on an SMT sibling of its cores. A kernel without core scheduling says so
/// (the edge says it too, at start); that is not an error.
pub fn apply_cpu_class(class: CpuClass) -> Result<(), String> {
    match class {
        CpuClass::BestEffort => {
            let param = libc::sched_param { sched_priority: 0 };
            // SAFETY: sched_setscheduler on this process with a valid param.
            if unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) } != 0 {
                return Err(format!("SCHED_IDLE: {}", std::io::Error::last_os_error()));
            }
            Ok(())
        }
        CpuClass::LatencySensitive => {
            const PR_SCHED_CORE: libc::c_int = 62;
            const PR_SCHED_CORE_CREATE: libc::c_ulong = 1;
            const PIDTYPE_TGID: libc::c_ulong = 1;
            // SAFETY: prctl with integer arguments.
            if unsafe { libc::prctl(PR_SCHED_CORE, PR_SCHED_CORE_CREATE, 0, PIDTYPE_TGID, 0) } != 0 {
                let e = std::io::Error::last_os_error();
                eprintln!("opendsec-agent: no core-scheduling cookie ({e}): this kernel lacks core scheduling");
            }
            Ok(())
        }
    }
}

/// Largest configuration the edge sends (the environment is capped at 256 KiB).
const MAX_BOOT_CONFIG: usize = 1 << 20;

/// Reads the configuration from `fd` up to its end, then closes it.
pub fn read_boot_config(fd: std::os::fd::RawFd) -> Result<BootConfig, String> {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    // SAFETY: the edge handed us this fd for this purpose only; we own it from here.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut bytes = Vec::new();
    file.take(MAX_BOOT_CONFIG as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("--config-fd {fd}: {e}"))?;
    if bytes.len() > MAX_BOOT_CONFIG {
        return Err(format!("--config-fd {fd}: more than {MAX_BOOT_CONFIG} bytes"));
    }
    parse_boot_config(&bytes)
}

pub fn parse_boot_config(bytes: &[u8]) -> Result<BootConfig, String> {
    let source = "the configuration from the edge";
    let c: BootConfig = serde_json::from_slice(bytes).map_err(|e| format!("{source} is not valid: {e}"))?;
    if c.access_token.trim().is_empty() {
        return Err(format!("{source} has an empty access_token"));
    }
    check_env(&c.env, source)?;
    if let Some(s) = &c.start {
        check_start(s, source)?;
    }
    if let Some(p) = &c.apparmor_profile
        && (p.is_empty() || !p.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b)))
    {
        return Err(format!("{source}: apparmor_profile {p:?} is not a profile name"));
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        std::io::Write::write_all(&mut f, text.as_bytes()).unwrap();
        f
    }

    #[test]
    fn env_file_is_an_object_of_strings() {
        let f = file(r#"{"A": "1", "B": "two words"}"#);
        let env = load_env(f.path()).unwrap();
        assert_eq!(env["A"], "1");
        assert_eq!(env["B"], "two words");
    }

    #[test]
    fn env_file_rejects_other_shapes_and_bad_names() {
        for bad in [r#"["A"]"#, r#"{"A": 1}"#, r#"{"A=B": "x"}"#, r#"{"": "x"}"#, "not json"] {
            let f = file(bad);
            let e = load_env(f.path()).unwrap_err();
            assert!(e.contains(&f.path().display().to_string()), "{bad}: {e}");
        }
        let e = load_env(Path::new("/nonexistent/env.json")).unwrap_err();
        assert!(e.starts_with("reading /nonexistent/env.json"), "{e}");
    }

    #[test]
    fn start_file_fields_and_defaults() {
        let f = file(r#"{"cmd": "/usr/bin/python3", "args": ["-m", "server"], "ready_port": 49999}"#);
        let s = load_start(f.path()).unwrap();
        assert_eq!(s.cmd, "/usr/bin/python3");
        assert_eq!(s.args, ["-m", "server"]);
        assert_eq!(s.ready_port, Some(49999));
        assert_eq!((s.user, s.cwd), (None, None));
        for bad in [
            r#"{"cmd": ""}"#,
            r#"{"args": []}"#,
            r#"{"cmd": "x", "ready_port": 0}"#,
            r#"{"cmd": "x", "typo": 1}"#,
        ] {
            assert!(load_start(file(bad).path()).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_boot_config_carries_token_env_and_start_command() {
        let c = parse_boot_config(br#"{"access_token":"t","env":{"A":"1"},"start":{"cmd":"sleep","ready_port":8888}}"#)
            .unwrap();
        assert_eq!(c.access_token, "t");
        assert_eq!(c.env["A"], "1");
        assert_eq!(c.start.unwrap().ready_port, Some(8888));
        assert_eq!(c.apparmor_profile, None);
        let c = parse_boot_config(br#"{"access_token":"t","apparmor_profile":"opendsec-sandbox"}"#).unwrap();
        assert_eq!(c.apparmor_profile.as_deref(), Some("opendsec-sandbox"));
    }

    #[test]
    fn a_bad_boot_config_is_refused_with_its_reason() {
        for (bytes, says) in [
            (&br#"{"access_token":""}"#[..], "empty access_token"),
            (
                br#"{"access_token":"t","env":{"A=B":"1"}}"#,
                "not a valid environment variable name",
            ),
            (br#"{"access_token":"t","start":{"cmd":""}}"#, "cmd is empty"),
            (br#"{"access_token":"t","planted":1}"#, "not valid"),
            (br#"{"access_token":"t","cpu_class":"turbo"}"#, "cpu_class"),
            (br#"{"access_token":"t","apparmor_profile":"a b"}"#, "apparmor_profile"),
            (br#"{"access_token":"t","apparmor_profile":""}"#, "apparmor_profile"),
        ] {
            let e = parse_boot_config(bytes).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn the_image_user_is_an_account_by_name_or_by_uid_else_the_fallback() {
        let exists = |u: &str| ["user", "app"].contains(&u);
        let by_uid = |uid: u32| (uid == 1001).then(|| "app".to_string());
        let pick = |u: Option<&str>| default_user(u, "user", exists, by_uid);
        assert_eq!(pick(Some("app")), "app");
        assert_eq!(pick(Some("1001")), "app", "a uid runs as its account");
        assert_eq!(pick(Some("4242")), "user", "a uid without an account falls back");
        assert_eq!(pick(Some("nobody-here")), "user");
        assert_eq!(pick(None), "user");
    }
}
