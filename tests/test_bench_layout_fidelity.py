"""benchmarks.layout_fidelity's merge and metrics against direct computations (the end-to-end check
against a one-process run is in tests/test_train_distributed.py)."""
import pytest
import torch

from benchmarks import layout_fidelity as lf


def _dump(path, keys, hidden, targets, weight=None, harts=True):
    torch.save({"keys": keys, "hidden": hidden, "targets": targets, "harts": harts, "rank": 0, "stride": 1}, path)
    if weight is not None:
        torch.save(weight, str(path).rsplit(".rank", 1)[0] + ".lm_head.pt")


def test_metrics_match_direct_formulas():
    g = torch.Generator().manual_seed(0)
    S, D, V = 7, 5, 11
    ha, hb = torch.randn(S, D, generator=g, dtype=torch.float64), torch.randn(S, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    t = torch.randint(0, V, (S,), generator=g)
    s = lf.position_metrics(ha, w, hb, w, t, chunk=3, device="cpu")
    za, zb = ha @ w.T, hb @ w.T
    cos = (za * zb).sum(1) / za.norm(dim=1) / zb.norm(dim=1)
    pa, pb = za.softmax(1), zb.softmax(1)
    kl = 0.5 * ((pa * (pa.log() - pb.log())).sum(1) + (pb * (pb.log() - pa.log())).sum(1))
    dnll = (pa.log()[range(S), t] - pb.log()[range(S), t]).abs()
    assert s["cos"] == pytest.approx(float(cos.sum()), rel=1e-12)
    assert s["cos_min"] == pytest.approx(float(cos.min()), rel=1e-12)
    assert s["symkl"] == pytest.approx(float(kl.sum()), rel=1e-10)
    assert s["dnll"] == pytest.approx(float(dnll.sum()), rel=1e-10)


def test_merge_dedupes_agreeing_ranks_and_names_disagreeing_ones(tmp_path):
    keys = torch.tensor([[1, 0], [0, 2], [0, 1]])
    h = torch.arange(6, dtype=torch.float64).view(3, 2)
    t = torch.tensor([4, 5, 6])
    _dump(tmp_path / "r.rank0.pt", keys, h, t, weight=torch.ones(8, 2, dtype=torch.float64))
    _dump(tmp_path / "r.rank1.pt", keys[:2], h[:2], t[:2])  # a TP replica of two positions
    run = lf.load_run(str(tmp_path / "r"))
    assert run["keys"].tolist() == [[0, 1], [0, 2], [1, 0]] and run["hidden"][:, 0].tolist() == [4, 2, 0]
    _dump(tmp_path / "r.rank1.pt", keys[:2], h[:2] + 1, t[:2])
    with pytest.raises(ValueError, match="ranks disagree on trajectory 0 position 2"):
        lf.load_run(str(tmp_path / "r"))
    with pytest.raises(FileNotFoundError, match="debug.dump_hidden"):
        lf.load_run(str(tmp_path / "nothing"))
