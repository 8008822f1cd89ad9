"""The policy's starting point: a user's local HF directory, or the tiny model built, warm-started and
cached by config hash (so later runs and tests reuse it)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

from rlsys.config import Config, DataConfig, read_chat_template
from rlsys.errors import UserError
from rlsys.logger import waiting

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # never pickles: see safe formats
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
BUILD_INFO = "rlsys_build.json"
TEMPLATED = "templated"  # under model.cache_dir: model folders with model.chat_template added
# The code that decides what a cached model is: editing it makes a new cache entry, never a stale hit.
BUILDER_SOURCES = ("models/tiny.py", "models/warm_start.py", "data/synthetic.py")
PACKAGE = Path(__file__).resolve().parent.parent


class ModelDirError(UserError, ValueError):
    pass


def load_tokenizer(model_dir: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def validate_model_dir(path: str | Path, field: str = "model.path") -> Path:
    """A local HF directory with config.json, weights and tokenizer files, or a ModelDirError naming `field`."""
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise ModelDirError(f"{field}: {model_dir} is not a directory (a local Hugging Face model folder; "
                            "nothing is downloaded)")
    missing = []
    if not (model_dir / "config.json").is_file():
        missing.append("config.json")
    if not any((model_dir / name).is_file() for name in WEIGHT_FILES):
        pickled = " (pytorch_model.bin is a pickle, which rlsys never loads: convert it with save_pretrained)"
        missing.append("weights (" + " or ".join(WEIGHT_FILES) + ")"
                       + (pickled if (model_dir / "pytorch_model.bin").is_file() else ""))
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        missing.append("tokenizer (" + " or ".join(TOKENIZER_FILES) + ")")
    if missing:
        raise ModelDirError(f"{field}: {model_dir} lacks " + "; ".join(missing))
    return model_dir


def prepare_model(cfg: Config) -> Path:
    """`cfg.model.path` if set (validated); else the cached tiny model for this config, built if absent; with
    model.chat_template, that model's folder with the template added (`with_chat_template`)."""
    model_dir = validate_model_dir(cfg.model.path) if cfg.model.path else _tiny_model(cfg)
    if cfg.model.chat_template is None:
        return model_dir
    return with_chat_template(model_dir, read_chat_template(cfg.model.chat_template),
                              Path(cfg.model.cache_dir).expanduser() / TEMPLATED)


def with_chat_template(model_dir: Path, template: str, cache_dir: Path) -> Path:
    """A folder holding a link to each of `model_dir`'s files and the chat template as chat_template.jinja (read by
    every tokenizer load: engines, trainer, data, an exported model), made once per model and template; a
    ModelDirError if the model has a template of its own, which model.chat_template would hide."""
    if own_chat_template(model_dir):
        raise ModelDirError(f"model.chat_template: {model_dir} has a chat template of its own; remove "
                            "model.chat_template to use it, or give a model folder without one")
    key = hashlib.sha256(f"{model_dir.resolve()}\n{template}".encode()).hexdigest()[:16]

    def fill(tmp: Path) -> None:
        for entry in model_dir.resolve().iterdir():
            (tmp / entry.name).symlink_to(entry)
        (tmp / "chat_template.jinja").write_text(template)
    return made_once(cache_dir / f"{model_dir.name}-{key}", fill)


def made_once(final: Path, fill) -> Path:
    """`final`, filled by `fill(folder)` in a temporary folder beside it and renamed into place: it appears whole
    or not at all, and where another process made it first, theirs is kept. Readable like any model folder."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private
    try:
        fill(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():  # another process made the same folder first: keep theirs
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def own_chat_template(model_dir: Path) -> bool:
    """Whether the model folder's tokenizer has a chat template (a file of its own, or tokenizer_config.json's)."""
    if any((model_dir / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    config = model_dir / "tokenizer_config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def _tiny_model(cfg: Config) -> Path:
    """The cached tiny model for this config, built if absent."""
    cache_dir = Path(cfg.model.cache_dir).expanduser()
    final = cache_dir / cache_key(cfg)
    if not final.is_dir():
        print(f"building the tiny model (once: cached at {final} for every run with this model, warm start and "
              "task, whatever its RL settings)", flush=True)
    return made_once(final, lambda tmp: _build(cfg, tmp))


def _build(cfg: Config, out: Path) -> None:
    from rlsys.data import demonstrations, load_datasets
    from rlsys.models.tiny import build_tiny_model
    from rlsys.models.warm_start import exact_match_accuracy, warm_start

    ws = cfg.model.warm_start
    build_tiny_model(cfg.model, out, seed=ws.seed)
    train, evals = load_datasets(cfg.data)
    if ws.steps == 0:  # no fine-tune, and no greedy eval of a random model (minutes on one thread at 0.5B)
        info = {"model": cfg.model.model_dump(), "data": cfg.data.model_dump(), "warm_start": {"steps": 0}}
        (out / BUILD_INFO).write_text(json.dumps(info, indent=1))
        print("warm start: off (model.warm_start.steps=0)", flush=True)
        return
    if cfg.data.task == "files":  # the user's answers are its examples: say so, as no RL has started yet
        print(f"warm start: fine-tuning the tiny model on the answers of {cfg.data.train_path} "
              f"(model.warm_start.steps={ws.steps}; 0 skips it)", flush=True)
    metrics = warm_start(out, train, ws, demonstrations(cfg.data.task, ws.demonstrations) if ws.tool_share else None,
                         progress=cfg.logging.progress)
    t = time.time()
    # Exact match of the generated text: with tools the model's text is a call, answered only in a run, whose
    # step-0 eval measures the warm-started model instead (0% here would say nothing of it)
    measured = not (cfg.tools.fns or cfg.tools.env)
    if measured:
        print(f"warm start: done in {metrics['seconds']:.0f}s; now a greedy eval of its {len(evals)} eval prompts",
              flush=True)
    with nullcontext() if cfg.logging.progress else waiting("warm start: greedy eval"):  # a bar, or lines
        metrics["eval_greedy_accuracy"] = exact_match_accuracy(
            out, evals, max_new_tokens=cfg.rollout.max_new_tokens, device=ws.device,
            progress=cfg.logging.progress) if measured else None
    metrics["eval_seconds"] = time.time() - t
    # For the record only (not part of the cache key): measured on the eval split of the building run.
    info = {"model": cfg.model.model_dump(), "data": cfg.data.model_dump(), "warm_start": metrics}
    (out / BUILD_INFO).write_text(json.dumps(info, indent=1))
    accuracy = (f"eval greedy accuracy {metrics['eval_greedy_accuracy']:.1%}" if measured else
                "eval greedy accuracy not measured: answers come through tools (the run's step-0 eval has it)")
    print(f"warm start: {metrics['steps']} steps in {metrics['seconds']:.0f}s, loss {metrics['loss_first']:.2f} "
          f"-> {metrics['loss_last']:.2f}, {accuracy}", flush=True)


def weights_fingerprint(model_dir: str | Path) -> str | None:
    """The first 16 hex digits of the sha256 of a model rlsys built (its BUILD_INFO present), over its weight
    files. One config can build other weights on another machine: the warm start trains on the CPU, whose
    floating-point results differ between CPU models, so runs are comparable only from one fingerprint. None for
    a user's model, which its path names."""
    model_dir = Path(model_dir)
    if not (model_dir / BUILD_INFO).is_file():
        return None
    digest = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def cache_key(cfg: Config) -> str:
    """Hash of what the built weights depend on, and of nothing else, so configs that differ only in what RL
    does with the model (trainer, scheduler, rollout, eval, reward) share one build: the architecture and its
    init seed; with a warm start, its settings, the training split it sees and the builder code."""
    ws = cfg.model.warm_start
    parts = {"model": cfg.model.model_dump(exclude={"path", "cache_dir", "warm_start", "chat_template"}),
             "seed": ws.seed}
    sources = [PACKAGE / BUILDER_SOURCES[0]]  # tiny.py: no warm start builds from it alone
    if ws.steps:
        parts["warm_start"] = ws.model_dump(exclude=set() if ws.label_noise else {"noise"})  # no noise, no kind
        parts["data"] = warm_start_data(cfg.data)
        sources = ([PACKAGE / rel for rel in BUILDER_SOURCES] + task_sources(cfg.data.task)
                   + demonstration_sources(ws.demonstrations))
    parts["code"] = [hashlib.sha256(path.read_bytes()).hexdigest() for path in sources]
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]
    return f"{cfg.model.arch}-h{cfg.model.hidden_size}-l{cfg.model.num_layers}-{digest}"


def warm_start_data(data: DataConfig) -> dict:
    """The data fields that decide the training split a warm start sees (rlsys.data.load_datasets)."""
    if data.task != "files":
        return {"task": data.task, "train_size": data.train_size, "seed": data.seed}
    # the user's file (it may change), read by their loader; without eval_path, eval_size rows are held out of it
    held_out = {} if data.eval_path else {"eval_size": data.eval_size, "seed": data.seed}
    return {"task": "files", "train_path": data.train_path, "train_file": _file_stamp(data.train_path),
            "loader": data.loader, **held_out}


def task_sources(task: str) -> list[Path]:
    """The files defining the task's families beyond synthetic.py (a family may live in its own module)."""
    import inspect

    from rlsys.data import TASKS  # importing the package registers every family
    from rlsys.data.synthetic import MIX

    families = MIX if task == "synthetic" else [task] if task in TASKS else []
    files = {Path(inspect.getsourcefile(TASKS.get(f))).resolve() for f in families}
    return sorted(f for f in files if f.name != "synthetic.py")


def demonstration_sources(spec: str | None) -> list[Path]:
    """The file of the user's warm-start demonstrations (model.warm_start.demonstrations): its edits build again."""
    import inspect

    from rlsys.data import demonstrations

    return [Path(inspect.getsourcefile(demonstrations("", spec))).resolve()] if spec else []


def _file_stamp(path: str | None) -> list | None:
    if not path or not Path(path).is_file():
        return None
    stat = Path(path).stat()
    return [str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns]
