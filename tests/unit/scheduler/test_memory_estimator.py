"""MARP (scheduler/memory_model.py) against hand-computed cases, sharding rules and monotonicity."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduler.memory_model import (
    CPU_MEASURED,
    CPU_SDPA_MEASURED,
    MEGATRON_GPU,
    MEGATRON_SDPA_GPU,
    MEGATRON_TE_FLASH_GPU,
    MemoryBreakdown,
    MemoryModelError,
    ParallelPlan,
    _adam_temporaries,
    estimate_memory,
    frenzy_estimate,
    frenzy_parameters,
    layer_activation_terms,
    profile_for_device,
    stage_parameters,
    static_bytes,
)
from training.config import ModelConfig, TrainingConfig

# A small Llama block whose numbers are easy to do by hand:
# h=64, 4 heads of 16, 2 kv heads (K = 32), f=128, V=100, s=8.
SMALL = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=128, vocab_size=100, seq_length=8)
SMALL_PARAMS = (
    2 * (64 * (64 + 2 * 32) + 64 * 64 + 2 * 64 * 128 + 128 * 64 + 2 * 64)  # layers: 2 × 36,992
    + 2 * 100 * 64  # untied embedding + output layer
    + 64  # final norm
)  # = 86,848

SEVEN_B = ModelConfig(num_layers=32, hidden_size=4096, num_attention_heads=32, ffn_hidden_size=11008,
                      vocab_size=32000, seq_length=4096)


def test_parameter_count_by_hand():
    assert SMALL_PARAMS == 86_848
    assert SMALL.num_parameters() == SMALL_PARAMS
    params, largest = stage_parameters(SMALL, tp=1, pp=1, stage=0)
    assert params == SMALL_PARAMS
    assert largest == 2 * 64 * 128  # fc1 (gate + up) beats the 100 × 64 embedding


def test_static_bytes_per_precision_and_sharding():
    p = 1000
    fp32 = ParallelPlan(global_batch_size=8, dp=4, precision="fp32")
    assert static_bytes(p, fp32) == (4000, 4000, 8000)  # 16 bytes/param: w, grad, m, v
    bf16 = ParallelPlan(global_batch_size=8, dp=4, precision="bf16")
    assert static_bytes(p, bf16) == (2000, 4000, 12000)  # 18: bf16 w, fp32 grad, fp32 master+m+v
    bf16_dist = ParallelPlan(global_batch_size=8, dp=4, precision="bf16", distributed_optimizer=True)
    assert static_bytes(p, bf16_dist) == (2000, 4000, 3000)  # fp32 state / dp: 12000 / 4
    fp32_dist = ParallelPlan(global_batch_size=8, dp=4, precision="fp32", distributed_optimizer=True)
    assert static_bytes(p, fp32_dist) == (4000, 4000, 2000)


def test_distributed_optimizer_shards_only_the_optimizer_state():
    plain = estimate_memory(SEVEN_B, ParallelPlan(global_batch_size=64, dp=8, tp=4), MEGATRON_GPU)
    sharded = estimate_memory(SEVEN_B, ParallelPlan(global_batch_size=64, dp=8, tp=4,
                                                    distributed_optimizer=True), MEGATRON_GPU)
    assert sharded.weights == plain.weights and sharded.gradients == plain.gradients
    assert sharded.optimizer_states == pytest.approx(plain.optimizer_states / 8, abs=1)


def test_layer_activations_by_hand_fp32_no_recompute():
    # fp32 (4 bytes), tokens = s·b = 16, t = 1. Per token the layer keeps:
    #   norms: 2 × (normalised h + output h) = 4h;  q, repeated k, repeated v, context: 4h;
    #   attention residual and layer output: 2h  -> 10h = 640
    #   SwiGLU: fc1 output 2f, silu f, linear part f, product f -> 5f = 640
    #   two RMSNorm rstd values: 2
    # plus softmax probabilities b·a·s² = 2·4·64 = 512 elements and RoPE cos/sin 4·s·d = 512.
    plan = ParallelPlan(global_batch_size=2, micro_batch_size=2, precision="fp32")
    terms = layer_activation_terms(SMALL, plan, CPU_MEASURED)
    assert sum(terms.values()) == 16 * 4 * (640 + 640 + 2) + 512 * 4 + 512 * 4 == 86_144
    assert terms["attention_probs"] == 2 * 4 * 8 * 8 * 4


def test_layer_activations_by_hand_recompute_modes():
    plan = ParallelPlan(global_batch_size=2, micro_batch_size=2, precision="fp32", recompute="selective")
    selective = layer_activation_terms(SMALL, plan, CPU_MEASURED)
    # No probabilities; attention keeps the qkv output (h + 2K = 128), q (64), k (32) and
    # context (64) = 288 per token instead of 4h = 256 + the probabilities; norms and
    # residuals 6h, MLP 5f, rstd 2, RoPE 512 elements as before.
    assert "attention_probs" not in selective
    assert sum(selective.values()) == 16 * 4 * (6 * 64 + 288 + 640 + 2) + 512 * 4 == 86_144
    # (at s = 8 the dropped probabilities, 2,048 bytes, equal the extra 32 per token kept;
    # the a·s² term wins as soon as sequences are longer)
    longer = SMALL.model_copy(update={"seq_length": 64})
    none_64 = layer_activation_terms(longer, ParallelPlan(global_batch_size=2, micro_batch_size=2,
                                                          precision="fp32"), CPU_MEASURED)
    sel_64 = layer_activation_terms(longer, ParallelPlan(global_batch_size=2, micro_batch_size=2,
                                                         precision="fp32", recompute="selective"), CPU_MEASURED)
    assert sum(sel_64.values()) < sum(none_64.values())
    full = layer_activation_terms(
        SMALL, ParallelPlan(global_batch_size=2, micro_batch_size=2, precision="fp32", recompute="full"),
        CPU_MEASURED)
    assert full == {"layer_output": 16 * 64 * 4}  # only the layer's input/output is kept


def test_tensor_and_sequence_parallel_divide_the_right_terms():
    base = dict(global_batch_size=2, micro_batch_size=2, precision="bf16")
    t1 = layer_activation_terms(SEVEN_B, ParallelPlan(**base), MEGATRON_GPU)
    t4 = layer_activation_terms(SEVEN_B, ParallelPlan(**base, tp=4), MEGATRON_GPU)
    sp = layer_activation_terms(SEVEN_B, ParallelPlan(**base, tp=4, sequence_parallel=True), MEGATRON_GPU)
    assert t4["fc1_out"] * 4 == t1["fc1_out"] and t4["attention_probs"] * 4 == t1["attention_probs"]
    assert t4["attention_residual"] == t1["attention_residual"]  # replicated without SP
    assert sp["attention_residual"] * 4 == t1["attention_residual"]
    assert sum(sp.values()) < sum(t4.values()) < sum(t1.values())


def test_breakdown_sums_to_total_and_reports_its_moment():
    bd = estimate_memory(SEVEN_B, ParallelPlan(global_batch_size=16, micro_batch_size=2, dp=2, tp=2, pp=2),
                         MEGATRON_GPU)
    assert isinstance(bd, MemoryBreakdown)
    parts = (bd.weights + bd.gradients + bd.optimizer_states + bd.activations + bd.logits
             + bd.transient + bd.persistent_buffers + bd.overhead)
    assert bd.total == parts
    assert bd.as_dict()["total"] == bd.total and bd.peak_event
    assert bd.overhead >= MEGATRON_GPU.fixed_overhead_bytes
    cpu = estimate_memory(SMALL, ParallelPlan(global_batch_size=2, precision="fp32"), CPU_MEASURED)
    assert cpu.overhead == 0  # MemTracker counts tensors only


def test_whole_step_by_hand_small_model():
    # fp32, b=2: the peak is the output layer's backward.
    #   static: 16 bytes × 86,848 params = 1,389,568, plus Adam's 0-dim fp32 step per
    #           parameter tensor (6 per layer × 2, embedding, final norm, output layer): 60
    #   stored: embedding output 16·64·4 = 4,096 + 2 layers × 86,144 + final norm
    #           (rstd 16·4 + normalised and output 2·16·64·4 = 8,256) + the RoPE table
    #           s·head_dim·4 = 512 + the loss's int64 labels and fp32 per-token loss
    #           16·12 = 192 and the loss scalar and its gradient 8 = 185,352
    #   logits (fp32 softmax kept by the loss): 16·100·4 = 6,400
    #   transient: output-weight gradient 100·64·4 + input gradient 16·64·4 = 29,696
    #   persistent: score buffer b·a·s²·4 = 2,048 + cached boolean causal mask s² = 64
    plan = ParallelPlan(global_batch_size=2, micro_batch_size=2, precision="fp32")
    bd = estimate_memory(SMALL, plan, CPU_MEASURED)
    assert bd.peak_event == "output-layer backward"
    assert bd.static == 16 * 86_848 + 4 * 15
    assert bd.activations == 4_096 + 2 * 86_144 + 8_256 + 512 + 192 + 8 == 185_352
    assert (bd.logits, bd.transient, bd.persistent_buffers) == (6_400, 29_696, 2_112)
    assert bd.total == 1_389_628 + 185_352 + 6_400 + 29_696 + 2_112


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_more_parallelism_or_recompute_never_needs_more_memory(precision):
    def total(**kw):
        args = dict(global_batch_size=64, micro_batch_size=2, precision=precision)
        args.update(kw)
        return estimate_memory(SEVEN_B, ParallelPlan(**args), MEGATRON_GPU).total

    assert total(tp=1) > total(tp=2) > total(tp=4) > total(tp=8)
    assert total(pp=1) > total(pp=2) > total(pp=4)
    assert total(recompute="none") > total(recompute="selective") > total(recompute="full")
    assert total(dp=1, distributed_optimizer=True) > total(dp=2, distributed_optimizer=True) > total(
        dp=8, distributed_optimizer=True)
    assert total(tp=4) > total(tp=4, sequence_parallel=True)
    assert total(micro_batch_size=1) < total(micro_batch_size=2) < total(micro_batch_size=4)


def test_1f1b_first_stage_holds_pp_microbatches():
    def stage0_acts(global_batch: int) -> int:
        return estimate_memory(SEVEN_B, ParallelPlan(global_batch_size=global_batch, pp=4, tp=8),
                               MEGATRON_GPU).activations

    # 1 microbatch: one in flight; 2: two; >= 4: pp = 4 in flight, no more.
    one, two, four, many = stage0_acts(1), stage0_acts(2), stage0_acts(4), stage0_acts(64)
    assert one < two < four == many


def test_flash_profile_has_no_quadratic_attention_terms():
    plan = ParallelPlan(global_batch_size=1, precision="bf16")
    terms = layer_activation_terms(SEVEN_B, plan, MEGATRON_TE_FLASH_GPU)
    assert not any("probs" in k for k in terms)
    flash = estimate_memory(SEVEN_B, plan, MEGATRON_TE_FLASH_GPU)
    assert flash.persistent_buffers == MEGATRON_TE_FLASH_GPU.allocator_workspace_bytes  # no score buffer
    assert flash.total < estimate_memory(SEVEN_B, plan, MEGATRON_GPU).total


def test_bf16_keeps_fp32_logits_and_softmax_copies():
    terms = layer_activation_terms(SEVEN_B, ParallelPlan(global_batch_size=1, precision="bf16"), MEGATRON_GPU)
    scores = 32 * 4096 * 4096
    assert terms["attention_probs"] == 2 * scores and terms["attention_probs_fp32"] == 4 * scores
    short = SEVEN_B.model_copy(update={"seq_length": 256})
    # With fused Adam the output layer's backward is the peak (with torch's foreach AdamW the
    # step's 4 bytes per matrix parameter beat it on a 7B model with 256 tokens).
    bd = estimate_memory(short, ParallelPlan(global_batch_size=1, precision="bf16"),
                         profile_for_device("A100-80G", "bf16", "local", fused_adam=True))
    assert bd.peak_event == "output-layer backward"
    # By the output layer's backward the fp32 logits are freed: the gradient reaching it is the
    # half copy the fp32 upcast's backward makes (256·32000·2). The fp32 logits themselves are
    # counted where they exist, at the cross-entropy forward (whatever the training precision;
    # see test_cross_entropy_forward_counts_its_int64_index_and_the_token_ids).
    assert bd.logits == 256 * 32000 * 2


def test_profile_for_device():
    """The profile follows the attention kernel the worker builds on that device."""
    assert profile_for_device("cpu") is CPU_MEASURED  # auto on CPU: megatron's unfused kernel
    assert profile_for_device("cpu", "fp32", "sdpa") is CPU_SDPA_MEASURED
    assert profile_for_device("A100-80G") is MEGATRON_SDPA_GPU  # auto, bf16 on a GPU: fused SDPA
    assert profile_for_device("A100-80G", "fp16") is MEGATRON_SDPA_GPU
    assert profile_for_device("A100-80G", "fp32") is MEGATRON_GPU  # no flash kernel in fp32
    assert profile_for_device("A100-80G", "bf16", "local") is MEGATRON_GPU
    assert profile_for_device("V100-32G", "fp16") is MEGATRON_GPU  # flash kernels need Ampere
    assert profile_for_device("some-new-accelerator") is MEGATRON_GPU  # unknown: the larger estimate


def test_sdpa_profile_drops_the_quadratic_terms_and_so_fits_longer_sequences():
    long = SEVEN_B.model_copy(update={"seq_length": 8192})
    plan = ParallelPlan(global_batch_size=1, tp=8, precision="bf16")
    unfused = estimate_memory(long, plan, MEGATRON_GPU)
    fused = estimate_memory(long, plan, MEGATRON_SDPA_GPU)
    assert "attention_probs" not in layer_activation_terms(long, plan, MEGATRON_SDPA_GPU)
    scores = plan.micro_batch_size * (long.num_attention_heads // 8) * 8192**2
    # per layer the unfused kernel keeps the probabilities in bf16 and in fp32
    assert unfused.activations - fused.activations >= long.num_layers * scores * 4


def test_plan_from_training_config():
    training = TrainingConfig(global_batch_size=32, micro_batch_size=4, steps=1, tensor_parallel=2,
                              recompute="selective", precision="bf16")
    plan = ParallelPlan.from_training(training, dp=4)
    assert (plan.dp, plan.tp, plan.num_microbatches, plan.gpus) == (4, 2, 2, 8)


@pytest.mark.parametrize(
    ("plan_kwargs", "message"),
    [
        (dict(global_batch_size=10, micro_batch_size=4), "multiple of micro_batch_size"),
        (dict(global_batch_size=8, dp=0), "dp must be >= 1"),
        (dict(global_batch_size=8, sequence_parallel=True), "sequence_parallel needs tp > 1"),
    ],
)
def test_impossible_plans_are_refused(plan_kwargs, message):
    with pytest.raises(MemoryModelError, match=message):
        ParallelPlan(**plan_kwargs)


def test_model_plan_mismatches_are_refused():
    with pytest.raises(MemoryModelError, match="tp=8 must divide"):
        estimate_memory(SMALL, ParallelPlan(global_batch_size=8, tp=8))
    with pytest.raises(MemoryModelError, match="pp=4 exceeds num_layers"):
        estimate_memory(SMALL, ParallelPlan(global_batch_size=8, pp=4))


def test_frenzy_formula_by_hand():
    # W = V·h + l·(12h² + 13h) = 6,400 + 2·(49,152 + 832) = 106,368
    assert frenzy_parameters(SMALL) == 106_368
    # 20W/t + s·B·h·l·(10/d + 24/(d·t) + 5·a·s/(d·h·t)) with s=8, B=4, d=2, t=1:
    #   2,127,360 + 8·4·64·2·(5 + 12 + 5·4·8/(2·64)) = 2,127,360 + 4,096·(17 + 1.25) = 2,202,112
    assert frenzy_estimate(SMALL, global_batch=4, dp=2, tp=1) == 2_202_112


def test_a_7b_model_does_not_fit_one_80g_gpu_but_fits_sharded():
    gib = 1024**3
    one = estimate_memory(SEVEN_B, ParallelPlan(global_batch_size=1), MEGATRON_GPU)
    assert one.static > 80 * gib and not one.fits(80 * gib)  # 18 bytes × 6.7 B parameters
    sharded = estimate_memory(SEVEN_B, ParallelPlan(global_batch_size=8, dp=2, tp=4, recompute="selective",
                                                    distributed_optimizer=True), MEGATRON_GPU)
    assert sharded.fits(80 * gib, safety_margin=0.1)
    assert not sharded.fits(sharded.total - 1)


def test_forward_backward_only_sizing_drops_optimizer_state_and_step():
    plan = ParallelPlan(global_batch_size=2, micro_batch_size=2, precision="bf16")
    full = estimate_memory(SMALL, plan, CPU_MEASURED)
    fwd_bwd = estimate_memory(SMALL, plan, CPU_MEASURED, optimizer=False)
    assert fwd_bwd.optimizer_states == 0 and fwd_bwd.peak_event != "optimizer step"
    assert fwd_bwd.weights == full.weights and fwd_bwd.gradients == full.gradients
    # bf16 weights: 2 bytes per parameter, except the 2·2·64 + 64 = 320 RMSNorm weights
    # that torch.nn.RMSNorm keeps in fp32 (4 bytes): 2 × 86,848 + 2 × 320
    assert full.weights == 2 * 86_848 + 2 * 320


# One layer, long sequence, tiny vocabulary: the attention's score-sized tensors decide the peak.
# b=1, s=256, 4 heads: S = 4·256² = 262,144 scores -> 524,288 B in bf16, 1,048,576 B in fp32;
# one hidden-sized bf16 tensor is 256·64·2 = 32,768 B. Measured with MemTracker (CPU, bf16,
# forward + backward): 4.29 MiB without recompute (peak at the forward softmax's half cast),
# 4.32 MiB with selective recompute (peak in the softmax's backward).
LONG = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                   ffn_hidden_size=128, vocab_size=100, seq_length=256)


def test_half_precision_softmax_backward_holds_three_fp32_score_tensors():
    plan = ParallelPlan(global_batch_size=1, precision="bf16", recompute="selective")
    bd = estimate_memory(LONG, plan, CPU_MEASURED, optimizer=False)
    assert bd.peak_event == "attention backward"
    # The fp32 probabilities just recomputed and still saved by the softmax, the incoming
    # gradient upcast to fp32 and the softmax gradient (3 × 1,048,576), plus q, k, v
    # gradients (3 × 32,768). Sized as half gradient + 2 fp32 before issue 26: 524,288 short.
    assert bd.transient == 3 * 1_048_576 + 3 * 32_768 == 3_244_032
    # stage input 32,768 + input norm (rstd 1,024 + out, normalised 2 × 32,768 + fp32 input
    # 65,536) + qkv output 65,536 + q 32,768 + k 16,384 + context 32,768 + RoPE cos/sin 65,536
    # + attention residual 32,768 (the MLP half and the layer output are freed by then)
    # + the RoPE table 256·16·4 = 16,384 + the loss's 256·12 + 8 = 3,080 + recompute's scalar 4.
    # RoPE cos/sin: 4·256·16 elements cast to bf16 (megatron's `.to(t.dtype)`), 32,768 (was
    # counted in fp32, 65,536).
    assert bd.activations == (32_768 + 132_096 + 65_536 + 32_768 + 16_384 + 32_768 + 32_768 + 32_768
                              + 16_384 + 3_080 + 4)
    assert bd.persistent_buffers == 524_288 + 65_536  # bf16 score buffer + boolean causal mask


def test_half_precision_attention_forward_is_a_peak_moment():
    plan = ParallelPlan(global_batch_size=1, precision="bf16")
    bd = estimate_memory(LONG, plan, CPU_MEASURED, optimizer=False)
    assert bd.peak_event == "attention forward"
    # Saved up to the softmax: stage input 32,768, RoPE table 16,384, input norm 132,096, q and
    # the repeated k, v 3 × 32,768, RoPE cos/sin in bf16 4·256·16·2 = 32,768, the probabilities
    # in bf16 and fp32 524,288 + 1,048,576; of the loss only the int64 token ids 256·8 = 2,048.
    assert bd.activations == 32_768 + 16_384 + 132_096 + 98_304 + 32_768 + 524_288 + 1_048_576 + 2_048
    assert bd.activations == 1_887_232
    # Alive besides: the raw scores 524,288, their fp32 upcast 1,048,576, the query's copy
    # 32,768, the fused qkv output 256·128·2 = 65,536, the norm's fp32 x·rstd beyond its
    # bf16-sized term 256·64·2 = 32,768, and the key after RoPE 256·32·2 = 16,384.
    assert bd.transient == 524_288 + 1_048_576 + 32_768 + 65_536 + 32_768 + 16_384 == 1_720_320
    # MemTracker (CPU, bf16, forward + backward): 4,496,896 B, exactly this.
    assert bd.total == 100_096 + 199_424 + 1_887_232 + 1_720_320 + 589_824 == 4_496_896


def test_full_recompute_replay_holds_the_loss_bookkeeping():
    """Under full recompute the last layer's softmax runs in its replay, inside the backward:
    the loss's per-token bookkeeping (token ids, fp32 per-token loss, 0-dim loss and gradient:
    256·12 + 8 = 3,080 B) is alive then; in the first forward only the token ids (256·8)."""
    def at(recompute):
        plan = ParallelPlan(global_batch_size=1, precision="bf16", recompute=recompute)
        return estimate_memory(LONG, plan, CPU_MEASURED, optimizer=False)

    full, none = at("full"), at("none")
    assert full.peak_event == none.peak_event == "attention forward"
    # the checkpointed layer input 32,768 + stage input 32,768 + RoPE table 16,384 + the loss's
    # 3,080, then what the replay saves up to the softmax (as without recompute)
    assert full.activations == (32_768 + 32_768 + 16_384 + 3_080
                                + 132_096 + 98_304 + 32_768 + 524_288 + 1_048_576)
    assert full.total == 4_530_696  # MemTracker (CPU, bf16, forward + backward): 4,530,696 B
    # Absent without full recompute: the same moment holds only the token ids of the loss's
    # bookkeeping (the other difference is the checkpointed layer input, 256·64·2).
    assert full.activations - none.activations == 256 * 64 * 2 + 3_080 - 2_048
    # Selective recompute replays the core attention in the backward, but its attention-forward
    # moment is the first forward's: no loss bookkeeping either.
    selective = estimate_memory(LONG, ParallelPlan(global_batch_size=1, precision="bf16", recompute="selective"),
                                CPU_MEASURED, optimizer=False)
    assert selective.peak_event == "attention backward"


def test_the_last_layers_input_is_alive_at_its_softmax_without_full_recompute():
    """With more than one layer the last layer's input (the previous layer's output) is held
    as the residual until the attention's output is added: one tokens x h tensor that no
    completed layer's terms contain. With full recompute it is a saved term already."""
    two = LONG.model_copy(update={"num_layers": 2})
    for recompute, extra in (("none", 256 * 64 * 2), ("full", 0)):
        plan = ParallelPlan(global_batch_size=1, precision="bf16", recompute=recompute)
        one_bd = estimate_memory(LONG, plan, CPU_MEASURED, optimizer=False)
        two_bd = estimate_memory(two, plan, CPU_MEASURED, optimizer=False)
        assert one_bd.peak_event == two_bd.peak_event == "attention forward"
        layer = sum(layer_activation_terms(two, plan, CPU_MEASURED).values())
        assert two_bd.activations - one_bd.activations == layer + extra


def test_rope_cos_sin_are_stored_in_the_activation_dtype():
    # megatron casts cos/sin to the activations' dtype: 4 x s x head_dim elements of e bytes
    for precision, e in (("bf16", 2), ("fp16", 2), ("fp32", 4)):
        terms = layer_activation_terms(LONG, ParallelPlan(global_batch_size=1, precision=precision), CPU_MEASURED)
        assert terms["rope_cos_sin"] == 4 * 256 * 16 * e


def test_fp32_and_flash_keep_their_peak_moments():
    # fp32: the masked-score chain of the backward (4 score tensors) stays the worst moment.
    fp32 = estimate_memory(LONG, ParallelPlan(global_batch_size=1, precision="fp32"), CPU_MEASURED,
                           optimizer=False)
    assert fp32.peak_event == "attention backward"
    assert fp32.transient == 4 * 1_048_576 + 2 * 256 * 64 * 4
    # A flash kernel has no s x s tensor, so no unfused-softmax moment.
    flash = estimate_memory(LONG, ParallelPlan(global_batch_size=1, precision="bf16"), CPU_SDPA_MEASURED,
                            optimizer=False)
    assert flash.peak_event != "attention forward" and flash.persistent_buffers == 0


# Few tokens, wide layers: the weight-sized tensors of the step decide the peak.
# h=256, 4 heads of 64, one kv head (K = 64), f=1024, V=16, s=4, b=1: 4 tokens.
WIDE = ModelConfig(num_layers=1, hidden_size=256, num_attention_heads=4, num_query_groups=1,
                   ffn_hidden_size=1024, vocab_size=16, seq_length=4)


def test_adam_visits_proj_before_qkv_and_the_step_keeps_the_rope_table_and_token_ids():
    bd = estimate_memory(WIDE, ParallelPlan(global_batch_size=1, precision="fp32"), CPU_MEASURED)
    assert bd.peak_event == "optimizer step"
    # At fc1 (2·256·1024 = 524,288): its sqrt(v) and quotient, and the previous parameter's
    # quotient, which is qkv (256·384 = 98,304; megatron registers linear_proj first), in fp32.
    # With proj (65,536) as the predecessor, as before, 262,144 B short.
    assert bd.transient == (2 * 524_288 + 98_304) * 4 == 4_587_520
    # The lru_cached RoPE table s·head_dim·4 = 1,024 and the int64 token ids 4·8 = 32.
    assert bd.activations == 1_024 + 32


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_mlp_output_projection_backward_holds_its_weight_gradient(recompute):
    fp32 = estimate_memory(WIDE, ParallelPlan(global_batch_size=1, precision="fp32", recompute=recompute),
                           CPU_MEASURED, optimizer=False)
    assert fp32.peak_event == "MLP output-projection backward"
    # incoming gradient 4·256·4 + fc2's input gradient 4·1024·4 + its weight gradient 256·1024·4
    assert fp32.transient == 4_096 + 16_384 + 1_048_576
    bf16 = estimate_memory(WIDE, ParallelPlan(global_batch_size=1, precision="bf16", recompute=recompute),
                           CPU_MEASURED, optimizer=False)
    assert bf16.peak_event == "MLP output-projection backward"
    # the same in bf16, plus the pre-MLP norm's fp32 x·rstd beyond its bf16-sized term 4·256·2
    assert bf16.transient == 2_048 + 8_192 + 524_288 + 2_048


def test_cross_entropy_forward_counts_its_int64_index_and_the_token_ids():
    m = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                    ffn_hidden_size=128, vocab_size=4096, seq_length=128)
    bd = estimate_memory(m, ParallelPlan(global_batch_size=1, precision="bf16", recompute="full"),
                         CPU_MEASURED, optimizer=False)
    assert bd.peak_event == "cross-entropy forward"
    assert bd.logits == 128 * 4096 * 4  # fp32 logits in bf16 training
    # bf16 logits next to the fp32 copy (128·4096·2) and 37 B/token: masked targets, the
    # arange row index and the token ids (int64 each), the target mask, three fp32 per token.
    assert bd.transient == 1_048_576 + 128 * 37
    # layer input and output 2·16,384 + RoPE table 8,192 + final norm 82,432 (rstd 512, bf16
    # output 16,384, fp32 x·rstd 32,768 — counted at 2 bytes before — and fp32 input 32,768)
    # + the loss's 128·12 + 8, less the fp32 per-token loss that does not exist yet (128·4)
    assert bd.activations == 32_768 + 8_192 + 82_432 + 1_544 - 512 == 124_424


# torch's multi-tensor AdamW (foreach), its default on CUDA and so megatron's without TE/apex.
WIDE_MATRIX_PARAMS = (256 * 384 + 256 * 256 + 2 * 256 * 1024 + 1024 * 256  # qkv, proj, fc1, fc2
                      + 2 * 16 * 256)  # untied embedding and output layer; the norms step apart
FOREACH_CPU = replace(CPU_MEASURED, adam_kernel="foreach")


def test_foreach_adam_holds_one_fp32_sqrt_per_matrix_parameter_at_once():
    assert WIDE_MATRIX_PARAMS == 958_464
    bd = estimate_memory(WIDE, ParallelPlan(global_batch_size=1, precision="fp32"), FOREACH_CPU)
    assert bd.peak_event == "optimizer step"
    # _foreach_sqrt(exp_avg_sqs) over the weight-decayed group: 4 B per matrix parameter, not the
    # single-tensor kernel's 2 x fc1 + qkv (4,587,520 B above).
    assert bd.transient == 4 * 958_464 == 3_833_856
    assert bd.activations == 1_024 + 32
    # static 16 B x 959,232 parameters (no host-side step tensors counted), the score buffer and
    # the causal mask (256 + 16). MemTracker measured 19,182,932 B for this case (2 fp32 steps,
    # AdamW forced to foreach=True): the 9 step tensors' 36 B more.
    assert bd.static == 16 * 959_232
    assert bd.total == 15_347_712 + 3_833_856 + 1_056 + 272 == 19_182_932 - 36


def test_foreach_adam_temporaries_are_sharded_by_the_distributed_optimizer_and_the_stage():
    plan = ParallelPlan(global_batch_size=4, dp=4, precision="fp32")
    plain = estimate_memory(WIDE, plan, FOREACH_CPU)
    assert plain.peak_event == "optimizer step" and plain.transient == 3_833_856
    # each rank steps its shard of the fp32 main parameters: 958,464 / 4 of them
    dist = ParallelPlan(global_batch_size=4, dp=4, precision="fp32", distributed_optimizer=True)
    assert _adam_temporaries(WIDE, dist, FOREACH_CPU, stage=0) == 958_464
    assert estimate_memory(WIDE, dist, FOREACH_CPU).total < plain.total
    # pp=2: stage 0 steps one layer's matrices and the embedding, stage 1 one layer's and the
    # output layer
    two = WIDE.model_copy(update={"num_layers": 2})
    pp = ParallelPlan(global_batch_size=2, pp=2, precision="fp32")
    one_stage = 4 * (WIDE_MATRIX_PARAMS - 16 * 256)
    assert _adam_temporaries(two, pp, FOREACH_CPU, stage=0) == one_stage
    assert _adam_temporaries(two, pp, FOREACH_CPU, stage=1) == one_stage


def test_gpu_profiles_pick_the_adam_the_worker_has():
    assert MEGATRON_GPU.adam_kernel == MEGATRON_SDPA_GPU.adam_kernel == "foreach"  # no TE/apex
    assert MEGATRON_TE_FLASH_GPU.adam_kernel == "fused"  # Transformer Engine's FusedAdam
    fused = profile_for_device("A100-80G", fused_adam=True)
    assert fused.adam_kernel == "fused" and fused.attention == MEGATRON_SDPA_GPU.attention
    assert profile_for_device("cpu", fused_adam=True) is CPU_MEASURED  # a CPU run never has it
    plan = ParallelPlan(global_batch_size=1, precision="bf16")
    small = SEVEN_B.model_copy(update={"seq_length": 256})
    foreach = estimate_memory(small, plan, MEGATRON_SDPA_GPU)
    assert foreach.peak_event == "optimizer step"
    params, _ = stage_parameters(small, tp=1, pp=1, stage=0)
    matrices = params - (32 * 2 + 1) * 4096
    assert foreach.transient == 4 * matrices
    assert estimate_memory(small, plan, fused).total < foreach.total


def test_gpu_overhead_is_the_fixed_term_plus_a_fraction_of_every_allocated_byte():
    bd = estimate_memory(SEVEN_B, ParallelPlan(global_batch_size=8, dp=8, tp=8, distributed_optimizer=True),
                         MEGATRON_GPU)
    allocated = bd.total - bd.overhead
    assert bd.overhead == MEGATRON_GPU.fixed_overhead_bytes + int(MEGATRON_GPU.fragmentation_fraction * allocated)
    assert bd.persistent_buffers >= MEGATRON_GPU.allocator_workspace_bytes > 0
