//! AppArmor profiles for container sandboxes, where the host has AppArmor (the DSec paper
//! confines its agent the same way): sandbox code, root inside its sandbox or not, may
//! not touch the agent's files, signal the agent or trace it (which is also how it would
//! reach the agent's memory and sockets: `/proc/<agent>/fd`, `pidfd_getfd`).
//!
//! Two profiles, machine-wide (the kernel holds one policy: every edge of a machine loads
//! the same text, each replacing what is there):
//! - [`AGENT_PROFILE`] is PID 1's, the agent's, set by the runtime from the spec's
//!   `process.apparmorProfile`. It is Docker's `docker-default` (moby
//!   `profiles/apparmor/template.go`, the reference for what ordinary programs need in a
//!   container: no mount, no writes to `/proc/sys`, `/proc/sysrq-trigger` or `/sys` but
//!   cgroups, nothing of `/proc/kcore` or `/sys/firmware`), stricter on `/proc/sys`,
//!   umount and pivot_root, plus what the agent does: it stacks [`SANDBOX_PROFILE`] on
//!   the processes it starts, and never writes `/.opendsec`.
//! - [`SANDBOX_PROFILE`] is stacked by the agent on every process it starts (commands,
//!   PTYs, the template's start command): between fork and exec the child writes
//!   `stack opendsec-sandbox` to `/proc/self/attr/apparmor/exec`, when the agent's
//!   configuration names the profile (`apparmor_profile`, which the edge sends only where
//!   it loaded these profiles; see the agent's `apparmor.rs`). A stack, not a change of
//!   profile: under no_new_privs, which every container has, AppArmor refuses a
//!   transition to another profile and allows one that keeps the current profile. So
//!   sandbox processes run under `opendsec-agent//&opendsec-sandbox`: what they do must
//!   be allowed by both, and their children and execs stay under both.
//!
//! The sandbox profile takes from sandbox processes: every access to `/.opendsec` (read,
//! write, link, lock, map, exec: sandbox code needs nothing there, and the agent is not
//! under this profile), every signal sent to the agent and ptrace of it (trace and read),
//! and any change of profile. The kernel's own signals are not mediated: a child's
//! SIGCHLD when it exits, a terminal's SIGHUP and SIGWINCH, so the agent still learns
//! that its children died. The agent may signal and read its children.
//!
//! Peer rules and the stack: AppArmor matches a stacked peer first whole
//! (`opendsec-agent//&opendsec-sandbox`) and, only where that does not allow the request,
//! component by component, where a deny of any component denies. Signals and ptrace among sandbox
//! processes are therefore allowed by rules that name the whole stack, and the deny rules
//! name `opendsec-agent` alone, which the whole stack does not match.
//!
//! The host: AppArmor is on where `/sys/kernel/security/apparmor` exists and
//! `/sys/module/apparmor/parameters/enabled` says `Y` (runc decides the same way). There
//! the edge writes both profiles under `<data>/apparmor/` and loads them with
//! `apparmor_parser --replace --skip-cache`, and refuses to start if it cannot (no parser,
//! a parser that fails, AppArmor on but securityfs not mounted; an operator may run
//! sandboxes without them: `--insecure-no-apparmor`). Where the kernel
//! has no AppArmor, or it is disabled, the edge says so once at start and nothing else
//! changes: no profile in the spec, none asked for by the agent.
//!
//! Verified on any host with Debian's `apparmor` package (the tests fail without it):
//! both profiles compile with the real `apparmor_parser` (against the 3.0 ABI, as for a
//! kernel with AppArmor), they hold the rules above, and the wiring (detection on fake
//! sysfs roots, the spec's `apparmorProfile`, the agent's request before exec). Enforced
//! only where the kernel has AppArmor, and so verified only there: the kernel's loading
//! of the profiles, the stack under no_new_privs, and what the rules refuse.

use std::path::{Path, PathBuf};

use super::ContainerError;

/// The agent's profile (PID 1 of every container).
pub const AGENT_PROFILE: &str = "opendsec-agent";
/// The profile the agent stacks on every process it starts.
pub const SANDBOX_PROFILE: &str = "opendsec-sandbox";
/// The label of a sandbox process: the agent's profile with the sandbox's stacked on it.
pub const SANDBOX_LABEL: &str = "opendsec-agent//&opendsec-sandbox";
/// Where the kernel's AppArmor shows itself (a fake root in tests).
pub const SYS: &str = "/sys";
/// Where the profiles go under the edge's data directory.
pub const DEFAULT_DIR: &str = "/var/lib/opendsec/apparmor";
/// How the edge loads them: replacing older versions, leaving the host's cache alone.
pub const LOAD_ARGS: &[&str] = &["--replace", "--skip-cache"];
/// The Debian package of `apparmor_parser`.
pub const PARSER_PACKAGE: &str = "apparmor";

/// The rules both profiles share: `docker-default`'s, with `/proc/sys`, umount and
/// pivot_root denied too. `/proc/<pid>/...` stays writable (the agent sets its
/// children's OOM score and their profile there), and so does `/sys/fs/cgroup` (the
/// mount is read-only anyway).
const COMMON_RULES: &str = r#"
  network,
  capability,
  file,

  # The edge, the shim and the runtime (unconfined, or under their own profiles) may
  # signal every process of a sandbox.
  signal (receive) peer={unconfined,runc,crun},

  deny mount,
  deny umount,
  deny pivot_root,

  # No writes to files directly in /proc, nor under /proc/<anything but a pid or sys>/.
  deny /proc/* w,
  deny /proc/{[^1-9],[^1-9][^0-9],[^1-9s][^0-9y][^0-9s],[^1-9][^0-9][^0-9][^0-9/]*}/** w,
  deny /proc/sys/** wklx,
  deny /proc/sysrq-trigger rwklx,
  deny /proc/kcore rwklx,
  deny /proc/mem rwklx,
  deny /proc/kmem rwklx,

  # Nothing written in /sys but cgroups.
  deny /sys/[^f]*/** wklx,
  deny /sys/f[^s]*/** wklx,
  deny /sys/fs/[^c]*/** wklx,
  deny /sys/fs/c[^g]*/** wklx,
  deny /sys/fs/cg[^r]*/** wklx,
  deny /sys/firmware/** rwklx,
  deny /sys/kernel/security/** rwklx,
"#;

/// What only the agent's profile says.
const AGENT_RULES: &str = r#"
  # Among the agent's own processes (supervisor and server), and towards the sandbox
  # processes it starts (whose label names this profile too).
  signal (send,receive) peer=opendsec-agent,
  signal (send,receive) peer="opendsec-agent//&opendsec-sandbox",
  ptrace (trace,read,tracedby,readby) peer=opendsec-agent,
  ptrace (trace,read,tracedby,readby) peer="opendsec-agent//&opendsec-sandbox",

  # The agent stacks the sandbox's profile on every process it starts.
  change_profile -> &opendsec-sandbox,

  # The agent's files are read-only to it too (a read-only mount as well).
  deny /.opendsec/{,**} wlk,
"#;

/// What only the sandbox's profile says.
const SANDBOX_RULES: &str = r#"
  # Among sandbox processes, named whole: the deny rules below name the agent alone.
  signal (send,receive) peer="opendsec-agent//&opendsec-sandbox",
  ptrace (trace,read,tracedby,readby) peer="opendsec-agent//&opendsec-sandbox",

  # The agent may signal and read its children; they may neither signal nor trace nor
  # read it (the kernel's SIGCHLD at a child's exit is not mediated).
  signal (receive) peer=opendsec-agent,
  ptrace (readby) peer=opendsec-agent,
  deny signal (send) peer=opendsec-agent,
  deny ptrace (trace,read) peer=opendsec-agent,

  # Nothing of the agent's files, and no way out of this profile.
  deny /.opendsec/{,**} rwlkmx,
  deny change_profile,
"#;

fn profile(name: &str, own_rules: &str) -> String {
    format!(
        "# Written by the OpenDsec edge (edge/src/container/apparmor.rs); replaced at each start.\n\
         abi <abi/3.0>,\n\n\
         profile {name} flags=(attach_disconnected,mediate_deleted) {{{COMMON_RULES}{own_rules}}}\n"
    )
}

/// The text of the agent's profile.
pub fn agent_profile() -> String {
    profile(AGENT_PROFILE, AGENT_RULES)
}

/// The text of the sandbox processes' profile.
pub fn sandbox_profile() -> String {
    profile(SANDBOX_PROFILE, SANDBOX_RULES)
}

/// Both profiles, by name.
pub fn profiles() -> [(&'static str, String); 2] {
    [(AGENT_PROFILE, agent_profile()), (SANDBOX_PROFILE, sandbox_profile())]
}

/// What the kernel offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Host {
    /// AppArmor is on: profiles can be loaded and enforced.
    Enabled,
    /// No AppArmor to use, and why.
    Absent(String),
    /// AppArmor is on but its file system is not mounted: nothing can be loaded.
    Unmounted,
}

/// What the kernel under `sys` (`/sys`, or a fake root) offers.
pub fn detect(sys: &Path) -> Host {
    let securityfs = sys.join("kernel/security/apparmor");
    let enabled = std::fs::read_to_string(sys.join("module/apparmor/parameters/enabled")).ok();
    match (enabled.as_deref().map(str::trim), securityfs.is_dir()) {
        (Some("Y"), true) => Host::Enabled,
        (Some("Y"), false) => Host::Unmounted,
        (Some(_), _) => Host::Absent(
            "AppArmor is built into this kernel but disabled (the boot parameter apparmor=0, or an lsm= list \
             without it)"
                .into(),
        ),
        (None, _) => {
            let lsms = std::fs::read_to_string(sys.join("kernel/security/lsm")).unwrap_or_default();
            let lsms = lsms.trim().trim_end_matches(',');
            Host::Absent(if lsms.is_empty() {
                "this kernel has no AppArmor".into()
            } else {
                format!("this kernel has no AppArmor (its security modules: {lsms})")
            })
        }
    }
}

/// Writes both profiles into `dir` and runs `parser` on them with `args` (for the edge,
/// [`LOAD_ARGS`]: into the kernel). Returns the files written.
pub fn install(dir: &Path, parser: &Path, args: &[&str]) -> Result<Vec<PathBuf>, ContainerError> {
    std::fs::create_dir_all(dir).map_err(|e| ContainerError::io(format!("creating {}", dir.display()), e))?;
    let mut files = Vec::new();
    for (name, text) in profiles() {
        let file = dir.join(name);
        std::fs::write(&file, text).map_err(|e| ContainerError::io(format!("writing {}", file.display()), e))?;
        files.push(file);
    }
    let out = std::process::Command::new(parser)
        .args(args)
        .args(&files)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| ContainerError::io(format!("running {}", parser.display()), e))?;
    if !out.status.success() {
        return Err(ContainerError::Prerequisite(format!(
            "{} {} {} failed ({}): {}",
            parser.display(),
            args.join(" "),
            dir.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(files)
}

/// Where the host has AppArmor, writes the profiles into `dir` and loads them; says once
/// why sandboxes run without them where it has none. Returns whether they are loaded.
/// Fails where AppArmor is on and the profiles cannot be loaded.
pub fn enable(sys: &Path, dir: &Path) -> Result<bool, ContainerError> {
    enable_with(sys, dir, super::runtime::find_binary("apparmor_parser"))
}

/// As [`enable`], with the parser found (`None`: not installed).
fn enable_with(sys: &Path, dir: &Path, parser: Option<PathBuf>) -> Result<bool, ContainerError> {
    const ESCAPE: &str = "Sandboxes are not started without their AppArmor profiles where the kernel has \
                          AppArmor; to run them without (unsafe), start the edge with --insecure-no-apparmor";
    match detect(sys) {
        Host::Absent(why) => {
            tracing::warn!("sandboxes run without an AppArmor profile: {why}");
            Ok(false)
        }
        Host::Unmounted => Err(ContainerError::Prerequisite(format!(
            "AppArmor is enabled in this kernel but {} is missing: mount securityfs there \
             (mount -t securityfs securityfs {}). {ESCAPE}",
            sys.join("kernel/security/apparmor").display(),
            sys.join("kernel/security").display(),
        ))),
        Host::Enabled => {
            let parser = parser.ok_or_else(|| {
                ContainerError::Prerequisite(format!(
                    "the kernel has AppArmor but apparmor_parser is not installed (apt-get install \
                     {PARSER_PACKAGE}). {ESCAPE}"
                ))
            })?;
            install(dir, &parser, LOAD_ARGS).map_err(|e| {
                ContainerError::Prerequisite(format!("loading the sandboxes' AppArmor profiles: {e}. {ESCAPE}"))
            })?;
            tracing::info!(
                profiles = %dir.display(),
                "sandboxes run under AppArmor: the agent under {AGENT_PROFILE}, what it starts under {SANDBOX_LABEL}"
            );
            Ok(true)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Debian package's copy of the 3.0 ABI, which the profiles name: the parser
    /// compiles them as for a kernel with exactly those features.
    const ABI_FILE: &str = "/etc/apparmor.d/abi/3.0";

    fn parser() -> PathBuf {
        super::super::runtime::find_binary("apparmor_parser").unwrap_or_else(|| {
            panic!(
                "apparmor_parser is missing: apt-get install {PARSER_PACKAGE} (./ops/test.sh installs it); \
                 these tests compile the profiles with it"
            )
        })
    }

    /// The rules of a profile: its lines without comments, blank lines or the header.
    fn rules(text: &str) -> Vec<&str> {
        text.lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#') && l.ends_with(','))
            .filter(|l| !l.starts_with("abi "))
            .collect()
    }

    /// Whether `text` has every rule of `expected`, each exactly.
    fn check_has(text: &str, expected: &[&str]) {
        let rules = rules(text);
        for want in expected {
            assert!(rules.contains(want), "missing rule {want:?} in:\n{text}");
        }
    }

    #[test]
    fn the_real_parser_compiles_both_profiles() {
        let dir = tempfile::tempdir().unwrap();
        assert!(
            Path::new(ABI_FILE).is_file(),
            "{ABI_FILE} is missing: apt-get install {PARSER_PACKAGE} (./ops/test.sh installs it)"
        );
        // Everything the edge does but the kernel's part: the same files, the same parser.
        let args = ["--skip-kernel-load", "--skip-cache", "--kernel-features", ABI_FILE];
        let files = install(dir.path(), &parser(), &args).unwrap();
        assert_eq!(
            files,
            [dir.path().join(AGENT_PROFILE), dir.path().join(SANDBOX_PROFILE)]
        );
        // The names the parser finds are the ones the spec and the agent use.
        let out = std::process::Command::new(parser())
            .args(["--names", "--kernel-features", ABI_FILE])
            .args(&files)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        // (in the order its threads finish the files)
        let stdout = String::from_utf8_lossy(&out.stdout);
        let mut names: Vec<&str> = stdout.split_whitespace().collect();
        names.sort();
        assert_eq!(names, [AGENT_PROFILE, SANDBOX_PROFILE]);
    }

    #[test]
    fn the_real_parser_refuses_a_broken_profile() {
        // So that the test above means something: the parser does read the rules.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("broken");
        std::fs::write(&file, agent_profile().replace("deny pivot_root,", "deny pivot_root")).unwrap();
        let out = std::process::Command::new(parser())
            .args(["--skip-kernel-load", "--skip-cache", "--kernel-features", ABI_FILE])
            .arg(&file)
            .output()
            .unwrap();
        assert!(!out.status.success());
    }

    #[test]
    fn a_failing_parser_is_an_error_that_names_it() {
        let dir = tempfile::tempdir().unwrap();
        let e = install(dir.path(), Path::new("/bin/false"), LOAD_ARGS).unwrap_err();
        assert!(e.to_string().contains("/bin/false --replace --skip-cache"), "{e}");
        // The profiles are written all the same, for an operator to read.
        assert_eq!(
            std::fs::read_to_string(dir.path().join(SANDBOX_PROFILE)).unwrap(),
            sandbox_profile()
        );
    }

    #[test]
    fn both_profiles_hold_docker_defaults_denials_and_more() {
        for (name, text) in profiles() {
            assert!(text.contains(&format!(
                "profile {name} flags=(attach_disconnected,mediate_deleted) {{"
            )));
            check_has(
                &text,
                &[
                    "deny mount,",
                    "deny umount,",
                    "deny pivot_root,",
                    "deny /proc/* w,",
                    "deny /proc/sys/** wklx,",
                    "deny /proc/sysrq-trigger rwklx,",
                    "deny /proc/kcore rwklx,",
                    "deny /sys/[^f]*/** wklx,",
                    "deny /sys/firmware/** rwklx,",
                    "deny /sys/kernel/security/** rwklx,",
                ],
            );
            // Nothing that would undo them.
            for rule in rules(&text) {
                assert!(
                    ![
                        "mount,",
                        "umount,",
                        "pivot_root,",
                        "ptrace,",
                        "signal,",
                        "change_profile,"
                    ]
                    .contains(&rule),
                    "{name} allows everything of a kind: {rule}"
                );
            }
        }
    }

    #[test]
    fn the_sandbox_profile_keeps_sandbox_code_off_the_agent() {
        let text = sandbox_profile();
        check_has(
            &text,
            &[
                "deny /.opendsec/{,**} rwlkmx,",
                "deny signal (send) peer=opendsec-agent,",
                "deny ptrace (trace,read) peer=opendsec-agent,",
                "deny change_profile,",
            ],
        );
        // Towards the agent alone, it allows only what the agent does to its children.
        let towards_agent: Vec<&str> = rules(&text)
            .into_iter()
            .filter(|r| !r.starts_with("deny ") && r.contains(&format!("peer={AGENT_PROFILE},")))
            .collect();
        assert_eq!(
            towards_agent,
            [
                "signal (receive) peer=opendsec-agent,",
                "ptrace (readby) peer=opendsec-agent,"
            ]
        );
        // Among sandbox processes everything is allowed, named by the whole stack.
        assert!(text.contains(&format!("signal (send,receive) peer=\"{SANDBOX_LABEL}\",")));
        // The kernel names a stack by its profiles in sorted order: this is that name.
        assert!(AGENT_PROFILE < SANDBOX_PROFILE);
        assert_eq!(SANDBOX_LABEL, format!("{AGENT_PROFILE}//&{SANDBOX_PROFILE}"));
        // The only rules that mention the agent's files deny them.
        assert!(
            rules(&text)
                .iter()
                .filter(|r| r.contains("/.opendsec"))
                .all(|r| r.starts_with("deny "))
        );
    }

    #[test]
    fn the_agent_profile_may_only_stack_the_sandbox_profile() {
        let text = agent_profile();
        check_has(
            &text,
            &["change_profile -> &opendsec-sandbox,", "deny /.opendsec/{,**} wlk,"],
        );
        let changes: Vec<&str> = rules(&text)
            .into_iter()
            .filter(|r| r.contains("change_profile"))
            .collect();
        assert_eq!(changes, ["change_profile -> &opendsec-sandbox,"]);
    }

    /// A fake sysfs root: `enabled` is the module's parameter (None: no module),
    /// `securityfs` whether its directory exists, `lsm` the list of security modules.
    fn sys(enabled: Option<&str>, securityfs: bool, lsm: &str) -> tempfile::TempDir {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("kernel/security")).unwrap();
        std::fs::write(root.path().join("kernel/security/lsm"), lsm).unwrap();
        if let Some(v) = enabled {
            std::fs::create_dir_all(root.path().join("module/apparmor/parameters")).unwrap();
            std::fs::write(root.path().join("module/apparmor/parameters/enabled"), v).unwrap();
        }
        if securityfs {
            std::fs::create_dir_all(root.path().join("kernel/security/apparmor")).unwrap();
        }
        root
    }

    #[test]
    fn detection_reads_the_module_and_securityfs() {
        let lsm = "lockdown,capability,landlock,bpf";
        for (enabled, securityfs, expected) in [
            (Some("Y\n"), true, Host::Enabled),
            (Some("Y\n"), false, Host::Unmounted),
            (
                Some("N\n"),
                true,
                Host::Absent(
                    "AppArmor is built into this kernel but disabled (the boot parameter apparmor=0, or an lsm= \
                     list without it)"
                        .into(),
                ),
            ),
            (
                None,
                false,
                Host::Absent(
                    "this kernel has no AppArmor (its security modules: lockdown,capability,landlock,bpf)".into(),
                ),
            ),
        ] {
            let root = sys(enabled, securityfs, lsm);
            assert_eq!(detect(root.path()), expected, "{enabled:?} {securityfs}");
        }
    }

    #[test]
    fn without_apparmor_nothing_is_written_or_loaded() {
        let root = sys(None, false, "capability,selinux");
        let dir = tempfile::tempdir().unwrap();
        let profiles = dir.path().join("apparmor");
        assert!(!enable(root.path(), &profiles).unwrap());
        assert!(!profiles.exists());
        let root = sys(Some("N"), true, "capability");
        assert!(!enable(root.path(), &profiles).unwrap());
        assert!(!profiles.exists());
    }

    #[test]
    fn apparmor_whose_profiles_cannot_be_loaded_stops_the_edge_and_names_the_escape() {
        let root = sys(Some("Y"), true, "capability,apparmor");
        let dir = tempfile::tempdir().unwrap();
        let e = enable_with(root.path(), dir.path(), Some("/bin/false".into()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/bin/false --replace") && e.contains("--insecure-no-apparmor"),
            "{e}"
        );
        let e = enable_with(root.path(), dir.path(), None).unwrap_err().to_string();
        assert!(
            e.contains("apt-get install apparmor") && e.contains("--insecure-no-apparmor"),
            "{e}"
        );
    }

    #[test]
    fn apparmor_without_securityfs_stops_the_edge_and_names_the_escape() {
        let root = sys(Some("Y"), false, "capability,apparmor");
        let dir = tempfile::tempdir().unwrap();
        let e = enable(root.path(), dir.path()).unwrap_err().to_string();
        assert!(
            e.contains("mount -t securityfs") && e.contains("--insecure-no-apparmor"),
            "{e}"
        );
    }
}
