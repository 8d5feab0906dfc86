"""Per-rank memory of a training step, estimated without the cluster.

    python -m vefsdp_optim.estimate --model llama3-70b --dp 128 --tp 8 \\
        --sharding fsdp2 --optimizer Muon --ranks 0,511,1023

``--config config.json`` takes the model from a Hugging Face ``config.json`` (llama and
mistral; the mixtures of experts deepseek_v3, qwen3_moe and mixtral) or from torchtitan's
llama3 fields instead of ``--model`` (``config_from_dict``). ``--ep`` shards a mixture of
experts' experts over that many of the data-parallel ranks (torchtitan's layout)::

    python -m vefsdp_optim.estimate --model deepseek-v3-671b --dp 1024 --ep 64 --ac full

Each rank asked for is played by its own process, as torchtitan's estimator does: the
model, its sharding and the optimizer are built on fake tensors (FakeTensorMode) under
torch's fake process group, two training steps run (the first makes the optimizer's
state), and torch's ``MemTracker`` reports the peak by category (parameters, gradients,
optimizer state, activations, temporaries and communication buffers). Nothing is
allocated, so a 70B model on 1,024 ranks runs on a laptop. The optimizer's state is
broken down by kind (Adam moments, 8-bit codes and scales, Muon momentum, Shampoo and
SOAP factors and roots); with ``--sharding ours`` and with Shampoo and SOAP the state
differs between ranks, so ask for several ranks: the report gives the busiest and the
median of those asked.

Fake CUDA tensors need a CUDA driver once a mesh or a backward touches them (torch's
FSDP2 asks for the current device and its streams): without one, the tensors are fake
CPU tensors, whose bytes are the same (``--device`` says which).
"""

from __future__ import annotations

from ._config import CONFIGS, ModelConfig, config_from_dict
from ._estimate import (
    OPTIMIZERS,
    STATE_KINDS,
    estimate_rank,
    main,
    real_tensors_on_the_fake_group,
    state_by_kind,
)
from ._model import Transformer

__all__ = ["CONFIGS", "ModelConfig", "OPTIMIZERS", "STATE_KINDS", "Transformer", "config_from_dict",
           "estimate_rank", "main", "real_tensors_on_the_fake_group", "state_by_kind"]
