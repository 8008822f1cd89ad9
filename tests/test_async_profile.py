"""benchmarks/async_profile.py's CPU accounting, on a process whose CPU time is known (the profile of a live
run is a benchmark, not a test)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "async_profile.py"
BUSY = """
import time
start = time.process_time()
while time.process_time() - start < 0.5:
    pass
print("spun", flush=True)
time.sleep(60)
"""


def test_cpu_seconds_names_the_controller_by_its_command_and_counts_its_cpu_time():
    spec = importlib.util.spec_from_file_location("async_profile", SCRIPT)
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    busy = subprocess.Popen([sys.executable, "-c", BUSY, "-m", "rlsys.cli"], stdout=subprocess.PIPE, text=True)
    try:
        assert busy.stdout.readline() == "spun\n"
        name, seconds = profile.cpu_seconds()[busy.pid]
    finally:
        busy.kill()
        busy.wait()
    assert name == "controller" and 0.5 <= seconds < 3  # interpreter start-up and the spin, not the sleep
    mine = profile.cpu_seconds()
    assert all(s >= 0 for _, s in mine.values()) and Path(sys.executable).name in {n for n, _ in mine.values()}
