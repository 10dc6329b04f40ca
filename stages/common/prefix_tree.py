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

A sliding-window layer (Mistral, Qwen2's upper layers, Gemma-3's local ones) adds one condition:
a query sees a key only if it is fewer than `window` positions back in their row; the row position
is the tree depth, so the packed rows still get each row's outputs. Each layer's attention call
says its own window (transformers passes ``sliding_window``), so the mask is per layer.

`tree_attention` computes that attention node by node with SDPA: a root causally over itself; any
other node's queries over [ancestors..., node], seeing the ancestors in full and the node causally
(a window cuts both). On a CPU without a window or dropout, that is
`stages.common.kernels.attention.context_then_causal_attention`: SDPA's kernel over the ancestors,
then causally over the node, merged, with no mask at all. Otherwise SDPA takes the node's mask;
it computes every block of a mask it is given, so a node's queries go in blocks of
`TreeLayout.query_block`, each over the keys from its first query's window to its own
last query: the key blocks past the diagonal, empty under the causal mask, are never computed (the
cost of the tree's attention is then within one block's width of the causal half it needs, as for
unpacked rows). On CUDA, where many small nodes would mean many small kernels, it is one compiled
FlexAttention call with a block mask (`TreeLayout.mask_mod`: the key's node is an ancestor-or-self
of the query's node, the key does not come after the query, and within the window), which skips
the tiles the mask empties. Its tile tables come from the node ranges (`TreeLayout.tile_counts`):
`create_block_mask` would evaluate the mask densely, a T x T mask and two T x T int64 index
tensors (4.8 GB at 16k tokens); the per-node SDPA masks are built only where SDPA runs.
`node_attention` computes one node the same way when its ancestors' keys come from their own
passes (`stages.training.tree_passes`, which runs one node a pass: `NodePass`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache

#: FlexAttention's tile: the block mask says per tile of this many queries and keys whether its
#: scores are all masked (skipped), all kept, or mixed (`mask_mod` evaluated in the kernel).
FLEX_BLOCK = 128
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
    read by every layer: per node its size, its ancestors (root first) and its depth (the row
    position of its first token); per attention window, built on first use and kept for the other
    layers, the nodes' causal offset masks (SDPA) or the block mask (FlexAttention).
    `query_block`: how many of a node's queries go in one SDPA call (see the module docstring;
    smaller blocks skip more of the masked keys, at one call each)."""

    def __init__(self, nodes: Sequence[tuple[int, int, int]], device="cpu", query_block: int = QUERY_BLOCK):
        self.nodes = list(nodes)
        if [start for start, _, _ in self.nodes] != [0, *(end for _, end, _ in self.nodes)][:-1]:
            raise ValueError("a TreeLayout's nodes must tile the sequence in order (as `pack` lays them out)")
        self.query_block = query_block
        self.length = self.nodes[-1][1] if self.nodes else 0
        self.sizes = [end - start for start, end, _ in self.nodes]
        self.ancestors = [self.chain(parent) for _, _, parent in self.nodes]
        self.depths = [sum(self.sizes[a] for a in chain) for chain in self.ancestors]
        self.device = device
        self._masks: dict = {}
        self._block_masks: dict = {}

    def chain(self, node: int) -> list[int]:
        """`node` and its ancestors, root first (none for -1)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.nodes[node][2]
        return out[::-1]

    def positions(self):
        """``[T]`` long: each token's position in its row (as `pack` gives them)."""
        import torch

        return torch.cat([torch.arange(depth, depth + size) for depth, size in zip(self.depths, self.sizes)]
                         or [torch.zeros(0, dtype=torch.long)])

    def dense_mask(self, window: int | None = None):
        """``[T, T]`` bool, True where the query (row) may attend to the key (column): the key is in
        the query's node or an ancestor, not after the query, and, with a `window`, fewer than
        `window` positions before it in their row."""
        import torch

        mask = torch.zeros(self.length, self.length, dtype=torch.bool)
        for node, (start, end, _) in enumerate(self.nodes):
            for ancestor in self.ancestors[node]:
                a, b, _ = self.nodes[ancestor]
                mask[start:end, a:b] = True
            mask[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        if window is not None:
            positions = self.positions()
            mask &= positions[:, None] - positions[None, :] < window
        return mask.to(self.device)

    def node_masks(self, window: int | None = None) -> list:
        """Per node, the mask of its queries over the keys of [ancestors..., node] (whose index
        there is their row position), or None where plain causal attention over the node alone is
        it (a root the window does not cut)."""
        if window not in self._masks:
            import torch

            masks = []
            for depth, size, ancestors in zip(self.depths, self.sizes, self.ancestors, strict=True):
                if not ancestors and (window is None or window >= size):
                    masks.append(None)
                    continue
                query = torch.arange(depth, depth + size, device=self.device)[:, None]
                key = torch.arange(depth + size, device=self.device)[None, :]
                masks.append((key <= query) & (query - key < window) if window is not None else key <= query)
            self._masks[window] = masks
        return self._masks[window]

    def mask_mod(self, window: int | None = None):
        """FlexAttention's ``mask_mod(batch, head, q, kv)`` of the tree (`dense_mask`'s rule)."""
        import torch

        node_of = torch.empty(self.length, dtype=torch.long)
        related = torch.zeros(len(self.nodes), len(self.nodes), dtype=torch.bool)
        for node, (start, end, parent) in enumerate(self.nodes):
            node_of[start:end] = node
            related[node, self.chain(node)] = True
        node_of, related = node_of.to(self.device), related.to(self.device)
        if window is None:
            def mask_mod(batch, head, q, kv):
                return related[node_of[q], node_of[kv]] & (kv <= q)
        else:
            positions = self.positions().to(self.device)

            def mask_mod(batch, head, q, kv):
                return related[node_of[q], node_of[kv]] & (kv <= q) & (positions[q] - positions[kv] < window)

        return mask_mod

    def block_mask(self, window: int | None = None, block: int = FLEX_BLOCK):
        """The FlexAttention block mask of the tree (`mask_mod`), its tables from `tile_counts`."""
        if (window, block) not in self._block_masks:
            from torch.nn.attention.flex_attention import BlockMask

            counts = self.tile_counts(window, block)
            full = counts == block * block  # a tile the sequence's end cuts is never full, as create_block_mask pads
            tables = [_ordered(table) for table in ((counts > 0) & ~full, full)]
            self._block_masks[window, block] = BlockMask.from_kv_blocks(
                *tables[0], *tables[1], BLOCK_SIZE=block, mask_mod=self.mask_mod(window),
                seq_lengths=(self.length, self.length))
        return self._block_masks[window, block]

    def tile_counts(self, window: int | None = None, block: int = FLEX_BLOCK):
        """``[tiles, tiles]`` long: how many (query, key) pairs of each `block` x `block` tile of
        `dense_mask(window)` are True, from the node ranges without building the mask. A query's
        keys are one interval per node of its chain (the window cuts its start), so each tile row
        adds its partial first and last key tiles and, by a difference table, the whole tiles
        between them: memory per query token and node of its chain, not per query and key."""
        import torch

        # every (node, node of its chain), then per query token of the first: its index and row position,
        # and the second's range and depth
        pairs = [(node, other) for node in range(len(self.nodes)) for other in self.chain(node)]
        if not pairs:
            return torch.zeros(0, 0, dtype=torch.long, device=self.device)
        node, other = (torch.tensor(column) for column in zip(*pairs, strict=True))
        starts, sizes, depths = (torch.tensor(x) for x in ([s for s, _, _ in self.nodes], self.sizes, self.depths))
        per_pair = sizes[node]
        pair = torch.repeat_interleave(torch.arange(len(pairs)), per_pair)
        offset = torch.arange(len(pair)) - torch.repeat_interleave(per_pair.cumsum(0) - per_pair, per_pair)
        query = starts[node[pair]] + offset
        position = depths[node[pair]] + offset
        key_start, key_depth, key_size = starts[other[pair]], depths[other[pair]], sizes[other[pair]]
        # the node's keys at row positions [oldest, position], as indices [first, end)
        oldest = position - window + 1 if window is not None else torch.zeros_like(position)
        first = key_start + (oldest - key_depth).clamp(min=0)
        end = key_start + (position + 1 - key_depth).clamp(max=key_size)
        nonempty = first < end
        query, first, end = query[nonempty], first[nonempty], end[nonempty]
        tiles = -(-self.length // block)
        row, first_tile, last_tile = query // block, first // block, (end - 1) // block
        counts = torch.zeros(tiles, tiles, dtype=torch.long)
        counts.index_put_((row, first_tile), torch.minimum(end, (first_tile + 1) * block) - first, accumulate=True)
        apart = last_tile > first_tile
        counts.index_put_((row[apart], last_tile[apart]), (end - last_tile * block)[apart], accumulate=True)
        between = torch.zeros_like(counts)  # +block from the tile after the first, -block from the last
        between.index_put_((row[apart], first_tile[apart] + 1), torch.tensor(block), accumulate=True)
        between.index_put_((row[apart], last_tile[apart]), torch.tensor(-block), accumulate=True)
        return (counts + between.cumsum(1)).to(self.device)


def _ordered(tiles):
    """A ``[tiles, tiles]`` bool table as FlexAttention's ``(num_blocks [1, 1, q_tiles], indices
    [1, 1, q_tiles, kv_tiles])``: per query tile how many key tiles it reads, and which first."""
    import torch

    tiles = tiles.to(torch.int32)
    order = torch.argsort(tiles, dim=-1, descending=True, stable=True)
    return tiles.sum(-1).to(torch.int32)[None, None].contiguous(), order.to(torch.int32)[None, None].contiguous()


def tree_attention(query, key, value, layout: TreeLayout, scaling=None, dropout: float = 0.0,
                   flex: bool | None = None, window: int | None = None):
    """Attention of one packed sequence (``query`` ``[1, heads, T, dim]``, ``key``/``value``
    ``[1, kv_heads, T, dim]``) under `layout`, a query seeing only the keys fewer than `window`
    positions before it in its row where a window is given (a sliding-window layer); returns
    ``([1, T, heads, dim], None)`` like transformers' attention functions. `flex` picks
    FlexAttention (default: on CUDA without dropout, which FlexAttention lacks), compiled on CUDA,
    eager elsewhere (tests)."""
    import torch
    import torch.nn.functional as F

    from stages.common.kernels.attention import context_then_causal_attention

    gqa = query.shape[1] != key.shape[1]
    if flex is None:
        flex = query.is_cuda and not dropout
    if flex:
        out = _flex(query.is_cuda)(query, key, value, block_mask=layout.block_mask(window), scale=scaling,
                                   enable_gqa=gqa)
        return out.transpose(1, 2).contiguous(), None
    # Node slices by `split` (and ancestors joined by `cat`), not by indexing: the backward of a
    # split is one concatenation, where every slice of the whole sequence would add a zero-filled
    # gradient of the whole sequence per node and query block.
    queries, keys, values = (x.split(layout.sizes, dim=2) for x in (query, key, value))
    merged = window is None and not dropout and query.device.type == "cpu"  # context_then_causal_attention: no masks
    masks = [None] * len(layout.sizes) if merged else layout.node_masks(window)
    blocks = []
    for node, (ancestors, mask) in enumerate(zip(layout.ancestors, masks, strict=True)):
        q, k, v = queries[node], keys[node], values[node]
        if not ancestors and mask is None:
            blocks.append(F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                                         enable_gqa=gqa))
            continue
        if merged:
            # A lone ancestor (a group's shared prompt) as it is: a joined copy would be kept for the backward.
            past_k, past_v = (parts[ancestors[0]] if len(ancestors) == 1
                              else torch.cat([parts[a] for a in ancestors], dim=2) for parts in (keys, values))
            blocks.append(context_then_causal_attention(q, k, v, past_k, past_v, scaling))
            continue
        if ancestors:
            k = torch.cat([keys[a] for a in ancestors] + [k], dim=2)
            v = torch.cat([values[a] for a in ancestors] + [v], dim=2)
        blocks.extend(_context_blocks(q, k, v, mask, layout.query_block, scaling, dropout, window))
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None


class NodePass:
    """One prefix-tree node's forward pass after its ancestors (`stages.training.tree_passes`), as
    its attention calls see it: per layer, the ancestors' keys and values to read (``context``, a
    list of ``(keys, values)`` ``[1, kv_heads, ancestors' tokens, dim]``, or None for a root), and
    the node's own, which each call leaves in ``own`` for the node's children. The model calls
    its layers' attention in layer order, one call a layer, so the n-th call is layer n's."""

    def __init__(self, context: list | None = None):
        self.context = context
        self.own: list[tuple] = []

    def exchange(self, key, value) -> tuple:
        """Record this layer's own keys and values; return its ancestors' (``(None, None)`` at a root)."""
        layer = len(self.own)
        self.own.append((key, value))
        return self.context[layer] if self.context else (None, None)


def node_attention(query, key, value, past_key=None, past_value=None, scaling=None, window: int | None = None):
    """Attention of one node's queries (``[1, heads, n, dim]``) over the keys of its row up to
    each of them: its ancestors' (``past_key``/``past_value`` ``[1, kv_heads, context, dim]``;
    None at a root), then its own (``key``/``value`` ``[1, kv_heads, n, dim]``), causally over its
    own, within `window` where given; as `tree_attention` computes a node with ancestors. Returns
    ``([1, n, heads, dim], None)``."""
    import torch
    import torch.nn.functional as F

    from stages.common.kernels.attention import context_then_causal_attention

    if past_key is None and window is None:  # a root: causal attention over itself
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    if past_key is not None and window is None and query.device.type == "cpu":
        out = context_then_causal_attention(query, key, value, past_key, past_value, scaling)
        return out.transpose(1, 2).contiguous(), None
    if past_key is not None:
        key, value = torch.cat([past_key, key], dim=2), torch.cat([past_value, value], dim=2)
    context = key.shape[2] - query.shape[2]
    queries = torch.arange(context, key.shape[2], device=query.device)[:, None]
    keys = torch.arange(key.shape[2], device=query.device)[None, :]
    mask = (keys <= queries) & (queries - keys < window) if window is not None else keys <= queries
    blocks = _context_blocks(query, key, value, mask, QUERY_BLOCK, scaling, 0.0, window)
    return torch.cat(blocks, dim=2).transpose(1, 2).contiguous(), None


def _context_blocks(q, k, v, mask, query_block: int, scaling, dropout: float, window: int | None) -> list:
    """A node's queries over [context..., node] (`mask`: ``[queries, keys]``) in blocks of
    `query_block` queries, each over the keys from its first query's window to its last query."""
    import torch.nn.functional as F

    context = k.shape[2] - q.shape[2]
    blocks = []
    for first, q_block in zip(range(0, q.shape[2], query_block), q.split(query_block, dim=2)):
        seen = context + first + q_block.shape[2]  # the keys up to the block's last query
        oldest = max(0, context + first - window + 1) if window is not None else 0  # the window's, for its first
        blocks.append(F.scaled_dot_product_attention(
            q_block, k[:, :, oldest:seen], v[:, :, oldest:seen],
            attn_mask=mask[first:first + q_block.shape[2], oldest:seen],
            dropout_p=dropout, scale=scaling, enable_gqa=q.shape[1] != k.shape[1]))
    return blocks


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
