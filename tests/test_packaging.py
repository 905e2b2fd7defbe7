"""What `pip install .` puts on a machine: one import package, `tracejoin`, holding every module
and the BPF sources, next to anything else in the environment; and runtime dependencies that
are exactly what the code imports.

The wheel is built from a copy of the tree with the venv's setuptools (--no-build-isolation) and
installed with --no-deps --no-index: nothing is downloaded.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from collections.abc import Iterator
from importlib.metadata import distribution, packages_distributions, version
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SETUPTOOLS = PROJECT["tool"]["setuptools"]
PACKAGE_DIRS: dict[str, str] = SETUPTOOLS["package-dir"]  # tracejoin -> agent, ...

# Imported, but not from PyPI: BCC's binding is Debian's python3-bpfcc (the PyPI `bcc` is an
# unrelated project), linked into the venv by scripts/setup.sh.
NOT_FROM_PYPI = {"bcc"}
# Declared before the code that uses them lands (issue 12, item 10: psutil for process facts,
# the OpenTelemetry SDK for resource detection and the OTLP exporter for transport;
# prometheus-client for /metrics). The test fails once one is imported: then delete it here.
AHEAD_OF_USE: set[str] = set()


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_dependencies() -> set[str]:
    names = set()
    for requirement in PROJECT["project"]["dependencies"]:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert match, requirement
        names.add(canonical(match.group()))
    return names


def imported_modules() -> dict[str, set[str]]:
    """Absolute imports of the shipped code (agent/, exporters/), outside the stdlib and
    tracejoin itself: dotted module name -> files importing it."""
    found: dict[str, set[str]] = {}
    for folder in PACKAGE_DIRS.values():
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.partition(".")[0]
                    if top not in sys.stdlib_module_names and top != "tracejoin":
                        found.setdefault(module, set()).add(str(path.relative_to(ROOT)))
    return found


def providers(module: str) -> set[str]:
    """The installed distributions that ship `module`. A namespace package (google,
    opentelemetry) is shared by several: keep those that ship this module's own path."""
    candidates = packages_distributions().get(module.partition(".")[0], [])
    if len(candidates) <= 1:
        return {canonical(d) for d in candidates}
    path = module.replace(".", "/")
    owners = set()
    for name in candidates:
        files = distribution(name).files or []
        if any(str(f).startswith(path + "/") or str(f) == path + ".py" for f in files):
            owners.add(canonical(name))
    return owners


def test_runtime_dependencies_are_what_the_code_imports() -> None:
    declared = declared_dependencies()
    used: set[str] = set()
    problems = []
    for module, files in sorted(imported_modules().items()):
        if module.partition(".")[0] in NOT_FROM_PYPI:
            continue
        owners = providers(module)
        if not owners:
            problems.append(f"{module} (imported by {sorted(files)}): no installed distribution")
        elif not owners & declared:
            problems.append(f"{module} (imported by {sorted(files)}) comes from {sorted(owners)}, "
                            "which pyproject.toml does not declare")  # fmt: skip
        used |= owners & declared
    for name in sorted(declared - used - AHEAD_OF_USE):
        problems.append(f"{name} is declared but nothing in agent/ or exporters/ imports it")
    for name in sorted(AHEAD_OF_USE & used):
        problems.append(f"{name} is imported now: remove it from AHEAD_OF_USE")
    for name in sorted(AHEAD_OF_USE - declared):
        problems.append(f"{name} is no longer declared: remove it from AHEAD_OF_USE")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------------------- the wheel


def expected_wheel_files() -> set[str]:
    """Every module of every mapped folder, at its installed path, plus the package data."""
    out = set()
    for package, folder in PACKAGE_DIRS.items():
        prefix = package.replace(".", "/")
        patterns = ["*.py", *SETUPTOOLS.get("package-data", {}).get(package, [])]
        for pattern in patterns:
            # modules in sub-folders too; package data only beside the package's __init__
            paths = (
                (ROOT / folder).rglob(pattern)
                if pattern == "*.py"
                else (ROOT / folder).glob(pattern)
            )
            out.update(f"{prefix}/{p.relative_to(ROOT / folder)}" for p in paths)
    # the compiled extensions, built for this interpreter (their C sources do not ship)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    out.update(ext["name"].replace(".", "/") + suffix for ext in SETUPTOOLS.get("ext-modules", []))
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tracejoin's wheel, built from a copy of the tree (a build writes build/ and egg-info)."""
    build_requires = PROJECT["build-system"]["requires"]
    have = version("setuptools")
    if build_requires != ["setuptools>=77"] or int(have.split(".")[0]) < 77:
        pytest.fail(f"the build needs {build_requires}; this venv has setuptools {have}: "
                    'pip install -e ".[dev]" (the dev extras pin it)')  # fmt: skip
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in PACKAGE_DIRS.values():
        shutil.copytree(
            ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.so")
        )
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    subprocess.run(
        [*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp), str(src)],
        check=True,
    )
    (built,) = tmp.glob("tracejoin-*.whl")
    return built


def test_the_wheel_installs_only_the_tracejoin_package(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (dist_info,) = {n.split("/")[0] for n in names if ".dist-info/" in n}
        top_level = zf.read(f"{dist_info}/top_level.txt").decode().split()
    assert top_level == ["tracejoin"]
    # nothing else at the top (no agent/, exporters/, bpf/), and no module left out: every
    # sub-package must be listed in [tool.setuptools] packages to ship
    shipped = {n for n in names if not n.startswith(dist_info + "/")}
    assert shipped == expected_wheel_files()
    assert {"tracejoin/bpf/http.c", "tracejoin/bpf/http_record.h"} <= shipped
    assert any(n.startswith("tracejoin/pipeline/_span_bytes.") for n in shipped)
    assert any(n.startswith("tracejoin/kernel/_ring_read.") for n in shipped)
    assert any(n.startswith("tracejoin/enrich/_trace_context.") for n in shipped)
    assert any(n.startswith("tracejoin/exporters/_request_bytes.") for n in shipped)


# ------------------------------------------------------------ beside unrelated agent/exporters


def dummy_wheel(dest: Path, name: str) -> Path:
    """A minimal wheel of distribution `name` holding the import package `name`."""
    files = {
        f"{name}/__init__.py": f'WHO = "the unrelated {name}"\n',
        f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{name}-1.0.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{name}-1.0.dist-info/top_level.txt": f"{name}\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    record.append(f"{name}-1.0.dist-info/RECORD,,")
    files[f"{name}-1.0.dist-info/RECORD"] = "\n".join(record) + "\n"
    out = dest / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(out, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return out


@pytest.fixture
def venv(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A fresh venv whose own site-packages is empty. It sees this venv's packages (click,
    PyYAML, grpcio...) through a path in a .pth file, which adds the folder but does not run
    the .pth files in it: the editable tracejoin here stays invisible there."""
    env = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = Path(
        subprocess.run(
            [env / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    (site / "deps-from-test-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    yield env, site


def test_installs_beside_unrelated_agent_and_exporters(
    wheel: Path, venv: tuple[Path, Path], tmp_path: Path
) -> None:
    env, site = venv
    python = str(env / "bin/python")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", python]
    install = [*pip, "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*install, *(str(dummy_wheel(tmp_path, n)) for n in ("agent", "exporters"))],
                   check=True)  # fmt: skip
    subprocess.run([*install, str(wheel)], check=True)

    check = """
import agent, exporters, tracejoin, tracejoin.commands.cli, tracejoin.exporters.base
from importlib.resources import files
assert agent.WHO == "the unrelated agent", agent.__file__
assert exporters.WHO == "the unrelated exporters", exporters.__file__
assert tracejoin.exporters.base.__file__.endswith("site-packages/tracejoin/exporters/base.py")
assert tracejoin.__file__ == %r, tracejoin.__file__
assert files("tracejoin.bpf").joinpath("http.c").is_file()
""" % str(site / "tracejoin/__init__.py")  # noqa: UP031
    subprocess.run([python, "-c", check], check=True, cwd=tmp_path)  # not the repo: it has agent/
    helped = subprocess.run(
        [env / "bin/tracejoin", "--help"], check=True, capture_output=True, text=True
    )
    assert "tracejoin capture" in helped.stdout

    # and uninstalling tracejoin takes nothing of theirs
    subprocess.run([*pip, "uninstall", "-q", "-y", "tracejoin"], check=True)
    assert not (site / "tracejoin").exists()
    assert (site / "agent/__init__.py").is_file() and (site / "exporters/__init__.py").is_file()
    still = "import agent, exporters; assert agent.WHO and exporters.WHO"
    subprocess.run([python, "-c", still], check=True, cwd=tmp_path)
