"""Specification: requests that must be refused get the error the SDK (e2b 2.63.0)
expects, and no other sandbox is affected.

Two sandboxes: `victim` takes every bad request, `bystander` is only looked at, before
and after, to show that nothing reached it. The last test checks both again.
"""

import json
import struct

import httpx
import pytest
from e2b import (
    AuthenticationException,
    ConnectionConfig,
    FileNotFoundException,
    NotEnoughSpaceException,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    SandboxQuery,
)
from packaging.version import Version

from conftest import BASE_TEMPLATE, wait_until

WRONG_API_KEY = "e2b_" + "0" * 40
BYSTANDER_FILE = "/home/user/bystander.txt"


@pytest.fixture(scope="module")
def victim(run_id, bystander):
    # The bystander exists (and holds a file and a process) before the first bad request.
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=600, metadata={"suite": run_id, "module": "errors", "role": "victim"})
    yield sb
    sb.kill()


@pytest.fixture(scope="module")
def bystander(run_id):
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=600, metadata={"suite": run_id, "module": "errors", "role": "bystander"})
    sb.files.write(BYSTANDER_FILE, "untouched")
    sb.commands.run("sleep 3600", background=True)
    yield sb
    sb.kill()


def sandbox_object(sandbox_id: str, envd_version: str, access_token):
    """A client object for `sandbox_id` that sends `access_token` as the envd access token.

    The SDK only builds these from the API's answer, which always carries the right
    token; to send a wrong one (or none) the test uses the deprecated public
    constructor `Sandbox(**SandboxOpts)` with a `ConnectionConfig` whose sandbox
    headers are those the SDK itself would set (`E2b-Sandbox-Id`, `E2b-Sandbox-Port`,
    `X-Access-Token`).
    """
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(ConnectionConfig.envd_port)}
    if access_token is not None:
        headers["X-Access-Token"] = access_token
    return Sandbox(
        sandbox_id=sandbox_id,
        sandbox_domain=None,
        envd_version=Version(envd_version),
        envd_access_token=access_token,
        traffic_access_token=None,
        connection_config=ConnectionConfig(extra_sandbox_headers=headers),
    )


def envelope(message: bytes, flags: int = 0, declared_len=None) -> bytes:
    """One Connect streaming envelope: flags, big-endian length, message."""
    n = len(message) if declared_len is None else declared_len
    return struct.pack(">BI", flags, n) + message


def end_stream_error(body: bytes):
    """The `error` of the end-of-stream frame (flags 0x02) of a Connect stream, if any."""
    i = 0
    while i + 5 <= len(body):
        flags, n = struct.unpack(">BI", body[i : i + 5])
        msg = body[i + 5 : i + 5 + n]
        i += 5 + n
        if flags & 0x02:
            return json.loads(msg or b"{}").get("error")
    return None


# --- unknown sandbox ---------------------------------------------------------------


def test_connecting_to_an_unknown_sandbox_raises_not_found():
    with pytest.raises(NotFoundException):
        Sandbox.connect("unknownid")


def test_the_control_api_answers_not_found_for_an_unknown_sandbox(victim):
    # Same shape as a real id (the edge's ordinal in the last four digits), but not one.
    unknown = "f" * 16 + victim.sandbox_id[16:]
    assert unknown != victim.sandbox_id
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(unknown)
    with pytest.raises(SandboxNotFoundException):
        Sandbox.set_timeout(unknown, 60)
    assert Sandbox.kill(unknown) is False


def test_sandbox_traffic_for_an_unknown_sandbox_is_answered_as_not_running(victim):
    unknown = "f" * 16 + victim.sandbox_id[16:]
    ghost = sandbox_object(unknown, victim.get_info().envd_version, "no-token")
    assert ghost.is_running() is False
    with pytest.raises(SandboxNotRunningException):
        ghost.files.read("/etc/hostname")
    with pytest.raises(SandboxException):
        ghost.commands.run("echo never")


# --- wrong API key -------------------------------------------------------------------


def test_a_wrong_api_key_is_refused_on_every_call(victim):
    with pytest.raises(AuthenticationException):
        Sandbox.create(template=BASE_TEMPLATE, api_key=WRONG_API_KEY)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key=WRONG_API_KEY).next_items()
    with pytest.raises(AuthenticationException):
        Sandbox.get_info(victim.sandbox_id, api_key=WRONG_API_KEY)
    with pytest.raises(AuthenticationException):
        Sandbox.kill(victim.sandbox_id, api_key=WRONG_API_KEY)
    with pytest.raises(AuthenticationException):
        Sandbox.connect(victim.sandbox_id, api_key="not-even-the-format")
    assert victim.is_running()


# --- wrong envd access token -------------------------------------------------------


def test_a_wrong_access_token_is_refused_by_the_sandbox(victim):
    impostor = sandbox_object(victim.sandbox_id, victim.get_info().envd_version, "wrong-token")
    # /health is the one envd endpoint that needs no token.
    assert impostor.is_running() is True
    with pytest.raises(AuthenticationException):
        impostor.commands.run("echo never")
    with pytest.raises(AuthenticationException):
        impostor.files.read("/etc/hostname")
    with pytest.raises(AuthenticationException):
        impostor.files.write("/home/user/planted.txt", "x")
    with pytest.raises(AuthenticationException):
        impostor.files.list("/home/user")
    assert not victim.files.exists("/home/user/planted.txt")


def test_a_missing_access_token_is_refused_by_the_sandbox(victim):
    anonymous = sandbox_object(victim.sandbox_id, victim.get_info().envd_version, None)
    with pytest.raises(AuthenticationException):
        anonymous.commands.run("echo never")
    with pytest.raises(AuthenticationException):
        anonymous.files.read("/etc/hostname")


def test_one_sandboxs_access_token_does_not_open_another(victim, bystander):
    victim_token = victim.connection_config.sandbox_headers["X-Access-Token"]
    crossed = sandbox_object(bystander.sandbox_id, bystander.get_info().envd_version, victim_token)
    with pytest.raises(AuthenticationException):
        crossed.files.read(BYSTANDER_FILE)
    with pytest.raises(AuthenticationException):
        crossed.commands.run("echo never")


# --- a sandbox whose ports are not public ------------------------------------------------


def test_ports_of_a_sandbox_without_public_traffic_need_its_traffic_token(run_id, sandbox_url):
    private = Sandbox.create(
        template=BASE_TEMPLATE, timeout=120, network={"allow_public_traffic": False}, metadata={"suite": run_id, "module": "errors"}
    )
    try:
        assert private.traffic_access_token
        private.files.write("/home/user/www/index.html", "private page")
        server = private.commands.run("python3 -m http.server 8000", background=True, cwd="/home/user/www")
        route = {"E2b-Sandbox-Id": private.sandbox_id, "E2b-Sandbox-Port": "8000"}
        with_token = {**route, "E2B-Traffic-Access-Token": private.traffic_access_token}

        def served():
            try:
                r = httpx.get(f"{sandbox_url}/index.html", headers=with_token, timeout=10)
            except httpx.TransportError:
                return None
            return r if r.status_code == 200 else None

        assert wait_until(served, "the private port answered with the traffic token").text == "private page"
        for headers in (route, {**route, "E2B-Traffic-Access-Token": "wrong"}):
            r = httpx.get(f"{sandbox_url}/index.html", headers=headers, timeout=10)
            assert r.status_code in (401, 403), (headers, r.status_code, r.text)
            assert "private page" not in r.text
        server.kill()
    finally:
        private.kill()


# --- malformed Connect requests (the SDK never sends these: raw HTTP to the same
# --- URL with the same headers the SDK sends) -----------------------------------------


def raw_envd(victim, path: str, body: bytes, content_type: str) -> httpx.Response:
    headers = dict(victim.connection_config.sandbox_headers)
    headers.update({"Content-Type": content_type, "Connect-Protocol-Version": "1"})
    return httpx.post(f"{victim.envd_api_url}{path}", content=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    "case,body",
    [
        ("truncated envelope", envelope(b'{"process":{"cmd":"/bin/true"}}', declared_len=1000)),
        ("bad json in envelope", envelope(b"{not json")),
    ],
)
def test_a_malformed_stream_request_is_refused_as_invalid_argument(victim, case, body):
    r = raw_envd(victim, "/process.Process/Start", body, "application/connect+json")
    if r.status_code == 200:
        err = end_stream_error(r.content)
        assert err is not None, f"{case}: answered 200 without an error: {r.content!r}"
        assert err["code"] == "invalid_argument", f"{case}: {err}"
    else:
        assert 400 <= r.status_code < 500, f"{case}: {r.status_code} {r.text}"
        assert r.json()["code"] == "invalid_argument", f"{case}: {r.text}"
    assert victim.commands.run("echo alive").stdout == "alive\n"


def test_a_malformed_unary_request_is_refused_as_invalid_argument(victim):
    r = raw_envd(victim, "/filesystem.Filesystem/Stat", b"{not json", "application/json")
    assert r.status_code == 400, r.text
    assert r.json()["code"] == "invalid_argument", r.text


def test_an_unknown_rpc_is_refused_as_unimplemented(victim):
    r = raw_envd(victim, "/process.Process/NoSuchMethod", b"{}", "application/json")
    # Connect allows a plain 404 for an unknown procedure, or 501 with code unimplemented.
    assert r.status_code in (404, 501), r.text
    if r.status_code == 501:
        assert r.json()["code"] == "unimplemented", r.text


# --- paths the user may not reach ------------------------------------------------------


def test_path_traversal_does_not_reach_files_the_user_may_not_read(victim):
    # Root can read the file, so a refusal is a permission decision, not a missing file.
    assert "root:" in victim.files.read("/etc/shadow", user="root")
    for path in ("../../etc/shadow", "/home/user/../../etc/shadow"):
        with pytest.raises((SandboxException, AuthenticationException)) as e:
            victim.files.read(path)
        assert not isinstance(e.value, FileNotFoundException), f"{path}: {e.value!r}"
        assert "root:" not in str(e.value)


def test_path_traversal_does_not_write_where_the_user_may_not(victim):
    with pytest.raises((SandboxException, AuthenticationException)):
        victim.files.write("../../etc/planted", "x")
    with pytest.raises((SandboxException, AuthenticationException)):
        victim.files.write("/root/planted", "x")
    assert not victim.files.exists("/etc/planted", user="root")
    assert not victim.files.exists("/root/planted", user="root")


# --- oversized upload ----------------------------------------------------------------


def test_an_upload_larger_than_the_free_disk_raises_not_enough_space(victim):
    free_kib = int(victim.commands.run("df -Pk /home/user | tail -1").stdout.split()[3])
    assert free_kib < 2 * 1024 * 1024, f"the sandbox's disk is not limited ({free_kib} KiB free)"
    size = free_kib * 1024 + 32 * 1024 * 1024
    chunk = b"\xab" * (1024 * 1024)

    def chunks():
        sent = 0
        while sent < size:
            yield chunk
            sent += len(chunk)

    with pytest.raises(NotEnoughSpaceException):
        victim.files.write("/home/user/too-big.bin", chunks())
    # The sandbox goes on: it runs commands, and its disk is usable again once the
    # partial file is gone.
    victim.commands.run("rm -f /home/user/too-big.bin")
    victim.files.write("/home/user/after.txt", "fits")
    assert victim.files.read("/home/user/after.txt") == "fits"


# --- what OpenDsec does not offer ------------------------------------------------------
# docs/e2b-compatibility.md lists these as refused (ops/e2b-compat.py names this test).


@pytest.mark.parametrize(
    "option, value, field",
    [
        ("iam", {"tokens": {"ci": {"audience": "https://ci.example", "token_type": "JWT-SVID"}}}, "iam"),
        ("volume_mounts", {"/mnt/data": "a-volume"}, "volumeMounts"),
    ],
    # The ids ops/e2b-compat.py names (REFUSED).
    ids=["iam", "volume_mounts"],
)
def test_a_create_asking_for_what_opendsec_does_not_offer_is_refused_naming_it(run_id, option, value, field):
    metadata = {"suite": run_id, "module": "errors", "role": f"refused-{option}"}
    with pytest.raises(SandboxException) as refused:
        Sandbox.create(template=BASE_TEMPLATE, timeout=60, metadata=metadata, **{option: value})
    assert getattr(refused.value, "status_code", None) == 400, repr(refused.value)
    assert f"{field} is not supported" in str(refused.value)
    assert Sandbox.list(query=SandboxQuery(metadata=metadata)).next_items() == []


# --- and nobody else noticed --------------------------------------------------------------


def test_the_bystander_saw_none_of_it(bystander):
    assert bystander.is_running()
    assert bystander.files.read(BYSTANDER_FILE) == "untouched"
    assert bystander.commands.run("echo fine").stdout == "fine\n"
    assert any(p.args[-1:] == ["sleep 3600"] for p in bystander.commands.list())
    assert not bystander.files.exists("/home/user/planted.txt")
