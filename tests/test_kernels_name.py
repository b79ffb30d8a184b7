"""kernels/ shares its name with Hugging Face's `kernels` package, which transformers >= 5.25 imports for its model
classes (kernels/hub_name.py). Both must work in one process, in either order, from the repository root and from
elsewhere. With transformers >= 5.25 installed the real package is used (.ci/run runs this file in a venv with the
newest transformers); otherwise a stand-in with the same shape: a name in its __init__ that comes from a submodule."""
import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OURS = "from kernels import apply_kernels, flash_attention; import kernels.fp8"


def real_hub_installed():
    """Hugging Face's kernels installed (found on sys.path without this root)?"""
    sys.path.insert(0, ROOT)
    try:
        from kernels import hub_name
        return hub_name.hub_spec() is not None
    finally:
        sys.path.remove(ROOT)


def stand_in_hub(tmp):
    """A package named kernels whose __init__ takes a name from its own submodule, as Hugging Face's does."""
    os.makedirs(os.path.join(tmp, "kernels", "_internals"))
    with open(os.path.join(tmp, "kernels", "__init__.py"), "w") as f:
        f.write("from kernels._internals.layer import CUDAProperties\n")
    open(os.path.join(tmp, "kernels", "_internals", "__init__.py"), "w").close()
    with open(os.path.join(tmp, "kernels", "_internals", "layer.py"), "w") as f:
        f.write("class CUDAProperties:\n    pass\n")
    return tmp


# ours first from elsewhere works as from the root (the root is first on sys.path when kernels is imported)
@pytest.mark.parametrize("where, first", [("root", "hub"), ("root", "ours"), ("elsewhere", "hub")])
def test_both_packages_named_kernels_work(where, first, tmp_path):
    env = dict(os.environ)
    if real_hub_installed():
        hub = "import transformers.models.llama.modeling_llama; from transformers.integrations import hub_kernels"
        check = "import kernels; assert kernels.CUDAProperties is sys.modules['kernels._internals.layer'].CUDAProperties"
    else:
        env["PYTHONPATH"] = stand_in_hub(str(tmp_path / "site"))
        hub = "from kernels import CUDAProperties"
        check = "import kernels; assert kernels.CUDAProperties.__module__ == 'kernels._internals.layer'"
    # from elsewhere, the root joins sys.path only when the project is used, and the scripts reach kernels through
    # converters (which takes the name back where the hub's package was imported first)
    project = OURS if where == "root" else f"sys.path.insert(0, {ROOT!r}); import converters; {OURS}"
    steps = [hub, project] if first == "hub" else [project, hub]
    code = "; ".join(["import sys", *steps, check, "print('both')"])
    cwd = ROOT if where == "root" else str(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "both", out.stderr[-2000:]
