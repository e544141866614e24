"""Specification: the code interpreter, `e2b_code_interpreter` 2.11.5, sync and async, on
its default template `code-interpreter-v1` (port 49999 of the sandbox, reached through
the single E2B_SANDBOX_URL): `run_code` keeps state between calls, reports errors
with name, value and traceback, streams stdout, stderr and results as they come,
returns rich results (a matplotlib figure as PNG and chart data, a DataFrame as HTML and
data, IPython display objects), runs IPython's shell escapes and magics, answers in
Python, Bash, JavaScript, TypeScript, R and Java (each a Jupyter kernel), and runs code in
separate contexts. A string result reads back without its quotes, as from E2B.
"""

import base64

import pytest
from e2b import CommandExitException, ConnectionConfig, SandboxException, TimeoutException
from e2b_code_interpreter import AsyncSandbox, Sandbox
from packaging.version import Version

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sandbox(run_id):
    # No template argument: the SDK's own default, code-interpreter-v1.
    sb = Sandbox.create(timeout=600, metadata={"suite": run_id, "module": "code_interpreter"})
    yield sb
    sb.kill()


def test_the_sandbox_is_made_from_the_sdks_default_template(sandbox):
    info = sandbox.get_info()
    assert "code-interpreter-v1" in (info.template_id, info.name), info
    # It is a full sandbox too: the commands API works beside the kernel.
    assert sandbox.commands.run("python3 -c 'import numpy, pandas, matplotlib; print(1)'").stdout == "1\n"


def test_state_is_kept_between_calls(sandbox):
    first = sandbox.run_code("x = 41")
    assert first.error is None and first.results == []
    second = sandbox.run_code("x + 1")
    assert second.error is None
    assert second.text == "42"
    assert second.results[0].is_main_result
    assert second.execution_count > first.execution_count


def test_an_exception_reports_its_name_value_and_traceback(sandbox):
    errors = []
    execution = sandbox.run_code(
        "def fail():\n    raise ValueError('bad value')\nfail()",
        on_error=errors.append,
    )
    assert execution.error is not None
    assert execution.error.name == "ValueError"
    assert execution.error.value == "bad value"
    assert "fail()" in execution.error.traceback and "ValueError" in execution.error.traceback
    assert errors and errors[0].name == "ValueError"
    assert execution.results == []


def test_stdout_and_stderr_are_streamed_and_kept_in_the_logs(sandbox):
    out, err = [], []
    execution = sandbox.run_code(
        "import sys\nprint('hello')\nprint('oops', file=sys.stderr)",
        on_stdout=lambda m: out.append(m.line),
        on_stderr=lambda m: err.append(m.line),
    )
    assert "".join(execution.logs.stdout) == "hello\n" == "".join(out)
    assert "".join(execution.logs.stderr) == "oops\n" == "".join(err)


def test_a_matplotlib_figure_comes_back_as_a_png(sandbox):
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.plot([1, 2, 3], [1, 4, 9])\n"
        "plt.title('squares')\n"
        "plt.show()"
    )
    assert execution.error is None, execution.error
    pngs = [r.png for r in execution.results if r.png]
    assert pngs, execution.results
    assert base64.b64decode(pngs[0]).startswith(PNG_MAGIC)


def test_a_dataframe_comes_back_as_text_and_html(sandbox):
    execution = sandbox.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert execution.error is None, execution.error
    main = execution.results[0]
    assert main.is_main_result
    assert "<table" in (main.html or ""), main
    assert "a" in main.text and "b" in main.text


def test_display_adds_results_and_only_the_last_expression_is_the_main_one(sandbox):
    execution = sandbox.run_code(
        "import pandas as pd\n"
        "class Data:\n"
        "    def _repr_json_(self):\n"
        "        return {'answer': 42}\n"
        "display(pd.DataFrame({'a': [1]}))\n"
        "display(Data())\n"
        "'last'"
    )
    assert execution.error is None, execution.error
    frame, data, last = execution.results
    assert "<table" in frame.html and not frame.is_main_result
    assert data.json == {"answer": 42} and not data.is_main_result
    assert last.text == "last" and last.is_main_result


def test_a_matplotlib_figure_also_gives_its_chart_data(sandbox):
    execution = sandbox.run_code(
        "import matplotlib.pyplot as plt\n"
        "plt.figure()\n"
        "plt.plot([1, 2, 3], [1, 4, 9], label='squares')\n"
        "plt.plot([1, 2, 3], [1, 8, 27], label='cubes')\n"
        "plt.title('powers')\n"
        "plt.xlabel('n')\n"
        "plt.show()"
    )
    assert execution.error is None, execution.error
    [figure] = execution.results
    assert base64.b64decode(figure.png).startswith(PNG_MAGIC)
    chart = figure.chart
    assert chart is not None, figure
    assert chart.type == "line" and chart.title == "powers" and chart.x_label == "n"
    assert [e.label for e in chart.elements] == ["squares", "cubes"]
    assert [list(p) for p in chart.elements[0].points] == [[1, 1], [2, 4], [3, 9]]

    bars = sandbox.run_code(
        "plt.figure()\nplt.bar(['a', 'b'], [3, 5])\nplt.title('bars')\nplt.show()"
    ).results[0].chart
    assert bars.type == "bar" and bars.title == "bars"
    assert [(e.label, e.value) for e in bars.elements] == [("a", 3), ("b", 5)]


def test_a_dataframe_also_gives_its_data(sandbox):
    main = sandbox.run_code("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})").results[0]
    assert main.data is not None, main
    # E2B's shape: each column's name to its values.
    assert main.data == {"a": [1, 2], "b": [3, 4]}
    assert "data" in main.formats() and "html" in main.formats()


def test_ipython_display_objects_shell_escapes_and_magics_work(sandbox):
    html = sandbox.run_code("from IPython.display import HTML, Markdown, display\ndisplay(HTML('<b>bold</b>'))")
    assert html.error is None, html.error
    assert html.results[0].html == "<b>bold</b>" and not html.results[0].is_main_result
    assert sandbox.run_code("Markdown('*md*')").results[0].markdown == "*md*"
    shell = sandbox.run_code("!pwd")
    assert shell.error is None, shell.error
    assert "".join(shell.logs.stdout).strip() == "/home/user"
    magic = sandbox.run_code("%env MAGIC_VAR=set\nimport os\nprint(os.environ['MAGIC_VAR'])")
    assert "".join(magic.logs.stdout).endswith("set\n"), magic.logs


def test_results_and_output_are_streamed_as_they_come(sandbox):
    import time

    seen = []
    started = time.monotonic()
    execution = sandbox.run_code(
        "from IPython.display import HTML, display\n"
        "import time\n"
        "print('before', flush=True)\n"
        "display(HTML('<i>early</i>'))\n"
        "time.sleep(3)\n"
        "print('after')",
        on_stdout=lambda m: seen.append(("stdout", m.line, time.monotonic() - started)),
        on_result=lambda r: seen.append(("result", r.html, time.monotonic() - started)),
    )
    finished = time.monotonic() - started
    assert execution.error is None, execution.error
    assert [kind for kind, _, _ in seen] == ["stdout", "result", "stdout"], seen
    assert seen[1][1] == "<i>early</i>"
    # The early result came well before the cell ended.
    assert finished - seen[1][2] > 2, (seen, finished)


def test_env_vars_read_back_as_their_values(sandbox):
    execution = sandbox.run_code("import os\nprint(os.environ['FOO'])", envs={"FOO": "bar"})
    assert "".join(execution.logs.stdout) == "bar\n"
    assert sandbox.run_code("import os\nos.environ['FOO']", envs={"FOO": "bar"}).text == "bar"
    assert sandbox.run_code("import os\nos.environ.get('FOO')").text is None


def test_a_sandboxs_own_variables_reach_its_kernels_even_those_started_before_it(run_id):
    """Warm code-interpreter containers run their server and kernels before a create
    claims one (so that create to first run_code is fast); the sandbox's variables still
    reach its Python kernel, IPython's shell escapes, its JavaScript kernel and its
    commands. Creates are made until one is claimed from a container started ahead: its
    server started well before the sandbox did."""
    import time

    started_ahead = 0
    for n in range(6):
        before = time.monotonic()
        sb = Sandbox.create(
            envs={"TASK_ID": f"task-{n}"},
            timeout=120,
            metadata={"suite": run_id, "module": "code_interpreter", "case": "envs"},
        )
        try:
            assert sb.run_code("import os\nos.environ['TASK_ID']").text == f"task-{n}"
            assert "".join(sb.run_code("!echo shell $TASK_ID").logs.stdout).strip() == f"shell task-{n}"
            assert sb.run_code("process.env.TASK_ID", language="javascript").text == f"task-{n}"
            assert sb.commands.run("echo $TASK_ID").stdout == f"task-{n}\n"
            # Started ahead when the server is older than this create.
            server = [p for p in sb.commands.list() if p.tag == "start"]
            assert server, sb.commands.list()
            # Start times in clock ticks since boot (/proc/<pid>/stat, field 22): the
            # server's against this command's own.
            age = sb.commands.run(
                "python3 -c \"import os; st = lambda p: int(open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[19]); "
                f"print((st('self') - st({server[0].pid})) / os.sysconf('SC_CLK_TCK'))\""
            ).stdout.strip()
            if float(age) > time.monotonic() - before + 1:
                started_ahead += 1
        finally:
            sb.kill()
        if started_ahead:
            break
        # Give the edge time to start the next warm container's kernels.
        time.sleep(5)
    assert started_ahead, "no create claimed a code interpreter started ahead of it"


def test_an_interrupted_cell_leaves_its_kernel_usable(sandbox):
    ctx = sandbox.create_code_context()
    try:
        sandbox.run_code("kept = 'still here'", context=ctx)
        with pytest.raises(TimeoutException):
            sandbox.run_code("import time\ntime.sleep(60)", context=ctx, timeout=2)
        # The same kernel (its state kept), not a restarted one.
        assert sandbox.run_code("kept", context=ctx, timeout=30).text == "still here"
    finally:
        sandbox.remove_code_context(ctx)


@pytest.mark.parametrize(
    "language, assign, read, answer",
    [
        ("python", "kept = 1 + 1", "print(kept)", "2\n"),
        ("bash", "KEPT=$((1 + 1))", "echo $KEPT", "2\n"),
        ("javascript", "const kept = 1 + 1", "console.log(kept)", "2\n"),
        ("typescript", "const kept: number = 1 + 1", "console.log(kept)", "2\n"),
        ("r", "kept <- 1 + 1", "cat(kept, '\\n')", "2 \n"),
        ("java", "int kept = 1 + 1;", "System.out.println(kept);", "2\n"),
    ],
)
def test_each_language_answers_and_keeps_state_between_cells(sandbox, language, assign, read, answer):
    # In a context of its own, removed after: every kernel is a process, and the
    # sandbox's 512 MB do not hold one of each language beside the data stack.
    ctx = sandbox.create_code_context(language=language)
    try:
        assert ctx.language == language
        assert sandbox.run_code(assign, context=ctx).error is None
        execution = sandbox.run_code(read, context=ctx)
        assert execution.error is None, execution.error
        assert "".join(execution.logs.stdout) == answer
    finally:
        sandbox.remove_code_context(ctx)


def test_a_failed_bash_command_is_an_error_with_its_exit_status(sandbox):
    execution = sandbox.run_code("echo out; exit_with() { return $1; }; exit_with 3", language="bash")
    assert "".join(execution.logs.stdout) == "out\n"
    assert execution.error is not None and execution.error.name == "ExitCode" and execution.error.value == "3"
    assert sandbox.run_code("echo $((2 + 2))", language="bash").logs.stdout == ["4\n"]


def test_each_language_gives_its_value_as_the_main_result(sandbox):
    # JavaScript's default context is started with the sandbox, as on E2B.
    assert sandbox.run_code("'a' + 'b'", language="javascript").text == "ab"
    failed = sandbox.run_code("null.x", language="js")
    assert failed.error is not None and failed.error.name == "TypeError"
    for language, code, text in (
        ("typescript", "const n: number = 6; n * 7", "42"),
        ("r", "6 * 7", "[1] 42"),
        ("java", "int n = 6; n * 7", "42"),
    ):
        ctx = sandbox.create_code_context(language=language)
        try:
            assert sandbox.run_code(code, context=ctx).results[0].text == text
        finally:
            sandbox.remove_code_context(ctx)


def test_a_language_the_sandbox_lacks_is_refused_naming_those_it_has(sandbox):
    for language in ("cobol", "fortran"):
        with pytest.raises(SandboxException) as refused:
            sandbox.run_code("1", language=language)
        message = str(refused.value)
        assert "400" in message and repr(language) in message, message
        assert "java, javascript, python, r, typescript" in message, message


def test_env_vars_apply_to_one_call(sandbox):
    assert sandbox.run_code("import os\nos.environ.get('PER_CALL')", envs={"PER_CALL": "yes"}).text == "yes"
    assert sandbox.run_code("import os\nos.environ.get('PER_CALL')").text is None  # None shows no result


def test_contexts_keep_their_own_state_and_working_directory(sandbox):
    ctx = sandbox.create_code_context(cwd="/tmp")
    try:
        assert ctx.id and ctx.cwd == "/tmp"
        assert ctx.id in [c.id for c in sandbox.list_code_contexts()]
        sandbox.run_code("only_here = 5", context=ctx)
        assert sandbox.run_code("only_here", context=ctx).text == "5"
        assert sandbox.run_code("import os\nos.getcwd()", context=ctx).text == "/tmp"
        unseen = sandbox.run_code("only_here")
        assert unseen.error is not None and unseen.error.name == "NameError"

        sandbox.restart_code_context(ctx)
        restarted = sandbox.run_code("only_here", context=ctx)
        assert restarted.error is not None and restarted.error.name == "NameError"
    finally:
        sandbox.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sandbox.list_code_contexts()]


def test_a_run_longer_than_its_timeout_raises_timeout(sandbox):
    ctx = sandbox.create_code_context()
    try:
        with pytest.raises(TimeoutException):
            sandbox.run_code("import time\ntime.sleep(30)", context=ctx, timeout=2)
    finally:
        sandbox.remove_code_context(ctx)
    # The default context was not held up by it.
    assert sandbox.run_code("1 + 1", timeout=20).text == "2"


def test_the_kernel_refuses_a_client_without_the_sandboxs_tokens(sandbox):
    # The deprecated public constructor, as in test_errors.py: the SDK itself always
    # uses the tokens the API handed out.
    impostor = Sandbox(
        sandbox_id=sandbox.sandbox_id,
        sandbox_domain=None,
        envd_version=Version(sandbox.get_info().envd_version),
        envd_access_token="wrong-token",
        traffic_access_token="wrong-token",
        connection_config=ConnectionConfig(
            extra_sandbox_headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": "wrong-token"}
        ),
    )
    with pytest.raises(SandboxException):
        impostor.run_code("open('/tmp/impostor-ran', 'w').write('x')")
    with pytest.raises(SandboxException):
        impostor.list_code_contexts()
    assert not sandbox.files.exists("/tmp/impostor-ran")


def test_commands_still_fail_as_commands_in_a_code_interpreter_sandbox(sandbox):
    with pytest.raises(CommandExitException):
        sandbox.commands.run("exit 4")


# --- the async client ----------------------------------------------------------------


@pytest.fixture(scope="module")
async def async_sandbox(run_id):
    sb = await AsyncSandbox.create(timeout=600, metadata={"suite": run_id, "module": "code_interpreter_async"})
    yield sb
    await sb.kill()


async def test_async_run_code_keeps_state_and_streams_stdout(async_sandbox):
    out = []

    async def on_stdout(message):
        out.append(message.line)

    await async_sandbox.run_code("y = 6")
    execution = await async_sandbox.run_code("print(y * 7)\ny * 7", on_stdout=on_stdout)
    assert execution.text == "42"
    assert "".join(out) == "42\n"


async def test_async_errors_and_contexts(async_sandbox):
    execution = await async_sandbox.run_code("1 / 0")
    assert execution.error.name == "ZeroDivisionError"
    ctx = await async_sandbox.create_code_context()
    assert ctx.id in [c.id for c in await async_sandbox.list_code_contexts()]
    assert (await async_sandbox.run_code("'in context'", context=ctx)).text == "in context"
    await async_sandbox.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in await async_sandbox.list_code_contexts()]
