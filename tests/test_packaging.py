"""Contract and packaging: generated protobuf code is fresh, buf lint is clean, each distribution's
wheel holds every subpackage found under its one source root, static tools follow the installed
packages, and ``kvgrid --help`` lists exactly the registered commands that import."""

from __future__ import annotations

import argparse
import ast
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
# Each distribution: its project folder, its one source root and the import package under it.
DISTRIBUTIONS = {
    "kvgrid": (ROOT, ROOT / "services" / "kvgrid"),
    "kvgrid_kernels": (ROOT / "kernels", ROOT / "kernels" / "kvgrid_kernels"),
}
# Files a subpackage needs at run time besides .py: stubs, markers and kernel sources compiled on load.
SHIPPED_SUFFIXES = (".py", ".pyi", ".typed", ".cu", ".cuh", ".cpp", ".h")


def _tool(name: str) -> str:
    found = shutil.which(name) or (str(BIN / name) if (BIN / name).exists() else None)
    if found is None:
        pytest.fail(f"{name} not found on PATH or next to {sys.executable}; run `make install`")
    return found


def _run(cmd: list[str], cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def _disk_packages(top: str) -> dict[str, Path]:
    """Every directory with an __init__.py under a distribution's import package, as dotted names."""
    found: dict[str, Path] = {}
    root = DISTRIBUTIONS[top][1]
    for init in sorted(root.rglob("__init__.py")):
        rel = init.parent.relative_to(root)
        if "__pycache__" not in rel.parts:
            found[".".join((top, *rel.parts))] = init.parent
    return found


def test_disk_packages_include_the_known_layout() -> None:
    # Guards the discovery itself: if it found nothing, the wheel test below would pass vacuously.
    expected = {
        "kvgrid.common",
        "kvgrid.agent",
        "kvgrid.engine",
        "kvgrid.controller",
        "kvgrid.connector",
        "kvgrid.api.v1",
    }
    assert {"kvgrid"} | expected <= set(_disk_packages("kvgrid"))
    assert set(_disk_packages("kvgrid_kernels")) == {"kvgrid_kernels", "kvgrid_kernels.bench"}


def _imported_modules(path: Path, package: str) -> set[str]:
    """Dotted names a source file imports, relative imports resolved against ``package``."""
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            found.update(f"{base}.{alias.name}" for alias in node.names)
            found.add(base)
    return found


@pytest.mark.parametrize("top", sorted(DISTRIBUTIONS))
def test_runtime_never_imports_the_benches(top: str) -> None:
    # Benchmarks, demos and harnesses live in `<top>.bench`; only the CLI names them (by string,
    # imported when the command runs), so the runtime's import graph holds none of them.
    root = DISTRIBUTIONS[top][1]
    bench = f"{top}.bench"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] == "bench" or "__pycache__" in rel.parts:
            continue
        package = ".".join((top, *rel.parts[:-1]))
        hits = [m for m in _imported_modules(path, package) if m == bench or m.startswith(f"{bench}.")]
        offenders += [f"{rel}: {m}" for m in sorted(hits)]
    assert not offenders, offenders


@pytest.mark.parametrize("top", sorted(DISTRIBUTIONS))
def test_installed_packages_are_the_source_tree(top: str) -> None:
    # Editable installs must be plain paths: the module imported is the file in the checkout, which
    # is what lets IDEs, mypy and ruff follow it without an import hook.
    mod = importlib.import_module(top)
    assert mod.__file__ is not None
    assert Path(mod.__file__).resolve() == DISTRIBUTIONS[top][1] / "__init__.py"


@pytest.mark.slow
def test_mypy_sees_a_type_error_through_the_installed_package(tmp_path: Path) -> None:
    # Run from outside the checkout with no config: mypy must resolve kvgrid from the environment.
    # The control is the same file without the error, which must pass.
    code = "from kvgrid.common.groups import EngineGroupInfo\n\nx: {} = EngineGroupInfo(engine_group_id=0)\n"
    results = {}
    for name, annotation in (("bad", "int"), ("good", "EngineGroupInfo")):
        f = tmp_path / f"{name}.py"
        f.write_text(code.format(annotation))
        results[name] = _run([_tool("mypy"), "--no-incremental", str(f)], cwd=tmp_path, timeout=300)
    assert results["good"].returncode == 0, results["good"].stdout
    assert results["bad"].returncode == 1, results["bad"].stdout
    assert 'incompatible type "EngineGroupInfo"' in results["bad"].stdout.lower() or (
        "Incompatible types in assignment" in results["bad"].stdout
    ), results["bad"].stdout


def test_generated_proto_code_is_fresh() -> None:
    result = _run([sys.executable, "scripts/gen_proto.py", "--check"])
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_proto_check_detects_stale_code(tmp_path: Path) -> None:
    # The check must be able to fail: run it on a copy whose generated module was edited.
    for part in ("scripts", "proto", "services/kvgrid/api/v1"):
        shutil.copytree(ROOT / part, tmp_path / part, ignore=shutil.ignore_patterns("__pycache__"))
    stale = tmp_path / "services/kvgrid/api/v1/common_pb2.py"
    stale.write_text(stale.read_text() + "\n# edited by hand\n")
    result = _run([sys.executable, "scripts/gen_proto.py", "--check"], cwd=tmp_path)
    assert result.returncode == 1
    assert "common_pb2.py" in result.stdout


def test_buf_lint_is_clean() -> None:
    result = _run([_tool("buf"), "lint"])
    assert result.returncode == 0, result.stdout + result.stderr


def _build_wheel(top: str, tmp_path: Path) -> zipfile.ZipFile:
    # Build from a copy so the repo gets no build/ or egg-info churn while other tests run.
    project = DISTRIBUTIONS[top][0]
    src = tmp_path / "src" / top
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build", ".*")
    shutil.copytree(DISTRIBUTIONS[top][1], src / DISTRIBUTIONS[top][1].relative_to(project), ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (project / name).exists():
            shutil.copy2(project / name, src / name)
    dist = tmp_path / "dist" / top
    # -x: the build requirements are installed in this venv (setuptools ships bdist_wheel itself).
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-x", "--outdir", str(dist), str(src)]
    result = _run(cmd, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    return zipfile.ZipFile(wheel)


@pytest.mark.slow
@pytest.mark.parametrize("top", sorted(DISTRIBUTIONS))
def test_wheel_contains_every_subpackage(top: str, tmp_path: Path) -> None:
    wheel = _build_wheel(top, tmp_path)
    names = set(wheel.namelist())
    missing = []
    for dotted, directory in _disk_packages(top).items():
        prefix = "/".join(dotted.split("."))
        missing += [
            f"{prefix}/{f.name}"
            for f in sorted(directory.iterdir())
            if f.is_file() and f.name.endswith(SHIPPED_SUFFIXES) and f"{prefix}/{f.name}" not in names
        ]
    assert not missing, f"wheel lacks {missing}"
    assert f"{top}/py.typed" in names
    (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
    requires = re.findall(r"^Requires-Dist: (.+)$", wheel.read(metadata).decode(), re.M)
    if top == "kvgrid_kernels":
        assert any(r.startswith("torch") for r in requires), requires
        return

    # The controller installs without torch: torch and the kernels come only with the agent extra.
    base = [r for r in requires if "extra ==" not in r]
    assert not [r for r in base if r.startswith(("torch", "kvgrid-kernels"))], base
    agent_extra = {
        r.split(";")[0].split(">")[0].split("=")[0].strip() for r in requires if 'extra == "agent"' in r
    }
    assert {"torch", "kvgrid-kernels"} <= agent_extra, requires

    generated = {n for n in names if n.startswith("kvgrid/api/v1/")}
    for proto in sorted((ROOT / "proto/kvgrid/v1").glob("*.proto")):
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"):
            assert f"kvgrid/api/v1/{proto.stem}{suffix}" in generated

    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = wheel.read(entry_points).decode()
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
