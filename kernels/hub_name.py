"""
kernels/hub_name.py: this package shares its name with Hugging Face's `kernels` package (hub kernels), which
transformers >= 5.25 imports for its model classes (`from kernels import CUDAProperties, ...`).

Python keeps one module per name. Wherever this repository's root comes first on sys.path (a script, pytest or a
notebook run from the root), `import kernels` finds this package, so this package answers for both:

    kernels.flash_attention, kernels.apply, ...      this package's own names and files
    kernels.CUDAProperties, kernels._internals, ...  Hugging Face's: a name not defined here is read from its
                                                     __init__ (run once, on first use, as `kernels._hub`), and
                                                     its directory is on this package's __path__, so its
                                                     submodules import as they do at home

Where Hugging Face's package was imported first (the root added to sys.path after transformers loaded it),
converters/__init__.py, the way the scripts reach this package, puts it in that one's place, the loaded one kept
as `kernels._hub` (so the classes transformers already holds stay the ones it is given).
"""
import importlib.machinery
import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def hub_spec():
    """Where Hugging Face's `kernels` is installed (a spec found on sys.path without this root), or None."""
    elsewhere = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != os.path.realpath(ROOT)]
    return importlib.machinery.PathFinder.find_spec("kernels", elsewhere)


def hub_module():
    """Hugging Face's package __init__, run once as `kernels._hub` (its own imports resolve through __path__)."""
    if "kernels._hub" not in sys.modules:
        spec = importlib.util.spec_from_file_location("kernels._hub", hub_spec().origin)
        module = importlib.util.module_from_spec(spec)
        sys.modules["kernels._hub"] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["kernels._hub"]
            raise
    return sys.modules["kernels._hub"]


def lookup(name, hub_installed):
    """A name this package does not define: Hugging Face's, when its package is installed."""
    if not hub_installed or name.startswith("__"):
        raise AttributeError(f"module 'kernels' has no attribute '{name}'")
    return getattr(hub_module(), name)
