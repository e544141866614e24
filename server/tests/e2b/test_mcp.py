"""Specification: MCP through E2B's SDK. `Sandbox.create(mcp={...})` starts the sandbox
from the `mcp-gateway` template and runs `mcp-gateway --config <json>` in it as root, as
E2B's SDK does with E2B's gateway; the gateway then serves every server it was given as
one streamable-HTTP MCP endpoint at `get_mcp_url()` (`https://50005-<id>.<domain>/mcp`,
OpenDsec's TLS port) to callers presenting `get_mcp_token()`. The client here is the
official `mcp` package, as an agent framework would use it.

The harness (e2b_sdk_mcp) points the SDK's API and envd traffic at one URL, as the other
modules, and sets E2B_DOMAIN to the TLS port's domain for host names; it trusts the
cluster's CA in the system store (SSL_CERT_FILE). This module adds each sandbox's MCP host
name to /etc/hosts (lines with HOSTS_MARKER, removed by the harness): with wildcard DNS,
as a deployment has it, that is not needed.
"""

import asyncio
import json
import os
import ssl
import subprocess
import uuid

import httpx2
import pytest
from e2b import Sandbox, SandboxException, SandboxQuery, Template
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from conftest import HOSTS_MARKER

MCP_TEMPLATE = "mcp-gateway"


def map_mcp_host(sandbox: Sandbox):
    host = sandbox.get_host(50005).rsplit(":", 1)[0]
    with open("/etc/hosts", "a") as hosts:
        hosts.write(f"127.0.0.1 {host} {HOSTS_MARKER}\n")


def trusted() -> ssl.SSLContext:
    # The system bundle, where the harness put the cluster's CA.
    return ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])


async def mcp_session(url: str, token: str, work):
    """Opens an MCP session at `url` with `token` and returns `await work(session)`."""
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx2.AsyncClient(headers=headers, verify=trusted(), timeout=60) as http:
        async with streamable_http_client(url, http_client=http) as streams:
            async with ClientSession(streams[0], streams[1]) as session:
                await session.initialize()
                return await work(session)


def tool_names(url: str, token: str):
    async def names(session):
        return sorted(t.name for t in (await session.list_tools()).tools)

    return asyncio.run(mcp_session(url, token, names))


def call(url: str, token: str, tool: str, arguments: dict):
    async def called(session):
        result = await session.call_tool(tool, arguments)
        assert not result.is_error, result
        return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")

    return asyncio.run(mcp_session(url, token, called))


def status_without(url: str, headers: dict) -> int:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    with httpx2.Client(verify=trusted(), timeout=30) as http:
        return http.post(url, json=body, headers={"Accept": "application/json, text/event-stream", **headers}).status_code


@pytest.fixture(scope="module")
def gateway(run_id):
    sb = Sandbox.create(mcp={"time": {}}, timeout=300, metadata={"suite": run_id, "module": "mcp"})
    map_mcp_host(sb)
    yield sb
    sb.kill()


def test_a_create_with_mcp_serves_the_servers_tools_at_the_sdks_url_and_token(gateway):
    url, token = gateway.get_mcp_url(), gateway.get_mcp_token()
    assert url == f"https://50005-{gateway.sandbox_id}.{os.environ['E2B_DOMAIN']}/mcp"
    assert token and len(token) >= 32
    assert "get_current_time" in tool_names(url, token)
    now = json.loads(call(url, token, "get_current_time", {"timezone": "UTC"}))
    assert now["timezone"] == "UTC" and now["datetime"].endswith("+00:00"), now


def test_the_sandbox_is_the_mcp_gateway_template_and_still_an_ordinary_sandbox(gateway):
    assert gateway.get_info().template_id == MCP_TEMPLATE
    assert gateway.commands.run("echo ordinary; whoami").stdout == "ordinary\nuser\n"


def test_a_sandbox_connected_later_reads_the_token_back_as_root(gateway):
    again = Sandbox.connect(gateway.sandbox_id)
    assert again.get_mcp_token() == gateway.get_mcp_token()
    assert again.get_mcp_url() == gateway.get_mcp_url()


def test_the_token_is_required_and_is_not_readable_by_the_sandbox_user(gateway):
    url = gateway.get_mcp_url()
    assert status_without(url, {}) == 401
    assert status_without(url, {"Authorization": "Bearer not-the-token"}) == 401
    peek = gateway.commands.run("cat /etc/mcp-gateway/.token 2>&1 || true")
    assert "Permission denied" in peek.stdout
    assert gateway.get_mcp_token() not in peek.stdout


def test_an_unknown_catalog_server_fails_the_create_naming_it_and_leaves_no_sandbox(run_id):
    metadata = {"suite": run_id, "module": "mcp", "role": "unknown-server"}
    with pytest.raises(SandboxException) as failed:
        Sandbox.create(mcp={"exa": {"apiKey": "unused"}}, timeout=60, metadata=metadata)
    said = str(failed.value)
    assert "Failed to start MCP gateway" in said and "unknown MCP server 'exa'" in said, said
    assert "github/<owner>/<repo>" in said  # and it says what would work
    assert Sandbox.list(query=SandboxQuery(metadata=metadata)).next_items() == []


def test_a_malformed_mcp_field_is_refused_before_anything_starts(run_id):
    # What the SDK sends is checked by the API too: a server's settings must be an object.
    api = os.environ["E2B_API_URL"]
    r = subprocess.run(
        [
            "curl", "-sS", "-o", "-", "-w", "\n%{http_code}", "-X", "POST", f"{api}/sandboxes",
            "-H", f"X-API-Key: {os.environ['E2B_API_KEY']}", "-H", "Content-Type: application/json",
            "-d", json.dumps({"templateID": MCP_TEMPLATE, "mcp": {"time": "yes"}}),
        ],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    body, status = r.stdout.rsplit("\n", 1)
    assert status == "400", r.stdout
    assert "mcp.time" in json.loads(body)["message"]


ECHO_SERVER = """\
import os
from fastmcp import FastMCP

server = FastMCP("echo")


@server.tool
def echo(text: str) -> str:
    \"\"\"Says the text back, with this server's greeting.\"\"\"
    return f"{os.environ['GREETING']}, {text} ({open('installed').read().strip()})"


server.run(show_banner=False)
"""


def test_a_server_from_a_repository_in_a_template_runs_with_its_install_command_and_envs(tmp_path):
    # E2B's `github/<owner>/<repo>` servers are cloned from GitHub unless the template
    # already carries the repository where the gateway keeps it: a template does here
    # (this test has no internet), built from `mcp-gateway` with the SDK's builder,
    # which also checks a catalog server with `add_mcp_server`.
    (tmp_path / "server.py").write_text(ECHO_SERVER)
    name = f"mcp-echo-{uuid.uuid4().hex[:8]}"
    template = (
        Template(file_context_path=str(tmp_path))
        .from_template(MCP_TEMPLATE)
        .add_mcp_server("time")
        .copy("server.py", "/opt/mcp-gateway/github/acme/echo/", user="root")
    )
    info = Template.build(template, name)
    servers = {
        "time": {},
        "github/acme/echo": {
            "installCmd": "echo installed-once > installed",
            # The image's FastMCP, for a server that brings no dependencies of its own.
            "runCmd": "PYTHONPATH=/opt/mcp-gateway/site exec python3 server.py",
            "envs": {"GREETING": "hello"},
        },
    }
    sb = Sandbox.create(template=name, mcp=servers, timeout=120)
    try:
        map_mcp_host(sb)
        url, token = sb.get_mcp_url(), sb.get_mcp_token()
        names = tool_names(url, token)
        # Two servers or more: each tool is named after its server.
        assert "acme-echo_echo" in names and "time_get_current_time" in names, names
        assert call(url, token, "acme-echo_echo", {"text": "world"}) == "hello, world (installed-once)"
    finally:
        sb.kill()
    assert Sandbox.delete_snapshot(info.template_id)


def test_a_server_that_does_not_start_fails_the_create_with_its_own_error(tmp_path):
    servers = {"github/acme/missing": {"runCmd": "python3 server.py"}}
    (tmp_path / "readme").write_text("no server here\n")
    name = f"mcp-broken-{uuid.uuid4().hex[:8]}"
    template = (
        Template(file_context_path=str(tmp_path))
        .from_template(MCP_TEMPLATE)
        .copy("readme", "/opt/mcp-gateway/github/acme/missing/", user="root")
    )
    info = Template.build(template, name)
    with pytest.raises(SandboxException) as failed:
        Sandbox.create(template=name, mcp=servers, timeout=60)
    said = str(failed.value)
    assert "server acme-missing did not start" in said and "server.py" in said, said
    assert Sandbox.delete_snapshot(info.template_id)
