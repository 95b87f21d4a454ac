"""HARTS as TRL 1.16's GRPO log-prob backend (``harts.integrations.trl``) equals TRL's own implementation.

TRL's ``GRPOTrainer._get_per_token_logps_and_entropies`` calls the model's padded forward (here the
``HartsForCausalLM`` wrapper: every row alone through the model's packed path) and scores the completion columns
with TRL's fused LM-head kernel. That kernel accumulates in float32 whatever the model dtype, so for the float64
comparison the reference replaces only it (``trl.trainer.utils._ChunkedLogProbFunction``) by its exact float64
equivalent over full logits; the unpatched kernel is checked at float32 level. Everything else of the reference is
TRL's code: the labels of the last ``logits_to_keep`` columns, the method's slicing, ``_compute_loss`` and, in the
end-to-end test, a whole ``train()`` step (generation, rewards, advantages, loss, backward).

Compared: the overridden method against TRL's original method on the same trainer, model and inputs (G = 4 and 8
completions per prompt, left-padded prompts of two lengths, duplicate completions, both families, float64 on the
reference ops): log-probs, entropies, TRL's loss on both outputs and every parameter gradient <= 1e-10 relative.
"""
import copy
import tempfile
import types

import numpy as np
import pytest
import torch

import harts

trl = pytest.importorskip("trl", minversion="1.16.0",
                          reason="TRL is optional: pip install 'harts[trl]' (the README's test command installs it)")

from harts.integrations import trl as htrl  # noqa: E402

REL = 1e-10
V = 512


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # "t<i>" <-> id i; the special tokens' words are no substring of a "t<i>" (transformers matches them anywhere)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"t{i}": i for i in range(4, V)}}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="</s>", bos_token="<s>",
                                   unk_token="<unk>")


def make(family: str, seed: int = 0):
    torch.manual_seed(seed)
    if family == "ling":
        from harts.models.ling import LingConfig, LingForCausalLM

        return LingForCausalLM(LingConfig.preset("ling3-tiny-debug", backend="reference")).double()
    from harts.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

    return Qwen35ForCausalLM(Qwen35Config.preset("qwen3.5-debug", backend="reference")).init_weights(seed).double()


def config(G: int, **kw):
    return trl.GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=G, num_generations=G,
                          max_completion_length=4, use_cpu=True, report_to=[], bf16=False, fp16=False,
                          gradient_checkpointing=False, max_steps=1, save_strategy="no", logging_steps=1,
                          optim="sgd", learning_rate=1e-3, **kw)


def dataset(n: int):
    import datasets

    return datasets.Dataset.from_dict({"prompt": [" ".join(f"t{i}" for i in range(10, 31))] * n})


def reward(completions, **kw):
    return [float(sum(int(t[1:]) for t in c.split()) % 7) for c in completions]


class _Float64LogProbs:
    """TRL's ``ChunkedLogProbFunction`` contract (log-probs and entropy of each position's label, in the inputs'
    dtype here) from full logits."""

    @staticmethod
    def apply(hidden, weight, bias, labels, temperature, chunk_size, softcap, logit_scale, outputs):
        z = hidden @ weight.t()
        if bias is not None:
            z = z + bias
        z = z * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        logp = torch.log_softmax(z / temperature, -1)
        lp = logp.gather(1, labels[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(-1) if "entropy" in outputs else None
        return lp, ent, None, None, None


@pytest.fixture()
def float64_trl(monkeypatch):
    import trl.trainer.utils as tu

    monkeypatch.setattr(tu, "_ChunkedLogProbFunction", _Float64LogProbs)


def groups(G: int, rng):
    """(input_ids, attention_mask, logits_to_keep) in TRL's layout: two prompts of different lengths (left padded)
    with G completions each (right padded, different lengths, a duplicate, two sharing their first tokens), and a
    next turn of the first conversation: its prompt is the first prompt, its first completion and a new user
    message, so its G completions share more than their own prompt with the first group's rows."""
    rows = []
    prompts = [rng.integers(4, V, 23).tolist(), rng.integers(4, V, 17).tolist()]
    for g in range(3):
        if g == 2:  # the next turn: history + the first group's first completion + a user message
            prompts.append(rows[0][0] + rows[0][1] + rng.integers(4, V, 5).tolist())
        prompt = prompts[g]
        comps = [rng.integers(4, V, int(rng.integers(1, 9))).tolist() for _ in range(G)]
        comps[-1] = list(comps[0])  # a duplicate
        comps[1] = comps[0][:3] + rng.integers(4, V, 4).tolist()  # the same first tokens, then its own
        rows += [(prompt, c) for c in comps]
    P, C = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    ids = torch.zeros(len(rows), P + C, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, (p, c) in enumerate(rows):
        ids[i, P - len(p):P] = torch.tensor(p)
        ids[i, P:P + len(c)] = torch.tensor(c)
        am[i, P - len(p):P + len(c)] = 1
    return ids, am, C


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def trainer(family, tokenizer, G, **kw):
    return htrl.GRPOTrainer(make(family), reward_funcs=reward, args=config(G, **kw), train_dataset=dataset(G),
                            processing_class=tokenizer)


@pytest.mark.parametrize("family,G", [("ling", 4), ("ling", 8), ("qwen35", 4), ("qwen35", 8)])
def test_method_and_loss_equal_trl(family, G, tokenizer, float64_trl):
    tr = trainer(family, tokenizer, G)
    model = tr.model
    assert isinstance(tr.model.harts, torch.nn.Module) and tr.model.harts.lm_head.weight.dtype == torch.float64
    ids, am, K = groups(G, np.random.default_rng(G))
    base = types.MethodType(trl.GRPOTrainer._get_per_token_logps_and_entropies, tr)
    with torch.no_grad():
        lp_t, ent_t, _ = base(model, ids, am, K, compute_entropy=True)
        lp_h, ent_h, _ = tr._get_per_token_logps_and_entropies(model, ids, am, K, compute_entropy=True)
        lp_b, _, _ = tr._get_per_token_logps_and_entropies(model, ids, am, K, batch_size=3)  # rows 3 at a time
    assert lp_h.shape == lp_t.shape == (ids.shape[0], K)
    assert rel(lp_h, lp_t) <= REL and rel(ent_h, ent_t) <= REL and rel(lp_b, lp_t) <= REL
    assert (lp_h[am[:, -K:] == 0] == 0).all()
    assert len(tr.harts_router_stats) == len(tr.model.harts.moe_layers())
    # the rows really share: one compact row per distinct token prefix of the rows (brute force)
    toks = [ids[i][am[i].bool()].tolist() for i in range(ids.shape[0])]
    prefixes = {tuple(t[:j]) for t in toks for j in range(1, len(t) + 1)}
    batch, _ = harts.pack_padded(ids, am, completion_mask=am * (torch.arange(ids.shape[1]) >= ids.shape[1] - K),
                                 config=tr.model.harts)
    assert batch.num_rows == len(prefixes) < sum(map(len, toks))

    # TRL's loss on both: a GRPO batch with advantages and an older policy's log-probs (clipping active)
    tr.current_gradient_accumulation_steps = 1  # (train() sets it)
    g = torch.Generator().manual_seed(1)
    inputs = {"prompt_ids": ids[:, :-K], "prompt_mask": am[:, :-K], "completion_ids": ids[:, -K:],
              "completion_mask": am[:, -K:], "advantages": torch.randn(ids.shape[0], generator=g, dtype=torch.float64),
              "old_per_token_logps": lp_t + 0.3 * torch.randn(lp_t.shape, generator=g, dtype=torch.float64),
              "num_items_in_batch": am[:, -K:].sum()}

    def loss_and_grads(method=None):
        model.zero_grad(set_to_none=True)
        if method is not None:
            tr._get_per_token_logps_and_entropies = method
        try:
            loss = tr._compute_loss(model, inputs)
        finally:
            tr.__dict__.pop("_get_per_token_logps_and_entropies", None)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_t, g_t = loss_and_grads(base)
    loss_h, g_h = loss_and_grads()
    assert rel(loss_h, loss_t) <= REL
    assert g_h.keys() == g_t.keys() and len(g_t) > 10
    for n in g_t:
        assert rel(g_h[n], g_t[n]) <= REL, n


def test_trl_float32_kernel_agrees(tokenizer):
    """TRL's own fused kernel, unpatched: float32-level agreement."""
    tr = trainer("ling", tokenizer, 4)
    ids, am, K = groups(4, np.random.default_rng(0))
    with torch.no_grad():
        lp_t, ent_t, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(tr, tr.model, ids, am, K,
                                                                           compute_entropy=True)
        lp_h, ent_h, _ = tr._get_per_token_logps_and_entropies(tr.model, ids, am, K, compute_entropy=True)
    assert rel(lp_h, lp_t.double()) <= 1e-5 and rel(ent_h, ent_t.double()) <= 1e-5


def test_train_step_equals_trl(tokenizer, float64_trl):
    """One whole ``train()`` step (generation, rewards, advantages, loss, backward, optimizer step) of TRL's trainer
    on the wrapped model and of the HARTS trainer on an identical model: same completions, loss and gradients."""
    seen = {}

    def run(cls, model, key):
        tr = cls(model, reward_funcs=reward, args=config(4, temperature=0.7), train_dataset=dataset(4),
                 processing_class=tokenizer)
        inner = tr._compute_loss

        def record(m, inputs):
            loss = inner(m, inputs)
            seen[key] = {"loss": loss.detach(), "completions": inputs["completion_ids"].clone()}
            return loss

        class Grads(__import__("transformers").TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kw):
                seen[key]["grads"] = {n: p.grad.clone() for n, p in tr.model.named_parameters() if p.grad is not None}

        tr._compute_loss = record
        tr.add_callback(Grads())
        tr.train()
        return tr

    ours = make("ling")
    theirs = copy.deepcopy(ours)
    tr_t = run(trl.GRPOTrainer, htrl.as_hf_model(theirs, eos_token_id=2, pad_token_id=0), "trl")
    tr_h = run(htrl.GRPOTrainer, ours, "harts")
    assert tr_h.model.harts is ours  # TRL trained the HARTS model itself
    t, h = seen["trl"], seen["harts"]
    assert torch.equal(t["completions"], h["completions"])
    assert rel(h["loss"], t["loss"]) <= REL
    assert t["grads"].keys() == h["grads"].keys() and len(t["grads"]) > 10
    for n in t["grads"]:
        assert rel(h["grads"][n], t["grads"][n]) <= REL, n
    for (n, p), q in zip(tr_h.model.named_parameters(), tr_t.model.parameters()):
        assert rel(p.detach(), q.detach()) <= REL, n


def test_reference_model_with_beta(tokenizer, float64_trl):
    """beta != 0: the reference model is a frozen copy of the HARTS model, scored through HARTS like the policy."""
    tr = trainer("qwen35", tokenizer, 4, beta=0.04)
    ref = tr.ref_model
    assert ref.harts is not tr.model.harts and not any(p.requires_grad for p in ref.parameters())
    for p, q in zip(ref.parameters(), tr.model.parameters()):
        assert p.data_ptr() != q.data_ptr() and torch.equal(p, q)
    ids, am, K = groups(4, np.random.default_rng(5))
    with torch.no_grad():
        lp_h, _, _ = tr._get_per_token_logps_and_entropies(ref, ids, am, K)
        lp_t, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(tr, tr.model, ids, am, K)
    assert rel(lp_h, lp_t) <= REL


def test_forward_logits_to_keep():
    """``HartsForCausalLM.forward(..., logits_to_keep=k)`` gives exactly the last k positions of the full logits (as
    transformers' causal LMs do; 0 or None: all), and its loss is the full loss over those positions' predictions."""
    hf = htrl.as_hf_model(make("ling"), eos_token_id=2, pad_token_id=0)
    ids, am, _ = groups(4, np.random.default_rng(3))
    labels = ids.masked_fill(am == 0, -100)
    L = ids.shape[1]
    with torch.no_grad():
        full = hf(input_ids=ids, attention_mask=am).logits
        for k in (1, 5, L - 1, L):
            out = hf(input_ids=ids, attention_mask=am, logits_to_keep=k, labels=labels)
            assert out.logits.shape == (ids.shape[0], k, V) and torch.equal(out.logits, full[:, -k:]), k
            if k > 1:
                z = full[:, L - k:-1].reshape(-1, V)
                ref = torch.nn.functional.cross_entropy(z, labels[:, L - k + 1:].reshape(-1), ignore_index=-100)
                assert torch.equal(out.loss, ref), k
        assert torch.equal(hf(input_ids=ids, attention_mask=am, logits_to_keep=0).logits, full)
    with pytest.raises(ValueError, match="logits_to_keep"):
        hf(input_ids=ids, attention_mask=am, logits_to_keep=-1)


def test_gradient_checkpointing_switches_the_harts_policy():
    """transformers' switches (the Trainer's ``gradient_checkpointing=True`` calls the first) set the HARTS model's
    policy from outside: full on, none off; every_n_layers other than 1 is refused."""
    hf = htrl.as_hf_model(make("qwen35"), eos_token_id=2, pad_token_id=0)
    stack = hf.harts.model
    assert stack.checkpoint_policy == "none" and not hf.is_gradient_checkpointing
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert stack.checkpoint_policy == "full" and hf.is_gradient_checkpointing
    hf.gradient_checkpointing_disable()
    assert stack.checkpoint_policy == "none" and not hf.is_gradient_checkpointing
    with pytest.raises(ValueError, match="every_n_layers=2"):
        hf._set_gradient_checkpointing(True, every_n_layers=2)


def test_misuse(tokenizer):
    with pytest.raises(TypeError, match="processing_class"):
        htrl.GRPOTrainer(make("ling"), reward_funcs=reward, args=config(4), train_dataset=dataset(4))
    with pytest.raises(TypeError, match="not a HARTS model"):
        htrl._harts_module(torch.nn.Linear(2, 2))
    tr = trainer("ling", tokenizer, 4)
    ids, am, K = groups(4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="multimodal inputs \\(pixel_values\\)"):
        tr._get_per_token_logps_and_entropies(tr.model, ids, am, K, pixel_values=torch.zeros(1))


def test_imports_without_trl():
    """harts and harts.integrations.trl import without trl; the trainer then names the install."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['trl'] = None\n"
            "import harts, harts.runtime, harts.integrations.trl as t\n"
            "try:\n    t.GRPOTrainer\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install 'harts[trl]'" in out
