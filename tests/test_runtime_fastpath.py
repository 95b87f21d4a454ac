"""The GPU fast path of the compact runtime, end to end: Triton KDA rounds with boundary states (fla's
safe-gate intra-chunk kernels + our state scans), fla's varlen conv with ancestor windows and the fused
compact log-probs, against the reference path on the same model and batch. On CPU the Triton kernels run
under the interpreter in float32 (CI executes the kernel code); on a GPU they run compiled."""
import numpy as np
import torch

from harts.models.ling import LingConfig, LingForCausalLM
from harts.runtime import pack
from tests.helpers import count_in_place_rounds, fork_tree, trajectories_from_spec


def _run(model, batch):
    model.zero_grad(set_to_none=True)
    lp = model.logprobs(batch)
    lp.sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_fast_kernels_through_the_compact_runtime(fla_interpreter_patches, monkeypatch):
    """Also: the rounds without replay write their output and their q and k gradients straight into the layer's
    rows (``chunk_kda_round(out=, grad_out=)``), and that path runs here."""
    import harts.ops.kda_round.chunk as chunk_mod

    in_place = count_in_place_rounds(monkeypatch, chunk_mod)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    B = 32  # fla's intra-chunk kernels support 32 and 64
    # one KDA and one MLA layer (layer groups of 2), the second one MoE
    shape = dict(kda_chunk_size=B, num_hidden_layers=2, layer_group_size=2, num_attention_heads=2, head_dim=32,
                 hidden_size=64)
    cfg = LingConfig.preset("ling3-tiny-debug", backend="reference", **shape)
    fast = LingConfig.preset("ling3-tiny-debug", backend="reference", **shape, kda_backend="fast", conv_backend="fast",
                             logprobs_backend="fast")
    torch.manual_seed(0)
    model = LingForCausalLM(cfg).float().to(dev)
    # a fork tree whose every round replays rows; a trunk whose first round has no replay (its fork points fall on
    # chunk boundaries), then a round that replays
    replaying = pack(fork_tree(B, np.random.default_rng(0)), chunk_size=B).to(dev)
    assert replaying.stats["replay_tokens"] > 0 and replaying.stats["boundary_states"] > 0
    mixed = pack(trajectories_from_spec([(2 * B, [(40, [(10, []), (7, [])]), (23, [])])]), chunk_size=B).to(dev)
    assert [bool(r.replay_rows.numel()) for r in mixed.rounds] == [False, True]
    for batch in (replaying, mixed):
        model.config = cfg
        for m in model.modules():
            if hasattr(m, "cfg"):
                m.cfg = cfg
        lp_ref, g_ref = _run(model, batch)
        model.config = fast  # same weights, fast kernels
        for m in model.modules():
            if hasattr(m, "cfg"):
                m.cfg = fast
        lp, g = _run(model, batch)
        assert (lp - lp_ref).abs().max().item() <= 1e-5 * lp_ref.abs().max().item()
        for n in g_ref:
            rel = ((g[n] - g_ref[n]).norm() / g_ref[n].norm().clamp_min(1e-30)).item()
            assert rel <= 1e-4, (n, rel)
    assert in_place["out"] > 0 and in_place["grad"] == 2, in_place  # q and k of the one KDA layer


def test_round_outputs_copy_only_rounds_not_written_in_place():
    """``_RoundOutputs`` assembles the rounds' output rows like ``torch.cat`` of each round's output rows and zero
    padding rows, values and gradients alike (a round with replay rows: only its output positions, the replay
    positions' gradient zero), and copies no round that wrote its output in its place
    (``chunk_kda_round(out=)``, stood in for here by a Function that writes into the rows it is handed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from harts.runtime.compact import _RoundOutputs

    class WriteInto(torch.autograd.Function):  # a round: 2 x its input, written into ``out`` when given
        @staticmethod
        def forward(ctx, x, out):
            return torch.mul(x, 2.0, out=out[0]) if out is not None else x * 2.0

        @staticmethod
        def backward(ctx, g):
            return g * 2.0, None

    class Writes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    x = torch.randn(12, 2, 3, dtype=torch.float64, requires_grad=True)
    buf = x.new_empty(12, 2, 3)  # 5 + 4 + 2 output rows, 1 padding row
    a = WriteInto.apply(x[:5], (buf[:5],))  # in place
    b = WriteInto.apply(x[5:9], None)  # elsewhere: copied
    c = WriteInto.apply(x[9:], None)  # 3 rows, row 1 a replay row: rows 0 and 2 are outputs
    pos, replay = torch.tensor([0, 2]), torch.tensor([1])
    with Writes() as mode:
        o = _RoundOutputs.apply((buf,), (None, None, (pos, replay)), a, b, c)
    assert sorted(op for op in mode.ops if op not in ("slice", "alias", "view")) == ["copy_", "index_select",
                                                                                      "zero_"], mode.ops
    want = torch.cat([2 * x.detach()[:9], 2 * x.detach()[[9, 11]]])
    torch.testing.assert_close(o, torch.cat([want, x.new_zeros(1, 2, 3)]), rtol=0, atol=0)
    w = torch.randn(12, 2, 3, dtype=torch.float64)
    (o * w).sum().backward()
    torch.testing.assert_close(x.grad, torch.cat([2 * w[:9], 2 * w[9:10], x.new_zeros(1, 2, 3), 2 * w[10:11]]),
                               rtol=0, atol=0)
