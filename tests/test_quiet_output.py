"""What a command prints is rlsys's and the user's: Ray's token-authentication notice, DeepSpeed's accelerator guess
on a machine without a GPU and the colour codes of Ray's worker-line prefixes in a log file are off by default
(rlsys.cli.quiet_libraries, before either is imported); what a worker prints, an error included, still shows."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# A driver as every command's: the libraries quieted first, then the Ray rlsys starts, whose workers import DeepSpeed
DRIVER = """
import sys
from rlsys.cli import quiet_libraries
if sys.argv[1] == "quiet":
    quiet_libraries()
import ray
from rlsys.cluster import init_ray
from rlsys.config import ClusterConfig
init_ray(ClusterConfig(num_cpus=1))

@ray.remote
def trainer_like():
    from deepspeed.accelerator import get_accelerator
    print("worker: accelerator", get_accelerator().device_name(), flush=True)
    print("worker: an error of its own", file=sys.stderr, flush=True)

ray.get(trainer_like.remote())
import time
time.sleep(2)  # the workers' lines reach the driver
ray.shutdown()
"""


def driver_output(mode: str) -> str:
    done = subprocess.run([sys.executable, "-c", DRIVER, mode], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_ray_and_deepspeed_notices_and_colour_codes_are_off_and_worker_lines_stay():
    import torch

    out = driver_output("quiet")
    assert "worker: an error of its own" in out and "worker: accelerator" in out, out
    assert "Token authentication is enabled" not in out, out
    assert "\x1b[" not in out, out  # a log file carries no colour codes
    if not torch.cuda.is_available():
        assert "worker: accelerator cpu" in out and "Setting accelerator to CPU" not in out, out
