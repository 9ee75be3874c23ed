"""flash-attn's sources fetched with pip: the command, the sha256 check, the errors (a fake pip runs here).

One test really calls pip (slow, needs the network and torch); it skips saying which is missing.
"""

from __future__ import annotations

import hashlib
import io
import os
import socket
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from mqa_byoc.kernels import sources
from mqa_byoc.kernels.errors import FlashAttnSourceUnavailable, NativeKernelsUnavailable

VERSION = sources.FLASH_ATTN_VERSION


def _fake_sdist() -> bytes:
    """A tarball shaped like flash-attn's sdist (only the files the tree check looks at)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tf:
        for name, text in [("PKG-INFO", f"Name: flash_attn\nVersion: {VERSION}\n"),
                           ("csrc/flash_attn/src/flash.h", "// flash.h\n"),
                           ("csrc/cutlass/include/cutlass/cutlass.h", "// cutlass.h\n")]:
            data = text.encode()
            info = tarfile.TarInfo(f"flash_attn-{VERSION}/{name}")
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class FakePip:
    """Records each call; saves ``payload`` as the sdist into the ``-d`` directory, or fails."""

    def __init__(self, payload: bytes | None, returncode: int = 0, stderr: str = ""):
        self.payload, self.returncode, self.stderr, self.calls = payload, returncode, stderr, []

    def __call__(self, cmd, env):
        self.calls.append((list(cmd), dict(env)))
        dest = Path(cmd[cmd.index("-d") + 1])
        if self.payload is not None:
            (dest / f"flash_attn-{VERSION}.tar.gz").write_bytes(self.payload)
        return subprocess.CompletedProcess(cmd, self.returncode, "", self.stderr)


@pytest.fixture
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MQA_BYOC_FLASH_ATTN_SRC", raising=False)
    return tmp_path / "cache"


def test_pip_command_is_the_pinned_sdist(tmp_path):
    fake = FakePip(_fake_sdist())
    sha = hashlib.sha256(fake.payload).hexdigest()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sources, "FLASH_ATTN_SHA256", sha)
        out = sources.fetch_sdist(tmp_path / "dl", runner=fake, progress=None)
    (cmd, env), = fake.calls
    d = cmd[cmd.index("-d") + 1]
    assert cmd == [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                   "--no-build-isolation", f"flash-attn=={VERSION}", "-d", d]
    assert Path(d).parent == tmp_path / "dl"  # a private temp dir: a failed fetch leaves nothing behind
    assert env["FLASH_ATTENTION_SKIP_CUDA_BUILD"] == "TRUE"
    assert out == tmp_path / "dl" / f"flash_attn-{VERSION}.tar.gz" and out.read_bytes() == fake.payload
    assert not Path(d).exists()


def test_bad_sha256_is_rejected_and_not_kept(tmp_path):
    fake = FakePip(b"not flash-attn")
    with pytest.raises(FlashAttnSourceUnavailable, match=f"sha256 .* != expected {sources.FLASH_ATTN_SHA256}"):
        sources.fetch_sdist(tmp_path, runner=fake, progress=None)
    assert list(tmp_path.iterdir()) == []


def test_pip_failure_names_both_fixes(tmp_path):
    fake = FakePip(None, returncode=1, stderr="ModuleNotFoundError: No module named 'torch'")
    with pytest.raises(FlashAttnSourceUnavailable) as e:
        sources.fetch_sdist(tmp_path, runner=fake, progress=None)
    msg = str(e.value)
    assert "install torch" in msg and "MQA_BYOC_FLASH_ATTN_SRC" in msg
    assert "No module named 'torch'" in msg and "pip download" in msg
    assert isinstance(e.value, NativeKernelsUnavailable)  # callers catching the old error still do


def test_pip_saving_nothing_is_an_error(tmp_path):
    with pytest.raises(FlashAttnSourceUnavailable, match="no sdist saved"):
        sources.fetch_sdist(tmp_path, runner=FakePip(None), progress=None)


def test_flash_attn_source_fetches_once_then_uses_the_cache(cache, monkeypatch):
    fake = FakePip(_fake_sdist())
    monkeypatch.setattr(sources, "FLASH_ATTN_SHA256", hashlib.sha256(fake.payload).hexdigest())
    with pytest.raises(NativeKernelsUnavailable, match="MQA_BYOC_FLASH_ATTN_SRC"):
        sources.flash_attn_source(download=False, runner=fake, progress=None)
    assert fake.calls == []
    root = sources.flash_attn_source(runner=fake, progress=None)
    assert root == cache / "src" / f"flash_attn-{VERSION}" and sources.is_flash_attn_tree(root)
    assert sources.flash_attn_tree_version(root) == VERSION
    assert sources.flash_attn_source(runner=fake, progress=None) == root
    assert len(fake.calls) == 1


def test_offline_sdist_via_env_is_sha_checked(cache, monkeypatch, tmp_path):
    bad = tmp_path / f"flash_attn-{VERSION}.tar.gz"
    bad.write_bytes(_fake_sdist())  # right shape, wrong digest
    monkeypatch.setenv("MQA_BYOC_FLASH_ATTN_SRC", str(bad))
    fake = FakePip(None)
    with pytest.raises(FlashAttnSourceUnavailable, match="sha256"):
        sources.flash_attn_source(runner=fake, progress=None)
    assert fake.calls == []  # an offline source never falls back to pip


def test_no_url_in_the_code():
    text = Path(sources.__file__).read_text()
    assert "http://" not in text and "https://" not in text and "urllib" not in text


def _why_no_real_pip() -> str | None:
    try:
        import torch  # noqa: F401 - pip runs flash-attn's setup.py, which imports it
    except ImportError:
        return "torch not installed (pip's metadata step for flash-attn's sdist imports it)"
    try:
        socket.create_connection(("pypi.org", 443), timeout=3).close()
    except OSError as e:
        return f"offline: cannot reach pypi.org ({e})"
    return None


@pytest.mark.slow
def test_real_pip_fetch(tmp_path):
    why = _why_no_real_pip()
    if why:
        pytest.skip(why)
    out = sources.fetch_sdist(tmp_path, progress=None)
    assert sources.sha256_of(out) == sources.FLASH_ATTN_SHA256
    assert os.path.getsize(out) > 1_000_000
