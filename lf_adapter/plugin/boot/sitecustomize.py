# Put first on PYTHONPATH by lfa: installs the lfa import hook, then runs any sitecustomize it shadows.
import os
import sys


def _chain_next_sitecustomize():
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        candidate = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(os.path.dirname(candidate)) != here and os.path.isfile(candidate):
            with open(candidate) as fh:
                code = compile(fh.read(), candidate, "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": candidate})
            return


try:
    from lf_adapter.plugin import hooks

    hooks.install()
except ImportError as exc:  # lf_adapter is not importable in this interpreter: say so once, run unpatched
    if os.environ.get("LFA_REQUIRE_PLUGIN"):
        sys.stderr.write(f"lfa plugin: cannot import lf_adapter ({exc}); custom templates will be missing\n")
_chain_next_sitecustomize()
