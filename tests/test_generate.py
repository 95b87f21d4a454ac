"""Incremental decoding (harts.models.common.generate) against the training forward, in float64 on CPU.

The references are independent of the decoder: the model's own trajectory-wise log-probs (the chunked
KDA, the packed short convolution and varlen attention over whole sequences), decoding a full path from
an empty cache, and the argmax of the training forward. Sequences are longer than the debug preset's KDA
chunk (16 tokens), so the chunkwise forward crosses chunk boundaries that the recurrent decoder never has.
"""
import pytest
import torch

import harts
from harts.data.trajectory import Trajectory
from harts.models.common.generate import DecodeCache, Sampling, feed, feed_sequences, generate, sample
from harts.models.ling import LingConfig, LingForCausalLM

V = 512


@pytest.fixture(scope="module")
def model():
    cfg = LingConfig.preset("ling3-tiny-debug", num_hidden_layers=4, backend="reference")
    return LingForCausalLM(cfg).init_weights(3).cast_(torch.float64).eval()


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


def test_teacher_forced_decoding_equals_trajectory_wise_logprobs(model):
    seqs = _seqs((40, 9, 23))
    cache = DecodeCache.empty(model, len(seqs))
    got = feed_sequences(model, cache, seqs)
    batch = harts.pack([Trajectory.create(s.numpy()) for s in seqs], config=model.config, prefix_sharing=False)
    with torch.no_grad():
        ref = batch.split(model.logprobs(batch))
    for g, r in zip(got, ref):
        assert torch.isnan(g[0])
        assert (g[1:] - r).abs().max().item() <= 1e-10
    assert cache.lengths.tolist() == [40, 9, 23]


def test_forked_branches_equal_decoding_each_path_from_scratch(model):
    prefix, tails = _seqs((21,), seed=1)[0], _seqs((5, 12, 1), seed=2)
    cache = DecodeCache.empty(model, 1)
    feed_sequences(model, cache, [prefix])
    branches = cache.fork([0, 0, 0])
    got = feed_sequences(model, branches, tails)
    for b, tail in enumerate(tails):
        scratch = DecodeCache.empty(model, 1)
        ref = feed_sequences(model, scratch, [torch.cat([prefix, tail])])[0][len(prefix):]
        assert (got[b] - ref).abs().max().item() <= 1e-12
        assert (branches.logits[b] - scratch.logits[0]).abs().max().item() <= 1e-12
    # the parent is untouched by its branches' steps
    assert cache.lengths.tolist() == [21]
    again = DecodeCache.empty(model, 1)
    feed_sequences(model, again, [prefix])
    assert torch.equal(cache.logits, again.logits)


def test_fork_without_the_conv_window_is_wrong(model):
    """Control: a fork that keeps the KDA state and KV cache but restarts the short-convolution window
    (as if only the recurrent state were the KDA state) gives different log-probs: the window is state."""
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
        full = torch.cat([p, toks])
        ref = _forward_logprobs(model, [full])[0][len(p) - 1:-1]
        assert torch.equal(toks, ref.argmax(-1))
        assert (lp - ref.gather(1, toks[:, None]).squeeze(1)).abs().max().item() <= 1e-10


def test_sampling_is_seeded_and_its_logprobs_are_the_samplers(model):
    prompts = _seqs((5, 5, 8), seed=6)
    s = Sampling(temperature=0.7, top_p=0.9)
    a = generate(model, prompts, 10, s, torch.Generator().manual_seed(11))
    b = generate(model, prompts, 10, s, torch.Generator().manual_seed(11))
    assert all(torch.equal(x, y) for x, y in zip(a.tokens, b.tokens))
    for p, toks, slp, lp in zip(prompts, a.tokens, a.sampler_logprobs, a.logprobs):
        ref = _forward_logprobs(model, [torch.cat([p, toks])])[0][len(p) - 1:-1]
        assert (lp - ref.gather(1, toks[:, None]).squeeze(1)).abs().max().item() <= 1e-10
        # brute force: the tempered, nucleus-truncated distribution the sampler drew from
        q = torch.softmax(ref / 0.7, -1)
        qs, order = q.sort(dim=-1, descending=True, stable=True)
        keep = torch.zeros_like(q, dtype=torch.bool).scatter(1, order, (qs.cumsum(-1) - qs) < 0.9)
        q = torch.where(keep, q, 0.0)
        q = q / q.sum(-1, keepdim=True)
        picked = q.gather(1, toks[:, None]).squeeze(1)
        assert (picked > 0).all()
        assert (slp - picked.log()).abs().max().item() <= 1e-10


def test_sample_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]], dtype=torch.float64)).expand(4000, 4)
    tok, slp, lp, ent = sample(logits, Sampling(), torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=4).double() / 4000
    assert (freq - torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)).abs().max() < 0.03
    tok, slp, _, _ = sample(logits[:50], Sampling(top_p=0.5), torch.Generator().manual_seed(0))
    assert (tok == 0).all() and (slp == 0).all()  # the nucleus of mass 0.5 is token 0 alone


def test_feed_subset_rows_leaves_the_others(model):
    a, b = _seqs((6, 6), seed=7)
    cache = DecodeCache.empty(model, 2)
    feed_sequences(model, cache, [a, b])
    before = cache.logits[1].clone()
    feed(model, cache, [5], rows=[0])
    assert cache.lengths.tolist() == [7, 6] and torch.equal(cache.logits[1], before)


def test_errors_name_the_offending_item(model):
    cache = DecodeCache.empty(model, 2)
    with pytest.raises(ValueError, match="token id 600"):
        feed(model, cache, [1, 600])
    with pytest.raises(ValueError, match="row 5"):
        cache.fork([0, 5])
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        Sampling(temperature=-1.0)
    with pytest.raises(ValueError, match="NaN"):
        sample(cache.logits, Sampling())


@pytest.mark.gpu
def test_teacher_forced_decoding_within_bf16_noise_on_gpu():
    """bf16 on the GPU (ling3-small, the online config's model): teacher-forced decoding (the recurrent step
    path) and the training forward (the fast kernels) each against the float64 truth of the same bf16-rounded
    weights (reference ops on CPU). Decoding must be no further from the truth than the training forward is,
    up to a factor 2 and a small floor: both are bf16 executions of one model."""
    model = LingForCausalLM(LingConfig.preset("ling3-small")).init_weights(3).cast_(torch.bfloat16).cuda().eval()
    truth = LingForCausalLM(LingConfig.preset("ling3-small", backend="reference"))
    with torch.no_grad():
        for pt, pb in zip(list(truth.parameters()) + list(truth.buffers()),
                          list(model.parameters()) + list(model.buffers())):
            pt.copy_(pb.cpu())
    truth = truth.cast_(torch.float64).eval()
    seqs = _seqs((150, 70, 200), seed=5)
    batch = harts.pack([Trajectory.create(s.numpy()) for s in seqs], config=model.config, prefix_sharing=False)
    with torch.no_grad():
        got = feed_sequences(model, DecodeCache.empty(model, len(seqs)), [s.cuda() for s in seqs])
        fwd = model.logprobs(batch.to("cuda")).double().cpu()
        ref = truth.logprobs(batch)
    dec = torch.cat([g[1:].double().cpu() for g in got])
    err_dec, err_fwd = (dec - ref).abs().mean().item(), (fwd - ref).abs().mean().item()
    print(f"bf16 vs float64 truth, mean |dlogp| over {ref.numel()} positions: decoding {err_dec:.3e}, "
          f"training forward {err_fwd:.3e}; max: decoding {(dec - ref).abs().max().item():.3e}, "
          f"forward {(fwd - ref).abs().max().item():.3e}")
    assert err_dec <= 2 * err_fwd + 1e-3, (err_dec, err_fwd)
