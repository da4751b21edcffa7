"""Code that runs inside LLaMA-Factory's own processes.

Mechanism: an import hook, installed by `boot/sitecustomize.py`, which lfa puts first on PYTHONPATH. Python runs
sitecustomize at start-up in every interpreter that inherits that environment: `llamafactory-cli` itself, the
torchrun workers it relaunches (FORCE_TORCHRUN / several GPUs), and workers of a user's own launch script that
exports the same PYTHONPATH (launch.sh does). The hook waits until LLaMA-Factory imports its template module, then
registers lfa's chat templates; when it imports the tuner, it wraps `run_exp` to add lfa's callbacks. Nothing in
LLaMA-Factory is forked or edited, and processes that never import llamafactory pay nothing but one small import.
We chose this over our own worker entry point because LLaMA-Factory's launcher always starts workers with its own
launcher.py file; an entry point of ours would have to re-implement that relaunch (and keep up with it).
"""

from pathlib import Path


def boot_dir() -> Path:
    return Path(__file__).parent / "boot"
