"""Shared fixtures: CPU only by default; GPU tests carry the requires_cuda marker."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
