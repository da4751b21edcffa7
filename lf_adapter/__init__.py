"""lf_adapter (lfa): fit a paper's LLaMA-Factory full-SFT recipe to the hardware you have."""

from pathlib import Path

__version__ = "0.1.0"


class UserError(Exception):
    """Bad input from the user: the CLI prints the message and exits 2, never a traceback."""


def _shipped(folder: str) -> Path:
    """A top-level folder of the checkout, which a wheel ships inside the package (lf_adapter/<folder>)."""
    packaged = Path(__file__).parent / folder
    if packaged.is_dir():
        return packaged
    return Path(__file__).parent.parent / folder


def templates_dir() -> Path:
    """templates/: the Jinja templates of recipes, launch scripts and DeepSpeed/accelerate configs."""
    return _shipped("templates")


def catalog_dir() -> Path:
    """catalog/: lfa's data: hardware profiles, the model catalog, tasks, chat templates, failure classes,
    version-dependent keys and the memory/throughput model's coefficients."""
    return _shipped("catalog")
