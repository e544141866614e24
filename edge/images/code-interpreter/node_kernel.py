#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""OpenDsec's JavaScript and TypeScript kernels for Jupyter (`--typescript` for the
latter): a wrapper kernel (ipykernel's Kernel) over one persistent `node` process
running node_kernel.js, so that globals live on between cells. ijavascript and tslab
need native ZeroMQ builds that npm fetches as prebuilt binaries from other hosts; this
kernel needs only node (and, for TypeScript, the `typescript` package's transpiler).

A cell's value is its result (`util.inspect`), `display(x)` adds others, `console.log`
and the output of child processes stream as stdout and stderr. A thrown error is an
error with its name, message and stack. An interrupt stops the cell and keeps the
kernel's state; a node that exits takes the kernel with it (the server restarts it).
"""

import codecs
import json
import os
import select
import subprocess
import sys

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

HERE = os.path.dirname(os.path.abspath(__file__))
# `--typescript=<the typescript package's directory>` makes it the TypeScript kernel.
TYPESCRIPT = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--typescript=")), None)
sys.argv = [a for a in sys.argv if not a.startswith("--typescript=")]


class NodeKernel(Kernel):
    implementation = "opendsec-node"
    implementation_version = "1"
    language = "typescript" if TYPESCRIPT else "javascript"
    language_version = ""
    language_info = {
        "name": language,
        "mimetype": "text/typescript" if TYPESCRIPT else "text/javascript",
        "file_extension": ".ts" if TYPESCRIPT else ".js",
    }
    banner = "TypeScript (node)" if TYPESCRIPT else "JavaScript (node)"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        requests_r, self.requests = os.pipe()
        self.replies, replies_w = os.pipe()
        argv = ["node", os.path.join(HERE, "node_kernel.js"), f"--fds={requests_r},{replies_w}"]
        if TYPESCRIPT:
            argv.append(f"--typescript={TYPESCRIPT}")
        self.node = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(requests_r, replies_w),
        )
        os.close(requests_r)
        os.close(replies_w)
        self.streams = {
            self.node.stdout.fileno(): ("stdout", codecs.getincrementaldecoder("utf-8")("replace")),
            self.node.stderr.fileno(): ("stderr", codecs.getincrementaldecoder("utf-8")("replace")),
        }
        self.pending = b""

    def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False):
        if not code.strip():
            return self.reply_ok()
        os.write(self.requests, (json.dumps({"code": code}) + "\n").encode())
        error = None
        done = False
        while not done:
            try:
                ready, _, _ = select.select([self.replies, *self.streams], [], [], 1.0)
            except KeyboardInterrupt:
                # The interrupt reached node too (the kernel's process group): it ends
                # the cell with an error reply.
                continue
            for fd in ready:
                if fd in self.streams:
                    self.forward(fd, silent)
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    self.node_exited(silent)
                self.pending += data
                while b"\n" in self.pending:
                    line, self.pending = self.pending.split(b"\n", 1)
                    message = json.loads(line)
                    kind = message["type"]
                    if kind == "done":
                        done = True
                    elif kind == "error":
                        error = {k: message[k] for k in ("ename", "evalue", "traceback")}
                    elif not silent:
                        content = {"data": message["data"], "metadata": {}}
                        if kind == "result":
                            content["execution_count"] = self.execution_count
                            self.send_response(self.iopub_socket, "execute_result", content)
                        else:
                            self.send_response(self.iopub_socket, "display_data", content)
        # What the cell wrote before its end is in the pipes already: pass it on first.
        for fd in self.streams:
            while select.select([fd], [], [], 0)[0] and self.forward(fd, silent):
                pass
        if error is not None:
            if not silent:
                self.send_response(self.iopub_socket, "error", error)
            return dict(error, status="error", execution_count=self.execution_count)
        return self.reply_ok()

    def forward(self, fd, silent):
        """Passes on what one of node's output pipes holds; False at its end."""
        name, decoder = self.streams[fd]
        data = os.read(fd, 1 << 16)
        text = decoder.decode(data, final=not data)
        if text and not silent:
            self.send_response(self.iopub_socket, "stream", {"name": name, "text": text})
        if not data:
            self.node_exited(silent)
        return bool(data)

    def node_exited(self, silent):
        status = self.node.wait()
        if not silent:
            self.send_response(self.iopub_socket, "stream", {"name": "stderr", "text": f"node exited with status {status}\n"})
        os._exit(0)

    def reply_ok(self):
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}

    def do_shutdown(self, restart):
        self.node.kill()
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=NodeKernel)
