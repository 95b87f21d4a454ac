"""The padded-tensor API (``harts.pack_padded`` / ``harts.unpack_padded``, entropies, router statistics).

Independent reference: the model's ordinary packed forward on each row alone (its attended tokens as one sequence,
no trie, no padding) and, for the entropies, the full logits of that row in float64. Both families, float64, the
debug presets on the reference ops. Groups: G = 4 and 8 completions of one prompt with different lengths and
duplicates, left- and right-padded rows, and a multi-turn group whose completions share more than the prompt.
"""
import numpy as np
import pytest
import torch

import harts
from harts.data import Trajectory
from harts.runtime import logprobs_and_entropies

REL = 1e-10


def make(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "ling":
        from harts.models.ling import LingConfig, LingForCausalLM

        model = LingForCausalLM(LingConfig.preset("ling3-tiny-debug", backend="reference")).double()
        for i, m in enumerate(model.moe_layers()):
            m.gate.expert_bias.copy_(torch.linspace(-0.05, 0.05, model.config.num_experts).roll(i))
    else:
        from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

        model = Qwen35ForCausalLM(Qwen35Config.preset("qwen3.5-debug", backend="reference")).init_weights(seed)
        model = model.double()
        g = torch.Generator().manual_seed(seed + 7)
        with torch.no_grad():  # non-trivial norms and gates
            for n, p in model.named_parameters():
                if n.endswith(("norm.weight", "dt_bias", "shared_expert_gate.weight")):
                    p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def group(case: str, rng: np.random.Generator) -> tuple[list[int], list[list[int]]]:
    """(prompt, completions) of one group."""
    prompt = rng.integers(3, 500, 21).tolist()
    c = lambda n: rng.integers(3, 500, n).tolist()
    if case == "g4":
        a = c(5)
        return prompt, [a, c(9), list(a), c(1)]  # different lengths, a duplicate, a one-token completion
    if case == "g8":
        a, b = c(7), c(3)
        return prompt, [a, b, c(12), list(a), c(2), list(b), c(17), list(a)]
    # multi-turn: two completions share a first turn (tool call + tool output), then differ
    turn = c(11)
    return prompt, [turn + c(6), turn + c(3), c(8), turn + c(6)]


def padded(prompt, completions, side: str):
    """TRL's layout (side="trl": prompt left-padded to the widest prompt, completion right-padded) or every row's
    tokens padded on one side; the rows' prompts get a varying extra prefix so the prompt lengths differ too."""
    rows = [prompt + c for c in completions]
    L = max(map(len, rows)) + 2
    N = len(rows)
    ids = torch.full((N, L), 0, dtype=torch.long)
    am, cm = torch.zeros(N, L, dtype=torch.long), torch.zeros(N, L, dtype=torch.long)
    for i, r in enumerate(rows):
        n, p = len(r), len(prompt)
        s = {"left": L - n, "right": 0, "trl": 1}[side]
        ids[i, s:s + n] = torch.tensor(r)
        am[i, s:s + n] = 1
        cm[i, s + p:s + n] = 1
    return ids, am, cm, [len(prompt)] * N


def reference(model, ids, am, cm):
    """Per row alone: log-probs of its completion tokens and the entropies of those positions from full logits."""
    lps, ents = [], []
    for i in range(ids.shape[0]):
        toks = ids[i][am[i].bool()]
        comp = cm[i][am[i].bool()].bool()
        batch = harts.pack([Trajectory(tokens=toks.numpy())], config=model.config, prefix_sharing=False)
        lp = model.logprobs(batch)  # position t predicts token t+1
        h = model(toks, torch.arange(toks.shape[0]), torch.tensor([0, toks.shape[0]]))
        logp = torch.log_softmax(model.logits(h).double(), -1)
        ent = -(logp.exp() * logp).sum(-1)
        sel = comp[1:]
        lps.append(lp[sel]), ents.append(ent[:-1][sel])
    return lps, ents


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


@pytest.mark.parametrize("family", ["ling", "qwen35"])
@pytest.mark.parametrize("case,side", [("g4", "left"), ("g8", "right"), ("multiturn", "trl")])
def test_padded_equals_per_row(family, case, side):
    model = make(family)
    prompt, comps = group(case, np.random.default_rng(["g4", "g8", "multiturn"].index(case)))
    ids, am, cm, plen = padded(prompt, comps, side)
    batch, layout = harts.pack_padded(ids, am, completion_mask=cm, config=model.config)
    assert batch.prefix_sharing and batch.stats["compact_rows"] < batch.stats["raw_tokens"]
    if case != "multiturn":  # the prompt is computed once: rows = prompt + distinct completion suffixes
        distinct = {tuple(c) for c in comps}
        assert batch.stats["compact_rows"] == len(prompt) + sum(len(c) for c in distinct)
    # the same split given as prompt lengths
    b2, l2 = harts.pack_padded(ids, am, prompt_lengths=plen, config=model.config)
    assert torch.equal(l2.completion_mask, layout.completion_mask) and torch.equal(b2.logprob_rows, batch.logprob_rows)

    g = torch.Generator().manual_seed(3)
    w_lp = torch.randn(layout.completion_mask.shape, generator=g, dtype=torch.float64)
    w_ent = torch.randn(layout.completion_mask.shape, generator=g, dtype=torch.float64)

    model.zero_grad(set_to_none=True)
    lp_S, ent_S, stats = logprobs_and_entropies(model, batch, return_router_stats=True)
    lp, mask = harts.unpack_padded(lp_S, layout)
    ent, _ = harts.unpack_padded(ent_S, layout)
    assert lp.shape == (ids.shape[0], ids.shape[1] - layout.column_offset)
    assert torch.equal(mask.long(), cm[:, layout.column_offset:])
    assert (lp[~mask] == 0).all() and (ent[~mask] == 0).all()
    assert len(stats) == len(model.moe_layers()) and stats[0].z_loss.requires_grad
    counts = torch.stack([s.counts_E for s in stats])
    ((w_lp * lp).sum() + (w_ent * ent).sum()).backward()
    g_h = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    ref_lp, ref_ent = reference(model, ids, am, cm)
    loss = 0
    for i in range(ids.shape[0]):
        loss = loss + (w_lp[i][mask[i]] * ref_lp[i]).sum() + (w_ent[i][mask[i]] * ref_ent[i]).sum()
    loss.backward()
    g_b = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert rel(lp[mask], torch.cat(ref_lp)) <= REL
    assert rel(ent[mask], torch.cat(ref_ent)) <= REL
    assert g_h.keys() == g_b.keys()
    for n in g_b:
        assert rel(g_h[n], g_b[n]) <= REL, n
    # the router statistics of the same call weight each compact row by its multiplicity: they equal the
    # trajectory-wise batch's (every row's tokens counted once each)
    with torch.no_grad():
        bb, _ = harts.pack_padded(ids, am, completion_mask=cm, config=model.config, prefix_sharing=False)
        _, stats_b = model.logprobs(bb, return_router_stats=True)
    assert torch.equal(counts, torch.stack([s.counts_E for s in stats_b]))
    assert (counts.sum(1) == am.sum() * model.config.num_experts_per_tok).all()


def test_entropies_without_prefix_sharing_and_no_grad():
    model = make("ling")
    prompt, comps = group("g4", np.random.default_rng(1))
    ids, am, cm, _ = padded(prompt, comps, "left")
    bb, layout = harts.pack_padded(ids, am, completion_mask=cm, config=model.config, prefix_sharing=False)
    hb, _ = harts.pack_padded(ids, am, completion_mask=cm, config=model.config)
    with torch.no_grad():
        lp_b, ent_b = model.logprobs(bb, return_entropies=True)
        lp_h, ent_h = model.logprobs(hb, return_entropies=True)
        ref_lp, ref_ent = reference(model, ids, am, cm)
    assert rel(lp_b, torch.cat(ref_lp)) <= REL and rel(ent_b, torch.cat(ref_ent)) <= REL
    assert rel(lp_h, lp_b) <= REL and rel(ent_h, ent_b) <= REL
    assert (ent_h > 0).all() and (ent_h <= np.log(model.config.vocab_size) + 1e-12).all()


def test_semantic_follows_the_scored_positions():
    ids = torch.tensor([[0, 5, 6, 7, 8], [5, 6, 7, 9, 0]])
    am = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 0]])
    batch, layout = harts.pack_padded(ids, am, prompt_lengths=[2, 3], chunk_size=16)
    assert batch.logprob_targets.tolist() == [7, 8, 9]  # completion tokens only, row by row
    assert batch.semantic("loss_mask").tolist() == [1.0, 1.0, 1.0]
    assert [len(x) for x in batch.split(batch.logprob_targets)] == [2, 1]
    assert layout.column_offset == 3 and layout.completion_mask.tolist() == [[1, 1], [1, 0]]


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(attention_mask=None), TypeError, "attention_mask is required"),
    (dict(attention_mask=torch.ones(2, 4, dtype=torch.long)), ValueError, "attention_mask has shape"),
    (dict(completion_mask=torch.ones(2, 4, dtype=torch.long)), ValueError, "completion_mask has shape"),
    (dict(attention_mask=torch.tensor([[1, 1, 1, 2, 1], [1, 1, 1, 1, 1]])), ValueError, "row 0 column 3 is 2"),
    (dict(attention_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]])), ValueError, "row 1 has no tokens"),
    (dict(attention_mask=torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])), ValueError,
     "row 0 has padding in the middle"),
    (dict(completion_mask=torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]])), ValueError,
     "row 1 has no completion token"),
    (dict(attention_mask=torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]])), ValueError,
     "row 1 column 4 is a completion token under attention_mask 0"),
    (dict(completion_mask=torch.tensor([[0, 0, 1, 0, 1], [0, 0, 0, 1, 1]])), ValueError,
     "row 0's completion tokens"),
    (dict(completion_mask=torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 1, 1]])), ValueError,
     "row 0's completion starts at its first token"),
    (dict(completion_mask=None, prompt_lengths=[2, 5]), ValueError, "row 1: prompt_lengths"),
    (dict(completion_mask=None, prompt_lengths=[2]), ValueError, "prompt_lengths must be 2 integers"),
    (dict(prompt_lengths=[2, 2]), TypeError, "exactly one of completion_mask"),
])
def test_misuse(kwargs, err, match):
    base = dict(attention_mask=torch.ones(2, 5, dtype=torch.long),
                completion_mask=torch.tensor([[0, 0, 0, 1, 1], [0, 0, 1, 1, 1]]), chunk_size=16)
    base.update(kwargs)
    if base.get("completion_mask") is None:
        base.pop("completion_mask")
    with pytest.raises(err, match=match):
        harts.pack_padded(torch.arange(10).view(2, 5), **base)


def test_unpack_misuse():
    batch, layout = harts.pack_padded(torch.arange(10).view(2, 5), torch.ones(2, 5, dtype=torch.long),
                                      prompt_lengths=[2, 3], chunk_size=16)
    with pytest.raises(ValueError, match="expected 5 entries"):
        harts.unpack_padded(torch.zeros(4), layout)
    with pytest.raises(TypeError, match="PaddedLayout"):
        harts.unpack_padded(torch.zeros(5), batch)
