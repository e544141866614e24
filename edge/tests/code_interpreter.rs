//! Specification of the code-interpreter server (`edge/images/code-interpreter/server.py`)
//! as E2B's SDK drives it over HTTP/1.1 (`e2b_code_interpreter`, port 49999), and of the
//! `code-interpreter-v1` image that carries it.
//!
//! The server tests run it on the host's Debian `/usr/bin/python3` (the interpreter the
//! image has) on 127.0.0.1; those that plot or build data frames need python3-matplotlib,
//! python3-numpy and python3-pandas (`CODE_INTERPRETER_TEST_PACKAGES` in ops/lib.sh) and
//! fail, naming them, when they are missing. The image test needs root, debootstrap and
//! network access for apt, like the `base` image.

use opendsec_edge::testing::free_port;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use opendsec_edge::images::{CODE_INTERPRETER_SERVER_PATH, ImageStore, code_interpreter_start};

const SERVER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/images/code-interpreter/server.py");
const PYTHON: &str = "/usr/bin/python3";
const DATA_PACKAGES: &str = "python3-matplotlib python3-numpy python3-pandas";
/// Images are built once per machine and shared by the tests (as on an edge).
const TEST_STORE: &str = "/var/tmp/opendsec-test-images";

// ---------------------------------------------------------------------------------
// The server under test.
// ---------------------------------------------------------------------------------

/// Where `./ops/test.sh` installs the Java kernel (JJava, with pip `--prefix`) for the
/// server on the host; the image has its own in /usr/local.
const JJAVA_DIR: &str = "/var/lib/opendsec/test/jjava";

/// The Jupyter data directory (`.../share/jupyter`) holding JJava's kernel spec under
/// [`JJAVA_DIR`] (Debian's pip adds `local/` to a prefix), if it is installed.
fn jjava_jupyter_path() -> Option<PathBuf> {
    ["share/jupyter", "local/share/jupyter"]
        .iter()
        .map(|p| Path::new(JJAVA_DIR).join(p))
        .find(|p| p.join("kernels/java/kernel.json").is_file())
}

fn require_python() {
    assert!(
        Path::new(PYTHON).is_file(),
        "{PYTHON} is missing: install the python3 package"
    );
}

/// matplotlib, numpy and pandas in the host's python3, or a failure saying what to install.
fn require_data_stack() {
    require_python();
    let out = Command::new(PYTHON)
        .args(["-c", "import matplotlib, numpy, pandas"])
        .output()
        .expect("run python3");
    assert!(
        out.status.success(),
        "this test needs matplotlib, numpy and pandas in {PYTHON}: apt-get install {DATA_PACKAGES} \
         (ops/lib.sh CODE_INTERPRETER_TEST_PACKAGES): {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A running server process; stopped (SIGTERM, which ends its workers) when dropped.
struct Server {
    child: Child,
    addr: String,
    cwd: PathBuf,
    _dir: Option<tempfile::TempDir>,
}

impl Server {
    /// The server on the host's python3, its default contexts in a fresh directory.
    async fn start() -> Server {
        Server::start_with(&[], Stdio::null()).await
    }

    /// [`Server::start`] with more arguments and its stdin.
    async fn start_with(args: &[&str], stdin: Stdio) -> Server {
        require_python();
        let dir = tempfile::tempdir().unwrap();
        let port = free_port();
        let mut cmd = Command::new(PYTHON);
        cmd.arg(SERVER)
            .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--cwd"])
            .arg(dir.path())
            .args(args)
            .stdin(stdin);
        if let Some(path) = jjava_jupyter_path() {
            cmd.env("JUPYTER_PATH", path);
        }
        let child = cmd.spawn().expect("start the server");
        let cwd = dir.path().to_path_buf();
        Server::ready(child, port, cwd, Some(dir)).await
    }

    /// Waits until `/health` answers (the server listens only once its default context
    /// has imported numpy, pandas and matplotlib).
    async fn ready(mut child: Child, port: u16, cwd: PathBuf, dir: Option<tempfile::TempDir>) -> Server {
        let addr = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the server exited before it was ready: {status}");
            }
            if let Ok((200, _)) = try_call(&addr, "GET", "/health", None).await {
                break;
            }
            assert!(Instant::now() < deadline, "the server was not ready in 60 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Server {
            child,
            addr,
            cwd,
            _dir: dir,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------
// HTTP as the SDK speaks it: HTTP/1.1, JSON bodies, NDJSON streams.
// ---------------------------------------------------------------------------------

fn request(method: &str, path: &str, body: Option<&str>) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "127.0.0.1")
        .header("e2b-sandbox-id", "test")
        .header("e2b-sandbox-port", "49999");
    if body.is_some() {
        b = b.header("content-type", "application/json");
    }
    b.body(Full::new(Bytes::from(body.unwrap_or("").to_owned()))).unwrap()
}

async fn try_call(
    addr: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<(u16, Vec<u8>), Box<dyn std::error::Error>> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await?;
    tokio::spawn(conn);
    let resp = send.send_request(request(method, path, body)).await?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await?.to_bytes().to_vec();
    Ok((status, body))
}

async fn call(addr: &str, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    let (status, body) = try_call(addr, method, path, body)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let value = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&body).unwrap_or_else(|e| {
            panic!(
                "{method} {path}: body is not JSON ({e}): {}",
                String::from_utf8_lossy(&body)
            )
        })
    };
    (status, value)
}

/// The lines of one `/execute` response, each with when it arrived.
struct Cell {
    lines: Vec<(Duration, Value)>,
}

impl Cell {
    fn of_type(&self, kind: &str) -> Vec<&Value> {
        self.lines
            .iter()
            .map(|(_, v)| v)
            .filter(|v| v["type"] == kind)
            .collect()
    }

    fn stdout(&self) -> String {
        self.of_type("stdout")
            .iter()
            .map(|v| v["text"].as_str().unwrap())
            .collect()
    }

    fn results(&self) -> Vec<&Value> {
        self.of_type("result")
    }

    fn main_text(&self) -> Option<&str> {
        self.results()
            .into_iter()
            .find(|r| r["is_main_result"] == true)
            .map(|r| r["text"].as_str().expect("a main result has text"))
    }

    fn error(&self) -> Option<&Value> {
        self.of_type("error").into_iter().next()
    }

    fn arrival(&self, kind: &str, text: &str) -> Duration {
        self.lines
            .iter()
            .find(|(_, v)| v["type"] == kind && v["text"] == text)
            .unwrap_or_else(|| panic!("no {kind} {text:?} in {:?}", self.lines))
            .0
    }
}

/// `POST /execute`, read to the end; every line must be one JSON object with a `type`,
/// the last `end_of_execution`.
async fn execute(addr: &str, body: Value) -> Cell {
    let (status, cell) = execute_status(addr, body).await;
    assert_eq!(status, 200, "{:?}", cell.lines);
    cell
}

async fn execute_status(addr: &str, body: Value) -> (u16, Cell) {
    let start = Instant::now();
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await.unwrap();
    tokio::spawn(conn);
    let resp = send
        .send_request(request("POST", "/execute", Some(&body.to_string())))
        .await
        .unwrap();
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    let mut lines = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("the stream ends cleanly");
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(end) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=end).collect();
            let value: Value = serde_json::from_slice(&line)
                .unwrap_or_else(|e| panic!("not a JSON line ({e}): {}", String::from_utf8_lossy(&line)));
            lines.push((start.elapsed(), value));
        }
    }
    if status == 200 {
        assert!(buf.is_empty(), "a partial last line: {buf:?}");
        assert!(lines.iter().all(|(_, v)| v["type"].is_string()), "{lines:?}");
        assert_eq!(
            lines.last().map(|(_, v)| &v["type"]),
            Some(&json!("end_of_execution")),
            "{lines:?}"
        );
    } else {
        // An error is one JSON object (no newline), as `call` gets it.
        let error: Value = serde_json::from_slice(&buf).expect("a JSON error body");
        assert!(error["message"].is_string(), "{error}");
        lines.push((start.elapsed(), error));
    }
    (status, Cell { lines })
}

async fn run(addr: &str, code: &str) -> Cell {
    execute(addr, json!({"code": code})).await
}

async fn run_in(addr: &str, context: &str, code: &str) -> Cell {
    execute(addr, json!({"code": code, "context_id": context})).await
}

async fn create_context(addr: &str, body: Value) -> Value {
    let (status, ctx) = call(addr, "POST", "/contexts", Some(&body.to_string())).await;
    assert_eq!(status, 200, "{ctx}");
    for field in ["id", "language", "cwd"] {
        assert!(ctx[field].is_string(), "{field} missing in {ctx}");
    }
    ctx
}

fn base64_decode(text: &str) -> Vec<u8> {
    fn value(c: u8) -> u32 {
        match c {
            b'A'..=b'Z' => (c - b'A') as u32,
            b'a'..=b'z' => (c - b'a' + 26) as u32,
            b'0'..=b'9' => (c - b'0' + 52) as u32,
            b'+' => 62,
            b'/' => 63,
            _ => panic!("not base64: {c:?}"),
        }
    }
    let clean: Vec<u8> = text.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::with_capacity(clean.len() * 3 / 4);
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= value(c) << (18 - 6 * i);
        }
        out.extend_from_slice(&n.to_be_bytes()[1..chunk.len()]);
    }
    out
}

const PNG_MAGIC: &[u8] = b"\x89PNG\r\n\x1a\n";

/// A process by pid and start time, so that a recycled pid (they wrap quickly on busy
/// machines) is not mistaken for it.
struct Process {
    pid: u32,
    started: Option<String>,
}

impl Process {
    fn stat(pid: u32) -> Option<String> {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()
    }

    /// Fields after the command name (which may hold spaces): state is [0], start time [19].
    fn field(stat: &str, index: usize) -> Option<String> {
        let rest = &stat[stat.rfind(')')? + 2..];
        rest.split(' ').nth(index).map(str::to_owned)
    }

    fn new(pid: u32) -> Process {
        let started = Process::stat(pid).and_then(|s| Process::field(&s, 19));
        assert!(started.is_some(), "process {pid} is not running");
        Process { pid, started }
    }

    /// Still there (a zombie counts: nobody has reaped it).
    fn exists(&self) -> bool {
        Process::stat(self.pid).is_some_and(|s| Process::field(&s, 19) == self.started)
    }

    async fn wait_gone(&self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.exists() {
            assert!(
                Instant::now() < deadline,
                "{what} (pid {}) still exists: {:?}",
                self.pid,
                Process::stat(self.pid)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

// ---------------------------------------------------------------------------------
// The server.
// ---------------------------------------------------------------------------------

#[tokio::test]
async fn state_persists_and_the_last_expression_is_the_main_result() {
    let server = Server::start().await;
    let first = run(&server.addr, "x = 41\nimport math\nprint('hi')").await;
    assert_eq!(first.stdout(), "hi\n");
    assert!(first.results().is_empty(), "an assignment shows nothing");
    assert_eq!(first.of_type("number_of_executions")[0]["execution_count"], 1);
    assert!(first.of_type("stdout")[0]["timestamp"].is_u64());

    let second = run(&server.addr, "y = x + 1\nmath.sqrt(y * y)").await;
    assert_eq!(second.main_text(), Some("42.0"));
    assert_eq!(second.results().len(), 1);
    assert_eq!(second.of_type("number_of_executions")[0]["execution_count"], 2);
    // A trailing semicolon hides the value (IPython's rule); None shows nothing.
    assert!(run(&server.addr, "y;  # quiet").await.results().is_empty());
    assert!(run(&server.addr, "None").await.results().is_empty());
    // Rich representations come from the object's _repr_*_ methods.
    let rich = run(
        &server.addr,
        "class Card:\n    def _repr_html_(self): return '<b>card</b>'\n    def _repr_markdown_(self): return '**card**'\n    def __repr__(self): return 'Card()'\nCard()",
    )
    .await;
    let result = rich.results()[0];
    assert_eq!(result["text"], "Card()");
    assert_eq!(result["html"], "<b>card</b>");
    assert_eq!(result["markdown"], "**card**");
    assert_eq!(result["is_main_result"], true);
    // display() gives results that are not the main one, in order with the output.
    let shown = run(&server.addr, "print('a')\ndisplay(1, 'two')\nprint('b')\n3").await;
    let kinds: Vec<_> = shown
        .lines
        .iter()
        .map(|(_, v)| match v["type"].as_str().unwrap() {
            "result" => format!("result {} {}", v["text"], v["is_main_result"]),
            other => format!("{other} {}", v["text"]),
        })
        .collect();
    assert_eq!(
        kinds[1..kinds.len() - 1],
        [
            "stdout \"a\\n\"",
            "result \"1\" false",
            "result \"two\" false",
            "stdout \"b\\n\"",
            "result \"3\" true",
        ],
        "{kinds:?}"
    );
    // Top-level await works as in IPython.
    let awaited = run(
        &server.addr,
        "import asyncio\nasync def f():\n    await asyncio.sleep(0)\n    return 7\nawait f()",
    )
    .await;
    assert_eq!(awaited.main_text(), Some("7"));
}

#[tokio::test]
async fn stdout_is_streamed_while_the_cell_runs_in_order() {
    let server = Server::start().await;
    let cell = run(
        &server.addr,
        "import time, sys\nfor i in range(3):\n    print(i)\n    time.sleep(0.4)\nprint('err', file=sys.stderr)",
    )
    .await;
    assert_eq!(cell.stdout(), "0\n1\n2\n");
    assert_eq!(cell.of_type("stderr")[0]["text"], "err\n");
    let end = cell.lines.last().unwrap().0;
    let first = cell.arrival("stdout", "0\n");
    let second = cell.arrival("stdout", "1\n");
    assert!(
        end - first >= Duration::from_millis(500),
        "the first line came {first:?}, the end {end:?}: output was held back"
    );
    assert!(second - first >= Duration::from_millis(300), "{first:?} {second:?}");

    // Output of subprocesses (file descriptor 1) is stdout too. ipykernel forwards it
    // from a thread of its own, so its place among the prints is not kept, and what a
    // subprocess writes in a cell's last instant may come with the next cell (as in
    // E2B's kernels): this cell goes on a little after its subprocesses.
    let mixed = run(
        &server.addr,
        "import os, subprocess, time\nprint('a')\nos.system('echo b')\nsubprocess.run(['echo', 'c'])\nprint('d')\ntime.sleep(0.3)",
    )
    .await;
    let mut lines: Vec<String> = mixed.stdout().lines().map(str::to_owned).collect();
    lines.sort();
    assert_eq!(lines, ["a", "b", "c", "d"], "{:?}", mixed.lines);
    // A partial line is not held until the end of the cell either.
    let partial = run(
        &server.addr,
        "import time\nprint('waiting', end='')\ntime.sleep(0.6)\nprint(' done')",
    )
    .await;
    let end = partial.lines.last().unwrap().0;
    assert!(end - partial.arrival("stdout", "waiting") >= Duration::from_millis(300));
    assert_eq!(partial.stdout(), "waiting done\n");
}

#[tokio::test]
async fn an_exception_is_an_error_and_the_context_keeps_working() {
    let server = Server::start().await;
    run(&server.addr, "kept = 'still here'").await;
    let failed = run(&server.addr, "def f():\n    return 1 / 0\nprint('before')\nf()").await;
    assert_eq!(failed.stdout(), "before\n");
    let error = failed.error().expect("an error line");
    assert_eq!(error["name"], "ZeroDivisionError");
    assert_eq!(error["value"], "division by zero");
    // The SDK's ExecutionError.traceback is one string: IPython's traceback, as E2B's
    // kernels give it (no colour codes), its pieces one after the other.
    let traceback = error["traceback"].as_str().expect("traceback is a string");
    assert!(traceback.contains("Traceback (most recent call last)"), "{traceback}");
    assert!(traceback.contains("return 1 / 0"), "{traceback}");
    assert!(!traceback.contains('\x1b'), "colour codes: {traceback:?}");
    assert!(
        traceback.trim_end().ends_with("ZeroDivisionError: division by zero"),
        "{traceback}"
    );
    assert!(
        !traceback.contains("server.py"),
        "the server's frames leak: {traceback}"
    );
    assert!(failed.results().is_empty());

    let syntax = run(&server.addr, "1 +").await;
    assert_eq!(syntax.error().unwrap()["name"], "SyntaxError");
    let exited = run(&server.addr, "import sys\nsys.exit(3)").await;
    assert_eq!(exited.error().unwrap()["name"], "SystemExit");

    let after = run(&server.addr, "kept").await;
    assert_eq!(after.main_text(), Some("still here"));
    assert!(after.error().is_none());
}

#[tokio::test]
async fn matplotlib_figures_become_png_results_and_are_closed() {
    require_data_stack();
    let server = Server::start().await;
    let cell = run(
        &server.addr,
        "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title('t')\nprint('drawn')",
    )
    .await;
    assert_eq!(cell.stdout(), "drawn\n");
    let results = cell.results();
    assert_eq!(results.len(), 1, "{results:?}");
    let figure = results[0];
    let text = figure["text"].as_str().unwrap();
    assert!(
        text.starts_with("<Figure size ") && text.ends_with(" with 1 Axes>"),
        "{text}"
    );
    assert_eq!(figure["is_main_result"], false);
    let png = base64_decode(figure["png"].as_str().expect("png is base64 text"));
    assert!(png.starts_with(PNG_MAGIC), "not a PNG: {:?}", &png[..16.min(png.len())]);
    assert!(png.len() > 1000);

    // plt.show() sends the figure at once (before what follows); two figures, two results.
    let shown = run(
        &server.addr,
        "plt.figure(); plt.plot([1]); plt.show()\nprint('after show')\nfig = plt.figure(); ax = fig.add_subplot(); ax.bar([1], [2])",
    )
    .await;
    let order: Vec<&str> = shown
        .lines
        .iter()
        .filter_map(|(_, v)| match v["type"].as_str() {
            Some("stdout") => Some("stdout"),
            Some("result") if v["png"].is_string() => Some("figure"),
            Some("result") => Some("value"),
            _ => None,
        })
        .collect();
    assert_eq!(order, ["figure", "stdout", "value", "figure"], "{:?}", shown.lines);
    let closed = run(&server.addr, "len(plt.get_fignums())").await;
    assert_eq!(closed.main_text(), Some("0"), "figures stay open");
    // A figure as the cell's value is the main result; Jupyter's inline backend then
    // shows the cell's open figure once more (as in E2B's kernels).
    let value = run(&server.addr, "fig, ax = plt.subplots()\nfig").await;
    let main: Vec<bool> = value.results().iter().map(|r| r["is_main_result"] == true).collect();
    assert_eq!(main, [true, false], "{:?}", value.lines);
    assert!(base64_decode(value.results()[0]["png"].as_str().unwrap()).starts_with(PNG_MAGIC));
    // The backend is Jupyter's inline one, as in E2B's kernels; the user's subprocesses
    // still plot.
    let child = run(
        &server.addr,
        "import subprocess, sys\nr = subprocess.run([sys.executable, '-c', 'import matplotlib.pyplot as p; p.plot([1]); p.savefig(\"/dev/null\", format=\"png\")'], capture_output=True, text=True)\n(r.returncode, plt.get_backend())",
    )
    .await;
    assert_eq!(
        child.main_text(),
        Some("(0, 'module://matplotlib_inline.backend_inline')"),
        "{:?}",
        child.lines
    );
}

#[tokio::test]
async fn a_dataframe_gives_html_text_and_its_data_by_column() {
    require_data_stack();
    let server = Server::start().await;
    let cell = run(
        &server.addr,
        "import pandas as pd\ndf = pd.DataFrame({'city': ['Oslo', 'Lima'], 'n': [1, 2]})\ndisplay(df.head(1))\ndf",
    )
    .await;
    let results = cell.results();
    assert_eq!(results.len(), 2, "{results:?}");
    let main = results[1];
    assert_eq!(main["is_main_result"], true);
    let html = main["html"].as_str().expect("html");
    assert!(html.contains("<table") && html.contains("Lima"), "{html}");
    let text = main["text"].as_str().expect("text");
    assert!(text.contains("city") && text.contains("Oslo"), "{text}");
    assert_eq!(results[0]["is_main_result"], false);
    assert!(results[0]["html"].as_str().unwrap().contains("Oslo"));
    // E2B's `data`: each column's name to its values (NaN and times made JSON).
    assert_eq!(main["data"], json!({"city": ["Oslo", "Lima"], "n": [1, 2]}));
    assert_eq!(results[0]["data"], json!({"city": ["Oslo"], "n": [1]}));
    let odd = run(
        &server.addr,
        "pd.DataFrame({'t': pd.to_datetime(['2024-01-02']), 'x': [float('nan')]})",
    )
    .await;
    assert_eq!(
        odd.results()[0]["data"],
        json!({"t": ["2024-01-02T00:00:00"], "x": [null]})
    );
}

#[tokio::test]
async fn the_default_context_is_warm_the_first_cell_fast_and_nothing_heavy_imported() {
    require_data_stack();
    let server = Server::start().await;
    let start = Instant::now();
    let first = run(&server.addr, "1 + 1").await;
    let latency = start.elapsed();
    eprintln!("first run_code(\"1 + 1\") after ready: {latency:?}");
    assert_eq!(first.main_text(), Some("2"));
    assert!(latency < Duration::from_secs(1), "first cell took {latency:?}");
    let warm = run(
        &server.addr,
        "import sys\nsorted(m for m in ('numpy', 'pandas', 'matplotlib.pyplot') if m in sys.modules)",
    )
    .await;
    // As in E2B's kernels, the data stack is imported by the user's first import, not
    // by every kernel's start (which it would slow down by seconds).
    assert_eq!(warm.main_text(), Some("[]"), "imported at startup");
    // The default context runs in the server's --cwd (the SDK's /home/user).
    let cwd = run(&server.addr, "import os\nos.getcwd()").await;
    assert_eq!(cwd.main_text().unwrap(), server.cwd.display().to_string());
}

#[tokio::test]
async fn contexts_are_isolated_listed_restarted_and_deleted() {
    let server = Server::start().await;
    let addr = &server.addr;
    let sub = server.cwd.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let a = create_context(addr, json!({"cwd": sub.to_str().unwrap()})).await;
    let b = create_context(addr, json!({"language": "python"})).await;
    let (a_id, b_id) = (a["id"].as_str().unwrap(), b["id"].as_str().unwrap());
    assert_eq!(a["language"], "python");
    assert_eq!(a["cwd"], sub.to_str().unwrap());
    assert_eq!(b["cwd"], server.cwd.to_str().unwrap());

    run_in(addr, a_id, "secret = 'a'").await;
    let in_b = run_in(addr, b_id, "secret").await;
    assert_eq!(in_b.error().unwrap()["name"], "NameError");
    assert!(
        run(addr, "secret").await.error().is_some(),
        "the default context sees a's state"
    );
    assert_eq!(
        run_in(addr, a_id, "import os\nos.getcwd()").await.main_text().unwrap(),
        sub.display().to_string()
    );
    // Each context is its own process.
    let pid = |cell: Cell| cell.main_text().unwrap().parse::<u32>().unwrap();
    let a_pid = pid(run_in(addr, a_id, "import os\nos.getpid()").await);
    let b_pid = pid(run_in(addr, b_id, "import os\nos.getpid()").await);
    assert_ne!(a_pid, b_pid);
    let (a_worker, b_worker) = (Process::new(a_pid), Process::new(b_pid));

    let (status, list) = call(addr, "GET", "/contexts", None).await;
    assert_eq!(status, 200);
    let ids: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert!(ids.contains(&a_id) && ids.contains(&b_id), "{list}");
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .any(|c| c["cwd"] == server.cwd.to_str().unwrap()),
        "the default context is listed: {list}"
    );

    // Restart: fresh state in a new process; the other context is untouched.
    run_in(addr, b_id, "kept = 1").await;
    let (status, _) = call(addr, "POST", &format!("/contexts/{a_id}/restart"), None).await;
    assert_eq!(status, 204);
    assert_eq!(run_in(addr, a_id, "secret").await.error().unwrap()["name"], "NameError");
    assert_ne!(pid(run_in(addr, a_id, "import os\nos.getpid()").await), a_pid);
    assert_eq!(run_in(addr, b_id, "kept").await.main_text(), Some("1"));
    assert!(!a_worker.exists(), "the old worker lives on");

    // Delete: gone from the list, its worker killed, then 404s.
    let (status, _) = call(addr, "DELETE", &format!("/contexts/{b_id}"), None).await;
    assert_eq!(status, 204);
    assert!(!b_worker.exists(), "the deleted worker lives on");
    let (status, body) = execute_status(addr, json!({"code": "1", "context_id": b_id})).await;
    assert_eq!(status, 404, "{:?}", body.lines);
    let (status, _) = call(addr, "DELETE", &format!("/contexts/{b_id}"), None).await;
    assert_eq!(status, 404);
    let (status, _) = call(addr, "POST", &format!("/contexts/{b_id}/restart"), None).await;
    assert_eq!(status, 404);
    let (_, list) = call(addr, "GET", "/contexts", None).await;
    assert!(!list.to_string().contains(b_id), "{list}");
    assert_eq!(run_in(addr, a_id, "2 * 2").await.main_text(), Some("4"));
}

#[tokio::test]
async fn a_worker_that_dies_is_replaced_and_others_live_on() {
    let server = Server::start().await;
    let addr = &server.addr;
    let other = create_context(addr, json!({})).await;
    let other_id = other["id"].as_str().unwrap();
    run_in(addr, other_id, "mine = 'safe'").await;
    run(addr, "lost = 1").await;
    let crashed = run(addr, "import os\nprint('bye', flush=True)\nos._exit(3)").await;
    // A kernel that exits at once may take its last output with it (ZeroMQ had not sent
    // it yet), as in any Jupyter kernel: what does arrive is whole.
    assert!(
        ["bye\n", ""].contains(&crashed.stdout().as_str()),
        "{:?}",
        crashed.lines
    );
    // E2B's name for an execution that its kernel's restart ended.
    let error = crashed.error().expect("the crash is reported");
    assert_eq!(error["name"], "ContextRestarting", "{error}");
    assert!(error["value"].as_str().unwrap().contains("exit code 3"), "{error}");
    let fresh = run(addr, "lost").await;
    assert_eq!(fresh.error().unwrap()["name"], "NameError");
    assert_eq!(run(addr, "1 + 2").await.main_text(), Some("3"));
    assert_eq!(run_in(addr, other_id, "mine").await.main_text(), Some("safe"));
}

#[tokio::test]
async fn env_vars_apply_to_one_call_only() {
    let server = Server::start().await;
    let addr = &server.addr;
    let with = execute(
        addr,
        json!({"code": "import os, subprocess\nprint(subprocess.run(['sh', '-c', 'echo $GREETING'], capture_output=True, text=True).stdout, end='')\nos.environ['GREETING']", "env_vars": {"GREETING": "hello"}}),
    )
    .await;
    assert_eq!(with.stdout(), "hello\n");
    // A string value reads back without its quotes, as from E2B.
    assert_eq!(with.main_text(), Some("hello"));
    let without = run(addr, "import os\nos.environ.get('GREETING')").await;
    assert!(without.results().is_empty(), "still set: {:?}", without.lines);
    // A variable the context had comes back after a call that overrode it.
    run(addr, "import os\nos.environ['KEEP'] = 'mine'").await;
    let over = execute(
        addr,
        json!({"code": "os.environ['KEEP']", "env_vars": {"KEEP": "call"}}),
    )
    .await;
    assert_eq!(over.main_text(), Some("call"));
    assert_eq!(run(addr, "os.environ['KEEP']").await.main_text(), Some("mine"));
    // The same for shell cells.
    let bash = execute(
        addr,
        json!({"code": "echo \"$GREETING from $0\"", "language": "bash", "env_vars": {"GREETING": "hi"}}),
    )
    .await;
    assert_eq!(bash.stdout(), "hi from /bin/bash\n");
}

#[tokio::test]
async fn shell_cells_run_in_the_context_directory_and_report_exit_codes() {
    let server = Server::start().await;
    let addr = &server.addr;
    // A Bash kernel runs its shell on a terminal, as E2B's does: stderr comes with stdout.
    let ok = execute(addr, json!({"code": "pwd; echo err >&2", "language": "bash"})).await;
    assert_eq!(ok.stdout(), format!("{}\nerr\n", server.cwd.display()));
    assert!(ok.error().is_none());
    let failed = execute(addr, json!({"code": "exit 4", "language": "sh"})).await;
    let error = failed.error().expect("a failing command is an error");
    assert_eq!(error["name"], "ExitCode");
    assert_eq!(error["value"], "4");
}

#[tokio::test]
async fn bad_requests_get_json_errors() {
    let server = Server::start().await;
    let addr = &server.addr;
    let (status, body) = call(addr, "POST", "/execute", Some(r#"{"code": "1", "context_id": "nope"}"#)).await;
    assert_eq!(status, 404);
    assert!(body["message"].as_str().unwrap().contains("nope"), "{body}");
    let (status, body) = call(addr, "POST", "/execute", Some("{not json")).await;
    assert_eq!(status, 400);
    assert!(body["message"].as_str().unwrap().contains("JSON"), "{body}");
    let (status, _) = call(addr, "POST", "/contexts", Some("[1")).await;
    assert_eq!(status, 400);
    // A language the server cannot run: 400, naming it and those it has.
    let (status, body) = call(addr, "POST", "/execute", Some(r#"{"code": "1", "language": "cobol"}"#)).await;
    assert_eq!(status, 400);
    let message = body["message"].as_str().unwrap();
    assert!(message.contains("cobol") && message.contains("python, "), "{body}");
    assert_eq!(body["field"], "language");
    let (status, _) = call(addr, "POST", "/execute", Some(r#"{"context_id": null}"#)).await;
    assert_eq!(status, 400, "code is required");
    let (status, _) = call(
        addr,
        "POST",
        "/execute",
        Some(r#"{"code": "1", "env_vars": {"A": ["x"], "": "y"}}"#),
    )
    .await;
    assert_eq!(status, 400);
    let (status, _) = call(addr, "POST", "/contexts", Some(r#"{"cwd": "/nonexistent/dir"}"#)).await;
    assert_eq!(status, 400);
    let (status, _) = call(addr, "DELETE", "/contexts/nope", None).await;
    assert_eq!(status, 404);
    let (status, _) = call(addr, "GET", "/nothing", None).await;
    assert_eq!(status, 404);
    // The server still works, on a connection of its own.
    assert_eq!(run(addr, "'ok'").await.main_text(), Some("ok"));
}

#[tokio::test]
async fn a_client_that_disconnects_interrupts_the_cell() {
    let server = Server::start().await;
    let addr = server.addr.clone();
    let marker = server.cwd.join("interrupted");
    run(&addr, "state = 5").await;

    // Start a long cell, read its first line, then go away (as the SDK does on timeout).
    let code = format!(
        "import time\ntry:\n    print('started', flush=True)\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    open({:?}, 'w').write('yes')\n    raise",
        marker.to_str().unwrap()
    );
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await.unwrap();
    let conn = tokio::spawn(conn);
    let resp = send
        .send_request(request("POST", "/execute", Some(&json!({"code": code}).to_string())))
        .await
        .unwrap();
    let mut body = resp.into_body();
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("started") {
        let frame = body.frame().await.expect("the cell streams").unwrap();
        seen.extend_from_slice(&frame.into_data().unwrap());
    }
    drop(body);
    drop(send);
    conn.abort();

    let deadline = Instant::now() + Duration::from_secs(10);
    while !marker.exists() {
        assert!(Instant::now() < deadline, "the cell was not interrupted");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The context is free again at once, with its state (interrupted, not restarted).
    let start = Instant::now();
    let after = run(&addr, "state").await;
    assert_eq!(after.main_text(), Some("5"));
    assert!(start.elapsed() < Duration::from_secs(5), "{:?}", start.elapsed());

    // Shell cells too: the cell's commands go, the context's shell and its state stay.
    let bash = json!({"code": "KEPT=yes", "language": "bash"});
    execute(&addr, bash).await;
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp)).await.unwrap();
    let conn = tokio::spawn(conn);
    let shell = json!({"code": "sh -c 'echo $$; exec sleep 60' | cat", "language": "bash"}).to_string();
    let resp = send
        .send_request(request("POST", "/execute", Some(&shell)))
        .await
        .unwrap();
    let mut body = resp.into_body();
    let mut seen = String::new();
    let shell = loop {
        let frame = body.frame().await.expect("the cell streams").unwrap();
        seen.push_str(&String::from_utf8_lossy(&frame.into_data().unwrap()));
        if let Some(line) = seen.lines().find(|l| l.contains("\"stdout\"")) {
            let v: Value = serde_json::from_str(line).unwrap();
            break Process::new(v["text"].as_str().unwrap().trim().parse::<u32>().unwrap());
        }
    };
    drop(body);
    drop(send);
    conn.abort();
    shell.wait_gone("the interrupted command").await;
    let kept = execute(&addr, json!({"code": "echo $KEPT", "language": "bash"})).await;
    assert_eq!(kept.stdout(), "yes\n");
    assert_eq!(run(&addr, "state").await.main_text(), Some("5"));
}

/// A language's interpreter on the host, or a failure saying what to install.
fn require_tool(tool: &str, package: &str) {
    let found = std::env::var_os("PATH")
        .map(|paths| std::env::split_paths(&paths).any(|d| d.join(tool).is_file()))
        .unwrap_or(false);
    assert!(
        found,
        "{tool} is missing: install {package} (ops/lib.sh CODE_INTERPRETER_TEST_PACKAGES)"
    );
}

#[tokio::test]
async fn every_mime_bundle_of_ipython_display_objects_is_a_result_field() {
    let server = Server::start().await;
    let addr = &server.addr;
    let cell = run(
        addr,
        "from IPython.display import HTML, Markdown, JSON, SVG, Latex, Javascript, display\n\
         display(HTML('<b>b</b>'))\ndisplay(Markdown('*m*'))\ndisplay(JSON({'k': [1]}))\n\
         display(SVG('<svg xmlns=\"http://www.w3.org/2000/svg\"/>'))\ndisplay(Latex('$x$'))\n\
         display(Javascript('1'))\ndisplay({'text/plain': 'p', 'application/x-own': 'o'}, raw=True)",
    )
    .await;
    let results = cell.results();
    assert_eq!(results.len(), 7, "{results:?}");
    assert!(results.iter().all(|r| r["is_main_result"] == false));
    assert_eq!(results[0]["html"], "<b>b</b>");
    assert_eq!(results[1]["markdown"], "*m*");
    assert_eq!(results[2]["json"], json!({"k": [1]}));
    assert!(results[3]["svg"].as_str().unwrap().starts_with("<svg"));
    assert_eq!(results[4]["latex"], "$x$");
    assert_eq!(results[5]["javascript"], "1");
    // A MIME type E2B has no field for goes to `extra`.
    assert_eq!(results[6]["text"], "p");
    assert_eq!(results[6]["extra"], json!({"application/x-own": "o"}));
    // IPython's shell escape runs in the context's directory.
    let shell = run(addr, "!pwd").await;
    assert_eq!(shell.stdout().trim(), server.cwd.display().to_string());
    // A figure's chart data comes with its PNG.
    require_data_stack();
    let plot = run(
        addr,
        "import matplotlib.pyplot as plt\nplt.plot([1, 2], [3, 4], label='s')\nplt.title('t')\nplt.show()",
    )
    .await;
    let chart = &plot.results()[0]["chart"];
    assert_eq!(chart["type"], "line", "{chart}");
    assert_eq!(chart["title"], "t");
    assert_eq!(chart["elements"][0]["label"], "s");
    assert_eq!(chart["elements"][0]["points"], json!([[1.0, 3.0], [2.0, 4.0]]));
}

/// A warm code-interpreter container runs the server and its kernels before a sandbox
/// claims it; the sandbox's variables then come from the agent on the server's stdin.
#[tokio::test]
async fn with_claim_stdin_cells_wait_for_the_sandboxs_variables_and_kernels_started_before_get_them() {
    use std::io::Write;
    let mut server = Server::start_with(&["--claim-stdin"], Stdio::piped()).await;
    let addr = server.addr.clone();
    // The default Python kernel runs already; a cell sent now waits for the claim.
    let cell = tokio::spawn({
        let addr = addr.clone();
        async move {
            let started = Instant::now();
            let cell = run(
                &addr,
                "import os, subprocess\nprint(os.environ.get('TASK'))\n!echo shell $TASK",
            )
            .await;
            (cell, started.elapsed())
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !cell.is_finished(),
        "a cell runs only once the sandbox's variables are in"
    );
    let mut stdin = server.child.stdin.take().expect("piped stdin");
    stdin
        .write_all(b"{\"env\": {\"TASK\": \"t-42\", \"QUOTED\": \"it's \\\"x\\\" $HOME\"}}\n")
        .unwrap();
    drop(stdin);
    let (cell, waited) = cell.await.unwrap();
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    // (IPython runs `!` commands on a terminal: \r\n.)
    assert_eq!(cell.stdout(), "t-42\nshell t-42\r\n", "{:?}", cell.lines);
    // Kept for later cells, for the variables' exact values, and in kernels started after
    // the claim (a new context) as in those started before (the spare, taken by it).
    let quoted = run(&addr, "print(os.environ['QUOTED'])").await;
    assert_eq!(quoted.stdout(), "it's \"x\" $HOME\n");
    let ctx = create_context(&addr, json!({"language": "python"})).await;
    let id = ctx["id"].as_str().unwrap();
    assert_eq!(
        run_in(&addr, id, "import os\nos.environ['TASK']").await.main_text(),
        Some("t-42")
    );
    let bash = execute(&addr, json!({"code": "echo \"$TASK|$QUOTED\"", "language": "bash"})).await;
    assert_eq!(bash.stdout(), "t-42|it's \"x\" $HOME\n");
}

#[tokio::test]
async fn javascript_and_typescript_contexts_keep_state_and_report_errors() {
    require_tool("node", "nodejs");
    let server = Server::start().await;
    let addr = &server.addr;
    let js = |code: &str| json!({"code": code, "language": "javascript"});
    let first = execute(addr, js("const base = 40\nconsole.log('log', base)\nbase + 2")).await;
    assert_eq!(first.stdout(), "log 40\n");
    assert_eq!(first.main_text(), Some("42"));
    assert_eq!(execute(addr, js("base * 2")).await.main_text(), Some("80"));
    // Strings read back without quotes; require() finds node's modules.
    let required = execute(
        addr,
        json!({"code": "require('path').join('a', 'b')", "language": "js"}),
    )
    .await;
    assert_eq!(required.main_text(), Some("a/b"));
    let failed = execute(addr, js("function f() { null.x }\nf()")).await;
    let error = failed.error().expect("a thrown error is the error");
    assert_eq!(error["name"], "TypeError");
    assert!(error["value"].as_str().unwrap().contains("null"), "{error}");
    assert!(!error["traceback"].as_str().unwrap().contains("node_kernel"), "{error}");
    // Top-level await works.
    let awaited = execute(
        addr,
        js("await new Promise(r => setTimeout(r, 50))\nconsole.log('waited')"),
    )
    .await;
    assert_eq!(awaited.stdout(), "waited\n");
    assert!(awaited.error().is_none(), "{:?}", awaited.lines);
    // env_vars for one call, as process.env.
    let env = execute(
        addr,
        json!({"code": "process.env.GREETING", "language": "javascript", "env_vars": {"GREETING": "hi"}}),
    )
    .await;
    assert_eq!(env.main_text(), Some("hi"));
    assert!(execute(addr, js("process.env.GREETING")).await.results().is_empty());

    require_tool("tsc", "node-typescript");
    let ts = |code: &str| json!({"code": code, "language": "typescript"});
    let typed = execute(
        addr,
        ts("const n: number = 4\ninterface P { x: number }\nconst p: P = { x: n }\np.x * 2"),
    )
    .await;
    assert_eq!(typed.main_text(), Some("8"), "{:?}", typed.lines);
    assert_eq!(execute(addr, ts("n + 1")).await.main_text(), Some("5"));
    // Each language's default context is its own kernel.
    assert!(execute(addr, js("n")).await.error().is_some());
}

#[tokio::test]
async fn java_contexts_run_on_jjava() {
    require_tool("jshell", "default-jdk-headless");
    assert!(
        jjava_jupyter_path().is_some(),
        "the Java kernel is missing: ./ops/test.sh installs JJava under {JJAVA_DIR}"
    );
    let server = Server::start().await;
    let addr = &server.addr;
    let java = |code: &str| json!({"code": code, "language": "java"});
    let first = execute(addr, java("int x = 6 * 7;\nSystem.out.println(\"printed \" + x);")).await;
    assert!(first.error().is_none(), "{:?}", first.lines);
    assert_eq!(first.stdout(), "printed 42\n");
    // State carries over; an expression's value is the main result.
    assert_eq!(execute(addr, java("x + 1")).await.main_text(), Some("43"));
    let failed = execute(addr, java("throw new IllegalStateException(\"bad\");")).await;
    let error = failed.error().expect("a thrown exception is the error");
    let value = error["value"].as_str().unwrap();
    assert!(
        value.contains("IllegalStateException") && value.contains("bad"),
        "{error}"
    );
    let ctx = create_context(addr, json!({"language": "java"})).await;
    assert_eq!(ctx["language"], "java");
    let own = run_in(addr, ctx["id"].as_str().unwrap(), "String s = \"own\"; s").await;
    assert_eq!(own.main_text(), Some("own"));
    // A JVM's environment is fixed at its start: env vars per call are refused, named.
    let body = json!({"code": "1", "language": "java", "env_vars": {"A": "b"}}).to_string();
    let (status, answer) = call(addr, "POST", "/execute", Some(&body)).await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.to_string().contains("env_vars"), "{answer}");
}

#[tokio::test]
async fn r_contexts_run_on_irkernel() {
    require_tool("R", "r-cran-irkernel");
    let server = Server::start().await;
    let addr = &server.addr;
    let r = |code: &str| json!({"code": code, "language": "r"});
    let first = execute(addr, r("x <- 20 + 1\nprint('printed')\nx * 2")).await;
    assert_eq!(first.stdout(), "[1] \"printed\"\n");
    let value = first.results()[0];
    assert_eq!(value["text"], "[1] 42");
    assert_eq!(execute(addr, r("cat(x)")).await.stdout(), "21");
    let failed = execute(addr, r("stop('bad')")).await;
    assert!(
        failed.error().unwrap()["value"].as_str().unwrap().contains("bad"),
        "{:?}",
        failed.lines
    );
    let env = execute(
        addr,
        json!({"code": "cat(Sys.getenv('GREETING'))", "language": "r", "env_vars": {"GREETING": "hi"}}),
    )
    .await;
    assert_eq!(env.stdout(), "hi");
    assert_eq!(execute(addr, r("cat(Sys.getenv('GREETING'))")).await.stdout(), "");
    let ctx = create_context(addr, json!({"language": "r", "cwd": "/tmp"})).await;
    assert_eq!(ctx["language"], "r");
    let cwd = run_in(addr, ctx["id"].as_str().unwrap(), "cat(getwd())").await;
    assert_eq!(cwd.stdout(), "/tmp");
}

#[tokio::test]
async fn large_output_is_streamed_in_bounded_pieces() {
    let server = Server::start().await;
    // 64 MB in one print: it must arrive whole, in many lines. The kernel sends it as
    // one Jupyter message, which the server holds while it passes it on in pieces (one
    // message at a time, never a cell's whole output).
    let cell = run(&server.addr, "print('x' * (64 << 20))").await;
    let pieces = cell.of_type("stdout");
    assert!(pieces.len() >= 64, "{} pieces", pieces.len());
    assert!(pieces.iter().all(|p| p["text"].as_str().unwrap().len() <= 64 << 10));
    assert_eq!(cell.stdout().len(), (64 << 20) + 1);
    let rss_kib = std::fs::read_to_string(format!("/proc/{}/status", server.child.id()))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse::<u64>().ok())
        .unwrap();
    assert!(rss_kib < 6 * 64 * 1024, "the server's peak RSS was {rss_kib} KiB");
}

// ---------------------------------------------------------------------------------
// The image.
// ---------------------------------------------------------------------------------

fn require_image_prerequisites() {
    // SAFETY: geteuid has no preconditions.
    assert_eq!(unsafe { libc::geteuid() }, 0, "building images needs root");
    for (bin, package) in [
        ("apt-get", "apt"),
        ("debootstrap", "debootstrap"),
        ("chroot", "coreutils"),
        ("unshare", "util-linux"),
        ("mount", "mount"),
    ] {
        let found = ["/usr/sbin", "/usr/bin", "/sbin", "/bin"]
            .iter()
            .any(|d| Path::new(d).join(bin).is_file());
        assert!(found, "{bin} is missing: install the {package} package");
    }
}

/// `argv` as uid 1000 chrooted into the image's layers (an overlay with a throwaway
/// upper dir under `scratch`), in a private mount namespace that ends with the process.
fn in_image(layers: &[PathBuf], scratch: &Path, argv: &[&str]) -> Command {
    let (upper, work, root) = (scratch.join("upper"), scratch.join("work"), scratch.join("root"));
    for d in [&upper, &work, &root] {
        std::fs::create_dir_all(d).unwrap();
    }
    let lower: Vec<String> = layers.iter().rev().map(|p| p.display().to_string()).collect();
    let script = format!(
        "set -e\n\
         mount -t overlay overlay -o lowerdir={},upperdir={},workdir={} {root}\n\
         mount -t proc proc {root}/proc\n\
         mount --bind /dev {root}/dev\n\
         exec chroot --userspec=1000:1000 {root} /usr/bin/env -i HOME=/home/user LANG=C.UTF-8 \
         PATH=/usr/local/bin:/usr/bin:/bin \"$@\"",
        lower.join(":"),
        upper.display(),
        work.display(),
        root = root.display(),
    );
    let mut cmd = Command::new("unshare");
    cmd.args(["--mount", "--propagation", "private", "--", "sh", "-c", &script, "sh"])
        .args(argv)
        .stdin(Stdio::null());
    cmd
}

#[tokio::test]
async fn code_interpreter_image_is_base_plus_a_layer_that_runs_the_server() {
    require_image_prerequisites();
    let store = ImageStore::open(TEST_STORE).unwrap();
    let started = Instant::now();
    let image = tokio::task::spawn_blocking({
        let store = store.clone();
        move || {
            store.ensure("code-interpreter-v1", &|p| {
                eprintln!("[code-interpreter-v1] {}: {}", p.phase, p.message)
            })
        }
    })
    .await
    .unwrap()
    .expect("build code-interpreter-v1");
    eprintln!("code-interpreter-v1 ready in {:?}", started.elapsed());

    let base = store.get("base").unwrap();
    assert_eq!(image.layers.len(), base.layers.len() + 1);
    assert_eq!(image.layers[..base.layers.len()], base.layers[..]);
    assert_eq!(image.config.start, Some(code_interpreter_start()));
    // SDKs ask for it by E2B's template names.
    assert_eq!(store.ensure("code-interpreter", &|_| {}).unwrap(), image);
    assert_eq!(store.get("code-interpreter-v1:latest").unwrap(), image);

    let layer = store.layer_path(image.layers.last().unwrap());
    let server = std::fs::read(layer.join(CODE_INTERPRETER_SERVER_PATH.trim_start_matches('/')))
        .expect("the layer has the server");
    assert_eq!(server, std::fs::read(SERVER).unwrap(), "a stale server in the layer");
    // Cleaned: no package lists or downloads, nothing of the build root's mounts.
    for dir in ["var/lib/apt/lists", "var/cache/apt/archives"] {
        if let Ok(entries) = std::fs::read_dir(layer.join(dir)) {
            for entry in entries.filter_map(Result::ok) {
                let name = entry.file_name().to_string_lossy().into_owned();
                assert!(
                    !entry.path().is_file() || name == "lock",
                    "{dir}/{name} left in the layer"
                );
            }
        }
    }
    for leftover in ["dev/null", "proc/self", "sys/kernel", "etc/resolv.conf"] {
        assert!(
            layer.join(leftover).symlink_metadata().is_err(),
            "{leftover} in the layer"
        );
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mountinfo.contains(TEST_STORE), "build mounts left: {mountinfo}");
    let cache = layer.join("home/user/.cache/matplotlib");
    assert_eq!(std::fs::metadata(&cache).expect("font cache").uid(), 1000);

    // The composed tree: python3 imports the data stack.
    let scratch = tempfile::tempdir_in("/var/tmp").unwrap();
    let dirs = store.layer_dirs(&image).unwrap();
    let out = in_image(
        &dirs,
        &scratch.path().join("imports"),
        &[
            "/usr/bin/python3",
            "-c",
            "import numpy, pandas, matplotlib; print(numpy.__version__, pandas.__version__, matplotlib.__version__)",
        ],
    )
    .output()
    .unwrap();
    assert!(
        out.status.success(),
        "imports failed in the image: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!(
        "in the image: numpy, pandas, matplotlib {}",
        String::from_utf8_lossy(&out.stdout).trim()
    );

    // And the image's start command serves the SDK's API as `user`.
    // Its arguments as the agent gives them, then this test's loopback address and a
    // free port (the last --port wins).
    let start = image.config.start.as_ref().unwrap();
    let port = free_port();
    let mut argv: Vec<String> = vec![start.cmd.clone()];
    argv.extend(start.args.iter().cloned());
    argv.extend(["--host".into(), "127.0.0.1".into(), "--port".into(), port.to_string()]);
    let argv: Vec<&str> = argv.iter().map(String::as_str).collect();
    let mut child = in_image(&dirs, &scratch.path().join("server"), &argv)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::BufReader::new(stderr).read_to_string(&mut text);
        eprint!("{text}");
    });
    let server = Server::ready(child, port, PathBuf::from(&start.cwd), None).await;
    let started = Instant::now();
    let first = run(&server.addr, "1 + 1").await;
    eprintln!("first run_code in the image: {:?}", started.elapsed());
    assert_eq!(first.main_text(), Some("2"));
    let who = run(&server.addr, "import os\n(os.getuid(), os.getcwd())").await;
    assert_eq!(who.main_text(), Some("(1000, '/home/user')"));
    let plot = run(&server.addr, "import matplotlib.pyplot as plt\nplt.plot([1, 2])\nNone").await;
    let png = base64_decode(plot.results()[0]["png"].as_str().expect("a figure"));
    assert!(png.starts_with(PNG_MAGIC));
}
