//! The project's own image builders: `busybox` (one static binary, for fast tests),
//! `base` (Debian bookworm via debootstrap, then what E2B code calls: `python`, `pip`,
//! `sudo` for `user`, `node`, `npm`) and `code-interpreter-v1` (`base` plus one layer:
//! numpy, pandas, matplotlib, jupyter_client, ipykernel, IRkernel, TypeScript, a JDK and
//! JJava (the Java kernel), OpenDsec's
//! Bash, JavaScript and TypeScript kernels and the code-interpreter server) and
//! `mcp-gateway` (`base` plus FastMCP and Docker's `time` and `git` reference servers,
//! pinned by digest, under OpenDsec's `mcp-gateway` command: E2B's `Sandbox.create(mcp=...)`
//! template). Each builds
//! one layer into a scratch directory; the store publishes it with a rename. Builders
//! run the host tools under `env -i` so that host settings (proxies for pip, locales) do
//! not leak into images, and use the tools' default package sources (for apt inside an
//! image, the sources debootstrap wrote): no registry host appears here.

use std::collections::BTreeMap;
use std::fmt;
use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::{PermissionsExt, symlink};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use super::{ImageConfig, ImageError, StartSpec, build_root, io_err};

/// PATH given to the build tools (nothing else of the caller's environment is passed).
const BUILD_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// Packages that `base` adds to debootstrap's minbase (debootstrap follows Depends
/// only: nothing merely recommended comes with them).
const BASE_PACKAGES: &str = "bash,coreutils,python3,curl,git,ca-certificates,procps";

/// What E2B code calls beside those: `python` (python-is-python3), `pip`, `sudo`, `node`
/// and `npm`. apt installs them after debootstrap, with `--no-install-recommends` (pip
/// would recommend build-essential and python3-dev, npm git and node-tap): debootstrap's
/// own resolver cannot settle npm's dependencies and leaves dozens of node-* packages
/// unconfigured.
const BASE_APT_PACKAGES: &[&str] = &["python-is-python3", "python3-pip", "sudo", "nodejs", "npm"];

/// `user` has passwordless sudo, as in E2B's sandboxes (checked with `visudo -c` at build).
/// A container sandbox runs with no_new_privileges on a nosuid overlay
/// (`container/oci.rs`), where sudo cannot become root and says so; the entry serves
/// where setuid works (the image itself, machines).
const BASE_SUDOERS: &[u8] = b"user ALL=(ALL:ALL) NOPASSWD: ALL\n";

/// E2B's images let `pip install x` (and `pip install --user x`) just work; Debian marks
/// its Python externally managed (PEP 668), so pip would refuse both and point to a
/// venv. pip's own setting lifts that for every user and survives upgrades of python3
/// (deleting the EXTERNALLY-MANAGED marker would not). It is safe enough here: Debian's
/// pip installs into /usr/local or ~/.local and never removes or overwrites a file of a
/// Debian package, so apt's packages stay whole; what pip installs is the sandbox's own.
const BASE_PIP_CONF: &[u8] = b"# E2B-style: `pip install` works without a venv (see PEP 668). pip writes only to\n\
# /usr/local (as root) or ~/.local (--user) and leaves Debian's packages untouched.\n\
[global]\n\
break-system-packages = true\n";

const BASE_FILES: &[LayerFile] = &[
    LayerFile {
        path: "/etc/sudoers.d/user",
        contents: BASE_SUDOERS,
        mode: 0o440,
    },
    LayerFile {
        path: "/etc/pip.conf",
        contents: BASE_PIP_CONF,
        mode: 0o644,
    },
];

/// Packages the code-interpreter layer installs with apt on top of `base`: the Python
/// data stack and Jupyter's kernel client and Python kernel (the server runs every
/// context on a kernel), pexpect for the Bash kernel, TypeScript's transpiler for the
/// TypeScript kernel (node is in `base`), R with IRkernel, and a JDK (jshell, which the
/// Java kernel [`JAVA_KERNEL`] runs cells on; about 270 MB). munkres settles fonttools'
/// `python3-scipy | python3-munkres` dependency: apt would pick scipy, which brings
/// pythran and with it gcc, g++ and python3-dev (about 600 MB).
const CODE_INTERPRETER_PACKAGES: &[&str] = &[
    "python3-numpy",
    "python3-pandas",
    "python3-matplotlib",
    "python3-munkres",
    "python3-jupyter-client",
    "python3-ipykernel",
    "python3-pexpect",
    "node-typescript",
    "r-cran-irkernel",
    "default-jdk-headless",
];

/// The Java kernel: DFLib's JJava (IJava's maintained successor) from PyPI, pinned with
/// its wheel's digest. The host's pip downloads the wheel (with the host's configuration
/// and trusted CAs, as every other host tool here), and the image's pip installs that
/// file without an index: its kernel spec goes to /usr/local/share/jupyter/kernels/java,
/// where jupyter_client finds it. Debian packages no Java kernel.
pub const JAVA_KERNEL: &str = "jjava==1.0a8";
const JAVA_KERNEL_WHEEL: &str = "jjava-1.0a8-py3-none-any.whl";
const JAVA_KERNEL_SHA256: &str = "b86ddf2eee6037a33a0adc2ac2f318a94638f42eefaeeeb13db381587e5f2a69";

/// The code-interpreter server (E2B's port 49999 API), built into the binary so that
/// the image can be built anywhere, and hashed into the layer id.
pub(super) const CODE_INTERPRETER_SERVER: &[u8] = include_bytes!("../../images/code-interpreter/server.py");

/// Where the server lives in the image.
pub const CODE_INTERPRETER_SERVER_PATH: &str = "/opt/opendsec/code-interpreter/server.py";

/// The port the SDK calls the server on (`e2b_code_interpreter.constants.JUPYTER_PORT`).
pub const CODE_INTERPRETER_PORT: u16 = 49999;

/// E2B's SDK creates a sandbox asked for `mcp=` from the template of this name, then runs
/// `mcp-gateway --config <json>` in it as root.
pub const MCP_GATEWAY_IMAGE: &str = "mcp-gateway";

/// The gateway's command (`edge/images/mcp-gateway/mcp_gateway.py`: it translates E2B's
/// configuration for FastMCP's proxy and keeps it running; its doc comment says how).
const MCP_GATEWAY_FILES: &[LayerFile] = &[
    LayerFile {
        path: "/usr/local/bin/mcp-gateway",
        contents: include_bytes!("../../images/mcp-gateway/mcp_gateway.py"),
        mode: 0o755,
    },
    LayerFile {
        path: MCP_GATEWAY_REQUIREMENTS,
        contents: include_bytes!("../../images/mcp-gateway/requirements.txt"),
        mode: 0o644,
    },
];

/// Every Python package of the gateway, `name==version --hash=sha256:...`.
const MCP_GATEWAY_REQUIREMENTS: &str = "/opt/mcp-gateway/requirements.txt";

/// Where those packages are installed (`pip --target`; the command puts it on its path).
const MCP_GATEWAY_SITE: &str = "/opt/mcp-gateway/site";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BuildPhase {
    Lock,
    Download,
    Extract,
    Bootstrap,
    Install,
    Configure,
    Cleanup,
    Done,
}

impl fmt::Display for BuildPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BuildPhase::Lock => "lock",
            BuildPhase::Download => "download",
            BuildPhase::Extract => "extract",
            BuildPhase::Bootstrap => "bootstrap",
            BuildPhase::Install => "install",
            BuildPhase::Configure => "configure",
            BuildPhase::Cleanup => "cleanup",
            BuildPhase::Done => "done",
        })
    }
}

/// One progress report of a build: the phase and a human-readable line.
#[derive(Clone, Debug)]
pub struct BuildProgress {
    pub phase: BuildPhase,
    pub message: String,
}

impl BuildProgress {
    pub fn new(phase: BuildPhase, message: impl Into<String>) -> Self {
        Self {
            phase,
            message: message.into(),
        }
    }
}

pub fn builder_names() -> Vec<&'static str> {
    vec!["busybox", "base", "code-interpreter-v1", MCP_GATEWAY_IMAGE]
}

/// A file a recipe puts into its layer (its contents are part of the layer id).
pub(super) struct LayerFile {
    /// Absolute path in the image.
    pub(super) path: &'static str,
    pub(super) contents: &'static [u8],
    pub(super) mode: u32,
}

/// What a builder produces; its hash names the layer, so a changed recipe builds a
/// new layer instead of reusing a stale one.
pub(super) struct Recipe {
    pub(super) name: &'static str,
    pub(super) version: u32,
    /// The packages (or other inputs) of the layer, as the builder uses them.
    pub(super) inputs: String,
    pub(super) files: &'static [LayerFile],
    /// The image whose layers this one goes on top of.
    pub(super) parent: Option<&'static str>,
    pub(super) shell: &'static str,
    pub(super) start: Option<fn() -> StartSpec>,
}

/// The server and the kernels it runs from beside it (Debian packages no Bash,
/// JavaScript or TypeScript kernel that installs without prebuilt binaries from other
/// hosts; R's is Debian's IRkernel).
const CODE_INTERPRETER_FILES: &[LayerFile] = &[
    LayerFile {
        path: CODE_INTERPRETER_SERVER_PATH,
        contents: CODE_INTERPRETER_SERVER,
        mode: 0o644,
    },
    LayerFile {
        path: "/opt/opendsec/code-interpreter/python_kernel.py",
        contents: include_bytes!("../../images/code-interpreter/python_kernel.py"),
        mode: 0o644,
    },
    LayerFile {
        path: "/opt/opendsec/code-interpreter/python_startup.py",
        contents: include_bytes!("../../images/code-interpreter/python_startup.py"),
        mode: 0o644,
    },
    LayerFile {
        path: "/opt/opendsec/code-interpreter/bash_kernel.py",
        contents: include_bytes!("../../images/code-interpreter/bash_kernel.py"),
        mode: 0o644,
    },
    LayerFile {
        path: "/opt/opendsec/code-interpreter/node_kernel.py",
        contents: include_bytes!("../../images/code-interpreter/node_kernel.py"),
        mode: 0o644,
    },
    LayerFile {
        path: "/opt/opendsec/code-interpreter/node_kernel.js",
        contents: include_bytes!("../../images/code-interpreter/node_kernel.js"),
        mode: 0o644,
    },
];

pub(super) fn recipe(name: &str) -> Option<Recipe> {
    match name {
        "busybox" => Some(Recipe {
            name: "busybox",
            version: 1,
            inputs: "busybox-static".into(),
            files: &[],
            parent: None,
            shell: "/bin/sh",
            start: None,
        }),
        "base" => Some(Recipe {
            name: "base",
            version: 2,
            inputs: format!("{BASE_PACKAGES};apt {}", BASE_APT_PACKAGES.join(",")),
            files: BASE_FILES,
            parent: None,
            shell: "/bin/bash",
            start: None,
        }),
        "code-interpreter-v1" => Some(Recipe {
            name: "code-interpreter-v1",
            version: 4,
            inputs: format!("{};pip {JAVA_KERNEL}", CODE_INTERPRETER_PACKAGES.join(",")),
            files: CODE_INTERPRETER_FILES,
            parent: Some("base"),
            shell: "/bin/bash",
            start: Some(code_interpreter_start),
        }),
        MCP_GATEWAY_IMAGE => Some(Recipe {
            name: MCP_GATEWAY_IMAGE,
            version: 1,
            // The pinned requirements are one of the files: a new pin is a new layer.
            inputs: "pip --require-hashes".into(),
            files: MCP_GATEWAY_FILES,
            parent: Some("base"),
            shell: "/bin/bash",
            start: None,
        }),
        _ => None,
    }
}

/// The template's start command: the server as `user`, ready when its port answers; it
/// takes the sandbox's variables on its stdin, so warm containers run it ahead of need.
pub fn code_interpreter_start() -> StartSpec {
    StartSpec {
        cmd: "/usr/bin/python3".into(),
        args: vec![
            CODE_INTERPRETER_SERVER_PATH.into(),
            "--port".into(),
            CODE_INTERPRETER_PORT.to_string(),
            "--claim-stdin".into(),
        ],
        envs: BTreeMap::new(),
        cwd: "/home/user".into(),
        user: "user".into(),
        ready_port: Some(CODE_INTERPRETER_PORT),
        ready_cmd: None,
        claim_stdin: true,
    }
}

/// The layer ids of image `name` as its recipes would make them, bottom first; `None`
/// when no builder knows it (or one of its parents).
pub(super) fn layer_ids(name: &str) -> Option<Vec<String>> {
    let recipe = recipe(name)?;
    let mut layers = match recipe.parent {
        Some(parent) => layer_ids(parent)?,
        None => Vec::new(),
    };
    let id = recipe.layer_id(&layers);
    layers.push(id);
    Some(layers)
}

impl Recipe {
    /// Hashes name, version, inputs, files and the layers below. Recipes without files
    /// or parents hash exactly as before those existed, so their layers stay valid.
    pub(super) fn layer_id(&self, parent_layers: &[String]) -> String {
        let mut digest = Sha256::new();
        digest.update(format!("{}\n{}\n{}", self.name, self.version, self.inputs));
        for file in self.files {
            digest.update(format!("\nfile {} {:o} ", file.path, file.mode));
            digest.update(Sha256::digest(file.contents));
        }
        for layer in parent_layers {
            digest.update(format!("\non {layer}"));
        }
        format!("{}-{}", self.name, &hex::encode(digest.finalize())[..16])
    }

    pub(super) fn config(&self) -> ImageConfig {
        ImageConfig {
            env: vec![
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
                "HOME=/home/user".into(),
                "LANG=C.UTF-8".into(),
            ],
            user: "user".into(),
            workdir: "/home/user".into(),
            shell: self.shell.into(),
            start: self.start.map(|start| start()),
            ..ImageConfig::default()
        }
    }
}

/// Builds the recipe's own layer into `dir`; `lower` are the parent's layer dirs,
/// bottom first (empty for a recipe without parent).
pub(super) fn build_layer(
    recipe: &Recipe,
    lower: &[PathBuf],
    dir: &Path,
    progress: &dyn Fn(&BuildProgress),
) -> Result<(), ImageError> {
    match recipe.name {
        "busybox" => build_busybox(dir, progress),
        "base" => build_base(recipe, dir, progress),
        "code-interpreter-v1" => build_code_interpreter(recipe, lower, dir, progress),
        MCP_GATEWAY_IMAGE => build_mcp_gateway(recipe, lower, dir, progress),
        other => Err(ImageError::UnknownImage(other.into())),
    }
}

fn fail(image: &str, phase: BuildPhase, message: impl Into<String>) -> ImageError {
    ImageError::Build {
        image: image.into(),
        phase,
        message: message.into(),
    }
}

/// Runs a command under `env -i`, streaming its output lines as progress and keeping
/// the last lines for the error message.
fn run_tool(
    image: &str,
    phase: BuildPhase,
    cwd: &Path,
    program: &str,
    args: &[&str],
    progress: &dyn Fn(&BuildProgress),
) -> Result<(), ImageError> {
    let mut command = Command::new(program);
    command
        .args(args)
        .current_dir(cwd)
        .env_clear()
        .env("PATH", BUILD_PATH)
        .env("LANG", "C.UTF-8")
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // A builder that dies takes its tool with it (and so the tool's mount namespace,
    // for tools run in a build root). The calling thread waits for the tool below, so
    // the signal, which follows the parent thread, never comes early.
    // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn().map_err(|e| {
        let package = match program {
            "debootstrap" => "debootstrap",
            "apt-get" => "apt",
            "dpkg-deb" => "dpkg",
            _ => program,
        };
        fail(
            image,
            phase,
            format!("cannot run {program} (install the {package} package): {e}"),
        )
    })?;
    let stderr = child.stderr.take().expect("piped");
    let stderr_reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            lines.push(line);
        }
        lines
    });
    let mut tail: Vec<String> = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped"))
        .lines()
        .map_while(Result::ok)
    {
        progress(&BuildProgress::new(phase, line.clone()));
        tail.push(line);
        if tail.len() > 10 {
            tail.remove(0);
        }
    }
    let status = child.wait().map_err(io_err(format!("waiting for {program}")))?;
    let err_lines = stderr_reader.join().unwrap_or_default();
    if status.success() {
        return Ok(());
    }
    tail.extend(
        err_lines
            .into_iter()
            .rev()
            .take(10)
            .collect::<Vec<_>>()
            .into_iter()
            .rev(),
    );
    Err(fail(
        image,
        phase,
        format!("{program} {} failed ({status}): {}", args.join(" "), tail.join(" | ")),
    ))
}

fn mkdirs(dir: &Path, paths: &[(&str, u32)]) -> Result<(), ImageError> {
    for (path, mode) in paths {
        let p = dir.join(path);
        fs::create_dir_all(&p).map_err(io_err(format!("creating {}", p.display())))?;
        fs::set_permissions(&p, fs::Permissions::from_mode(*mode)).map_err(io_err(format!("chmod {}", p.display())))?;
    }
    Ok(())
}

fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), ImageError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io_err(format!("chown {}", path.display())))
}

fn build_busybox(dir: &Path, progress: &dyn Fn(&BuildProgress)) -> Result<(), ImageError> {
    const IMAGE: &str = "busybox";
    let work = dir.with_extension("download");
    let _ = super::remove_tree(&work);
    fs::create_dir_all(&work).map_err(io_err("creating the download dir"))?;
    let result = (|| {
        progress(&BuildProgress::new(
            BuildPhase::Download,
            "apt-get download busybox-static",
        ));
        run_tool(
            IMAGE,
            BuildPhase::Download,
            &work,
            "apt-get",
            // As root apt wants to drop to the `_apt` user, which cannot write here.
            &["-q", "-o", "APT::Sandbox::User=root", "download", "busybox-static"],
            progress,
        )
        .map_err(|e| match e {
            ImageError::Build { image, phase, message } => ImageError::Build {
                image,
                phase,
                message: format!("{message} (has `apt-get update` run?)"),
            },
            other => other,
        })?;
        let deb = fs::read_dir(&work)
            .map_err(io_err("listing the download dir"))?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .ok_or_else(|| fail(IMAGE, BuildPhase::Download, "apt-get download produced no .deb"))?;
        progress(&BuildProgress::new(
            BuildPhase::Extract,
            format!("dpkg-deb -x {}", deb.display()),
        ));
        let extracted = work.join("x");
        run_tool(
            IMAGE,
            BuildPhase::Extract,
            &work,
            "dpkg-deb",
            &[
                "-x",
                deb.to_str().expect("utf-8 path"),
                extracted.to_str().expect("utf-8 path"),
            ],
            progress,
        )?;
        let binary = extracted.join("bin/busybox");
        if !binary.is_file() {
            return Err(fail(IMAGE, BuildPhase::Extract, "the package has no bin/busybox"));
        }

        progress(&BuildProgress::new(
            BuildPhase::Configure,
            "applets, users, directories",
        ));
        fs::create_dir_all(dir).map_err(io_err("creating the layer dir"))?;
        mkdirs(
            dir,
            &[
                ("bin", 0o755),
                ("sbin", 0o755),
                ("usr/bin", 0o755),
                ("usr/sbin", 0o755),
                ("etc", 0o755),
                ("root", 0o700),
                ("home/user", 0o755),
                ("tmp", 0o1777),
                ("var/tmp", 0o1777),
                ("proc", 0o555),
                ("sys", 0o555),
                ("dev", 0o755),
                ("run", 0o755),
            ],
        )?;
        fs::copy(&binary, dir.join("bin/busybox")).map_err(io_err("copying busybox"))?;
        fs::set_permissions(dir.join("bin/busybox"), fs::Permissions::from_mode(0o755))
            .map_err(io_err("chmod busybox"))?;
        // The static binary runs on the host and tells where each applet belongs.
        let out = Command::new(dir.join("bin/busybox"))
            .arg("--list-full")
            .env_clear()
            .output()
            .map_err(io_err("running busybox --list-full"))?;
        if !out.status.success() {
            return Err(fail(IMAGE, BuildPhase::Configure, "busybox --list-full failed"));
        }
        for applet in String::from_utf8_lossy(&out.stdout).lines() {
            let applet = applet.trim().trim_start_matches('/');
            if applet.is_empty() || applet == "bin/busybox" || applet.contains("..") {
                continue;
            }
            let link = dir.join(applet);
            if let Some(parent) = link.parent() {
                fs::create_dir_all(parent).map_err(io_err("creating applet dir"))?;
            }
            if link.symlink_metadata().is_err() {
                symlink("/bin/busybox", &link).map_err(io_err(format!("linking {applet}")))?;
            }
        }
        write_accounts(dir, "/bin/sh")?;
        chown(&dir.join("home/user"), 1000, 1000)?;
        fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(io_err("chmod layer"))?;
        Ok(())
    })();
    let _ = super::remove_tree(&work);
    result
}

fn write_accounts(dir: &Path, shell: &str) -> Result<(), ImageError> {
    let files = [
        (
            "etc/passwd",
            format!(
                "root:x:0:0:root:/root:{shell}\nuser:x:1000:1000:user:/home/user:{shell}\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
            ),
        ),
        ("etc/group", "root:x:0:\nuser:x:1000:\nnogroup:x:65534:\n".to_string()),
        ("etc/hosts", "127.0.0.1 localhost\n::1 localhost\n".to_string()),
    ];
    for (path, content) in files {
        fs::write(dir.join(path), content).map_err(io_err(format!("writing {path}")))?;
    }
    Ok(())
}

/// debootstrap's minbase with [`BASE_PACKAGES`], then, in a build root bound over that
/// same tree, apt's [`BASE_APT_PACKAGES`], the account `user` and the recipe's files.
fn build_base(recipe: &Recipe, dir: &Path, progress: &dyn Fn(&BuildProgress)) -> Result<(), ImageError> {
    let image = recipe.name;
    fs::create_dir_all(dir).map_err(io_err("creating the layer dir"))?;
    let target = dir.to_str().expect("utf-8 path");
    progress(&BuildProgress::new(
        BuildPhase::Bootstrap,
        format!("debootstrap --variant=minbase --include={BASE_PACKAGES} bookworm (about a minute)"),
    ));
    let include = format!("--include={BASE_PACKAGES}");
    run_tool(
        image,
        BuildPhase::Bootstrap,
        dir.parent().unwrap_or(Path::new("/")),
        "debootstrap",
        &["--variant=minbase", &include, "bookworm", target],
        progress,
    )?;
    let scratch = dir.with_extension("root");
    let _ = super::remove_tree(&scratch);
    build_root::with_build_root(&[], dir, &scratch, progress, |root, progress| {
        let root_arg = root.to_str().expect("utf-8 path");
        let in_root = |phase: BuildPhase, args: &[&str]| {
            let mut argv = vec![root_arg];
            argv.extend_from_slice(args);
            run_tool(image, phase, Path::new("/"), "chroot", &argv, progress)
        };
        apt_get_install(&in_root, "the sources debootstrap wrote", BASE_APT_PACKAGES, progress)?;

        progress(&BuildProgress::new(
            BuildPhase::Configure,
            "useradd user (uid 1000, /home/user, bash), sudoers, pip.conf",
        ));
        in_root(
            BuildPhase::Configure,
            &[
                "useradd",
                "--create-home",
                "--home-dir",
                "/home/user",
                "--uid",
                "1000",
                "--user-group",
                "--shell",
                "/bin/bash",
                "user",
            ],
        )?;
        write_files(root, recipe.files)?;
        // A sudoers file sudo cannot parse would break sudo for everyone: never publish one.
        in_root(BuildPhase::Configure, &["visudo", "--check"])?;

        progress(&BuildProgress::new(
            BuildPhase::Cleanup,
            "dropping apt caches and lists",
        ));
        drop_apt_caches(root);
        // Runtimes bind their own files over these; an empty hostname avoids the build host's.
        let _ = fs::write(root.join("etc/hostname"), "");
        Ok(())
    })
}

/// Writes a recipe's files into the tree at `root` (owned by root, with their modes).
fn write_files(root: &Path, files: &[LayerFile]) -> Result<(), ImageError> {
    for file in files {
        let path = root.join(file.path.trim_start_matches('/'));
        let parent = path.parent().expect("a file path has a parent");
        fs::create_dir_all(parent).map_err(io_err(format!("creating {}", parent.display())))?;
        fs::write(&path, file.contents).map_err(io_err(format!("writing {}", file.path)))?;
        fs::set_permissions(&path, fs::Permissions::from_mode(file.mode))
            .map_err(io_err(format!("chmod {}", file.path)))?;
    }
    Ok(())
}

/// Removes apt's downloaded packages, package lists and caches under `root` (keeping
/// the lock files and directories apt expects): an image needs `apt-get update` first.
fn drop_apt_caches(root: &Path) {
    for sub in [
        "var/cache/apt/archives",
        "var/cache/apt/archives/partial",
        "var/lib/apt/lists",
        "var/lib/apt/lists/partial",
    ] {
        let path = root.join(sub);
        if let Ok(entries) = fs::read_dir(&path) {
            for entry in entries.filter_map(Result::ok) {
                let p = entry.path();
                if p.is_file() && p.file_name().is_some_and(|n| n != "lock") {
                    let _ = fs::remove_file(&p);
                }
            }
        }
    }
    for bin in ["var/cache/apt/pkgcache.bin", "var/cache/apt/srcpkgcache.bin"] {
        let _ = fs::remove_file(root.join(bin));
    }
}

/// `base` plus one layer: apt installs the Python data stack in a build root over the
/// base layers, the server goes to /opt/opendsec/code-interpreter, and matplotlib's
/// font cache is made once here (as `user`) instead of at every sandbox's first plot.
fn build_code_interpreter(
    recipe: &Recipe,
    lower: &[PathBuf],
    dir: &Path,
    progress: &dyn Fn(&BuildProgress),
) -> Result<(), ImageError> {
    let (image, files) = (recipe.name, recipe.files);
    build_on(lower, dir, progress, |root, progress| {
        let root_arg = root.to_str().expect("utf-8 path");
        let in_root = |phase: BuildPhase, args: &[&str]| {
            let mut argv = vec![root_arg];
            argv.extend_from_slice(args);
            run_tool(image, phase, Path::new("/"), "chroot", &argv, progress)
        };
        apt_get_install(&in_root, "the image's own sources", CODE_INTERPRETER_PACKAGES, progress)?;
        install_java_kernel(image, root, &in_root, progress)?;

        progress(&BuildProgress::new(
            BuildPhase::Configure,
            format!("{CODE_INTERPRETER_SERVER_PATH}, matplotlib font cache"),
        ));
        write_files(root, files)?;
        // As the sandbox user, so the cache lands in its home with its ownership.
        run_tool(
            image,
            BuildPhase::Configure,
            Path::new("/"),
            "chroot",
            &[
                "--userspec=1000:1000",
                root_arg,
                "/usr/bin/env",
                "HOME=/home/user",
                "/usr/bin/python3",
                "-c",
                "import matplotlib.pyplot, numpy, pandas",
            ],
            progress,
        )?;

        progress(&BuildProgress::new(
            BuildPhase::Cleanup,
            "dropping apt caches and lists",
        ));
        drop_apt_caches(root);
        Ok(())
    })
}

/// Builds a layer into `dir` on the layers `lower` (bottom first): `build` runs with the
/// build root, an overlay of them whose upper directory is `dir`, in a private mount
/// namespace.
fn build_on<F>(lower: &[PathBuf], dir: &Path, progress: &dyn Fn(&BuildProgress), build: F) -> Result<(), ImageError>
where
    F: FnOnce(&Path, &dyn Fn(&BuildProgress)) -> Result<(), ImageError> + Send,
{
    fs::create_dir_all(dir).map_err(io_err("creating the layer dir"))?;
    // The overlay's root directory takes the upper dir's attributes.
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755)).map_err(io_err("chmod layer"))?;
    let scratch = dir.with_extension("root");
    let _ = super::remove_tree(&scratch);
    progress(&BuildProgress::new(
        BuildPhase::Configure,
        format!("overlay of {} lower layer(s) in a private mount namespace", lower.len()),
    ));
    build_root::with_build_root(lower, dir, &scratch, progress, build)
}

/// Where wheels the host's pip downloaded wait in a build root for the image's pip
/// (removed once installed: never part of a layer).
const WHEELS_IN_ROOT: &str = "/tmp/opendsec-wheels";

/// [`WHEELS_IN_ROOT`] in build root `root`, made anew and empty.
fn fresh_wheels_dir(root: &Path) -> Result<PathBuf, ImageError> {
    let wheels = root.join(WHEELS_IN_ROOT.trim_start_matches('/'));
    let _ = fs::remove_dir_all(&wheels);
    fs::create_dir_all(&wheels).map_err(io_err("making the wheels directory"))?;
    Ok(wheels)
}

/// The host's pip (its configuration and trusted CAs, as every other host tool here)
/// downloads the binary wheels `args` name into `wheels`, each alone (`--no-deps`).
fn host_pip_download(
    image: &str,
    wheels: &Path,
    args: &[&str],
    progress: &dyn Fn(&BuildProgress),
) -> Result<(), ImageError> {
    let mut argv = vec![
        "-m",
        "pip",
        "download",
        "-q",
        "--no-deps",
        "--no-cache-dir",
        "--only-binary=:all:",
        "-d",
        wheels.to_str().expect("utf-8 path"),
    ];
    argv.extend_from_slice(args);
    run_tool(
        image,
        BuildPhase::Download,
        Path::new("/"),
        "/usr/bin/python3",
        &argv,
        progress,
    )
}

/// `base` plus the gateway: the host's pip downloads every wheel the requirements pin
/// (checking each digest, for the image's CPython 3.11 on x86-64), the image's pip
/// installs exactly those files, checking them again, into [`MCP_GATEWAY_SITE`]; the
/// wheels are removed and the gateway's imports are tried once.
fn build_mcp_gateway(
    recipe: &Recipe,
    lower: &[PathBuf],
    dir: &Path,
    progress: &dyn Fn(&BuildProgress),
) -> Result<(), ImageError> {
    let (image, files) = (recipe.name, recipe.files);
    build_on(lower, dir, progress, |root, progress| {
        let root_arg = root.to_str().expect("utf-8 path");
        write_files(root, files)?;
        let wheels = fresh_wheels_dir(root)?;
        let requirements = root.join(MCP_GATEWAY_REQUIREMENTS.trim_start_matches('/'));
        progress(&BuildProgress::new(
            BuildPhase::Download,
            "pip download --require-hashes: fastmcp, mcp-server-time, mcp-server-git and their dependencies (the host's pip)",
        ));
        host_pip_download(
            image,
            &wheels,
            &[
                "--require-hashes",
                "--implementation",
                "cp",
                "--python-version",
                "3.11",
                "--platform",
                "manylinux2014_x86_64",
                "--platform",
                "manylinux_2_17_x86_64",
                "--platform",
                "manylinux_2_28_x86_64",
                "--platform",
                "manylinux_2_5_x86_64",
                "--platform",
                "manylinux1_x86_64",
                "-r",
                requirements.to_str().expect("utf-8 path"),
            ],
            progress,
        )?;
        progress(&BuildProgress::new(
            BuildPhase::Install,
            format!("pip install --no-index --target {MCP_GATEWAY_SITE}"),
        ));
        let installed = run_tool(
            image,
            BuildPhase::Install,
            Path::new("/"),
            "chroot",
            &[
                root_arg,
                "/usr/bin/python3",
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-cache-dir",
                "--require-hashes",
                "--find-links",
                WHEELS_IN_ROOT,
                "--target",
                MCP_GATEWAY_SITE,
                "-r",
                MCP_GATEWAY_REQUIREMENTS,
            ],
            progress,
        );
        let _ = fs::remove_dir_all(&wheels);
        installed?;
        progress(&BuildProgress::new(
            BuildPhase::Configure,
            "the gateway's imports (fastmcp, the servers) checked",
        ));
        run_tool(
            image,
            BuildPhase::Configure,
            Path::new("/"),
            "chroot",
            &[
                root_arg,
                "/usr/bin/env",
                &format!("PYTHONPATH={MCP_GATEWAY_SITE}"),
                "/usr/bin/python3",
                "-c",
                "import fastmcp.server, mcp_server_time, mcp_server_git",
            ],
            progress,
        )
    })
}

/// Downloads [`JAVA_KERNEL`]'s wheel with the host's pip into the build root's /tmp,
/// checks its digest, and installs it with the image's pip, offline; the wheel is removed.
fn install_java_kernel(
    image: &str,
    root: &Path,
    in_root: &InRoot<'_>,
    progress: &dyn Fn(&BuildProgress),
) -> Result<(), ImageError> {
    let wheels = fresh_wheels_dir(root)?;
    progress(&BuildProgress::new(
        BuildPhase::Download,
        format!("pip download {JAVA_KERNEL} (the Java kernel; the host's pip, python3-pip)"),
    ));
    host_pip_download(image, &wheels, &[JAVA_KERNEL], progress)?;
    let wheel = wheels.join(JAVA_KERNEL_WHEEL);
    let bytes = fs::read(&wheel).map_err(io_err("reading the Java kernel's wheel"))?;
    let digest = hex::encode(Sha256::digest(&bytes));
    if digest != JAVA_KERNEL_SHA256 {
        let _ = fs::remove_dir_all(&wheels);
        return Err(ImageError::Build {
            image: image.to_string(),
            phase: BuildPhase::Download,
            message: format!("{JAVA_KERNEL_WHEEL} has sha256 {digest}, not the pinned {JAVA_KERNEL_SHA256}"),
        });
    }
    progress(&BuildProgress::new(
        BuildPhase::Install,
        format!("pip install {JAVA_KERNEL_WHEEL}"),
    ));
    let in_image = format!("{WHEELS_IN_ROOT}/{JAVA_KERNEL_WHEEL}");
    let installed = in_root(
        BuildPhase::Install,
        &[
            "/usr/bin/python3",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-cache-dir",
            &in_image,
        ],
    );
    let _ = fs::remove_dir_all(&wheels);
    installed
}

/// Runs a tool in a build root (a chroot) in a phase of a build.
type InRoot<'a> = dyn Fn(BuildPhase, &[&str]) -> Result<(), ImageError> + 'a;

/// `apt-get update` from `sources` (said in the progress line), then `apt-get install`
/// of `packages` without recommends, each run by `in_root` (a chroot into a build root).
fn apt_get_install(
    in_root: &InRoot<'_>,
    sources: &str,
    packages: &[&str],
    progress: &dyn Fn(&BuildProgress),
) -> Result<(), ImageError> {
    progress(&BuildProgress::new(
        BuildPhase::Download,
        format!("apt-get update ({sources})"),
    ));
    in_root(BuildPhase::Download, &["apt-get", "-q", "update"])?;
    progress(&BuildProgress::new(
        BuildPhase::Install,
        format!(
            "apt-get install --no-install-recommends {} (about a minute)",
            packages.join(" ")
        ),
    ));
    let mut install = vec!["apt-get", "-q", "install", "-y", "--no-install-recommends"];
    install.extend_from_slice(packages);
    in_root(BuildPhase::Install, &install)
}
