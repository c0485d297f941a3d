"""The built wheel stands alone: it holds every module of every package, installs into a clean
virtual environment with its runtime dependencies only (no dev extras), and there
`autopart --version` works and a compiled pipeline trains like the unpartitioned model.

Builds with ``pip wheel . --no-deps`` from a copy of the package sources, creates a venv in a
temporary directory, installs the Makefile's ``TORCH_SPEC`` (the CPU build, from the pip
cache or the machine's wheel directory) and then the wheel. About a minute on a 2-core CPU,
most of it installing torch. Skipped, with the reason, when pip cannot reach an index or
cache that has torch or the build requirements.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from autopart.core.version import __version__

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it installs as (pyproject.toml's package-dir mapping)
PACKAGE_DIRS = {"autopart": "autopart", "profiler": "autopart/profiler",
                "solver": "autopart/solver", "codegen": "autopart/codegen"}
DEV_ONLY = ("pytest", "transformers", "hypothesis", "ruff", "mypy", "matplotlib")
_NETWORK = re.compile(r"No matching distribution found|Could not find a version that satisfies|"
                      r"NewConnectionError|Max retries exceeded|Temporary failure in name "
                      r"resolution|Network is unreachable|ConnectTimeout|ReadTimeout|"
                      r"Could not fetch URL|ProxyError|Name or service not known")


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    workdir: Path  # outside the repository, so only the installed package can be imported

    def python(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return _run([str(self.venv / "bin" / "python"), *args], cwd=self.workdir,
                    timeout=timeout)


def _run(cmd: list[str], *, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _torch_spec() -> str:
    match = re.search(r"^TORCH_SPEC \?= *(\S+)", (ROOT / "Makefile").read_text(), re.M)
    assert match, "Makefile has no `TORCH_SPEC ?= ...` line"
    return match.group(1)


def _pip(venv_python: Path | str, args: list[str], cwd: Path, what: str,
         *, skip_any_failure: bool = False) -> None:
    res = _run([str(venv_python), "-m", "pip", *args], cwd=cwd, timeout=540)
    if res.returncode == 0:
        return
    tail = " ".join((res.stdout + res.stderr).split())[-600:]
    if skip_any_failure or _NETWORK.search(res.stdout + res.stderr):
        pytest.skip(f"{what}: pip could not get the packages from its index or cache ({tail})")
    raise AssertionError(f"{what} failed (exit {res.returncode}): {tail}")


# one xdist worker builds and installs the wheel for every test here (``make test`` runs
# ``--dist loadgroup``): two workers built it twice, 31 s each
pytestmark = pytest.mark.xdist_group("wheel")


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    tmp = Path(tempfile.mkdtemp(prefix="autopart-wheel-"))
    try:
        yield _build_and_install(tmp)
    finally:
        # the venv is ~1 GB in ~20k files; removing it takes a minute on a busy disk, so a
        # detached `rm -rf` does it while the rest of the suite runs
        subprocess.Popen(["rm", "-rf", str(tmp)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)


def _build_and_install(tmp: Path) -> Installed:
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for folder in PACKAGE_DIRS:
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    _pip(sys.executable, ["wheel", str(src), "--no-deps", "-q", "-w", str(tmp / "dist")],
         tmp, "building the wheel")
    wheels = list((tmp / "dist").glob("autopart-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    res = _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp)
    assert res.returncode == 0, res.stderr
    py = venv / "bin" / "python"
    _pip(py, ["install", "-q", "--no-compile", _torch_spec()], tmp,
         f"installing {_torch_spec()}", skip_any_failure=True)
    _pip(py, ["install", "-q", "--no-compile", str(wheels[0])], tmp,
         "installing the wheel with its dependencies")
    work = tmp / "work"
    work.mkdir()
    return Installed(wheels[0], venv, work)


def test_wheel_holds_every_module(installed: Installed) -> None:
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    expected = set()
    for folder, package in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                expected.add(f"{package}/{path.relative_to(ROOT / folder).as_posix()}")
    assert expected, "no package sources found"
    missing = sorted(expected - names)
    assert not missing, f"the wheel lacks {missing}; list them in pyproject.toml"
    assert not any(n.startswith(("tests/", "benchmarks/", "profiler/", "solver/", "codegen/"))
                   for n in names), sorted(names)
    info = f"autopart-{__version__}.dist-info"
    entry_points = zipfile.ZipFile(installed.wheel).read(f"{info}/entry_points.txt").decode()
    assert "autopart = autopart.apps.cli:main" in entry_points
    metadata = zipfile.ZipFile(installed.wheel).read(f"{info}/METADATA").decode()
    assert re.search(rf"^Version: {re.escape(__version__)}$", metadata, re.M)


def test_installs_without_dev_extras(installed: Installed) -> None:
    res = installed.python("-m", "pip", "list", "--format=freeze")
    assert res.returncode == 0, res.stderr
    present = {line.split("==")[0].lower() for line in res.stdout.split()}
    assert {"torch", "ortools", "networkx", "numpy", "rich", "typer", "safetensors"} <= present
    assert not present & set(DEV_ONLY), present & set(DEV_ONLY)
    res = installed.python("-c", "import autopart, autopart.solver, autopart.profiler, "
                           "autopart.codegen, autopart.runtime, autopart.apps.cli; "
                           "print(autopart.__version__, autopart.__file__)")
    assert res.returncode == 0, res.stderr
    version, path = res.stdout.split()
    assert version == __version__
    assert str(installed.venv) in path  # the installed copy, not this checkout


def test_cli_works_without_the_extras(installed: Installed) -> None:
    cli = str(installed.venv / "bin" / "autopart")
    res = _run([cli, "--version"], cwd=installed.workdir)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"autopart {__version__} (python ")
    assert "transformers not installed" in res.stdout
    res = _run([cli, "devices", "NVIDIA H100 80GB HBM3", "--json"], cwd=installed.workdir)
    assert res.returncode == 0, res.stderr
    assert '"name": "h100-sxm"' in res.stdout
    res = _run([cli, "profile", "hf:GPT2LMHeadModel", "--device", "h100"], cwd=installed.workdir)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "pip install 'autopart[hf]'" in res.stderr, res.stderr


_NUMERICS = textwrap.dedent("""
    import copy, torch, autopart
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(32, 32),
                                                              torch.nn.GELU())],
                                torch.nn.Linear(32, 8))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 32), torch.randn(8, 8)
    loss_fn = torch.nn.functional.mse_loss
    pipe = autopart.compile(model, (x,), loss_fn=loss_fn, num_stages=2, num_microbatches=4,
                            time_limit_s=5)
    assert pipe.plan.num_stages == 2, pipe.plan.num_stages
    loss = pipe.train_step(x, target=y)
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=4e-5)
    grads = dict(pipe.named_parameters())
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=4e-5)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=1e-5, atol=4e-5)
    written = pipe.save_plan("out/mlp.plan.json")
    print("ok", len(written), f"{loss.item():.6f}", f"{ref_loss.item():.6f}")
""")


def test_compiled_pipeline_matches_the_plain_model(installed: Installed) -> None:
    res = installed.python("-c", _NUMERICS, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    ok, files, loss, ref_loss = res.stdout.split()[-4:]
    assert ok == "ok" and int(files) == 3  # the plan and two stage sources
    assert abs(float(loss) - float(ref_loss)) < 1e-5
    assert (installed.workdir / "out" / "mlp.plan.json").is_file()
