//! The sandbox's configuration files, which the edge bind-mounts read-only at
//! `/.opendsec/config/`: `env.json` (`--env-file`, the E2B `envVars` given at
//! create) and `start.json` (`--start-file`, the template's start command).
//! Both are read and checked once at boot; a bad file stops the agent with a
//! message naming the file and the problem.

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

fn check_env(env: &BTreeMap<String, String>, file: &Path) -> Result<(), String> {
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(format!(
                "{}: {k:?} is not a valid environment variable name",
                file.display()
            ));
        }
        if v.contains('\0') {
            return Err(format!("{}: the value of {k} contains a NUL byte", file.display()));
        }
    }
    Ok(())
}

/// Reads `--env-file`: a JSON object of string names to string values.
pub fn load_env(path: &Path) -> Result<SandboxEnv, String> {
    let env: SandboxEnv = read_json(path, "a JSON object of string values")?;
    check_env(&env, path)?;
    Ok(env)
}

/// The template's start command (`--start-file`), e.g. the code interpreter's
/// server. Started once at boot as an ordinary managed process tagged
/// [`START_TAG`].
#[derive(Debug, Clone, Deserialize)]
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
}

/// The tag of the start command's process in `process.List`.
pub const START_TAG: &str = "start";

/// Reads `--start-file`.
pub fn load_start(path: &Path) -> Result<StartCommand, String> {
    let s: StartCommand = read_json(path, "a start command object")?;
    if s.cmd.is_empty() {
        return Err(format!("{}: cmd is empty", path.display()));
    }
    if s.ready_port == Some(0) {
        return Err(format!("{}: ready_port 0 is not a port", path.display()));
    }
    check_env(&s.envs, path)?;
    Ok(s)
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
}
