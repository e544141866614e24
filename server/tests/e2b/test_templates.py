"""Templates built with the unmodified SDK's `Template` builder (`Template.build`, which
calls `POST /v3/templates`, uploads COPY files to the URL it is given, starts the build
with its steps and polls its status and logs), then started with `Sandbox.create`.

No network: a wheel made here is copied in and installed with `pip_install`."""

import base64
import hashlib
import os
import uuid
import zipfile

import pytest
from e2b import BuildException, Sandbox, Template, wait_for_file

from conftest import BASE_TEMPLATE


def make_wheel(directory: str, name: str, value: str) -> str:
    """A pure-Python wheel of package `name` whose VALUE is `value`; returns its file name."""
    dist = f"{name}-1.0"
    wheel = f"{dist}-py3-none-any.whl"
    files = {
        f"{name}/__init__.py": f"VALUE = {value!r}\n".encode(),
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
        f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    with zipfile.ZipFile(os.path.join(directory, wheel), "w") as z:
        for path, data in files.items():
            z.writestr(path, data)
    return wheel


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def context(tmp_path):
    """A build context: an app directory, a wheel, and a file with a quote in its name."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "main.py").write_text("print('app main')\n")
    (app / "data").mkdir()
    (app / "data" / "rows.csv").write_text("a,b\n1,2\n")
    (tmp_path / "it's.txt").write_text("quoted\n")
    wheel = make_wheel(str(tmp_path), "odsecpkg", "forty-two")
    return tmp_path, wheel


def test_a_template_from_base_with_copy_pip_install_and_run_cmd_is_used_by_sandbox_create(context):
    ctx, wheel = context
    name = unique("py-env")
    template = (
        Template(file_context_path=str(ctx))
        .from_template(BASE_TEMPLATE)
        .copy("app", "/home/user/app/")
        .copy("it's.txt", "/opt/")
        .copy(wheel, "/tmp/wheels/")
        .pip_install(["--no-index", f"/tmp/wheels/{wheel}"])
        .run_cmd("echo built by $(whoami) > /home/user/built.txt")
        .set_envs({"GREETING": "hello from the template"})
        .set_workdir("/home/user/app")
        .set_start_cmd("sleep 1 && touch /tmp/started && sleep 3600", wait_for_file("/tmp/started"))
    )
    logs = []
    info = Template.build(template, name, cpu_count=1, memory_mb=512, on_build_logs=logs.append)
    assert info.name == name
    messages = [e.message for e in logs]
    assert any("RUN" in m and "pip install" in m for m in messages), messages
    assert any("build ready" in m for m in messages), messages

    assert Template.exists(name)
    assert not Template.exists(unique("never-built"))
    assert [t.tag for t in Template.get_tags(info.template_id)] == ["default"]

    sbx = Sandbox.create(name)
    try:
        assert sbx.get_info().template_id == name
        r = sbx.commands.run("python3 -c 'import odsecpkg; print(odsecpkg.VALUE)'")
        assert r.stdout.strip() == "forty-two"
        assert sbx.commands.run("cat /home/user/built.txt").stdout.strip() == "built by user"
        assert sbx.commands.run("echo $GREETING").stdout.strip() == "hello from the template"
        assert sbx.commands.run("pwd").stdout.strip() == "/home/user/app"
        assert sbx.commands.run("cat /home/user/app/main.py").stdout == "print('app main')\n"
        assert sbx.commands.run("cat /home/user/app/data/rows.csv").stdout == "a,b\n1,2\n"
        assert sbx.commands.run("cat \"/opt/it's.txt\"").stdout == "quoted\n"
        # COPY gives the files to the build's user; the wheel was in /tmp, which is not kept.
        assert sbx.commands.run("stat -c %U /home/user/app/main.py").stdout.strip() == "user"
        assert sbx.commands.run("ls /tmp/wheels 2>&1 || true").stdout.strip().endswith("No such file or directory")
        # The start command ran at boot and was ready before create returned.
        assert sbx.commands.run("test -f /tmp/started && echo yes").stdout.strip() == "yes"
    finally:
        sbx.kill()

    # A template on a template: the first one's files and settings are under it.
    child = unique("child-env")
    Template.build(Template().from_template(name).run_cmd("echo child > /home/user/child.txt"), child)
    sbx = Sandbox.create(child)
    try:
        out = sbx.commands.run("cat /home/user/built.txt /home/user/child.txt; echo $GREETING").stdout
        assert out.split("\n")[:3] == ["built by user", "child", "hello from the template"]
    finally:
        sbx.kill()


def test_tags_name_builds_and_a_bare_name_is_its_default_tag():
    name = unique("tagged")
    Template.build(Template().from_template(BASE_TEMPLATE).run_cmd("echo one > /home/user/v"), f"{name}:v1")
    Template.build(Template().from_template(BASE_TEMPLATE).run_cmd("echo two > /home/user/v"), name)

    def version(ref: str) -> str:
        sbx = Sandbox.create(ref)
        try:
            return sbx.commands.run("cat /home/user/v").stdout.strip()
        finally:
            sbx.kill()

    assert version(f"{name}:v1") == "one"
    assert version(name) == "two"
    assert version(f"{name}:default") == "two"

    Template.assign_tags(f"{name}:v1", ["prod"])
    assert version(f"{name}:prod") == "one"
    tags = {t.tag for t in Template.get_tags(name)}
    assert tags == {"v1", "default", "prod"}
    Template.remove_tags(name, ["prod"])
    assert {t.tag for t in Template.get_tags(name)} == {"v1", "default"}


def test_a_failing_step_fails_the_build_naming_the_step_and_leaves_no_template_to_start():
    name = unique("broken")
    template = Template().from_template(BASE_TEMPLATE).run_cmd("echo fine").run_cmd("echo oops >&2; exit 3")
    logs = []
    with pytest.raises(BuildException) as e:
        Template.build(template, name, on_build_logs=logs.append)
    assert "exited with code 3" in str(e.value)
    assert any("oops" in entry.message for entry in logs), [entry.message for entry in logs]
    with pytest.raises(Exception) as e:
        Sandbox.create(name)
    assert "no ready build" in str(e.value)


def test_deleting_a_template_removes_its_name():
    name = unique("short-lived")
    info = Template.build(Template().from_template(BASE_TEMPLATE).run_cmd("true"), name)
    assert Template.exists(name)
    assert Sandbox.delete_snapshot(info.template_id)
    assert not Template.exists(name)
    assert not Sandbox.delete_snapshot(info.template_id)


def test_bad_build_requests_are_refused_naming_what_is_wrong():
    """The calls the SDK makes, sent by hand with bad input: each a 4xx whose message
    says what is wrong, and nothing is built."""
    import httpx

    api = os.environ["E2B_API_URL"]
    headers = {"X-API-KEY": os.environ["E2B_API_KEY"]}
    with httpx.Client(base_url=api, headers=headers, timeout=30) as c:
        r = c.post("/v3/templates", json={"name": "Bad Name"})
        assert r.status_code == 400 and "template name" in r.json()["message"], r.text
        r = c.post("/v3/templates", json={"name": unique("ok"), "tags": ["no spaces"]})
        assert r.status_code == 400 and "tag" in r.json()["message"], r.text
        r = c.post("/v3/templates", json={"name": unique("ok"), "cpuCount": "two"})
        assert r.status_code == 400 and "cpuCount" in r.json()["message"], r.text

        name = unique("by-hand")
        r = c.post("/v3/templates", json={"name": name})
        assert r.status_code == 202, r.text
        t, b = r.json()["templateID"], r.json()["buildID"]
        for body, says in [
            ({"fromImage": "base", "fromTemplate": "base", "steps": []}, "not both"),
            ({"fromTemplate": "base", "steps": [{"type": "FROB", "args": []}]}, "steps[0]"),
            ({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["A"]}]}, "pairs"),
            ({"fromTemplate": "base", "steps": [{"type": "ENV", "args": ["1A", "x"]}]}, "environment variable"),
            (
                {"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["a", "/a", "", ""], "filesHash": "0" * 64}]},
                "were not uploaded",
            ),
            (
                {"fromTemplate": "base", "fromImageRegistry": {"type": "registry", "username": "u", "password": "p"}},
                "fromImageRegistry",
            ),
        ]:
            r = c.post(f"/v2/templates/{t}/builds/{b}", json=body)
            assert r.status_code == 400 and says in r.json()["message"], (body, r.text)
        # Nothing started: the build still waits for its steps.
        r = c.get(f"/templates/{t}/builds/{b}/status")
        assert r.status_code == 200 and r.json()["status"] == "waiting", r.text

        assert c.get(f"/templates/{t}/builds/{uuid.uuid4()}/status").status_code == 404
        assert c.get(f"/templates/{unique('nope')}/builds/{b}/status").status_code == 404
        r = c.get(f"/templates/{t}/files/not-a-hash")
        assert r.status_code == 400 and "filesHash" in r.json()["message"], r.text

        # The upload URL opens one upload; a forged or expired one opens none.
        r = c.get(f"/templates/{t}/files/{'a' * 64}")
        assert r.status_code == 201 and r.json()["present"] is False, r.text
        url = r.json()["url"]
        forged = url.replace("signature=", "signature=0")
        assert httpx.put(forged, content=b"x").status_code == 401
        expired = url.replace("expires=", "expires=1")
        assert httpx.put(expired, content=b"x").status_code == 401
        assert httpx.put(url, content=b"not a tar").status_code == 200
        r = c.get(f"/templates/{t}/files/{'a' * 64}")
        assert r.json()["present"] is True, r.text

    # Without a key: nothing.
    r = httpx.post(f"{api}/v3/templates", json={"name": unique("anon")})
    assert r.status_code == 401, r.text


def test_a_dockerfile_is_built_as_its_steps(tmp_path):
    """`from_dockerfile`: the SDK turns the Dockerfile into steps (FROM, USER, WORKDIR,
    RUN, ENV, COPY with --chown); the build runs them as Docker would."""
    (tmp_path / "conf.ini").write_text("[x]\ny=1\n")
    dockerfile = "\n".join(
        [
            f"FROM {BASE_TEMPLATE}",
            "ENV MODE=docker",
            "WORKDIR /srv/site",
            "RUN echo from-dockerfile > index.txt && id -un > who.txt",
            "COPY --chown=user:user conf.ini ./conf/",
            "USER user",
            "WORKDIR /home/user",
        ]
    )
    name = unique("dockerfile")
    Template.build(Template(file_context_path=str(tmp_path)).from_dockerfile(dockerfile), name)
    sbx = Sandbox.create(name)
    try:
        out = sbx.commands.run("cat /srv/site/index.txt /srv/site/who.txt; echo $MODE; pwd").stdout.split()
        assert out == ["from-dockerfile", "root", "docker", "/home/user"]
        assert sbx.commands.run("stat -c %U:%G /srv/site/conf/conf.ini").stdout.strip() == "user:user"
        assert sbx.commands.run("cat /srv/site/conf/conf.ini").stdout == "[x]\ny=1\n"
    finally:
        sbx.kill()
