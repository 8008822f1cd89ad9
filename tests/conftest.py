import pytest


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster shared by every test that needs actors."""
    import ray

    from rlsys.cluster import init_ray

    init_ray()
    yield ray
    ray.shutdown()
