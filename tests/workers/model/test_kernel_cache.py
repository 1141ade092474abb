"""The native kernels' build cache: a private directory, only libraries this user built and whose bytes match the
hash recorded when they were built are loaded, and a library that cannot be used leaves the PyTorch paths.

Compiling the kernels takes seconds, so the real library is compiled once for the module and a stand-in compiler
(`CC`) copies it (or a stub) wherever a build is asked for. The stub has no kernels and leaves a mark file when a
process loads it: a planted library must never run, so "not loaded" is checked by its constructor not running.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from workers import ModelRunner, SamplingParams
from workers.model import load_checkpoint
from workers.model.kernels import native
from workers.model.layers.mamba2 import Mamba2Mixer

STUB_SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void mark_loaded(void) {
    const char *path = getenv("HYBRIDGEN_TEST_LOADED_MARK");
    FILE *mark = path ? fopen(path, "a") : NULL;
    if (mark) { fputs("loaded\n", mark); fclose(mark); }
}
int not_a_kernel(void) { return 0; }
"""

FAKE_COMPILER = """#!/bin/sh
# Stands in for the C compiler: copies the library named in {choice} to the path after -o.
echo run >> {runs}
while [ "$#" -gt 0 ]; do
  if [ "$1" = "-o" ]; then exec cp "$(cat {choice})" "$2"; fi
  shift
done
exit 1
"""


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The kernel library ("real") and a library without kernels that marks its loading ("stub"), compiled once."""
    compiler = shutil.which(os.environ.get("CC") or "cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    directory = tmp_path_factory.mktemp("prebuilt")
    (directory / "stub.c").write_text(STUB_SOURCE)
    commands = {
        "real": [
            compiler,
            *native.CFLAGS,
            *native.ISA_FLAGS[native.selected_isa()],
            *map(str, native.SOURCES),
            "-o",
            str(directory / "real.so"),
            "-lm",
        ],
        "stub": [compiler, "-shared", "-fPIC", str(directory / "stub.c"), "-o", str(directory / "stub.so")],
    }
    for command in commands.values():
        subprocess.run(command, check=True, capture_output=True)
    return {name: directory / f"{name}.so" for name in commands}


class FakeCompiler:
    """A `CC` script producing a prebuilt library; `produce` picks which, `runs` counts the builds asked for."""

    def __init__(self, directory: Path, prebuilt: dict[str, Path]) -> None:
        self.prebuilt = prebuilt
        self.choice, self.log = directory / "choice", directory / "runs"
        self.path = directory / "cc"
        self.path.write_text(FAKE_COMPILER.format(choice=self.choice, runs=self.log))
        self.path.chmod(0o755)
        self.produce("real")

    def produce(self, name: str) -> None:
        self.choice.write_text(str(self.prebuilt[name]))

    @property
    def runs(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0


def _forget_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    """native's per-process state as in a new worker process."""
    monkeypatch.setattr(native, "_LIBRARIES", {})
    monkeypatch.setattr(native, "_LOAD_ERRORS", {})
    monkeypatch.setattr(native, "_WARNED", False)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HYBRIDGEN_KERNEL_CACHE (not created yet), and native's per-process state as before a first load."""
    _forget_the_library(monkeypatch)
    directory = tmp_path / "home" / "kernels"
    monkeypatch.setenv("HYBRIDGEN_KERNEL_CACHE", str(directory))
    return directory


@pytest.fixture
def compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, prebuilt: dict[str, Path]) -> FakeCompiler:
    (tmp_path / "fake").mkdir()
    fake = FakeCompiler(tmp_path / "fake", prebuilt)
    monkeypatch.setenv("CC", str(fake.path))
    return fake


@pytest.fixture
def loaded_mark(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[], bool]:
    """Whether the stub has been loaded by this process since the test began."""
    mark = tmp_path / "loaded-mark"
    monkeypatch.setenv("HYBRIDGEN_TEST_LOADED_MARK", str(mark))
    return mark.exists


def _build_in_another_process(cache: Path, compiler: FakeCompiler, library: str) -> None:
    """Fill `cache` the way another worker would: a separate process builds (and tries to load) `library`.

    Separate, so this process's dynamic loader has never seen the file: it hands back a library it already loaded
    under the same path without reading the file again, which would hide what the tests look for.
    """
    compiler.produce(library)
    env = {k: v for k, v in os.environ.items() if k != "HYBRIDGEN_TEST_LOADED_MARK"}
    env["PYTHONPATH"] = str(Path(native.__file__).parents[3])
    script = "from workers.model.kernels import native; native.available()"
    subprocess.run([sys.executable, "-c", script], env=env, capture_output=True)
    assert any(cache.glob("*.so")), "the other process left no library in the cache"


def _replace_with(path: Path, source: Path) -> None:
    """Put a copy of `source` at `path` as a new file (an in-place write would change a library a process maps)."""
    partial = path.with_name(path.name + ".planting")
    shutil.copyfile(source, partial)
    os.replace(partial, path)


def test_the_cache_directory_is_created_private(cache, compiler):
    native.load()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_a_build_is_reused_and_written_whole(cache, compiler, monkeypatch):
    native.load()
    _forget_the_library(monkeypatch)
    assert native.load().linear_panel_width() > 0
    assert compiler.runs == 1
    (record,), (library,) = cache.glob("*.sha256"), cache.glob("*.so")  # no partial files left behind
    assert sorted(p.name for p in cache.iterdir()) == sorted([record.name, library.name])
    recorded = json.loads(record.read_text())["sha256"]
    assert recorded == hashlib.sha256(library.read_bytes()).hexdigest() and recorded[:16] in library.name


def test_a_record_of_another_build_is_not_trusted(cache, compiler, monkeypatch, caplog):
    native.load()
    (record,) = cache.glob("*.sha256")
    record.write_text(json.dumps({**json.loads(record.read_text()), "build_key": "0" * 64}))
    _forget_the_library(monkeypatch)
    with caplog.at_level(logging.WARNING):
        assert native.load().linear_panel_width() > 0
    assert compiler.runs == 2 and "records another build" in caplog.text


def test_a_planted_library_that_does_not_match_its_recorded_hash_is_never_loaded(
    cache, compiler, loaded_mark, prebuilt, caplog
):
    _build_in_another_process(cache, compiler, "real")
    for library in cache.glob("*.so"):  # the name the cache would load, the planted bytes
        _replace_with(library, prebuilt["stub"])
    compiler.produce("real")
    runs = compiler.runs
    with caplog.at_level(logging.WARNING):
        assert native.load().linear_panel_width() > 0  # rebuilt: the real kernels
    assert not loaded_mark()
    assert compiler.runs == runs + 1
    assert "does not match" in caplog.text


def _other_owner(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: path.stat().st_uid + 1)  # the cache now belongs to someone else


@pytest.mark.parametrize(
    "unsafe, reason",
    [
        (lambda path, _: path.chmod(0o770), "writable by group or others"),
        (lambda path, _: path.chmod(0o707), "writable by group or others"),
        (_other_owner, "owned by uid"),
    ],
    ids=["group-writable", "world-writable", "another user's"],
)
def test_an_unsafe_cache_directory_is_not_loaded_from(
    cache, compiler, loaded_mark, caplog, monkeypatch, unsafe, reason
):
    _build_in_another_process(cache, compiler, "stub")  # a library that matches its recorded hash
    before = sorted(p.name for p in cache.iterdir())
    unsafe(cache, monkeypatch)
    compiler.produce("real")
    with caplog.at_level(logging.WARNING):
        assert native.load().linear_panel_width() > 0  # built privately for this process
    assert not loaded_mark()
    assert f"{cache} refused" in caplog.text and reason in caplog.text
    assert sorted(p.name for p in cache.iterdir()) == before  # nothing written there either


def _chown_to_another_user(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    os.chown(path, path.stat().st_uid + 1, -1)


@pytest.mark.parametrize(
    "unsafe, reason",
    [
        (lambda path: path.chmod(0o770), "writable by group or others"),
        (lambda path: path.chmod(0o702), "writable by group or others"),
        (_chown_to_another_user, "owned by uid"),
    ],
    ids=["group-writable", "world-writable", "another user's"],
)
def test_an_unsafe_library_file_is_not_loaded(cache, compiler, loaded_mark, caplog, unsafe, reason):
    _build_in_another_process(cache, compiler, "stub")  # a library that matches its recorded hash
    for library in cache.glob("*.so"):
        unsafe(library)
    compiler.produce("real")
    with caplog.at_level(logging.WARNING):
        assert native.load().linear_panel_width() > 0  # rebuilt in the cache
    assert not loaded_mark()
    assert reason in caplog.text


PROMPTS = [[5, 9, 30, 31, 4, 77, 12], [8, 8, 8]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def torch_path_tokens(checkpoint_dir) -> list[list[int]]:
    """Greedy tokens of the bamba checkpoint on the PyTorch reference paths (made before any test's cache)."""
    reference = ModelRunner.from_pretrained(
        str(checkpoint_dir("bamba")), decode_kernel="torch", linear_backend="torch", max_num_seqs=2
    )
    return [r.token_ids for r in reference.generate(PROMPTS, GREEDY)]


def test_a_library_missing_a_kernel_leaves_the_torch_paths(
    torch_path_tokens, cache, compiler, loaded_mark, checkpoint_dir, caplog
):
    path = str(checkpoint_dir("bamba"))
    _build_in_another_process(cache, compiler, "stub")  # ours and intact, but a stale or foreign build
    with caplog.at_level(logging.WARNING):
        runner = ModelRunner.from_pretrained(path, max_num_seqs=2)
    assert loaded_mark()  # it was loaded: the missing kernel is what stops it
    assert "undefined symbol" in caplog.text and "PyTorch" in caplog.text
    mixers = [m for m in runner.model.modules() if isinstance(m, Mamba2Mixer)]
    assert {m.decode_kernel for m in mixers} == {"torch"}
    assert [r.token_ids for r in runner.generate(PROMPTS, GREEDY)] == torch_path_tokens
    with pytest.raises(native.NativeKernelError, match="undefined symbol"):
        load_checkpoint(path, decode_kernel="native")
