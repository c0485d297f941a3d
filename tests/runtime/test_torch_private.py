"""Private torch APIs are used by the runtime only through autopart/runtime/_torch_private.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RUNTIME = Path(__file__).resolve().parents[2] / "autopart" / "runtime"
SHIM = "_torch_private.py"
ALLOWED_MODULES = {"torch.utils._pytree"}
# private torch names reached through objects the scan cannot type (a tensor, a stage, a
# module): any attribute of these names outside the shim counts as a private torch use
KNOWN = {"_version", "_IncompatibleKeys", "_load_csv", "_get_default_store", "_to_tensor",
         "_prepare_schedule_with_comms", "_load_actions", "_orig_mod", "args_recv_info",
         "grad_recv_info", "pipeline_order"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _torch_module(module: str) -> bool:
    return module == "torch" or module.startswith("torch.")


def _root(node: ast.expr) -> ast.expr:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def violations(source: str) -> list[str]:
    """Each use of a private torch name in ``source``: ``"line: what"``."""
    tree = ast.parse(source)
    torch_names: set[str] = set()  # local names bound to torch modules or objects
    bad: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _torch_module(alias.name):
                    if alias.name not in ALLOWED_MODULES and any(
                            _private(p) for p in alias.name.split(".")):
                        bad.append(f"{node.lineno}: import {alias.name}")
                    torch_names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and _torch_module(node.module):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full not in ALLOWED_MODULES and node.module not in ALLOWED_MODULES and any(
                        _private(p) for p in full.split(".")):
                    bad.append(f"{node.lineno}: from {node.module} import {alias.name}")
                torch_names.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        root = _root(node)
        if node.attr in KNOWN:
            bad.append(f"{node.lineno}: .{node.attr}")
        elif _private(node.attr) and isinstance(root, ast.Name) and root.id in torch_names:
            bad.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (_private(node.attr) and isinstance(root, ast.Call)
              and isinstance(root.func, ast.Name) and root.func.id == "super"):
            bad.append(f"{node.lineno}: super().{node.attr}")  # a torch base class's
    return bad


@pytest.mark.parametrize("path", sorted(p.name for p in RUNTIME.glob("*.py") if p.name != SHIM))
def test_no_runtime_module_but_the_shim_touches_a_private_torch_name(path: str) -> None:
    found = violations((RUNTIME / path).read_text(encoding="utf-8"))
    assert found == [], f"autopart/runtime/{path} uses private torch names (move them into " \
                        f"{SHIM}): {found}"


def test_the_scan_finds_what_it_looks_for() -> None:
    source = '''
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
from torch import nn
# dist.distributed_c10d._get_default_store() in a comment is not code
text = "runtime._load_csv(f)"
store = dist.distributed_c10d._get_default_store()
keys = nn.modules.module._IncompatibleKeys([], [])
v = tensor._version
flat = pytree.tree_flatten(x)
class S(Base):
    def _to_tensor(self, a):
        return super()._to_tensor(a)
'''
    found = violations(source)
    # the private import, the store, the named tuple, the version counter, super()'s method;
    # not the allowed pytree, nor the comment (line 7) or the string (line 8)
    assert sorted(int(f.split(":")[0]) for f in found) == [5, 9, 10, 11, 15], found


def test_the_shim_is_where_they_are() -> None:
    assert violations((RUNTIME / SHIM).read_text(encoding="utf-8")) != []
