"""Specification: creating a sandbox and running commands and terminals in it through
the synchronous client, `e2b.Sandbox` 2.63.0.

One sandbox serves the whole module: created with metadata and environment variables,
it runs every command below as E2B's defaults say (bash, user `user` in /home/user).
"""

import time
from datetime import datetime, timezone

import httpx
import pytest
from e2b import CommandExitException, NotFoundException, PtySize, Sandbox, SandboxState

from conftest import BASE_TEMPLATE, wait_until


@pytest.fixture(scope="module")
def sandbox(run_id):
    sb = Sandbox.create(
        template=BASE_TEMPLATE,
        timeout=600,
        metadata={"suite": run_id, "module": "sync_commands"},
        envs={"A": "from-create", "SHARED": "from-create"},
    )
    yield sb
    sb.kill()


def pids(sandbox):
    return {p.pid for p in sandbox.commands.list()}


# --- create ----------------------------------------------------------------------


def test_create_returns_a_running_sandbox_that_reports_its_metadata(sandbox, run_id):
    info = sandbox.get_info()
    assert info.sandbox_id == sandbox.sandbox_id
    assert BASE_TEMPLATE in (info.template_id, info.name), info
    assert info.metadata == {"suite": run_id, "module": "sync_commands"}
    assert info.state == SandboxState.RUNNING
    assert info.cpu_count >= 1 and info.memory_mb > 0, info
    now = datetime.now(timezone.utc)
    assert info.started_at <= now < info.end_at, info
    assert sandbox.is_running()


def test_env_vars_given_at_create_are_seen_by_every_command(sandbox):
    assert sandbox.commands.run("echo $A").stdout == "from-create\n"
    assert sandbox.commands.run("echo $SHARED", user="root").stdout == "from-create\n"


# --- commands.run ----------------------------------------------------------------


def test_run_returns_stdout_stderr_and_exit_code(sandbox):
    r = sandbox.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)


def test_a_nonzero_exit_raises_command_exit_exception_with_code_and_output(sandbox):
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("echo partial; echo boom >&2; exit 3")
    assert e.value.exit_code == 3
    assert e.value.stdout == "partial\n"
    assert e.value.stderr == "boom\n"


def test_output_callbacks_receive_the_output_as_it_streams(sandbox):
    out, err = [], []
    r = sandbox.commands.run(
        "for i in 1 2 3; do echo $i; sleep 0.05; done; echo e >&2",
        on_stdout=out.append,
        on_stderr=err.append,
    )
    assert "".join(out) == "1\n2\n3\n" == r.stdout
    assert "".join(err) == "e\n" == r.stderr


def test_output_is_streamed_through_the_gateway_not_buffered_to_the_end(sandbox):
    start = time.monotonic()
    arrivals = []
    sandbox.commands.run("echo first; sleep 2; echo second", on_stdout=lambda s: arrivals.append((time.monotonic() - start, s)))
    assert [s for _, s in arrivals] == ["first\n", "second\n"]
    assert arrivals[0][0] < 1.5, f"the first line came only after {arrivals[0][0]:.2f} s"


def test_large_output_arrives_whole(sandbox):
    r = sandbox.commands.run("seq 1 200000")
    lines = r.stdout.splitlines()
    assert len(lines) == 200000 and lines[0] == "1" and lines[-1] == "200000"


def test_per_command_envs_extend_and_override_the_sandbox_envs(sandbox):
    r = sandbox.commands.run("echo $A-$B-$SHARED", envs={"B": "b", "SHARED": "per-command"})
    assert r.stdout == "from-create-b-per-command\n"


def test_commands_start_in_the_home_directory_and_cwd_changes_it(sandbox):
    assert sandbox.commands.run("pwd").stdout == "/home/user\n"
    sandbox.commands.run("mkdir -p /tmp/work-dir")
    assert sandbox.commands.run("pwd", cwd="/tmp/work-dir").stdout == "/tmp/work-dir\n"


def test_commands_run_as_user_by_default_and_as_root_on_request(sandbox):
    assert sandbox.commands.run("whoami; echo $HOME").stdout == "user\n/home/user\n"
    assert sandbox.commands.run("whoami; id -u", user="root").stdout == "root\n0\n"
    with pytest.raises(CommandExitException):
        sandbox.commands.run("touch /root/not-yours")


def test_a_command_without_stdin_reads_end_of_file(sandbox):
    assert sandbox.commands.run("cat; echo after", timeout=10).stdout == "after\n"


# --- background commands ---------------------------------------------------------


def test_a_background_command_returns_a_handle_to_wait_for(sandbox):
    h = sandbox.commands.run("sleep 0.3; echo done", background=True)
    assert h.pid > 0
    r = h.wait()
    assert (r.stdout, r.exit_code) == ("done\n", 0)


def test_a_background_command_is_listed_with_its_config_until_it_is_killed(sandbox):
    h = sandbox.commands.run("sleep 600", background=True, envs={"TAG": "listed"}, cwd="/tmp")
    listed = {p.pid: p for p in sandbox.commands.list()}
    assert h.pid in listed, listed
    p = listed[h.pid]
    assert p.cmd == "/bin/bash"
    assert p.args == ["-l", "-c", "sleep 600"]
    assert p.envs.get("TAG") == "listed"
    assert p.cwd == "/tmp"

    assert h.kill() is True
    with pytest.raises(CommandExitException) as e:
        h.wait()
    assert e.value.exit_code != 0
    wait_until(lambda: h.pid not in pids(sandbox), "the killed command left the process list")


def test_commands_kill_by_pid_and_an_unknown_pid_is_not_found(sandbox):
    h = sandbox.commands.run("sleep 600", background=True)
    assert sandbox.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    wait_until(lambda: h.pid not in pids(sandbox), "the killed command left the process list")
    assert sandbox.commands.kill(h.pid) is False
    assert sandbox.commands.kill(999_999) is False


def test_connect_attaches_to_a_running_background_command(sandbox):
    h = sandbox.commands.run(
        "for i in $(seq 1 20); do echo tick-$i; sleep 0.1; done",
        background=True,
    )
    h.disconnect()
    r = sandbox.commands.connect(h.pid).wait()
    assert r.exit_code == 0
    assert r.stdout.endswith("tick-20\n"), r.stdout


def test_connect_to_an_unknown_pid_raises_not_found(sandbox):
    with pytest.raises(NotFoundException):
        sandbox.commands.connect(999_999)


# --- stdin -----------------------------------------------------------------------


def test_stdin_is_streamed_to_a_command_started_with_stdin(sandbox):
    h = sandbox.commands.run("read line; echo got:$line", background=True, stdin=True)
    sandbox.commands.send_stdin(h.pid, "hello\n")
    assert h.wait().stdout == "got:hello\n"


def test_closing_stdin_ends_the_input(sandbox):
    h = sandbox.commands.run("cat; echo eof", background=True, stdin=True)
    h.send_stdin("abc")
    h.send_stdin(b"def")
    h.close_stdin()
    assert h.wait().stdout == "abcdefeof\n"


# --- a port of the sandbox through the single URL -------------------------------------


def test_a_port_inside_the_sandbox_is_reached_through_the_single_url(sandbox, sandbox_url):
    """What `get_host(port)` names by host name (tested in test_domain.py) is, with one
    E2B_SANDBOX_URL, the same URL with `E2b-Sandbox-Port: <port>`: the routing headers
    the SDK itself sends for ports 49983 and 49999."""
    sandbox.files.write("/home/user/www/index.html", "from port 8000")
    server = sandbox.commands.run("python3 -m http.server 8000", background=True, cwd="/home/user/www")
    try:
        headers = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8000"}

        def served():
            try:
                r = httpx.get(f"{sandbox_url}/index.html", headers=headers, timeout=10)
            except httpx.TransportError:
                return None
            return r if r.status_code == 200 else None

        r = wait_until(served, "the server on port 8000 answered through the gateway")
        assert r.text == "from port 8000"
    finally:
        server.kill()


# --- PTY -------------------------------------------------------------------------


def read_pty_until(events, out: bytearray, needle: bytes):
    """Reads PTY output from the handle's event iterator until `needle` appears."""
    for _, _, pty in events:
        if pty is not None:
            out.extend(pty)
            if needle in out:
                return
    pytest.fail(f"the terminal ended before printing {needle!r}: {bytes(out)!r}")


def test_a_pty_runs_an_interactive_shell_that_sees_input_and_resizes(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=60)
    events = iter(h)
    out = bytearray()

    # The terminal echoes the input; `$((6*7))` only becomes 42 in the output.
    sandbox.pty.send_stdin(h.pid, b"echo pty-$((6*7)); tty; stty size\n")
    read_pty_until(events, out, b"24 80")
    assert b"pty-42" in out
    assert b"/dev/pts/" in out

    sandbox.pty.resize(h.pid, PtySize(rows=40, cols=120))
    sandbox.pty.send_stdin(h.pid, b"stty size; whoami; exit 0\n")
    read_pty_until(events, out, b"40 120")
    for _, _, pty in events:  # to the end of the terminal
        out.extend(pty or b"")
    assert h.wait().exit_code == 0
    assert b"user" in out.split(b"40 120", 1)[1]


def test_a_pty_can_be_killed(sandbox):
    h = sandbox.pty.create(PtySize(rows=24, cols=80), timeout=60)
    assert h.pid in pids(sandbox)
    assert sandbox.pty.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        h.wait()
    wait_until(lambda: h.pid not in pids(sandbox), "the killed terminal left the process list")
