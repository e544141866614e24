"""Specification: host-name routing over TLS. With only `E2B_API_KEY` and `E2B_DOMAIN`
set (no E2B_API_URL, no E2B_SANDBOX_URL) the SDK talks to `https://api.{domain}` and
to `https://{port}-{sandboxId}.{domain}`; the gateway serves both on its TLS port with a
certificate from the cluster's CA. The harness (e2b_sdk_tls_domain) trusts that CA in
the system store (`update-ca-certificates`), points SSL_CERT_FILE at the system bundle
(for httpx, which otherwise trusts only certifi's list) and maps `api.{domain}` to
127.0.0.1 in /etc/hosts; this module adds each sandbox's host names the same way (the harness
removes every line carrying HOSTS_MARKER afterwards). Signed file URLs and
`get_host(port)` are then fetched with plain `curl`, as a user would.
"""

import os
import subprocess
import sys
import time

import pytest
from e2b import Sandbox

from conftest import BASE_TEMPLATE, HOSTS_MARKER

HTTP_PORT = 8000


def domain_host() -> str:
    """E2B_DOMAIN without its port (host names), and the port-bearing domain itself."""
    return os.environ["E2B_DOMAIN"].rsplit(":", 1)[0]


def map_hosts(sandbox_id: str, ports):
    with open("/etc/hosts", "a") as hosts:
        for port in ports:
            hosts.write(f"127.0.0.1 {port}-{sandbox_id}.{domain_host()} {HOSTS_MARKER}\n")


def curl(*args: str) -> subprocess.CompletedProcess:
    # No --cacert: curl trusts the system store, where the harness put the CA.
    return subprocess.run(["curl", "-sS", "--fail-with-body", "--max-time", "20", *args], capture_output=True, text=True)


@pytest.fixture(scope="module", autouse=True)
def only_the_domain_is_set():
    assert os.environ.get("E2B_DOMAIN"), "the harness sets E2B_DOMAIN"
    for var in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_DEBUG"):
        assert var not in os.environ, f"{var} must not be set: this module tests host-name routing"


CREATE_IN_A_CHILD = """
import sys
from e2b import Sandbox
sb = Sandbox.create(template=sys.argv[1], timeout=300, metadata={"suite": sys.argv[2], "module": "domain"})
print(sb.sandbox_id)
"""


@pytest.fixture(scope="module")
def sandbox(run_id):
    # The SDK's transport resolves names itself (hickory, not glibc) and reads /etc/hosts
    # once, when the transport is made. A sandbox's names can only be added once its id
    # is known, so a child process creates it; this process's SDK makes its first
    # transport afterwards, in `Sandbox.connect`. (With wildcard DNS, as a deployment has
    # it, none of this is needed.)
    child = subprocess.run(
        [sys.executable, "-c", CREATE_IN_A_CHILD, BASE_TEMPLATE, run_id], capture_output=True, text=True, timeout=120
    )
    assert child.returncode == 0, f"Sandbox.create over TLS failed:\n{child.stdout}\n{child.stderr}"
    sandbox_id = child.stdout.strip().splitlines()[-1]
    map_hosts(sandbox_id, (49983, 49999, HTTP_PORT))
    sb = Sandbox.connect(sandbox_id)
    yield sb
    sb.kill()


def test_the_sdk_reaches_the_sandbox_by_host_name(sandbox):
    assert sandbox.envd_api_url == f"https://49983-{sandbox.sandbox_id}.{os.environ['E2B_DOMAIN']}"
    assert sandbox.is_running()
    assert sandbox.commands.run("echo over-tls; whoami").stdout == "over-tls\nuser\n"


def test_files_write_and_read_by_host_name(sandbox):
    sandbox.files.write("/home/user/tls.txt", "through the domain")
    assert sandbox.files.read("/home/user/tls.txt") == "through the domain"


def test_a_signed_download_url_works_with_plain_curl(sandbox):
    sandbox.files.write("/home/user/download-me.txt", "signed download")
    url = sandbox.download_url("/home/user/download-me.txt")
    assert "signature=v1_" in url, url
    r = curl(url)
    assert r.returncode == 0, (url, r.stdout, r.stderr)
    assert r.stdout == "signed download"

    # The signature covers the path: the same signature for another file is refused.
    tampered = url.replace("download-me.txt", "tls.txt")
    assert curl(tampered).returncode != 0


def test_a_signed_upload_url_works_with_plain_curl(sandbox, tmp_path):
    local = tmp_path / "upload.txt"
    local.write_text("uploaded with curl")
    url = sandbox.upload_url("/home/user/uploaded.txt")
    r = curl("-F", f"file=@{local}", url)
    assert r.returncode == 0, (url, r.stdout, r.stderr)
    assert sandbox.files.read("/home/user/uploaded.txt") == "uploaded with curl"
    assert sandbox.files.get_info("/home/user/uploaded.txt").owner == "user"


def test_get_host_reaches_a_server_inside_the_sandbox(sandbox):
    sandbox.files.write("/home/user/www/index.html", "served from inside")
    server = sandbox.commands.run(f"python3 -m http.server {HTTP_PORT}", background=True, cwd="/home/user/www")
    try:
        host = sandbox.get_host(HTTP_PORT)
        assert host == f"{HTTP_PORT}-{sandbox.sandbox_id}.{os.environ['E2B_DOMAIN']}"
        deadline = time.monotonic() + 15
        while True:
            r = curl(f"https://{host}/index.html")
            if r.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)  # the server inside may still be starting
        assert r.returncode == 0, (host, r.stdout, r.stderr)
        assert r.stdout == "served from inside"
    finally:
        server.kill()
