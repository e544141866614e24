"""Shared setup of the E2B SDK conformance suite.

Each module here is one group of `server/tests/e2b_sdk.rs`, which starts a real
`opendsec up`, issues an E2B API key and runs the module with nothing but the SDK's
own variables set: `E2B_API_KEY`, `E2B_API_URL` and `E2B_SANDBOX_URL` (or, for
`test_domain.py`, `E2B_API_KEY` and `E2B_DOMAIN`). The tests use only the public API
of the unmodified `e2b` and `e2b-code-interpreter` packages, so that what passes here
is what a user's unmodified code gets.

A module run without the harness fails (it never skips): the variables are missing.
"""

import json
import os
import time
import uuid
from importlib.metadata import version
from typing import Callable, Optional, TypeVar

import pytest

import sdk_calls

# OpenDsec's plain Debian image. E2B's SDK also defaults to "base", but every test names
# it, so that what is created does not depend on the SDK's default.
BASE_TEMPLATE = "base"

# Which SDK each module is written against; the harness runs each module with the
# matching venv from ops/e2b-venv.sh.
SDK_VERSION_OF_MODULE = {"test_v250_smoke": "2.50.0"}
DEFAULT_SDK_VERSION = "2.63.0"

# Lines the domain test adds to /etc/hosts carry this marker; the harness removes
# every line that has it when the test ends.
HOSTS_MARKER = "# opendsec-e2b-test"

T = TypeVar("T")


def wait_until(
    probe: Callable[[], Optional[T]],
    what: str,
    within: float = 15.0,
    every: float = 0.2,
) -> T:
    """Calls `probe` until it returns something truthy and returns that; fails the
    test with `what` and the last value seen after `within` seconds."""
    deadline = time.monotonic() + within
    last: object = None
    while True:
        last = probe()
        if last:
            return last  # type: ignore[return-value]
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {within} s (last value: {last!r})")
        time.sleep(every)


@pytest.fixture(scope="session", autouse=True)
def sdk_environment():
    """The suite runs only against a server the harness started: fail loudly otherwise."""
    missing = [v for v in ("E2B_API_KEY",) if not os.environ.get(v)]
    has_urls = bool(os.environ.get("E2B_API_URL")) and bool(os.environ.get("E2B_SANDBOX_URL"))
    if not has_urls and not os.environ.get("E2B_DOMAIN"):
        missing.append("E2B_API_URL and E2B_SANDBOX_URL (or E2B_DOMAIN)")
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not set: run this suite through "
            "`cargo test -p opendsec --test e2b_sdk`, which starts the server",
            pytrace=False,
        )


@pytest.fixture(scope="module", autouse=True)
def sdk_version(request):
    """Each module is written against one SDK version; running it with another venv
    would test something else than it says."""
    module = request.module.__name__.rsplit(".", 1)[-1]
    want = SDK_VERSION_OF_MODULE.get(module, DEFAULT_SDK_VERSION)
    have = version("e2b")
    if have != want:
        pytest.fail(f"{module} is written for e2b=={want}, but e2b=={have} is installed", pytrace=False)


@pytest.fixture(scope="session")
def run_id() -> str:
    """Tags this run's sandboxes (metadata `suite`), so list filters see only them."""
    return uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def sandbox_url() -> str:
    """The single URL all sandbox traffic goes to (set by the harness)."""
    url = os.environ.get("E2B_SANDBOX_URL")
    if not url:
        pytest.fail("E2B_SANDBOX_URL is not set", pytrace=False)
    return url.rstrip("/")


class CallRecords:
    """Which public SDK calls each passing test made (`sdk_calls.py`), written as JSON to
    $OPENDSEC_E2B_CALLS when the session ends: `ops/e2b-compat.py` builds the table of
    docs/e2b-compatibility.md from it. A test's calls include those of the fixtures its
    setup and teardown ran (a module's sandbox is created in its first test's setup)."""

    def __init__(self, path: str):
        self.path = path
        self.current: Optional[set] = None
        self.outcome_ok = False
        self.tests: dict = {}
        sdk_calls.Recorder(self.note).install()

    def note(self, call: str) -> None:
        if self.current is not None:
            self.current.add(call)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current, self.outcome_ok = set(), False
        yield
        if self.outcome_ok:
            self.tests[item.nodeid] = sorted(self.current)
        self.current = None

    def pytest_runtest_logreport(self, report):
        if report.when == "call":
            self.outcome_ok = report.passed
        elif report.failed:
            self.outcome_ok = False

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            json.dump({"sdk": sdk_calls.sdk_version(), "language": "python", "tests": self.tests}, f, indent=1, sort_keys=True)


def pytest_configure(config):
    path = os.environ.get("OPENDSEC_E2B_CALLS")
    if path:
        config.pluginmanager.register(CallRecords(path), "opendsec-e2b-calls")
