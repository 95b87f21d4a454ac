"""Packed varlen attention with bottom-right causal masking (MLA's sequence-mixing core).

Query row i of sequence n (length Lq_n) sees key j of the same sequence (length Lk_n) iff
j <= i + Lk_n - Lq_n: queries are the *last* Lq_n tokens of the key sequence. With Lq == Lk this is the
usual causal mask; with Lq < Lk it lets a later runtime attend new tokens to a cached prefix. k and v may
have fewer heads than q (grouped-query attention, ``repeat_heads`` says which query heads each one serves).

``harts.ops.attention.tree``: the same attention over a whole rollout tree's compact rows (every row sees its
trie ancestors and itself), as per-sequence views on the packed varlen call (the exact reference) or as one
block-sparse FlexAttention call that reads the shared keys and values in place (the fast path).
"""
from harts.ops.attention.api import repeat_heads, varlen_attention
from harts.ops.attention.reference import varlen_attention_reference
from harts.ops.attention.tree import TreeMask, tree_attention_flex, tree_attention_views, tree_mask

__all__ = ["repeat_heads", "varlen_attention", "varlen_attention_reference", "TreeMask", "tree_attention_flex",
           "tree_attention_views", "tree_mask"]
