"""Several token rows as one packed sequence with their common prefixes computed once.

The rows of a training micro-batch often begin alike: every SFT row with the same system prompt
and game instruction, every PPO episode of a group with the same first prompt, every turn row of
a trajectory with the rows of its earlier turns. `pack` lays them out as a prefix tree: a node is
a run of tokens shared by every row that passes through it, its parent holds the tokens before
them, the prefix common to all rows is the root (a forest where rows share no first token). Nodes
are laid out depth first, so a node's ancestors come before it in the sequence. Each token keeps
the position id it has in its own row (ancestors' positions continue), and attends to exactly
its row's earlier tokens: its own node's earlier tokens and every token of the node's ancestors.
A model fed the packed sequence with that attention gives every row the outputs (and, by the
chain rule, the gradients) of the row alone, and computes each shared token once.

`tree_attention` computes that attention node by node with SDPA: a root causally over itself; any
other node's queries over [ancestors..., node], seeing the ancestors in full and the node causally.
SDPA computes every block of a mask it is given, so a node's queries go in blocks of
`TreeLayout.query_block`, each over the keys up to its own last query: the key blocks past the
diagonal, empty under the causal mask, are never computed (the cost of the tree's attention is
then within one block's width of the causal half it needs, as for unpacked rows). On CUDA, where many small nodes would mean many small kernels, it
is one compiled FlexAttention call with a block mask built from the tree (`TreeLayout.mask_mod`:
the key's node is an ancestor-or-self of the query's node, and the key does not come after the
query), which skips the blocks the mask empties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

#: Queries per SDPA call of a node with ancestors (`TreeLayout.query_block`): on a CPU a call of
#: 256 queries is still a large matmul, and the masked keys it computes are half a block per query.
QUERY_BLOCK = 256


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two id sequences share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, step = 0, 256
    while lo + step <= n and a[lo:lo + step] == b[lo:lo + step]:  # whole blocks first: list slices are fast
        lo += step
    while a[lo] == b[lo]:
        lo += 1
    return lo


def packed_length(rows: Sequence[Sequence[int]]) -> int:
    """The tokens `pack(rows)` computes: each row's length less what it shares with the row before
    it in sorted order (a sorted list's adjacent common prefixes are exactly a prefix tree's edges)."""
    ordered = sorted(map(list, rows))
    return sum(len(row) - common_prefix_len(prev, row) for prev, row in zip([[]] + ordered, ordered))


@dataclass
class PackedRows:
    """`pack`'s result: the packed token ids and position ids, the tree's nodes as ``(start, end,
    parent)`` (half-open ranges of the packed sequence; parent -1 for a root), and per input row,
    in input order, the packed index of each of its tokens (``where[r][t]``: token t of row r)."""

    ids: list[int]
    positions: list[int]
    nodes: list[tuple[int, int, int]]
    where: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)


def pack(rows: Sequence[Sequence[int]]) -> PackedRows:
    """Rows (non-empty token lists) as one prefix-tree-packed sequence (see the module docstring).
    The rows are ordered by their tokens, so the layout does not depend on their input order;
    identical rows share every token."""
    rows = [list(row) for row in rows]
    order = sorted(range(len(rows)), key=lambda r: (rows[r], r))
    out = PackedRows([], [], [], [[] for _ in rows])
    _place(rows, order, 0, -1, out)
    return out


def _place(rows: list[list[int]], members: list[int], depth: int, parent: int, out: PackedRows) -> None:
    """Lay out the subtree of `members` (row indices, sorted by tokens, sharing their first `depth`
    tokens, which lie in `parent` and its ancestors)."""
    first, last = rows[members[0]], rows[members[-1]]
    end = depth + common_prefix_len(first[depth:], last[depth:])  # sorted: the first and last bound the rest
    node = parent
    if end > depth:
        node, start = len(out.nodes), len(out.ids)
        out.nodes.append((start, start + end - depth, parent))
        out.ids.extend(first[depth:end])
        out.positions.extend(range(depth, end))
        ancestry = out.where[members[0]][:depth] if depth else []
        for r in members:
            out.where[r] = ancestry + list(range(start, start + end - depth))
    branch: list[int] = []
    for r in (r for r in members if len(rows[r]) > end):  # rows ending here are complete
        if branch and rows[r][end] != rows[branch[0]][end]:
            _place(rows, branch, end, node, out)
            branch = []
        branch.append(r)
    if branch:
        _place(rows, branch, end, node, out)


class TreeLayout:
    """The attention structure of one packed sequence, on `device`, built once per micro-batch and
    read by every layer: per node its size, its ancestors (root first) and its causal offset mask;
    for FlexAttention the node of each token and which nodes are ancestors-or-self of which.
    `query_block`: how many of a node's queries go in one SDPA call (see the module docstring;
    smaller blocks skip more of the masked keys, at one call each)."""

    def __init__(self, nodes: Sequence[tuple[int, int, int]], device="cpu", query_block: int = QUERY_BLOCK):
        import torch

        self.nodes = list(nodes)
        if [start for start, _, _ in self.nodes] != [0, *(end for _, end, _ in self.nodes)][:-1]:
            raise ValueError("a TreeLayout's nodes must tile the sequence in order (as `pack` lays them out)")
        self.query_block = query_block
        self.length = self.nodes[-1][1] if self.nodes else 0
        self.sizes = [end - start for start, end, _ in self.nodes]
        self.ancestors: list[list[int]] = []
        self.masks: list = []
        for start, end, parent in self.nodes:
            chain = self.chain(parent)
            self.ancestors.append(chain)
            context, own = sum(self.sizes[a] for a in chain), end - start
            self.masks.append(torch.ones(own, context + own, dtype=torch.bool, device=device)
                              .tril(diagonal=context) if chain else None)
        self.device = device
        self._block_mask = None

    def chain(self, node: int) -> list[int]:
        """`node` and its ancestors, root first (none for -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.nodes[node][2]
        return out[::-1]

    def dense_mask(self):
        """``[T, T]`` bool, True where the query (row) may attend to the key (column)."""
        import torch

        mask = torch.zeros(self.length, self.length, dtype=torch.bool)
        for node, (start, end, _) in enumerate(self.nodes):
            for ancestor in self.ancestors[node]:
                a, b, _ = self.nodes[ancestor]
                mask[start:end, a:b] = True
            mask[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        return mask.to(self.device)

    def mask_mod(self):
        """FlexAttention's ``mask_mod(batch, head, q, kv)`` of the tree."""
        import torch

        node_of = torch.empty(self.length, dtype=torch.long)
        related = torch.zeros(len(self.nodes), len(self.nodes), dtype=torch.bool)
        for node, (start, end, parent) in enumerate(self.nodes):
            node_of[start:end] = node
            ancestor = node
            while ancestor >= 0:
                related[node, ancestor] = True
                ancestor = self.nodes[ancestor][2]
        node_of, related = node_of.to(self.device), related.to(self.device)

        def mask_mod(batch, head, q, kv):
            return related[node_of[q], node_of[kv]] & (kv <= q)

        return mask_mod

    def block_mask(self):
        """The FlexAttention block mask of the tree (built on the first call)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            self._block_mask = create_block_mask(self.mask_mod(), 1, None, self.length, self.length,
                                                 device=self.device)
        return self._block_mask


def tree_attention(query, key, value, layout: TreeLayout, scaling=None, dropout: float = 0.0,
                   flex: bool | None = None):
    """Attention of one packed sequence (``query`` ``[1, heads, T, dim]``, ``key``/``value``
    ``[1, kv_heads, T, dim]``) under `layout`; returns ``([1, T, heads, dim], None)`` like
    transformers' attention functions. `flex` picks FlexAttention (default: on CUDA without
    dropout, which FlexAttention lacks), compiled on CUDA, eager elsewhere (tests)."""
    import torch
    import torch.nn.functional as F

    gqa = query.shape[1] != key.shape[1]
    if flex is None:
        flex = query.is_cuda and not dropout
    if flex:
        out = _flex(query.is_cuda)(query, key, value, block_mask=layout.block_mask(), scale=scaling,
                                   enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    # Node slices by `split` (and ancestors joined by `cat`), not by indexing: the backward of a
    # split is one concatenation, where every slice of the whole sequence would add a zero-filled
    # gradient of the whole sequence per node and query block.
    queries, keys, values = (x.split(layout.sizes, dim=2) for x in (query, key, value))
    blocks = []
    for node, (ancestors, mask) in enumerate(zip(layout.ancestors, layout.masks, strict=True)):
        q, k, v = queries[node], keys[node], values[node]
        if not ancestors:
            blocks.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                                         enable_gqa=gqa))
            continue
        k = torch.cat([keys[a] for a in ancestors] + [k], dim=2)
        v = torch.cat([values[a] for a in ancestors] + [v], dim=2)
        context = k.shape[2] - q.shape[2]
        for first, q_block in zip(range(0, q.shape[2], layout.query_block), q.split(layout.query_block, dim=2)):
            seen = context + first + q_block.shape[2]  # the keys up to the block's last query
            blocks.append(F.scaled_dot_product_attention(
                q_block, k[:, :, :seen], v[:, :, :seen], attn_mask=mask[first:first + q_block.shape[2], :seen],
                dropout_p=dropout, scale=scaling, enable_gqa=gqa))
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None


@cache
def _flex(compiled: bool):
    import torch
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if compiled else flex_attention


def placeholder_mask(length: int, device="cpu"):
    """A ``[1, 1, T, T]`` all-True view of one element, passed as the model's attention mask with a
    `TreeLayout`: transformers takes a 4D mask as given and builds none of its own (a dense one
    would be T x T), and `tree_attention` reads the layout, not the mask."""
    import torch

    return torch.ones((), dtype=torch.bool, device=device).expand(1, 1, length, length)
