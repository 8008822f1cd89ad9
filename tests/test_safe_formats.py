"""Safe formats and defaults: nothing pickled is ever loaded from disk, checkpoints and exports are
safetensors and JSON only, and what rlsys starts listens on localhost unless the config says otherwise.
(launch/ray_head.sh's dashboard default is tested in tests/test_launch.py.)"""
import ast
import contextlib
import http.client
import json
import os
import urllib.request
from pathlib import Path

import psutil  # DeepSpeed's dependency
import pytest
from safetensors import safe_open

from rlsys.config import ClusterConfig, TrainerConfig
from rlsys.trainer.backend import TorchBackend
from rlsys.trainer.logprobs import Scoring

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "rlsys").rglob("*.py")) + sorted((ROOT / "launch").rglob("*.py"))

# Modules whose only way to read data is unpickling it (or running it, for marshal).
PICKLE_MODULES = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "joblib", "shelve", "marshal", "jsonpickle"}
# Calls that unpickle what they read, always, or with the keyword given.
PICKLE_CALLS = {"torch.load", "torch.jit.load", "torch.serialization.load", "yaml.unsafe_load", "yaml.full_load",
                "yaml.unsafe_load_all", "yaml.full_load_all", "pandas.read_pickle", "numpy.lib.format.read_array"}
UNSAFE_KEYWORDS = {("allow_pickle", True), ("weights_only", False), ("use_safetensors", False),
                   ("trust_remote_code", True)}
SAFE_YAML_LOADERS = {"SafeLoader", "CSafeLoader"}
WILDCARD = {"0.0.0.0": "127.0.0.1", "::": "127.0.0.1"}  # a socket on every address answers on loopback
# (file, what) pairs that are allowed, each with the reason.
ALLOWED = {
    # The reward function is pickled by the driver and unpickled by its reward actors, in memory through
    # Ray (which pickles every actor argument anyway); nothing is written to or read from disk.
    ("rlsys/reward/pool.py", "import ray.cloudpickle"),
    # CUDA IPC handles (torch's reduce_tensor: a rebuild function and its arguments, pickled as torch's own
    # multiprocessing does) pass once per run from a trainer rank to the engine on its GPU through that rank's
    # TCP store, in memory. The store trusts the cluster's network exactly as Ray's own ports do.
    ("rlsys/weights/transfer.py", "import pickle"),
}


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def pickle_loaders(source: str) -> list[str]:
    """Each import of a pickling module and each call that unpickles, as 'what (line N)'."""
    tree, aliases, found = ast.parse(source), {}, []
    for node in ast.walk(tree):  # aliases first: `import numpy as np`, `from torch import load`
        if isinstance(node, ast.Import):
            aliases.update((a.asname or a.name.split(".")[0], a.name if a.asname else a.name.split(".")[0])
                           for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            aliases.update((a.asname or a.name, f"{node.module}.{a.name}") for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                name = f"{node.module}.{a.name}" if isinstance(node, ast.ImportFrom) else a.name
                if PICKLE_MODULES & set(name.split(".")) or name in PICKLE_CALLS:
                    found.append(f"import {name} (line {node.lineno})")
        if not isinstance(node, ast.Call):
            continue
        for k in node.keywords:
            if isinstance(k.value, ast.Constant) and (k.arg, k.value.value) in UNSAFE_KEYWORDS:
                found.append(f"{k.arg}={k.value.value} (line {node.lineno})")
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, rest = name.partition(".")
        name = ".".join(filter(None, [aliases.get(head, head), rest]))
        loader = next((_dotted(k.value) or "" for k in node.keywords if k.arg == "Loader"), "")
        if (name in PICKLE_CALLS or name.endswith((".read_pickle", ".load_checkpoint"))
                or (name in ("yaml.load", "yaml.load_all") and loader.split(".")[-1] not in SAFE_YAML_LOADERS)):
            found.append(f"{name} (line {node.lineno})")
    return found


def test_no_source_file_loads_pickled_data():
    found = []
    for path in SOURCES:
        rel = path.relative_to(ROOT).as_posix()
        found += [f"{rel}: {what}" for what in pickle_loaders(path.read_text())
                  if (rel, what.rsplit(" (line", 1)[0]) not in ALLOWED]
    assert not found, "pickle loaders (use safetensors or JSON, or justify one in ALLOWED):\n" + "\n".join(found)


@pytest.mark.parametrize("snippet", [
    "import torch\ntorch.load('x.pt')",
    "from torch import load\nload('x.pt')",
    "import pickle",
    "from pickle import loads",
    "import numpy as np\nnp.load('x.npy', allow_pickle=True)",
    "import yaml\nyaml.load(open('c.yaml'))",
    "import yaml\nyaml.load(open('c.yaml'), Loader=yaml.FullLoader)",
    "import yaml\nyaml.unsafe_load(open('c.yaml'))",
    "import pandas as pd\npd.read_pickle('x.pkl')",
    "engine.load_checkpoint('ckpt')",  # DeepSpeed's own checkpoints are torch.save files
    "AutoModel.from_pretrained('m', use_safetensors=False)",
    "AutoModel.from_pretrained('m', trust_remote_code=True)",
    "torch.load('x.pt', weights_only=False)",
])
def test_the_scan_catches_each_way_of_unpickling(snippet):
    assert pickle_loaders(snippet)


def test_the_scan_lets_safe_loaders_through():
    assert not pickle_loaders("import yaml, json, numpy as np\nyaml.safe_load('a: 1')\n"
                              "yaml.load('a: 1', Loader=yaml.SafeLoader)\njson.loads('{}')\nnp.load('x.npy')\n"
                              "from safetensors.torch import load_file\nload_file('m.safetensors')")


def assert_safetensors_and_json_only(folder: Path) -> list[str]:
    """Every file is a readable safetensors or JSON file, and none is a pickle or torch.save archive."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    for path in files:
        assert path.suffix in (".safetensors", ".json"), path
        head = path.read_bytes()[:2]
        assert head[:1] != b"\x80" and head != b"PK", f"{path} looks like a pickle or a torch.save zip"
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            with safe_open(str(path), "pt") as f:
                assert list(f.keys()) or path.stat().st_size > 8, path
    return [p.relative_to(folder).as_posix() for p in files]


@pytest.mark.slow
def test_a_real_run_checkpoints_and_exports_safetensors_and_json_only(tmp_path, two_step_run):
    run = two_step_run  # the embedded default's (conftest.py)
    checkpoint = assert_safetensors_and_json_only(run / "checkpoints")  # DeepSpeed (ZeRO-2) and the controller
    assert {"step_000002/controller.json", "step_000002/trainer/model.safetensors",
            "step_000002/trainer/optimizer_shard0.safetensors"} <= set(checkpoint)
    assert "model.safetensors" in assert_safetensors_and_json_only(run / "export")

    backend = TorchBackend(TrainerConfig(backend="torch"), str(run / "export"), Scoring())  # the other backend's files
    sum(p.sum() for p in backend.model.parameters()).backward()
    backend.optimizer.step()  # so that the optimizer has state to save
    backend.save(str(tmp_path / "torch"))
    assert "optimizer_rank0.safetensors" in assert_safetensors_and_json_only(tmp_path / "torch")


def file_modes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): oct(p.stat().st_mode & 0o777) for p in folder.rglob("*") if p.is_file()}


def umask_file_mode() -> str:
    """The mode a file written with open() gets here: 0644 under a umask of 022."""
    mask = os.umask(0)
    os.umask(mask)
    return oct(0o666 & ~mask)


def test_a_checkpoints_safetensors_get_the_mode_of_the_other_files(tmp_path):
    """safetensors writes its files 0600: a checkpoint's are given the umask's mode, as its JSON files have."""
    import torch
    from safetensors.torch import save_file

    from rlsys.checkpoint import CheckpointManager

    def write(folder: Path):
        save_file({"w": torch.zeros(2)}, str(folder / "model.safetensors"))
        (folder / "controller.json").write_text('{"step": 1}')
    folder = CheckpointManager(tmp_path).save(1, write)
    assert file_modes(folder) == dict.fromkeys(["controller.json", "model.safetensors"], umask_file_mode())


@pytest.mark.slow
def test_a_runs_exported_model_and_checkpoint_are_readable_as_its_other_files(two_step_run):
    """export/model.safetensors was 0600: unreadable to a group sharing the run folder, unlike its config.json."""
    for folder in ("export", "checkpoints"):
        modes = file_modes(two_step_run / folder)
        assert "model.safetensors" in " ".join(modes) and set(modes.values()) == {umask_file_mode()}, modes


def serves_ray_dashboard(host: str, port: int) -> bool:
    """Whether the port answers the dashboard's health check (open without Ray's auth token; the job API
    behind it needs the token, which every process of the cluster's user can read)."""
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/api/gcs_healthz", timeout=2) as reply:
            return reply.read() == b"success"
    except (OSError, http.client.HTTPException):  # not HTTP, or not the dashboard
        return False


def test_ray_is_started_without_its_dashboard(ray_cluster):
    # The dashboard serves Ray's job API (run any command on the cluster) to whoever reaches its port:
    # no port that the Ray started by rlsys (init_ray, through the fixture) listens on may serve it.
    assert ClusterConfig().dashboard_host == "127.0.0.1"  # where it would listen if a config turned it on
    listening = set()
    for process in psutil.Process().children(recursive=True):  # the local Ray's processes
        with contextlib.suppress(psutil.Error):  # a worker that exits meanwhile
            listening |= {(WILDCARD.get(c.laddr.ip, c.laddr.ip), c.laddr.port)
                          for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert listening, "found no Ray process listening"
    assert not [address for address in listening if serves_ray_dashboard(*address)]


def test_a_model_folder_with_only_pickled_weights_is_refused_by_name(tmp_path):
    from rlsys.models import ModelDirError, validate_model_dir

    for name in ("config.json", "tokenizer.json", "pytorch_model.bin"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(ModelDirError, match="model.path: .*pytorch_model.bin is a pickle"):
        validate_model_dir(tmp_path)


def test_the_trainer_never_unpickles_weights_a_folder_holds_only_as_a_pickle(tmp_path):
    """A folder past the name check (validate_model_dir) still meets the trainer's loader, which takes
    safetensors only: transformers would otherwise unpickle pytorch_model.bin."""
    import torch
    from transformers import AutoModelForCausalLM

    from rlsys.config import ModelConfig
    from rlsys.models.tiny import build_tiny_model
    from rlsys.trainer.backend import load_model

    built = build_tiny_model(ModelConfig(), tmp_path / "built")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((built / "config.json").read_text())
    torch.save(AutoModelForCausalLM.from_pretrained(built).state_dict(), pickled / "pytorch_model.bin")
    assert (pickled / "pytorch_model.bin").exists() and not list(pickled.glob("*.safetensors"))
    assert AutoModelForCausalLM.from_pretrained(pickled) is not None  # loadable by unpickling: what is refused
    with pytest.raises(OSError, match="safetensors"):
        load_model(str(pickled), torch.float32)
