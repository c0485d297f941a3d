"""What every rank of a multi-rank test imports, imported once per test session by the server
that launches fork from (:mod:`tests.distributed.spawned`): each rank then starts with torch,
autopart and the zoo's transformers models loaded instead of importing them again (about 8 s
of CPU per rank on a 2-core machine, a large part of a small test's time).

Nothing here runs a tensor op: a forked rank must not inherit a started intra-op thread pool.
"""

from __future__ import annotations

import torch.distributed  # noqa: F401
import torch.distributed.pipelining  # noqa: F401
import transformers

import autopart  # noqa: F401
import autopart.api  # noqa: F401
import autopart.runtime.distributed  # noqa: F401

for _name in ("GPT2LMHeadModel", "LlamaForCausalLM", "BertForMaskedLM"):
    getattr(transformers, _name)  # transformers imports a model's module on first access
