"""Specification: the sandbox file system through the synchronous client,
`e2b.Sandbox` 2.63.0 (`sandbox.files`, envd's `filesystem.Filesystem` and `/files`).

One sandbox serves the module; each test works in a directory of its own under
/home/user, the default user's home, where relative paths start.
"""

import io
import os
import stat
import urllib.parse
from datetime import datetime, timedelta, timezone

import pytest
from e2b import FileNotFoundException, FileType, FilesystemEventType, Sandbox

from conftest import BASE_TEMPLATE, wait_until

HOME = "/home/user"


@pytest.fixture(scope="module")
def sandbox(run_id):
    sb = Sandbox.create(template=BASE_TEMPLATE, timeout=600, metadata={"suite": run_id, "module": "files"})
    yield sb
    sb.kill()


# --- write and read ---------------------------------------------------------------


def test_text_written_is_read_back(sandbox):
    info = sandbox.files.write(f"{HOME}/text/hello.txt", "héllo wörld\n")
    assert (info.name, info.path, info.type) == ("hello.txt", f"{HOME}/text/hello.txt", FileType.FILE)
    assert sandbox.files.read(f"{HOME}/text/hello.txt") == "héllo wörld\n"
    assert sandbox.commands.run(f"cat {HOME}/text/hello.txt").stdout == "héllo wörld\n"


def test_every_byte_value_survives_a_round_trip(sandbox):
    data = bytes(range(256)) * 64
    sandbox.files.write(f"{HOME}/bytes/all.bin", data)
    back = sandbox.files.read(f"{HOME}/bytes/all.bin", format="bytes")
    assert bytes(back) == data
    assert sandbox.commands.run(f"wc -c < {HOME}/bytes/all.bin").stdout.strip() == str(len(data))


def test_relative_paths_start_in_the_home_directory(sandbox):
    sandbox.files.write("relative/r.txt", "rel")
    assert sandbox.files.read(f"{HOME}/relative/r.txt") == "rel"
    assert sandbox.files.read("relative/r.txt") == "rel"


def test_writing_creates_missing_directories_and_overwrites_files(sandbox):
    path = f"{HOME}/deep/a/b/c/file.txt"
    sandbox.files.write(path, "first version, longer")
    sandbox.files.write(path, "second")
    assert sandbox.files.read(path) == "second"


def test_files_are_written_as_the_requesting_user(sandbox):
    mine = sandbox.files.write(f"{HOME}/owners/user.txt", "u")
    roots = sandbox.files.write("/opt/owners/root.txt", "r", user="root")
    assert sandbox.files.get_info(mine.path).owner == "user"
    assert sandbox.files.get_info(roots.path, user="root").owner == "root"
    assert sandbox.commands.run("stat -c %U /opt/owners/root.txt").stdout == "root\n"


def test_write_files_writes_many_files_in_one_request(sandbox):
    entries = [{"path": f"{HOME}/many/f{i}.txt", "data": f"content {i}"} for i in range(5)]
    entries.append({"path": f"{HOME}/many/sub/bin.dat", "data": b"\x00\x01\xff"})
    infos = sandbox.files.write_files(entries)
    assert sorted(i.path for i in infos) == sorted(e["path"] for e in entries)
    for e in entries:
        want = e["data"] if isinstance(e["data"], bytes) else e["data"].encode()
        assert bytes(sandbox.files.read(e["path"], format="bytes")) == want


def test_a_file_like_object_is_streamed_as_an_upload(sandbox):
    data = os.urandom(3 * 1024 * 1024 + 17)
    sandbox.files.write(f"{HOME}/stream/up.bin", io.BytesIO(data))
    assert bytes(sandbox.files.read(f"{HOME}/stream/up.bin", format="bytes")) == data


def test_a_download_can_be_streamed(sandbox):
    data = os.urandom(2 * 1024 * 1024)
    sandbox.files.write(f"{HOME}/stream/down.bin", data)
    chunks = list(sandbox.files.read(f"{HOME}/stream/down.bin", format="stream"))
    assert b"".join(chunks) == data


def test_gzip_uploads_and_downloads_are_decoded(sandbox):
    data = b"compressible " * 50_000
    sandbox.files.write(f"{HOME}/gzip/data.txt", data, gzip=True)
    assert sandbox.commands.run(f"wc -c < {HOME}/gzip/data.txt").stdout.strip() == str(len(data))
    assert bytes(sandbox.files.read(f"{HOME}/gzip/data.txt", format="bytes", gzip=True)) == data


def test_reading_a_missing_file_raises_file_not_found(sandbox):
    with pytest.raises(FileNotFoundException):
        sandbox.files.read(f"{HOME}/no/such/file")


# --- list, exists, get_info --------------------------------------------------------


@pytest.fixture(scope="module")
def tree(sandbox):
    root = f"{HOME}/tree"
    sandbox.files.write_files(
        [
            {"path": f"{root}/top.txt", "data": "t"},
            {"path": f"{root}/a/one.txt", "data": "1"},
            {"path": f"{root}/a/b/two.txt", "data": "22"},
        ]
    )
    return root


def test_list_shows_one_level_by_default(sandbox, tree):
    entries = {e.name: e for e in sandbox.files.list(tree)}
    assert set(entries) == {"top.txt", "a"}
    assert entries["a"].type == FileType.DIR and entries["a"].path == f"{tree}/a"
    assert entries["top.txt"].type == FileType.FILE and entries["top.txt"].size == 1


def test_list_with_depth_descends_that_many_levels(sandbox, tree):
    paths = {e.path for e in sandbox.files.list(tree, depth=2)}
    assert paths == {f"{tree}/top.txt", f"{tree}/a", f"{tree}/a/one.txt", f"{tree}/a/b"}
    paths = {e.path for e in sandbox.files.list(tree, depth=3)}
    assert f"{tree}/a/b/two.txt" in paths


def test_listing_a_missing_directory_raises_file_not_found(sandbox):
    with pytest.raises(FileNotFoundException):
        sandbox.files.list(f"{HOME}/no-such-dir")


def test_exists_tells_files_and_directories_from_missing_paths(sandbox, tree):
    assert sandbox.files.exists(f"{tree}/top.txt")
    assert sandbox.files.exists(f"{tree}/a")
    assert not sandbox.files.exists(f"{tree}/nope")


def test_get_info_describes_a_file(sandbox, tree):
    info = sandbox.files.get_info(f"{tree}/a/b/two.txt")
    assert (info.name, info.path, info.type, info.size) == ("two.txt", f"{tree}/a/b/two.txt", FileType.FILE, 2)
    assert (info.owner, info.group) == ("user", "user")
    assert info.permissions[-9:] == stat.filemode(stat.S_IFREG | (info.mode & 0o777))[-9:], info
    assert info.mode & 0o600 == 0o600, info
    assert abs(info.modified_time - datetime.now(timezone.utc)) < timedelta(minutes=5), info
    assert sandbox.files.get_info(f"{tree}/a").type == FileType.DIR


def test_get_info_of_a_symlink_says_symlink_with_its_target(sandbox):
    sandbox.files.write(f"{HOME}/links/target.txt", "pointed at")
    sandbox.commands.run(f"ln -s {HOME}/links/target.txt {HOME}/links/link")
    info = sandbox.files.get_info(f"{HOME}/links/link")
    assert (info.name, info.type, info.symlink_target) == ("link", FileType.SYMLINK, f"{HOME}/links/target.txt"), info
    assert sandbox.files.get_info(f"{HOME}/links/target.txt").symlink_target is None
    assert sandbox.files.read(f"{HOME}/links/link") == "pointed at"


def test_get_info_of_a_missing_path_raises_file_not_found(sandbox):
    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info(f"{HOME}/missing.txt")


# --- remove, rename, make_dir ------------------------------------------------------


def test_remove_deletes_files_and_whole_directories(sandbox):
    sandbox.files.write(f"{HOME}/rm/dir/inner.txt", "x")
    sandbox.files.write(f"{HOME}/rm/file.txt", "x")
    sandbox.files.remove(f"{HOME}/rm/file.txt")
    assert not sandbox.files.exists(f"{HOME}/rm/file.txt")
    sandbox.files.remove(f"{HOME}/rm/dir")
    assert not sandbox.files.exists(f"{HOME}/rm/dir")
    assert sandbox.files.exists(f"{HOME}/rm")


def test_rename_moves_a_file_and_returns_its_new_entry(sandbox):
    sandbox.files.write(f"{HOME}/mv/old.txt", "moving")
    entry = sandbox.files.rename(f"{HOME}/mv/old.txt", f"{HOME}/mv/new.txt")
    assert (entry.name, entry.path) == ("new.txt", f"{HOME}/mv/new.txt")
    assert not sandbox.files.exists(f"{HOME}/mv/old.txt")
    assert sandbox.files.read(f"{HOME}/mv/new.txt") == "moving"


def test_make_dir_creates_parents_and_reports_an_existing_directory(sandbox):
    assert sandbox.files.make_dir(f"{HOME}/mk/x/y") is True
    assert sandbox.files.get_info(f"{HOME}/mk/x/y").type == FileType.DIR
    assert sandbox.files.make_dir(f"{HOME}/mk/x/y") is False


# --- watch_dir (the sync client polls CreateWatcher / GetWatcherEvents) ------------


def test_watch_dir_reports_a_file_created_in_the_directory(sandbox):
    sandbox.files.make_dir(f"{HOME}/watched")
    handle = sandbox.files.watch_dir(f"{HOME}/watched")
    try:
        sandbox.files.write(f"{HOME}/watched/new.txt", "hi")
        seen = []

        def created():
            seen.extend(handle.get_new_events())
            return [e for e in seen if e.name == "new.txt" and e.type == FilesystemEventType.CREATE]

        wait_until(created, "a CREATE event for new.txt", within=10)
    finally:
        handle.stop()


def test_a_recursive_watch_sees_subdirectories(sandbox):
    sandbox.files.make_dir(f"{HOME}/rwatch/sub")
    handle = sandbox.files.watch_dir(f"{HOME}/rwatch", recursive=True)
    try:
        sandbox.commands.run(f"echo x > {HOME}/rwatch/sub/deep.txt")
        seen = []

        def deep():
            seen.extend(handle.get_new_events())
            return [e for e in seen if e.name.endswith("deep.txt")]

        wait_until(deep, "an event for sub/deep.txt", within=10)
    finally:
        handle.stop()


def test_a_recursive_watch_sees_directories_made_after_it_started(sandbox):
    sandbox.files.make_dir(f"{HOME}/rwatch-late")
    handle = sandbox.files.watch_dir(f"{HOME}/rwatch-late", recursive=True)
    try:
        sandbox.files.make_dir(f"{HOME}/rwatch-late/new/deeper")
        # Made after the watch started, two levels down: the watch follows it.
        wait_until(lambda: sandbox.files.exists(f"{HOME}/rwatch-late/new/deeper"), "the directories exist")
        sandbox.commands.run(f"sleep 0.5; echo x > {HOME}/rwatch-late/new/deeper/late.txt")
        seen = []

        def late():
            seen.extend(handle.get_new_events())
            return [e for e in seen if e.name.endswith("deeper/late.txt")]

        wait_until(late, "an event for new/deeper/late.txt", within=10)
        names = {e.name for e in seen}
        assert "new" in names, names
    finally:
        handle.stop()


def test_a_watched_write_gives_create_and_write(sandbox):
    sandbox.files.make_dir(f"{HOME}/watched-write")
    handle = sandbox.files.watch_dir(f"{HOME}/watched-write")
    try:
        sandbox.files.write(f"{HOME}/watched-write/w.txt", "some bytes")
        seen = []

        def both():
            seen.extend(handle.get_new_events())
            kinds = {e.type for e in seen if e.name == "w.txt"}
            return kinds if {FilesystemEventType.CREATE, FilesystemEventType.WRITE} <= kinds else None

        wait_until(both, "CREATE and WRITE events for w.txt", within=10)
        creates = [i for i, e in enumerate(seen) if e.name == "w.txt" and e.type == FilesystemEventType.CREATE]
        writes = [i for i, e in enumerate(seen) if e.name == "w.txt" and e.type == FilesystemEventType.WRITE]
        assert creates[0] < writes[-1], seen
    finally:
        handle.stop()


# --- what the reported envd version switches on in the SDK (0.6.2: file metadata,
# --- 0.6.3: entries in watch events, 0.6.4: watches that allow network mounts) --------


def test_file_metadata_written_with_a_file_is_reported_with_it(sandbox):
    tags = {"origin": "e2b-test", "run": "1"}
    sandbox.files.write(f"{HOME}/meta/tagged.txt", "x", metadata=tags)
    sandbox.files.write(f"{HOME}/meta/plain.txt", "y")
    assert sandbox.files.get_info(f"{HOME}/meta/tagged.txt").metadata == tags
    entries = {e.name: e for e in sandbox.files.list(f"{HOME}/meta")}
    assert entries["tagged.txt"].metadata == tags
    assert not entries["plain.txt"].metadata


def test_watch_events_carry_the_entry_when_asked(sandbox):
    sandbox.files.make_dir(f"{HOME}/watched-entry")
    handle = sandbox.files.watch_dir(f"{HOME}/watched-entry", include_entry=True, allow_network_mounts=True)
    try:
        sandbox.files.write(f"{HOME}/watched-entry/new.txt", "four")
        seen = []

        def created():
            seen.extend(handle.get_new_events())
            return [e for e in seen if e.name == "new.txt" and e.type == FilesystemEventType.CREATE]

        event = wait_until(created, "a CREATE event for new.txt", within=10)[0]
        assert event.entry is not None, event
        assert (event.entry.name, event.entry.path, event.entry.type) == ("new.txt", f"{HOME}/watched-entry/new.txt", FileType.FILE)
    finally:
        handle.stop()


# --- signed URLs (fetched for real in test_domain.py: with one E2B_SANDBOX_URL
# --- they carry no routing headers, so here they are only checked for form) --------


def test_download_and_upload_urls_are_signed_urls_of_the_files_endpoint(sandbox, sandbox_url):
    path = f"{HOME}/signed/x.txt"
    for url, op in ((sandbox.download_url(path), "read"), (sandbox.upload_url(path), "write")):
        parts = urllib.parse.urlsplit(url)
        assert f"{parts.scheme}://{parts.netloc}" == sandbox_url, (op, url)
        assert parts.path.endswith("/files"), (op, url)
        query = urllib.parse.parse_qs(parts.query)
        assert query["path"] == [path], (op, url)
        # A secured sandbox (the API returned an envd access token) signs its URLs.
        assert query["signature"][0].startswith("v1_"), (op, url)

    url = sandbox.download_url(path, user="root", use_signature_expiration=60)
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert query["username"] == ["root"]
    expires = int(query["signature_expiration"][0])
    assert 0 < expires - datetime.now(timezone.utc).timestamp() <= 61
