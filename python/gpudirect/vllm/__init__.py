"""RL weight sync in vLLM over gpudirect: the weight-transfer backend
``gpudirect``.

Installed with ``pip install gpudirect[vllm]``, it registers itself in
every vLLM process through the ``vllm.general_plugins`` entry point, on
the worker side (``WeightTransferEngineFactory``) and the trainer side
(``WeightTransferTrainerFactory``). A vLLM server then takes
``--weight-transfer-config '{"backend": "gpudirect"}'``, and a trainer
makes its engine with::

    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from gpudirect.vllm import GpudirectTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        GpudirectTrainerInitInfo(rendezvous="10.0.0.1:29600", serve_rendezvous=True, num_workers=8, rank=0),
        client=client, source=ModuleSource(model))
    engine.send_weights()          # after every step

Every process needs the cluster's secret (``GPUDIRECT_SECRET_FILE``);
without it the engines refuse to start, naming the fix.

What an update guarantees: a worker's ``update_weights`` returns only when
every byte of that version arrived (each bucket's notification comes
after its data, and its header names its session, version and bucket);
bytes and notifications of another version or session are refused and
counted; a trainer or worker that dies or stalls makes the other side
raise :class:`WeightTransferError` within the ``timeout`` of the init
info, naming who, which version and which bucket, never a hang or a
success. The trainer's NIC sends each bucket once, whatever the number
of workers (a relay broadcast: workers forward to each other).

Importing the engines imports vLLM and torch; importing this package
alone does not.
"""

from __future__ import annotations

from typing import Any

from ._common import WeightTransferError, WeightTransferTimeout

__all__ = [
    "register",
    "WeightTransferError",
    "WeightTransferTimeout",
    "GpudirectWeightTransferEngine",
    "GpudirectWeightTransferInitInfo",
    "GpudirectWeightTransferUpdateInfo",
    "GpudirectTrainerWeightTransferEngine",
    "GpudirectTrainerInitInfo",
]

BACKEND = "gpudirect"
"""The name vLLM selects the backend by."""


def register() -> None:
    """Registers the backend with vLLM's two factories (the
    ``vllm.general_plugins`` entry point calls it in each vLLM process).
    Lazily: the engines' module is imported when the backend is used.
    Registering again does nothing."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "gpudirect.vllm.worker", "GpudirectWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "gpudirect.vllm.trainer", "GpudirectTrainerWeightTransferEngine")


def __getattr__(name: str) -> Any:
    if name in ("GpudirectWeightTransferEngine", "GpudirectWeightTransferInitInfo", "GpudirectWeightTransferUpdateInfo"):
        from . import worker

        return getattr(worker, name)
    if name in ("GpudirectTrainerWeightTransferEngine", "GpudirectTrainerInitInfo"):
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'gpudirect.vllm' has no attribute {name!r}")
