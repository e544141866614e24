"""Specification: E2B templates backed by microVMs (`<image>-vm`) with the synchronous
client, `e2b.Sandbox` 2.63.0. The sandbox is a QEMU microVM with a kernel of its own;
pause snapshots it and ends its VMM, connect restores it with its memory, a snapshot
holds the whole machine and fork copies its memory. What that means is written in
docs/e2b-compatibility.md.

One parent VM serves every test (guests boot slowly where there is no KVM); each test
then makes what it needs from it.
"""

import os

import pytest
from e2b import Sandbox, SandboxState

from conftest import wait_until

VM_TEMPLATE = "base-vm"


@pytest.fixture(scope="module")
def parent(run_id):
    sb = Sandbox.create(template=VM_TEMPLATE, timeout=600, metadata={"suite": run_id, "group": "vm"}, envs={"ROLE": "parent"})
    # A shell counting in its own memory, written aside and renamed so that a read
    # never sees a half-written file.
    proc = sb.commands.run(
        "n=0; while true; do n=$((n+1)); echo $n > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.1; done",
        background=True,
    )
    wait_until(lambda: sb.files.exists("/tmp/counter") and counter(sb) >= 3, "the counter ran", within=60)
    yield sb, proc.pid
    sb.kill()


def counter(sb) -> int:
    return int(sb.files.read("/tmp/counter").strip())


def test_a_vm_template_is_a_guest_with_a_kernel_of_its_own(parent):
    sb, _ = parent
    info = sb.get_info()
    assert info.template_id == VM_TEMPLATE
    assert sb.commands.run("uname -r").stdout.strip() != os.uname().release
    assert sb.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"
    assert sb.commands.run("echo $ROLE").stdout == "parent\n"


def test_pause_ends_the_vm_and_connect_restores_its_memory(parent):
    sb, pid = parent
    at_pause = counter(sb)
    assert sb.pause() is True
    assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.PAUSED
    resumed = Sandbox.connect(sb.sandbox_id)
    assert Sandbox.get_info(sb.sandbox_id).state == SandboxState.RUNNING
    # The same shell goes on from its count: it was in memory, and memory came back.
    assert pid in {p.pid for p in resumed.commands.list()}
    at_resume = counter(resumed)
    assert at_resume >= at_pause
    wait_until(lambda: counter(resumed) > at_resume, "the counter goes on after the resume")


def test_a_vm_snapshot_starts_a_vm_that_continues_where_it_was(parent, run_id):
    sb, pid = parent
    sb.files.write("/home/user/snap.txt", "in the snapshot")
    snap = sb.create_snapshot()
    child = Sandbox.create(template=snap.snapshot_id, timeout=120, metadata={"suite": run_id, "group": "vm-from-snapshot"})
    try:
        assert child.sandbox_id != sb.sandbox_id
        assert child.files.read("/home/user/snap.txt") == "in the snapshot"
        # Its processes came with its memory, and count on.
        assert pid in {p.pid for p in child.commands.list()}
        start = counter(child)
        wait_until(lambda: counter(child) > start, "the restored counter goes on")
        child.files.write("/home/user/snap.txt", "changed in the child")
        assert sb.files.read("/home/user/snap.txt") == "in the snapshot"
    finally:
        child.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True


def test_fork_copies_the_vm_with_its_memory_and_the_copies_diverge(parent):
    sb, pid = parent
    forks = sb.fork(count=2, timeout=120)
    try:
        errors = [f for f in forks if isinstance(f, Exception)]
        assert not errors, errors
        assert len({f.sandbox_id for f in forks}) == 2
        for i, f in enumerate(forks):
            assert pid in {p.pid for p in f.commands.list()}, "the counting shell came with the memory"
            f.files.write("/home/user/who", f"fork {i}")
        for i, f in enumerate(forks):
            assert f.files.read("/home/user/who") == f"fork {i}"
            assert f.get_info().template_id == VM_TEMPLATE
        assert not sb.files.exists("/home/user/who")
        assert sb.is_running()
    finally:
        for f in forks:
            if not isinstance(f, Exception):
                f.kill()


def test_a_filesystem_pause_ends_the_vm_and_connect_boots_it_again_on_its_disk(parent):
    sb, pid = parent
    # A copy restored from the parent's memory: it never booted a kernel of its own.
    (vm,) = sb.fork(count=1, timeout=300)
    try:
        vm.files.write("/home/user/on-disk.txt", "kept")
        assert pid in {p.pid for p in vm.commands.list()}
        boot_id = vm.files.read("/proc/sys/kernel/random/boot_id")
        assert vm.pause(mode="filesystem") is True
        assert Sandbox.get_info(vm.sandbox_id).state == SandboxState.PAUSED
        resumed = Sandbox.connect(vm.sandbox_id)
        # Its disk is as it was; its memory is not: the counting shell is gone, the guest
        # booted again (a new boot id) and runs what it is asked.
        assert resumed.files.read("/home/user/on-disk.txt") == "kept"
        assert not any("counter" in " ".join(p.args) for p in resumed.commands.list())
        assert resumed.files.read("/proc/sys/kernel/random/boot_id") != boot_id
        assert resumed.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"
    finally:
        vm.kill()
