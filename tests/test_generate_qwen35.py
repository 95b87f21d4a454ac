"""Incremental decoding of Qwen3.5-MoE (harts.models.common.generate with the Gated DeltaNet and gated attention
``step``s) against the training forward, in float64 on CPU.

The references are independent of the decoder: the model's trajectory-wise log-probs (the chunked GDN core,
the packed short convolution and varlen attention over whole sequences), decoding a full path from an empty
cache, and the training forward's argmax. Sequences are longer than the debug preset's GDN chunk (16 tokens),
and forks sit at B-1, B and B+1 of it, so the chunkwise forward crosses chunk boundaries that the recurrent
decoder never has.
"""
import pytest
import torch

import harts
from harts.data.trajectory import Trajectory
from harts.models.common.generate import DecodeCache, LayerCache, Sampling, feed, feed_sequences, generate
from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

V = 512


@pytest.fixture(scope="module")
def model():
    cfg = Qwen35Config.preset("qwen3.5-debug", num_hidden_layers=4, backend="reference")  # 3 GDN + 1 attention
    m = Qwen35ForCausalLM(cfg).init_weights(seed=3).double().eval()
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():  # non-trivial norms and gates (the scratch init leaves them at identity)
        for n, p in m.named_parameters():
            if n.endswith(("norm.weight", "dt_bias", "shared_expert_gate.weight")):
                p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


def _seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (n,), generator=g) for n in lengths]


def _forward_logprobs(model, seqs):
    """Per sequence [L, V] log-softmax of the training forward (packed, trajectory-wise)."""
    ids = torch.cat(seqs)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    pos = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        lp = torch.log_softmax(model.logits(model(ids, pos, cu)), -1)
    return [lp[a:b] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]


def test_layers_keep_the_state_their_mixer_needs(model):
    cache = DecodeCache.empty(model, 2)
    c = model.config
    for layer, lc in zip(model.decoder_layers(), cache.layers):
        if layer.kind == "gdn":
            C = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
            assert [t.shape for t in lc.conv] == [(2, c.linear_conv_kernel_dim - 1, C)] and lc.k is None
            assert lc.state.shape == (2, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)
        else:  # keys and values per key/value head (GQA), not repeated to the query heads
            assert lc.conv is None and [t.shape for t in lc.k] == [(0, c.num_key_value_heads, c.head_dim)] * 2
    feed_sequences(model, cache, _seqs((3, 5), seed=9))
    att = [lc for layer, lc in zip(model.decoder_layers(), cache.layers) if layer.kind != "gdn"]
    assert att and [t.shape[0] for t in att[0].k] == [3, 5]


def test_teacher_forced_decoding_equals_trajectory_wise_logprobs(model):
    seqs = _seqs((40, 9, 23, 17))
    cache = DecodeCache.empty(model, len(seqs))
    got = feed_sequences(model, cache, seqs)
    batch = harts.pack([Trajectory.create(s.numpy()) for s in seqs], config=model.config, prefix_sharing=False)
    with torch.no_grad():
        ref = batch.split(model.logprobs(batch))
    for g, r in zip(got, ref):
        assert torch.isnan(g[0])
        assert (g[1:] - r).abs().max().item() <= 1e-10
    assert cache.lengths.tolist() == [40, 9, 23, 17]
    # the last logits predict what the forward predicts after each whole sequence
    fwd = _forward_logprobs(model, seqs)
    for n, f in enumerate(fwd):
        assert (torch.log_softmax(cache.logits[n], -1) - f[-1]).abs().max().item() <= 1e-10


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_forks_around_the_chunk_boundary_continue_like_unforked_paths(model, offset):
    """A prefix of B-1, B or B+1 tokens (B = gdn_chunk_size) forked into three branches: each branch
    continues exactly like its path decoded from scratch and like the training forward; the parent and
    the sibling branches see none of a branch's steps."""
    B = model.config.gdn_chunk_size
    prefix, tails = _seqs((B + offset,), seed=1)[0], _seqs((5, 12, 1), seed=2 + offset)
    cache = DecodeCache.empty(model, 1)
    feed_sequences(model, cache, [prefix])
    parent = [(tuple(c.clone() for c in lc.conv), lc.state.clone()) if lc.conv is not None
              else ([k.clone() for k in lc.k], [v.clone() for v in lc.v]) for lc in cache.layers]
    logits = cache.logits.clone()
    branches = cache.fork([0, 0, 0])
    got = feed_sequences(model, branches, tails)
    fwd = _forward_logprobs(model, [torch.cat([prefix, t]) for t in tails])
    for b, tail in enumerate(tails):
        scratch = DecodeCache.empty(model, 1)
        ref = feed_sequences(model, scratch, [torch.cat([prefix, tail])])[0][len(prefix):]
        assert (got[b] - ref).abs().max().item() <= 1e-12
        assert (branches.logits[b] - scratch.logits[0]).abs().max().item() <= 1e-12
        ref_fwd = fwd[b][len(prefix) - 1:-1].gather(1, tail[:, None]).squeeze(1)
        assert (got[b] - ref_fwd).abs().max().item() <= 1e-10
    assert branches.lengths.tolist() == [len(prefix) + len(t) for t in tails]
    # the parent is untouched, bit for bit, by its branches' steps
    assert cache.lengths.tolist() == [len(prefix)] and torch.equal(cache.logits, logits)
    for lc, (a, b) in zip(cache.layers, parent):
        if lc.conv is not None:
            assert all(torch.equal(x, y) for x, y in zip(lc.conv, a)) and torch.equal(lc.state, b)
        else:
            assert all(torch.equal(x, y) for x, y in zip(lc.k, a)) and all(torch.equal(x, y) for x, y in zip(lc.v, b))
    # a branch advanced alone leaves its siblings where they were
    before = branches.fork([1, 2])
    feed(model, branches, [7], rows=[0])
    after = branches.fork([1, 2])
    assert torch.equal(before.logits, after.logits)
    for x, y in zip(before.layers, after.layers):
        if x.conv is not None:
            assert torch.equal(x.state, y.state) and torch.equal(x.conv[0], y.conv[0])
        else:
            assert all(torch.equal(p, q) for p, q in zip(x.k, y.k))


def test_fork_without_the_conv_window_is_wrong(model):
    """Control: a fork that keeps the GDN state and the KV cache but restarts the short-convolution window
    gives different log-probs: the window is state."""
    prefix, tail = _seqs((21, 6), seed=4)
    cache = DecodeCache.empty(model, 1)
    feed_sequences(model, cache, [prefix])
    ok, bad = cache.fork([0]), cache.fork([0])
    for lc in bad.layers:
        if lc.conv is not None:
            lc.conv = tuple(torch.zeros_like(c) for c in lc.conv)
    a, b = feed_sequences(model, ok, [tail])[0], feed_sequences(model, bad, [tail])[0]
    ref = _forward_logprobs(model, [torch.cat([prefix, tail])])[0]
    ref_tail = ref[len(prefix) - 1:-1].gather(1, tail[:, None]).squeeze(1)
    assert (a - ref_tail).abs().max().item() <= 1e-10
    assert (b - ref_tail).abs().max().item() > 1e-4


def test_greedy_decoding_is_the_forward_argmax_step_by_step(model):
    prompts = _seqs((7, 3), seed=5)
    out = generate(model, prompts, 20, Sampling(temperature=0.0))
    for p, toks, lp in zip(prompts, out.tokens, out.logprobs):
        ref = _forward_logprobs(model, [torch.cat([p, toks])])[0][len(p) - 1:-1]
        assert torch.equal(toks, ref.argmax(-1))
        assert (lp - ref.gather(1, toks[:, None]).squeeze(1)).abs().max().item() <= 1e-10


def test_sampling_is_seeded_and_its_logprobs_are_the_policys(model):
    prompts = _seqs((5, 5, 8), seed=6)
    s = Sampling(temperature=0.8)
    a = generate(model, prompts, 12, s, torch.Generator().manual_seed(11))
    b = generate(model, prompts, 12, s, torch.Generator().manual_seed(11))
    c = generate(model, prompts, 12, s, torch.Generator().manual_seed(12))
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))
    assert any(not torch.equal(x, y) for x, y in zip(a.tokens, c.tokens))
    for p, toks, slp, lp in zip(prompts, a.tokens, a.sampler_logprobs, a.logprobs):
        ref = _forward_logprobs(model, [torch.cat([p, toks])])[0][len(p) - 1:-1]
        assert (lp - ref.gather(1, toks[:, None]).squeeze(1)).abs().max().item() <= 1e-10
        assert (slp - torch.log_softmax(ref / 0.8, -1).gather(1, toks[:, None]).squeeze(1)).abs().max() <= 1e-10


def test_errors_name_the_offending_item(model):
    with pytest.raises(ValueError, match="token id 600"):
        feed(model, DecodeCache.empty(model, 2), [1, 600])
    with pytest.raises(TypeError, match="causal LM"):
        DecodeCache.empty(model.model, 1)
    with pytest.raises(ValueError, match=r"either conv and state.*\['conv'\]"):
        LayerCache(conv=(torch.zeros(1, 3, 4),))
