"""Specification: a sandbox's life through the control API with the synchronous
client, `e2b.Sandbox` 2.63.0: list (metadata and state filters, pagination), get_info,
pause and connect (a container's pause freezes it: files and processes are kept),
set_timeout and expiry, kill, metrics, snapshots and fork, network settings.

Three sandboxes tagged `group=listed` serve the list tests and are then paused,
snapshotted and forked; the timeout, auto-pause, network and kill tests make their own.
What the calls mean for containers is written in docs/e2b-compatibility.md.
"""

import time
from datetime import datetime, timedelta, timezone

import pytest
from e2b import (
    ALL_TRAFFIC,
    NotFoundException,
    SandboxException,
    Sandbox,
    SandboxNotFoundException,
    SandboxQuery,
    SandboxState,
)

from conftest import BASE_TEMPLATE, wait_until


# Metadata values as users write them: spaces, '&', '=', '/', non-ASCII (the SDK sends
# the filter as a percent-encoded `k=v&k=v` string inside the `metadata` parameter).
NOTES = ["plain", "two words & a=b", "path/with ünïcode"]


@pytest.fixture(scope="module")
def listed(run_id):
    made = [
        Sandbox.create(
            template=BASE_TEMPLATE,
            timeout=600,
            metadata={"suite": run_id, "group": "listed", "idx": str(i), "note": NOTES[i]},
            envs={"IDX": str(i)},
        )
        for i in range(3)
    ]
    yield made
    for sb in made:
        sb.kill()


def query(run_id, state=None, **metadata):
    return SandboxQuery(metadata={"suite": run_id, **metadata}, state=state)


def ids(infos):
    return [i.sandbox_id for i in infos]


def counter(sb) -> int:
    return int(sb.files.read("/tmp/counter").strip())


# --- list ------------------------------------------------------------------------


def test_list_filters_by_metadata(listed, run_id):
    infos = Sandbox.list(query=query(run_id, group="listed")).next_items()
    assert sorted(ids(infos)) == sorted(sb.sandbox_id for sb in listed)
    for info in infos:
        assert info.metadata["group"] == "listed"
        assert info.state == SandboxState.RUNNING
        assert BASE_TEMPLATE in (info.template_id, info.name)

    one = Sandbox.list(query=query(run_id, group="listed", idx="1")).next_items()
    assert ids(one) == [listed[1].sandbox_id]
    assert Sandbox.list(query=query(run_id, group="nobody")).next_items() == []


def test_list_paginates_with_limit_and_next_token(listed, run_id):
    pages = Sandbox.list(query=query(run_id, group="listed"), limit=2)
    first = pages.next_items()
    assert len(first) == 2
    assert pages.has_next and pages.next_token
    token = pages.next_token
    second = pages.next_items()
    assert len(second) == 1
    assert not pages.has_next
    assert sorted(ids(first) + ids(second)) == sorted(sb.sandbox_id for sb in listed)

    # A token handed out can be used by a new paginator, too.
    again = Sandbox.list(query=query(run_id, group="listed"), limit=2, next_token=token).next_items()
    assert ids(again) == ids(second)


def test_list_is_newest_first_and_a_page_goes_on_after_its_last_sandbox_is_killed(run_id):
    made = [
        Sandbox.create(template=BASE_TEMPLATE, timeout=300, metadata={"suite": run_id, "group": "paged"})
        for _ in range(4)
    ]
    try:
        newest_first = [sb.sandbox_id for sb in reversed(made)]
        assert ids(Sandbox.list(query=query(run_id, group="paged")).next_items()) == newest_first
        assert ids(Sandbox.list(query=query(run_id, group="paged"), order="asc").next_items()) == newest_first[::-1]

        pages = Sandbox.list(query=query(run_id, group="paged"), limit=2)
        first = pages.next_items()
        assert ids(first) == newest_first[:2]
        # The sandbox the token names, and one before it, end between the pages: the
        # next page is still the two that come after, nothing skipped or repeated.
        Sandbox.kill(first[1].sandbox_id)
        Sandbox.kill(first[0].sandbox_id)
        second = pages.next_items()
        assert ids(second) == newest_first[2:]
        assert not pages.has_next

        asc = Sandbox.list(query=query(run_id, group="paged"), limit=1, order="asc")
        assert ids(asc.next_items()) == [made[0].sandbox_id]
        Sandbox.kill(made[0].sandbox_id)
        assert ids(asc.next_items()) == [made[1].sandbox_id]
        assert not asc.has_next
    finally:
        for sb in made:
            Sandbox.kill(sb.sandbox_id)


def test_a_token_this_api_did_not_hand_out_is_refused():
    with pytest.raises(SandboxException) as e:
        Sandbox.list(limit=1, next_token="not-a-token").next_items()
    assert "nextToken" in str(e.value), e.value


# --- connect, pause -----------------------------------------------------------------


def test_connect_to_a_running_sandbox_returns_a_working_client(listed):
    same = Sandbox.connect(listed[1].sandbox_id)
    assert same.sandbox_id == listed[1].sandbox_id
    assert same.commands.run("echo $IDX").stdout == "1\n"


def remaining(sandbox_id) -> timedelta:
    return Sandbox.get_info(sandbox_id).end_at - datetime.now(timezone.utc)


def test_connect_extends_a_running_sandboxs_timeout_but_never_shortens_it(run_id):
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=120, metadata={"suite": run_id, "group": "connect"})
    try:
        Sandbox.connect(sb.sandbox_id, timeout=10)
        assert timedelta(seconds=100) < remaining(sb.sandbox_id) <= timedelta(seconds=121)
        Sandbox.connect(sb.sandbox_id, timeout=300)
        assert timedelta(seconds=280) < remaining(sb.sandbox_id) <= timedelta(seconds=301)
        # set_timeout sets it, shorter or not.
        sb.set_timeout(60)
        assert timedelta(seconds=40) < remaining(sb.sandbox_id) <= timedelta(seconds=61)
    finally:
        sb.kill()


def test_pause_keeps_files_and_processes_and_connect_resumes(listed, run_id):
    sb = listed[0]
    sb.files.write("/home/user/before-pause.txt", "kept")
    proc = sb.commands.run(
        # Written aside and renamed, so that a read never sees a half-written file.
        "n=0; while true; do n=$((n+1)); echo $n > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.1; done",
        background=True,
    )
    wait_until(lambda: sb.files.exists("/tmp/counter") and counter(sb) >= 3, "the counter ran")

    at_pause = counter(sb)
    assert sb.pause() is True
    info = Sandbox.get_info(sb.sandbox_id)
    assert info.state == SandboxState.PAUSED
    paused = Sandbox.list(query=query(run_id, state=[SandboxState.PAUSED], group="listed")).next_items()
    assert ids(paused) == [sb.sandbox_id]
    running = Sandbox.list(query=query(run_id, state=[SandboxState.RUNNING], group="listed")).next_items()
    assert sb.sandbox_id not in ids(running) and len(running) == 2
    assert Sandbox.pause(sb.sandbox_id) is False  # already paused: 409
    time.sleep(3)  # 30 more counts, were the counter not frozen

    resumed = Sandbox.connect(sb.sandbox_id)
    assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.RUNNING
    assert resumed.files.read("/home/user/before-pause.txt") == "kept"
    assert proc.pid in {p.pid for p in resumed.commands.list()}
    # The same process goes on counting from where it was frozen (a restart would
    # start from 1 again).
    before = counter(resumed)
    # A few counts may fall between the read and the freeze, and between thaw and read.
    assert at_pause <= before < at_pause + 15, f"counted {before - at_pause} while paused: not frozen"

    def advanced():
        n = counter(resumed)
        return n if n > before else None

    wait_until(advanced, "the counter went on after the resume")
    resumed.commands.kill(proc.pid)


def running_commands(sb):
    """The command lines of the processes the sandbox's agent runs."""
    return [" ".join([p.cmd, *p.args]) for p in sb.commands.list()]


def test_a_filesystem_pause_keeps_the_files_ends_the_processes_and_connect_boots_it_again(run_id):
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=120, metadata={"suite": run_id, "group": "fs-pause"})
    try:
        sb.files.write("/home/user/on-disk.txt", "kept")
        sb.commands.run("echo installed > /opt/state.txt", user="root")
        sb.commands.run("sleep 3600", background=True)
        assert any("sleep 3600" in c for c in running_commands(sb))

        assert sb.pause(mode="filesystem") is True
        assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.PAUSED
        assert Sandbox.pause(sb.sandbox_id, mode="filesystem") is False  # already paused: 409

        resumed = Sandbox.connect(sb.sandbox_id)
        assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.RUNNING
        # Everything it wrote is there; nothing it ran is: it booted again.
        assert resumed.files.read("/home/user/on-disk.txt") == "kept"
        assert resumed.commands.run("cat /opt/state.txt").stdout == "installed\n"
        assert not any("sleep 3600" in c for c in running_commands(resumed))
        assert resumed.commands.run("echo up").stdout == "up\n"
        # Its envd token is the one it had: the same client goes on working.
        assert sb.files.read("/home/user/on-disk.txt") == "kept"
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_connect_with_reboot_drops_the_memory_a_full_pause_kept(run_id):
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=120, metadata={"suite": run_id, "group": "reboot"})
    try:
        sb.files.write("/home/user/on-disk.txt", "kept")
        sb.commands.run("sleep 3600", background=True)
        assert sb.pause() is True  # keeps memory: a freeze
        resumed = Sandbox.connect(sb.sandbox_id, on_resume="reboot")
        assert resumed.files.read("/home/user/on-disk.txt") == "kept"
        assert not any("sleep 3600" in c for c in running_commands(resumed))
        # A later full pause keeps memory again.
        resumed.commands.run("sleep 3600", background=True)
        assert resumed.pause() is True
        again = Sandbox.connect(sb.sandbox_id)
        assert any("sleep 3600" in c for c in running_commands(again))
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_a_sandbox_set_to_pause_its_file_system_at_its_timeout_boots_again_on_connect(run_id):
    sb = Sandbox.create(
        template=BASE_TEMPLATE,
        timeout=60,
        lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}, "auto_resume": False},
        metadata={"suite": run_id, "group": "auto-pause-fs"},
    )
    try:
        sb.files.write("/home/user/kept.txt", "still here")
        sb.commands.run("sleep 3600", background=True)
        sb.set_timeout(2)
        wait_state(sb.sandbox_id, SandboxState.PAUSED)
        resumed = Sandbox.connect(sb.sandbox_id)
        assert resumed.files.read("/home/user/kept.txt") == "still here"
        assert not any("sleep 3600" in c for c in running_commands(resumed))
    finally:
        Sandbox.kill(sb.sandbox_id)


# --- timeout and expiry -------------------------------------------------------------


def test_set_timeout_extends_the_life_and_expiry_ends_the_sandbox(run_id):
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=4, metadata={"suite": run_id, "group": "timeout"})
    try:
        sb.set_timeout(30)
        end_at = Sandbox.get_info(sb.sandbox_id).end_at
        remaining = end_at - datetime.now(timezone.utc)
        assert timedelta(seconds=20) < remaining <= timedelta(seconds=31), remaining

        time.sleep(6)  # past the 4 s it was created with
        assert sb.is_running()
        assert sb.commands.run("echo still").stdout == "still\n"

        sb.set_timeout(2)
        wait_until(lambda: not sb.is_running(), "the sandbox stopped after its timeout", within=15)

        def gone():
            try:
                Sandbox.get_info(sb.sandbox_id)
                return False
            except SandboxNotFoundException:
                return True

        wait_until(gone, "get_info of the expired sandbox raises not found", within=10)
        assert Sandbox.list(query=query(run_id, group="timeout")).next_items() == []
    finally:
        Sandbox.kill(sb.sandbox_id)


# --- network settings (default deny; kept and shown as asked; what they let through is
# tested against a test internet in sandbox_network.rs and test_network.py) ----------


def test_network_settings_are_kept_shown_and_replaced_while_it_runs(run_id):
    sb = Sandbox.create(
        template=BASE_TEMPLATE,
        timeout=120,
        network={"allow_out": ["pkgs.example.com", "11.22.33.0/24"], "deny_out": [ALL_TRAFFIC]},
        metadata={"suite": run_id, "group": "net"},
    )
    try:
        info = sb.get_info()
        # Nothing else: the project's default is deny, and the rules say what opens.
        assert info.allow_internet_access is False
        assert info.network["allow_out"] == ["pkgs.example.com", "11.22.33.0/24"], info.network
        assert info.network["deny_out"] == [ALL_TRAFFIC], info.network

        # An update names the rules anew.
        sb.update_network({"allow_out": ["*.example.org:443"]})
        info = sb.get_info()
        assert info.network["allow_out"] == ["*.example.org:443"], info.network
        assert "deny_out" not in info.network, info.network

        # A bad rule is a 400 naming it, and changes nothing.
        with pytest.raises(SandboxException) as e:
            sb.update_network({"allow_out": ["*.example.org:443", "not a host"]})
        assert e.value.status_code == 400 and "allow_out[1]" in str(e.value), e.value
        assert sb.get_info().network["allow_out"] == ["*.example.org:443"]
        assert sb.is_running()
    finally:
        sb.kill()


def test_allow_internet_access_true_opens_the_public_internet_and_false_closes_it(run_id):
    opened = Sandbox.create(template=BASE_TEMPLATE, timeout=120, allow_internet_access=True, metadata={"suite": run_id, "group": "net"})
    closed = Sandbox.create(template=BASE_TEMPLATE, timeout=120, allow_internet_access=False, metadata={"suite": run_id, "group": "net"})
    plain = Sandbox.create(template=BASE_TEMPLATE, timeout=120, metadata={"suite": run_id, "group": "net"})
    try:
        assert opened.get_info().allow_internet_access is True
        assert closed.get_info().allow_internet_access is False
        # E2B code that says nothing gets the project's default: deny here.
        assert plain.get_info().allow_internet_access is False
        # Each has its own link out (what it lets through is test_network.py's, against
        # a test internet): a default route via its edge.
        for sb in (opened, closed, plain):
            routes = sb.commands.run("tail -n +2 /proc/net/route").stdout
            assert routes.split("\t")[:2] == ["eth0", "00000000"], f"no default route: {routes!r}"
        # An update that does not name internet access keeps it.
        opened.update_network({"deny_out": ["198.51.100.0/24"]})
        info = opened.get_info()
        assert info.allow_internet_access is True and info.network["deny_out"] == ["198.51.100.0/24"], info
    finally:
        for sb in (opened, closed, plain):
            sb.kill()


# --- kill -------------------------------------------------------------------------------


def test_kill_ends_the_sandbox_and_a_second_kill_reports_it_gone(run_id):
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=120, metadata={"suite": run_id, "group": "kill"})
    assert sb.kill() is True
    wait_until(lambda: not sb.is_running(), "the killed sandbox stopped answering", within=10)
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sb.sandbox_id)
    assert Sandbox.kill(sb.sandbox_id) is False
    assert Sandbox.list(query=query(run_id, group="kill")).next_items() == []
    with pytest.raises(NotFoundException):
        Sandbox.connect(sb.sandbox_id)


# --- metrics ----------------------------------------------------------------------------


def test_get_metrics_reports_cpu_memory_and_disk(listed):
    sb = listed[1]
    sb.commands.run("head -c 20000000 /dev/urandom | sha256sum")
    metrics = wait_until(sb.get_metrics, "at least one metrics entry", within=20, every=1)
    m = metrics[-1]
    assert m.cpu_count >= 1
    assert 0 <= m.cpu_used_pct <= 100 * m.cpu_count
    assert 0 < m.mem_used <= m.mem_total
    assert 0 <= m.disk_used <= m.disk_total and m.disk_total > 0
    assert abs(m.timestamp - datetime.now(timezone.utc)) < timedelta(minutes=2), m


def test_get_metrics_with_a_range_returns_the_history_the_edge_kept(run_id):
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=120, metadata={"suite": run_id, "group": "history"})
    try:
        created = datetime.now(timezone.utc) - timedelta(seconds=1)
        # The edge takes a baseline, then a point every 5 s.
        points = wait_until(
            lambda: (lambda p: p if len(p) >= 2 else None)(sb.get_metrics(start=created, end=datetime.now(timezone.utc))),
            "two points of history",
            within=25,
            every=1,
        )
        times = [p.timestamp for p in points]
        assert times == sorted(times)
        for a, b in zip(times, times[1:]):
            assert timedelta(seconds=4) <= b - a <= timedelta(seconds=7), times
        for p in points:
            assert p.cpu_count >= 1 and 0 <= p.cpu_used_pct <= 100
            assert 0 < p.mem_used <= p.mem_total and p.disk_total > 0
            assert created - timedelta(seconds=1) <= p.timestamp <= datetime.now(timezone.utc)
        # A range before the sandbox existed has no points: an empty list, not an error.
        long_ago = created - timedelta(hours=1)
        assert sb.get_metrics(start=long_ago, end=long_ago + timedelta(minutes=5)) == []
    finally:
        sb.kill()


# --- snapshots ----------------------------------------------------------------------------


def test_a_snapshot_starts_new_sandboxes_with_the_files_of_that_moment(listed, run_id):
    parent = listed[1]
    parent.files.write("/home/user/snap.txt", "in the snapshot")
    snap = parent.create_snapshot()
    assert snap.snapshot_id
    parent.files.write("/home/user/after-snap.txt", "later")
    assert parent.is_running()

    listed_snaps = Sandbox.list_snapshots(sandbox_id=parent.sandbox_id).next_items()
    assert snap.snapshot_id in [s.snapshot_id for s in listed_snaps]
    assert snap.snapshot_id in [s.snapshot_id for s in parent.list_snapshots().next_items()]

    child = Sandbox.create(template=snap.snapshot_id, timeout=120, metadata={"suite": run_id, "group": "from-snapshot"})
    try:
        assert child.sandbox_id != parent.sandbox_id
        assert child.files.read("/home/user/snap.txt") == "in the snapshot"
        assert not child.files.exists("/home/user/after-snap.txt")
        child.files.write("/home/user/snap.txt", "changed in the child")
        assert parent.files.read("/home/user/snap.txt") == "in the snapshot"
    finally:
        child.kill()

    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=parent.sandbox_id).next_items()]
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False


# --- fork ---------------------------------------------------------------------------------


def test_fork_makes_copies_that_start_from_the_parent_and_then_diverge(listed):
    parent = listed[2]
    parent.files.write("/home/user/fork.txt", "parent")
    forks = parent.fork(count=2, timeout=120)
    try:
        assert len(forks) == 2
        errors = [f for f in forks if isinstance(f, Exception)]
        assert not errors, errors
        fork_ids = {f.sandbox_id for f in forks}
        assert len(fork_ids) == 2 and parent.sandbox_id not in fork_ids
        for i, f in enumerate(forks):
            assert f.files.read("/home/user/fork.txt") == "parent"
            f.files.write("/home/user/fork.txt", f"fork {i}")
        for i, f in enumerate(forks):
            assert f.files.read("/home/user/fork.txt") == f"fork {i}"
            assert f.commands.run("echo $IDX").stdout == "2\n"
        assert parent.files.read("/home/user/fork.txt") == "parent"
        assert parent.is_running()
    finally:
        for f in forks:
            if not isinstance(f, Exception):
                f.kill()


# --- on_timeout: pause (autoPause) and autoResume ------------------------------------


def wait_state(sandbox_id, state, within=15.0):
    wait_until(lambda: Sandbox.get_info(sandbox_id).state == state, f"{sandbox_id} is {state}", within=within)


def test_a_sandbox_set_to_pause_at_its_timeout_is_paused_and_connect_resumes_it(run_id):
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=60, lifecycle={"on_timeout": "pause"}, metadata={"suite": run_id, "group": "auto-pause"})
    try:
        # OpenDsec resumes a paused sandbox on its next call unless told otherwise.
        assert sb.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        sb.files.write("/home/user/kept.txt", "still here")
        sleeper = sb.commands.run("sleep 3600", background=True)
        sb.set_timeout(2)  # a new timeout keeps what happens at it
        wait_state(sb.sandbox_id, SandboxState.PAUSED)
        assert Sandbox.list(query=query(run_id, state=[SandboxState.PAUSED], group="auto-pause")).next_items()

        resumed = Sandbox.connect(sb.sandbox_id)
        info = Sandbox.get_info(sb.sandbox_id)
        assert info.state == SandboxState.RUNNING
        # Its old timeout was spent: it runs on with a bounded new one, not without end.
        remaining = info.end_at - datetime.now(timezone.utc)
        assert timedelta(0) < remaining <= timedelta(seconds=300), remaining
        assert resumed.files.read("/home/user/kept.txt") == "still here"
        assert sleeper.pid in {p.pid for p in resumed.commands.list()}
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_traffic_to_an_auto_resume_sandbox_resumes_it(run_id):
    sb = Sandbox.create(
        template=BASE_TEMPLATE,
        timeout=60,
        lifecycle={"on_timeout": "pause", "auto_resume": True},
        metadata={"suite": run_id, "group": "auto-resume"},
    )
    try:
        assert sb.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": True}
        sb.set_timeout(2)
        wait_state(sb.sandbox_id, SandboxState.PAUSED)
        # No connect: the command itself wakes the sandbox, and the API says so at once.
        assert sb.commands.run("echo awake").stdout == "awake\n"
        assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.RUNNING
        # It stays awake with a new lifetime like the one it was made with (E2B resumes
        # with the sandbox's timeout): neither paused again at once because the old one
        # was spent, nor left without an end.
        time.sleep(2)
        info = Sandbox.get_info(sb.sandbox_id)
        assert info.state == SandboxState.RUNNING, info
        remaining = info.end_at - datetime.now(timezone.utc)
        assert timedelta(0) < remaining <= timedelta(seconds=300), remaining
    finally:
        Sandbox.kill(sb.sandbox_id)


def test_a_sandbox_created_without_auto_resume_stays_paused_when_called(run_id):
    sb = Sandbox.create(
        template=BASE_TEMPLATE,
        timeout=60,
        lifecycle={"on_timeout": "pause", "auto_resume": False},
        metadata={"suite": run_id, "group": "no-auto-resume"},
    )
    try:
        assert sb.get_info().lifecycle == {"on_timeout": "pause", "auto_resume": False}
        sb.pause()
        wait_state(sb.sandbox_id, SandboxState.PAUSED)
        with pytest.raises(Exception) as e:
            sb.commands.run("echo awake")
        assert "paused" in str(e.value).lower()
        assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.PAUSED
        resumed = Sandbox.connect(sb.sandbox_id)
        assert resumed.commands.run("echo awake").stdout == "awake\n"
    finally:
        Sandbox.kill(sb.sandbox_id)


# --- the rest of the SDK's list options, and idempotent create -------------------------


def test_list_filters_by_metadata_values_with_spaces_and_symbols(listed, run_id):
    found = {note: ids(Sandbox.list(query=query(run_id, group="listed", note=note)).next_items()) for note in NOTES}
    assert found == {note: [sb.sandbox_id] for note, sb in zip(NOTES, listed)}


def group_query(run_id, **kw):
    return SandboxQuery(metadata={"suite": run_id, "group": "listed"}, **kw)


def test_list_filters_by_template(listed, run_id):
    assert len(Sandbox.list(query=group_query(run_id, template=BASE_TEMPLATE)).next_items()) == 3
    assert Sandbox.list(query=group_query(run_id, template="code-interpreter-v1")).next_items() == []


def test_list_orders_by_start_time(listed, run_id):
    in_order = [sb.sandbox_id for sb in listed]  # created one after the other
    assert ids(Sandbox.list(query=group_query(run_id), order="asc").next_items()) == in_order
    assert ids(Sandbox.list(query=group_query(run_id), order="desc").next_items()) == in_order[::-1]


def test_list_filters_by_start_time(listed, run_id):
    last_start = Sandbox.get_info(listed[2].sandbox_id).started_at
    assert ids(Sandbox.list(query=group_query(run_id, started_after=last_start)).next_items()) == [listed[2].sandbox_id]
    later = datetime.now(timezone.utc) + timedelta(hours=1)
    assert Sandbox.list(query=group_query(run_id, started_after=later)).next_items() == []


def test_a_create_repeated_with_the_same_idempotency_key_returns_the_same_sandbox(run_id):
    """The SDK sends `idempotency_key` as the `Idempotency-Key` header and reuses it on
    its retries, so a create retried after a lost answer must not make a second sandbox."""
    key = f"e2b-test-{run_id}"
    first = Sandbox.create(template=BASE_TEMPLATE, timeout=120, idempotency_key=key, metadata={"suite": run_id, "group": "idem"})
    try:
        again = Sandbox.create(template=BASE_TEMPLATE, timeout=120, idempotency_key=key, metadata={"suite": run_id, "group": "idem"})
        assert again.sandbox_id == first.sandbox_id
        assert ids(Sandbox.list(query=query(run_id, group="idem")).next_items()) == [first.sandbox_id]
    finally:
        Sandbox.kill(first.sandbox_id)
        for info in Sandbox.list(query=query(run_id, group="idem")).next_items():
            Sandbox.kill(info.sandbox_id)
