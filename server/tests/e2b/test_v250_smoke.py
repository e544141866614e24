"""Specification: the older SDK, `e2b` 2.50.0, the last release that creates through the
v1 paths (`POST /sandboxes`, `POST /sandboxes/{id}/connect`) and sends `secure` and
`allow_internet_access` by default, still works: create, run, files, info, list,
connect, kill. Run by the harness with the 2.50 venv of ops/e2b-venv.sh.
"""

import pytest
from e2b import CommandExitException, NotFoundException, Sandbox, SandboxQuery

from conftest import BASE_TEMPLATE


@pytest.fixture(scope="module")
def sandbox(run_id):
    sb = Sandbox.create(
        template=BASE_TEMPLATE,
        timeout=300,
        metadata={"suite": run_id, "module": "v250"},
        envs={"GREETING": "from-2.50"},
    )
    yield sb
    Sandbox.kill(sb.sandbox_id)


def test_create_through_the_v1_path_gives_a_running_sandbox(sandbox, run_id):
    assert sandbox.is_running()
    info = sandbox.get_info()
    assert info.metadata == {"suite": run_id, "module": "v250"}


def test_commands_run(sandbox):
    assert sandbox.commands.run("echo $GREETING; whoami").stdout == "from-2.50\nuser\n"
    with pytest.raises(CommandExitException) as e:
        sandbox.commands.run("exit 5")
    assert e.value.exit_code == 5


def test_files_write_and_read(sandbox):
    sandbox.files.write("/home/user/v250.txt", "written by 2.50")
    assert sandbox.files.read("/home/user/v250.txt") == "written by 2.50"
    assert sandbox.commands.run("cat /home/user/v250.txt").stdout == "written by 2.50"


def test_list_and_connect(sandbox, run_id):
    infos = Sandbox.list(query=SandboxQuery(metadata={"suite": run_id, "module": "v250"})).next_items()
    assert [i.sandbox_id for i in infos] == [sandbox.sandbox_id]
    same = Sandbox.connect(sandbox.sandbox_id)
    assert same.files.read("/home/user/v250.txt") == "written by 2.50"


def test_kill(sandbox):
    assert sandbox.kill() is True
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sandbox.sandbox_id)
    assert Sandbox.kill(sandbox.sandbox_id) is False
