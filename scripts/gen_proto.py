"""Regenerate services/kvgrid/api/v1 from proto/kvgrid/v1 (python, grpc and mypy stubs).

protoc emits modules named ``kvgrid.v1.*``; the package lives at ``kvgrid.api.v1``, so imports are
rewritten after generation. ``--check`` regenerates into a temporary folder and fails on any difference.
"""

from __future__ import annotations

import argparse
import filecmp
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "services" / "kvgrid" / "api" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi")


def generate(dest: Path) -> None:
    bindir = Path(sys.executable).parent
    protos = sorted(str(p.relative_to(PROTO_DIR)) for p in (PROTO_DIR / "kvgrid" / "v1").glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            f"--mypy_out={tmp}",
            f"--mypy_grpc_out={tmp}",
            f"--plugin=protoc-gen-mypy={bindir / 'protoc-gen-mypy'}",
            f"--plugin=protoc-gen-mypy_grpc={bindir / 'protoc-gen-mypy_grpc'}",
            *protos,
        ]
        subprocess.run(cmd, check=True)
        dest.mkdir(parents=True, exist_ok=True)
        for src in sorted((Path(tmp) / "kvgrid" / "v1").iterdir()):
            text = src.read_text().replace("from kvgrid.v1 import", "from kvgrid.api.v1 import")
            text = text.replace("import kvgrid.v1.", "import kvgrid.api.v1.").replace(
                "kvgrid.v1.common_pb2", "kvgrid.api.v1.common_pb2"
            )
            (dest / src.name).write_text(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if the committed code differs")
    args = parser.parse_args()
    if not args.check:
        for old in OUT_DIR.iterdir():
            if old.name.endswith(GENERATED_SUFFIXES):
                old.unlink()
        generate(OUT_DIR)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        fresh = sorted(p.name for p in Path(tmp).iterdir())
        committed = sorted(p.name for p in OUT_DIR.iterdir() if p.name.endswith(GENERATED_SUFFIXES))
        stale = [n for n in fresh if n not in committed or not filecmp.cmp(Path(tmp) / n, OUT_DIR / n, False)]
        stale += [n for n in committed if n not in fresh]
        if stale:
            print("generated code is stale, run `python scripts/gen_proto.py`: " + ", ".join(stale))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
