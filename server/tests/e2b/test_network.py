"""Network egress through the unmodified E2B SDK.

The harness (`e2b_sdk.rs`, `e2b_sdk_network`) runs this module against an `opendsec up`
inside a test internet of its own (`server/tests/support/internet.rs`): `pkgs.test`
(11.0.0.10) and `other.test` (11.0.0.20) answer HTTP on ports 80 and 8080 with
`hello from <address> <port>`; the metadata address 169.254.169.254 answers too. No
packet leaves the test's namespaces. OpenDsec's default is deny (E2B's is open): code
that needs the network says so.
"""

import time

import pytest
from e2b import CommandExitException, FileNotFoundException, Sandbox

from conftest import BASE_TEMPLATE, wait_until

PKGS = "11.0.0.10"
OTHER = "11.0.0.20"


def fetch(sb: Sandbox, url: str) -> str | None:
    """GET `url` from inside the sandbox (3 s at most): the body, or None."""
    try:
        r = sb.commands.run(f"curl -sS -m 3 {url}", timeout=15)
    except CommandExitException:
        return None
    return r.stdout


@pytest.fixture
def sandboxes(run_id):
    made = []

    def create(**kwargs) -> Sandbox:
        sb = Sandbox.create(template=BASE_TEMPLATE, timeout=300, metadata={"suite": run_id, "module": "network"}, **kwargs)
        made.append(sb)
        return sb

    yield create
    for sb in made:
        sb.kill()


def test_allow_internet_access_false_reaches_nothing_and_true_the_public_internet(sandboxes):
    closed = sandboxes(allow_internet_access=False)
    opened = sandboxes(allow_internet_access=True)
    assert fetch(closed, "http://pkgs.test/") is None
    assert fetch(closed, f"http://{PKGS}/") is None
    assert f"hello from {PKGS} 80" in (fetch(opened, "http://pkgs.test/") or "")
    assert f"hello from {OTHER} 8080" in (fetch(opened, "http://other.test:8080/") or "")
    # Never part of the public internet: the cloud metadata address.
    assert fetch(opened, "http://169.254.169.254/") is None


def test_an_allowed_name_is_reached_and_nothing_else(sandboxes):
    sb = sandboxes(network={"allow_out": ["pkgs.test"]})
    assert f"hello from {PKGS} 80" in (fetch(sb, "http://pkgs.test/") or "")
    assert fetch(sb, "http://other.test/") is None
    assert fetch(sb, f"http://{OTHER}/") is None
    assert sb.get_info().network["allow_out"] == ["pkgs.test"]


def test_update_network_changes_what_a_running_loop_of_requests_reaches(sandboxes):
    sb = sandboxes(network={"allow_out": ["pkgs.test"]})
    # A loop of requests, one line per answer: ok or no.
    loop = sb.commands.run(
        "while true; do if curl -s -m 1 -o /dev/null http://pkgs.test/; then echo ok; else echo no; fi; sleep 0.1; done > /tmp/loop",
        background=True,
    )

    def last(n: int = 3) -> list[str]:
        try:
            lines = sb.files.read("/tmp/loop").split()
        except FileNotFoundException:
            return []  # the loop has not started writing yet
        return lines[-n:] if len(lines) >= n else []

    wait_until(lambda: last() == ["ok"] * 3, "the loop reaches pkgs.test")
    sb.update_network({"allow_out": []})
    started = time.monotonic()
    wait_until(lambda: last() == ["no"] * 3, "the loop sees pkgs.test taken away")
    assert time.monotonic() - started < 10
    sb.update_network({"allow_out": ["pkgs.test"]})
    wait_until(lambda: last() == ["ok"] * 3, "the loop sees pkgs.test given back")
    loop.kill()
