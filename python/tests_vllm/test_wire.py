"""The backend's layout, headers, notifications and checksum, and its
registration with vLLM: host tests (no RDMA device needed)."""

import random
from dataclasses import asdict

import pytest
import torch

from gpudirect.vllm import _wire


def layout(nbytes, bucket):
    """Every parameter's bytes, rebuilt from the plan's pieces."""
    p = _wire.plan(nbytes, bucket)
    got = {i: [] for i in range(len(nbytes))}
    for k, pieces in enumerate(p.buckets):
        for piece in pieces:
            assert 0 <= piece.at and piece.at + piece.length <= p.length(k), (k, piece)
            assert piece.at % 4 == 0 or piece.start > 0
            got[piece.index].append((k, piece))
    return p, got


def test_each_parameter_is_covered_once_in_order_and_ends_on_its_last_piece():
    rng = random.Random(5)
    for _ in range(300):
        bucket = _wire.ALIGN * rng.randint(1, 40)
        nbytes = [rng.choice([0, 1, 2, 4, 255, 256, 257, rng.randint(0, 30000)]) for _ in range(rng.randint(0, 30))]
        p, got = layout(nbytes, bucket)
        assert p.total % _wire.ALIGN == 0 and p.count * bucket >= p.total > (p.count - 1) * bucket or p.total == 0
        for i, n in enumerate(nbytes):
            pieces = got[i]
            assert pieces, f"parameter {i} is in no bucket"
            assert sum(pc.length for _, pc in pieces) == n
            assert [pc.start for _, pc in pieces] == [sum(pc.length for _, pc in pieces[:j]) for j in range(len(pieces))]
            assert [pc.last for _, pc in pieces] == [False] * (len(pieces) - 1) + [True]
            ks = [k for k, _ in pieces]
            assert ks == sorted(ks) and (n == 0 or ks == list(range(ks[0], ks[0] + len(ks))))
        for k in range(p.count):
            assert p.length(k) > 0, f"bucket {k} of {p.count} carries nothing"
        assert p.by_parameter() == [got[i] for i in range(len(nbytes))]


def test_bucket_sizes_must_be_aligned_positive_and_bounded():
    for bad in (0, -256, 255, 1000, 3 << 40, True, 256.0, "256"):
        with pytest.raises(ValueError, match="multiple of 256"):
            _wire.plan([1], bad)


def test_a_header_round_trips_and_garbage_is_not_one():
    h = _wire.Header(0xFEEDFACECAFEBEEF, 7, 3, 4096, 123456789)
    raw = h.pack()
    assert len(raw) == _wire.HEADER and _wire.Header.unpack(raw) == h
    assert _wire.Header.unpack(bytes(_wire.HEADER)) is None
    assert _wire.Header.unpack(raw[:10]) is None


def test_notes_round_trip_and_malformed_ones_are_none():
    n = _wire.Note("nak", 0x0123456789ABCDEF, 12, 4, "load_weights failed: shape mismatch")
    assert _wire.Note.decode(n.encode()) == n
    assert _wire.Note.decode(_wire.Note("put", 1, 1, 0, nonce=0xDEADBEEF).encode()) == _wire.Note("put", 1, 1, 0, nonce=0xDEADBEEF)
    for bad in (b"", b"step 1", b"gdvw1 ", b"gdvw1 put", b"gdvw1 zap 0000000000000001 1 0 00000000", b"gdvw1 put 01 1 0 00000000",
                b"gdvw1 put 0000000000000001 x 0 00000000", b"gdvw1 put 0000000000000001 -1 0 00000000",
                b"gdvw1 put 000000000000000g 1 0 00000000", b"gdvw1 put 0000000000000001 1 -3 00000000",
                b"gdvw1 put 0000000000000001 1 0", b"gdvw1 put 0000000000000001 1 0 0000000", b"gdvw1 put 0000000000000001 \xd9\xa1 0 00000000",
                b"gdvw1 put 0000000000000001 1 0 0000000G", bytes(range(256))):
        assert _wire.Note.decode(bad) is None, bad


def test_the_checksum_sees_a_flipped_byte_and_swapped_words():
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8, generator=g)
    c = _wire.checksum(a)
    b = a.clone()
    b[12345] ^= 1
    assert _wire.checksum(b) != c
    s = a.clone()
    s[0:4], s[4:8] = a[4:8].clone(), a[0:4].clone()
    assert (a[0:4] != a[4:8]).any() and _wire.checksum(s) != c
    assert _wire.checksum(a.clone()) == c


def test_vllm_loads_the_plugin_and_both_factories_know_the_backend():
    import vllm.plugins
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    vllm.plugins.load_general_plugins()
    assert "gpudirect" in WeightTransferEngineFactory._registry
    assert "gpudirect" in WeightTransferTrainerFactory._registry
    from gpudirect import vllm as gv

    gv.register()  # again: nothing happens, nothing raises
    assert WeightTransferEngineFactory._registry["gpudirect"]() is gv.GpudirectWeightTransferEngine
    assert WeightTransferTrainerFactory._registry["gpudirect"]() is gv.GpudirectTrainerWeightTransferEngine


def test_init_and_update_info_refuse_what_cannot_work():
    from gpudirect.vllm import GpudirectWeightTransferInitInfo as I, GpudirectWeightTransferUpdateInfo as U

    ok = dict(rendezvous="127.0.0.1:1", group="g", session="0123456789abcdef", num_workers=2)
    I(**ok)
    for k, v in [("session", "xyz"), ("session", "0123456789abcdeg"), ("num_workers", 0), ("bucket_bytes", 100), ("timeout", 0),
                 ("timeout", float("inf")), ("timeout", float("nan")), ("rank_offset", -1)]:
        with pytest.raises(ValueError):
            I(**{**ok, k: v})
    u = U(names=["a", "b"], dtype_names=["float32", "bfloat16"], shapes=[[2, 3], [5]], version=1, session="0123456789abcdef")
    assert u.nbytes() == [24, 10]
    assert U(**asdict(u)) == u, "what the trainer sends is what the worker parses"
    for k, v in [("dtype_names", ["float32"]), ("dtype_names", ["float32", "Tensor"]), ("shapes", [[2], [-1]]), ("version", 0),
                 ("version", True), ("session", "")]:
        with pytest.raises(ValueError):
            U(**{**dict(names=["a", "b"], dtype_names=["float32", "bfloat16"], shapes=[[2, 3], [5]], version=1, session="0123456789abcdef"), k: v})


def test_no_secret_is_refused_at_init_naming_the_fix(monkeypatch):
    from gpudirect.vllm import GpudirectTrainerInitInfo, WeightTransferError
    from gpudirect.vllm.trainer import GpudirectTrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.base import ModuleSource

    monkeypatch.delenv("GPUDIRECT_SECRET_FILE", raising=False)
    monkeypatch.delenv("GPUDIRECT_SECRET", raising=False)

    class Client:
        called = []

        def __getattr__(self, name):
            return lambda *a, **k: self.called.append(name)

    client = Client()
    with pytest.raises(WeightTransferError, match="GPUDIRECT_SECRET_FILE") as e:
        GpudirectTrainerWeightTransferEngine.trainer_init(
            GpudirectTrainerInitInfo(rendezvous="127.0.0.1:1", num_workers=1, rank=0), client=client, source=ModuleSource(torch.nn.Linear(2, 2))
        )
    assert "32 random bytes" in str(e.value)
    assert client.called == [], "nothing reached the inference side"
    with pytest.raises(WeightTransferError, match="not a readable file"):
        GpudirectTrainerWeightTransferEngine.trainer_init(
            GpudirectTrainerInitInfo(rendezvous="127.0.0.1:1", num_workers=1, rank=0, secret_file="/nonexistent"),
            client=client, source=ModuleSource(torch.nn.Linear(2, 2)),
        )


def test_a_worker_without_a_secret_refuses_init_naming_the_fix(monkeypatch):
    import vllm.plugins
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from gpudirect.vllm import WeightTransferError

    monkeypatch.delenv("GPUDIRECT_SECRET_FILE", raising=False)
    monkeypatch.delenv("GPUDIRECT_SECRET", raising=False)
    vllm.plugins.load_general_plugins()
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="gpudirect"), VllmConfig(), torch.device("cpu"), torch.nn.Linear(2, 2))
    info = engine.parse_init_info(dict(rendezvous="127.0.0.1:1", group="g", session="0123456789abcdef", num_workers=1))
    with pytest.raises(WeightTransferError, match="GPUDIRECT_SECRET_FILE"):
        engine.init_transfer_engine(info)
    with pytest.raises(WeightTransferError, match="not initialized"):
        engine.update_weights(dict(names=["x"], dtype_names=["float32"], shapes=[[1]], version=1, session="0123456789abcdef"))
    with pytest.raises(ValueError, match="Invalid update_info"):
        engine.update_weights(dict(names=[], version=1))


def test_sizes_from_an_update_are_bounded_before_anything_is_laid_out_or_allocated():
    import time

    from gpudirect.vllm import GpudirectWeightTransferUpdateInfo as U

    t = time.monotonic()
    with pytest.raises(ValueError, match="more than"):
        _wire.plan([1 << 62], 1 << 20)
    with pytest.raises(ValueError, match="more than"):
        _wire.plan([1 << 20] * 5000, 1024)
    with pytest.raises(ValueError, match="at most"):
        _wire.plan([0] * (_wire.MAX_PARAMS + 1), 1 << 20)
    with pytest.raises(ValueError, match="at most"):
        U(names=["a"] * (_wire.MAX_PARAMS + 1), dtype_names=[], shapes=[], version=1, session="0123456789abcdef")
    with pytest.raises(ValueError, match="lists"):
        U(names="ab", dtype_names="ab", shapes=[[1], [1]], version=1, session="0123456789abcdef")
    assert time.monotonic() - t < 5, "refusing took long"


def test_a_worker_refuses_an_update_far_larger_than_its_model_and_a_secret_path_in_the_init_info(monkeypatch):
    import vllm.plugins
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    vllm.plugins.load_general_plugins()
    model = torch.nn.Linear(256, 256)
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="gpudirect"), VllmConfig(), torch.device("cpu"), model)
    with pytest.raises(ValueError, match="4x the model"):
        engine.update_weights(dict(names=["w"], dtype_names=["float32"], shapes=[[1 << 30]], version=1, session="0123456789abcdef"))
    with pytest.raises(ValueError, match="secret_file"):
        # Whoever reaches vLLM's routes must not choose the worker's secret.
        engine.parse_init_info(dict(rendezvous="127.0.0.1:1", group="g", session="0123456789abcdef", num_workers=1, secret_file="/etc/hostname"))
