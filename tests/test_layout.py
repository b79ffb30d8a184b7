"""The shape a reader meets: the root is the ladder (model.py, the train_*.py rungs, plan.py, collectives.py), the
shared plumbing sits in common/ and never imports a rung, no module imports itself back through others, a rung's
building blocks teach its own technique only (later ones live in converters/ and compose/), and every file keeps
its budget.
Read from the source (every module's import statements), nothing is run."""
import ast
import os
import re

from conftest import ROOT

LESSONS = {"model", "plan", "collectives"}      # with the train_* rungs: what the root holds
PACKAGES = ("common", "common/checkpoint", "common/hf", "planner", "pipeline", "converters", "compose", "kernels",
            "moe")


def project_modules():
    """{module name: path} of the project's own Python modules (the root and its packages, at any depth)."""
    out = {}
    for folder in ("",) + PACKAGES:
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                module = name[:-3] if not folder else f"{folder.replace('/', '.')}.{name[:-3]}"
                out[module.replace(".__init__", "")] = os.path.join(ROOT, folder, name)
    return out


def imports_of(path, modules):
    """The project modules a file imports, at any depth of its code (imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        found.update(n for n in names if n in modules)
    return found


def test_root_is_the_ladder():
    root_py = {n[:-3] for n in os.listdir(ROOT) if n.endswith(".py")}
    rungs = {n for n in root_py if n.startswith("train_")}
    assert root_py - rungs == LESSONS, sorted(root_py - rungs - LESSONS)
    assert len(root_py) <= 11, sorted(root_py)


def rung_names_imported(path):
    """(rung, name) for each name a file imports from a train_* rung; (rung, None) for a whole-module import."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update((a.name, None) for a in node.names if a.name.startswith("train_"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("train_"):
            found.update((node.module, a.name) for a in node.names)
    return found


def test_the_package_imports_no_lesson():
    """common/, kernels/, pipeline/ and converters/ import no lesson; planner/ (plan.py's model) imports only a rung's
    building blocks (train_pp.py's schedules), by name: never a rung's main, nor plan.py or collectives.py."""
    modules = project_modules()
    lessons = {m for m in modules if "." not in m and m != "kernels" and (m.startswith("train_") or m in LESSONS)}
    lessons.discard("model")                      # the one GPT: plumbing may build it (checkpoints, planner)
    for module, path in modules.items():
        if module.startswith(("common", "kernels", "pipeline", "converters")):
            bad = imports_of(path, modules) & lessons
            assert not bad, f"{module} imports {sorted(bad)}"
        elif module.startswith("planner"):
            bad = {m for m in imports_of(path, modules) & lessons if not m.startswith("train_")}
            assert not bad, f"{module} imports {sorted(bad)}"
            mains = {(rung, name) for rung, name in rung_names_imported(path) if name in (None, "main", "*")}
            assert not mains, f"{module} imports more of a rung than its building blocks: {sorted(mains, key=str)}"


def test_comm_imports_only_torch_and_the_stdlib():
    """The one project file a copied-out technique takes along."""
    assert imports_of(project_modules()["common.comm"], project_modules()) == set()


def test_no_import_cycle():
    modules = project_modules()
    graph = {m: imports_of(p, modules) - {m} for m, p in modules.items()}
    graph = {m: {d if d in modules else d.rsplit(".", 1)[0] for d in deps} - {m} for m, deps in graph.items()}
    state = {}

    def visit(m, path):
        state[m] = "open"
        for d in sorted(graph.get(m, ())):
            if d in ("common", "kernels"):         # a package's __init__ re-exports; its members are the edges
                continue
            assert state.get(d) != "open", "import cycle: " + " -> ".join(path + [d])
            if d not in state:
                visit(d, path + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


RUNGS = ("train_ddp", "train_zero", "train_tp", "train_cp", "train_pp", "train_ep")
LATER = ("kernels", "converters", "compose")   # what a rung's building blocks never import
PLUMBING = ("common", "planner", "pipeline", "converters", "compose")


def building_blocks(rung):
    """A rung's building blocks: its source below the module docstring and above the script part (the line
    `# ... the script`), where main, its flags and its checks begin."""
    source = open(os.path.join(ROOT, f"{rung}.py")).read()
    body = source[len(ast.get_docstring(ast.parse(source), clean=False) or "") + 6:]
    lines = body.splitlines()
    end = next(i for i, line in enumerate(lines) if re.fullmatch(r"# [- ]*the script", line.strip()))
    return "\n".join(lines[:end])


def test_building_blocks_import_no_kernels_or_wing():
    """A later technique extends a rung from its own file: the rung's blocks never reach into kernels/ or compose/."""
    for rung in RUNGS:
        imported = set()
        for node in ast.walk(ast.parse(building_blocks(rung))):
            if isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
        bad = sorted(m for m in imported if m.split(".")[0] in LATER)
        assert not bad, f"{rung}'s building blocks import {bad}"


def test_building_blocks_mention_no_later_chapter():
    """No slot, argument or comment for FP8, the zero-bubble weight store or partitioned activations in a rung's
    blocks: those live where the techniques meet (converters/, compose/)."""
    later = re.compile(r"fp8|float8|weight_grad|partition_activations|partitioned activations", re.IGNORECASE)
    for rung in RUNGS:
        text = building_blocks(rung)
        if rung == "train_pp":                 # zero bubble is a pipeline schedule: its runner runs W actions
            text = re.sub(r"WeightGradStore|weight_grads", "", text)
        found = sorted(set(later.findall(text)))
        assert not found, f"{rung}'s building blocks mention {found}"


def test_files_within_budget():
    """Rungs <= 450 lines, train_5d.py <= 350 (its main is the order of apply calls), every other module <= 400."""
    for module, path in project_modules().items():
        limit = 350 if module == "train_5d" else 450 if module.startswith("train_") else 400
        n = len(open(path).read().splitlines())
        assert n <= limit, f"{path}: {n} lines, budget {limit}"


def test_model_and_kernels_import_no_plumbing():
    """The floors below the plumbing: model.py (plain torch, and moe/'s routing math) and kernels/ (which imports only
    model.py)."""
    modules = project_modules()
    for module, path in modules.items():
        if module == "model" or module.split(".")[0] in ("kernels", "moe"):
            bad = sorted(m for m in imports_of(path, modules) if m.split(".")[0] in PLUMBING)
            assert not bad, f"{module} imports {bad}"
