"""What the whole test suite shares: the repository root, the shipped tokenizer, free ports, the debug
configs (and the debug model's shape with any number of blocks), a trainer factory and a ``torchrun`` runner.

Fixtures serve the test functions. Code that runs where no fixture reaches (a function
spawned on ranks, a module-level helper) imports the same things by name:
``from conftest import REPO, DEBUG_CONFIG, debug_config, make_trainer, run_torchrun``,
and ``load_script`` imports a script of the repository as a module.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

from torchtitan.distributed.lifecycle import free_port as _free_port

if TYPE_CHECKING:
    from torchtitan.config import JobConfig
    from torchtitan.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
# The SentencePiece tokenizer that ships with the package (2048 words), absolute so that a
# test passes from any working directory.
SHIPPED_TOKENIZER = str(REPO / "torchtitan" / "datasets" / "assets" / "tokenizer.model")
# The debug model (CPU, seconds) and its CI sizes, the configs most tests train.
DEBUG_CONFIG = str(REPO / "train_configs" / "debug_model.toml")
CI_CONFIG = str(REPO / "train_configs" / "debug_model_ci.toml")
# Variables torchrun sets for its ranks: a launch from a process that has them would inherit them.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
# Every process a test starts (torchrun's ranks included) prints its Python stacks if it dies of a native crash
# (SIGSEGV, SIGABRT), instead of leaving only a signal number in torchrun's report.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


def debug_config(*overrides: str, config: str = DEBUG_CONFIG) -> JobConfig:
    """``config`` (the debug model's by default) parsed with ``overrides``, as ``train.py`` would."""
    from torchtitan.config import ConfigManager

    return ConfigManager().parse_args(["--job.config_file", config, *overrides])


def debug_release(folder: Path, n_layers: int) -> str:
    """A release folder (Meta's ``params.json``) of the debug model's shape with ``n_layers`` blocks, in ``folder``;
    ``--model.flavor`` takes it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "params.json").write_text(json.dumps({"dim": 256, "n_layers": n_layers, "n_heads": 16, "n_kv_heads": 8,
                                                    "vocab_size": 2048, "multiple_of": 256, "norm_eps": 1e-5,
                                                    "rope_theta": 500000.0}))
    return str(folder)


def make_trainer(dump: str | Path, *overrides: str, config: str = DEBUG_CONFIG) -> Trainer:
    """A ``Trainer`` of ``config`` writing under ``dump``: no printed arguments, no TensorBoard, then ``overrides``."""
    from torchtitan.trainer import Trainer

    return Trainer(debug_config(f"--job.dump_folder={dump}", "--job.print_args=false",
                                "--metrics.enable_tensorboard=false", *overrides, config=config))


def torchrun_command(script: str | Path, *args: str, nproc: int = 2, launch: Sequence[str] = ()) -> list[str]:
    """The command line of ``script`` under ``torchrun --standalone`` with ``nproc`` ranks (``launch``: more
    torchrun options)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *launch,
            str(script), *args]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This process' environment for a launch: the repository first on ``PYTHONPATH``, no torchrun variables."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), **extra}
    for var in _TORCHRUN_VARS:
        env.pop(var, None)
    return env


def run_torchrun(script: str | Path, *args: str, nproc: int = 2, launch: Sequence[str] = (), timeout: float = 600,
                 env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``script`` (``train.py`` or a test's entry) under torchrun from the repository root, its output captured.

    ``env`` adds to ``torchrun_env()``.
    """
    return subprocess.run(torchrun_command(script, *args, nproc=nproc, launch=launch), cwd=REPO,
                          env=torchrun_env(**(env or {})), capture_output=True, text=True, timeout=timeout)


def load_script(relative_path: str) -> ModuleType:
    """A script of the repository (``scripts/x.py``, ``tests/x.py``) imported as a module, once.

    Registered in ``sys.modules`` under its file name: dataclasses look their module up
    while a class is built, and a second load would give a second copy of each class.
    """
    path = REPO / relative_path
    if path.stem in sys.modules:
        return sys.modules[path.stem]
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def shipped_tokenizer() -> str:
    """Path of the tokenizer that ships with the package."""
    return SHIPPED_TOKENIZER


@pytest.fixture
def free_port() -> Callable[[], int]:
    """Call it for a TCP port that is free now (one call per rendezvous)."""
    return _free_port


@pytest.fixture(scope="session")
def debug_blocks(tmp_path_factory) -> Callable[[int], str]:
    """``debug_blocks(n)``: a release folder of the debug model's shape with ``n`` blocks (``debug_release``)."""
    made: dict[int, str] = {}

    def release(n_layers: int) -> str:
        if n_layers not in made:
            made[n_layers] = debug_release(tmp_path_factory.mktemp(f"debug{n_layers}"), n_layers)
        return made[n_layers]

    return release


@pytest.fixture
def debug_cfg() -> Callable[..., JobConfig]:
    """``debug_cfg(*overrides, config=DEBUG_CONFIG)``: the debug config with overrides (``debug_config``)."""
    return debug_config


@pytest.fixture
def trainer_factory() -> Callable[..., Trainer]:
    """``trainer_factory(dump, *overrides)``: a Trainer of the debug config (``make_trainer``)."""
    return make_trainer


@pytest.fixture
def torchrun() -> Callable[..., subprocess.CompletedProcess]:
    """``torchrun(script, *args, nproc=2, ...)``: the script under torchrun, its output captured (``run_torchrun``)."""
    return run_torchrun


# ---- object storage: a real S3 server (moto's) on the loopback, for the checkpoint tests ----------------
class S3Bucket:
    """A fresh bucket on the session's S3 server: ``url`` (``s3://<name>``) and ``fs`` (an s3fs file system)."""

    def __init__(self, name: str, fs) -> None:
        self.name, self.url, self.fs = name, f"s3://{name}", fs


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 (a free port), with dummy credentials in this process' environment (and so
    in every rank and torchrun it starts); yields the endpoint, stops the server and restores the environment."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    assert host == "127.0.0.1", endpoint  # never a real store
    saved = {k: os.environ.get(k) for k in _S3_ENV}
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1", AWS_REQUEST_CHECKSUM_CALCULATION="when_required",
                      AWS_RESPONSE_CHECKSUM_VALIDATION="when_required", NO_PROXY="127.0.0.1")
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(var, None)
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_S3_ENV = ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
           "AWS_REQUEST_CHECKSUM_CALCULATION", "AWS_RESPONSE_CHECKSUM_VALIDATION", "NO_PROXY", "AWS_PROFILE",
           "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3")


@pytest.fixture
def s3_bucket(s3_server: str, request) -> S3Bucket:
    """A new, empty bucket on the session's S3 server, named after the test."""
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=s3_server, use_listings_cache=False)
    name = "t-" + "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:50].strip("-")
    fs.mkdir(name)
    return S3Bucket(name, fs)


@pytest.fixture(autouse=True)
def _no_leaked_rank_variables() -> Iterator[None]:
    """A test that runs a trainer in this process leaves the one-rank group's RANK, WORLD_SIZE, MASTER_PORT...
    in ``os.environ`` (distributed/lifecycle.py sets them for a plain ``python train.py``). Later tests that
    launch processes with this environment (fault tolerance's groups) would inherit them: two one-rank groups
    then share one MASTER_PORT (EADDRINUSE). Each test ends with these variables as it found them."""
    before = {var: os.environ.get(var) for var in _TORCHRUN_VARS}
    yield
    for var, value in before.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


@pytest.fixture(autouse=True)
def _no_leaked_process_group() -> Iterator[None]:
    """A test that joins a process group in this process leaves without it: the dry run (planning/) refuses to
    start in a process that has one, and it forks its simulations from here. The group is destroyed and the test
    that left it fails, so the leak is found where it is, not in whatever test this process runs next."""
    import torch.distributed as dist

    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a process group in the pytest process: destroy it (dist.destroy_process_group) "
                    "before the test ends", pytrace=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``gpu`` tier needs CUDA: on a machine without it those tests are reported as skipped, with the
    command that runs them where a GPU is (they check CUDA kernels that have no CPU path)."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device: `python -m pytest -m gpu` on a GPU machine "
                                   "(benchmarks/gpu_frontier.sh)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# The fast tier's check: a test that starts a process without the slow mark fails there.
from tiers import pytest_runtest_call, pytest_runtest_setup  # noqa: E402,F401 - pytest finds hooks by name
