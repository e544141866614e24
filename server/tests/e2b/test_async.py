"""Specification: the asynchronous client, `e2b.AsyncSandbox` 2.63.0, against the same
server: create, list, commands (callbacks, background, stdin, kill, list, connect),
PTY with `on_data`, files and the streaming `watch_dir`, and many calls at once over
one sandbox.

One sandbox serves the module, on one event loop (pytest.ini: loop scope `module`).
"""

import asyncio
import time

import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEventType,
    FileType,
    PtySize,
    SandboxQuery,
    SandboxState,
)

from conftest import BASE_TEMPLATE


async def eventually(probe, what: str, within: float = 15.0, every: float = 0.2):
    """Awaits `probe()` until it is truthy and returns it; fails after `within` seconds."""
    deadline = time.monotonic() + within
    while True:
        last = await probe()
        if last:
            return last
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within} s (last value: {last!r})")
        await asyncio.sleep(every)


@pytest.fixture(scope="module")
async def sandbox(run_id):
    sb = await AsyncSandbox.create(
        template=BASE_TEMPLATE,
        timeout=600,
        metadata={"suite": run_id, "module": "async"},
        envs={"A": "async-env"},
    )
    yield sb
    await sb.kill()


async def pids(sandbox):
    return {p.pid for p in await sandbox.commands.list()}


# --- create, info, list ------------------------------------------------------------


async def test_create_gives_a_running_sandbox_with_its_metadata_and_envs(sandbox, run_id):
    assert await sandbox.is_running()
    info = await sandbox.get_info()
    assert info.state == SandboxState.RUNNING
    assert info.metadata == {"suite": run_id, "module": "async"}
    assert (await sandbox.commands.run("echo $A")).stdout == "async-env\n"


async def test_list_finds_the_sandbox_by_its_metadata(sandbox, run_id):
    pages = AsyncSandbox.list(query=SandboxQuery(metadata={"suite": run_id, "module": "async"}))
    infos = await pages.next_items()
    assert [i.sandbox_id for i in infos] == [sandbox.sandbox_id]
    assert not pages.has_next


async def test_connect_by_id_returns_a_working_client(sandbox):
    same = await AsyncSandbox.connect(sandbox.sandbox_id)
    assert (await same.commands.run("echo $A")).stdout == "async-env\n"


# --- commands ----------------------------------------------------------------------


async def test_run_streams_output_to_sync_and_async_callbacks(sandbox):
    out, err = [], []

    async def on_stderr(line):
        err.append(line)

    r = await sandbox.commands.run(
        "for i in 1 2 3; do echo $i; done; echo e >&2",
        on_stdout=out.append,
        on_stderr=on_stderr,
    )
    assert "".join(out) == "1\n2\n3\n" == r.stdout
    assert "".join(err) == "e\n" == r.stderr


async def test_a_nonzero_exit_raises_command_exit_exception(sandbox):
    with pytest.raises(CommandExitException) as e:
        await sandbox.commands.run("echo nope >&2; exit 7")
    assert (e.value.exit_code, e.value.stderr) == (7, "nope\n")


async def test_envs_cwd_and_user_apply_per_command(sandbox):
    r = await sandbox.commands.run("echo $B; pwd; whoami", envs={"B": "bee"}, cwd="/tmp")
    assert r.stdout == "bee\n/tmp\nuser\n"
    assert (await sandbox.commands.run("whoami", user="root")).stdout == "root\n"


async def test_background_commands_can_be_waited_for_listed_and_killed(sandbox):
    quick = await sandbox.commands.run("sleep 0.2; echo done", background=True)
    slow = await sandbox.commands.run("sleep 600", background=True)
    assert slow.pid in await pids(sandbox)
    assert (await quick.wait()).stdout == "done\n"

    assert await slow.kill() is True
    with pytest.raises(CommandExitException):
        await slow.wait()
    await eventually(lambda: _gone(sandbox, slow.pid), "the killed command left the process list")
    assert await sandbox.commands.kill(slow.pid) is False


async def _gone(sandbox, pid):
    return pid not in await pids(sandbox)


async def test_stdin_reaches_a_background_command(sandbox):
    h = await sandbox.commands.run("read a; read b; echo $b-$a", background=True, stdin=True)
    await sandbox.commands.send_stdin(h.pid, "one\n")
    await h.send_stdin(b"two\n")
    assert (await h.wait()).stdout == "two-one\n"


async def test_connect_attaches_to_a_running_command(sandbox):
    h = await sandbox.commands.run("sleep 0.5; echo finished", background=True)
    await h.disconnect()
    attached = await sandbox.commands.connect(h.pid)
    r = await attached.wait()
    assert (r.exit_code, r.stdout) == (0, "finished\n")


async def test_many_commands_run_at_once(sandbox):
    results = await asyncio.gather(*(sandbox.commands.run(f"sleep 0.2; echo {i}") for i in range(12)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(12)]


# --- PTY ------------------------------------------------------------------------------


async def test_a_pty_delivers_its_output_through_on_data_and_resizes(sandbox):
    out = bytearray()
    h = await sandbox.pty.create(PtySize(rows=24, cols=80), on_data=out.extend, timeout=60)

    async def printed(needle):
        return needle in out

    await sandbox.pty.send_stdin(h.pid, b"echo pty-$((6*7)); stty size\n")
    await eventually(lambda: printed(b"24 80"), "the terminal printed its size")
    assert b"pty-42" in out

    await sandbox.pty.resize(h.pid, PtySize(rows=50, cols=132))
    await sandbox.pty.send_stdin(h.pid, b"stty size\n")
    await eventually(lambda: printed(b"50 132"), "the terminal printed its new size")

    assert await sandbox.pty.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        await h.wait()


# --- files -----------------------------------------------------------------------------


async def test_files_write_read_list_and_remove(sandbox):
    await sandbox.files.write("/home/user/async/a.txt", "alpha")
    await sandbox.files.write_files(
        [
            {"path": "/home/user/async/b.bin", "data": b"\x00\xff"},
            {"path": "/home/user/async/sub/c.txt", "data": "gamma"},
        ]
    )
    assert await sandbox.files.read("/home/user/async/a.txt") == "alpha"
    assert bytes(await sandbox.files.read("/home/user/async/b.bin", format="bytes")) == b"\x00\xff"
    entries = {e.name: e.type for e in await sandbox.files.list("/home/user/async")}
    assert entries == {"a.txt": FileType.FILE, "b.bin": FileType.FILE, "sub": FileType.DIR}
    assert await sandbox.files.exists("/home/user/async/sub/c.txt")
    await sandbox.files.remove("/home/user/async/sub")
    assert not await sandbox.files.exists("/home/user/async/sub/c.txt")


async def test_watch_dir_streams_a_create_event(sandbox):
    await sandbox.files.make_dir("/home/user/async-watched")
    events = []
    handle = await sandbox.files.watch_dir("/home/user/async-watched", on_event=events.append, timeout=60)
    try:
        await sandbox.files.write("/home/user/async-watched/new.txt", "hi")

        async def created():
            return [e for e in events if e.name == "new.txt" and e.type == FilesystemEventType.CREATE]

        await eventually(created, "a CREATE event for new.txt", within=10)
    finally:
        await handle.stop()
