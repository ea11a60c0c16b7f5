"""Nothing in pagedllm/ (nor in the suites under benchmarks/) patches pagedllm: no `monkeypatch`, no `mock.patch`
of a pagedllm name, no setattr, delattr or attribute assignment on a module, class or function imported from
pagedllm. Test tooling reaches the engine through its seams (LLMEngine's wrap_executor, EngineCore's listeners
and step gates). tests/ may patch, and is not walked."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WALKED = ("pagedllm", "benchmarks")
PATCHERS = {"patch", "object", "dict", "multiple"}   # mock.patch, mock.patch.object / .dict / .multiple


def _imported_from_pagedllm(tree: ast.Module) -> set[str]:
    """The names a file binds to pagedllm modules and to what it imports from them."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.asname or alias.name.partition(".")[0] for alias in node.names
                      if alias.name.partition(".")[0] == "pagedllm"}
        elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("pagedllm")):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _root(node: ast.expr) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def patches_in(source: str, filename: str = "<source>") -> list[str]:
    """Every place the source patches a pagedllm name, as 'file:line what'."""
    tree = ast.parse(source, filename)
    ours = _imported_from_pagedllm(tree)
    found = []

    def report(node: ast.AST, what: str) -> None:
        found.append(f"{filename}:{node.lineno} {what}")

    for node in ast.walk(tree):
        bound = node.id if isinstance(node, ast.Name) else node.arg if isinstance(node, ast.arg) else None
        if bound == "monkeypatch" or isinstance(node, ast.Attribute) and node.attr == "monkeypatch":
            report(node, "uses monkeypatch")
        elif isinstance(node, ast.Call) and node.args:
            func, target = node.func, node.args[0]
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            is_patch = name in PATCHERS and "patch" in ast.unparse(func)
            if name in ("setattr", "delattr") and _root(target) in ours:
                report(node, f"{name} on {ast.unparse(target)}")
            elif is_patch and (_root(target) in ours or (isinstance(target, ast.Constant)
                                                         and str(target.value).startswith("pagedllm"))):
                report(node, f"{ast.unparse(func)} of {ast.unparse(target)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for target in targets:
                for element in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(element, ast.Attribute) and _root(element) in ours:
                        report(node, f"assigns {ast.unparse(element)}")
    return found


def test_nothing_outside_the_tests_patches_pagedllm():
    found = [problem for folder in WALKED for path in sorted((ROOT / folder).rglob("*.py"))
             for problem in patches_in(path.read_text(), str(path.relative_to(ROOT)))]
    assert not found, "patching instead of a seam:\n" + "\n".join(found)


@pytest.mark.parametrize("source", [
    "from pagedllm.engine import llm_engine\nllm_engine.LLMEngine.step = lambda self: []\n",
    "from pagedllm.engine.output_processor import OutputProcessor as O\nO.process += 1\n",
    "import pagedllm.engine.core\npagedllm.engine.core.EngineCore.step = None\n",
    "from pagedllm.worker.model_runner import ModelRunner\nsetattr(ModelRunner, 'execute_model', None)\n",
    "from . import api_server\ndel api_server.build_app\n",
    "from unittest import mock\nwith mock.patch('pagedllm.engine.core.EngineCore.step'):\n    pass\n",
    "from unittest import mock\nfrom pagedllm.entrypoints.openai import auth\nmock.patch.object(auth, 'x', 1)\n",
    "def test(monkeypatch):\n    pass\n",
])
def test_each_way_of_patching_is_found(source):
    assert patches_in(source), source


@pytest.mark.parametrize("source", [
    "from pagedllm.engine.core import EngineCore\ncore = EngineCore()\ncore.step_gates.append(print)\n",
    "from pagedllm.engine.core import EngineCore\nclass Mine(EngineCore):\n    def step(self):\n        pass\n",
    "import hmac\nfrom unittest import mock\nmock.patch.object(hmac, 'compare_digest', print)\n",
    "class A:\n    pass\nA.x = 1\nself_like = A()\nself_like.y = 2\n",
])
def test_seams_and_foreign_patches_are_not_found(source):
    assert patches_in(source) == []
