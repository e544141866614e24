"""Specification: `Sandbox.git` of the synchronous client, `e2b.Sandbox` 2.63.0, against
OpenDsec's `base` image (which has git). The SDK runs git through `commands.run`, so
these are E2B's own calls reaching a real git in the sandbox. Remotes are bare
repositories in the sandbox itself (a test never leaves its machine). The SDK marks the
module deprecated; E2B code still calls it.
"""

import pytest
from e2b import Sandbox

from conftest import BASE_TEMPLATE

WORK = "/home/user/work"
ORIGIN = "/home/user/origin.git"


@pytest.fixture(scope="module")
def sb(run_id):
    s = Sandbox.create(template=BASE_TEMPLATE, timeout=600, metadata={"suite": run_id, "group": "git"})
    yield s
    s.kill()


def test_config_and_identity_are_set_and_read_back(sb):
    sb.git.configure_user("Ada Lovelace", "ada@example.org")
    assert sb.git.get_config("user.name") == "Ada Lovelace"
    assert sb.git.get_config("user.email") == "ada@example.org"
    sb.git.set_config("pull.rebase", "false")
    assert sb.git.get_config("pull.rebase") == "false"
    assert sb.git.get_config("core.no-such-key") is None


def test_init_add_commit_and_status_follow_the_working_tree(sb):
    sb.git.init(WORK, initial_branch="main")
    sb.files.write(f"{WORK}/a.txt", "one\n")
    status = sb.git.status(WORK)
    assert status.current_branch == "main"
    assert [(f.name, f.staged) for f in status.file_status] == [("a.txt", False)]
    sb.git.add(WORK)
    assert [f.staged for f in sb.git.status(WORK).file_status] == [True]
    sb.git.commit(WORK, "first")
    assert sb.git.status(WORK).file_status == []
    log = sb.commands.run("git log --format=%an:%s", cwd=WORK).stdout
    assert log == "Ada Lovelace:first\n"


def test_branches_are_made_switched_and_deleted(sb):
    sb.git.create_branch(WORK, "feature")
    assert sb.git.branches(WORK).current_branch == "feature"
    sb.git.checkout_branch(WORK, "main")
    branches = sb.git.branches(WORK)
    assert set(branches.branches) == {"main", "feature"} and branches.current_branch == "main"
    sb.git.delete_branch(WORK, "feature")
    assert sb.git.branches(WORK).branches == ["main"]


def test_reset_and_restore_undo_changes(sb):
    sb.files.write(f"{WORK}/a.txt", "changed\n")
    sb.git.restore(WORK, ["a.txt"])
    assert sb.files.read(f"{WORK}/a.txt") == "one\n"
    sb.files.write(f"{WORK}/a.txt", "staged\n")
    sb.git.add(WORK, files=["a.txt"])
    sb.git.reset(WORK)
    status = sb.git.status(WORK)
    assert [(f.name, f.staged) for f in status.file_status] == [("a.txt", False)]
    sb.git.reset(WORK, mode="hard", target="HEAD")
    assert sb.files.read(f"{WORK}/a.txt") == "one\n"


def test_a_remote_is_pushed_to_cloned_and_pulled_from(sb):
    sb.git.init(ORIGIN, bare=True, initial_branch="main")
    sb.git.remote_add(WORK, "origin", ORIGIN)
    assert sb.git.remote_get(WORK, "origin") == ORIGIN
    assert sb.git.remote_get(WORK, "upstream") is None
    sb.git.push(WORK, remote="origin", branch="main")
    assert sb.git.status(WORK).upstream == "origin/main"

    sb.git.clone(ORIGIN, path="/home/user/copy")
    assert sb.files.read("/home/user/copy/a.txt") == "one\n"
    sb.files.write("/home/user/copy/b.txt", "from the copy\n")
    sb.git.add("/home/user/copy")
    sb.git.commit("/home/user/copy", "second")
    sb.git.push("/home/user/copy")

    sb.git.pull(WORK, remote="origin", branch="main")
    assert sb.files.read(f"{WORK}/b.txt") == "from the copy\n"
    # git ignores a depth for a plain path: a file:// URL is cloned as a remote is.
    shallow = sb.git.clone(f"file://{ORIGIN}", path="/home/user/shallow", depth=1, branch="main")
    assert shallow.exit_code == 0
    assert sb.commands.run("git rev-list --count HEAD", cwd="/home/user/shallow").stdout == "1\n"
