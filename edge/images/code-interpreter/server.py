#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""OpenDsec's code-interpreter server: the HTTP API that E2B's code-interpreter SDK
calls on port 49999 (`/execute`, `/contexts`, `/health`), with a Jupyter-like Python
kernel per context. Standard library only; it runs inside the sandbox as `user`.

Processes: this server answers HTTP and owns the contexts; each context is one worker
process (this file run with `--worker`) holding the context's state, so a crash or a
restart of one context never touches another. Server and worker talk over two pipes
that user code does not see as stdin/stdout: one JSON request line per cell in, and
NDJSON lines out that are already in the wire format of `/execute`, so the server only
forwards bytes. In the worker, stdin is /dev/null and file descriptors 1 and 2 are pipes
the worker reads, so output of subprocesses is captured like `print`.
"""

import argparse
import ast
import asyncio
import base64
import builtins
import codecs
import fcntl
import http.server
import importlib.util
import inspect
import io
import json
import linecache
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import tokenize
import traceback
import types
import urllib.parse
import uuid

DEFAULT_PORT = 49999
DEFAULT_CWD = "/home/user"
# Largest request body accepted (the code of one cell and its env vars).
MAX_BODY = 64 << 20
# Largest piece of output in one NDJSON line: bigger output is split, never held whole.
CHUNK = 64 << 10
# How long a worker gets to stop a cell after SIGINT before it is killed and restarted.
INTERRUPT_GRACE = 10.0
# How long a new worker may take to start (and import PRELOAD) before it is replaced.
WORKER_START_TIMEOUT = 120.0
# A partial output line is sent after this long even without a newline.
PARTIAL_LINE_DELAY = 0.05
# Modules imported by the default context's worker at startup, if installed.
PRELOAD = ("numpy", "pandas", "matplotlib", "matplotlib.pyplot")

# The worker's message types, as the SDK reads them (`e2b_code_interpreter/models.py`).
END_LINE = b'{"type": "end_of_execution"}'
READY_LINE = b'{"type": "ready"}'

LANGUAGES = {
    None: "python",
    "": "python",
    "python": "python",
    "python3": "python",
    "bash": "bash",
    "sh": "sh",
}


def now_ns():
    return time.time_ns()


# ---------------------------------------------------------------------------------------
# Worker: one context's kernel.
# ---------------------------------------------------------------------------------------


class Channel:
    """The worker's message pipe to the server; one whole line per write, any thread."""

    def __init__(self, fd):
        self.fd = fd
        self.lock = threading.Lock()

    def send(self, message):
        data = (json.dumps(message, default=str) + "\n").encode()
        with self.lock:
            view = memoryview(data)
            while view:
                written = os.write(self.fd, view)
                view = view[written:]


class Interrupts:
    """SIGINT raises KeyboardInterrupt only inside user code, never in the middle of
    the worker's own bookkeeping (a half-written message would break the protocol)."""

    def __init__(self):
        self.running = False
        self.critical = 0
        self.pending = False
        self.main_thread = threading.get_ident()

    def install(self):
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, _signum, _frame):
        if not self.running:
            return
        if self.critical:
            self.pending = True
            return
        raise KeyboardInterrupt

    def __enter__(self):
        # Signals run in the main thread; other threads (the user's too) do not count.
        if threading.get_ident() == self.main_thread:
            self.critical += 1

    def __exit__(self, *exc):
        if threading.get_ident() != self.main_thread:
            return False
        self.critical -= 1
        if self.critical == 0 and self.pending:
            self.pending = False
            if self.running and exc[0] is None:
                raise KeyboardInterrupt
        return False


class FdPump:
    """Reads one of the worker's output descriptors (1 or 2) and forwards it."""

    def __init__(self, fd, kind, channel):
        self.fd = fd
        self.kind = kind
        self.channel = channel
        # Bytes taken from the pipe, and bytes of those already sent; `drain` waits for
        # the second to catch up with the first plus what is still in the pipe.
        self.taken = 0
        self.sent = 0
        self.closed = False
        self.cond = threading.Condition()
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        threading.Thread(target=self._run, name=f"pump-{kind}", daemon=True).start()

    def _run(self):
        while True:
            select.select([self.fd], [], [])
            with self.cond:
                data = os.read(self.fd, CHUNK)
                self.taken += len(data)
                if not data:
                    self.closed = True
                    self.cond.notify_all()
                    return
            text = self.decoder.decode(data)
            if text:
                self.channel.send({"type": self.kind, "text": text, "timestamp": now_ns()})
            with self.cond:
                self.sent += len(data)
                self.cond.notify_all()

    def pending(self):
        buf = fcntl.ioctl(self.fd, termios.FIONREAD, struct.pack("i", 0))
        return struct.unpack("i", buf)[0]

    def drain(self, timeout=2.0):
        """Waits until everything written to the descriptor so far has been sent, so
        a subprocess's output stays before what the cell prints or returns next."""
        deadline = time.monotonic() + timeout
        with self.cond:
            target = self.taken + self.pending()
            while self.sent < target and not self.closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self.cond.wait(remaining)


class CellStream(io.TextIOBase):
    """`sys.stdout`/`sys.stderr` of user code: whole lines are sent at once, a partial
    line after PARTIAL_LINE_DELAY, and nothing bigger than CHUNK per message."""

    def __init__(self, kind, fd, kernel):
        super().__init__()
        self.kind = kind
        self._fd = fd
        self.kernel = kernel
        self.lock = threading.RLock()
        self.parts = []
        self.size = 0
        self.since = 0.0

    @property
    def encoding(self):
        return "utf-8"

    @property
    def errors(self):
        return "strict"

    def writable(self):
        return True

    def isatty(self):
        return False

    def fileno(self):
        return self._fd

    def write(self, s):
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        if not s:
            return 0
        with self.kernel.interrupts:
            with self.lock:
                if not self.parts:
                    self.since = time.monotonic()
                self.parts.append(s)
                self.size += len(s)
                if "\n" in s or self.size >= CHUNK:
                    self._send(whole_lines_only=self.size < CHUNK)
        return len(s)

    def flush(self):
        with self.kernel.interrupts:
            with self.lock:
                self._send(whole_lines_only=False)

    def flush_if_stale(self):
        with self.lock:
            if self.parts and time.monotonic() - self.since >= PARTIAL_LINE_DELAY:
                self._send(whole_lines_only=False)

    def _send(self, whole_lines_only):
        if not self.parts:
            return
        text = "".join(self.parts)
        keep = ""
        if whole_lines_only:
            cut = text.rfind("\n") + 1
            text, keep = text[:cut], text[cut:]
        self.parts = [keep] if keep else []
        self.size = len(keep)
        self.since = time.monotonic()
        if text:
            self.kernel.drain_fds()
            for start in range(0, len(text), CHUNK):
                self.kernel.channel.send(
                    {"type": self.kind, "text": text[start : start + CHUNK], "timestamp": now_ns()}
                )


# MIME type of a rich representation -> field of the SDK's `Result`.
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
}
# IPython's `_repr_*_` protocol, in the order IPython asks.
REPR_METHODS = (
    ("_repr_html_", "text/html"),
    ("_repr_markdown_", "text/markdown"),
    ("_repr_svg_", "image/svg+xml"),
    ("_repr_png_", "image/png"),
    ("_repr_jpeg_", "image/jpeg"),
    ("_repr_pdf_", "application/pdf"),
    ("_repr_latex_", "text/latex"),
    ("_repr_json_", "application/json"),
    ("_repr_javascript_", "application/javascript"),
)
BINARY_MIMES = ("image/png", "image/jpeg", "application/pdf")


def is_figure(obj):
    figure = sys.modules.get("matplotlib.figure")
    return figure is not None and isinstance(obj, figure.Figure)


def figure_bundle(fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return {"text/plain": repr(fig), "image/png": buf.getvalue()}


def mime_bundle(obj):
    """The representations of `obj`, as IPython's display formatter would give them."""
    if is_figure(obj):
        return figure_bundle(obj)
    bundle = {}
    # Classes have the methods unbound; objects answering every attribute (mocks)
    # would claim every format. IPython skips both the same way.
    rich = not inspect.isclass(obj) and not hasattr(obj, "_ipython_canary_method_should_not_exist_")
    if rich:
        method = getattr(obj, "_repr_mimebundle_", None)
        if callable(method):
            try:
                data = method(include=None, exclude=None)
            except Exception:
                data = None
            if isinstance(data, tuple):
                data = data[0]
            if isinstance(data, dict):
                bundle.update(data)
        for name, mime in REPR_METHODS:
            if mime in bundle:
                continue
            method = getattr(obj, name, None)
            if not callable(method):
                continue
            try:
                value = method()
            except Exception:
                continue
            if isinstance(value, tuple):
                value = value[0]
            if value is not None:
                bundle[mime] = value
    if "text/plain" not in bundle:
        bundle["text/plain"] = repr(obj)
    return bundle


def result_message(bundle, is_main):
    message = {"type": "result"}
    extra = {}
    for mime, value in bundle.items():
        if mime in BINARY_MIMES and isinstance(value, (bytes, bytearray)):
            value = base64.b64encode(value).decode()
        elif isinstance(value, (bytes, bytearray)):
            value = value.decode("utf-8", "replace")
        field = MIME_FIELDS.get(mime)
        if field == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass
        if field:
            message[field] = value
        else:
            extra[mime] = value
    if extra:
        message["extra"] = extra
    message["is_main_result"] = is_main
    return message


def error_message(exc, own_file):
    tb = exc.__traceback__
    # The worker's own frames (exec/eval of the cell) are not the user's business,
    # nor is the parser's frame for a syntax error in the cell itself.
    while tb is not None and tb.tb_frame.f_code.co_filename == own_file:
        tb = tb.tb_next
    if isinstance(exc, SyntaxError) and str(exc.filename).startswith("<cell-"):
        tb = None
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return {
        "type": "error",
        "name": type(exc).__name__,
        "value": str(exc),
        "traceback": text,
    }


def suppressed_by_semicolon(code):
    """IPython's rule: a cell ending in `;` shows no result."""
    last = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(code).readline):
            if tok.type not in (
                tokenize.COMMENT,
                tokenize.NL,
                tokenize.NEWLINE,
                tokenize.INDENT,
                tokenize.DEDENT,
                tokenize.ENDMARKER,
            ):
                last = tok
    except (tokenize.TokenError, SyntaxError):
        return False
    return last is not None and last.type == tokenize.OP and last.string == ";"


class InlineBackend(types.ModuleType):
    """A matplotlib backend (`MPLBACKEND=module://opendsec_inline`): Agg rendering, and
    `plt.show()` / `fig.show()` send the figures as results instead of opening windows.
    Its classes are made on first use, when matplotlib is being imported anyway."""

    def __init__(self, kernel):
        super().__init__("opendsec_inline")
        self._kernel = kernel

    def __getattr__(self, name):
        if name.startswith("__") or "FigureCanvas" in self.__dict__:
            raise AttributeError(name)
        from matplotlib.backend_bases import FigureManagerBase
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        kernel = self._kernel

        class FigureManager(FigureManagerBase):
            def show(self):
                kernel.show_figure(self.canvas.figure)

        class FigureCanvas(FigureCanvasAgg):
            manager_class = FigureManager

        def show(*_args, **_kwargs):
            kernel.flush_figures()

        self.__dict__.update(FigureCanvas=FigureCanvas, FigureManager=FigureManager, show=show)
        if name in self.__dict__:
            return self.__dict__[name]
        raise AttributeError(name)


class MatplotlibHook:
    """Makes the inline backend matplotlib's default when user code imports it. An
    MPLBACKEND variable would do the same but leak into the user's subprocesses, where
    the backend module does not exist."""

    def find_spec(self, name, path=None, target=None):
        if name != "matplotlib":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original = loader.exec_module

        def exec_module(module):
            original(module)
            if not os.environ.get("MPLBACKEND"):
                module.rcParams["backend"] = "module://opendsec_inline"

        loader.exec_module = exec_module
        return spec


class Kernel:
    """The state of one context and the execution of its cells."""

    def __init__(self, language, channel, pumps, fds):
        self.language = language
        self.channel = channel
        self.pumps = pumps
        self.interrupts = Interrupts()
        self.count = 0
        self.loop = None
        self.main = types.ModuleType("__main__")
        self.main.__dict__["__builtins__"] = builtins
        sys.modules["__main__"] = self.main
        self.streams = [CellStream("stdout", fds[0], self), CellStream("stderr", fds[1], self)]
        sys.stdout, sys.stderr = self.streams
        builtins.display = self.display
        sys.modules["opendsec_inline"] = InlineBackend(self)
        sys.meta_path.insert(0, MatplotlibHook())
        threading.Thread(target=self._flusher, name="flusher", daemon=True).start()

    def _flusher(self):
        while True:
            time.sleep(PARTIAL_LINE_DELAY)
            for stream in self.streams:
                stream.flush_if_stale()

    def drain_fds(self):
        for pump in self.pumps:
            pump.drain()

    def flush_output(self):
        for stream in self.streams:
            stream.flush()
        with self.interrupts:
            self.drain_fds()

    def emit(self, message):
        self.flush_output()
        with self.interrupts:
            self.channel.send(message)

    def display(self, *objs, raw=False, **_options):
        """IPython's `display()`: each object becomes a result that is not the main one."""
        for obj in objs:
            if raw and isinstance(obj, dict):
                bundle = obj
            else:
                bundle = mime_bundle(obj)
                if is_figure(obj):
                    self._forget_figure(obj)
            self.emit(result_message(bundle, False))

    def show_figure(self, fig):
        self.emit(result_message(figure_bundle(fig), False))
        self._forget_figure(fig)

    def _forget_figure(self, fig):
        pyplot = sys.modules.get("matplotlib.pyplot")
        if pyplot is not None and fig in [m.canvas.figure for m in self._managers()]:
            pyplot.close(fig)

    def _managers(self):
        helpers = sys.modules.get("matplotlib._pylab_helpers")
        return helpers.Gcf.get_all_fig_managers() if helpers is not None else []

    def flush_figures(self):
        """Every open pyplot figure becomes a result and is closed (end of cell, show())."""
        for manager in self._managers():
            self.show_figure(manager.canvas.figure)

    def _run(self, code_obj):
        if code_obj.co_flags & inspect.CO_COROUTINE:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            return self.loop.run_until_complete(eval(code_obj, self.main.__dict__))
        return eval(code_obj, self.main.__dict__)

    def run_python(self, code):
        filename = f"<cell-{self.count}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        flags = ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        tree = ast.parse(code, filename, "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr) and not suppressed_by_semicolon(code):
            last = ast.Expression(tree.body.pop().value)
        self._run(compile(tree, filename, "exec", flags=flags, dont_inherit=True))
        if last is not None:
            value = self._run(compile(last, filename, "eval", flags=flags, dont_inherit=True))
            if value is not None:
                self.main.__dict__["_"] = value
                bundle = mime_bundle(value)
                if is_figure(value):
                    self._forget_figure(value)
                self.emit(result_message(bundle, True))

    def run_shell(self, code):
        shell = "/bin/bash" if self.language == "bash" else "/bin/sh"
        proc = subprocess.Popen([shell, "-c", code], stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            status = proc.wait()
        except KeyboardInterrupt:
            stop_group(proc)
            raise
        if status != 0:
            name = "ExitCode" if status > 0 else "Signal"
            value = str(status) if status > 0 else signal.Signals(-status).name
            self.emit({"type": "error", "name": name, "value": value, "traceback": ""})

    def execute(self, request):
        self.count += 1
        self.channel.send({"type": "number_of_executions", "execution_count": self.count})
        env_vars = request.get("env_vars") or {}
        saved = {key: os.environ.get(key) for key in env_vars}
        os.environ.update(env_vars)
        try:
            self.interrupts.running = True
            try:
                if self.language == "python":
                    self.run_python(request["code"])
                else:
                    self.run_shell(request["code"])
                if self.language == "python":
                    self.flush_figures()
            except BaseException as exc:  # KeyboardInterrupt and SystemExit too, like IPython
                self.interrupts.running = False
                self.flush_output()
                self.channel.send(error_message(exc, __file__))
                try:
                    self.flush_figures()
                except Exception:
                    pass
            finally:
                self.interrupts.running = False
                self.interrupts.pending = False
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        self.flush_output()
        self.channel.send({"type": "end_of_execution"})


def stop_group(proc):
    """SIGINT the process group of `proc`, then SIGKILL it if it lingers."""
    for sig, wait in ((signal.SIGINT, 1.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def watch_parent(parent):
    """Ends the worker (and what it started) when the server is gone."""
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            try:
                os.killpg(0, signal.SIGKILL)
            finally:
                os._exit(1)


def worker_main(language, preload):
    parent = os.getppid()
    # Private channels (not inherited by subprocesses: PEP 446), then the user's fds.
    requests = os.fdopen(os.dup(0), "rb")
    channel = Channel(os.dup(1))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    pumps = []
    for fd, kind in ((1, "stdout"), (2, "stderr")):
        read_end, write_end = os.pipe()
        os.dup2(write_end, fd)
        os.close(write_end)
        pumps.append(FdPump(read_end, kind, channel))
    kernel = Kernel(language, channel, pumps, (1, 2))
    kernel.interrupts.install()
    threading.Thread(target=watch_parent, args=(parent,), name="parent", daemon=True).start()
    if preload:
        for name in PRELOAD:
            try:
                __import__(name)
            except Exception:
                pass
    channel.send({"type": "ready"})
    while True:
        line = requests.readline()
        if not line:
            return
        kernel.execute(json.loads(line))


# ---------------------------------------------------------------------------------------
# Server: contexts and HTTP.
# ---------------------------------------------------------------------------------------


class WorkerProcess:
    """The server's handle on one worker process."""

    def __init__(self, language, cwd, preload):
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--language", language]
        if preload:
            argv.append("--preload")
        self.proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.msg_fd = self.proc.stdout.fileno()
        self.buf = bytearray()
        self.ready = False
        self.retired = False
        # A request handler is reading its pipe (then that handler closes it).
        self.busy = False

    def send(self, request):
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()

    def read_some(self):
        """Appends what the worker wrote to the buffer; False at end of file."""
        data = os.read(self.msg_fd, CHUNK)
        self.buf += data
        return bool(data)

    def take_lines(self):
        """Complete lines in the buffer (each with its newline)."""
        cut = self.buf.rfind(b"\n") + 1
        if cut == 0:
            return []
        lines = bytes(self.buf[:cut]).splitlines(keepends=True)
        del self.buf[:cut]
        return lines

    def consume_ready(self):
        """Drops what the worker wrote before it was ready (import noise); True once
        its ready line has been read. Lines after it stay for the first cell."""
        if self.ready:
            return True
        lines = self.take_lines()
        for i, line in enumerate(lines):
            if line.rstrip(b"\n") == READY_LINE:
                self.ready = True
                self.buf[:0] = b"".join(lines[i + 1 :])
                return True
        return False

    def wait_ready(self, timeout):
        """Waits for the worker's ready line; False if it exited or timed out first."""
        deadline = time.monotonic() + timeout
        while not self.consume_ready():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.msg_fd], [], [], remaining)[0]:
                return False
            if not self.read_some():
                return False
        return True

    def interrupt(self):
        try:
            os.kill(self.proc.pid, signal.SIGINT)
        except ProcessLookupError:
            pass

    def kill(self):
        """Kills the worker and everything it started (its process group)."""
        self.retired = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self):
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class Context:
    def __init__(self, language, cwd, preload=False):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.preload = preload
        # One cell at a time; a restart or delete does not wait for it.
        self.exec_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.deleted = False
        self.worker = self._spawn()

    def _spawn(self):
        kind = LANGUAGES[self.language]
        return WorkerProcess(kind, self.cwd, self.preload)

    def describe(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self, dead=None):
        """Replaces the worker (all of the context's state). With `dead`, only if that
        worker is still the current one (another thread may have replaced it)."""
        with self.state_lock:
            if self.deleted or (dead is not None and self.worker is not dead):
                return
            old, self.worker = self.worker, self._spawn()
        self._retire(old)

    def delete(self):
        with self.state_lock:
            self.deleted = True
            old = self.worker
        self._retire(old)

    def _retire(self, worker):
        worker.kill()
        with self.state_lock:
            if not worker.busy:
                worker.close()

    def checkout(self):
        """The current worker, marked busy for the calling request handler."""
        with self.state_lock:
            self.worker.busy = True
            return self.worker

    def checkin(self, worker):
        with self.state_lock:
            worker.busy = False
            if worker.retired:
                worker.close()


class Contexts:
    def __init__(self, default_cwd):
        self.default_cwd = default_cwd
        self.lock = threading.Lock()
        self.by_id = {}
        self.defaults = {}

    def create(self, language, cwd):
        ctx = Context(language, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def get(self, context_id):
        with self.lock:
            return self.by_id.get(context_id)

    def default(self, language):
        """The default context of a language, created on first use (or after a delete)."""
        with self.lock:
            ctx = self.by_id.get(self.defaults.get(language))
            if ctx is None:
                ctx = Context(language, self.default_cwd, preload=language == "python")
                self.by_id[ctx.id] = ctx
                self.defaults[language] = ctx.id
            return ctx

    def list(self):
        with self.lock:
            return [ctx.describe() for ctx in self.by_id.values()]

    def remove(self, context_id):
        with self.lock:
            ctx = self.by_id.pop(context_id, None)
            for language, default_id in list(self.defaults.items()):
                if default_id == context_id:
                    del self.defaults[language]
        if ctx is not None:
            ctx.delete()
        return ctx is not None

    def shutdown(self):
        with self.lock:
            contexts = list(self.by_id.values())
            self.by_id.clear()
        for ctx in contexts:
            ctx.delete()


class BadRequest(Exception):
    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


def client_gone(sock):
    """True once the client has closed its side (it sends nothing while it waits)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "opendsec-code-interpreter/1"
    contexts = None  # set by serve()

    def setup(self):
        super().setup()
        # Output lines are small writes that must not wait for the next one (Nagle).
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format, *args):
        if self.server.verbose:
            super().log_message(format, *args)

    # -- helpers --------------------------------------------------------------------

    def send_json(self, status, body):
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def send_error_json(self, status, message):
        self.send_json(status, {"code": status, "message": message})

    def send_empty(self, status=204):
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def read_body(self):
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts, total = [], 0
            while True:
                size_line = self.rfile.readline(1024)
                try:
                    size = int(size_line.split(b";")[0].strip(), 16)
                except ValueError:
                    self.close_connection = True
                    raise BadRequest(400, "malformed chunked body")
                if size == 0:
                    while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                        pass
                    break
                total += size
                if total > MAX_BODY:
                    self.close_connection = True
                    raise BadRequest(413, f"request body over {MAX_BODY} bytes")
                parts.append(self.rfile.read(size))
                self.rfile.readline(1024)
            return b"".join(parts)
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            self.close_connection = True
            raise BadRequest(400, "bad Content-Length")
        if length > MAX_BODY:
            self.close_connection = True
            raise BadRequest(413, f"request body over {MAX_BODY} bytes")
        return self.rfile.read(length) if length > 0 else b""

    def read_json(self):
        body = self.read_body()
        if not body.strip():
            return {}
        try:
            data = json.loads(body)
        except ValueError as e:
            raise BadRequest(400, f"malformed JSON: {e}")
        if not isinstance(data, dict):
            raise BadRequest(400, "the body must be a JSON object")
        return data

    def route(self):
        path = urllib.parse.urlsplit(self.path).path.rstrip("/") or "/"
        return [p for p in path.split("/") if p]

    def dispatch(self, method):
        try:
            parts = self.route()
            handler = self.routes(method, parts)
            if handler is None:
                self.read_body()
                raise BadRequest(404, f"no route {method} {self.path}")
            handler()
        except BadRequest as e:
            self.send_error_json(e.status, str(e))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def routes(self, method, parts):
        if parts == ["health"] and method == "GET":
            return self.health
        if parts == ["execute"] and method == "POST":
            return self.execute
        if parts == ["contexts"]:
            return {"GET": self.list_contexts, "POST": self.create_context}.get(method)
        if len(parts) == 2 and parts[0] == "contexts" and method == "DELETE":
            return lambda: self.delete_context(parts[1])
        if len(parts) == 3 and parts[0] == "contexts" and parts[2] == "restart" and method == "POST":
            return lambda: self.restart_context(parts[1])
        return None

    def do_GET(self):
        self.dispatch("GET")

    def do_POST(self):
        self.dispatch("POST")

    def do_DELETE(self):
        self.dispatch("DELETE")

    # -- endpoints ------------------------------------------------------------------

    def health(self):
        self.send_json(200, {"status": "ok"})

    def list_contexts(self):
        self.read_body()
        self.send_json(200, self.contexts.list())

    def create_context(self):
        data = self.read_json()
        language = language_of(data.get("language"))
        cwd = data.get("cwd") or self.contexts.default_cwd
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise BadRequest(400, f"cwd {cwd!r} is not a directory")
        ctx = self.contexts.create(language, cwd)
        self.send_json(200, ctx.describe())

    def delete_context(self, context_id):
        self.read_body()
        if not self.contexts.remove(context_id):
            raise BadRequest(404, f"context {context_id} not found")
        self.send_empty()

    def restart_context(self, context_id):
        self.read_body()
        ctx = self.contexts.get(context_id)
        if ctx is None:
            raise BadRequest(404, f"context {context_id} not found")
        ctx.restart()
        self.send_empty()

    def execute(self):
        data = self.read_json()
        code = data.get("code")
        if not isinstance(code, str):
            raise BadRequest(400, "code must be a string")
        env_vars = data.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(
            isinstance(k, str) and k and "=" not in k and "\0" not in k for k in env_vars
        ):
            raise BadRequest(400, "env_vars must be an object of variable names to strings")
        env_vars = {k: v if isinstance(v, str) else json.dumps(v) for k, v in env_vars.items()}
        if any("\0" in v for v in env_vars.values()):
            raise BadRequest(400, "env_vars values must not contain NUL")
        context_id = data.get("context_id")
        if context_id:
            ctx = self.contexts.get(context_id)
            if ctx is None:
                raise BadRequest(404, f"context {context_id} not found")
        else:
            ctx = self.contexts.default(language_of(data.get("language")))
        self.run_cell(ctx, {"code": code, "env_vars": env_vars})

    # -- execution ------------------------------------------------------------------

    def write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def run_cell(self, ctx, request):
        sock = self.request
        # Wait for the context's previous cell, unless the client gives up first.
        while not ctx.exec_lock.acquire(timeout=0.2):
            if client_gone(sock):
                self.close_connection = True
                return
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/x-ndjson")
            self.send_header("Transfer-Encoding", "chunked")
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            connected = self.stream_cell(ctx, request, sock)
            if connected:
                self.write_chunk_end()
            else:
                self.close_connection = True
        finally:
            ctx.exec_lock.release()

    def write_chunk_end(self):
        try:
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True

    def stream_cell(self, ctx, request, sock):
        """Forwards the worker's lines to the client until the end of the cell. Returns
        whether the client is still connected. A client that disconnects interrupts the
        cell (SIGINT); a worker that does not stop in INTERRUPT_GRACE is replaced."""
        worker = ctx.checkout()
        try:
            return self._stream(ctx, worker, request, sock)
        finally:
            ctx.checkin(worker)

    def _stream(self, ctx, worker, request, sock):
        connected = True
        watch_client = True
        sent = False
        interrupted_at = None
        alive = True
        started = time.monotonic()

        def forward(data):
            nonlocal connected
            if connected and data:
                try:
                    self.write_chunk(data)
                except OSError:
                    connected = False

        while alive:
            if worker.consume_ready() and not sent:
                try:
                    worker.send(request)
                except OSError:
                    break
                sent = True
            if not sent and time.monotonic() - started > WORKER_START_TIMEOUT:
                ctx.restart(dead=worker)
                break
            if sent:
                lines = worker.take_lines()
                for i, line in enumerate(lines):
                    if line.rstrip(b"\n") == END_LINE:
                        forward(b"".join(lines[: i + 1]))
                        worker.buf[:0] = b"".join(lines[i + 1 :])
                        return connected
                forward(b"".join(lines))
            if not connected and interrupted_at is None:
                if not sent:
                    return False
                worker.interrupt()
                interrupted_at = time.monotonic()
            if interrupted_at is not None and time.monotonic() - interrupted_at > INTERRUPT_GRACE:
                ctx.restart(dead=worker)
                return False
            watched = [worker.msg_fd] + ([sock] if connected and watch_client else [])
            readable, _, _ = select.select(watched, [], [], 0.5)
            if sock in readable:
                if client_gone(sock):
                    connected = False
                else:
                    watch_client = False  # a pipelined request: not ours to read
            if worker.msg_fd in readable:
                alive = worker.read_some()
        # The worker is gone: killed by a restart or delete, or it died on its own.
        code = worker.proc.wait()
        if ctx.deleted:
            reason = "the context was deleted"
        elif ctx.worker is not worker:
            reason = "the context was restarted"
        else:
            reason = f"the context's worker exited ({exit_reason(code)}); its state is lost"
            ctx.restart(dead=worker)
        for message in (
            {"type": "error", "name": "ContextRestarted", "value": reason, "traceback": ""},
            {"type": "end_of_execution"},
        ):
            forward(json.dumps(message).encode() + b"\n")
        return connected


def exit_reason(code):
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def language_of(value):
    if value is not None and not isinstance(value, str):
        raise BadRequest(400, "language must be a string")
    key = value.lower() if isinstance(value, str) else value
    if key not in LANGUAGES:
        raise BadRequest(400, f"unsupported language {value!r}: use python, bash or sh")
    return LANGUAGES[key]


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128
    verbose = False


def serve(args):
    if os.path.isdir(args.cwd):
        default_cwd = args.cwd
    else:
        default_cwd = os.getcwd()
        print(f"code-interpreter: {args.cwd} does not exist; contexts start in {default_cwd}", file=sys.stderr)
    contexts = Contexts(default_cwd)
    Handler.contexts = contexts
    server = Server((args.host, args.port), Handler, bind_and_activate=False)
    server.verbose = args.verbose
    # Bind first (a taken port fails at once), listen only when the default context is
    # warm: whoever waits for the port then gets a fast first cell.
    server.server_bind()
    default = contexts.default("python")
    if not default.worker.wait_ready(WORKER_START_TIMEOUT):
        print("code-interpreter: the default context did not start", file=sys.stderr)
        contexts.shutdown()
        sys.exit(1)
    server.server_activate()

    def stop(_signum, _frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    print(f"code-interpreter: listening on {args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    except KeyboardInterrupt:
        pass
    finally:
        contexts.shutdown()
        server.server_close()


def main():
    parser = argparse.ArgumentParser(description="OpenDsec code-interpreter server (E2B API)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--cwd", default=DEFAULT_CWD, help="directory of the default contexts")
    parser.add_argument("--verbose", action="store_true", help="log every request to stderr")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--language", default="python", help=argparse.SUPPRESS)
    parser.add_argument("--preload", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(args.language, args.preload)
    else:
        serve(args)


if __name__ == "__main__":
    main()
