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

With `--claim-stdin` (as the image starts it) the sandbox's variables come from the
agent on stdin (`Claim`), so that a warm container can run this server and its kernels
before a sandbox claims it; cells wait for them.
"""

import argparse
import http.server
import json
import os
import queue
import shlex
import shutil
import signal
import socket
import sys
import threading
import time
import urllib.parse
import uuid

from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager, NoSuchKernel

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

# The kernels the server knows, by the language a context reports. Each runs as
# `python3 <file beside this one>` (ours, so that the server finds its kernels wherever it
# runs) or is an installed Jupyter kernel spec (IRkernel's `ir`, from Debian's
# r-cran-irkernel; JJava's `java`, from PyPI). `needs` is what must be on PATH for the
# language to be offered.
HERE = os.path.dirname(os.path.abspath(__file__))
PYTHON_ARGS = [
    "--InteractiveShell.colors=NoColor",
    "--HistoryManager.enabled=False",
    "--IPKernelApp.exec_files=" + os.path.join(HERE, "python_startup.py"),
]
KERNELS = {
    "python": {"argv": ["python_kernel.py", *PYTHON_ARGS], "needs": []},
    "bash": {"argv": ["bash_kernel.py"], "needs": ["bash"]},
    "javascript": {"argv": ["node_kernel.py"], "needs": ["node"]},
    "typescript": {"argv": ["node_kernel.py"], "needs": ["node"], "module": "typescript"},
    "r": {"spec": "ir", "needs": ["R"]},
    "java": {"spec": "java", "needs": ["java", "jshell"]},
}
# Languages whose kernel cannot change its own environment (a JVM's is fixed at start):
# env vars per call are refused there, naming the field, rather than dropped.
NO_ENV_PER_CALL = ("java",)
# Other names a request may use for them (E2B's SDKs send these).
ALIASES = {"": "python", "python3": "python", "sh": "bash", "js": "javascript", "ts": "typescript"}
# Languages that get their default context at start, after the listen (the others at
# their first use): E2B's own server starts Python and JavaScript.
STARTED_AT_START = ("javascript",)
# Languages of which one spare started kernel is kept for the next new context. Each
# kernel is a process of 50 to 100 MB, and a sandbox's memory is small: only Python's,
# whose contexts SDK users make most.
SPARE_LANGUAGES = ("python",)
# Memory a sandbox must have free for a kernel started ahead of use (a spare, a default
# context at start): below it kernels start only when asked for.
AHEAD_HEADROOM = 256 << 20


def memory_headroom():
    """Bytes this sandbox's cgroup may still use (None when it has no limit)."""
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) - current


def room_for_a_kernel_ahead():
    headroom = memory_headroom()
    return headroom is None or headroom >= AHEAD_HEADROOM

# MIME type of a rich representation -> field of the SDK's `Result` (E2B's names,
# `e2b/data` and `e2b/chart` made by python_startup.py).
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
    "e2b/data": "data",
    "e2b/chart": "chart",
}
# Base64 fields, sent without the line breaks some kernels put in.
BINARY_FIELDS = ("png", "jpeg", "pdf")


def node_package(name):
    """The directory of node package `name` in the global module directories (Debian's,
    npm's global prefix, NODE_PATH), or None: looked up on disk, since starting node
    takes time."""
    dirs = ["/usr/share/nodejs", "/usr/lib/nodejs", "/usr/local/lib/node_modules", "/usr/lib/node_modules"]
    dirs += [d for d in os.environ.get("NODE_PATH", "").split(os.pathsep) if d]
    found = [os.path.join(d, name) for d in dirs if os.path.isfile(os.path.join(d, name, "package.json"))]
    return found[0] if found else None


class Kernels(KernelSpecManager):
    """The kernel specs of KERNELS that this machine can run."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        installed = super().find_kernel_specs()
        self.specs = {}
        for language, kernel in KERNELS.items():
            if not all(shutil.which(tool) for tool in kernel["needs"]):
                continue
            args = list(kernel.get("argv", [])[1:])
            if "module" in kernel:
                package = node_package(kernel["module"])
                if package is None:
                    continue
                args.append(f"--{kernel['module']}={package}")
            if "spec" in kernel:
                if kernel["spec"] in installed:
                    self.specs[language] = super().get_kernel_spec(kernel["spec"])
                continue
            argv = [sys.executable, os.path.join(HERE, kernel["argv"][0]), *args, "-f", "{connection_file}"]
            self.specs[language] = KernelSpec(argv=argv, display_name=language, language=language, interrupt_mode="signal")

    def languages(self):
        return sorted(self.specs)

    def get_kernel_spec(self, kernel_name):
        # jupyter_client renames a kernel called `python` to `python3`.
        spec = self.specs.get("python" if kernel_name == "python3" else kernel_name)
        if spec is None:
            raise NoSuchKernel(kernel_name)
        return spec


def now_ns():
    return time.time_ns()


def line(message):
    return json.dumps(message).encode() + b"\n"


def quoted(value, quote="'"):
    return quote + value.replace("\\", "\\\\").replace(quote, "\\" + quote) + quote


def env_code(language, env_vars):
    """The code that sets one execution's env vars in a kernel, and the code that puts
    the kernel's own values back after it (E2B sets them in the kernel's language)."""
    if not env_vars:
        return None, None
    if language == "python":
        return f"__opendsec_env_push({env_vars!r})", "__opendsec_env_pop()"
    if language in ("javascript", "typescript"):
        saved = json.dumps({k: None for k in env_vars})
        push = (
            f"globalThis.__opendsec_env = (globalThis.__opendsec_env || []).concat([Object.fromEntries("
            f"Object.keys({saved}).map(k => [k, process.env[k]]))]);"
            f"Object.assign(process.env, {json.dumps(env_vars)});undefined"
        )
        pop = (
            "for (const [k, v] of Object.entries(globalThis.__opendsec_env.pop())) "
            "{ if (v === undefined) delete process.env[k]; else process.env[k] = v; }"
        )
        return push, pop
    if language == "r":
        names = "c(" + ", ".join(quoted(k, '"') for k in env_vars) + ")"
        push = (
            f".opendsec_env <- c(if (exists('.opendsec_env')) .opendsec_env, list(Sys.getenv({names}, unset = NA, names = TRUE))); "
            "Sys.setenv(" + ", ".join(f"{quoted(k, '`')} = {quoted(v, chr(34))}" for k, v in env_vars.items()) + "); invisible()"
        )
        pop = (
            ".opendsec_old <- .opendsec_env[[length(.opendsec_env)]]; .opendsec_env <- .opendsec_env[-length(.opendsec_env)]; "
            "for (.k in names(.opendsec_old)) if (is.na(.opendsec_old[[.k]])) Sys.unsetenv(.k) else "
            "do.call(Sys.setenv, stats::setNames(list(.opendsec_old[[.k]]), .k)); invisible()"
        )
        return push, pop
    saved = "; ".join(
        f"__opendsec_saved_{i}=${{{k}+set}}; __opendsec_value_{i}=${{{k}-}}" for i, k in enumerate(env_vars)
    )
    push = saved + "; " + "; ".join(f"export {k}={shlex.quote(v)}" for k, v in env_vars.items())
    pop = "; ".join(
        f'if [ -n "$__opendsec_saved_{i}" ]; then export {k}="$__opendsec_value_{i}"; else unset {k}; fi'
        for i, k in enumerate(env_vars)
    )
    return push, pop


def env_set_code(language, env):
    """The code that sets `env` in a kernel for good (the sandbox's variables in a kernel
    started before the sandbox claimed its container), or None where a kernel cannot."""
    if not env:
        return None
    if language == "python":
        return f"__import__('os').environ.update({env!r})"
    if language in ("javascript", "typescript"):
        return f"Object.assign(process.env, {json.dumps(env)});undefined"
    if language == "r":
        return "Sys.setenv(" + ", ".join(f"{quoted(k, '`')} = {quoted(v, chr(34))}" for k, v in env.items()) + "); invisible()"
    if language == "bash":
        return "; ".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
    return None


class Claim:
    """The sandbox's variables. With `--claim-stdin` the agent writes them on stdin as
    one JSON line, `{"env": {...}}`, then closes it: at boot, or for a warm container
    started ahead of its sandbox (kernels up), when a sandbox claims it. They go into the
    server's environment (kernels started later inherit them) and, before their next
    cell, into every kernel started before (`generation` tells which). Cells wait for
    the claim."""

    WAIT = 60.0

    def __init__(self):
        self.lock = threading.Lock()
        self.generation = 0
        self.env = {}
        self.done = threading.Event()

    def unclaimed(self):
        """No --claim-stdin: the server's own environment is the sandbox's."""
        self.done.set()

    def read(self, stream, contexts):
        env = {}
        try:
            line = stream.readline()
            value = json.loads(line) if line.strip() else {}
            env = value.get("env") or {}
            if not isinstance(env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) and k and "=" not in k and "\0" not in k + v
                for k, v in env.items()
            ):
                print("code-interpreter: the claim's env is not a map of names to strings; ignored", file=sys.stderr)
                env = {}
        except (OSError, ValueError, AttributeError) as e:
            print(f"code-interpreter: reading the claim: {e}", file=sys.stderr)
        with self.lock:
            # Kernels started before the claim have the server's environment: only what
            # the claim changes (the sandbox's own variables; the image's are there
            # already) needs giving them, and nothing at all when the claim adds none.
            changed = {k: v for k, v in env.items() if os.environ.get(k) != v}
            os.environ.update(changed)
            self.env = changed
            self.generation += 1
        # Cells may come now: one brings its own kernel up to the claim first (`code_for`,
        # sent ahead of the cell); meanwhile the kernels of idle contexts take it.
        self.done.set()
        contexts.bring_up_to_claim()

    def wait(self):
        if not self.done.wait(self.WAIT):
            raise BadRequest(503, "the sandbox has not handed its variables to the code interpreter yet")

    def environment(self):
        """The environment for a kernel starting now, and the claim it has."""
        with self.lock:
            return dict(os.environ), self.generation

    def code_for(self, kernel):
        """The code that brings `kernel` up to the claim (None when it is)."""
        with self.lock:
            if kernel.claim_generation >= self.generation:
                return None
            kernel.claim_generation = self.generation
            return env_set_code(kernel.language, self.env)


CLAIM = Claim()


def traceback_text(pieces):
    """A kernel's traceback pieces as one string: E2B joins them as they are; IPython's
    pieces do not all end their line, so a line break goes where one is missing."""
    text = ""
    for piece in pieces:
        if text and not text.endswith("\n"):
            text += "\n"
        text += piece
    return text


def result_message(bundle, is_main):
    """One `display_data` or `execute_result` MIME bundle as E2B's result line."""
    message = {"type": "result"}
    extra = {}
    for mime, value in bundle.items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
        elif field in BINARY_FIELDS and isinstance(value, str):
            message[field] = "".join(value.split())
        else:
            message[field] = value
    text = message.get("text")
    # E2B's server drops the quotes around a string's repr: 'bar' reads back as bar.
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        message["text"] = text[1:-1]
    if extra:
        message["extra"] = extra
    message["is_main_result"] = is_main
    return message


class Kernel:
    """One running Jupyter kernel, with its blocking client."""

    def __init__(self, language, cwd, specs):
        self.language = language
        self.cwd = cwd
        self.retired = False
        self.manager = KernelManager(kernel_name=language, kernel_spec_manager=specs)
        env, self.claim_generation = CLAIM.environment()
        env.pop("JPY_PARENT_PID", None)
        env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
        self.manager.start_kernel(cwd=cwd, env=env)
        try:
            self.client = self.manager.blocking_client()
            self.client.start_channels()
            self.client.wait_for_ready(timeout=KERNEL_START_TIMEOUT)
        except BaseException:
            self.kill()
            raise

    def run_silent(self, code):
        return self.client.execute(code, silent=True, store_history=False, allow_stdin=False, stop_on_error=False)

    def run_and_wait(self, code, timeout):
        """Runs `code` silently and waits for its reply (only the caller, holding the
        context's cell lock, reads the kernel's shell channel)."""
        msg_id = self.run_silent(code)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            reply = self.client.get_shell_msg(timeout=max(0.01, deadline - time.monotonic()))
            if reply.get("parent_header", {}).get("msg_id") == msg_id:
                return
        raise TimeoutError(f"no reply within {timeout} s")

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

    def exit_code(self):
        process = getattr(getattr(self.manager, "provisioner", None), "process", None)
        return process.poll() if process is not None else None

    def kill(self):
        self.retired = True
        for stop in (
            lambda: self.client.stop_channels(),
            lambda: self.manager.shutdown_kernel(now=True),
            lambda: self.manager.cleanup_resources(),
        ):
            try:
                stop()
            except Exception:
                pass


class WarmKernels:
    """One started kernel per language of SPARE_LANGUAGES kept ready (in the default
    directory), so that a new context does not wait for a kernel to start. A spare is
    made again in the background once taken."""

    def __init__(self, default_cwd, specs):
        self.default_cwd = default_cwd
        self.specs = specs
        self.lock = threading.Lock()
        self.ready = {}
        self.starting = set()
        self.closed = False

    def take(self, language, cwd):
        with self.lock:
            kernel = self.ready.pop(language, None) if cwd == self.default_cwd else None
        if kernel is not None and not kernel.alive():
            kernel.kill()
            kernel = None
        self.refill(language)
        return kernel if kernel is not None else Kernel(language, cwd, self.specs)

    def refill(self, language):
        with self.lock:
            if language not in SPARE_LANGUAGES or self.closed or language in self.ready or language in self.starting:
                return
            if not room_for_a_kernel_ahead():
                return
            self.starting.add(language)
        threading.Thread(target=self._start, args=(language,), daemon=True).start()

    def _start(self, language):
        try:
            kernel = Kernel(language, self.default_cwd, self.specs)
        except Exception as e:
            print(f"code-interpreter: a spare {language} kernel did not start: {e}", file=sys.stderr)
            kernel = None
        with self.lock:
            self.starting.discard(language)
            if kernel is not None and not self.closed:
                self.ready[language], kernel = kernel, None
        if kernel is not None:
            kernel.kill()

    def shutdown(self):
        with self.lock:
            self.closed = True
            spares = list(self.ready.values())
            self.ready.clear()
        for kernel in spares:
            kernel.kill()


class Context:
    def __init__(self, language, cwd, warm):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.warm = warm
        # One cell at a time; a restart or delete does not wait for it.
        self.exec_lock = threading.Lock()
        self.state_lock = threading.Lock()
        self.deleted = False
        self.kernel = warm.take(language, cwd)

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
        new = self.warm.take(self.language, self.cwd)
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
        self.specs = Kernels()
        self.warm = WarmKernels(default_cwd, self.specs)
        self.lock = threading.Lock()
        self.by_id = {}
        self.defaults = {}
        # Per language: held while its default context is made (others wait for it).
        self.default_locks = {language: threading.Lock() for language in self.specs.languages()}

    def languages(self):
        return self.specs.languages()

    def start_in_background(self, languages):
        self.warm.refill("python")
        for language in languages:
            if language in self.default_locks and room_for_a_kernel_ahead():
                try:
                    self.default(language)
                except Exception as e:
                    print(f"code-interpreter: the default {language} kernel did not start: {e}", file=sys.stderr)

    def create(self, language, cwd):
        ctx = Context(language, cwd, self.warm)
        with self.lock:
            self.by_id[ctx.id] = ctx
        return ctx

    def get(self, context_id):
        with self.lock:
            return self.by_id.get(context_id)

    def default(self, language):
        """The default context of a language, created on first use (or after a delete)."""
        with self.default_locks[language]:
            with self.lock:
                ctx = self.by_id.get(self.defaults.get(language))
            if ctx is None:
                ctx = Context(language, self.default_cwd, self.warm)
                with self.lock:
                    self.by_id[ctx.id] = ctx
                    self.defaults[language] = ctx.id
            return ctx

    def list(self):
        with self.lock:
            return [ctx.describe() for ctx in self.by_id.values()]

    def bring_up_to_claim(self):
        """Gives the kernel of each idle context the sandbox's variables (a busy one
        takes them before its next cell) and waits for each to have them."""
        with self.lock:
            contexts = list(self.by_id.values())
        for ctx in contexts:
            if not ctx.exec_lock.acquire(blocking=False):
                continue
            try:
                with ctx.state_lock:
                    kernel = ctx.kernel
                code = CLAIM.code_for(kernel)
                if code:
                    kernel.run_and_wait(code, timeout=10.0)
            except Exception as e:
                print(f"code-interpreter: giving a {ctx.language} kernel the sandbox's variables: {e}", file=sys.stderr)
            finally:
                ctx.exec_lock.release()

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
        self.warm.shutdown()
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
        CLAIM.wait()
        language = self.language_of(data.get("language"))
        cwd = data.get("cwd") or self.contexts.default_cwd
        if not isinstance(cwd, str) or not os.path.isdir(cwd):
            raise BadRequest(400, f"cwd {cwd!r} is not a directory", "cwd")
        try:
            ctx = self.contexts.create(language, cwd)
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
        """The language a request names (Python when it names none), or a 400 that
        names it and the languages this server has."""
        if value is not None and not isinstance(value, str):
            raise BadRequest(400, "language must be a string", "language")
        key = (value or "").strip().lower()
        language = ALIASES.get(key, key)
        available = self.contexts.languages()
        if language not in available:
            known = "" if language in KERNELS else "unknown "
            raise BadRequest(
                400,
                f"{known}language {value!r} is not available in this sandbox: use one of {', '.join(available)}",
                "language",
            )
        return language

    def execute(self):
        data = self.read_json()
        CLAIM.wait()
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
            language = self.language_of(data.get("language"))
            try:
                ctx = self.contexts.default(language)
            except Exception as e:
                raise BadRequest(500, f"the {language} kernel did not start: {e}")
        if env_vars and ctx.language in NO_ENV_PER_CALL:
            raise BadRequest(
                400,
                f"env_vars per call are not supported in {ctx.language} (its kernel's environment is fixed at start): "
                "set them when creating the sandbox",
                "env_vars",
            )
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
        errored = False
        interrupted_at = None
        next_check = 0.0

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
            claimed = CLAIM.code_for(kernel)
            if claimed:
                kernel.run_silent(claimed)
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
                    # One error per cell, as E2B's; the traceback's pieces joined as
                    # E2B joins them. bash_kernel reports a failed command by its exit
                    # status alone.
                    if not errored:
                        errored = True
                        forward(
                            {
                                "type": "error",
                                "name": content.get("ename") or "ExitCode",
                                "value": content.get("evalue", ""),
                                "traceback": traceback_text(content.get("traceback") or []),
                            }
                        )
                # A cell that never stops printing must still notice its client leave.
                if time.monotonic() < next_check:
                    continue
            next_check = time.monotonic() + 0.2
            if kernel.retired:
                reason = "the context was deleted" if ctx.deleted else "the context was restarted"
                break
            if not kernel.alive():
                # Its last messages may still be on their way.
                drain_until = time.monotonic() + 0.5
                while time.monotonic() < drain_until:
                    try:
                        msg = client.get_iopub_msg(timeout=0.1)
                    except Exception:
                        continue
                    if msg.get("parent_header", {}).get("msg_id") == msg_id and msg["msg_type"] == "stream":
                        forward({"type": msg["content"].get("name", "stdout"), "text": msg["content"].get("text", ""), "timestamp": now_ns()})
                code = kernel.exit_code()
                status = f" with exit code {code}" if code is not None else ""
                reason = f"the kernel exited{status}; it was restarted and its state is lost"
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
        # E2B's name for an execution its kernel's restart ended.
        forward({"type": "error", "name": "ContextRestarting", "value": f"Context was restarted: {reason or ''}", "traceback": ""})
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
    if args.claim_stdin:
        threading.Thread(target=CLAIM.read, args=(sys.stdin, contexts), daemon=True).start()
    else:
        CLAIM.unclaimed()
    server = Server((args.host, args.port), Handler, bind_and_activate=False)
    server.verbose = args.verbose
    # Bind first (a taken port fails at once), listen only when the default Python
    # kernel is warm: whoever waits for the port then gets a fast first cell.
    server.server_bind()
    try:
        contexts.default("python")
    except Exception as e:
        print(f"code-interpreter: the default Python kernel did not start: {e}", file=sys.stderr)
        contexts.shutdown()
        sys.exit(1)
    server.server_activate()
    # Then, while the first cells run: a spare Python kernel for new contexts and the
    # default contexts of the languages E2B starts at once.
    threading.Thread(target=contexts.start_in_background, args=(STARTED_AT_START,), daemon=True).start()

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
    parser.add_argument(
        "--claim-stdin",
        action="store_true",
        help="read the sandbox's variables from stdin (one JSON line from the agent) before running cells",
    )
    serve(parser.parse_args())


if __name__ == "__main__":
    main()
