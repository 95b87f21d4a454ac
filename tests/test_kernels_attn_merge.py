"""The view split's merge kernel (``harts.kernels.attn_merge``, interpreter on CPU, float32) against the merge
of the same pieces' attention computed in float64 from their scores: the output of attention over the union of
disjoint key sets, and its log-sum-exp."""
import pytest
import torch

from harts.kernels.attn_merge import attn_merge


def _piece(q_HLD, k_HSD, v_HSDv):
    """Dense unmasked attention of one key set: (o, lse), float64."""
    s = q_HLD @ k_HSD.transpose(-1, -2)
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v_HSDv, lse


@pytest.mark.parametrize("L,Dv,batches", [(37, 24, (1, 3, 1)), (5, 128, (2,)), (64, 256, (1, 1, 2, 4)),
                                          (9, 24, (1, 2, 1, 1, 3, 1, 1, 2, 1))])
def test_merge_equals_attention_over_the_union_of_keys(L, Dv, batches):
    """Groups of B partials (B key chunks each) with the view's rows at an offset r0 in some of them (the causal
    piece's dropped rows in front, padded rows after): the merged output and lse are those of one attention over
    all the keys, computed in float64; the kernel reads float32 partials and writes float32 (bf16 is the GPU's).
    More groups than one launch takes (MAX_GROUPS) are folded in launches that carry a float32 partial."""
    g = torch.Generator().manual_seed(L + Dv)
    H, D = 3, 8
    q = torch.randn(H, L, D, generator=g, dtype=torch.float64)
    groups, keys, vals = [], [], []
    for i, B in enumerate(batches):
        r0, pad = (3, 2) if i == 0 else (0, 5 * (i % 2))
        os_, ls_ = [], []
        for _ in range(B):
            S = int(torch.randint(1, 40, (1,), generator=g))
            k = torch.randn(H, S, D, generator=g, dtype=torch.float64) * 2
            v = torch.randn(H, S, Dv, generator=g, dtype=torch.float64)
            keys.append(k)
            vals.append(v)
            o, lse = _piece(q, k, v)
            junk = torch.randn(H, r0, Dv, generator=g, dtype=torch.float64), torch.randn(H, pad, Dv, generator=g,
                                                                                             dtype=torch.float64)
            os_.append(torch.cat([junk[0], o, junk[1]], 1))
            ls_.append(torch.cat([torch.randn(H, r0, generator=g, dtype=torch.float64), lse,
                                  torch.randn(H, pad, generator=g, dtype=torch.float64)], 1))
        groups.append((torch.stack(os_).float(), torch.stack(ls_).float(), r0))
    o_ref, lse_ref = _piece(q, torch.cat(keys, 1), torch.cat(vals, 1))
    out = torch.full((L, H, Dv), float("nan"))
    lse = torch.full((L, H), float("nan"))
    attn_merge(out, lse, groups)
    torch.testing.assert_close(out, o_ref.transpose(0, 1).float(), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(lse, lse_ref.transpose(0, 1).float(), rtol=2e-6, atol=2e-5)


def test_merge_refuses_what_it_cannot_read():
    o, lse = torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10)
    with pytest.raises(ValueError, match="no groups"):
        attn_merge(torch.zeros(4, 2, 8), torch.zeros(4, 2), [])
    with pytest.raises(ValueError, match="does not hold 4 rows"):
        attn_merge(torch.zeros(4, 2, 8), torch.zeros(4, 2), [(o, lse, 7)])
    with pytest.raises(ValueError, match="lse fp32"):
        attn_merge(torch.zeros(4, 2, 8), torch.zeros(4, 2, dtype=torch.float64), [(o, lse, 0)])
