"""Write the CPU lock: every distribution installed in an environment, pinned, rlsys itself left out.

Usage: python requirements/write_lock.py PYTHON LOCK  (`make lock` runs it on a scratch environment).
The local-version suffix of torch's CPU build (+cpu) is dropped, so the same pin serves machines
that install torch from another index.
"""
import subprocess
import sys
from datetime import date

HEADER = """# Exact versions that `make test` passed with on the CPU machine (Python 3.11, x86-64).
# `make setup` installs through this file as pip constraints; refresh with `make lock`.
# Written {day} by requirements/write_lock.py.
"""


def main(python: str, lock: str) -> None:
    frozen = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable", "--disable-pip-version-check"],
                            check=True, capture_output=True, text=True).stdout.splitlines()
    pins = sorted((line.split("+")[0] for line in frozen if "==" in line and not line.startswith("rlsys==")),
                  key=str.lower)
    with open(lock, "w") as f:
        f.write(HEADER.format(day=date.today().isoformat()) + "\n".join(pins) + "\n")
    print(f"wrote {len(pins)} pins to {lock}")


if __name__ == "__main__":
    main(*sys.argv[1:])
