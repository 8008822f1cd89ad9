import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster shared by every test that needs actors."""
    import ray

    from rlsys.cluster import init_ray

    init_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_cluster) -> str:
    """The shared cluster's address, for `rlsys train` in a child process to join (`cluster.address=`): it
    starts and stops no Ray of its own, which costs more than its steps. Its actors end with its driver."""
    return ray_cluster.get_runtime_context().gcs_address


@pytest.fixture(scope="session")
def two_step_run(ray_cluster, tmp_path_factory):
    """One run of the embedded default, two short steps, with evals, its checkpoint and export, asserted on by
    tests/test_end_to_end.py (what it logs and writes) and tests/test_safe_formats.py (its files' formats)."""
    from helpers import SMALL

    from rlsys.cli import main
    from rlsys.config import DEFAULT_CONFIG

    out = tmp_path_factory.mktemp("two_step") / "run"
    # Staged lengthening: step 1's answers capped at 4 tokens, step 2's at SMALL's 48 (eval's always 48)
    assert main(["train", str(DEFAULT_CONFIG), "trainer.total_steps=2", f"output_dir={out}", *SMALL,
                 "rollout.max_new_tokens_stages=[[0, 4], [1, 48]]"]) == 0
    return out


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tiny matmuls gain nothing from threads, and on a shared machine spare threads only contend."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_modifyitems(config, items):
    """`very_slow` tests (minutes each on a CPU) run only when asked for, with RLSYS_SLOW=1."""
    if os.environ.get("RLSYS_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="very_slow: minutes on a CPU; set RLSYS_SLOW=1 to run it")
    for item in items:
        if "very_slow" in item.keywords:
            item.add_marker(skip)
