#!/usr/bin/env python3
# SPDX-License-Identifier: AGPL-3.0-only
"""How long the code-interpreter server takes from its start to a first result: the
part of a cold `code_interpreter.Sandbox.create()` and first `run_code` that the image's
server decides (the sandbox's own start is measured by ops/bench/e2b_bench.py).

Runs the server on the host's /usr/bin/python3 (the interpreter the image has; the
host needs ops/lib.sh's CODE_INTERPRETER_TEST_PACKAGES) `--runs` times and prints the
p50 and p90 of: start to listening (what a create waits for), then the first
`run_code("1+1")`, and the sum, beside a bare `python3 -c pass` for the floor.

    /usr/bin/python3 ops/bench/code_interpreter_start.py [--runs 10] [--server PATH]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_SERVER = os.path.join(HERE, "..", "..", "edge", "images", "code-interpreter", "server.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def once(server, cwd):
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        ["/usr/bin/python3", server, "--host", "127.0.0.1", "--port", str(port), "--cwd", cwd],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.005)
        listening = time.monotonic()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/execute",
            data=json.dumps({"code": "1+1"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            lines = [json.loads(line) for line in response.read().splitlines() if line.strip()]
        first = time.monotonic()
        texts = [line.get("text") for line in lines if line.get("type") == "result"]
        if texts != ["2"]:
            raise RuntimeError(f"run_code('1+1') gave {lines}")
        return (listening - started) * 1000, (first - listening) * 1000
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--server", default=DEFAULT_SERVER)
    args = ap.parse_args()
    floor = []
    for _ in range(args.runs):
        t = time.monotonic()
        subprocess.run(["/usr/bin/python3", "-c", "pass"], check=True)
        floor.append((time.monotonic() - t) * 1000)
    listen, first, total = [], [], []
    with tempfile.TemporaryDirectory() as cwd:
        for i in range(args.runs):
            a, b = once(args.server, cwd)
            listen.append(a)
            first.append(b)
            total.append(a + b)
            print(f"  run {i + 1}/{args.runs}: listening {a:.0f} ms, first result {b:.1f} ms", file=sys.stderr)
    print(f"code-interpreter server {os.path.relpath(args.server)}: {args.runs} runs, {os.cpu_count()} cores")
    print("| measurement                     |      p50 |      p90 |")
    print("|---------------------------------|----------|----------|")
    for name, values in (
        ("start -> listening", listen),
        ('then first run_code("1+1")', first),
        ("start -> first result", total),
        ("python3 -c pass (the floor)", floor),
    ):
        print(f"| {name:<31} | {statistics.median(values):6.0f} ms | {percentile(values, 90):6.0f} ms |")


if __name__ == "__main__":
    main()
