#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""OpenDsec's code-interpreter server: the HTTP API that E2B's code-interpreter SDK
calls on port 49999 (`/execute`, `/contexts`, `/health`), each context a Jupyter kernel
(ipykernel for Python, OpenDsec's `bash_kernel.py` for Bash) run through `jupyter_client`. It runs inside
the sandbox as `user`.

A cell is sent on the kernel's shell channel; the kernel's iopub messages for it are
turned into the NDJSON lines of `/execute` as they arrive: `stream` into stdout/stderr,
`execute_result` and `display_data` MIME bundles into results, `error` into the error,
`execute_input` into the execution count. In Python kernels a startup script adds two
MIME types E2B's SDK reads beside the standard ones: the data of a pandas DataFrame
(`data`) and the chart data of a matplotlib figure (`chart`). A client that disconnects
(the SDK's timeout) interrupts the cell; a kernel that does not stop is restarted.
"""

import argparse
import http.server
import json
import os
import queue
import shlex
import signal
import socket
import sys
import threading
import time
import urllib.parse
import uuid

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

DEFAULT_PORT = 49999
DEFAULT_CWD = "/home/user"
# Largest request body accepted (the code of one cell and its env vars).
MAX_BODY = 64 << 20
# Largest piece of output in one NDJSON line: bigger output is split, never held whole.
CHUNK = 64 << 10
# How long a kernel gets to stop a cell after an interrupt before it is restarted.
INTERRUPT_GRACE = 10.0
# How long a new kernel may take to start (and run its startup script).
KERNEL_START_TIMEOUT = 120.0

# The `language` of a request -> (the context's language, the Jupyter kernel's name).
LANGUAGES = {
    None: ("python", "python3"),
    "": ("python", "python3"),
    "python": ("python", "python3"),
    "python3": ("python", "python3"),
    "bash": ("bash", "bash"),
    "sh": ("bash", "bash"),
}

# MIME type of a rich representation -> field of the SDK's `Result`.
CHART_MIME = "application/vnd.opendsec.chart+json"
DATA_MIME = "application/vnd.opendsec.data+json"
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
    CHART_MIME: "chart",
    DATA_MIME: "data",
}

# Run once in every Python kernel: plain tracebacks (no ANSI colours), numpy, pandas and
# matplotlib imported ahead (a warm first cell), formatters for E2B's `data` and `chart`,
# and the helpers that set a cell's env vars and put them back after it.
PYTHON_STARTUP = r'''
def __opendsec_setup():
    import json, os
    ip = get_ipython()
    try:
        ip.run_line_magic("colors", "nocolor")
    except Exception:
        pass
    saved = []

    def env_push(values):
        saved.append({k: os.environ.get(k) for k in values})
        os.environ.update(values)

    def env_pop():
        for k, v in (saved.pop() if saved else {}).items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    ip.user_ns["__opendsec_env_push"] = env_push
    ip.user_ns["__opendsec_env_pop"] = env_pop
    ip.user_ns_hidden["__opendsec_env_push"] = env_push
    ip.user_ns_hidden["__opendsec_env_pop"] = env_pop

    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    def number(v):
        try:
            f = float(v)
        except (TypeError, ValueError):
            return str(v)
        return f if f == f and f not in (float("inf"), float("-inf")) else None

    def axis_of(ax, which):
        axis = ax.xaxis if which == "x" else ax.yaxis
        ticks = [number(t) for t in axis.get_ticklocs()]
        labels = [t.get_text() for t in axis.get_ticklabels()]
        scale = axis.get_scale()
        return {
            which + "_label": axis.get_label().get_text() or None,
            which + "_unit": None,
            which + "_ticks": ticks,
            which + "_tick_labels": labels,
            which + "_scale": scale if scale in ("linear", "log", "symlog", "logit", "function", "functionlog", "asinh") else "unknown",
        }

    def chart_of_axes(ax):
        from matplotlib.collections import PathCollection
        from matplotlib.patches import Rectangle, Wedge
        title = ax.get_title() or None
        wedges = [p for p in ax.patches if isinstance(p, Wedge)]
        if wedges:
            return {
                "type": "pie",
                "title": title,
                "elements": [
                    {"label": w.get_label(), "angle": abs(w.theta2 - w.theta1), "radius": w.r}
                    for w in wedges
                ],
            }
        bars = []
        for container in getattr(ax, "containers", []):
            rects = [p for p in container if isinstance(p, Rectangle)]
            if not rects:
                continue
            group = container.get_label() or ""
            if group.startswith("_"):
                group = ""
            labels = [t.get_text() for t in ax.xaxis.get_ticklabels()]
            ticks = list(ax.xaxis.get_ticklocs())
            for r in rects:
                center = r.get_x() + r.get_width() / 2
                label = str(number(center))
                for tick, text in zip(ticks, labels):
                    if abs(tick - center) < 1e-9 and text:
                        label = text
                bars.append({"label": label, "group": group, "value": r.get_height()})
        base = {"title": title, "x_label": ax.get_xlabel() or None, "y_label": ax.get_ylabel() or None,
                "x_unit": None, "y_unit": None}
        if bars:
            return dict(base, type="bar", elements=bars)
        lines = [l for l in ax.get_lines() if not l.get_label().startswith("_child") or len(l.get_xdata()) > 1]
        scatters = [c for c in ax.collections if isinstance(c, PathCollection)]
        kind = "line" if lines and not scatters else "scatter" if scatters and not lines else None
        if kind is None:
            return dict(base, type="unknown" if not (lines or scatters) else "line", elements=[])
        elements = []
        if kind == "line":
            for l in lines:
                label = l.get_label()
                points = [[number(x), number(y)] for x, y in zip(l.get_xdata(), l.get_ydata())]
                elements.append({"label": "" if label.startswith("_") else label, "points": points})
        else:
            for c in scatters:
                label = c.get_label()
                points = [[number(x), number(y)] for x, y in c.get_offsets()]
                elements.append({"label": "" if label.startswith("_") else label, "points": points})
        return dict(base, type=kind, elements=elements, **axis_of(ax, "x"), **axis_of(ax, "y"))

    def chart_of_figure(fig):
        axes = [ax for ax in fig.get_axes() if ax.get_visible()]
        if not axes:
            return None
        if len(axes) == 1:
            return chart_of_axes(axes[0])
        title = fig._suptitle.get_text() if getattr(fig, "_suptitle", None) else None
        return {"type": "superchart", "title": title, "elements": [chart_of_axes(ax) for ax in axes]}

    def data_of_frame(frame):
        return json.loads(frame.to_json(orient="split", date_format="iso", default_handler=str))

    class JSONMime(BaseFormatter):
        print_method = ObjectName("_repr_opendsec_json_")
        _return_type = (dict, list)

    formatter = ip.display_formatter.formatters
    chart = formatter[CHART] = JSONMime(parent=ip.display_formatter, format_type=CHART)
    data = formatter[DATA] = JSONMime(parent=ip.display_formatter, format_type=DATA)
    data.for_type_by_name("pandas.core.frame", "DataFrame", data_of_frame)
    active = ip.display_formatter.active_types
    active.extend(t for t in (CHART, DATA) if t not in active)
    for name in ("numpy", "pandas", "matplotlib", "matplotlib.pyplot"):
        try:
            __import__(name)
        except Exception:
            pass

    # Selecting matplotlib's inline backend (at the first pyplot import, or `%matplotlib`)
    # drops every formatter's Figure printer: put ours back before every cell.
    def register_chart(*_args):
        chart.for_type_by_name("matplotlib.figure", "Figure", chart_of_figure)

    register_chart()
    ip.events.register("pre_run_cell", register_chart)
    # The backend is chosen at a cell's first plot; its figures are shown after the
    # cell by its own post_execute hook, registered after this one.
    ip.events.register("post_execute", register_chart)


CHART, DATA = "@CHART@", "@DATA@"
__opendsec_setup()
del __opendsec_setup, CHART, DATA
'''.replace("@CHART@", CHART_MIME).replace("@DATA@", DATA_MIME)


def now_ns():
    return time.time_ns()


def line(message):
    return json.dumps(message).encode() + b"\n"


def env_code(language, env_vars):
    """The code that sets a cell's env vars, and the code that puts them back after."""
    if not env_vars:
        return None, None
    if language == "python":
        return f"__opendsec_env_push({env_vars!r})", "__opendsec_env_pop()"
    saved = "; ".join(
        f"__opendsec_saved_{i}=${{{k}+set}}; __opendsec_value_{i}=${{{k}-}}" for i, k in enumerate(env_vars)
    )
    push = saved + "; " + "; ".join(f"export {k}={shlex.quote(v)}" for k, v in env_vars.items())
    pop = "; ".join(
        f'if [ -n "$__opendsec_saved_{i}" ]; then export {k}="$__opendsec_value_{i}"; else unset {k}; fi'
        for i, k in enumerate(env_vars)
    )
    return push, pop


def result_message(bundle, is_main):
    message = {"type": "result"}
    extra = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field:
            message[field] = value
        else:
            extra[mime] = value
    if extra:
        message["extra"] = extra
    message["is_main_result"] = is_main
    return message


class Kernel:
    """One running Jupyter kernel of a context, with its blocking client."""

    def __init__(self, language, kernel_name, cwd):
        self.language = language
        self.retired = False
        self.busy = False
        self.manager = KernelManager(kernel_name=kernel_name)
        env = dict(os.environ)
        env.pop("JPY_PARENT_PID", None)
        # ipykernel's debugger otherwise warns about frozen modules on every start.
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        self.manager.start_kernel(cwd=cwd, env=env)
        try:
            self.client = self.manager.blocking_client()
            self.client.start_channels()
            self.client.wait_for_ready(timeout=KERNEL_START_TIMEOUT)
            if language == "python":
                self.run_silent(PYTHON_STARTUP, wait=True)
        except BaseException:
            self.kill()
            raise

    def run_silent(self, code, wait=False):
        msg_id = self.client.execute(code, silent=True, store_history=False, allow_stdin=False, stop_on_error=False)
        if wait:
            deadline = time.monotonic() + KERNEL_START_TIMEOUT
            while time.monotonic() < deadline:
                try:
                    reply = self.client.get_shell_msg(timeout=1.0)
                except queue.Empty:
                    if not self.manager.is_alive():
                        raise RuntimeError("the kernel died while starting")
                    continue
                if reply["parent_header"].get("msg_id") == msg_id:
                    if reply["content"].get("status") != "ok":
                        raise RuntimeError(f"the kernel's startup failed: {reply['content'].get('evalue')}")
                    return
            raise RuntimeError("the kernel's startup did not finish")
        return msg_id

    def interrupt(self):
        try:
            self.manager.interrupt_kernel()
        except Exception:
            pass

    def alive(self):
        try:
            return self.manager.is_alive()
        except Exception:
            return False

    def kill(self):
        self.retired = True
        try:
            self.client.stop_channels()
        except Exception:
            pass
        try:
            self.manager.shutdown_kernel(now=True)
        except Exception:
            pass
        try:
            self.manager.cleanup_resources()
        except Exception:
            pass


class Context:
    def __init__(self, language, kernel_name, cwd):
        self.id = str(uuid.uuid4())
        self.language = language
        self.kernel_name = kernel_name
        self.cwd = cwd
        # One cell at a time; a restart or delete does not wait for it.
        self.exec_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.deleted = False
        self.kernel = Kernel(language, kernel_name, cwd)

    def describe(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def restart(self, dead=None):
        """Replaces the kernel (all of the context's state). With `dead`, only if that
        kernel is still the current one (another thread may have replaced it)."""
        with self.state_lock:
            if self.deleted or (dead is not None and self.kernel is not dead):
                return
            old = self.kernel
            old.retired = True
        old.kill()
        new = Kernel(self.language, self.kernel_name, self.cwd)
        with self.state_lock:
            if self.deleted:
                stale = new
            else:
                stale, self.kernel = None, new
        if stale is not None:
            stale.kill()

    def delete(self):
        with self.state_lock:
            self.deleted = True
            old = self.kernel
        old.kill()


class Contexts:
    def __init__(self, default_cwd):
        self.default_cwd = default_cwd
        self.lock = threading.Lock()
        self.by_id = {}
        self.defaults = {}
        specs = KernelSpecManager().find_kernel_specs()
        self.installed = {name for name in specs}

    def create(self, language, kernel_name, cwd):
        ctx = Context(language, kernel_name, cwd)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def get(self, context_id):
        with self.lock:
            return self.by_id.get(context_id)

    def default(self, language, kernel_name):
        """The default context of a language, created on first use (or after a delete)."""
        with self.lock:
            ctx = self.by_id.get(self.defaults.get(language))
            if ctx is None:
                ctx = Context(language, kernel_name, self.default_cwd)
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
    def __init__(self, status, message, field=None):
        super().__init__(message)
        self.status = status
        self.field = field


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

    def send_error_json(self, status, message, field=None):
        body = {"code": status, "message": message}
        if field:
            body["field"] = field
        self.send_json(status, body)

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
            self.send_error_json(e.status, str(e), e.field)
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
        language, kernel_name = self.language_of(data.get("language"))
        cwd = data.get("cwd") or self.contexts.default_cwd
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise BadRequest(400, f"cwd {cwd!r} is not a directory", "cwd")
        try:
            ctx = self.contexts.create(language, kernel_name, cwd)
        except Exception as e:
            raise BadRequest(500, f"the {language} kernel did not start: {e}")
        self.send_json(200, ctx.describe())

    def delete_context(self, context_id):
        self.read_body()
        if not self.contexts.remove(context_id):
            raise BadRequest(404, f"context {context_id} not found", "context_id")
        self.send_empty()

    def restart_context(self, context_id):
        self.read_body()
        ctx = self.contexts.get(context_id)
        if ctx is None:
            raise BadRequest(404, f"context {context_id} not found", "context_id")
        try:
            ctx.restart()
        except Exception as e:
            raise BadRequest(500, f"the {ctx.language} kernel did not restart: {e}")
        self.send_empty()

    def language_of(self, value):
        if value is not None and not isinstance(value, str):
            raise BadRequest(400, "language must be a string", "language")
        key = value.lower() if isinstance(value, str) else value
        known = LANGUAGES.get(key)
        if known is None or known[1] not in self.contexts.installed:
            names = sorted(k for k, v in LANGUAGES.items() if k and v[1] in self.contexts.installed)
            raise BadRequest(400, f"unsupported language {value!r}: use one of {', '.join(names)}", "language")
        return known

    def execute(self):
        data = self.read_json()
        code = data.get("code")
        if not isinstance(code, str):
            raise BadRequest(400, "code must be a string", "code")
        env_vars = data.get("env_vars") or {}
        if not isinstance(env_vars, dict) or not all(
            isinstance(k, str) and k.isidentifier() and k.isascii() for k in env_vars
        ):
            raise BadRequest(400, "env_vars must be an object of variable names to strings", "env_vars")
        env_vars = {k: v if isinstance(v, str) else json.dumps(v) for k, v in env_vars.items()}
        if any("\0" in v for v in env_vars.values()):
            raise BadRequest(400, "env_vars values must not contain NUL", "env_vars")
        context_id = data.get("context_id")
        if context_id:
            ctx = self.contexts.get(context_id)
            if ctx is None:
                raise BadRequest(404, f"context {context_id} not found", "context_id")
        else:
            language, kernel_name = self.language_of(data.get("language"))
            try:
                ctx = self.contexts.default(language, kernel_name)
            except Exception as e:
                raise BadRequest(500, f"the {language} kernel did not start: {e}")
        self.run_cell(ctx, code, env_vars)

    # -- execution ------------------------------------------------------------------

    def write_chunk(self, data):
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    def run_cell(self, ctx, code, env_vars):
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
            with ctx.state_lock:
                kernel = ctx.kernel
            connected = self.stream_cell(ctx, kernel, code, env_vars, sock)
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

    def stream_cell(self, ctx, kernel, code, env_vars, sock):
        """Runs one cell on the kernel and forwards its iopub messages as NDJSON lines
        until the kernel is idle again. Returns whether the client is still connected.
        A client that disconnects interrupts the cell; a kernel that does not stop in
        INTERRUPT_GRACE, or dies, is restarted."""
        connected = True
        interrupted_at = None

        def forward(message):
            nonlocal connected
            if connected:
                try:
                    self.write_chunk(line(message))
                except OSError:
                    connected = False

        client = kernel.client
        push, pop = env_code(ctx.language, env_vars)
        reason = None
        try:
            if push:
                kernel.run_silent(push)
            msg_id = client.execute(code, silent=False, store_history=True, allow_stdin=False, stop_on_error=False)
            if pop:
                kernel.run_silent(pop)
        except Exception:
            reason = "the context's kernel is gone"
            msg_id = None
        while msg_id is not None:
            try:
                msg = client.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                msg = None
            except Exception:
                msg = None
                if kernel.retired:
                    reason = "the context was restarted or deleted"
                    break
            if msg is not None and msg.get("parent_header", {}).get("msg_id") == msg_id:
                kind, content = msg["msg_type"], msg["content"]
                if kind == "status" and content.get("execution_state") == "idle":
                    forward({"type": "end_of_execution"})
                    return connected
                if kind == "execute_input":
                    forward({"type": "number_of_executions", "execution_count": content.get("execution_count")})
                elif kind == "stream":
                    text = content.get("text", "")
                    name = "stderr" if content.get("name") == "stderr" else "stdout"
                    for start in range(0, len(text), CHUNK):
                        forward({"type": name, "text": text[start : start + CHUNK], "timestamp": now_ns()})
                elif kind in ("execute_result", "display_data"):
                    forward(result_message(content.get("data") or {}, kind == "execute_result"))
                elif kind == "error":
                    # bash_kernel reports a failed command by its exit status alone.
                    forward(
                        {
                            "type": "error",
                            "name": content.get("ename") or "ExitCode",
                            "value": content.get("evalue", ""),
                            "traceback": "\n".join(content.get("traceback") or []),
                        }
                    )
                continue
            if kernel.retired:
                reason = "the context was deleted" if ctx.deleted else "the context was restarted"
                break
            if not kernel.alive():
                reason = "the context's kernel exited; its state is lost"
                break
            if connected and client_gone(sock):
                connected = False
            if not connected:
                if interrupted_at is None:
                    kernel.interrupt()
                    interrupted_at = time.monotonic()
                elif time.monotonic() - interrupted_at > INTERRUPT_GRACE:
                    reason = "the cell did not stop on interrupt; the kernel was restarted"
                    break
        if not kernel.retired:
            try:
                ctx.restart(dead=kernel)
            except Exception as e:
                print(f"code-interpreter: restarting a {ctx.language} kernel failed: {e}", file=sys.stderr)
        forward({"type": "error", "name": "ContextRestarted", "value": reason or "", "traceback": ""})
        forward({"type": "end_of_execution"})
        return connected


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
    # Bind first (a taken port fails at once), listen only when the default Python
    # kernel is warm: whoever waits for the port then gets a fast first cell.
    server.server_bind()
    try:
        contexts.default(*LANGUAGES["python"])
    except Exception as e:
        print(f"code-interpreter: the default Python kernel did not start: {e}", file=sys.stderr)
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
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
