"""tests/run.sh (make test): the two halves split by the cluster fixture (and the long marker), and the
worse exit status wins."""
import inspect
import os
import subprocess

import tests.slurm.test_sbatch as sbatch_tests
from tests.conftest import PY, REPO
from tests.timeouts import limit


def collected(part: str, path: str, env: dict | None = None) -> set[str]:
    environ = {k: v for k, v in os.environ.items() if k != "TEST_WORKERS"}
    proc = subprocess.run([PY, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", path], cwd=REPO,
                          env=dict(environ, TEST_PART=part, **(env or {})), capture_output=True, text=True,
                          timeout=limit("run"))
    return {line.split("::")[1].split("[")[0] for line in proc.stdout.splitlines() if "::" in line}


def test_the_halves_split_by_the_cluster_fixture():
    path = "tests/slurm/test_sbatch.py"
    on_cluster = {name for name, fn in inspect.getmembers(sbatch_tests, inspect.isfunction)
                  if name.startswith("test_") and "slurm_cluster" in inspect.signature(fn).parameters}
    cluster, rest = collected("cluster", path), collected("rest", path)
    assert on_cluster and cluster == on_cluster
    assert rest and not rest & cluster


def test_the_worse_exit_status_wins_and_both_reports_are_shown(tmp_path):
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\nif [ "$TEST_PART" = cluster ]; then echo cluster-report; exit 1; fi\n'
                    'echo rest-report; exit 0\n')
    fake.chmod(0o755)
    proc = subprocess.run(["bash", str(REPO / "tests" / "run.sh"), str(fake), "-q"], capture_output=True, text=True,
                          timeout=limit("minute"))
    assert proc.returncode == 1
    assert proc.stdout.index("rest-report") < proc.stdout.index("cluster-report")
    fake.write_text("#!/bin/bash\nexit 5\n")                     # nothing collected in either half
    assert subprocess.run(["bash", str(REPO / "tests" / "run.sh"), str(fake)], timeout=limit("minute")).returncode == 5


def test_the_long_cpu_tests_run_in_the_cluster_half_only_beside_one_worker():
    """With the rest half in one process (TEST_WORKERS=1; unset outside tests/run.sh), the benchmarks' smoke tests and
    other long CPU work fill the cluster half, which mostly waits; with the rest in several workers they are the
    rest's."""
    path, headers = "tests/bench/test_bench_har.py", "tests/recipes/test_kernel_module.py"
    assert collected("cluster", path) and not collected("rest", path)
    assert collected("cluster", headers) == {"test_each_fragment_compiles_on_its_own"}
    assert "test_every_header_registers_its_own_functions_in_the_module" in collected("rest", headers)
    three = dict(TEST_WORKERS="3")
    assert not collected("cluster", path, three) and collected("rest", path, three)
    assert "test_each_fragment_compiles_on_its_own" in collected("rest", headers, three)


def test_the_rest_half_is_spread_over_workers_unless_told_otherwise(tmp_path):
    """The rest half in TEST_WORKERS pytest-xdist workers, the cluster half in TEST_CLUSTER_WORKERS, a file to a worker
    (a module's jobs fixture runs once); by default 3 and 2; 1: one process."""
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/bash\necho "$TEST_PART $*" >> {tmp_path}/args\n')
    fake.chmod(0o755)
    two, three = "-n 2 --dist loadfile ", "-n 3 --dist load "
    cases = (({}, two, three), (dict(TEST_WORKERS="1", TEST_CLUSTER_WORKERS="1"), "", ""),
             (dict(TEST_WORKERS="2"), two, "-n 2 --dist load "),
             (dict(TEST_CLUSTER_WORKERS="4"), "-n 4 --dist loadfile ", three))
    for given, cluster, rest in cases:
        (tmp_path / "args").unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("TEST_WORKERS", "TEST_CLUSTER_WORKERS")}
        subprocess.run(["bash", str(REPO / "tests" / "run.sh"), str(fake), "-q"], env=dict(env, **given),
                       timeout=limit("minute"))
        lines = sorted((tmp_path / "args").read_text().splitlines())
        assert lines == [f"cluster -m pytest {cluster}-q", f"rest -m pytest {rest}-q"], (given, lines)
