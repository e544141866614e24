"""The public calls of the installed E2B Python SDK, and a recorder of which ones a test makes.

`public_calls()` lists them by introspection: every public method (no leading
underscore, no property, no constant) of the SDK's client classes below, named as user
code calls it (`Sandbox.commands.run`, `AsyncSandbox.get_info`). `Recorder` wraps each of
them so that a call made from outside the SDK is noted under that name; calls the SDK
makes to itself are not. conftest.py records each passing test's calls into
$OPENDSEC_E2B_CALLS, and `ops/e2b-compat.py` turns the records into the table in
docs/e2b-compatibility.md (it runs `python sdk_calls.py` for the list).
"""

import contextvars
import functools
import importlib
import inspect
import json
import sys
import typing
from importlib.metadata import version

# The client classes, as (what users call them, sync class, async class): import paths
# `module:attribute`. Methods a class inherits from an earlier one here belong to that
# one (the code interpreter's Sandbox adds `run_code` and the like to e2b's).
ROOTS = [
    ("Sandbox", "e2b:Sandbox", "e2b:AsyncSandbox"),
    ("Sandbox", "e2b_code_interpreter:Sandbox", "e2b_code_interpreter:AsyncSandbox"),
    ("CommandHandle", "e2b:CommandHandle", "e2b:AsyncCommandHandle"),
    ("WatchHandle", "e2b:WatchHandle", "e2b:AsyncWatchHandle"),
    ("SandboxPaginator", "e2b:SandboxPaginator", "e2b:AsyncSandboxPaginator"),
    ("SnapshotPaginator", "e2b:SnapshotPaginator", "e2b:AsyncSnapshotPaginator"),
    ("Template", "e2b:Template", "e2b:AsyncTemplate"),
    # What `Template().from_image(...)` returns; one class for both clients.
    ("TemplateBuilder", "e2b.template.main:TemplateBuilder", None),
    ("Volume", "e2b:Volume", "e2b:AsyncVolume"),
    ("Secret", "e2b:Secret", "e2b:AsyncSecret"),
    ("SecretPaginator", "e2b:SecretPaginator", "e2b:AsyncSecretPaginator"),
]

# Properties of a sandbox that hand out an object with calls of its own.
SANDBOX_PARTS = ("commands", "files", "pty", "git")

CODE_INTERPRETER = "e2b_code_interpreter"


class PublicCall(typing.NamedTuple):
    name: str  # as user code calls it: `Sandbox.files.read`, `AsyncSandbox.kill`
    row: str  # the same call of the sync client: the table's row
    defined_in: type
    attr: str
    code_interpreter: bool


def _load(path):
    if path is None:
        return None
    module, _, attr = path.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None  # an older SDK without it (e2b 2.50 has no volumes)


def _is_call(value) -> bool:
    if isinstance(value, property):
        return False
    return isinstance(value, (classmethod, staticmethod)) or callable(value)


def _surfaces():
    """(sync name, async name or None, class) for every client class, sub-objects too."""
    out = []
    for name, sync_path, async_path in ROOTS:
        for cls, prefix in ((_load(sync_path), ""), (_load(async_path), "Async")):
            if cls is None:
                continue
            out.append((name, prefix + name, cls))
            if name != "Sandbox":
                continue
            for part in SANDBOX_PARTS:
                prop = inspect.getattr_static(cls, part, None)
                if not isinstance(prop, property):
                    continue
                part_cls = typing.get_type_hints(prop.fget).get("return")
                if inspect.isclass(part_cls):
                    out.append((f"{name}.{part}", f"{prefix}{name}.{part}", part_cls))
    return out


def public_calls():
    surfaces = _surfaces()
    roots = {cls for _, _, cls in surfaces}
    calls, seen = [], set()
    for row_prefix, prefix, cls in surfaces:
        for owner in cls.__mro__:
            if owner is not cls and owner in roots:
                break  # its calls are listed under it
            if not owner.__module__.startswith("e2b"):
                continue
            for attr, value in vars(owner).items():
                if attr.startswith("_") or not _is_call(value):
                    continue
                name = f"{prefix}.{attr}"
                if name in seen:
                    continue  # overridden in a subclass: listed once
                seen.add(name)
                calls.append(
                    PublicCall(
                        name=name,
                        row=f"{row_prefix}.{attr}",
                        defined_in=owner,
                        attr=attr,
                        code_interpreter=owner.__module__.startswith(CODE_INTERPRETER),
                    )
                )
    return calls


def sdk_version() -> str:
    return f"e2b {version('e2b')}"


# Set while a recorded call runs: what the SDK calls of itself then is not user code's.
_inside_call = contextvars.ContextVar("inside_e2b_call", default=False)


class Recorder:
    """Wraps every public call; `note` receives the name of each call user code makes.

    The wrapping is transparent: a class attribute is replaced by a descriptor that
    hands out what the original descriptor hands out (method, classmethod, E2B's
    `class_method_variant`), wrapped in a function of the same kind (async stays async)
    that notes the call and calls through.
    """

    def __init__(self, note):
        self.note = note
        # (class, attr) -> {class users reach it through -> the call's name}
        names = {}
        for call in public_calls():
            names.setdefault((call.defined_in, call.attr), []).append(call)
        self.names = names

    def install(self):
        surfaces = {cls: prefix for _, prefix, cls in _surfaces()}
        for (owner, attr), calls in self.names.items():
            by_class = {}
            for call in calls:
                prefix = call.name.rsplit(".", 1)[0]
                by_class.update({cls: call.name for cls, p in surfaces.items() if p == prefix})
            setattr(owner, attr, _Recorded(vars(owner)[attr], attr, by_class, self.note))


class _Recorded:
    def __init__(self, inner, attr, by_class, note):
        self.inner, self.attr, self.by_class, self.note = inner, attr, by_class, note
        functools.update_wrapper(self, getattr(inner, "__func__", inner), updated=())

    def _name(self, cls):
        for c in getattr(cls, "__mro__", ()):
            if c in self.by_class:
                return self.by_class[c]
        return None

    def __get__(self, obj, owner=None):
        got = self.inner.__get__(obj, owner) if hasattr(self.inner, "__get__") else self.inner
        name = self._name(owner if owner is not None else type(obj))
        return got if name is None else _wrap(got, name, self.note)


def _wrap(fn, name, note):
    if inspect.iscoroutinefunction(inspect.unwrap(fn)):

        @functools.wraps(fn)
        async def recorded_async(*args, **kwargs):
            if _inside_call.get():
                return await fn(*args, **kwargs)
            note(name)
            token = _inside_call.set(True)
            try:
                return await fn(*args, **kwargs)
            finally:
                _inside_call.reset(token)

        return recorded_async

    @functools.wraps(fn)
    def recorded(*args, **kwargs):
        if _inside_call.get():
            return fn(*args, **kwargs)
        note(name)
        token = _inside_call.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _inside_call.reset(token)

    return recorded


if __name__ == "__main__":
    # For ops/e2b-compat.py: the public calls of this venv's SDK, as JSON.
    json.dump(
        {
            "sdk": sdk_version(),
            "calls": [
                {"name": c.name, "row": c.row, "code_interpreter": c.code_interpreter}
                for c in public_calls()
            ],
        },
        sys.stdout,
        indent=1,
    )
