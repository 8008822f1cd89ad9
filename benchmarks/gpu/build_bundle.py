"""Collect the wheels an offline single-GPU host needs to run rlsys, when it has Python, PyTorch and
transformers but no internet and no Ray, DeepSpeed, pydantic or math-verify.

Run it where the package index is reachable, with a Python that has torch (DeepSpeed's build imports it):
    python benchmarks/gpu/build_bundle.py [--out build/gpu_bundle] [--python-version 3.12]
then copy the folder and a checkout of rlsys to the host and run benchmarks/gpu/run.sh there. RLSYS_SHA256
in the folder is the digest of the rlsys sources the bundle's wheel was built from: measure.sh refuses a
checkout whose own differs (the phases import the bundle's rlsys, and their figures are the checkout's).

The bundle fits one 64 MiB transfer: Ray without the parts rlsys never loads, DeepSpeed without compiled
ops, and only the dependencies that torch and transformers do not bring already.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOCK_FILES = "requirements/lock*.txt"  # `name==version` lines; where one names a package, its pin wins

# Java jars, the dashboard's web UI and the libraries above Ray core: rlsys needs tasks, actors and
# placement groups only. They are 37 of the wheel's 76 MiB.
RAY_UNUSED = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/serve/", "ray/data/",
              "ray/tune/", "ray/train/")

# What rlsys needs beyond torch and transformers, pinned to the versions its tests run with. torch and
# transformers bring numpy, packaging, pyyaml, filelock, tqdm, safetensors, tokenizers, sympy,
# typing-extensions, idna and certifi. Left out: matplotlib (run plots, 23 MiB with pillow and fonttools;
# `rlsys plot RUN_DIR` draws them anywhere later) and pyarrow (parquet data, 52 MiB; jsonl needs none).
WHEELS = {
    # Ray core
    "ray": "2.60.0", "click": "8.5.1", "jsonschema": "4.26.0", "jsonschema-specifications": "2025.9.1",
    "referencing": "0.37.0", "rpds-py": "2026.9.1", "attrs": "26.1.0", "msgpack": "1.2.4",
    "protobuf": "7.36.2", "requests": "2.34.2", "urllib3": "2.8.0", "charset-normalizer": "3.5.2",
    # DeepSpeed's own dependencies (DeepSpeed itself is built below)
    "einops": "0.8.2", "hjson": "3.1.0", "ninja": "1.13.2", "psutil": "7.2.2", "py-cpuinfo": "9.0.0",
    # transformers builds a ZeRO-3 model under deepspeed.zero.Init only with accelerate (a core dependency)
    "accelerate": "1.15.0",
    # trainer.lora's adapters (pure Python; accelerate, safetensors and the hub client are here already)
    "peft": "0.21.2",
    # the config (pydantic) and reward.fn=math_verify
    "pydantic": "2.14.3", "pydantic-core": "2.50.4", "annotated-types": "0.8.0", "typing-inspection": "0.4.5",
    "math-verify": "0.9.0", "latex2sympy2-extended": "1.11.0", "antlr4-python3-runtime": "4.13.2",
}
DEFAULT_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux2014_x86_64"]
DEEPSPEED = "0.19.8"  # an sdist on PyPI: built here with DS_BUILD_OPS=0 into a 2 MiB pure-Python wheel


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_pins(root: Path) -> dict[str, str]:
    """`name==version` pins of the project's lock files (comments, markers and hashes ignored)."""
    pins = {}
    for path in sorted(root.glob(LOCK_FILES)):
        for line in path.read_text().splitlines():
            match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*==\s*([^\s;\\#]+)", line)
            if match:
                pins[normalize(match.group(1))] = match.group(3)
    return pins


def pinned(root: Path) -> tuple[dict[str, str], str]:
    """(wheel pins, DeepSpeed version): ours, each replaced by the lock file's where it has one."""
    lock = lock_pins(root)
    wheels = {name: lock.get(normalize(name), version) for name, version in WHEELS.items()}
    return wheels, lock.get("deepspeed", DEEPSPEED)


def pip(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, env=env)


def download(pins: dict[str, str], dest: Path, python_version: str, platforms: list[str]) -> None:
    """Binary wheels for the target interpreter and platforms, each exactly as pinned, no dependencies."""
    pip("download", "--no-deps", "--only-binary=:all:", "--implementation", "cp", "--python-version",
        python_version, *(f"--platform={tag}" for tag in platforms), "--dest", str(dest),
        *(f"{name}=={version}" for name, version in pins.items()))


def build_deepspeed(version: str, dest: Path) -> None:
    """A wheel from DeepSpeed's sdist with no ops compiled (rlsys uses torch's AdamW and NCCL)."""
    env = dict(os.environ, DS_BUILD_OPS="0")
    pip("wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "--no-binary", "deepspeed",
        "--wheel-dir", str(dest), f"deepspeed=={version}", env=env)


def build_rlsys(dest: Path) -> None:
    """rlsys as a wheel, built from a copy so the checkout gets no build/ or egg-info folders."""
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, tmp)
        shutil.copytree(ROOT / "rlsys", Path(tmp) / "rlsys", ignore=shutil.ignore_patterns("__pycache__"))
        pip("wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(dest), tmp)


def rlsys_digest(root: Path) -> str:
    """sha256 of the `sha256sum` listing of rlsys/'s files (no __pycache__) in byte order of their paths: what
    measure.sh's `find rlsys -type f ... | LC_ALL=C sort | xargs sha256sum | sha256sum` gives in a checkout."""
    files = sorted(p.relative_to(root).as_posix() for p in (root / "rlsys").rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts)
    listing = "".join(f"{hashlib.sha256((root / f).read_bytes()).hexdigest()}  {f}\n" for f in files)
    return hashlib.sha256(listing.encode()).hexdigest()


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def strip_wheel(wheel: Path, prefixes: tuple[str, ...]) -> int:
    """Re-pack `wheel` in place without the files under `prefixes` and their RECORD lines; returns how many
    files went. Entries keep their permissions (Ray's raylet and GCS server must stay executable)."""
    out = wheel.with_suffix(".tmp")
    removed = 0
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if info.filename.startswith(prefixes):
                removed += 1
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not line.decode().startswith(prefixes))
            dst.writestr(info, data)
    out.replace(wheel)
    return removed


def describe(dest: Path, limit_mib: float) -> float:
    """Print each wheel's size and the total; write SHA256SUMS, which run.sh checks the copy against."""
    wheels = sorted(dest.glob("*.whl"), key=lambda p: -p.stat().st_size)
    lines = []
    for path in wheels:
        data = path.read_bytes()
        lines.append(f"{hashlib.sha256(data).hexdigest()}  {path.name}")
        print(f"{len(data) / 2**20:8.2f} MiB  {path.name}")
    total = sum(p.stat().st_size for p in wheels) / 2**20
    print(f"{total:8.2f} MiB  in {len(wheels)} wheels ({dest})")
    (dest / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    if total > limit_mib:
        sys.exit(f"build_bundle: the bundle is {total:.1f} MiB, over --max-mib {limit_mib}")
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "gpu_bundle",
                        help="folder for the wheels (default build/gpu_bundle, which git ignores)")
    parser.add_argument("--python-version", default="3.12", help="the GPU host's Python (default 3.12)")
    parser.add_argument("--platform", action="append", dest="platforms",
                        help="a wheel platform tag the host takes, repeatable (default: manylinux 2.28 and "
                             "2014 on x86_64, as pip does not read the older tags into the newer)")
    parser.add_argument("--max-mib", type=float, default=60.0, help="fail if the wheels add up to more")
    parser.add_argument("--rlsys-only", action="store_true",
                        help="only rlsys's wheel and its digest (a rehearsal of measure.sh with a venv's packages)")
    args = parser.parse_args(argv)
    if args.rlsys_only:
        args.out.mkdir(parents=True, exist_ok=True)
        build_rlsys(args.out)
        (args.out / "RLSYS_SHA256").write_text(rlsys_digest(ROOT) + "\n")
        describe(args.out, args.max_mib)
        return
    try:
        import torch  # noqa: F401  DeepSpeed's setup.py imports it
    except ImportError:
        sys.exit("build_bundle: run it with a Python that has torch (DeepSpeed's build needs it)")
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"build_bundle: --out {args.out} is not empty")
    args.out.mkdir(parents=True, exist_ok=True)
    wheels, deepspeed_version = pinned(ROOT)
    download(wheels, args.out, args.python_version, args.platforms or DEFAULT_PLATFORMS)
    ray_wheel = next(args.out.glob("ray-*.whl"))
    print(f"ray: removed {strip_wheel(ray_wheel, RAY_UNUSED)} files under " + ", ".join(RAY_UNUSED))
    build_deepspeed(deepspeed_version, args.out)
    build_rlsys(args.out)
    (args.out / "RLSYS_SHA256").write_text(rlsys_digest(ROOT) + "\n")
    describe(args.out, args.max_mib)


if __name__ == "__main__":
    main()
