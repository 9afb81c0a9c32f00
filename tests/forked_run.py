"""`python -m xla_train ARGV` in a process forked from one that has already imported the libraries.

A run that needs a fresh process (conftest.needs_fresh_process: XLA's runtime and counters, workers,
a process group) spent about 7 s of CPU importing torch, torch_xla and transformers before doing
anything: with a hundred and more such runs, a third of `make test`. Here multiprocessing's
forkserver imports them once (`set_forkserver_preload`) and forks a process per run, which sets the
run's environment and working folder, then runs the package's `__main__` as `python -m` does
(runpy), Python's exit steps included (non-daemon threads joined, atexit handlers such as
torch_xla's `_prepare_to_exit`). The package itself is imported in the forked process, from the
checkout on sys.path, never in the server.

What a library reads once at import cannot differ between the server and a run, so a run whose
environment differs from the session's in any other variable than those of FORK_SAFE gets a real
`subprocess.run` (conftest.cli decides). XLA's runtime is started in the forked process only (the
server never touches a device): its flags (XLA_FLAGS), device count (CPU_NUM_DEVICES) and SPMD mode
are read there, when the runtime starts. torch_xla's import also sets XLA_FLAGS' defaults
(torch_xla/__init__.py: `_setup_default_env`, `_setup_xla_flags`, called before _XLAC loads); the
forked process calls both again after setting the run's environment, as a fresh import would.

Only the standard library is imported at this module's top: the server unpickles `_run` by
importing this module before any run's environment is set.
"""

import os
import subprocess

# Variables read when used (at a run's start or later), never at the preloaded libraries' import;
# those the imports themselves set, the same in whichever process imports them (torch_xla: the first
# four, inductor: its cache folder); pytest's own PYTEST_CURRENT_TEST. The rest are set in pytest's
# own process by what its in-process tests run, and read only when used, never at an import this
# server preloads (a fresh interpreter would be handed the same values): torch_xla's jax import
# (torch_xla/_internal/jax_workarounds.py: SKIP_MEGASCALE_PJRT_CLIENT), jax/_src/cloud_tpu_init.py
# (TPU_SKIP_MDS_QUERY; ENABLE_RUNTIME_UPTIME_TELEMETRY, libtpu's), scikit-learn's import
# (KMP_DUPLICATE_LIB_OK, for Intel's OpenMP, which torch's CPU build does not load), XLA's runtime
# started in process (torch_xla/_internal/pjrt.py initialize_singleprocess: PJRT_LOCAL_PROCESS_COUNT,
# read by torch_xla.runtime when a run asks) and inductor's compiled modules
# (torch/_inductor/codecache.py: _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR). Outside this set, one
# changed variable sends every later run of the process to a new interpreter (conftest warns).
FORK_SAFE = {"PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS", "XLA_USE_SPMD", "TOKENIZERS_PARALLELISM",
             "MLFLOW_TRACKING_URI", "STORAGE_EMULATOR_HOST", "XLA_TRAIN_TEST_CPU_LOG",
             "TF_CPP_MIN_LOG_LEVEL", "GRPC_VERBOSITY", "PJRT_DYNAMIC_PLUGINS", "TORCHINDUCTOR_CACHE_DIR",
             "PYTEST_CURRENT_TEST", "SKIP_MEGASCALE_PJRT_CLIENT", "TPU_SKIP_MDS_QUERY", "KMP_DUPLICATE_LIB_OK",
             "ENABLE_RUNTIME_UPTIME_TELEMETRY", "PJRT_LOCAL_PROCESS_COUNT", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"}
# What every run imports before its first step (about 7 s of CPU together)
PRELOAD = ["torch", "torch_xla", "torch_xla.core.xla_model", "torch_xla.runtime", "torch_xla.distributed.spmd",
           "transformers", "transformers.modeling_utils", "transformers.models.bert.modeling_bert",
           "transformers.models.llama.modeling_llama", "datasets", "evaluate", "peft", "safetensors.torch"]

# A file a forked run appends its CPU seconds to, with its test's id: the pytest process's own clock
# does not see them (the forkserver waits for its forks, not pytest)
CPU_LOG = "XLA_TRAIN_TEST_CPU_LOG"
_context = []


def changed(env, session_env):
    """The variables whose values differ between `env` and `session_env`."""
    return {k for k in env.keys() | session_env.keys() if env.get(k) != session_env.get(k)}


def forkable(env, session_env):
    """Whether a run with environment `env` may be forked from a server started in `session_env`."""
    return changed(env, session_env) <= FORK_SAFE


def start(session_env):
    """Starts the forkserver (once per process) with the session's environment, the libraries
    imported in it."""
    import multiprocessing
    from multiprocessing import forkserver

    if _context:
        return _context[0]
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(session_env)  # the server inherits this process's environment when it starts
    try:
        forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    _context.append(context)
    return context


def _run(argv, env, cwd, out, err):
    """The forked process: the run's environment, folder and streams, then `python ARGV` (ARGV:
    `-m MODULE ...` or `-c CODE ...`) as a new interpreter would run it."""
    import atexit
    import runpy
    import sys
    import threading
    import traceback
    import types

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    if "torch_xla" in sys.modules:  # its import-time environment, for this run's variables
        import torch_xla

        torch_xla._setup_default_env()
        torch_xla._setup_xla_flags()
    sys.path.insert(0, cwd)  # what `python -m` and `python -c` put first
    code = 0
    try:
        if argv[0] == "-m":  # runpy puts the module's path first in sys.argv, as `python -m` does
            sys.argv = ["", *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:  # -c: the code as a fresh __main__ module's
            sys.argv = ["-c", *argv[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # what the interpreter does at exit: non-daemon threads, then atexit
    atexit._run_exitfuncs()
    if os.environ.get(CPU_LOG):  # this run's CPU (its waited-for children's too), by test
        import json

        times = os.times()
        with open(os.environ[CPU_LOG], "a") as log:
            log.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST"), "argv": argv[:2] if argv[0] == "-m"
                                  else argv[:1], "cpu": sum(times[:4]), "code": code}) + "\n")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Forked:
    """`python ARGV` (`-m MODULE ...` or `-c CODE ...`) forked from the server and not waited for:
    what tests use of subprocess.Popen (pid, poll, send_signal, kill, wait, communicate,
    returncode), with the output read from files once it ends."""

    def __init__(self, argv, env, cwd, session_env):
        import tempfile

        self.args = ["python", *argv]
        self._folder = tempfile.TemporaryDirectory(prefix="xla-train-forked-")
        self._out, self._err = (os.path.join(self._folder.name, name) for name in ("out", "err"))
        self._process = start(session_env).Process(target=_run, args=(argv, env, str(cwd), self._out, self._err))
        self._process.start()
        self.pid = self._process.pid
        self.returncode = None

    def poll(self):
        if self.returncode is None and not self._process.is_alive():
            self._process.join()
            self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout=None):
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self):
        self._process.kill()

    def communicate(self, timeout=None):
        self.wait(timeout)
        out, err = (open(path, encoding="utf-8", errors="replace").read() if os.path.exists(path) else ""
                    for path in (self._out, self._err))
        self._folder.cleanup()
        return out, err


def run(argv, env, cwd, timeout, session_env):
    """`python ARGV` forked from the server: a CompletedProcess as subprocess.run's (a run killed
    by a signal: minus its number), TimeoutExpired after `timeout` seconds."""
    process = Forked(argv, env, cwd, session_env)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, *process.communicate())
