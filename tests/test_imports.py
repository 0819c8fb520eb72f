"""rlcore runs without transformers: importing every module must not pull it in, nor the trackers
train.report_to names (optional extras, imported only when a run reports to them)."""

import subprocess
import sys


def test_importing_rlcore_does_not_import_transformers_trl_or_a_tracker():
    code = ("import sys, rlcore, rlcore.train, rlcore.cli, rlcore.models.transformer, rlcore.models.hf_checkpoint, "
            "rlcore.models.tokenizer, rlcore.rollout, rlcore.losses, rlcore.models.embedded, rlcore.models.lora, "
            "rlcore.models.classifier, rlcore.rewards.reward_model, rlcore.run.tracking; "
            "print(sorted(m for m in ('transformers', 'trl', 'accelerate', 'tensorboard', 'torch.utils.tensorboard', "
            "'wandb', 'trackio') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def import_graph() -> dict[str, set[str]]:
    """Module -> the rlcore modules its import statements run, every one of them: at the top,
    inside functions and under `if TYPE_CHECKING`. `from a.b import c` runs a.b (and c, when c is a
    module), and before them the packages above them that the importer is not already inside."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "rlcore"
    files = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        edges = set()
        for target in (t for t in targets if t in files):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                module = ".".join(parts[:i])
                if module != name and not (name + ".").startswith(module + "."):  # not one of its own packages
                    edges.add(module)
        graph[name] = edges
    return graph


def test_no_rlcore_module_imports_one_that_imports_it_back():
    """Imports run one way: no two modules import each other, through any chain, not even through a
    function-local or type-checking import (STYLE.md)."""
    graph, state, cycles = import_graph(), {}, []

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert len(graph) > 40 and cycles == []


def test_the_top_of_the_package_holds_only_the_loop_and_what_it_calls_directly():
    """The folder list is the architecture: every other module sits in the package of its concern."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "rlcore"
    assert sorted(p.name for p in root.glob("*.py")) == ["__init__.py", "cli.py", "evaluation.py", "forward.py",
                                                         "sft.py", "train.py"]
