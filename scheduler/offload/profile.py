"""What the offload planner knows about a model and a machine: per-layer profiles and links.

A `LayerProfile` is one unit the partition may cut between (the embedding, each
decoder layer, the final norm + output head): its forward and backward time for
one micro batch on the target device, the bytes of its parameters as the device
holds them, of their gradients and of the optimizer state (host only), the
activations one micro batch keeps alive while the layer runs backward, and the
bytes of its output (what crosses a stage boundary per micro batch).

Profiles come from two places:

* `analytic_profile` — from the model shape and a GPU's peak TFLOP/s (the
  simulator's 3B..15B models on RTX 3090-Ti, where no such GPU is at hand);
* `training.offload.profile.measure_profile` — timed on the device the executor
  will run on (on CPU it measures the CPU), so planner and executor agree.

`OffloadHardware` is the machine side: GPU count and memory, host-to-device
bandwidth per GPU (from the inventory's PCIe figures or measured), and the
root complex of every GPU (cluster.Node.pcie_root_complex).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.config import ModelConfig

# PCIe 3.0 x8: 8 GT/s x 8 lanes x 128/130 = 7.88 GB/s raw; ~6.5 GB/s is what cudaMemcpy
# from pinned memory reaches on such links (the figure the simulator uses).
PCIE3_X8_BYTES_PER_S = 6.5e9
PCIE3_X16_BYTES_PER_S = 13.0e9


@dataclass(frozen=True)
class LayerProfile:
    """One cuttable unit of the model (times for ONE micro batch)."""

    name: str
    forward_s: float
    backward_s: float  # includes recomputing the forward (stages keep only their inputs)
    param_bytes: int  # device copy of the weights
    grad_bytes: int  # device gradients before they go back to host
    optimizer_bytes: int  # host only (Adam moments + fp32 master when mixed precision)
    activation_bytes: int  # alive while this layer runs backward, one micro batch
    output_bytes: int  # this layer's output, one micro batch (crosses a stage boundary)


@dataclass(frozen=True)
class OffloadHardware:
    """The GPUs of one server as the offload planner sees them."""

    num_gpus: int
    gpu_memory_bytes: int  # usable per GPU (margin already taken off)
    h2d_bytes_per_s: float  # one GPU's host<->device bandwidth, each direction
    root_complex: tuple[int, ...] | None = None  # per GPU; None = unknown (one shared)
    root_complex_bytes_per_s: float | None = None  # uplink of a root complex; None = no limit
    name: str = "server"

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.gpu_memory_bytes <= 0 or self.h2d_bytes_per_s <= 0:
            raise ValueError(
                f"offload hardware needs num_gpus >= 1, gpu_memory_bytes > 0 and h2d_bytes_per_s > 0 "
                f"(got {self.num_gpus}, {self.gpu_memory_bytes}, {self.h2d_bytes_per_s})"
            )
        if self.root_complex is not None and len(self.root_complex) != self.num_gpus:
            raise ValueError(f"root_complex lists {len(self.root_complex)} GPUs, num_gpus is {self.num_gpus}")

    @property
    def effective_h2d_bytes_per_s(self) -> float:
        """What one GPU gets when every GPU under its root complex copies at once (the partition
        plans for this: Mobius's pipeline keeps most GPUs prefetching most of the time)."""
        if not self.root_complex_bytes_per_s:
            return self.h2d_bytes_per_s
        from collections import Counter

        sharing = max(Counter(self.root_complex or (0,) * self.num_gpus).values())
        return min(self.h2d_bytes_per_s, self.root_complex_bytes_per_s / sharing)


@dataclass(frozen=True)
class ModelProfile:
    """All cuttable units in execution order, plus how a step is cut into micro batches."""

    layers: tuple[LayerProfile, ...]
    microbatches: int = 1
    source: str = "analytic"  # or "measured on <device>"
    meta: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("a model profile needs at least one layer")
        if self.microbatches < 1:
            raise ValueError(f"microbatches must be >= 1 (got {self.microbatches})")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def param_bytes(self) -> int:
        return sum(l.param_bytes for l in self.layers)

    @property
    def model_state_bytes(self) -> int:
        """Weights + gradients + optimizer state: what DRAM holds."""
        return sum(l.param_bytes + l.grad_bytes + l.optimizer_bytes for l in self.layers)


def analytic_profile(
    model: ModelConfig,
    *,
    micro_batch: int,
    microbatches: int,
    peak_tflops: float,
    compute_efficiency: float = 0.45,
    param_bytes_per: int = 2,
    activation_bytes_per: int = 2,
) -> ModelProfile:
    """Per-layer profile from the model shape (mixed precision: 2-byte weights/grads on the GPU,
    fp32 master + Adam moments = 12 bytes per parameter on the host).

    FLOPs per token and layer: 2 x params (forward); backward = recompute forward + 2x forward.
    Activations per micro batch and layer: s.b.h.(34 + 5.a.s/h) bytes at 2 bytes/element
    (Korthikanti et al.), the number scheduler.memory_model uses too.
    """
    h, s, b = model.hidden_size, model.seq_length, micro_batch
    flops_per_s = peak_tflops * 1e12 * compute_efficiency
    tokens = s * b
    kv = model.kv_heads * model.head_dim
    layer_params = 2 * h * h + 2 * h * kv + 3 * h * model.ffn_size + 2 * h
    # attention scores: 2 x (2 s^2 h) FLOP per sequence on top of the weight FLOPs
    layer_fwd_flops = 2 * layer_params * tokens + 4 * b * s * s * h
    layer_act = int(s * b * h * (34 + 5 * model.num_attention_heads * s / h) * activation_bytes_per / 2)
    boundary = s * b * h * activation_bytes_per

    def unit(name: str, params: int, fwd_flops: float, act: int, out: int) -> LayerProfile:
        fwd = fwd_flops / flops_per_s
        return LayerProfile(
            name=name, forward_s=fwd, backward_s=3 * fwd,
            param_bytes=params * param_bytes_per, grad_bytes=params * param_bytes_per,
            optimizer_bytes=params * 12, activation_bytes=act, output_bytes=out,
        )

    embed = model.vocab_size * h
    layers = [unit("embedding", embed, 0.0, boundary, boundary)]
    layers += [unit(f"layer{i}", layer_params, layer_fwd_flops, layer_act, boundary) for i in range(model.num_layers)]
    head_params = h + (embed if model.untie_embeddings_and_output_weights else 0)
    logits = s * b * model.vocab_size * 4  # fp32 logits for the loss
    layers.append(unit("head", head_params, 2 * embed * tokens, logits + boundary, 4 * b))
    return ModelProfile(tuple(layers), microbatches=microbatches, source="analytic",
                        meta={"peak_tflops": peak_tflops, "compute_efficiency": compute_efficiency})
