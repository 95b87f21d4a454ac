"""RL objectives: GRPO advantages against a brute-force per-group computation, PPO-clip / k3-KL against
their formulas, and the property the trainer relies on: with step-global coefficients the step's
gradient is the same for every split of the step into microbatches (and equals the full-batch one)."""
import statistics

import numpy as np
import pytest
import torch

from harts.data import Trajectory
from harts.rl import LossConfig, grpo_advantages, microbatch_coefficients, step_normalizer, token_losses
from harts.rl.advantages import with_grpo_advantages
from harts.runtime import pack


def test_grpo_advantages_match_brute_force():
    rng = np.random.default_rng(0)
    groups = rng.integers(0, 5, 40)
    rewards = rng.random(40).round(1)
    adv = grpo_advantages(rewards, groups)
    adv0 = grpo_advantages(rewards, groups, std_normalize=False)
    for i in range(40):
        members = [float(rewards[j]) for j in range(40) if groups[j] == groups[i]]
        if len(members) < 2:
            assert adv[i] == 0 and adv0[i] == 0
            continue
        mean = statistics.fmean(members)
        assert adv0[i] == pytest.approx(rewards[i] - mean, abs=1e-12)
        assert adv[i] == pytest.approx((rewards[i] - mean) / (statistics.stdev(members) + 1e-6), abs=1e-9)


def test_grpo_singleton_and_constant_groups_and_errors():
    assert grpo_advantages([1.0, 0.3, 0.3], [7, 8, 8]).tolist() == [0.0, 0.0, 0.0]
    t = [Trajectory.create([1, 2], reward=1.0, group_id=0), Trajectory.create([1, 3], reward=0.0, group_id=0)]
    a = with_grpo_advantages(t)
    assert a[0].advantage > 0 > a[1].advantage and t[0].advantage is None  # copies; input untouched
    with pytest.raises(ValueError, match="trajectory 1: GRPO needs a 'reward'"):
        with_grpo_advantages([t[0], Trajectory.create([1], group_id=0)])
    with pytest.raises(ValueError, match="trajectory 0: GRPO needs a 'group_id'"):
        with_grpo_advantages([Trajectory.create([1], reward=1.0)])
    with pytest.raises(ValueError, match="trajectory 0: reward nan"):
        grpo_advantages([float("nan")], [0])


def test_ppo_clip_and_kl_formulas():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(64, generator=g, dtype=torch.float64) - 3).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(64, generator=g, dtype=torch.float64)
    ref = lp.detach() + 0.2 * torch.randn(64, generator=g, dtype=torch.float64)
    adv = torch.randn(64, generator=g, dtype=torch.float64)
    cfg = LossConfig(objective="ppo", clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.05)
    loss, pg, kl, clipped = token_losses(lp, adv, cfg, old_logp_S=old, ref_logp_S=ref)
    for s in range(64):  # scalar re-derivation of each position
        r = float(np.exp(lp[s].item() - old[s].item()))
        a = adv[s].item()
        want_pg = -min(r * a, min(max(r, 0.8), 1.28) * a)
        d = ref[s].item() - lp[s].item()
        want_kl = np.exp(d) - d - 1
        assert pg[s].item() == pytest.approx(want_pg, rel=1e-12, abs=1e-14)
        assert kl[s].item() == pytest.approx(want_kl, rel=1e-10, abs=1e-14) and kl[s].item() >= 0
        assert loss[s].item() == pytest.approx(want_pg + 0.05 * want_kl, rel=1e-12, abs=1e-14)
        assert clipped[s].item() == float(min(max(r, 0.8), 1.28) * a < r * a)
    assert 0 < clipped.sum() < 64
    # at ratio 1 (old = current) PPO's gradient is the policy gradient -A dlogp
    lp2 = lp.detach().clone().requires_grad_()
    token_losses(lp2, adv, LossConfig(objective="ppo"), old_logp_S=lp2.detach())[0].sum().backward()
    assert torch.allclose(lp2.grad, -adv, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="old log-probs"):
        token_losses(lp, adv, LossConfig(objective="ppo"))
    with pytest.raises(ValueError, match="reference log-probs"):
        token_losses(lp, adv, LossConfig(kl_coef=0.1))


def _step(rng, n=14, vocab=32):
    trajs = []
    for i in range(n):
        L = int(rng.integers(2, 12))
        trajs.append(Trajectory.create(rng.integers(0, vocab, L).tolist(), group_id=int(i % 4),
                                       reward=float(rng.random()), loss_mask=(rng.random(L) < 0.6).astype(float),
                                       loss_weights=rng.random(L) + 0.5))
    trajs[3] = Trajectory.create([5, 6, 7], group_id=1, reward=0.1, loss_mask=[1, 0, 0],
                                 loss_weights=[1.0, 1.0, 1.0])  # no loss token
    return with_grpo_advantages(trajs)


@pytest.mark.parametrize("mode", ["token", "sequence"])
def test_step_gradient_is_independent_of_the_split(mode):
    """A bigram-table policy (any differentiable logp works): the step loss summed over microbatches with
    step-global coefficients has the same value and gradient for every partition; a per-microbatch mean
    does not (so the test can fail)."""
    rng = np.random.default_rng(1)
    trajs = _step(rng)
    norm = step_normalizer(trajs)
    theta = torch.randn(32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cfg = LossConfig(normalization=mode)

    def step_loss(partition, per_mb_mean=False):
        th = theta.clone().requires_grad_()
        total = 0.0
        for mb in partition:
            sub = [trajs[i] for i in mb]
            b = pack(sub, chunk_size=4, prefix_sharing=False)
            lp = torch.log_softmax(th, -1)[b.input_ids[b.logprob_rows], b.logprob_targets]
            loss, *_ = token_losses(lp, b.semantic("advantages"), cfg)
            c = torch.from_numpy(microbatch_coefficients(sub, norm, mode))
            if per_mb_mean:
                w = b.semantic("loss_mask") * b.semantic("loss_weights")
                total = total + (w * loss).sum() / w.sum().clamp_min(1)
            else:
                total = total + (c * loss).sum()
        total.backward()
        return total.item(), th.grad

    full_v, full_g = step_loss([list(range(len(trajs)))])
    for seed in range(4):
        perm = np.random.default_rng(seed).permutation(len(trajs))
        cuts = sorted(np.random.default_rng(seed + 10).choice(np.arange(1, len(trajs)), 3, replace=False))
        part = [p.tolist() for p in np.split(perm, cuts)]
        v, g = step_loss(part)
        assert v == pytest.approx(full_v, rel=1e-12)
        assert torch.allclose(g, full_g, rtol=0, atol=1e-14 * full_g.abs().max().item())
    v_bad, _ = step_loss(part, per_mb_mean=True)
    assert abs(v_bad - step_loss([list(range(len(trajs)))], per_mb_mean=True)[0]) > 1e-6


def test_coefficients_align_with_compact_batch_positions():
    rng = np.random.default_rng(3)
    trajs = _step(rng)
    norm = step_normalizer(trajs)
    assert norm.loss_weight == pytest.approx(sum(float((t.loss_mask[1:] * t.loss_weights[1:]).sum()) for t in trajs))
    with_loss = [i for i, t in enumerate(trajs) if (t.loss_mask[1:] * t.loss_weights[1:]).sum() > 0]
    assert 3 not in with_loss and norm.trajectories == len(with_loss)
    assert norm.raw_tokens == sum(len(t) for t in trajs)
    b = pack(list(trajs), chunk_size=4)  # HARTS layout: semantic order is still original order
    c = torch.from_numpy(microbatch_coefficients(trajs, norm, "token"))
    want = b.semantic("loss_mask") * b.semantic("loss_weights") / norm.loss_weight
    assert torch.equal(c, want)
    cs = microbatch_coefficients(trajs, norm, "sequence")
    per_traj = [x.sum().item() for x in b.split(torch.from_numpy(cs))]
    assert sum(per_traj) == pytest.approx(1.0) and per_traj[3] == 0
    with pytest.raises(ValueError, match="no loss tokens"):
        step_normalizer([Trajectory.create([1, 2], loss_mask=[1, 0])])
