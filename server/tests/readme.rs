//! Specification: the README's "Use" section works as written. Every `sh` block under
//! `## Use` (its `###` subsections included: the E2B SDK, the three-node control plane)
//! runs verbatim, in order, in one bash session against a fresh `opendsec up` started
//! here, as a newcomer types them after `./ops/up.sh`. Any command that fails (errexit,
//! pipefail) fails the test, naming the command and showing the session's transcript.
//!
//! How the session stands in for the newcomer's shell:
//! - Ids flow as the README shows: `id=$(opendsecctl ... --output json | jq -r ...)`;
//!   nothing is substituted into the README's text.
//! - `OPENDSEC_URL` and `OPENDSEC_TOKEN_FILE` point at this test's server (what
//!   `./ops/up.sh` prints for its own); the binaries of this build come first on PATH
//!   after the README's own `export PATH=...` (the session runs in an empty directory,
//!   so the README's `$PWD/target/release` adds nothing); HOME is a fresh directory.
//! - `opendsecctl sandbox shell` is interactive: its keyboard is a pipe that types
//!   `echo readme-shell-$((6*7))` and `exit`, and the transcript must show the shell
//!   ran it.
//! - The E2B block uses the SDK venv `./ops/up.sh` makes (`./ops/e2b-venv.sh --sdk`;
//!   `./ops/test.sh` makes it too); the three-node block's fixed ports (7410-7441) are not
//!   this server's, so both run side by side. Processes a block leaves in the
//!   background are killed with the session's process group.
//!
//! Needs what `opendsec up` and the VM suites need (root, crun or runc, QEMU, the
//! images, the static agent: `./ops/test.sh`), `opendsecctl` built beside `opendsec`
//! (`cargo build -p opendsec-sdk --bins`), jq and the E2B SDK venv.
//!
//! Run: `cargo test -p opendsec --test readme -- --nocapture`

#[path = "support/up.rs"]
mod up;
#[path = "support/vms.rs"]
mod vms;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The whole section at most: it boots microVMs and a full VM under TCG on two cores.
const SESSION_LIMIT: Duration = Duration::from_secs(40 * 60);
/// What the piped keyboard types into `sandbox shell`, and what must come back.
const SHELL_INPUT: &str = "echo readme-shell-$((6*7))";
const SHELL_OUTPUT: &str = "readme-shell-42";

/// One fenced `sh` block of the README: the heading it sits under and its lines.
#[derive(Debug)]
struct Block {
    heading: String,
    lines: Vec<String>,
}

/// The `sh` blocks from `## Use` up to the next `## ` heading, in order.
fn use_section_blocks(readme: &str) -> Vec<Block> {
    let mut blocks = Vec::new();
    let mut in_section = false;
    let mut heading = String::from("Use");
    let mut open: Option<Vec<String>> = None;
    for line in readme.lines() {
        if let Some(lines) = open.as_mut() {
            if line.trim_start().starts_with("```") {
                blocks.push(Block {
                    heading: heading.clone(),
                    lines: open.take().unwrap(),
                });
            } else {
                lines.push(line.to_string());
            }
            continue;
        }
        if let Some(title) = line.strip_prefix("## ") {
            in_section = title.trim() == "Use";
            continue;
        }
        if !in_section {
            continue;
        }
        if let Some(title) = line.strip_prefix("### ") {
            heading = title.trim().to_string();
        } else if line.trim() == "```sh" {
            open = Some(Vec::new());
        }
    }
    assert!(open.is_none(), "README.md: an `sh` block under `## Use` is not closed");
    blocks
}

/// The block's commands, a line continued with `\` joined to the next.
fn commands(block: &Block) -> Vec<String> {
    let mut commands = Vec::new();
    let mut current = String::new();
    for line in &block.lines {
        if line.trim().is_empty() {
            continue;
        }
        current.push_str(line);
        if line.ends_with('\\') {
            current.push('\n');
        } else {
            commands.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        commands.push(current);
    }
    commands
}

fn single_quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// The bash script of the section: each command echoed as `$ command`, then run as
/// written (`sandbox shell` with its keyboard piped in).
fn session_script(blocks: &[Block]) -> String {
    let mut script = String::from(
        "set -eE -o pipefail\n\
         trap 'rc=$?; printf \"\\nREADME command failed (exit %s): %s\\n\" \"$rc\" \"$BASH_COMMAND\"' ERR\n",
    );
    for (n, block) in blocks.iter().enumerate() {
        script.push_str(&format!(
            "printf '\\n### block %s (%s)\\n' {} {}\n",
            n + 1,
            single_quoted(&block.heading)
        ));
        for command in commands(block) {
            script.push_str(&format!("printf '$ %s\\n' {}\n", single_quoted(&command)));
            if command.trim_start().starts_with("opendsecctl sandbox shell ") {
                script.push_str(&format!("printf '%s\\nexit\\n' {} | ", single_quoted(SHELL_INPUT)));
            }
            script.push_str(&command);
            script.push('\n');
        }
    }
    script.push_str("printf '\\nREADME session done\\n'\n");
    script
}

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The last `n` lines of `text`.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// SIGKILL to every process of group `pgid` (the session and what it left running).
fn kill_group(pgid: u32) {
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pgid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

#[test]
fn readme_blocks_parse_into_commands() {
    let readme = "# X\n## Set up\n```sh\nnot-this\n```\n## Use\n```sh\na \\\n  b\n\nc # note\n```\n\
                  ### Sub\n```sh\nd\n```\n## Benchmarks\n```sh\nnot-this-either\n```\n";
    let blocks = use_section_blocks(readme);
    assert_eq!(blocks.len(), 2, "{blocks:?}");
    assert_eq!(commands(&blocks[0]), vec!["a \\\n  b".to_string(), "c # note".into()]);
    assert_eq!(
        (blocks[1].heading.as_str(), commands(&blocks[1])),
        ("Sub", vec!["d".to_string()])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_command_of_the_readmes_use_section_runs_against_a_fresh_opendsec_up() {
    let readme = std::fs::read_to_string(workspace().join("README.md")).expect("read README.md");
    let blocks = use_section_blocks(&readme);
    assert!(
        blocks.len() >= 3 && blocks.iter().any(|b| b.heading.contains("E2B")),
        "README.md has no `## Use` section with its E2B and cluster blocks: {blocks:?}"
    );
    let bin_dir = Path::new(env!("CARGO_BIN_EXE_opendsec"))
        .parent()
        .unwrap()
        .to_path_buf();
    assert!(
        bin_dir.join("opendsecctl").is_file(),
        "opendsecctl is not built beside opendsec in {}: cargo build -p opendsec-sdk --bins",
        bin_dir.display()
    );

    // The server a newcomer has after ./ops/up.sh: its edge runs containers and VMs.
    let up = vms::start().await;
    up.ensure_image("base", Duration::from_secs(30 * 60)).await;
    let session = tempfile::tempdir().unwrap();
    let home = session.path().join("home");
    let work = session.path().join("work");
    std::fs::create_dir_all(&home).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let token_file = session.path().join("token");
    std::fs::write(&token_file, &up.token).unwrap();
    let script = session.path().join("readme.sh");
    std::fs::write(&script, session_script(&blocks)).unwrap();
    let transcript_path = session.path().join("transcript.log");
    let transcript = std::fs::File::create(&transcript_path).unwrap();

    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into())
    );
    let mut child = Command::new("bash")
        .arg("--noprofile")
        .arg("--norc")
        .arg(&script)
        .current_dir(&work)
        .env_clear()
        .env("PATH", path)
        .env("HOME", &home)
        .env("TERM", "xterm-256color")
        .env("LANG", "C.UTF-8")
        .env("OPENDSEC_URL", format!("http://{}", up.http))
        .env("OPENDSEC_TOKEN_FILE", &token_file)
        .stdin(Stdio::null())
        .stdout(transcript.try_clone().unwrap())
        .stderr(transcript)
        // Its own process group: whatever a block leaves running is killed with it.
        .process_group(0)
        .spawn()
        .expect("run bash");
    let pgid = child.id();
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > SESSION_LIMIT {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    kill_group(pgid);
    let _ = child.wait();
    let text = std::fs::read_to_string(&transcript_path).unwrap_or_default();
    println!(
        "--- the README session ({:.0} s) ---\n{text}",
        started.elapsed().as_secs_f64()
    );

    let Some(status) = status else {
        panic!(
            "the README session did not end within {SESSION_LIMIT:?}; its last lines:\n{}",
            tail(&text, 60)
        );
    };
    assert!(
        status.success() && text.contains("README session done"),
        "a README command failed ({status}); the session's last lines:\n{}\n--- opendsec up ---\n{}",
        tail(&text, 80),
        up.log_tail(40)
    );
    // What the commands print, beyond their exit codes.
    for (what, expected) in [
        ("sandbox exec prints python's answer", "\n42"),
        ("the piped keyboard ran in sandbox shell", SHELL_OUTPUT),
        ("the E2B SDK ran a command", "\nhi\n"),
        ("the added node is a member", "member 4"),
    ] {
        assert!(text.contains(expected), "{what}: no {expected:?} in the transcript");
    }
}
