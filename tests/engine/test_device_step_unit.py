"""A step on the device path, checked on a machine without a GPU.

- On the ``meta`` device every op checks that its tensors share a device, and nothing can
  be copied back to the host: the model's tiled step and the device part of the sampler
  run there, so a tensor left on the CPU (or a host sync) in either fails here as it
  would on CUDA.
- The tiled path (one host-to-device copy, RoPE writing the cache, attention from the
  cache) gives the logits of the CPU path, through Triton's interpreter.
- The kernels a decoder layer launches in a decode step are counted (the issue's bound:
  at most 12 in eager mode).
"""

from types import SimpleNamespace

import pytest
import torch
import transformers

from worker.engine.model_runner import ModelRunner
from worker.engine.sampling import SamplingPlan, SamplingRow, SamplingParams, sample_on_device
from worker.engine.scheduler import ScheduledSeq
from worker.models import triton_kernels
from worker.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.unit
needs_triton = pytest.mark.skipif(not triton_kernels.available(), reason="needs triton")

BLOCK = 4


def config(layers=2, **kw):
    base = dict(vocab_size=300, hidden_size=96, intermediate_size=128,
                num_hidden_layers=layers, num_attention_heads=6, num_key_value_heads=2,
                max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True)
    base.update(kw)
    return transformers.LlamaConfig(**base)


def meta_model(cfg) -> LlamaForCausalLM:
    with torch.device("meta"):
        return LlamaForCausalLM(cfg).to(torch.bfloat16)


def seq(tokens, computed, blocks):
    return SimpleNamespace(token_ids=list(tokens), num_computed=computed, block_table=blocks)


def decode_step(batch: int, context: int):
    """``batch`` decoding sequences with ``context`` tokens each (the last one new)."""
    per = -(-context // BLOCK)
    return [ScheduledSeq(seq(range(context), context - 1, list(range(i * per, (i + 1) * per))), 1)
            for i in range(batch)]


def test_meta_is_a_device_check():
    # the mechanism the tests below rely on: meta refuses a CPU operand and a host copy
    with pytest.raises(RuntimeError):
        torch.ones(2, device="meta") + torch.ones(2)
    with pytest.raises(Exception):
        torch.ones(2, device="meta").tolist()


@needs_triton
def test_tiled_step_keeps_every_tensor_on_the_device():
    model = meta_model(config())
    runner = ModelRunner(model, num_blocks=64, block_size=BLOCK, tiled=True)
    scheduled = decode_step(3, 9) + [
        ScheduledSeq(seq(range(40), 0, list(range(40, 50))), 40)]  # a prefill beside them
    logits, rows = runner.run(scheduled)
    assert logits.device.type == "meta" and logits.shape == (4, 300) and rows == [0, 1, 2, 3]


def test_sampling_keeps_every_tensor_on_the_device():
    def row(seed, **kw):
        return SamplingRow(SamplingParams(**kw), torch.Generator().manual_seed(seed),
                           [1, 2, 3], [4, 4, 5])

    rows = [row(0, temperature=0), row(1, temperature=0.7, top_p=0.9, top_k=5, min_p=0.1),
            row(2, temperature=1.0, logprobs=3), row(3, temperature=0.2, repetition_penalty=1.3,
                                                     presence_penalty=0.5, frequency_penalty=0.2)]
    logits = torch.empty(4, 300, device="meta")
    plan = SamplingPlan.build(rows, logits.device)
    packed = sample_on_device(logits, plan)
    assert packed.device.type == "meta" and packed.shape == (4, 2 + 2 * 3)


def test_guided_masking_keeps_every_tensor_on_the_device():
    from worker.engine.logits_process import FusedLogitsProcessor
    from worker.engine.sampling import SamplingInputs

    class Manager:  # a manager's host side: a CPU bitmask and a UTF-8 ban list
        stop_token_ids = [2]
        bitmask = torch.full((4, 10), -1, dtype=torch.int32)

        def fill_bitmask(self, rows, matchers):
            self.bitmask[rows, 0] = 0b1010

        def apply_bitmask(self, logits, n):
            from worker.guided.bitmask import apply_token_bitmask_inplace

            apply_token_bitmask_inplace(logits[:n], self.bitmask[:n])

        def ban_utf8(self, row, output_ids):
            self.bitmask[row, 0] &= ~((1 << 7) | (1 << 9))

        def allowed(self, row, token):
            return True

    rows = [SamplingRow(SamplingParams(temperature=0.5), torch.Generator().manual_seed(0),
                        [1], [2])]
    proc = FusedLogitsProcessor(SamplingInputs(rows, [object()]), Manager())
    proc.prepare()
    logits = torch.empty(1, 300, device="meta")
    packed = sample_on_device(logits, SamplingPlan.build(rows, logits.device), proc)
    assert packed.device.type == "meta"


@needs_triton
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiled_path_matches_the_cpu_path(family):
    torch.manual_seed(0)
    if family == "qwen3":  # per-head q/k norms, fused into the RoPE kernel
        cfg = transformers.Qwen3Config(**dict(config().to_dict(), head_dim=32,
                                              model_type="qwen3"))
    else:
        cfg = config()
    model = LlamaForCausalLM(cfg)
    assert model.layers[0].self_attn.qk_norm == (family == "qwen3")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    model.rotary.reset_tables()
    plain = ModelRunner(model, num_blocks=64, block_size=BLOCK, tiled=False)
    tiled = ModelRunner(model, num_blocks=64, block_size=BLOCK, tiled=True)
    a, b = [5, 17, 42, 99, 3, 250, 7, 8, 9, 11, 12], list(range(20, 57))
    sa, sb = seq(a, 0, [3, 9, 1, 12]), seq(b, 0, [20, 4, 11, 30, 8, 2, 7, 6, 5, 40])
    steps = [
        [ScheduledSeq(sa, len(a)), ScheduledSeq(sb, 20)],  # a whole prompt, b's first chunk
        [ScheduledSeq(sb, 17)],  # b's second chunk after 20 cached tokens
    ]
    for step in steps:
        want, rows_w = plain.run(step)
        got, rows_g = tiled.run(step)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert rows_g == rows_w
        for s in step:
            s.seq.num_computed += s.num_tokens
    for token in (13, 14, 15):  # decode rows, both sequences at once
        for s in (sa, sb):
            s.token_ids.append(token)
        step = [ScheduledSeq(sa, 1), ScheduledSeq(sb, 1)]
        want, _ = plain.run(step)
        got, _ = tiled.run(step)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        sa.num_computed += 1
        sb.num_computed += 1


def kernels_per_layer(cfg_kw: dict, batch: int = 1, context: int = 128) -> dict[str, int]:
    """Kernels one decoder layer launches in a decode step on the device path (the
    difference between a model of two layers and one of one, on meta)."""
    def count(layers):
        model = meta_model(config(layers, **cfg_kw))
        runner = ModelRunner(model, num_blocks=batch * (context // BLOCK + 1) + 1,
                             block_size=BLOCK, tiled=True)
        return triton_kernels.count_kernels(runner.run, decode_step(batch, context))[1]

    two, one = count(2), count(1)
    return {k: two.get(k, 0) - one.get(k, 0) for k in two if two.get(k, 0) != one.get(k, 0)}


@needs_triton
def test_a_decoder_layer_is_nine_kernels_in_a_decode_step():
    per_layer = kernels_per_layer({})
    assert sum(per_layer.values()) <= 12, per_layer
    assert per_layer == {"rms_norm": 2, "rope_and_cache": 1, "paged_attention": 1,
                         "silu_mul": 1, "aten.linear": 4}, per_layer  # a GEMM each


def test_a_cpu_kv_cache_is_zero_and_resident_only_where_written():
    """model_runner.zeroed: the CPU cache is the kernel's zero pages (no time to zero
    kv_cache_gb at a worker's start, no memory for blocks never written)."""
    from worker.engine.model_runner import zeroed

    def resident_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    before = resident_mb()
    kv = zeroed((2**20, 4, 64), torch.float32, torch.device("cpu"))  # 1 GiB
    assert kv.shape == (2**20, 4, 64) and kv.dtype == torch.float32 and kv.is_contiguous()
    assert resident_mb() - before < 64
    kv[123] = 2.0
    assert kv[123].eq(2.0).all() and kv[:64].eq(0).all() and kv[-64:].eq(0).all()
    assert resident_mb() - before < 64
    assert zeroed((0, 4, 64), torch.float16, torch.device("cpu")).shape == (0, 4, 64)
    meta = zeroed((8, 2), torch.float16, torch.device("meta"))
    assert meta.device.type == "meta" and meta.shape == (8, 2)
