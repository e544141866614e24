//! `sandbox exec`, `sandbox shell` and `sandbox cp`: thin terminal glue over the
//! client's agent calls (`Client::exec`, `Client::pty`, `upload_body`, `download_with`).

use opendsec_sdk::{ApiError, Client, ExecOutput, ExecRequest, PtyEvent, PtyRequest};
use std::io::{IsTerminal, Write};

use super::{Output, Printer};

/// Exit codes outside 0..=255 (killed by a signal) become 1... unless they fit.
fn exit_code(code: i32) -> u8 {
    u8::try_from(code).unwrap_or(1)
}

pub async fn exec(client: &Client, id: &str, req: &ExecRequest) -> Result<u8, ApiError> {
    let code = client
        .exec(id, req, |o| {
            // Best effort: a closed local stdout must not stop the remote process's report.
            let _ = match o {
                ExecOutput::Stdout(b) => std::io::stdout()
                    .lock()
                    .write_all(&b)
                    .and_then(|_| std::io::stdout().flush()),
                ExecOutput::Stderr(b) => std::io::stderr().lock().write_all(&b),
            };
        })
        .await?;
    if code < 0 {
        // The agent reports a process ended by a signal as -1 (as E2B's envd does); a
        // shell says 128 + 9, and the likeliest signal is the OOM killer's.
        eprintln!(
            "opendsecctl: the process was killed by a signal; if it ran out of memory, \
             `opendsecctl sandbox get {id}` counts it among the sandbox's OOM kills"
        );
        return Ok(137);
    }
    Ok(exit_code(code))
}

/// Raw mode on the local terminal while alive; the saved settings come back on drop.
struct RawMode {
    saved: libc::termios,
}

impl RawMode {
    fn enable() -> Option<RawMode> {
        if !std::io::stdin().is_terminal() {
            return None;
        }
        // SAFETY: termios is plain data; fd 0 is a terminal (checked above).
        unsafe {
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &mut t) != 0 {
                return None;
            }
            let saved = t;
            libc::cfmakeraw(&mut t);
            if libc::tcsetattr(0, libc::TCSANOW, &t) != 0 {
                return None;
            }
            Some(RawMode { saved })
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores settings read from the same fd.
        unsafe {
            libc::tcsetattr(0, libc::TCSANOW, &self.saved);
        }
    }
}

/// The local terminal's size (cols, rows), 80x24 when not a terminal.
fn term_size() -> (u16, u16) {
    // SAFETY: TIOCGWINSZ fills a winsize.
    unsafe {
        let mut w: libc::winsize = std::mem::zeroed();
        if libc::ioctl(1, libc::TIOCGWINSZ, &mut w) == 0 && w.ws_col > 0 && w.ws_row > 0 {
            return (w.ws_col, w.ws_row);
        }
    }
    (80, 24)
}

pub async fn shell(client: &Client, id: &str, user: Option<String>, cmd: String) -> Result<u8, ApiError> {
    let (cols, rows) = term_size();
    let term = std::env::var("TERM")
        .ok()
        .filter(|t| !t.is_empty())
        .unwrap_or_else(|| "xterm-256color".into());
    let envs = [
        ("TERM".to_string(), term),
        ("LANG".into(), "C.UTF-8".into()),
        ("LC_ALL".into(), "C.UTF-8".into()),
    ]
    .into();
    let args = if cmd.ends_with("sh") {
        vec!["-i".into(), "-l".into()]
    } else {
        vec![]
    };
    let req = PtyRequest {
        exec: ExecRequest {
            cmd,
            args,
            envs,
            cwd: None,
            user,
        },
        cols,
        rows,
    };
    let mut session = client.pty(id, &req).await?;
    let ctl = session.control();

    // stdin is read on a plain thread: it blocks, and must not hold the runtime at exit.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Vec<u8>>(16);
    std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = [0u8; 4096];
        let mut stdin = std::io::stdin();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change()).ok();
    let raw = RawMode::enable();
    let mut stdin_open = true;
    let result = loop {
        tokio::select! {
            ev = session.next() => match ev {
                Ok(PtyEvent::Output(b)) => {
                    let mut out = std::io::stdout().lock();
                    let _ = out.write_all(&b).and_then(|_| out.flush());
                }
                Ok(PtyEvent::Exit(code)) => break Ok(exit_code(code)),
                Err(e) => break Err(e),
            },
            data = rx.recv(), if stdin_open => match data {
                Some(d) => {
                    if let Err(e) = ctl.send_input(&d).await {
                        break Err(e);
                    }
                }
                None => stdin_open = false,
            },
            Some(()) = async { match winch.as_mut() { Some(w) => w.recv().await, None => std::future::pending().await } } => {
                let (c, r) = term_size();
                let _ = ctl.resize(c, r).await;
            }
        }
    };
    drop(raw);
    result
}

/// `ID:PATH` (an id has no `/`), else a local path.
fn remote(spec: &str) -> Option<(&str, &str)> {
    let (id, path) = spec.split_once(':')?;
    (!id.is_empty() && !id.contains('/') && !path.is_empty()).then_some((id, path))
}

/// Shows `done/total` on stderr for copies over 1 MiB when stderr is a terminal.
struct Progress {
    label: String,
    show: bool,
}

impl Progress {
    fn new(label: String, total: Option<u64>) -> Progress {
        let show = std::io::stderr().is_terminal() && total.is_none_or(|t| t > 1 << 20);
        Progress { label, show }
    }

    fn update(&self, done: u64, total: Option<u64>) {
        if !self.show {
            return;
        }
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        let line = match total {
            Some(t) if t > 0 => format!(
                "\r{}: {:.1}/{:.1} MiB ({}%)",
                self.label,
                mib(done),
                mib(t),
                done * 100 / t
            ),
            _ => format!("\r{}: {:.1} MiB", self.label, mib(done)),
        };
        eprint!("{line}");
    }

    fn finish(&self) {
        if self.show {
            eprintln!();
        }
    }
}

pub async fn copy(client: &Client, out: Printer, src: &str, dst: &str, user: Option<&str>) -> Result<u8, ApiError> {
    let usage = |m: &str| ApiError {
        status: 400,
        code: "invalid".into(),
        message: m.into(),
        field: Some("src/dst".into()),
    };
    let io = |what: &str, e: std::io::Error| ApiError {
        status: 0,
        code: "io".into(),
        message: format!("{what}: {e}"),
        field: None,
    };
    let (bytes, summary) = match (remote(src), remote(dst)) {
        (Some(_), Some(_)) => {
            return Err(usage(
                "both sides are ID:PATH; copy between sandboxes through a local file",
            ));
        }
        (None, None) => return Err(usage("neither side is ID:PATH; one side must be in a sandbox")),
        (None, Some((id, path))) => {
            // Upload: a path ending in / keeps the local file's name.
            let path = if path.ends_with('/') {
                let name = std::path::Path::new(src)
                    .file_name()
                    .and_then(|n| n.to_str())
                    .ok_or_else(|| usage("the source has no file name; give the full remote path"))?;
                format!("{path}{name}")
            } else {
                path.to_string()
            };
            let (reader, total): (Box<dyn tokio::io::AsyncRead + Send + Unpin>, Option<u64>) = if src == "-" {
                (Box::new(tokio::io::stdin()), None)
            } else {
                let f = tokio::fs::File::open(src)
                    .await
                    .map_err(|e| io(&format!("cannot open {src}"), e))?;
                let len = f
                    .metadata()
                    .await
                    .map_err(|e| io(&format!("cannot stat {src}"), e))?
                    .len();
                (Box::new(f), Some(len))
            };
            let progress = std::sync::Arc::new(Progress::new(format!("{src} -> {id}:{path}"), total));
            let p = progress.clone();
            let sent = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
            let counter = sent.clone();
            let stream = futures::stream::unfold(reader, move |mut r| {
                let (p, counter) = (p.clone(), counter.clone());
                async move {
                    use tokio::io::AsyncReadExt;
                    let mut buf = vec![0u8; 256 * 1024];
                    match r.read(&mut buf).await {
                        Ok(0) => None,
                        Ok(n) => {
                            buf.truncate(n);
                            let done = counter.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed) + n as u64;
                            p.update(done, total);
                            Some((Ok::<_, std::io::Error>(buf), r))
                        }
                        Err(e) => Some((Err(e), r)),
                    }
                }
            });
            client
                .upload_body(id, &path, user, reqwest::Body::wrap_stream(stream))
                .await?;
            progress.finish();
            let n = sent.load(std::sync::atomic::Ordering::Relaxed);
            (n, format!("copied {n} bytes to {id}:{path}"))
        }
        (Some((id, path)), None) => {
            let to_stdout = dst == "-";
            let target = if !to_stdout && std::path::Path::new(dst).is_dir() {
                let name = std::path::Path::new(path)
                    .file_name()
                    .and_then(|n| n.to_str())
                    .ok_or_else(|| usage("the remote path has no file name"))?;
                std::path::Path::new(dst).join(name)
            } else {
                std::path::PathBuf::from(dst)
            };
            let mut sink: Box<dyn Write> = if to_stdout {
                Box::new(std::io::stdout().lock())
            } else {
                Box::new(std::io::BufWriter::new(
                    std::fs::File::create(&target)
                        .map_err(|e| io(&format!("cannot create {}", target.display()), e))?,
                ))
            };
            let mut progress: Option<Progress> = None;
            let label = format!("{id}:{path} -> {}", target.display());
            let n = client
                .download_with(id, path, user, |chunk, done, total| {
                    sink.write_all(chunk)?;
                    progress
                        .get_or_insert_with(|| Progress::new(label.clone(), total))
                        .update(done, total);
                    Ok(())
                })
                .await?;
            sink.flush().map_err(|e| io("cannot write", e))?;
            if let Some(p) = &progress {
                p.finish();
            }
            if to_stdout {
                return Ok(0);
            }
            (n, format!("copied {n} bytes to {}", target.display()))
        }
    };
    match out.0 {
        Output::Json => println!("{}", serde_json::json!({ "bytes": bytes })),
        Output::Table => println!("{summary}"),
    }
    Ok(0)
}
