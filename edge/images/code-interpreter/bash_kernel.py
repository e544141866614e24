#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""OpenDsec's Bash kernel for Jupyter: one bash per kernel (its variables, functions and
working directory kept between cells) on a pseudo-terminal, output streamed to the
kernel's iopub as it comes, stdout and stderr together as on a terminal. A cell is
sourced from a file, so it may span lines; a cell whose status is not zero is an error
with the status as its value (`exit` too: a new bash then takes the old one's place).
Interrupting the kernel interrupts the cell's commands.
"""

import os
import re
import signal
import tempfile
import uuid

import pexpect
from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel

# Printed after every cell with its status; never printed by user code by accident.
MARK = "__opendsec_cell_done_" + uuid.uuid4().hex
MARK_RE = re.compile(r"\r?\n?" + MARK + r" (\d+)\r?\n")


def mark_prefix_at(text):
    """Where a tail of `text` that could be the beginning of the mark's line starts
    (len(text) when none can)."""
    start = max(text.rfind("\n"), text.rfind("\r"))
    while start >= 0:
        tail = text[start:].lstrip("\r\n")
        if MARK.startswith(tail) or tail.startswith(MARK):
            return start
        start = max(text.rfind("\n", 0, start), text.rfind("\r", 0, start))
    return len(text) if not MARK.startswith(text) else 0


class BashKernel(Kernel):
    implementation = "opendsec-bash"
    implementation_version = "1"
    language = "bash"
    language_version = "5"
    language_info = {"name": "bash", "mimetype": "text/x-sh", "file_extension": ".sh", "codemirror_mode": "shell"}
    banner = "Bash"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.cells = tempfile.mkdtemp(prefix="bash-kernel-")
        self.start_bash()

    def start_bash(self):
        env = dict(os.environ, PS1="", PS2="", PROMPT_COMMAND="", TERM="dumb")
        self.bash = pexpect.spawn(
            "/bin/bash",
            ["--noprofile", "--norc", "--noediting"],
            env=env,
            echo=False,
            encoding="utf-8",
            codec_errors="replace",
            timeout=None,
            # The kernel ignores SIGINT outside of cells, and a shell cannot undo an
            # ignored signal: bash and its commands get the default one.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.bash.setwinsize(50, 200)
        self.run_quietly("stty -echo; bind 'set enable-bracketed-paste off' 2>/dev/null; true")

    def run_quietly(self, command):
        self.bash.sendline(f"{command}; printf '\\n{MARK} %d\\n' $?")
        self.bash.expect(MARK_RE)

    def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False):
        if not code.strip():
            return self.reply_ok()
        path = os.path.join(self.cells, "cell.sh")
        with open(path, "w") as f:
            f.write(code if code.endswith("\n") else code + "\n")
        self.bash.sendline(f"source {path}; printf '\\n{MARK} %d\\n' $?")
        status = None
        interrupted = False
        while status is None:
            try:
                index = self.bash.expect([MARK_RE, pexpect.TIMEOUT, pexpect.EOF], timeout=0.05)
                if index == 1:
                    # Pass on what came so far (it stays in pexpect's buffer otherwise),
                    # but for a tail that may be the start of the mark.
                    text = self.bash.buffer
                    keep = mark_prefix_at(text)
                    self.emit(silent, text[:keep])
                    self.bash.buffer = text[keep:]
                    continue
                self.emit(silent, self.bash.before)
                if index == 0:
                    status = int(self.bash.match.group(1))
                elif index == 2:
                    self.bash.wait()
                    status = self.bash.exitstatus if self.bash.exitstatus is not None else 1
            except KeyboardInterrupt:
                # The shell runs in a session of its own: ^C on its terminal interrupts
                # the cell's commands. Bash drops the rest of the line (the mark with
                # it): ask again.
                if not interrupted:
                    self.bash.sendintr()
                    self.bash.sendline(f"printf '\\n{MARK} %d\\n' 130")
                    interrupted = True
        if not self.bash.isalive():
            # `exit` in a cell ends this bash: a new one takes its place (the old one's
            # variables are gone, as after `exit` in a terminal), and the status is the
            # cell's.
            self.start_bash()
        if interrupted or status != 0:
            name = "KeyboardInterrupt" if interrupted else "ExitCode"
            content = {"ename": name, "evalue": str(status), "traceback": []}
            if not silent:
                self.send_response(self.iopub_socket, "error", content)
            return dict(content, status="error", execution_count=self.execution_count)
        return self.reply_ok()

    def emit(self, silent, text):
        if text and not silent:
            text = text.replace("\r\n", "\n")
            self.send_response(self.iopub_socket, "stream", {"name": "stdout", "text": text})

    def reply_ok(self):
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}

    def do_shutdown(self, restart):
        try:
            self.bash.terminate(force=True)
        except Exception:
            pass
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=BashKernel)
