"""Contract and packaging: generated protobuf code is fresh, buf lint is clean, the wheel holds every
subpackage found on disk, and ``kvgrid --help`` lists exactly the registered commands that import."""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from kvgrid import cli

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# Where each import root lives on disk (pyproject's package-dir).
PACKAGE_ROOTS = {"kvgrid": ROOT / "services", "kvgrid.kernels": ROOT / "kernels"}
# Files a subpackage needs at run time besides .py: stubs, markers and kernel sources compiled on load.
SHIPPED_SUFFIXES = (".py", ".pyi", ".typed", ".cu", ".cuh", ".cpp", ".h")


def _tool(name: str) -> str:
    found = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if found is None:
        pytest.fail(f"{name} not found on PATH or next to {sys.executable}; run `make install`")
    return found


def _run(cmd: list[str], cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def _disk_packages() -> dict[str, Path]:
    """Every directory with an __init__.py under services/ and kernels/, as dotted module names."""
    found: dict[str, Path] = {}
    for top, root in PACKAGE_ROOTS.items():
        for init in sorted(root.rglob("__init__.py")):
            rel = init.parent.relative_to(root)
            if "__pycache__" in rel.parts:
                continue
            found[".".join((top, *rel.parts)) if rel.parts else top] = init.parent
    return found


def test_disk_packages_include_the_known_layout() -> None:
    # Guards the discovery itself: if it found nothing, the wheel test below would pass vacuously.
    expected = {"kvgrid.common", "kvgrid.agent", "kvgrid.controller", "kvgrid.connector", "kvgrid.api.v1"}
    assert {"kvgrid", "kvgrid.kernels"} | expected <= set(_disk_packages())


def test_generated_proto_code_is_fresh() -> None:
    result = _run([sys.executable, "scripts/gen_proto.py", "--check"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_proto_check_detects_stale_code(tmp_path: Path) -> None:
    # The check must be able to fail: run it on a copy whose generated module was edited.
    for part in ("scripts", "proto", "services/api/v1"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    stale = tmp_path / "services/api/v1/common_pb2.py"
    stale.write_text(stale.read_text() + "\n# edited by hand\n")
    result = _run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=tmp_path)
    assert result.returncode == 1
    assert "common_pb2.py" in result.stdout


def test_buf_lint_is_clean() -> None:
    result = _run([_tool("buf"), "lint"])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_wheel_contains_every_subpackage(tmp_path: Path) -> None:
    # Build from a copy so the repo gets no build/ or egg-info churn while other tests run.
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for part in ("services", "kernels"):
        shutil.copytree(ROOT / part, src / part, ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, src / name)
    dist = tmp_path / "dist"
    # -x: the build requirements are installed in this venv (setuptools ships bdist_wheel itself).
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-x", "--outdir", str(dist), str(src)]
    result = _run(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = dist.glob("kvgrid-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    missing = []
    for dotted, directory in _disk_packages().items():
        prefix = "/".join(dotted.split("."))
        missing += [
            f"{prefix}/{f.name}"
            for f in sorted(directory.iterdir())
            if f.is_file() and f.name.endswith(SHIPPED_SUFFIXES) and f"{prefix}/{f.name}" not in names
        ]
    assert not missing, f"wheel lacks {missing}: add the subpackage to `packages` in pyproject.toml"

    generated = {n for n in names if n.startswith("kvgrid/api/v1/")}
    for proto in sorted((ROOT / "proto/kvgrid/v1").glob("*.proto")):
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert f"kvgrid/api/v1/{proto.stem}{suffix}" in generated

    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert re.search(r"^\[console_scripts\]\s*\nkvgrid = kvgrid\.cli:main$", text, re.M), text


def _listed(help_text: str) -> set[str]:
    """Subcommand names from argparse help: the indented `name  help` lines under the metavar."""
    return set(re.findall(r"^ {4}(\S+)(?: {2,}|\n| *$)", help_text, re.M))


@pytest.mark.parametrize(
    ("name", "entry"),
    sorted({**cli.COMMANDS, **{f"bench {k}": v for k, v in cli.BENCHMARKS.items()}}.items()),
)
def test_registered_command_modules_import(name: str, entry: tuple[str, str]) -> None:
    module, help_text = entry
    mod = importlib.import_module(module)
    assert callable(mod.run), f"{module} (kvgrid {name}) has no run(args)"
    parser = argparse.ArgumentParser(prog=f"kvgrid {name}")
    mod.add_arguments(parser)
    assert help_text.strip(), f"kvgrid {name} has no help text"


@pytest.mark.slow
def test_kvgrid_help_lists_exactly_the_registered_commands() -> None:
    kvgrid = _tool("kvgrid")
    top = _run([kvgrid, "--help"])
    assert top.returncode == 0, top.stderr
    assert _listed(top.stdout) == {*cli.COMMANDS, "bench"}
    bench = _run([kvgrid, "bench", "--help"])
    assert bench.returncode == 0, bench.stderr
    assert _listed(bench.stdout) == set(cli.BENCHMARKS)
