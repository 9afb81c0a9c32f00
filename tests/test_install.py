"""The package the way users install it: the wheel `make dist` builds, installed (not editable)
into a fresh virtual environment, used from a folder outside the checkout.

The fresh environments reuse the dependencies already installed in the test's own environment
(.venv) through a .pth file that lists its site-packages: Python adds that folder to sys.path
but does not run the .pth files inside it, so the editable install's finder, which maps
`xla_train` to the checkout, never loads. The wheel is installed with `--no-deps`, the
dependencies being there already. Commands run with cwd outside the checkout, no PYTHONPATH,
and the environment's bin/ first on PATH, as after `source venv/bin/activate`.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import nbformat
import pytest
from conftest import ROOT

# installs that reuse the dependencies and never reach an index (see the module's docstring);
# PIP_NO_BUILD_ISOLATION=0 is pip's spelling of --no-build-isolation (a git+URL builds with
# this environment's setuptools and wheel)
PIP_OFFLINE = {"PIP_NO_DEPS": "1", "PIP_NO_INDEX": "1", "PIP_IGNORE_INSTALLED": "1",
               "PIP_NO_BUILD_ISOLATION": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
SKIP_TOP = {".git", ".venv", "build", "dist", "runs", ".pytest_cache"}


def run(cmd, cwd, env, timeout=600):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(map(str, cmd))} -> {proc.returncode}\n" \
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def clean_copy(dest):
    """The working tree as a clone has it, with uncommitted work: no .venv, build/, dist/,
    egg-info or caches, whose stale files would otherwise get into the sdist or the wheel."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
        files = [f for f in out.split("\0") if f and (ROOT / f).is_file()]  # less files deleted, not yet staged
    except (OSError, subprocess.CalledProcessError):  # not a git checkout
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                 if p.is_file() and p.relative_to(ROOT).parts[0] not in SKIP_TOP
                 and "__pycache__" not in p.parts and not any(x.endswith(".egg-info") for x in p.parts)]
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    return dest


def user_env(venv, home, **extra):
    """The environment of a user who activated `venv`, and has a fresh Hugging Face cache."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV") and not k.startswith("GIT_")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               PJRT_DEVICE="CPU", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_HOME=str(home / "hf"),
               **extra)
    return env


def deps_dirs():
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def new_venv(path):
    """A virtual environment without xla_train that sees this environment's packages."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "_xla_train_deps.pth").write_text("\n".join(deps_dirs()) + "\n")
    return python


WHERE = """import importlib.metadata, json, os, sys
import gpu_fallback, xla_train
dist = importlib.metadata.distribution("xla-train")
print(json.dumps({"xla_train": xla_train.__file__, "gpu_fallback": gpu_fallback.__file__,
                  "sys_path": [os.path.realpath(p or ".") for p in sys.path],
                  "meta_path": [repr(f) for f in sys.meta_path], "dist": str(dist.locate_file("")),
                  "direct_url": json.loads(dist.read_text("direct_url.json") or "{}")}))
"""


def where(python, cwd, env):
    """Where `python` imports xla_train from, and what pip recorded about its install."""
    return json.loads(run([python, "-c", WHERE], cwd, env).stdout)


def assert_installed_in(info, venv):
    venv = venv.resolve()
    for key in ("xla_train", "gpu_fallback", "dist"):
        assert venv in Path(info[key]).resolve().parents, (key, info[key])
    assert "dir_info" not in info["direct_url"]  # an editable install records {"dir_info": {"editable": true}}
    deps = {Path(d).resolve() for d in deps_dirs()}
    for p in info["sys_path"]:  # nothing of the checkout but .venv's installed dependencies
        p = Path(p)
        assert p in deps or not (p == ROOT or ROOT in p.parents), p
    assert not any("editable" in f.lower() for f in info["meta_path"]), info["meta_path"]


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """sdist and wheel built from a clean copy of the tree the way `make dist` builds them."""
    tmp = tmp_path_factory.mktemp("dist")
    src = clean_copy(tmp / "src")
    run([sys.executable, "-m", "build", "--no-isolation", "--outdir", tmp / "dist", src], tmp, None)
    (wheel,), (sdist,) = (tmp / "dist").glob("*.whl"), (tmp / "dist").glob("*.tar.gz")
    print(f"\n{wheel.name}:")
    subprocess.run([sys.executable, "-m", "zipfile", "-l", str(wheel)], check=True)
    return src, wheel, sdist


@pytest.fixture(scope="session")
def installed(built, tmp_path_factory):
    """The wheel pip-installed into a fresh venv (with `pip install WHEEL[xla]`, as the README
    says, less the dependencies), and a working folder outside the checkout."""
    _, wheel, _ = built
    tmp = tmp_path_factory.mktemp("user")
    assert ROOT not in tmp.resolve().parents
    venv, work = tmp / "venv", tmp / "work"
    work.mkdir()
    python = new_venv(venv)
    env = user_env(venv, tmp)
    run([python, "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", f"{wheel}[xla]"], work,
        env)
    return venv, work, env


def test_wheel_carries_every_module_the_bundled_data_and_the_metric(built):
    src, wheel, sdist = built
    names = set(zipfile.ZipFile(wheel).namelist())
    package_files = {str(p.relative_to(src)) for top in ("xla_train", "gpu_fallback") for p in (src / top).rglob("*")
                     if p.is_file() and "__pycache__" not in p.parts}
    assert {"xla_train/data/mrpc/train.tsv", "xla_train/data/mrpc/dev.tsv", "xla_train/data/mrpc/test.tsv",
            "xla_train/tasks/task_metric/task_metric.py", "xla_train/commands/cli.py", "xla_train/core/roles.py",
            "gpu_fallback/strategies.py"} <= package_files
    assert {n for n in names if ".dist-info/" not in n} == package_files  # all of them, and nothing else
    info = wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info/"
    entry_points = zipfile.ZipFile(wheel).read(info + "entry_points.txt").decode()
    assert "xla-train = xla_train.commands.cli:main" in entry_points
    import tarfile

    with tarfile.open(sdist) as tar:
        in_sdist = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert package_files | {"setup.py", "README.md"} <= in_sdist


def test_every_extra_with_torch_xla_pins_the_torch_it_was_built_for(built):
    """torch_xla's wheel names no torch, so an extra that brings it must pin torch itself: without
    the pin pip took the newest torch that install_requires admits, and torch_xla failed to import
    (CI, 2026-11-25)."""
    _, wheel, _ = built
    name, version = wheel.name.split("-")[:2]
    meta = zipfile.ZipFile(wheel).read(f"{name}-{version}.dist-info/METADATA").decode()
    by_extra = {}
    for req, extra in re.findall(r'^Requires-Dist: (.+?); extra == "(.+?)"$', meta, re.M):
        by_extra.setdefault(extra, set()).add(req.replace(" ", "").replace("_", "-"))  # torch_xla -> torch-xla
    with_xla = {e: reqs for e, reqs in by_extra.items() if any(r.startswith("torch-xla") for r in reqs)}
    assert set(with_xla) == {"xla", "tpu", "dev"}
    for extra, reqs in with_xla.items():
        xla = next(r for r in reqs if r.startswith("torch-xla"))
        release = xla.split("==")[1]
        assert f"torch=={release}" in reqs, (extra, sorted(reqs))


def test_installed_copy_is_the_wheel_not_the_checkout(installed):
    venv, work, env = installed
    info = where(venv / "bin" / "python", work, env)
    assert_installed_in(info, venv)
    assert "archive_info" in info["direct_url"]  # pip installed it from the wheel file


def test_cli_help_and_env(installed):
    venv, work, env = installed
    exe = shutil.which("xla-train", path=env["PATH"])
    assert Path(exe).parent == venv / "bin"
    out = run(["xla-train", "--help"], work, env).stdout
    assert "{train,predict,report,env}" in out
    out = run(["xla-train", "env"], work, env).stdout
    print(out)
    assert "transformers" in out and "--backend auto ->" in out


def test_train_on_the_bundled_data(installed):
    venv, work, env = installed
    run(["xla-train", "train", "--backend", "cpu", "--max-steps", 2, "--metrics-out", "train.json"], work, env,
        timeout=900)
    m = json.loads((work / "train.json").read_text())
    assert m["backend"] == "cpu" and m["task"] == "mrpc" and m["steps"] == 2
    assert m["eval"]["n"] == 408  # every row of the bundled dev.tsv
    assert 0 <= m["eval"]["accuracy"] <= 1


def test_own_loop_script_runs_against_the_installed_package(installed):
    venv, work, env = installed
    script = shutil.copy(ROOT / "scripts" / "custom_loop_mrpc.py", work / "custom_loop_mrpc.py")
    run(["python", script, "--backend", "cpu", "--max-steps", 2, "--metrics-out", "loop.json"], work, env,
        timeout=900)
    result = json.loads((work / "loop.json").read_text())
    assert result["n"] == 408 and result["steps"] == 2
    assert 0 <= result["accuracy"] <= 1


def git_url_of_a_copy(src, dest):
    """git+file URL of a repository holding `src`: what a user's `git+https://...` points at."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    for cmd in (["init", "-q"], ["add", "-A"],
                ["-c", "user.name=test", "-c", "user.email=test@example.com", "-c", "commit.gpgsign=false",
                 "commit", "-q", "-m", "snapshot"]):
        run(["git", *cmd], dest, env)
    return f"git+file://localhost{dest}"  # pip's requirement syntax wants a host in the URL


@pytest.mark.parametrize("form", ["wheel", "git"])
def test_notebook_install_cell_installs_a_wheel_or_a_repository_url(form, built, tmp_path):
    """The Colab notebook's install cell, run in a fresh venv with PACKAGE naming the wheel or a
    git URL of the repository (the [tpu] extra's dependencies left out)."""
    src, wheel, _ = built
    package = str(wheel) if form == "wheel" else git_url_of_a_copy(src, tmp_path / "repo")
    nb = nbformat.read(ROOT / "notebooks" / "colab_tpu_mrpc.ipynb", as_version=4)
    (cell,) = [c for c in nb.cells if "install" in c.metadata.get("tags", [])]
    assert "PACKAGE" in next(c for c in nb.cells if "parameters" in c.metadata.get("tags", [])).source
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    python = new_venv(venv)
    env = user_env(venv, tmp_path, **PIP_OFFLINE)
    run([python, "-c", f"INSTALL = True\nPACKAGE = {package!r}\n{cell.source}"], work, env)
    info = where(python, work, env)
    assert_installed_in(info, venv)
    assert ("vcs_info" if form == "git" else "archive_info") in info["direct_url"], info["direct_url"]


def pod_commands(package, tmp_path):
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "tpu_pod.py", "--tpu", "pod-1", "--zone", "us-central2-b",
                           "--package", str(package), "--dry-run", "--run-id", "r1", "--launch-id", "l1", "--",
                           "--data-dir", "hub"],
                          cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()


def test_tpu_pod_copies_a_local_wheel_to_every_worker_then_installs_the_copy(built, tmp_path):
    _, wheel, _ = built
    scp, install, train = pod_commands(wheel, tmp_path)
    where_ = "--zone=us-central2-b --worker=all"
    assert scp == f"gcloud compute tpus tpu-vm scp {wheel} pod-1:{wheel.name} {where_}"
    ssh = f"gcloud compute tpus tpu-vm ssh pod-1 {where_} --command "
    assert install.startswith(ssh) and train.startswith(ssh)
    assert shlex.split(train)[-1] == ("PJRT_DEVICE=TPU XLA_TRAIN_RUN_ID=r1 XLA_TRAIN_LAUNCH_ID=l1 python3 -m xla_train "
                                      "train --data-dir hub")
    # play a worker: scp puts the wheel in the home folder, where ssh's command starts; run the
    # install twice, the second replacing the copy the first installed
    home, venv = tmp_path / "worker", tmp_path / "venv"
    home.mkdir()
    shutil.copy(wheel, home / shlex.split(scp)[-3].split(":", 1)[1])
    new_venv(venv)
    env = user_env(venv, tmp_path, **PIP_OFFLINE)
    command = shlex.split(install)[-1]
    assert command == f"python3 -m pip uninstall --yes xla-train; python3 -m pip install './{wheel.name}[tpu]'"
    run(["bash", "-c", command], home, env)
    second = run(["bash", "-c", command], home, env)
    assert "Successfully uninstalled xla-train" in second.stdout
    assert_installed_in(where(venv / "bin" / "python", tmp_path, env), venv)


def test_tpu_pod_installs_a_git_url_or_pypi_name_on_every_worker(tmp_path):
    ssh = "gcloud compute tpus tpu-vm ssh pod-1 --zone=us-central2-b --worker=all --command "
    url = "git+https://github.com/you/xla_train@v0.1.0"
    install, _ = pod_commands(url, tmp_path)
    assert install == ssh + shlex.quote("python3 -m pip uninstall --yes xla-train; python3 -m pip install "
                                        + shlex.quote(f"xla-train[tpu] @ {url}"))
    install, _ = pod_commands("xla-train", tmp_path)
    assert install == ssh + shlex.quote("python3 -m pip install --upgrade 'xla-train[tpu]'")
    proc = subprocess.run([sys.executable, ROOT / "scripts" / "tpu_pod.py", "--tpu", "pod-1", "--zone", "z",
                           "--package", "dist/missing.whl", "--dry-run"], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 2 and "no such wheel" in proc.stderr


def test_the_torch_cap_is_the_newest_torch_make_test_torch_runs():
    """setup.py lets the base install take torch up to the newest the tests ran on, the one
    `make test-torch` installs into .venv-torch (Makefile's NEWEST_TORCH), and no newer."""
    newest = re.search(r"^NEWEST_TORCH := (\d+)\.(\d+)\.\d+$", (ROOT / "Makefile").read_text(), re.MULTILINE)
    assert f'"torch>=2.9,<{newest[1]}.{int(newest[2]) + 1}",' in (ROOT / "setup.py").read_text()
