"""A template built with the unmodified SDK from an OCI image in a registry
(`from_image`), run by `server/tests/images.rs` with the image's reference in
`OPENDSEC_TEST_IMAGE` (a busybox-based image on a loopback registry whose config sets
Env and WorkingDir and whose /etc/passwd has no `user`)."""

import os
import uuid

from e2b import Sandbox, Template


def test_a_template_from_a_registry_image_runs_its_steps_and_starts():
    image = os.environ["OPENDSEC_TEST_IMAGE"]
    name = f"from-image-{uuid.uuid4().hex[:8]}"
    template = (
        Template()
        .from_image(image)
        .run_cmd("hello > /srv/app/greeting.txt", user="root")
        .run_cmd("echo made by $(whoami) > /home/user/made.txt")
        .set_envs({"EXTRA": "from-the-template"})
    )
    logs = []
    Template.build(template, name, on_build_logs=logs.append)
    assert any("hello" in e.message and "RUN" in e.message for e in logs), [e.message for e in logs]

    sbx = Sandbox.create(name)
    try:
        # The image's own config (Env, WorkingDir) held for the build's steps and holds
        # under the template's.
        assert sbx.commands.run("cat /srv/app/greeting.txt").stdout.strip() == (
            "hello from the-image-config in /srv/app"
        )
        assert sbx.commands.run("cat /home/user/made.txt").stdout.strip() == "made by user"
        assert sbx.commands.run("echo $GREETING $EXTRA").stdout.strip() == "the-image-config from-the-template"
        assert sbx.commands.run("pwd").stdout.strip() == "/srv/app"
    finally:
        sbx.kill()
