#!/usr/bin/env python3
"""Writes the table of every E2B SDK call in docs/e2b-compatibility.md from the tests.

    ops/e2b-compat.py [--records DIR]           regenerate the table
    ops/e2b-compat.py --check [--records DIR]   fail if the table claims a call supported or
                                                refused that no passing test of the records
                                                showed so (./ops/test.sh, after the tests);
                                                a table claiming less is stale, said, not failed

The calls are those of the installed current SDKs, found by introspection: Python's
through `server/tests/e2b/sdk_calls.py` run in the suite's venv (OPENDSEC_E2B_VENV, else
/var/lib/opendsec/test/e2b), JS's from the type declarations of the packages
./ops/e2b-js.sh installs (OPENDSEC_E2B_JS, else /var/lib/opendsec/test/e2b-js). The
records are the JSON files the suites leave (server/tests/support/e2b_calls.rs): which
calls each passing test made. A call is "supported" when a passing test made it,
"refused" when it is one of REFUSED below and its test passed, else "not tested".
DIR defaults to $OPENDSEC_E2B_CALLS_DIR, else cargo's target tmp dir's e2b-calls/.
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple, Optional

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs/e2b-compatibility.md"
BEGIN = "<!-- sdk-calls:begin -->"
END = "<!-- sdk-calls:end -->"
PY_SUITE = ROOT / "server/tests/e2b"
JS_SUITE = ROOT / "server/tests/e2b-js"
PY_CURRENT_VENV = "2.63"  # as server/tests/support/e2b_py.rs names it
TESTS_SHOWN = 2  # per cell; the rest are counted


class Refusal(NamedTuple):
    """What OpenDsec refuses on purpose, and the test that checks the refusal."""

    row: str
    call: str  # the Python call the test makes (sync client)
    test: str  # its pytest node id
    reason: str


REFUSED = [
    Refusal(
        "Sandbox.create(iam=…)",
        "Sandbox.create",
        "test_errors.py::test_a_create_asking_for_what_opendsec_does_not_offer_is_refused_naming_it[iam]",
        "no workload identity; a 400 naming `iam`",
    ),
    Refusal(
        "Sandbox.create(volume_mounts=…)",
        "Sandbox.create",
        "test_errors.py::test_a_create_asking_for_what_opendsec_does_not_offer_is_refused_naming_it[volume_mounts]",
        "no volumes; a 400 naming `volumeMounts`",
    ),
]

# JS classes (as the .d.ts declares them) and the rows their methods go to; a method of
# TemplateBase that the TemplateBuilder interface declares is a builder step.
JS_CLASSES = {
    "Sandbox": "Sandbox",
    "SandboxApi": "Sandbox",
    "Commands": "Sandbox.commands",
    "Filesystem": "Sandbox.files",
    "Pty": "Sandbox.pty",
    "Git": "Sandbox.git",
    "CommandHandle": "CommandHandle",
    "WatchHandle": "WatchHandle",
    "SandboxPaginator": "SandboxPaginator",
    "SnapshotPaginator": "SnapshotPaginator",
    "TemplateBase": "Template",
    "Volume": "Volume",
    "Secret": "Secret",
    "SecretPaginator": "SecretPaginator",
}
SURFACE_ORDER = [
    "Sandbox", "Sandbox.commands", "Sandbox.files", "Sandbox.pty", "Sandbox.git", "CommandHandle",
    "WatchHandle", "SandboxPaginator", "SnapshotPaginator", "Template", "TemplateBuilder",
    "Volume", "Secret", "SecretPaginator",
]  # fmt: skip


def snake(name: str) -> str:
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def python_calls(venv: Path) -> dict:
    python = venv / PY_CURRENT_VENV / "bin/python"
    if not python.is_file():
        sys.exit(f"error: {python} is missing: run ./ops/e2b-venv.sh {venv}")
    out = subprocess.run(
        [str(python), "-B", str(PY_SUITE / "sdk_calls.py")], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def declared_members(dts: str, kind: str, name: str) -> tuple[list, Optional[str]]:
    """The public methods (name, static?) of `declare class name` or `interface name`, and
    the class it extends."""
    head = re.search(rf"^(?:declare (?:abstract )?class|interface) {name}\b(.*)\{{$", dts, re.M)
    if not head:
        sys.exit(f"error: the JS SDK declares no {kind} {name}")
    body = dts[head.end() : dts.index("\n}", head.end())]
    members = re.findall(r"^  (static )?(?:async )?([A-Za-z]\w*)\??(?:<.*?>)?\(", body, re.M)
    parent = re.match(r"(?:<.*?>)?\s*extends (\w+)", head.group(1))
    return [(m, bool(s)) for s, m in members if m != "constructor"], parent and parent.group(1)


def js_calls(js: Path) -> dict:
    """{row: JS name} for every public method of the current JS SDK's classes."""
    modules = js / "current/node_modules"
    sdk = modules / "e2b"
    if not (sdk / "dist/index.d.ts").is_file():
        sys.exit(f"error: the JS SDK is not installed in {js}/current: run ./ops/e2b-js.sh {js}")
    dts = (sdk / "dist/index.d.ts").read_text()
    builder = {m for m, _ in declared_members(dts, "interface", "TemplateBuilder")[0]}
    calls = {}
    for cls, surface in JS_CLASSES.items():
        klass = cls
        while klass and klass != "ClientFactory":
            members, parent = declared_members(dts, "class", klass)
            for method, static in members:
                prefix = "TemplateBuilder" if cls == "TemplateBase" and method in builder and not static else surface
                calls.setdefault(f"{prefix}.{snake(method)}", (f"{cls}.{method}", False))
            klass = parent if parent in ("Paginator", "SandboxApi") else None
    ci = (modules / "@e2b/code-interpreter/dist/index.d.ts").read_text()
    for method, _ in declared_members(ci, "class", "Sandbox")[0]:
        calls.setdefault(f"Sandbox.{snake(method)}", (f"Sandbox.{method}", True))
    version = json.loads((sdk / "package.json").read_text())["version"]
    return {"sdk": f"e2b {version}", "calls": calls, "builder": builder}


def js_row(recorded: str, builder: set) -> Optional[str]:
    """The row of a JS record `Class.method` (the class it was called on)."""
    cls, _, method = recorded.partition(".")
    surface = JS_CLASSES.get(cls)
    if surface is None:
        return None
    if cls == "TemplateBase" and method in builder:
        surface = "TemplateBuilder"
    return f"{surface}.{snake(method)}"


class Records(NamedTuple):
    tests: dict  # (language, call) -> {test: number of calls the test made}
    missing: list  # module runs without a record


def read_records(directory: Path, py_sdk: str, js_sdk: str, builder: set) -> Records:
    tests: dict = {}
    wanted = [f"py-{p.name}" for p in sorted(PY_SUITE.glob("test_*.py"))]
    wanted += [f"js-current-{p.name}" for p in sorted(JS_SUITE.glob("*.test.mjs"))]
    missing = [w for w in wanted if not (directory / f"{w}.json").is_file()]
    for f in sorted(directory.glob("*.json")):
        record = json.loads(f.read_text())
        language = record["language"]
        if record["sdk"] != (py_sdk if language == "python" else js_sdk):
            continue  # an older SDK's run (e2b 2.50): the table is about the current one
        for test, calls in record["tests"].items():
            if language == "js":
                test = f"{record['module']}: {test}"
            for call in calls:
                key = call if language == "python" else js_row(call, builder)
                if key:
                    tests.setdefault((language, key), {})[test] = len(calls)
    return Records(tests, missing)


def short(test: str) -> str:
    """`test_files.py::test_x[a]` -> `files::x[a]`; JS names are kept."""
    m = re.fullmatch(r"test_(\w+)\.py::(?:test_)?(.+)", test)
    return f"{m.group(1)}::{m.group(2)}" if m else test


def cell(tests: Optional[dict]) -> str:
    if not tests:
        return "not tested"
    # The most focused tests (fewest calls) first: the best evidence for a reader.
    ranked = sorted(tests, key=lambda t: (tests[t], t))
    shown = ", ".join(f"`{short(t)}`" for t in ranked[:TESTS_SHOWN])
    more = f" +{len(ranked) - TESTS_SHOWN} more" if len(ranked) > TESTS_SHOWN else ""
    return f"supported (tested: {shown}{more})"


def render(py: dict, js: dict, records: Records) -> str:
    rows: dict = {}  # row -> {"sync": name, "async": name, "js": name, "ci": bool}
    for c in py["calls"]:
        r = rows.setdefault(c["row"], {"ci": c["code_interpreter"]})
        r["async" if c["name"] != c["row"] else "sync"] = c["name"]
    for row, (name, ci) in js["calls"].items():
        r = rows.setdefault(row, {"ci": ci})
        r["js"] = name

    def order(row):
        surface = row.rsplit(".", 1)[0]
        return (SURFACE_ORDER.index(surface) if surface in SURFACE_ORDER else len(SURFACE_ORDER), row)

    counts = {column: {"supported": 0, "refused": 0, "not tested": 0} for column in ("sync", "async", "js")}
    lines = []

    def status(column: str, name: Optional[str], language: str) -> str:
        if name is None:
            return "—"
        text = cell(records.tests.get((language, name)))
        counts[column]["supported" if text.startswith("supported") else "not tested"] += 1
        return text

    for row in sorted(rows, key=order):
        r = rows[row]
        label = f"`{row}`" + (" (code interpreter)" if r["ci"] else "")
        js_name = r.get("js", "").split(".", 1)[-1]
        if js_name and js_name != row.rsplit(".", 1)[1]:
            label += f" (JS `{js_name}`)"
        js_key = row if "js" in r else None
        sync = status("sync", r.get("sync"), "python")
        asyn = status("async", r.get("async"), "python")
        jsc = status("js", js_key, "js")
        lines.append(f"| {label} | {sync} | {asyn} | {jsc} |")
        for refusal in REFUSED:
            if refusal.call != row:
                continue
            checked = refusal.test in records.tests.get(("python", refusal.call), {})
            if checked:
                counts["sync"]["refused"] += 1
                text = f"refused: {refusal.reason} (tested: `{short(refusal.test)}`)"
            else:
                counts["sync"]["not tested"] += 1
                text = "not tested"
            lines.append(f"| `{refusal.row}` | {text} | — | — |")

    def summary(column: str) -> str:
        c = counts[column]
        return f"{c['supported']} supported, {c['refused']} refused, {c['not tested']} not tested"

    head = [
        BEGIN,
        "<!-- Generated by ops/e2b-compat.py from the tests' records; edit the generator, not this. -->",
        "",
        f"Python: `{py['sdk'].replace(' ', '==')}` with `e2b-code-interpreter` (sync client: {summary('sync')}; "
        f"async client: {summary('async')}). JS: `{js['sdk'].replace(' ', '@')}` with `@e2b/code-interpreter` "
        f"({summary('js')}).",
        "",
        "| call | Python | Python async | JS |",
        "|---|---|---|---|",
    ]
    return "\n".join(head + lines + [END])


def claims(table: str) -> dict:
    """(row label, column) -> "supported", "refused", "not tested" or "—", read from a
    rendered table."""
    columns = ("python", "python async", "js")
    out = {}
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        for column, text in zip(columns, cells[1:]):
            kind = next((k for k in ("supported", "refused", "not tested") if text.startswith(k)), text)
            out[(cells[0], column)] = kind
    return out


def section(doc: str) -> str:
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        sys.exit(f"error: {DOC} has no {BEGIN} ... {END} section")
    return doc[start : end + len(END)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare the doc with the records; change nothing")
    p.add_argument("--records", type=Path, help="the directory of the suites' records")
    args = p.parse_args()
    default_records = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "tmp/e2b-calls"
    records_dir = args.records or Path(os.environ.get("OPENDSEC_E2B_CALLS_DIR", default_records))
    venv = Path(os.environ.get("OPENDSEC_E2B_VENV", "/var/lib/opendsec/test/e2b"))
    js_dir = Path(os.environ.get("OPENDSEC_E2B_JS", "/var/lib/opendsec/test/e2b-js"))

    py, js = python_calls(venv), js_calls(js_dir)
    records = read_records(records_dir, py["sdk"], js["sdk"], js["builder"])
    if records.missing:
        print(
            f"error: no records in {records_dir} of: {', '.join(records.missing)}: the table needs a run of "
            "every E2B suite (./ops/test.sh, or cargo test -p opendsec --test e2b_sdk --test e2b_js "
            "--test images -- --test-threads=1)",
            file=sys.stderr,
        )
        return 1
    doc = DOC.read_text()
    old, new = section(doc), render(py, js, records)
    if args.check:
        # What the doc claims must be what this run's tests showed; a table that claims
        # less than they showed (a new test, a call newly supported) is only stale.
        doc_says, run_shows = claims(old), claims(new)
        overstated = sorted(
            f"{row} ({column}): the doc says {said}, this run's tests show {run_shows.get((row, column), 'no such call')}"
            for (row, column), said in doc_says.items()
            if said in ("supported", "refused") and run_shows.get((row, column)) != said
        )
        if overstated:
            print("\n".join(overstated))
            print(
                f"\nerror: {len(overstated)} claims of the SDK call table of {DOC.relative_to(ROOT)} are not "
                f"backed by a passing test of this run: fix the tests or the code, or, if every E2B test "
                f"passed, run ops/e2b-compat.py --records {records_dir} to regenerate it",
                file=sys.stderr,
            )
            return 1
        if old != new:
            print(
                f"{DOC.relative_to(ROOT)}: every claim of the SDK call table is backed by this run's tests; "
                f"the table is stale (it claims less or names other tests): run ops/e2b-compat.py "
                f"--records {records_dir} to refresh it"
            )
            return 0
        print(f"{DOC.relative_to(ROOT)}: the SDK call table matches the records in {records_dir}")
        return 0
    DOC.write_text(doc.replace(old, new))
    print(f"wrote the SDK call table of {DOC.relative_to(ROOT)} from {records_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
