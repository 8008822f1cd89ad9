"""docs/config.md is the schema's reference: generated from rlsys/config.py, and equal to what it generates."""
from pathlib import Path

from rlsys.config import Config
from rlsys.config_reference import reference

ROOT = Path(__file__).resolve().parent.parent


def every_key(model, prefix=""):
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
            yield from every_key(field.annotation, dotted + ".")
        else:
            yield dotted


def test_the_config_reference_page_is_up_to_date():
    assert (ROOT / "docs" / "config.md").read_text() == reference(), (
        "docs/config.md differs from the schema: run `python -m rlsys.config_reference > docs/config.md`")


def test_the_reference_lists_every_key_with_its_default_and_the_notes_beside_it():
    page = reference()
    keys = list(every_key(Config))
    assert len(keys) > 100 and all(f"| `{key}` |" in page for key in keys)
    assert "| `trainer.total_steps` | `int` >= 1 |" in page
    assert "| `logging.tensorboard` | `bool` | `false` | TensorBoard event files in OUTPUT_DIR/tensorboard" in page
    assert "`model.path` | `Optional[str]` | `null` | a local Hugging Face directory" in page


def test_the_readme_points_to_the_reference():
    assert "[docs/config.md](docs/config.md)" in (ROOT / "README.md").read_text()
