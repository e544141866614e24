#!/usr/bin/python3
"""mcp-gateway: the MCP gateway of OpenDsec's `mcp-gateway` image, driven the way E2B's
SDK drives E2B's gateway.

    mcp-gateway --config '<json>'   what `Sandbox.create(mcp={...})` runs, as root, with
                                    GATEWAY_ACCESS_TOKEN set: starts the servers the JSON
                                    names and serves them, aggregated, as one streamable-HTTP
                                    MCP endpoint on port 50005 at /mcp (the SDK's
                                    `get_mcp_url()`), for callers with the bearer token
                                    (`get_mcp_token()` reads it back from /etc/mcp-gateway/.token).
                                    Returns once every server answers, leaving the gateway
                                    running in its own session; a second call replaces it.
    mcp-gateway pull NAME...        what the template builder's `add_mcp_server` runs: checks
                                    that the image carries these catalog servers.
    mcp-gateway list                the catalog servers this image carries.
    mcp-gateway stop                stops a running gateway.

The aggregation, the MCP protocol and the HTTP transport are FastMCP's (its proxy over an
MCPConfig, one stdio backend per server; with two or more servers each tool's name is
prefixed with its server's). This file only translates E2B's configuration, prepares the
servers and keeps the process running.

The servers:
- catalog names carried in the image (Docker's reference servers, from PyPI): `time`
  (no settings) and `git` (`paths`: the repositories it may touch). Any other catalog
  name is refused, naming what is here: this image cannot fetch Docker's catalog images.
- `github/<owner>/<repo>`: {"runCmd": ..., "installCmd": ..., "envs": {...}}: the
  repository is cloned (depth 1) from https://github.com/<owner>/<repo> into
  /opt/mcp-gateway/github/<owner>/<repo> unless it is already there (a template may
  carry it), `installCmd` runs there once, and `runCmd` is the stdio server, run there
  with `envs`. git's own settings apply to the clone (e.g. `url.<base>.insteadOf`
  for a mirror).
"""

import sys

SITE = "/opt/mcp-gateway/site"
sys.path.insert(0, SITE)

import argparse  # noqa: E402
import hmac  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

PORT = 50005
PATH = "/mcp"
STATE_DIR = "/etc/mcp-gateway"
TOKEN_FILE = f"{STATE_DIR}/.token"
CONFIG_FILE = f"{STATE_DIR}/config.json"
PID_FILE = "/run/mcp-gateway.pid"
LOG_FILE = "/var/log/mcp-gateway.log"
GITHUB_DIR = "/opt/mcp-gateway/github"
# How long `--config` waits for every server to answer (a slow `runCmd` may take a while).
READY_TIMEOUT = float(os.environ.get("MCP_GATEWAY_READY_TIMEOUT", "120"))
NAME_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class GatewayError(Exception):
    """What the caller did wrong or what failed, said in one message (to stderr)."""


def python_server(module, *args):
    return {"command": sys.executable, "args": ["-m", module, *args], "env": {"PYTHONPATH": SITE}}


def string_list(name, key, value):
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise GatewayError(f"{name}.{key} must be a list of paths")
    return value


def git_server(name, settings):
    paths = string_list(name, "paths", settings.get("paths"))
    for path in paths:
        if not os.path.isdir(path):
            raise GatewayError(f"{name}.paths: {path} is not a directory in the sandbox")
    # mcp-server-git confines itself to one repository when given one.
    return python_server("mcp_server_git", *(["--repository", paths[0]] if len(paths) == 1 else []))


# name: (settings it takes, required ones, how its stdio server is run)
CATALOG = {
    "time": (set(), set(), lambda name, settings: python_server("mcp_server_time")),
    "git": ({"paths"}, {"paths"}, git_server),
}


def catalog_help():
    return (
        f"this image carries the catalog servers {', '.join(sorted(CATALOG))}; "
        'any other server runs from its repository: "github/<owner>/<repo>": {"runCmd": ..., "installCmd": ...}'
    )


def github_server(key, settings):
    _, owner, repo = key.split("/", 2) if key.count("/") == 2 else (None, "", "")
    if not (NAME_PART.match(owner) and NAME_PART.match(repo)) or ".." in (owner, repo):
        raise GatewayError(f"{key!r}: a repository server is named github/<owner>/<repo>")
    unknown = set(settings) - {"runCmd", "installCmd", "envs"}
    if unknown:
        raise GatewayError(f"{key}: unknown setting(s) {', '.join(sorted(unknown))} (runCmd, installCmd, envs)")
    run = settings.get("runCmd")
    if not isinstance(run, str) or not run.strip():
        raise GatewayError(f"{key}.runCmd is required: the command that starts its stdio server")
    install = settings.get("installCmd")
    if install is not None and not isinstance(install, str):
        raise GatewayError(f"{key}.installCmd must be a string")
    envs = settings.get("envs") or {}
    if not isinstance(envs, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items()):
        raise GatewayError(f"{key}.envs must map names to strings")
    return {"owner": owner, "repo": repo, "run": run, "install": install, "envs": envs}


def translate(config):
    """E2B's `mcp` object -> (FastMCP's mcpServers, the repositories to prepare)."""
    if not isinstance(config, dict) or not config:
        raise GatewayError("--config must be a JSON object naming at least one server")
    servers, repos = {}, []
    for key, settings in config.items():
        if not isinstance(settings, dict):
            raise GatewayError(f"{key}: its settings must be an object")
        if key.startswith("github/"):
            repo = github_server(key, settings)
            repo["dir"] = os.path.join(GITHUB_DIR, repo["owner"], repo["repo"])
            repos.append(repo)
            servers[f"{repo['owner']}-{repo['repo']}"] = {
                "command": "/bin/bash",
                "args": ["-c", repo["run"]],
                "cwd": repo["dir"],
                "env": repo["envs"],
            }
            continue
        if key not in CATALOG:
            raise GatewayError(f"unknown MCP server {key!r}: {catalog_help()}")
        allowed, required, make = CATALOG[key]
        unknown = set(settings) - allowed
        if unknown:
            raise GatewayError(f"{key}: unknown setting(s) {', '.join(sorted(unknown))}")
        missing = required - set(settings)
        if missing:
            raise GatewayError(f"{key}: missing setting(s) {', '.join(sorted(missing))}")
        servers[key] = make(key, settings)
    return servers, repos


def tail(text, lines=20):
    return "\n".join(text.strip().splitlines()[-lines:])


def prepare(repo):
    """Clones the repository unless present, then runs its install command there."""
    where = repo["dir"]
    if not os.path.isdir(where):
        os.makedirs(os.path.dirname(where), exist_ok=True)
        scratch = f"{where}.clone-{os.getpid()}"
        shutil.rmtree(scratch, ignore_errors=True)
        url = f"https://github.com/{repo['owner']}/{repo['repo']}"
        cloned = subprocess.run(
            ["git", "clone", "--quiet", "--depth", "1", url, scratch], capture_output=True, text=True
        )
        if cloned.returncode != 0:
            shutil.rmtree(scratch, ignore_errors=True)
            raise GatewayError(f"cloning {url} failed: {tail(cloned.stderr)}")
        os.rename(scratch, where)  # a half-made clone is never taken for a whole one
    if repo["install"]:
        installed = subprocess.run(
            ["/bin/bash", "-c", repo["install"]],
            cwd=where,
            env={**os.environ, **repo["envs"]},
            capture_output=True,
            text=True,
        )
        if installed.returncode != 0:
            out = tail(installed.stdout + installed.stderr)
            raise GatewayError(
                f"installCmd of github/{repo['owner']}/{repo['repo']} exited {installed.returncode}: {out}"
            )


def write_private(path, text):
    scratch = f"{path}.tmp"
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(scratch, path)


def running_pid():
    try:
        pid = int(open(PID_FILE).read().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def stop():
    pid = running_pid()
    if pid is None:
        return False
    try:
        os.killpg(pid, signal.SIGTERM)  # the gateway leads its session: its servers go too
    except OSError:
        pass
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and running_pid() == pid:
        time.sleep(0.05)
    if running_pid() == pid:
        os.killpg(pid, signal.SIGKILL)
    try:
        os.unlink(PID_FILE)
    except FileNotFoundError:
        pass
    return True


def check_servers(servers):
    """Starts each server once on its own and completes MCP's handshake with it, all at
    once: the aggregate leaves out a server that fails, so this is where a bad `runCmd`
    or a missing dependency is caught and reported with the server's own stderr."""
    import asyncio
    import tempfile

    from fastmcp import Client
    from fastmcp.client.transports import StdioTransport

    async def one(name, server):
        with tempfile.TemporaryFile("w+") as errors:
            transport = StdioTransport(
                command=server["command"],
                args=server["args"],
                env=server.get("env"),
                cwd=server.get("cwd"),
                keep_alive=False,
                log_file=errors,
            )
            try:
                async with asyncio.timeout(READY_TIMEOUT):
                    async with Client(transport, timeout=READY_TIMEOUT):
                        pass  # entering it is MCP's initialize handshake
                return None
            except Exception as e:  # whatever went wrong, said with the server's stderr
                errors.seek(0)
                said = tail(errors.read())
                return f"server {name} did not start ({type(e).__name__}: {e})" + (f":\n{said}" if said else "")

    async def all_of_them():
        return await asyncio.gather(*(one(n, s) for n, s in servers.items()))

    failed = [f for f in asyncio.run(all_of_them()) if f]
    if failed:
        raise GatewayError("\n".join(failed))


def probe(token):
    """The tool names the running gateway serves, asked as a client would."""
    import asyncio

    from fastmcp import Client

    async def ask():
        async with Client(f"http://127.0.0.1:{PORT}{PATH}", auth=token, timeout=READY_TIMEOUT) as client:
            return [tool.name for tool in await client.list_tools()]

    return asyncio.run(ask())


def log_tail():
    try:
        return tail(open(LOG_FILE, errors="replace").read(), 30)
    except OSError:
        return ""


def start(config_text):
    token = os.environ.get("GATEWAY_ACCESS_TOKEN", "")
    if not token:
        raise GatewayError("GATEWAY_ACCESS_TOKEN is not set: it is the bearer token callers of the gateway present")
    try:
        config = json.loads(config_text)
    except json.JSONDecodeError as e:
        raise GatewayError(f"--config is not JSON: {e}") from None
    servers, repos = translate(config)
    for repo in repos:
        prepare(repo)
    check_servers(servers)
    stop()
    os.makedirs(STATE_DIR, mode=0o700, exist_ok=True)
    os.chmod(STATE_DIR, 0o700)
    write_private(TOKEN_FILE, token)
    write_private(CONFIG_FILE, json.dumps({"mcpServers": servers}, indent=2))
    env = {k: v for k, v in os.environ.items() if k != "GATEWAY_ACCESS_TOKEN"}
    # Warnings and errors only: a request a line would grow the log for as long as the
    # sandbox lives.
    env.setdefault("FASTMCP_LOG_LEVEL", "WARNING")
    with open(LOG_FILE, "ab") as log:
        os.chmod(LOG_FILE, 0o600)
        gateway = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # outlives the command that started it
            env=env,
            cwd="/",
        )
    write_private(PID_FILE, str(gateway.pid))
    deadline = time.monotonic() + READY_TIMEOUT
    last = None
    while True:
        if gateway.poll() is not None:
            raise GatewayError(f"the gateway exited ({gateway.returncode}) while starting:\n{log_tail()}")
        try:
            tools = probe(token)
            break
        except Exception as e:  # not listening yet, or a server still starting
            last = e
        if time.monotonic() > deadline:
            stop()
            raise GatewayError(f"the gateway did not answer within {READY_TIMEOUT:.0f} s ({last}):\n{log_tail()}")
        time.sleep(0.1)
    print(
        f"mcp-gateway: {len(tools)} tools from {', '.join(sorted(config))} on port {PORT} at {PATH}",
        flush=True,
    )


def serve():
    from fastmcp.server import create_proxy
    from fastmcp.server.auth import AccessToken, TokenVerifier

    token = open(TOKEN_FILE).read()
    config = json.load(open(CONFIG_FILE))

    class GatewayToken(TokenVerifier):
        """The one bearer token `--config` was given (compared in constant time)."""

        async def verify_token(self, presented):
            if hmac.compare_digest(presented.encode(), token.encode()):
                return AccessToken(token=presented, client_id="mcp-gateway", scopes=[])
            return None

    gateway = create_proxy(config, name="opendsec-mcp-gateway", auth=GatewayToken())
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # Reached by host name through OpenDsec's gateway (`50005-<id>.<domain>`): no Host
    # allow-list; the bearer token is what admits a caller.
    gateway.run(
        transport="http",
        host="0.0.0.0",
        port=PORT,
        path=PATH,
        show_banner=False,
        host_origin_protection=False,
        log_level=os.environ.get("FASTMCP_LOG_LEVEL", "WARNING").lower(),
    )


def main():
    parser = argparse.ArgumentParser(prog="mcp-gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="E2B's `mcp` object, as JSON: start the gateway with these servers")
    sub = parser.add_subparsers(dest="command")
    pull = sub.add_parser("pull", help="check that catalog servers are in this image")
    pull.add_argument("names", nargs="+")
    sub.add_parser("list", help="the catalog servers in this image")
    sub.add_parser("stop", help="stop a running gateway")
    sub.add_parser("serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        if args.config is not None:
            start(args.config)
        elif args.command == "pull":
            missing = [n for n in args.names if n not in CATALOG]
            if missing:
                raise GatewayError(f"not in this image: {', '.join(missing)}; {catalog_help()}")
            print(f"mcp-gateway: {', '.join(args.names)} ready")
        elif args.command == "list":
            print("\n".join(sorted(CATALOG)))
        elif args.command == "stop":
            print("mcp-gateway: stopped" if stop() else "mcp-gateway: not running")
        elif args.command == "serve":
            serve()
        else:
            parser.print_help(sys.stderr)
            return 2
    except GatewayError as e:
        print(f"mcp-gateway: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
