"""lf_adapter (lfa): fit a paper's LLaMA-Factory full-SFT recipe to the hardware you have."""
from pathlib import Path

__version__ = "0.1.0"


class UserError(Exception):
    """Bad input from the user: the CLI prints the message and exits 2, never a traceback."""


def templates_dir() -> Path:
    """templates/ ships inside the wheel as lf_adapter/templates; in a checkout it is the top-level folder."""
    packaged = Path(__file__).parent / "templates"
    if packaged.is_dir():
        return packaged
    return Path(__file__).parent.parent / "templates"
