"""Every command the README, the docs/ pages and tests/gpu/README.md show is run here: parsed by its real
parser, or run where that takes seconds (dry-run where running takes minutes); and the README's
compile-script example runs.

Commands are taken from fenced shell blocks, indented code blocks and inline code spans that start
with a command word. Each one must match a handler below; a command no handler covers fails
:func:`test_doc_command`, so a new documented command needs a line here.

- ``mqa-byoc ...`` / ``python -m mqa_byoc.cli ...`` / ``python -m mqa_byoc.kernels ...``: parsed by
  :func:`mqa_byoc.cli.build_parser`; ``build-kernels`` is also run with ``--dry-run``, ``runtime-kit`` is
  run (into a temporary folder, without downloading wheels); a bare command name (``mqa-byoc profile``)
  must answer ``--help``.
- ``python SCRIPT.py ...`` (also ``python3 -m tvm_runtime_kit SCRIPT.py ...``, the runtime kit's launcher,
  and ``nice python ...``): the script runs in a subprocess until its own argparse parser has parsed the
  arguments, then stops.
- ``nsys profile ... CMD``: CMD as above; ``nsys stats``: external, listed as known.
- ``pip install -e ".[extras]"``: the extras exist in pyproject.toml; ``pytest`` / ``python -m pytest``:
  the paths exist; ``source KIT/setup.sh``: a kit the documents write with ``mqa-byoc runtime-kit --out KIT``.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mqa_byoc.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "gpu" / "README.md"]

_COMMAND_START = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:nice\s+)?(mqa-byoc|python3?|pip|pytest|nsys|source)(\s|$)")
_SHELL_FENCES = {"", "sh", "bash", "shell", "console"}


def doc_commands(text: str) -> list[tuple[int, str]]:
    """``(line number, command)`` for each command line in ``text``; ``&&`` chains stay one entry."""
    out, fence, prev_blank, in_indented = [], None, True, False
    for no, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip().lower()
            continue
        if fence is not None:
            if fence in _SHELL_FENCES and stripped and not stripped.startswith("#"):
                out.append((no, stripped.removeprefix("$ ")))
            continue
        if line.startswith("    ") and (prev_blank or in_indented):
            in_indented = True
            if _COMMAND_START.match(stripped):  # other lines of an indented block are code, not commands
                out.append((no, stripped))
            prev_blank = False
            continue
        in_indented = in_indented and not stripped  # a blank line does not end an indented block
        prev_blank = not stripped
        for span in re.findall(r"`([^`]+)`", line):
            # one word (`python`, `mqa-byoc`) names a provider or the program, not a command
            if _COMMAND_START.match(span.strip()) and len(span.split()) > 1:
                out.append((no, span.strip()))
    return out


def _split(command: str) -> list[list[str]]:
    """Simple commands of a line: comments dropped, split at ``&&``."""
    tokens = shlex.split(command, comments=True)
    parts, cur = [], []
    for t in tokens:
        if t == "&&":
            parts.append(cur)
            cur = []
        else:
            cur.append(t)
    return [p for p in parts + [cur] if p]


_PARSE_ONLY = r"""
import argparse, os, runpy, sys

class _Parsed(BaseException):
    pass

_depth = [0]

def _wrap(orig):
    def wrapped(self, *a, **k):
        _depth[0] += 1
        try:
            result = orig(self, *a, **k)
        finally:
            _depth[0] -= 1
        if _depth[0] == 0:
            print("PARSED", result if isinstance(result, argparse.Namespace) else result[0], flush=True)
            raise _Parsed
        return result
    return wrapped

argparse.ArgumentParser.parse_args = _wrap(argparse.ArgumentParser.parse_args)
argparse.ArgumentParser.parse_known_args = _wrap(argparse.ArgumentParser.parse_known_args)
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
try:
    runpy.run_path(script, run_name="__main__")
except _Parsed:
    sys.exit(0)
print("NOT PARSED: the script ended without parsing its arguments with argparse")
sys.exit(3)
"""


def _parse_script(argv: list[str]) -> None:
    script = ROOT / argv[0]
    assert script.is_file(), f"{argv[0]} does not exist"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + sys.path))
    r = subprocess.run([sys.executable, "-c", _PARSE_ONLY, str(script), *argv[1:]], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "PARSED" in r.stdout, f"{' '.join(argv)}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"


def _subcommand_names(parser) -> set[str]:
    names = set()
    for action in parser._actions:
        if getattr(action, "choices", None) and hasattr(action, "_name_parser_map"):
            for name, sub in action._name_parser_map.items():
                names.add(name)
                names |= _subcommand_names(sub)
    return names


def _run_cli(args: list[str], tmp_path: Path, monkeypatch) -> None:
    parser = build_parser()
    if args and args[-1] in ("--help", "-h"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(args)
        assert e.value.code == 0, f"mqa-byoc {' '.join(args)}"
        return
    if args and all(a in _subcommand_names(parser) for a in args):  # a command's name in the text
        with pytest.raises(SystemExit) as e:
            parser.parse_args(args + ["--help"])
        assert e.value.code == 0
        return
    try:
        ns = parser.parse_args(args)
    except SystemExit as e:  # argparse has printed why
        raise AssertionError(f"mqa-byoc {' '.join(args)}: does not parse (exit {e.code})") from None
    if ns.command == "build-kernels":  # compiling takes minutes per file: dry run
        monkeypatch.setenv("MQA_BYOC_CACHE", str(tmp_path / "cache"))
        assert main(args + ["--dry-run"]) == 0
    if ns.command == "runtime-kit":  # a second: written into tmp_path, no wheels fetched
        kit = tmp_path / Path(ns.out).name
        assert main(["runtime-kit", "--out", str(kit), "--no-wheels"]) == 0
        assert (kit / "setup.sh").is_file()


def _check_pip(args: list[str]) -> None:
    assert args[:1] == ["install"], f"pip {' '.join(args)}: only `pip install` is known"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for a in args[1:]:
        m = re.fullmatch(r"\.\[([\w,-]+)\]", a)
        if m:
            missing = set(m.group(1).split(",")) - set(extras)
            assert not missing, f"pip install {a}: no such extras {missing} in pyproject.toml"


def _check_pytest(args: list[str]) -> None:
    for a in args:
        if not a.startswith("-"):
            assert (ROOT / a.split("::")[0]).exists(), f"pytest {a}: no such path"


def _run_simple(argv: list[str], tmp_path: Path, monkeypatch) -> None:
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", argv[0]):  # VAR=value prefixes
        argv = argv[1:]
    if argv[:1] == ["nice"]:
        argv = argv[1:]
    head, rest = argv[0], argv[1:]
    if head == "mqa-byoc":
        return _run_cli(rest, tmp_path, monkeypatch)
    if head in ("python", "python3"):
        if rest[:2] == ["-m", "mqa_byoc.cli"]:
            return _run_cli(rest[2:], tmp_path, monkeypatch)
        if rest[:2] == ["-m", "mqa_byoc.kernels"]:
            return _run_cli(["build-kernels", *rest[2:]], tmp_path, monkeypatch)
        if rest[:2] == ["-m", "pytest"]:
            return _check_pytest(rest[2:])
        if rest[:2] == ["-m", "tvm_runtime_kit"]:  # the runtime kit's launcher runs the script as __main__
            rest = rest[2:]
        if rest and rest[0].endswith(".py"):
            return _parse_script(rest)
    if head == "pytest":
        return _check_pytest(rest)
    if head == "pip":
        return _check_pip(rest)
    if head == "nsys" and rest[:1] == ["profile"]:
        inner = next((i for i, t in enumerate(rest) if t in ("mqa-byoc", "python", "python3")), None)
        assert inner is not None, f"nsys profile without a command: {' '.join(argv)}"
        return _run_simple(rest[inner:], tmp_path, monkeypatch)
    if head == "nsys" and rest[:1] == ["stats"]:
        return None  # Nsight Systems' report tool: external
    if head == "source" and len(rest) == 1 and rest[0].endswith("/setup.sh"):
        kit = rest[0].rsplit("/", 1)[0]
        assert kit in KITS_WRITTEN, f"source {rest[0]}: no document writes that kit (mqa-byoc runtime-kit --out {kit})"
        return None
    raise AssertionError(f"command not covered by tests/test_docs_commands.py: {' '.join(argv)}")


COMMANDS = [(doc, no, c) for doc in DOCUMENTS for no, c in doc_commands(doc.read_text())]
KITS_WRITTEN = {m for _, _, c in COMMANDS for m in re.findall(r"mqa-byoc runtime-kit --out (\S+)", c)}


def test_documents_have_the_commands_this_file_was_written_for():
    texts = [c for _, _, c in COMMANDS]
    readme = [c for doc, _, c in COMMANDS if doc == README]
    assert readme[:2] == ['pip install -e ".[test,hf]" && mqa-byoc demo', "pytest"]  # what .ci/run relies on
    assert "mqa-byoc build-kernels --arch sm_90 --head-dims 128 --dtypes fp16,bf16" in texts
    assert "mqa-byoc runtime-kit --out .runtime-kit" in texts
    assert "pytest tests/gpu" in texts
    assert {doc.name for doc, _, _ in COMMANDS} >= {"README.md", "testing.md", "performance.md", "deployment.md"}
    assert len(texts) >= 30


def test_extraction_of_blocks_and_spans():
    text = ("Run `mqa-byoc demo` or `--jobs 2`.\n\n    mqa-byoc profile run d  # here\n    x = f(1)\n    pytest\n\n"
            "```python\nx = 1\n```\n```bash\n$ python tools/x.py --a\n# comment\n```\n"
            "- item\n  continued `python3 -m pytest -q`\n")
    assert doc_commands(text) == [(1, "mqa-byoc demo"), (3, "mqa-byoc profile run d  # here"), (5, "pytest"),
                                  (11, "python tools/x.py --a"), (15, "python3 -m pytest -q")]
    assert _split("pip install -e '.[test]' && mqa-byoc demo  # first") == [
        ["pip", "install", "-e", ".[test]"], ["mqa-byoc", "demo"]]


@pytest.mark.parametrize("doc,line_no,command", COMMANDS,
                         ids=[f"{d.parent.name}/{d.name}:L{n}:{c[:50]}" for d, n, c in COMMANDS])
def test_doc_command(doc, line_no, command, tmp_path, monkeypatch):
    for argv in _split(command):
        _run_simple(argv, tmp_path, monkeypatch)


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_readme_compile_script_runs(tmp_path):
    """The README's compile-script example, as written, on this machine (built and exported for sm_90;
    loading it needs the GPU); the python provider, so that no FA2 kernel is compiled."""
    (block,) = _python_blocks(README.read_text())
    call = 'mqa_byoc.build(mod, {"kind": "cuda", "arch": "sm_90"}, mqa=True)'
    assert block.count(call) == 1, "the example's build call changed: update this test"
    block = block.replace(call, call[:-1] + ', provider="python")')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src")] + sys.path))
    r = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "offloaded" in r.stdout.lower(), r.stdout[-2000:]
    assert (tmp_path / "model.so").is_file()


def test_uncovered_command_fails(tmp_path, monkeypatch):
    with pytest.raises(AssertionError, match="not covered"):
        _run_simple(["make", "all"], tmp_path, monkeypatch)
    with pytest.raises(AssertionError, match="does not parse"):
        _run_simple(["mqa-byoc", "build-kernels", "--arch"], tmp_path, monkeypatch)


def test_script_parse_only_stops_after_parsing(tmp_path):
    script = tmp_path / "tool.py"
    script.write_text(
        "import argparse, sys\n"
        "p = argparse.ArgumentParser()\n"
        "sub = p.add_subparsers(dest='cmd', required=True)\n"
        "sub.add_parser('build').add_argument('--out')\n"
        "args = p.parse_args()\n"
        "sys.exit(7)  # the work: never reached in a parse-only run\n"
    )
    _parse_script([str(script), "build", "--out", "x"])
    with pytest.raises(AssertionError, match="unrecognized arguments: --bogus"):
        _parse_script([str(script), "build", "--bogus"])
    plain = tmp_path / "plain.py"
    plain.write_text("print('no parser')\n")
    with pytest.raises(AssertionError, match="NOT PARSED"):
        _parse_script([str(plain)])
