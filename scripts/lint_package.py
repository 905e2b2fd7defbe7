"""Type-check tracejoin and check its import contracts ([tool.importlinter] in pyproject.toml)
over the package as the wheel lays it out.

mypy and import-linter both find a package on disk, not through import hooks. The editable
install maps tracejoin to agent/ with an import hook, and tracejoin.exporters and tracejoin.bpf
to folders beside agent/: mypy cannot see tracejoin at all (every `from tracejoin...` import
would be Any) and import-linter would walk agent/ only, never exporters/. The view built here
puts every folder from [tool.setuptools.package-dir] where the wheel installs it, as symlinks
to the real files; mypy's messages are mapped back to those files.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = project["tool"]["setuptools"]["package-dir"]
    return mapping


def build_view(dest: Path) -> None:
    for package, folder in package_dirs().items():
        target = dest.joinpath(*package.split("."))
        for src in (ROOT / folder).rglob("*.py"):
            link = target / src.relative_to(ROOT / folder)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(src)


def mypy(view: Path) -> int:
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "-p", "tracejoin"],
        cwd=ROOT,
        env={**os.environ, "MYPYPATH": str(view)},
        capture_output=True,
        text=True,
    )
    out = result.stdout + result.stderr
    # deepest package first, so tracejoin/exporters/x.py becomes exporters/x.py, not agent/...
    for package, folder in sorted(package_dirs().items(), key=lambda kv: -kv[0].count(".")):
        out = out.replace(f"{view}/{package.replace('.', '/')}/", f"{folder}/")
    print(out, end="")
    return result.returncode


def import_contracts(view: Path) -> int:
    # Ahead of site-packages, and of the editable install's finder (last on sys.meta_path).
    sys.path.insert(0, str(view))
    spec = importlib.util.find_spec("tracejoin")
    if spec is None or not spec.origin or not spec.origin.startswith(str(view)):
        print(f"lint: tracejoin resolves to {spec and spec.origin}, not the view", file=sys.stderr)
        return 1
    return lint_imports(no_cache=True, no_logo=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="tracejoin-lint-") as tmp:
        build_view(Path(tmp))
        failed = [
            name
            for name, check in (("mypy", mypy), ("imports", import_contracts))
            if check(Path(tmp)) != 0
        ]
    if failed:
        print(f"lint: {' and '.join(failed)} failed", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
