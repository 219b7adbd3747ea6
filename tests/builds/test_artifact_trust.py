"""CPU tests that the loader only loads what it can vouch for: JIT artifacts verified like
built ones (sha256, toolchain, source hash, target), stale builds rebuilt or compiled just in
time with one warning, corrupt manifests reported in one line and repaired by
``dsv4-tl build``; and the loader's locking (one lock per variant, failed compiles
remembered) and its ``DSV4_TL_JIT`` switch."""

import json
import shutil
import threading
import time
import warnings

import pytest

from dsv4_tl import cli, loader as L, provenance
from dsv4_tl.build import build
from dsv4_tl.kernels import Variant
from dsv4_tl.loader import (
    MANIFEST_NAME,
    KernelBuildMismatchError,
    KernelCompileError,
    KernelLoader,
    KernelNotBuiltError,
    jit_artifact_path,
)
from dsv4_tl.manifest import CorruptManifestError
from dsv4_tl.targets import parse_target

TARGET = parse_target("cuda:sm_90a")
OPS = ("global_topk",)
# Not in the build: a global_topk schedule of the space that no bucket selects.
JIT_SCHEDULE = {"tokens_per_block": 8, "cols_per_block": 256, "threads": 256}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # buckets without a tuning log
        manifest = build(TARGET, out, heads=(64,), ops=OPS, jobs=2, progress=False)
    jit_dir = tmp_path_factory.mktemp("jit_kernels")
    shutil.copytree(out, jit_dir, dirs_exist_ok=True)
    variant = Variant.make("global_topk", dict(ragged=False), JIT_SCHEDULE)
    KernelLoader(TARGET, jit_dir, jit=True).get(variant)
    return out, manifest, jit_dir


@pytest.fixture
def kdir(built, tmp_path):
    dst = tmp_path / "kernels"
    shutil.copytree(built[2], dst)
    return dst


def _jit_variant() -> Variant:
    return Variant.make("global_topk", dict(ragged=False), JIT_SCHEDULE)


def _built_variants(manifest):
    return [Variant.make(e["op"], e["static"], e["schedule"]) for e in manifest["kernels"]]


def _edit_manifest(kdir, edit):
    path = kdir / TARGET.dirname / MANIFEST_NAME
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# ------------------------------------------------------------------ item 1: JIT artifacts
def test_a_verified_jit_artifact_loads_with_jit_off(kdir):
    assert callable(KernelLoader(TARGET, kdir, jit=False).get(_jit_variant()))


def test_a_jit_artifact_with_a_flipped_byte_is_not_loaded(kdir):
    path = jit_artifact_path(kdir, TARGET, _jit_variant())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(KernelNotBuiltError, match="JIT compilation is off"):
        KernelLoader(TARGET, kdir, jit=False).get(_jit_variant())
    # JIT on: compiled again over it, and then verified
    assert callable(KernelLoader(TARGET, kdir, jit=True).get(_jit_variant()))
    assert path.read_bytes() != bytes(data)
    assert callable(KernelLoader(TARGET, kdir, jit=False).get(_jit_variant()))


def test_another_variants_library_under_the_key_is_not_loaded(built, kdir):
    other = kdir / TARGET.dirname / built[1]["kernels"][0]["artifact"]
    shutil.copyfile(other, jit_artifact_path(kdir, TARGET, _jit_variant()))
    with pytest.raises(KernelNotBuiltError):
        KernelLoader(TARGET, kdir, jit=False).get(_jit_variant())


def test_a_plain_key_named_library_in_jit_is_never_loaded(built, kdir):
    """What the old loader loaded: ``jit/<key>.so`` with no record."""
    other = kdir / TARGET.dirname / built[1]["kernels"][0]["artifact"]
    for path in (kdir / TARGET.dirname / "jit").glob("*"):
        path.unlink()
    shutil.copyfile(other, kdir / TARGET.dirname / "jit" / f"{_jit_variant().key}.so")
    with pytest.raises(KernelNotBuiltError):
        KernelLoader(TARGET, kdir, jit=False).get(_jit_variant())


def test_after_a_tilelang_upgrade_the_jit_artifact_is_refused(kdir, monkeypatch):
    versions = dict(provenance._toolchain_versions())
    before = jit_artifact_path(kdir, TARGET, _jit_variant())
    monkeypatch.setattr(provenance, "_toolchain_versions",
                        lambda: {**versions, "tilelang": "9.9.9"})
    after = jit_artifact_path(kdir, TARGET, _jit_variant())
    assert after != before  # the JIT key holds the versions
    with pytest.raises(KernelNotBuiltError):
        KernelLoader(TARGET, kdir, jit=False).get(_jit_variant())
    # the old file under the new name is refused too: its record names the old version
    shutil.copyfile(before, after)
    shutil.copyfile(before.with_name(before.name[:-3] + ".record.json"),
                    after.with_name(after.name[:-3] + ".record.json"))
    with pytest.raises(KernelNotBuiltError):
        KernelLoader(TARGET, kdir, jit=False).get(_jit_variant())


def test_the_jit_key_holds_the_versions_and_the_source_hash(monkeypatch):
    variant = _jit_variant()
    base = provenance.fingerprint(variant, TARGET)
    versions = dict(provenance._toolchain_versions())
    monkeypatch.setattr(provenance, "_toolchain_versions",
                        lambda: {**versions, "apache-tvm-ffi": "9.9.9"})
    assert provenance.fingerprint(variant, TARGET) != base
    monkeypatch.undo()
    monkeypatch.setattr(provenance, "source_hash", lambda v: "0" * 64)
    assert provenance.fingerprint(variant, TARGET) != base
    assert provenance.fingerprint(variant, parse_target("cuda:sm_100a")) != base


# ------------------------------------------------------------------ item 2: stale builds
def _stale_cases():
    def sources(data):
        for e in data["kernels"]:
            e["source_hash"] = "0" * 64

    def tvm_ffi(data):
        for e in data["kernels"]:
            e["toolchain"]["apache-tvm-ffi"] = "9.9.9"

    def target(data):
        for e in data["kernels"]:
            e["target"] = "cuda:sm_100a"

    return [(sources, "other kernel sources"), (tvm_ffi, "tvm-ffi 9.9.9"),
            (target, "built for cuda:sm_100a")]


@pytest.mark.parametrize("edit,reason", _stale_cases(), ids=["source", "tvm-ffi", "target"])
def test_a_stale_built_kernel_is_refused_without_jit(built, kdir, edit, reason):
    _edit_manifest(kdir, edit)
    for variant in _built_variants(built[1]):
        with pytest.raises(KernelBuildMismatchError, match=reason):
            KernelLoader(TARGET, kdir, jit=False).get(variant)


def test_a_stale_built_kernel_is_compiled_just_in_time_with_one_warning(built, kdir):
    _edit_manifest(kdir, _stale_cases()[0][0])
    variant = _built_variants(built[1])[0]
    loader = KernelLoader(TARGET, kdir, jit=True)
    with pytest.warns(RuntimeWarning, match="stale .*other kernel sources.*dsv4-tl build") as rec:
        assert callable(loader.get(variant))
    assert len([w for w in rec if "stale" in str(w.message)]) == 1
    assert "\n" not in str(rec[0].message)
    assert jit_artifact_path(kdir, TARGET, variant).is_file()


def test_an_edited_kernel_source_changes_the_source_hash(tmp_path, monkeypatch):
    """The hash follows the files' content in a running process (mtime/size-keyed cache), a
    sub-package's (``sparse_mla/``) as much as the package's own."""
    import dsv4_tl.tile_kernels as tk
    from pathlib import Path

    root = tmp_path / "tile_kernels"
    shutil.copytree(Path(tk.__file__).parent, root, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(provenance, "_kernel_root", lambda: root)
    variant = _jit_variant()
    for edited in (root / "index_helpers.py", root / "sparse_mla" / "work.py"):
        before = provenance.source_hash(variant)
        edited.write_text(edited.read_text() + "\n# edited\n")
        assert provenance.source_hash(variant) != before, edited.name
    moved = root / "sparse_mla" / "ring.py"  # the same bytes under another name
    before = provenance.source_hash(variant)
    moved.rename(moved.with_name("ring2.py"))
    assert provenance.source_hash(variant) != before


def test_a_rebuild_replaces_stale_entries(built, kdir):
    _edit_manifest(kdir, _stale_cases()[1][0])
    again = build(TARGET, kdir, heads=(64,), ops=OPS, jobs=2, progress=False)
    assert sorted(again["built"]) == sorted(v.key for v in _built_variants(built[1]))
    for variant in _built_variants(built[1]):
        assert callable(KernelLoader(TARGET, kdir, jit=False).get(variant))


# ------------------------------------------------------------------ item 4: corrupt manifests
def _corruptions():
    return {
        "truncated": lambda text: text[: len(text) // 2],
        "list": lambda text: "[]",
        "entry without key": lambda text: json.dumps(
            {**json.loads(text), "kernels": [{k: v for k, v in e.items() if k != "key"}
                                             for e in json.loads(text)["kernels"]]}),
        "empty": lambda text: "",
    }


@pytest.mark.parametrize("name", sorted(_corruptions()))
def test_a_corrupt_manifest_is_one_clear_error_and_build_repairs_it(built, kdir, name, capsys):
    path = kdir / TARGET.dirname / MANIFEST_NAME
    path.write_text(_corruptions()[name](path.read_text()))
    variant = _built_variants(built[1])[0]
    with pytest.raises(CorruptManifestError, match=f"corrupt .*run: dsv4-tl build") as exc:
        KernelLoader(TARGET, kdir, jit=False).get(variant)
    assert "\n" not in str(exc.value)

    assert cli.main(["info", "--out", str(kdir)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("dsv4-tl info: ") and "corrupt" in err and "\n" not in err

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["build", "--target", TARGET.name, "--out", str(kdir),
                         "--op", "global_topk", "--jobs", "2"]) == 0
    for variant in _built_variants(built[1]):
        assert callable(KernelLoader(TARGET, kdir, jit=False).get(variant))


# ------------------------------------------------------------------ item 8: the loader's locks
@pytest.mark.parametrize("value,expected", [("0", False), ("false", False), ("OFF", False),
                                            ("No", False), ("1", True), ("true", True),
                                            ("", True), ("yes", True)])
def test_dsv4_tl_jit_accepts_the_usual_spellings(monkeypatch, tmp_path, value, expected):
    monkeypatch.setenv(L.ENV_JIT, value)
    assert KernelLoader(TARGET, tmp_path).jit is expected


def test_dsv4_tl_jit_rejects_nonsense_by_name(monkeypatch, tmp_path):
    monkeypatch.setenv(L.ENV_JIT, "maybe")
    with pytest.raises(ValueError, match="DSV4_TL_JIT"):
        KernelLoader(TARGET, tmp_path)


def test_a_jit_compile_does_not_block_loading_another_kernel(built, kdir, monkeypatch):
    real = L.compile_variant
    compiling = threading.Event()

    def slow_compile(variant, target, path):
        compiling.set()
        time.sleep(3.0)
        return real(variant, target, path)

    monkeypatch.setattr(L, "compile_variant", slow_compile)
    for path in (kdir / TARGET.dirname / "jit").glob("*"):
        path.unlink()
    loader = KernelLoader(TARGET, kdir, jit=True)
    worker = threading.Thread(target=loader.get, args=(_jit_variant(),))
    worker.start()
    assert compiling.wait(30)
    start = time.time()
    loader.get(_built_variants(built[1])[0])
    waited = time.time() - start
    worker.join()
    assert waited < 1.5, f"loading a built kernel waited {waited:.1f} s behind a JIT compile"


def test_a_failed_compile_is_raised_again_without_recompiling(kdir, monkeypatch):
    calls = []

    def failing_compile(variant, target, path):
        calls.append(variant.key)
        raise KernelCompileError(f"compiling {variant.key} failed: boom")

    monkeypatch.setattr(L, "compile_variant", failing_compile)
    for path in (kdir / TARGET.dirname / "jit").glob("*"):
        path.unlink()
    loader = KernelLoader(TARGET, kdir, jit=True)
    with pytest.raises(KernelCompileError, match="boom") as first:
        loader.get(_jit_variant())
    with pytest.raises(KernelCompileError, match="boom") as second:
        loader.get(_jit_variant())
    assert second.value is first.value and len(calls) == 1


def test_audit_finds_damaged_and_leftover_files(built, kdir):
    assert L.audit_kernel_dir(kdir, TARGET) == []
    path = jit_artifact_path(kdir, TARGET, _jit_variant())
    path.write_bytes(path.read_bytes() + b"x")
    (kdir / TARGET.dirname / "manifest.json.123.456.tmp").write_text("{")
    problems = L.audit_kernel_dir(kdir, TARGET)
    assert any("temporary file" in p for p in problems)
    assert any(path.name in p and "sha256" in p for p in problems)


# ------------------------------------------------------------------ issue 25 item 1: trust
def _foreign(path, monkeypatch):
    """Make ``path`` look owned by another user: chown it as root, else pretend to be
    another user (trust compares owners with os.getuid())."""
    import os

    from dsv4_tl import trust

    if os.getuid() == 0:
        os.chown(path, 12345, -1, follow_symlinks=False)
    else:
        monkeypatch.setattr(trust.os, "getuid", lambda: os.getuid() + 1)


def _jit_files(kdir):
    path = jit_artifact_path(kdir, TARGET, _jit_variant())
    return path, path.with_name(path.name[:-3] + ".record.json")


@pytest.mark.parametrize("which", ["kernel_dir", "target_dir", "jit_dir", "artifact", "record"])
def test_a_group_or_other_writable_kernel_path_is_refused_jit_off_or_on(kdir, which):
    """Issue 25 item 1: anyone who can write the kernel directory could plant an artifact
    with a record computed from public inputs; such a directory, subdirectory or file is
    refused with one error naming it and the fix, with JIT off and on."""
    import os

    artifact, record = _jit_files(kdir)
    path = {"kernel_dir": kdir, "target_dir": kdir / TARGET.dirname,
            "jit_dir": artifact.parent, "artifact": artifact, "record": record}[which]
    os.chmod(path, os.stat(path).st_mode | 0o022)
    for jit in (False, True):
        with pytest.raises(L.UntrustedPathError, match=f"{path}.*writable by its group and "
                           f"others.*fix: chmod go-w {path}"):
            KernelLoader(TARGET, kdir, jit=jit).get(_jit_variant())
    os.chmod(path, os.stat(path).st_mode & ~0o022)
    assert callable(KernelLoader(TARGET, kdir, jit=False).get(_jit_variant()))


@pytest.mark.parametrize("which", ["kernel_dir", "manifest", "built_artifact", "artifact"])
def test_a_kernel_path_owned_by_another_user_is_refused(built, kdir, which, monkeypatch):
    artifact, _ = _jit_files(kdir)
    tdir = kdir / TARGET.dirname
    path = {"kernel_dir": kdir, "manifest": tdir / MANIFEST_NAME, "artifact": artifact,
            "built_artifact": tdir / built[1]["kernels"][0]["artifact"]}[which]
    variant = (_built_variants(built[1])[0] if which == "built_artifact" else _jit_variant())
    _foreign(path, monkeypatch)
    with pytest.raises(L.UntrustedPathError, match=f"{path} is owned by uid"):
        KernelLoader(TARGET, kdir, jit=False).get(variant)


@pytest.mark.parametrize("inside", [False, True], ids=["leaving", "inside"])
def test_a_symlinked_artifact_or_record_is_refused(kdir, tmp_path, inside):
    """Nothing in a kernel directory is opened through a link (issue 34 item 7: what a link
    points to could be swapped between the check and the load), whether it leaves the
    directory or not; the kernel directory itself may be reached through a link."""
    import os

    artifact, record = _jit_files(kdir)
    there = kdir if inside else tmp_path / "elsewhere"
    there.mkdir(mode=0o700, exist_ok=True)
    for path in (artifact, record):
        shutil.move(path, there / path.name)
        os.symlink(there / path.name, path)
        with pytest.raises(L.UntrustedPathError, match=f"{path} is a symbolic link"):
            KernelLoader(TARGET, kdir, jit=False).get(_jit_variant())
        path.unlink()
        shutil.move(there / path.name, path)
    link = tmp_path / "link_to_kernels"
    os.symlink(kdir, link)
    assert callable(KernelLoader(TARGET, link, jit=False).get(_jit_variant()))


def test_jit_output_is_private_whatever_the_umask(tmp_path):
    """A user-private-group umask (002) would make a group-writable kernel directory that the
    next process then refuses: what the loader and the builder create is 0700 / 0600."""
    import os
    import stat

    fresh = tmp_path / "fresh" / "kernels"
    old = os.umask(0o002)
    try:
        KernelLoader(TARGET, fresh, jit=True).get(_jit_variant())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build(TARGET, tmp_path / "built", heads=(64,), ops=OPS, jobs=1, progress=False)
    finally:
        os.umask(old)
    artifact, record = _jit_files(fresh)
    for d in (tmp_path / "fresh", fresh, fresh / TARGET.dirname, artifact.parent,
              tmp_path / "built" / TARGET.dirname):
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
    lock = artifact.with_name(artifact.name + ".lock")
    assert stat.S_IMODE(os.stat(artifact).st_mode) == 0o700
    for f in (record, lock, tmp_path / "built" / TARGET.dirname / MANIFEST_NAME):
        assert stat.S_IMODE(os.stat(f).st_mode) == 0o600, f
    assert L.audit_kernel_dir(fresh, TARGET) == []


def test_build_refuses_an_out_others_can_write(built, kdir, capsys):
    import os

    os.chmod(kdir / TARGET.dirname, 0o777)
    with pytest.raises(L.UntrustedPathError, match="writable by its group and others"):
        build(TARGET, kdir, heads=(64,), ops=OPS, jobs=1, progress=False)
    assert cli.main(["build", "--out", str(kdir), "--op", "global_topk"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "chmod go-w" in err[0]


def test_audit_reports_untrusted_paths_and_a_manifest_entry_without_static(built, kdir):
    """Issue 25 items 1 and 10: the audit names a group-writable artifact; an entry without
    ``static`` (which read_manifest accepts) is a problem, not a KeyError."""
    import os

    artifact, _ = _jit_files(kdir)
    os.chmod(artifact, 0o666)
    _edit_manifest(kdir, lambda d: d["kernels"][0].pop("static"))
    problems = L.audit_kernel_dir(kdir, TARGET)
    assert any(p.startswith("untrusted: ") and str(artifact) in p for p in problems)
    assert any("malformed record" in p and "static" in p for p in problems)


# ------------------------------------------------------------------ issue 34 item 7: races
def _mapped_inodes() -> set:
    """Inodes of the files mapped into this process (``/proc/self/maps``)."""
    inodes = set()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[4] != "0":
                inodes.add(int(fields[4]))
    return inodes


@pytest.mark.parametrize("which", ["built", "jit"])
def test_a_library_swapped_in_after_the_check_is_never_loaded(built, kdir, monkeypatch, which):
    """Issue 34 item 7: the loader checked and hashed the artifact by path and then opened the
    path again, so another user able to rename entries got their library loaded (22 times in
    2,000 loads). Here the swap happens right after the hash matched: what is loaded is the
    file that was hashed (opened once, loaded through its descriptor), not the newcomer."""
    import os

    if which == "built":
        variant = _built_variants(built[1])[0]
        path = kdir / TARGET.dirname / built[1]["kernels"][0]["artifact"]
        planted_from = jit_artifact_path(kdir, TARGET, _jit_variant())
    else:
        variant = _jit_variant()
        path = jit_artifact_path(kdir, TARGET, variant)
        planted_from = kdir / TARGET.dirname / built[1]["kernels"][0]["artifact"]
    planted = path.with_name("planted.tmp")
    shutil.copyfile(planted_from, planted)  # another valid library, a fresh inode
    checked, planted_inode = os.stat(path).st_ino, os.stat(planted).st_ino
    real = L.stale_reason

    def then_swap(record, v, target, p, *rest, **kw):
        reason = real(record, v, target, p, *rest, **kw)
        if reason is None and p == path and planted.exists():
            os.replace(planted, path)  # the attacker's rename, right after the check
        return reason

    monkeypatch.setattr(L, "stale_reason", then_swap)
    assert callable(KernelLoader(TARGET, kdir, jit=False).get(variant))
    assert not planted.exists(), "the swap did not happen: the test checks nothing"
    mapped = _mapped_inodes()
    assert planted_inode not in mapped, "the library swapped in after the check was loaded"
    assert checked in mapped


def _chown_or_skip(path, uid):
    import os

    if os.getuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    os.chown(path, uid, -1)


@pytest.mark.parametrize("parent", ["group_writable", "other_writable", "sticky", "foreign",
                                    "root_owned"])
def test_the_levels_above_the_kernel_dir_are_checked_as_ssh_does(kdir, tmp_path, parent):
    """Issue 34 item 7: whoever can rename entries in a parent of the kernel directory can
    swap the whole directory; each level above it must be owned by this user or root and not
    writable by group or others unless sticky (``/tmp``)."""
    import os

    top = tmp_path / "top"
    top.mkdir(mode=0o700)
    moved = top / "kernels"
    shutil.move(kdir, moved)
    mode = {"group_writable": 0o770, "other_writable": 0o707, "sticky": 0o1777}.get(parent, 0o755)
    os.chmod(top, mode)
    if parent == "foreign":
        _chown_or_skip(top, 12345)
    if parent == "root_owned":
        _chown_or_skip(top, 0)
    if parent in ("sticky", "root_owned"):
        assert callable(KernelLoader(TARGET, moved, jit=False).get(_jit_variant()))
        assert L.audit_kernel_dir(moved, TARGET) == []
        return
    expect = "owned by uid 12345" if parent == "foreign" else "writable by .* and not sticky"
    for jit in (False, True):
        with pytest.raises(L.UntrustedPathError, match=f"{top}, above the kernel directory "
                           f"{moved}, is {expect}") as exc:
            KernelLoader(TARGET, moved, jit=jit).get(_jit_variant())
        assert "\n" not in str(exc.value)
    with pytest.raises(L.UntrustedPathError, match="above the kernel directory"):
        build(TARGET, moved, heads=(64,), ops=OPS, jobs=1, progress=False)
    assert any("above the kernel directory" in p for p in L.audit_kernel_dir(moved, TARGET))


@pytest.mark.parametrize("which", ["record", "artifact", "manifest"])
def test_a_fifo_in_a_kernel_file_s_place_is_one_error_not_a_hang(built, kdir, which):
    """Issue 34 item 7: a FIFO where a record or the manifest should be blocked the loader's
    read forever; only regular files are read (opened non-blocking, then fstat)."""
    import os
    import threading

    artifact, record = _jit_files(kdir)
    path = {"record": record, "artifact": artifact,
            "manifest": kdir / TARGET.dirname / MANIFEST_NAME}[which]
    path.unlink()
    os.mkfifo(path, 0o600)
    outcome = []

    def load():
        try:
            KernelLoader(TARGET, kdir, jit=False).get(_jit_variant())
            outcome.append("loaded")
        except Exception as exc:  # noqa: BLE001  (the test inspects it)
            outcome.append(exc)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(20)
    if worker.is_alive():  # unblock the reader before failing
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        pytest.fail(f"the loader hung on a FIFO in place of the {which}")
    assert isinstance(outcome[0], L.UntrustedPathError), outcome
    assert f"{path} is not a regular file" in str(outcome[0]) and "\n" not in str(outcome[0])


def test_a_kernel_dir_that_is_a_file_or_has_a_newline_is_one_line_naming_it(tmp_path,
                                                                             monkeypatch):
    """Issue 34 item 7: ``DSV4_TL_KERNEL_DIR`` naming a file gave a raw ``[Errno 20]``, one
    with a newline a two-line message (and a suggested command that runs something else)."""
    a_file = tmp_path / "not_a_dir"
    a_file.write_text("")
    for jit in (False, True):
        with pytest.raises(NotADirectoryError) as exc:
            KernelLoader(TARGET, a_file, jit=jit).get(_jit_variant())
        assert str(exc.value) == (f"{a_file} is not a directory (expected a kernel directory "
                                  "or a folder in one)")
    monkeypatch.setenv(L.ENV_KERNEL_DIR, str(tmp_path / "a\nb"))
    with pytest.raises(ValueError, match="DSV4_TL_KERNEL_DIR: expected a folder path without "
                       "control characters") as exc:
        KernelLoader(TARGET, jit=False)
    assert "\n" not in str(exc.value)
    with pytest.raises(ValueError, match="out: expected a folder path") as exc:
        build(TARGET, tmp_path / "c\nd", heads=(64,), ops=OPS, jobs=1, progress=False)
    assert "\n" not in str(exc.value)


def test_an_unreadable_kernel_dir_is_one_line_naming_it(tmp_path):
    """Issue 34 item 7: a kernel directory this user may not search gave a raw OS error;
    now one line naming the level that could not be opened. Run in a child process that
    cannot bypass permission bits (as root: without CAP_DAC_OVERRIDE, through setpriv)."""
    import os
    import subprocess
    import sys

    prefix = []
    if os.getuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root bypasses permission bits and setpriv is not here to drop that")
        prefix = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"]
    kernels = tmp_path / "kernels"
    (kernels / TARGET.dirname).mkdir(parents=True, mode=0o700)
    os.chmod(kernels, 0o000)
    code = ("import sys; from dsv4_tl.loader import KernelLoader\n"
            "from dsv4_tl.kernels import Variant\n"
            f"v = Variant.make('global_topk', dict(ragged=False), {JIT_SCHEDULE!r})\n"
            "for jit in (False, True):\n"
            "    try:\n"
            f"        KernelLoader({TARGET.name!r}, sys.argv[1], jit=jit).get(v)\n"
            "    except Exception as exc:\n"
            "        print(type(exc).__name__, exc, sep='|')\n")
    try:
        run = subprocess.run(prefix + [sys.executable, "-c", code, str(kernels)], text=True,
                             capture_output=True, timeout=120)
    finally:
        os.chmod(kernels, 0o700)
    assert run.returncode == 0, run.stderr[-2000:]
    expected = f"PermissionError|{kernels / TARGET.dirname}: cannot open (Permission denied)"
    assert run.stdout.splitlines() == [expected, expected], run.stdout


def test_suggested_commands_quote_the_kernel_dir(tmp_path):
    """Issue 34 item 7: the ``dsv4-tl build`` command in an error is pasted into a shell:
    a kernel directory with a space or a ``;`` is quoted."""
    import shlex

    kdir = tmp_path / "my kernels; rm -rf x"
    with pytest.raises(KernelNotBuiltError) as exc:
        KernelLoader(TARGET, kdir, jit=False).get(_jit_variant())
    assert str(exc.value).endswith(f"run: dsv4-tl build --target {TARGET.name} --out "
                                   f"{shlex.quote(str(kdir))}")


def test_an_fnuz_cache_on_cuda_with_jit_off_names_no_build_that_cannot_build_it(tmp_path):
    """Issue 34 item 7: CUDA builds hold e4m3fn variants only, yet an FNUZ call with JIT off
    was told to run a ``dsv4-tl build`` that never builds FNUZ; now the message says there
    is none and what works (JIT), and an e4m3fn call still gets the command."""
    from dsv4_tl.kernels import KERNELS

    spec = KERNELS["insert_k_cache"]
    fnuz = spec.variant(TARGET.dirname, tokens=64, fp8_format="e4m3fnuz")
    with pytest.raises(KernelNotBuiltError) as exc:
        KernelLoader(TARGET, tmp_path, jit=False).get(fnuz)
    message = str(exc.value)
    assert "dsv4-tl build --target" not in message
    assert ("no dsv4-tl build command builds it (builds for cuda:sm_90a hold e4m3fn caches "
            "only, this call's cache is e4m3fnuz); it is compiled just in time only: turn "
            "DSV4_TL_JIT on") in message
    ocp = spec.variant(TARGET.dirname, tokens=64, fp8_format="e4m3fn")
    with pytest.raises(KernelNotBuiltError, match=f"run: dsv4-tl build --target {TARGET.name}"):
        KernelLoader(TARGET, tmp_path, jit=False).get(ocp)


def test_sycl_artifacts_are_read_through_the_checked_descriptors(tmp_path, monkeypatch):
    """Issue 34 item 7, SYCL: the launch description was read again by path after the loader
    hashed it (another one naming another SPIR-V with its hash could take its place), and
    its SPIR-V read through links; both are read through descriptors checked like the
    loader's."""
    import hashlib
    import os

    from dsv4_tl.sycl import artifacts, runtime
    from dsv4_tl.trust import UntrustedPathError, open_trusted

    made = []
    monkeypatch.setattr(runtime, "SyclKernel", lambda meta, spirv: made.append(spirv) or "kernel")
    kdir = tmp_path / "kernels"
    tdir = kdir / "sycl"
    tdir.mkdir(parents=True, mode=0o700)

    def write(stem: str, spirv: bytes) -> None:
        (tdir / f"{stem}.spv").write_bytes(spirv)
        meta = {"format": 1, "spirv": f"{stem}.spv",
                "spirv_sha256": hashlib.sha256(spirv).hexdigest()}
        (tdir / f"{stem}{artifacts.ARTIFACT_SUFFIX}").write_text(json.dumps(meta))

    write("k", b"ours")
    write("evil", b"theirs")
    opened = open_trusted(kdir, tdir / f"k{artifacts.ARTIFACT_SUFFIX}")
    os.replace(tdir / f"evil{artifacts.ARTIFACT_SUFFIX}", tdir / f"k{artifacts.ARTIFACT_SUFFIX}")
    with opened:
        assert artifacts.load_artifact(opened) == "kernel" and made == [b"ours"]
    write("k", b"ours")
    os.replace(tdir / "k.spv", tdir / "moved.spv")
    os.symlink(tdir / "moved.spv", tdir / "k.spv")
    with open_trusted(kdir, tdir / f"k{artifacts.ARTIFACT_SUFFIX}") as opened:
        with pytest.raises(UntrustedPathError, match="k.spv is a symbolic link"):
            artifacts.load_artifact(opened)
